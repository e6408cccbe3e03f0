"""Every code name the architecture and benchmark docs mention in backticks, and every script and
flag of their commands, exists in the repository: a path, a flag some script or CLI defines, a
module attribute or class method that is defined, a bare name that the sources spell."""

import os
import re
from functools import cache
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
DOCS = ("docs/architecture.md", "docs/benchmarks.md", "docs/models.md", "docs/usage.md")
PACKAGES = ("xserv_engine", "xserv_rest", "xserv_cli")
SOURCE_DIRS = (*PACKAGES, "benchmarks", "scripts", "protos", "tests")
CODE_FILES = (".py", ".cpp", ".sh", ".md", ".proto", ".toml", ".jinja", ".yaml", ".js", ".html", ".css")
IDENTIFIER = r"[A-Za-z_]\w*"


@cache
def sources() -> dict[Path, str]:
    return {path: path.read_text() for top in SOURCE_DIRS for path in (REPO / top).rglob("*")
            if path.suffix in (".py", ".cpp", ".sh", ".proto")}


@cache
def spelled() -> frozenset[str]:
    """Every word the sources spell: a bare name is spelled somewhere iff it is one of these."""
    return frozenset(word for text in sources().values() for word in re.findall(r"\w+", text))


@cache
def paths() -> list[str]:
    """Every file and folder of the repository (the virtual environment and .git aside)."""
    found = []
    for root, dirs, files in os.walk(REPO):
        dirs[:] = [d for d in dirs if d not in (".venv", ".git", "__pycache__", "node_modules")]
        found += [os.path.join(root, name) for name in dirs + files]
    return found


def names_in(doc: str) -> list[str]:
    """The words of backticked spans and of fenced shell blocks' lines."""
    text = (REPO / doc).read_text()
    words = []
    for block in re.findall(r"```(?:bash|sh)?\n(.*?)```", text, re.S):
        words += [w for w in block.split() if re.fullmatch(r"--[a-z][\w-]*|[\w.-]+/[\w./-]+\.\w+", w)]
    for span in re.findall(r"`([^`\n]+)`", re.sub(r"```.*?```", "", text, flags=re.S)):
        words += span.split()
    return [w.strip(",;:()") for w in words]


def problem(word: str) -> str | None:
    """Why `word` names nothing in the repository, or None (also for what is not a code name)."""
    if word.startswith(("../", "~", "/", "http")) or re.search(r"[<>{}\[\]=\"'*]", word):
        return None
    if word.startswith("--"):
        quoted = f'"{word}"'
        return None if any(quoted in text for text in sources().values()) else "no script or CLI defines the flag"
    if "/" in word or word.endswith(CODE_FILES):
        if word.endswith(CODE_FILES) or word.endswith("/"):
            found = (REPO / word).exists() or any(path.endswith("/" + word.rstrip("/")) for path in paths())
            return None if found else "no such file"
        return None
    if re.fullmatch(rf"{IDENTIFIER}(\.{IDENTIFIER})+", word):
        return _dotted(word.split("."))
    if re.fullmatch(IDENTIFIER, word) and ("_" in word or word[0].isupper()) and not word.isupper():
        return None if word in spelled() else "spelled nowhere"
    return None


def _dotted(parts: list[str]) -> str | None:
    """module.attr, package.module.attr or Class.attr: the last part defined where the rest
    points; names outside the repository (torch.argmax) are not checked."""
    for cut in range(len(parts) - 1, 0, -1):
        files = _modules(parts[:cut]) or _classes(parts[0]) if cut == 1 else _modules(parts[:cut])
        if files:
            defined = rf"(def|class)\s+{parts[-1]}\b|^\s*(self\.)?{parts[-1]}\s*[:=]|\b{parts[-1]}\s*="
            return None if any(re.search(defined, sources()[f], re.M) for f in files) else "not defined there"
    return None


def _modules(parts: list[str]) -> list[Path]:
    suffix = "/".join(parts)
    return [path for path in sources() if path.suffix == ".py" and (
        str(path.with_suffix("")).endswith("/" + suffix) or str(path.parent).endswith("/" + suffix))]


def _classes(name: str) -> list[Path]:
    return [path for path, text in sources().items() if re.search(rf"^class {name}\b", text, re.M)]


@pytest.mark.parametrize("doc", DOCS)
def test_every_code_name_in_the_doc_exists(doc):
    missing = {word: why for word in names_in(doc) if (why := problem(word))}
    assert not missing, missing
