"""Random-weight Qwen3-MoE checkpoints written by transformers (Qwen3MoeForCausalLM, fp32), with the
demo model's tokenizer files beside them: the reference the MoE tests check xserv against."""

from pathlib import Path

import torch

from tests.support.build_cache import cached_model, checkpoint_inputs
from tests.support.hybrid_checkpoint import copy_tokenizer, tokenizer_files

# name -> the shape's differences: dense and MoE layers mixed, norm_topk_prob both ways, tied and
# untied heads, one checkpoint sharded with an index
SHAPES = {
    "mlp-only-layer-1,normalized,untied,sharded": dict(
        num_hidden_layers=3, num_experts=8, num_experts_per_tok=2, mlp_only_layers=[1], norm_topk_prob=True,
        tie_word_embeddings=False),
    "every-2nd-layer-sparse,unnormalized,tied": dict(
        num_hidden_layers=4, num_experts=6, num_experts_per_tok=3, decoder_sparse_step=2, norm_topk_prob=False,
        tie_word_embeddings=True),
}


def tiny_moe_config(**shape):
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(
        vocab_size=151936, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=1024,
        rope_theta=1_000_000.0, initializer_range=0.5, eos_token_id=151645, bos_token_id=151643, **shape)


def write_moe_checkpoint(path: Path, demo_dir: Path, shape: str, seed: int = 0):
    """Save the SHAPES[shape] model into path (a copy from the tests' build cache when it holds
    one); returns it as transformers loads it from there (eval mode)."""

    def write(out: Path):
        from transformers import Qwen3MoeForCausalLM

        torch.manual_seed(seed)
        model = Qwen3MoeForCausalLM(tiny_moe_config(**SHAPES[shape])).eval()
        model.save_pretrained(out, max_shard_size="4MB" if "sharded" in shape else "1GB")
        copy_tokenizer(demo_dir, out)

    inputs = checkpoint_inputs(write_moe_checkpoint, *tokenizer_files(demo_dir), repr((shape, seed)))
    return cached_model(path, f"moe-{shape}-seed{seed}", inputs, write, "Qwen3MoeForCausalLM")
