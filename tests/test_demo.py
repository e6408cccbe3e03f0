"""The embedded demo model: deterministic files that transformers recognizes as Qwen3."""

import json
import os

import pytest
from safetensors import safe_open

from xserv_engine import demo
from xserv_cli.main import main

FILES = {
    "config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
    "tokenizer_config.json", "chat_template.jinja", "README.md",
}


def read_all(directory):
    return {path.name: path.read_bytes() for path in directory.iterdir()}


def test_make_demo_model_is_deterministic(tmp_path, demo_dir):
    for name, seed in (("a", "0"), ("c", "1")):
        assert main(["make-demo-model", str(tmp_path / name), "--seed", seed]) == 0
    # the second seed-0 copy is the session's, written by another call (under xdist, another process)
    first, second, other = read_all(tmp_path / "a"), read_all(demo_dir), read_all(tmp_path / "c")
    assert set(first) == FILES
    assert first == second
    assert other["model.safetensors"] != first["model.safetensors"]
    assert {k: v for k, v in other.items() if k != "model.safetensors"} == {
        k: v for k, v in first.items() if k != "model.safetensors"
    }


def test_config_loads_in_transformers(demo_dir):
    transformers = pytest.importorskip("transformers")
    config = transformers.AutoConfig.from_pretrained(str(demo_dir))
    assert config.model_type == "qwen3"
    assert (config.hidden_size, config.num_hidden_layers, config.head_dim) == (256, 4, 64)
    assert (config.num_attention_heads, config.num_key_value_heads) == (4, 2)
    assert config.vocab_size == 151936 and config.tie_word_embeddings
    generation = json.loads((demo_dir / "generation_config.json").read_text())
    assert generation["eos_token_id"] == [151645, 151643]
    assert generation["max_new_tokens"] == demo.DEMO_MAX_NEW_TOKENS  # random weights never say EOS


def test_weights_have_qwen3_names_shapes_and_bf16(demo_dir):
    with safe_open(str(demo_dir / "model.safetensors"), framework="pt") as f:
        names = set(f.keys())
        embed = f.get_tensor("model.embed_tokens.weight")
        q_proj = f.get_tensor("model.layers.3.self_attn.q_proj.weight")
        k_norm = f.get_tensor("model.layers.0.self_attn.k_norm.weight")
        down = f.get_tensor("model.layers.1.mlp.down_proj.weight")
    assert len(names) == 1 + 4 * 11 + 1 and "lm_head.weight" not in names  # tied embeddings
    assert embed.shape == (151936, 256) and str(embed.dtype) == "torch.bfloat16"
    assert q_proj.shape == (256, 256) and down.shape == (256, 768)
    assert bool((k_norm == 1).all())
    assert 0.018 < float(embed.float().std()) < 0.022


def test_model_card_says_output_is_random(demo_dir):
    card = (demo_dir / "README.md").read_text()
    assert "weights are random" in card and "random text" in card


def test_default_model_dir_builds_once_in_the_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    path = demo.default_model_dir()
    assert path == str(tmp_path / "xserv" / demo.CACHE_NAME)
    assert set(os.listdir(path)) == FILES
    assert os.listdir(tmp_path / "xserv") == [demo.CACHE_NAME]  # no staging directory left behind
    mtime = os.stat(os.path.join(path, "model.safetensors")).st_mtime_ns
    assert demo.default_model_dir() == path
    assert os.stat(os.path.join(path, "model.safetensors")).st_mtime_ns == mtime


def test_default_model_dir_uses_the_copy_of_a_process_that_won_the_race(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    final = tmp_path / "xserv" / demo.CACHE_NAME
    write = demo.write_demo_model

    def racing_write(out_dir, seed=0, model=demo.QWEN3_DEMO):
        write(out_dir, seed, model)
        final.mkdir()  # another process renamed its copy into place meanwhile
        (final / "config.json").write_text("{}")

    monkeypatch.setattr(demo, "write_demo_model", racing_write)
    assert demo.default_model_dir() == str(final)
    assert os.listdir(final) == ["config.json"]
    assert os.listdir(tmp_path / "xserv") == [demo.CACHE_NAME]
