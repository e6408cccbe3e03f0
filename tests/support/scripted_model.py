"""A Qwen3 checkpoint whose output is scripted: the next token is a fixed function of the current one.

Attention and MLP outputs are zero, so the final hidden state is the current token's embedding.
Each scripted token embeds as its own one-hot direction, and the LM head maps that direction to
the scripted successor with a logit far above the rest (probability ~1 even at temperature 1).
Written as a normal Hugging Face directory and loaded through the normal loader.
"""

import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import save_file

from xserv_engine.tokenizer.tokenizer import Tokenizer

HIDDEN = 128
VOCAB = 151936
EOS = 151645  # <|im_end|>
LOGIT_SCALE = 10.0


def transitions(scripts: list[list[int]]) -> dict[int, int]:
    """Each script is [trigger, t1, t2, ...]: trigger -> t1 -> t2 ... -> EOS."""
    table: dict[int, int] = {}
    for script in scripts:
        for current, following in zip(script, script[1:] + [EOS]):
            if table.setdefault(current, following) != following:
                raise ValueError(f"token {current} would need two successors; reword the script")
    if len(table) > HIDDEN:
        raise ValueError(f"{len(table)} scripted tokens; at most {HIDDEN}")
    return table


def write_scripted_model(out: Path, tokenizer_dir: Path, scripts: list[list[int]], chat_template: str | None = None):
    out.mkdir(parents=True, exist_ok=True)
    table = transitions(scripts)
    embed = torch.zeros(VOCAB, HIDDEN)
    head = torch.zeros(VOCAB, HIDDEN)
    for slot, (current, following) in enumerate(table.items()):
        embed[current, slot] = 1.0
        head[following, slot] = LOGIT_SCALE
    weights = {"model.embed_tokens.weight": embed, "lm_head.weight": head, "model.norm.weight": torch.ones(HIDDEN)}
    prefix = "model.layers.0."
    shapes = {"self_attn.q_proj.weight": (128, HIDDEN), "self_attn.k_proj.weight": (64, HIDDEN),
              "self_attn.v_proj.weight": (64, HIDDEN), "self_attn.o_proj.weight": (HIDDEN, 128),
              "mlp.gate_proj.weight": (64, HIDDEN), "mlp.up_proj.weight": (64, HIDDEN),
              "mlp.down_proj.weight": (HIDDEN, 64)}
    weights |= {prefix + name: torch.zeros(shape) for name, shape in shapes.items()}
    weights |= {prefix + name: torch.ones(size) for name, size in
                [("input_layernorm.weight", HIDDEN), ("post_attention_layernorm.weight", HIDDEN),
                 ("self_attn.q_norm.weight", 64), ("self_attn.k_norm.weight", 64)]}
    save_file({k: v.contiguous() for k, v in weights.items()}, out / "model.safetensors", metadata={"format": "pt"})
    config = {
        "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "vocab_size": VOCAB,
        "hidden_size": HIDDEN, "intermediate_size": 64, "num_hidden_layers": 1, "num_attention_heads": 2,
        "num_key_value_heads": 1, "head_dim": 64, "max_position_embeddings": 4096, "rope_theta": 1000000.0,
        "rms_norm_eps": 1e-6, "tie_word_embeddings": False, "torch_dtype": "float32", "eos_token_id": EOS,
    }
    (out / "config.json").write_text(json.dumps(config, indent=2))
    (out / "generation_config.json").write_text(json.dumps({"eos_token_id": [EOS, 151643]}))
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(tokenizer_dir / name, out / name)
    template = chat_template if chat_template is not None else (tokenizer_dir / "chat_template.jinja").read_text()
    (out / "chat_template.jinja").write_text(template)


def script_tokens(tokenizer: Tokenizer, *pieces: str | int) -> list[int]:
    """Token ids of pieces: ints are token ids, strings are encoded."""
    ids: list[int] = []
    for piece in pieces:
        ids.extend([piece] if isinstance(piece, int) else tokenizer.encode(piece))
    return ids
