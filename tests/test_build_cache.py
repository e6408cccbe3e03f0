"""The tests' build cache (tests/support/build_cache.py) gives the files a build writes, or builds
again: never a stale or damaged copy."""

import os

import pytest

from tests.support.build_cache import demo_inputs, write_cached
from xserv_engine.demo import QWEN3_DEMO
from xserv_engine.demo_qwen3_5 import QWEN3_5_DEMO


class Build:
    """A build that writes two files from its input file and counts its runs."""

    def __init__(self, source):
        self.source, self.runs = source, 0

    def __call__(self, out):
        self.runs += 1
        (out / "tokenizer.json").write_text(self.source.read_text() * 2)
        (out / "model.safetensors").write_bytes(bytes(range(256)) * 64)


@pytest.fixture
def build(tmp_path):
    source = tmp_path / "demo.py"
    source.write_text("merges v1")
    return Build(source)


def cached(tmp_path, build, out_name: str):
    out = tmp_path / out_name
    out.mkdir()
    write_cached(out, "demo", [build.source, "torch==2.13.0"], build, root=tmp_path / "cache")
    return {path.name: path.read_bytes() for path in out.iterdir()}


def test_the_second_run_copies_what_the_first_built(tmp_path, build):
    first = cached(tmp_path, build, "a")
    assert cached(tmp_path, build, "b") == first
    assert build.runs == 1
    assert first["tokenizer.json"] == b"merges v1merges v1"


@pytest.mark.parametrize("damage", ["flipped byte", "truncated", "missing file", "missing manifest"])
def test_a_damaged_entry_is_built_again(tmp_path, build, damage):
    first = cached(tmp_path, build, "a")
    [entry] = (tmp_path / "cache").iterdir()
    weights = entry / "model.safetensors"
    if damage == "flipped byte":
        data = bytearray(weights.read_bytes())
        data[1000] ^= 1
        weights.write_bytes(bytes(data))
    elif damage == "truncated":
        os.truncate(weights, 100)
    else:
        (entry / ("model.safetensors" if damage == "missing file" else "manifest.json")).unlink()
    assert cached(tmp_path, build, "b") == first
    assert build.runs == 2
    assert cached(tmp_path, build, "c") == first  # stored again, intact
    assert build.runs == 2


def test_a_changed_input_builds_anew_and_drops_the_old_entry(tmp_path, build):
    cached(tmp_path, build, "a")
    build.source.write_text("merges v2")
    assert cached(tmp_path, build, "b")["tokenizer.json"] == b"merges v2merges v2"
    assert build.runs == 2
    assert len(list((tmp_path / "cache").iterdir())) == 1


def test_the_demo_key_covers_the_modules_that_write_it_and_its_vocabulary():
    names = {item.name if hasattr(item, "name") else item for item in demo_inputs(QWEN3_DEMO)}
    assert {"demo.py", "demo_tokenizer.py", "byte_level.py", "qwen.tiktoken"} <= names
    assert any(name.startswith("torch==") for name in names)
    qwen3_5 = {item.name if hasattr(item, "name") else item for item in demo_inputs(QWEN3_5_DEMO)}
    assert {"demo_qwen3_5.py", "qwen3_6.tiktoken"} <= qwen3_5
