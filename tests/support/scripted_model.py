"""A Qwen3 checkpoint whose output is scripted: the next token is a fixed function of the current one.

Attention and MLP outputs are zero, so the final hidden state is the current token's embedding.
Each scripted token embeds as its own one-hot direction, and the LM head maps that direction to
the scripted successor with a logit far above the rest (probability ~1 even at temperature 1).
Written as a normal Hugging Face directory and loaded through the normal loader.

A token has one successor, so text a script repeats (Qwen3-Coder's XML tags and newlines) is
written with added tokens of the scripted model's own: extra non-special tokens in its
tokenizer.json, with ids from FREE_ID on (rows the model has beyond the Qwen tokenizer's).
"""

import json
import shutil
import subprocess
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import torch
from safetensors.torch import save_file

from tests.support.processes import Served, served
from xserv_engine.tokenizer.tokenizer import Tokenizer

HIDDEN = 128
VOCAB = 151936
EOS = 151645  # <|im_end|>
LOGIT_SCALE = 10.0
FREE_ID = 151669  # the first id past the Qwen tokenizer's


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


def write_scripted_model(out: Path, tokenizer_dir: Path, scripts: list[list[int]], chat_template: str | None = None,
                         added_tokens: tuple[str, ...] = ()):
    """added_tokens: texts that become tokens FREE_ID, FREE_ID + 1, ... (added_token_ids)."""
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
    if added_tokens:
        _add_tokens(out / "tokenizer.json", added_tokens)
    template = chat_template if chat_template is not None else (tokenizer_dir / "chat_template.jinja").read_text()
    (out / "chat_template.jinja").write_text(template)


def _add_tokens(tokenizer_json: Path, added_tokens: tuple[str, ...]) -> None:
    tokenizer = json.loads(tokenizer_json.read_text())
    tokenizer["added_tokens"] += [
        {"id": token_id, "content": text, "single_word": False, "lstrip": False, "rstrip": False,
         "normalized": False, "special": False}
        for text, token_id in added_token_ids(added_tokens).items()]
    tokenizer_json.write_text(json.dumps(tokenizer, ensure_ascii=False))


def added_token_ids(added_tokens: tuple[str, ...]) -> dict[str, int]:
    """The ids write_scripted_model gives its added_tokens."""
    return {text: FREE_ID + i for i, text in enumerate(added_tokens)}


def script_tokens(tokenizer: Tokenizer, *pieces: str | int) -> list[int]:
    """Token ids of pieces: ints are token ids, strings are encoded."""
    ids: list[int] = []
    for piece in pieces:
        ids.extend([piece] if isinstance(piece, int) else tokenizer.encode(piece))
    return ids


@contextmanager
def served_scripted(model_dir: Path, *flags: str) -> Iterator[Served]:
    """`xserv up` on a scripted model: fp32, a small cache, one REST worker, quiet."""
    with served("up", "--model", str(model_dir), "--workers", "1", "--threads", "8", "--num-kv-blocks", "64",
                "--max-model-len", "2048", "--dtype", "float32", "--log-level", "warning", *flags,
                stdout=subprocess.DEVNULL) as up:
        yield up
