"""../shared/reference: the official Qwen chat templates and published configs that some tests
compare xserv with. It sits beside the repository in the usual layout and is absent from a bare
clone; a test that reads it carries the `reference` marker, and tests/conftest.py skips those,
saying so up front, where it is absent. Standard library only: pytest-xdist's controller imports
it too."""

import ast
import os
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
# XSERV_TEST_REFERENCE points elsewhere (the test of the skips points it at nothing)
REFERENCE = Path(os.environ.get("XSERV_TEST_REFERENCE", REPO.parent / "shared" / "reference"))
QWEN3 = REFERENCE / "qwen3"
QWEN3_5 = REFERENCE / "qwen3_5"
SKIP_REASON = f"{REFERENCE} is absent (the official Qwen templates and configs, beside the repository)"


def marked_tests(tests_dir: Path) -> set[str]:
    """Node-id prefixes ("tests/x.py" or "tests/x.py::test_name") of the tests that carry the
    marker, read from the sources: pytest-xdist's controller never collects, so it counts the ids
    its workers collected against these."""
    found = set()
    for path in tests_dir.rglob("test_*.py"):
        text = path.read_text()
        if "mark.reference" not in text:
            continue
        name = path.relative_to(REPO).as_posix()
        tree = ast.parse(text)
        for node in tree.body:
            if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "pytestmark" for t in node.targets) \
                    and "mark.reference" in ast.unparse(node.value):
                found.add(name)
            if isinstance(node, ast.FunctionDef) and any(
                    ast.unparse(d).endswith("mark.reference") for d in node.decorator_list):
                found.add(f"{name}::{node.name}")
    return found


def is_marked(nodeid: str, marked: set[str]) -> bool:
    path, _, rest = nodeid.partition("::")
    return path in marked or f"{path}::{rest.split('[', 1)[0]}" in marked
