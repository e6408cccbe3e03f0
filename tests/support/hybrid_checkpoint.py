"""Random-weight hybrid checkpoints (Qwen3.5, Qwen3.5-MoE, Qwen3-Next) written by transformers
(fp32), with the demo model's tokenizer files beside them: the reference the hybrid tests check
xserv against.

transformers' default init hides mistakes (DESIGN.md): zero-centred norms start at 0, A_log
forgets the state within about a token. So norms, q/k norms, gated-norm weights, decays and
dt_bias are randomized here, until a deliberately wrong layer changes the greedy tokens
(tests/engine/test_hybrid_models.py checks that it does).
"""

import shutil
from pathlib import Path

import torch

from tests.support.build_cache import cached_model, checkpoint_inputs

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")
# linear, full, linear, linear: the full-attention layer sits between linear ones, state carried across
LAYER_TYPES = ["linear_attention", "full_attention", "linear_attention", "linear_attention"]
COMMON = dict(
    vocab_size=151936, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
    head_dim=32, max_position_embeddings=1024, initializer_range=0.2, linear_num_key_heads=2,
    linear_key_head_dim=16, linear_value_head_dim=24, linear_conv_kernel_dim=4, eos_token_id=151645,
    bos_token_id=151643, layer_types=LAYER_TYPES)
# name -> (transformers class, config class, the shape's own fields)
SHAPES = {
    # more value heads than key heads, tied head
    "qwen3_5,v4-over-k2,tied": ("Qwen3_5ForCausalLM", "Qwen3_5TextConfig", dict(
        intermediate_size=128, linear_num_value_heads=4, tie_word_embeddings=True)),
    # every layer MoE with a shared expert, untied head, sharded with an index
    "qwen3_5_moe,shared-expert,untied,sharded": ("Qwen3_5MoeForCausalLM", "Qwen3_5MoeTextConfig", dict(
        moe_intermediate_size=32, shared_expert_intermediate_size=48, num_experts=8, num_experts_per_tok=2,
        linear_num_value_heads=2, tie_word_embeddings=False)),
    # fused in_proj_qkvz / in_proj_ba, dense and MoE layers mixed, unnormalized top-k
    "qwen3_next,v4-over-k2,every-2nd-sparse": ("Qwen3NextForCausalLM", "Qwen3NextConfig", dict(
        intermediate_size=128, moe_intermediate_size=32, shared_expert_intermediate_size=48, num_experts=8,
        num_experts_per_tok=2, norm_topk_prob=False, decoder_sparse_step=2, linear_num_value_heads=4,
        tie_word_embeddings=True)),
}


def randomize(model, seed: int):
    """Norms, gates and decays drawn so that each of them shows in the output."""
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("A_log"):  # decays exp(-A softplus(.)) with A in [0.02, 0.6]: a long memory
                p.copy_(torch.empty(p.shape).uniform_(0.02, 0.6, generator=g).log())
            elif name.endswith("dt_bias"):
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)
            elif name.endswith("linear_attn.norm.weight"):  # the gated norm is a plain one: around 1
                p.copy_(1 + torch.randn(p.shape, generator=g) * 0.3)
            elif name.endswith("norm.weight"):  # zero-centred: x * (1 + w)
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    return model


def write_hybrid_checkpoint(path: Path, demo_dir: Path, shape: str, seed: int = 0):
    """Save the SHAPES[shape] model into path (a copy from the tests' build cache when it holds
    one); returns it as transformers loads it from there (eval mode)."""
    model_class, config_class, fields = SHAPES[shape]

    def write(out: Path):
        import transformers

        torch.manual_seed(seed)
        config = getattr(transformers, config_class)(**COMMON, **fields)
        model = randomize(getattr(transformers, model_class)(config).eval(), seed)
        model.save_pretrained(out, max_shard_size="4MB" if "sharded" in shape else "1GB")
        copy_tokenizer(demo_dir, out)

    inputs = checkpoint_inputs(write_hybrid_checkpoint, *tokenizer_files(demo_dir), repr((shape, seed)))
    return cached_model(path, f"hybrid-{shape}-seed{seed}", inputs, write, model_class)


def write_vl_checkpoint(path: Path, demo_dir: Path, seed: int = 0):
    """A Qwen3_5ForConditionalGeneration (text weights under model.language_model., a small vision
    tower under model.visual.), cached as write_hybrid_checkpoint's: returns the model."""

    def write(out: Path):
        import transformers

        torch.manual_seed(seed)
        text = dict(COMMON, intermediate_size=128, linear_num_value_heads=4, tie_word_embeddings=True)
        vision = dict(depth=1, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64,
                      num_position_embeddings=64)
        config = transformers.Qwen3_5Config(text_config=text, vision_config=vision, tie_word_embeddings=True)
        randomize(transformers.Qwen3_5ForConditionalGeneration(config).eval(), seed).save_pretrained(out)
        copy_tokenizer(demo_dir, out)

    inputs = checkpoint_inputs(write_vl_checkpoint, *tokenizer_files(demo_dir), repr(seed))
    return cached_model(path, f"hybrid-vl-seed{seed}", inputs, write, "Qwen3_5ForConditionalGeneration")


def tokenizer_files(demo_dir: Path) -> list[Path]:
    return [demo_dir / name for name in TOKENIZER_FILES]


def copy_tokenizer(demo_dir: Path, out: Path) -> None:
    for path in tokenizer_files(demo_dir):
        shutil.copy(path, out / path.name)


def add_mtp_layer(path: Path, model, seed: int = 0) -> dict[str, torch.Tensor]:
    """Write a multi-token-prediction layer (`mtp.*`, as Qwen3.5's checkpoints hold one) beside
    the checkpoint in path, which transformers' model does not read: its own file (listed in the
    index of a sharded checkpoint) and mtp_num_hidden_layers 1 in config.json. Random as the rest
    (zero-centred norms around 0, not at it); returns the tensors."""
    import json

    from safetensors.torch import save_file

    from xserv_engine.demo import mlp_shapes
    from xserv_engine.demo_qwen3_5 import mtp_shapes

    text = model.config.to_dict() | {"mtp_num_hidden_layers": 1}
    # the layer is decoder layer num_hidden_layers (vLLM's index): experts where that index's are
    index = text["num_hidden_layers"]
    moe = (bool(text.get("num_experts")) and (index + 1) % (text.get("decoder_sparse_step") or 1) == 0
           and index not in (text.get("mlp_only_layers") or ()))
    shapes = mtp_shapes(text | {"intermediate_size": text.get("intermediate_size") or 1})
    if moe:  # every layer of a Qwen3.5-MoE has experts and a gated shared expert: so has its MTP layer
        p, hidden, shared = "mtp.layers.0.mlp.", text["hidden_size"], text["shared_expert_intermediate_size"]
        shapes = [s for s in shapes if not s[0].startswith(p)] + mlp_shapes(text, True, p) + [
            (p + "shared_expert.gate_proj.weight", (shared, hidden)),
            (p + "shared_expert.up_proj.weight", (shared, hidden)),
            (p + "shared_expert.down_proj.weight", (hidden, shared)), (p + "shared_expert_gate.weight", (1, hidden))]
    g = torch.Generator().manual_seed(seed + 2)
    tensors = {name: torch.randn(shape, generator=g) * (0.3 if name.endswith("norm.weight") else 0.2)
               for name, shape in shapes}
    save_file(tensors, str(path / "mtp.safetensors"), metadata={"format": "pt"})
    index = path / "model.safetensors.index.json"
    if index.is_file():
        data = json.loads(index.read_text())
        data["weight_map"].update({name: "mtp.safetensors" for name in tensors})
        index.write_text(json.dumps(data))
    config = json.loads((path / "config.json").read_text())
    text_config = config.get("text_config") or config
    # Qwen3-Next's config spells it num_nextn_predict_layers
    text_config["num_nextn_predict_layers" if text_config.get("model_type") == "qwen3_next" else "mtp_num_hidden_layers"] = 1
    (path / "config.json").write_text(json.dumps(config))
    return tensors
