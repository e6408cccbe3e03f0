"""What a first start says at the engine's default log level (warning): the one-time native build
with its time, or why there is none and what runs instead; nothing about it once it is cached."""

import os
import subprocess
import sys

import pytest

from tests.support.processes import REPO
from xserv_engine.layers import native

# the engine CLI's logging set up as `xserv engine` does it, then a build of a small source
BUILD = """
import sys
from pathlib import Path
from xserv_engine.server.cli import configure_logging
from xserv_engine.layers import native
configure_logging("warning")
print(native.build(Path(sys.argv[1]), ["-O2", "-shared", "-fPIC"], "the test ops"))
"""


def build_at_the_default_level(tmp_path, search_path: str | None = None) -> subprocess.CompletedProcess:
    source = tmp_path / "answer.cpp"
    source.write_text('extern "C" int xserv_answer() { return 42; }\n')
    env = os.environ | {"XDG_CACHE_HOME": str(tmp_path / "cache")}
    if search_path is not None:  # no g++ on it, and no $CXX
        env = {key: value for key, value in env.items() if key != "CXX"} | {"PATH": search_path}
    return subprocess.run([sys.executable, "-c", BUILD, str(source)], cwd=REPO, capture_output=True, text=True,
                          timeout=300, env=env)  # a loaded 2-core box imports torch slowly


def test_the_first_build_says_it_compiles_once_and_how_long_it_took(tmp_path):
    if native.compiler() is None:
        pytest.skip("no C++ compiler (g++ or $CXX) here")
    first = build_at_the_default_level(tmp_path)
    assert first.returncode == 0, first.stderr
    assert "compiling the test ops (once per machine and torch version, cached in" in first.stderr
    assert "compiled the test ops in " in first.stderr and " s" in first.stderr.split("compiled the test ops in ")[1]
    again = build_at_the_default_level(tmp_path)
    assert again.stdout == first.stdout and again.stderr == ""  # cached: a second start stays quiet


def test_without_a_compiler_the_default_level_says_what_runs_instead(tmp_path):
    result = build_at_the_default_level(tmp_path, search_path=str(tmp_path))
    assert result.returncode == 0 and result.stdout.strip() == "None", result.stderr
    assert "WARNING xserv.engine.startup: no C++ compiler (g++ or $CXX): the test ops cannot be built" in result.stderr
    assert "the engine runs plain torch ops instead (route cpu-torch" in result.stderr
