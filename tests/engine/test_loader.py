"""Loading Hugging Face Qwen3 directories: spellings, shards, and clear errors."""

import json
import os
import shutil

import pytest
import torch

from tests.engine.conftest import save_hf_model
from tests.support.hybrid_checkpoint import TOKENIZER_FILES
from xserv_engine.errors import ModelLoadError
from xserv_engine.layers.attention import TorchAttentionBackend
from xserv_engine.models.loader import load_model, read_model_dir
from xserv_engine.models.qwen3 import Qwen3ForCausalLM


def load(path) -> Qwen3ForCausalLM:
    model_dir = read_model_dir(str(path))
    model = Qwen3ForCausalLM(model_dir.config, TorchAttentionBackend())
    load_model(model_dir, model, progress=False)
    return model


def test_sharded_checkpoint_with_index_loads_the_same_weights(tmp_path, demo_dir):
    hf = save_hf_model(tmp_path / "one", demo_dir, tie=False)
    hf.save_pretrained(tmp_path / "sharded", max_shard_size="5MB")
    assert (tmp_path / "sharded" / "model.safetensors.index.json").is_file()
    one, sharded = load(tmp_path / "one"), load(tmp_path / "sharded")
    for (name, a), (_, b) in zip(one.state_dict().items(), sharded.state_dict().items()):
        assert torch.equal(a, b), name


@pytest.mark.parametrize("spelling", ["rope_theta", "rope_parameters"])
def test_rope_theta_and_dtype_spellings(tmp_path, demo_dir, spelling):
    save_hf_model(tmp_path, demo_dir, tie=True)
    config = json.loads((tmp_path / "config.json").read_text())
    config.pop("rope_theta", None)
    config.pop("rope_parameters", None)
    config.pop("torch_dtype", None)
    config["dtype"] = "bfloat16"
    if spelling == "rope_theta":
        config["rope_theta"] = 12345.0
    else:
        config["rope_parameters"] = {"rope_type": "default", "rope_theta": 12345.0}
    (tmp_path / "config.json").write_text(json.dumps(config))
    model_dir = read_model_dir(str(tmp_path))
    assert model_dir.config.rope_theta == 12345.0
    assert model_dir.checkpoint_dtype == "bfloat16"


def _mapping_of(address: int) -> str:
    """The path /proc/self/maps names for the mapping that holds `address` ("" for anonymous memory)."""
    for line in open("/proc/self/maps"):
        fields = line.split(maxsplit=5)
        start, end = (int(x, 16) for x in fields[0].split("-"))
        if start <= address < end:
            return fields[5].strip() if len(fields) > 5 else ""
    raise LookupError(f"no mapping holds {address:#x}")


@pytest.mark.skipif(not os.path.exists("/proc/self/maps"), reason="reads the process's mappings (Linux)")
def test_a_cpu_models_token_embedding_is_read_from_the_file_not_copied(demo_dir):
    model_dir = read_model_dir(str(demo_dir))
    assert model_dir.hf_config["torch_dtype"] == "bfloat16"  # the demo's checkpoint
    torch.set_default_dtype(torch.bfloat16)
    try:
        mapped = Qwen3ForCausalLM(model_dir.config, TorchAttentionBackend())
    finally:
        torch.set_default_dtype(torch.float32)
    load_model(model_dir, mapped, progress=False)
    copied = load(demo_dir)  # float32: converted, so copied
    checkpoint = os.path.realpath(demo_dir / "model.safetensors")
    embed = mapped.model.embed_tokens.weight
    assert _mapping_of(embed.data_ptr()) == checkpoint
    assert _mapping_of(mapped.model.norm.weight.data_ptr()) != checkpoint  # the rest is copied
    assert _mapping_of(copied.model.embed_tokens.weight.data_ptr()) != checkpoint
    assert torch.equal(embed.float(), copied.model.embed_tokens.weight)
    assert mapped.lm_head.weight is embed  # tied: the head reads the same rows


def test_eos_ids_come_from_generation_config(tmp_path, demo_dir):
    save_hf_model(tmp_path, demo_dir, tie=True)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [151645, 151643]}))
    assert read_model_dir(str(tmp_path)).eos_token_ids == (151645, 151643)


def test_recommended_sampling_values_come_from_generation_config(tmp_path, demo_dir):
    save_hf_model(tmp_path, demo_dir, tie=True)
    generation = tmp_path / "generation_config.json"
    # Qwen3-8B's file: do_sample is ignored (as vLLM does), the rest are what unset fields take
    generation.write_text(json.dumps({"bos_token_id": 151643, "do_sample": True, "eos_token_id": [151645, 151643],
                                      "pad_token_id": 151643, "temperature": 0.6, "top_k": 20, "top_p": 0.95}))
    assert read_model_dir(str(tmp_path)).sampling_defaults == {"temperature": 0.6, "top_p": 0.95, "top_k": 20}
    generation.write_text(json.dumps({"do_sample": False, "max_new_tokens": 64}))
    assert read_model_dir(str(tmp_path)).sampling_defaults == {}
    for bad in ({"temperature": 5}, {"top_p": 0}, {"top_k": "20"}, {"repetition_penalty": True}):
        generation.write_text(json.dumps(bad))
        name = next(iter(bad))
        with pytest.raises(ModelLoadError, match=f"generation_config.json: {name} must be .*--sampling-defaults openai"):
            read_model_dir(str(tmp_path))


def test_clear_errors_for_bad_directories(tmp_path, demo_dir):
    with pytest.raises(ModelLoadError, match="does not exist"):
        read_model_dir(str(tmp_path / "nowhere"))
    with pytest.raises(ModelLoadError, match="no config.json"):
        read_model_dir(str(tmp_path))
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "model_type": "llama"}))
    with pytest.raises(ModelLoadError, match="not supported"):
        read_model_dir(str(tmp_path))
    save_hf_model(tmp_path / "ok", demo_dir, tie=True)
    for name in TOKENIZER_FILES:
        assert (tmp_path / "ok" / name).is_file()
    for file in (tmp_path / "ok").glob("*.safetensors"):
        file.unlink()
    with pytest.raises(ModelLoadError, match="no \\*.safetensors"):
        read_model_dir(str(tmp_path / "ok"))


def test_a_checkpoint_missing_tensors_is_refused(tmp_path, demo_dir):
    from safetensors.torch import load_file, save_file

    save_hf_model(tmp_path, demo_dir, tie=False)
    weights = load_file(tmp_path / "model.safetensors")
    del weights["model.layers.1.mlp.up_proj.weight"]
    save_file(weights, tmp_path / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ModelLoadError, match="lacks"):
        load(tmp_path)
    shutil.rmtree(tmp_path)


def test_a_vision_config_without_tower_weights_serves_the_text_model_alone(demo_qwen3_5_dir, caplog):
    """xserv's Qwen3.5 demo (and make_random_model.py's checkpoints) keep the real config, vision
    tower included, but write the text weights alone: they load as text models, images refused."""
    with caplog.at_level("WARNING", logger="xserv_engine.models.loader"):
        model_dir = read_model_dir(str(demo_qwen3_5_dir))
    assert "vision_config" in model_dir.hf_config
    assert model_dir.config.vision is None and not model_dir.config.accepts_images
    assert "no model.visual.* weights" in caplog.text
    load(demo_qwen3_5_dir)  # every text tensor there, nothing of a tower expected
