"""The tests that compare with ../shared/reference carry the `reference` marker, and a run without
the directory says so up front, skips exactly those, and lists them with the reason."""

import os
import re
import subprocess
import sys

import pytest

from tests.support.reference import REPO

TESTS = REPO / "tests"


def test_every_module_that_reads_the_reference_marks_its_tests():
    unmarked = [path.relative_to(REPO).as_posix() for path in TESTS.rglob("test_*.py")
                if re.search(r"tests\.support\.reference import|shared/reference|\"shared\"", path.read_text())
                and "mark.reference" not in path.read_text() and path.name != "test_reference_marker.py"]
    assert not unmarked


@pytest.mark.e2e  # a pytest of its own, in a process
def test_without_the_directory_the_run_says_so_first_and_skips_only_the_marked_tests(tmp_path):
    module = "tests/tokenizer/test_tool_call_parsers.py"
    run = subprocess.run([sys.executable, "-m", "pytest", module], cwd=REPO,
                         env={**os.environ, "XSERV_TEST_REFERENCE": str(tmp_path / "absent")},
                         capture_output=True, text=True, timeout=300)
    out = run.stdout
    assert run.returncode == 0, out[-3000:]
    header = out.index(f"reference: {tmp_path / 'absent'} is ABSENT")
    count = re.search(r"reference: (\d+) of (\d+) tests will SKIP", out)
    assert count and header < count.start() < out.index("test_tool_call_parsers.py ")
    skipped = int(re.search(r"(\d+) skipped", out).group(1))
    assert int(count.group(1)) == skipped == 2 and int(count.group(2)) > skipped
    assert re.search(r"SKIPPED \[\d+\] .*absent", out)
