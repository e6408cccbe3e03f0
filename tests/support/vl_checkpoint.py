"""Random-weight vision-language checkpoints written by transformers (fp32): Qwen3-VL (dense or
MoE text model, DeepStack) and Qwen3.5 (hybrid text model, no DeepStack), in the real Qwen3 vocabulary
(the demo model's tokenizer files beside them), with a preprocessor_config.json that keeps images
to a few tokens. Every weight is drawn large enough that a wrong MRoPE axis, position table or
DeepStack layer changes the logits (tests/multimodal/test_vl_model.py)."""

import io
import json
from pathlib import Path

import numpy as np
import torch
from PIL import Image

from tests.support.build_cache import cached_model, checkpoint_inputs
from tests.support.hybrid_checkpoint import COMMON, copy_tokenizer, tokenizer_files
from tests.support.hybrid_checkpoint import randomize as randomize_hybrid

# the Qwen3 vocabulary's <|image_pad|>, <|vision_start|>, <|vision_end|>
IMAGE_PAD, VISION_START, VISION_END = 151655, 151652, 151653
VISION = dict(depth=3, hidden_size=32, intermediate_size=64, num_heads=2, out_hidden_size=64,
              num_position_embeddings=64, patch_size=16, spatial_merge_size=2, temporal_patch_size=2)
PREPROCESSOR = {"size": {"shortest_edge": 32 * 32, "longest_edge": 256 * 256}, "patch_size": 16,
                "temporal_patch_size": 2, "merge_size": 2, "image_mean": [0.5, 0.5, 0.5],
                "image_std": [0.5, 0.5, 0.5], "image_processor_type": "Qwen2VLImageProcessorFast"}
# Qwen2-VL's chat template, in short: an image part renders as its placeholder between vision marks
CHAT_TEMPLATE = (
    "{%- for message in messages %}<|im_start|>{{ message.role }}\n"
    "{%- if message.content is string %}{{ message.content }}{%- else %}{%- for item in message.content %}"
    "{%- if item.type == 'image' %}<|vision_start|><|image_pad|><|vision_end|>"
    "{%- elif item.type == 'text' %}{{ item.text }}{%- endif %}{%- endfor %}{%- endif %}<|im_end|>\n"
    "{%- endfor %}{%- if add_generation_prompt %}<|im_start|>assistant\n{%- endif %}")
TOKENS = dict(image_token_id=IMAGE_PAD, vision_start_token_id=VISION_START, vision_end_token_id=VISION_END)
# head_dim 32: 16 rotary frequencies in Qwen3-VL, 8 in Qwen3.5 (half the head rotates)
KINDS = {
    "qwen3_vl": ("Qwen3VLForConditionalGeneration", "Qwen3VLConfig", dict(
        vocab_size=151936, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, max_position_embeddings=1024, initializer_range=0.2,
        eos_token_id=151645, bos_token_id=151643, rope_parameters={
            "rope_type": "default", "rope_theta": 5_000_000.0, "mrope_section": [6, 5, 5], "mrope_interleaved": True}),
        dict(deepstack_visual_indexes=[0, 1])),
    # every 2nd layer experts (4, top 2), the other a dense MLP
    "qwen3_vl_moe": ("Qwen3VLMoeForConditionalGeneration", "Qwen3VLMoeConfig", dict(
        vocab_size=151936, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, head_dim=32, max_position_embeddings=1024, initializer_range=0.2,
        moe_intermediate_size=24, num_experts=4, num_experts_per_tok=2, decoder_sparse_step=2,
        eos_token_id=151645, bos_token_id=151643, rope_parameters={
            "rope_type": "default", "rope_theta": 5_000_000.0, "mrope_section": [6, 5, 5], "mrope_interleaved": True}),
        dict(deepstack_visual_indexes=[1])),
    "qwen3_5": ("Qwen3_5ForConditionalGeneration", "Qwen3_5Config", dict(
        COMMON, intermediate_size=128, linear_num_value_heads=4,
        rope_parameters={"rope_type": "default", "rope_theta": 10_000_000.0, "partial_rotary_factor": 0.5,
                         "mrope_section": [3, 3, 2], "mrope_interleaved": True}), {}),
}


def randomize(model, kind: str, seed: int):
    g = torch.Generator().manual_seed(seed + 7)
    if kind == "qwen3_5":
        randomize_hybrid(model, seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".visual." in name or name.startswith("visual."):
                around = 1.0 if name.endswith(("norm1.weight", "norm2.weight", "norm.weight")) else 0.0
                p.copy_(around + torch.randn(p.shape, generator=g) * (0.3 if around else 0.15))
            elif kind.startswith("qwen3_vl") and name.endswith("norm.weight"):
                p.copy_(1 + torch.randn(p.shape, generator=g) * 0.3)
    return model


def write_vl_model(path: Path, demo_dir: Path, kind: str, seed: int = 0):
    """Save a KINDS[kind] model into path (a copy from the tests' build cache when it holds one);
    returns it as transformers loads it from there (eval mode)."""
    model_class, config_class, text, vision = KINDS[kind]

    def write(out: Path):
        import transformers

        torch.manual_seed(seed)
        config = getattr(transformers, config_class)(text_config=text, vision_config=dict(VISION, **vision),
                                                     tie_word_embeddings=False, **TOKENS)
        randomize(getattr(transformers, model_class)(config).eval(), kind, seed).save_pretrained(out)
        (out / "preprocessor_config.json").write_text(json.dumps(PREPROCESSOR))
        copy_tokenizer(demo_dir, out)
        (out / "chat_template.jinja").write_text(CHAT_TEMPLATE)

    inputs = checkpoint_inputs(write_vl_model, *tokenizer_files(demo_dir), repr((kind, seed)))
    return cached_model(path, f"vl-{kind}-seed{seed}", inputs, write, model_class)


def png(width: int, height: int, seed: int = 0) -> bytes:
    """A noisy RGB image, PNG-encoded."""
    pixels = np.random.default_rng(seed).integers(0, 256, size=(height, width, 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format="PNG")
    return out.getvalue()
