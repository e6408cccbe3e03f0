"""The Qwen3.5 demo model: deterministic files that transformers loads as Qwen3_5ForConditionalGeneration,
random weights that make a wrong implementation show, and a chat template in Qwen3.5's layout."""

import json
import os

import pytest
import torch
from safetensors.torch import load_file
from tokenizers import Tokenizer as HFTokenizer

from tests.support.hf_reference import auto_tokenizer
from tests.support.reference import QWEN3_5
from tests.test_demo import FILES, read_all
from xserv_cli.main import main
from xserv_engine import demo
from xserv_engine.demo_qwen3_5 import CACHE_NAME, MODEL_ID, QWEN3_5_DEMO, TEXT_CONFIG
from xserv_engine.inputs import ChatInput
from xserv_engine.tokenizer.tokenizer import Tokenizer
from xserv_engine.tokenizer.tool_call_parsers import XML_PARSER, resolve_tool_call_parser

OFFICIAL_TEMPLATE = QWEN3_5 / "chat_template-Qwen3.5-4B.jinja"
TEXT = "model.language_model."
WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}}}}}


@pytest.fixture(scope="module")
def weights(demo_qwen3_5_dir):
    return load_file(str(demo_qwen3_5_dir / "model.safetensors"))


@pytest.fixture(scope="module")
def tokenizer(demo_qwen3_5_dir):
    return Tokenizer.from_dir(demo_qwen3_5_dir)


def test_make_demo_model_arch_qwen3_5_is_deterministic(tmp_path, demo_qwen3_5_dir):
    for name, seed in (("a", "0"), ("b", "1")):
        assert main(["make-demo-model", str(tmp_path / name), "--arch", "qwen3_5", "--seed", seed]) == 0
    first, other, fixture = read_all(tmp_path / "a"), read_all(tmp_path / "b"), read_all(demo_qwen3_5_dir)
    assert set(first) == FILES
    assert first == fixture  # written by another call (under xdist, another process)
    assert other["model.safetensors"] != first["model.safetensors"]
    assert {k: v for k, v in other.items() if k != "model.safetensors"} == {
        k: v for k, v in first.items() if k != "model.safetensors"}
    assert json.loads(first["config.json"])["model_type"] == "qwen3_5"


def test_config_loads_in_transformers_as_qwen3_5(demo_qwen3_5_dir):
    transformers = pytest.importorskip("transformers")
    config = transformers.AutoConfig.from_pretrained(str(demo_qwen3_5_dir))
    text = config.text_config
    assert (config.model_type, text.model_type) == ("qwen3_5", "qwen3_5_text")
    assert config.architectures == ["Qwen3_5ForConditionalGeneration"]
    assert text.layer_types == ["linear_attention"] * 3 + ["full_attention"]
    assert (text.hidden_size, text.intermediate_size, text.vocab_size) == (256, 768, 248320)
    assert (text.num_attention_heads, text.num_key_value_heads, text.head_dim) == (4, 2, 64)
    assert (text.linear_num_key_heads, text.linear_num_value_heads) == (4, 8)
    assert (text.linear_key_head_dim, text.linear_value_head_dim, text.linear_conv_kernel_dim) == (32, 32, 4)
    assert text.attn_output_gate and text.tie_word_embeddings and config.tie_word_embeddings
    rope = text.rope_parameters
    assert rope["partial_rotary_factor"] == 0.25
    assert 2 * sum(rope["mrope_section"]) == text.head_dim * rope["partial_rotary_factor"]  # rotary frequencies
    generation = json.loads((demo_qwen3_5_dir / "generation_config.json").read_text())
    assert generation["eos_token_id"] == text.eos_token_id == [248046, 248044]
    assert generation["max_new_tokens"] == demo.DEMO_MAX_NEW_TOKENS  # random weights never say EOS


def test_text_weights_have_transformers_names_and_shapes(demo_qwen3_5_dir, weights):
    transformers = pytest.importorskip("transformers")
    config = transformers.AutoConfig.from_pretrained(str(demo_qwen3_5_dir))
    with torch.device("meta"):
        model = transformers.Qwen3_5ForConditionalGeneration(config)
    expected = {name: tuple(t.shape) for name, t in model.state_dict().items()
                if not name.startswith("model.visual.") and name != "lm_head.weight"}  # tied to embed_tokens
    assert {name: tuple(t.shape) for name, t in weights.items()} == expected
    assert all(t.dtype == torch.bfloat16 for t in weights.values())
    assert weights[TEXT + "layers.0.linear_attn.conv1d.weight"].shape == (512, 1, 4)
    assert weights[TEXT + "layers.3.self_attn.q_proj.weight"].shape == (2 * 4 * 64, 256)  # query and gate


def test_transformers_loads_the_text_weights_and_greedy_output_is_finite(demo_qwen3_5_dir):
    transformers = pytest.importorskip("transformers")
    model, info = transformers.Qwen3_5ForConditionalGeneration.from_pretrained(
        str(demo_qwen3_5_dir), dtype=torch.float32, output_loading_info=True)
    assert [name for name in info["missing_keys"] if not name.startswith("model.visual.")] == []
    assert not info["unexpected_keys"] and not info["mismatched_keys"]
    hf = auto_tokenizer(demo_qwen3_5_dir)
    ids = torch.tensor([hf.encode("Hello, Qwen3.5! 你好")])
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=6, do_sample=False)
        logits = model(out).logits
    assert out.shape == (1, ids.shape[1] + 6)
    assert bool(torch.isfinite(logits).all()) and float(logits.std()) > 0.1


def test_random_weights_make_mistakes_visible(weights):
    """Qwen3.5's RMSNorm is x * (1 + w): zero weights would hide a missing `1 +`; equal decays
    would hide a head mixed up with another."""
    zero_centred = [t.float() for name, t in weights.items()
                    if name.endswith("norm.weight") and ".linear_attn." not in name]
    assert len(zero_centred) == 4 * 2 + 2 + 1  # input/post norms, q/k norms, the final norm
    for t in zero_centred:
        assert abs(float(t.mean())) < 0.1 and 0.1 < float(t.std()) < 0.3
    decays = []
    for i in range(3):
        p = f"{TEXT}layers.{i}.linear_attn."
        gated = weights[p + "norm.weight"].float()
        assert 0.9 < float(gated.mean()) < 1.1 and float(gated.std()) > 0.1
        a = weights[p + "A_log"].float().exp()
        dt_bias = weights[p + "dt_bias"].float()
        assert len(set(a.tolist())) == 8 and bool(((a >= 1) & (a <= 16.1)).all())
        assert len(set(dt_bias.tolist())) == 8 and bool(((dt_bias >= -5) & (dt_bias <= 0)).all())
        decays += torch.exp(-a * torch.nn.functional.softplus(dt_bias)).tolist()  # per token, at a = 0
        assert float(weights[p + "conv1d.weight"].float().std()) > 0.2
    assert min(decays) < 0.1 and max(decays) > 0.9  # heads that forget at once and heads that remember


def test_default_model_dir_caches_the_qwen3_5_demo_under_its_own_name(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    written = []
    monkeypatch.setattr(demo, "write_demo_model", lambda out, seed=0, model=demo.QWEN3_DEMO: written.append(model))
    path = demo.default_model_dir(QWEN3_5_DEMO)
    assert path == str(tmp_path / "xserv" / CACHE_NAME) and written == [QWEN3_5_DEMO]
    assert os.listdir(tmp_path / "xserv") == [CACHE_NAME] != [demo.CACHE_NAME]


def test_model_card_says_output_is_random_and_text_only(demo_qwen3_5_dir):
    card = (demo_qwen3_5_dir / "README.md").read_text()
    assert MODEL_ID in card and "weights are random" in card and "random text" in card
    assert "model.visual.*" in card and "left out" in card


def render(tokenizer, messages, tools=None, **template_kwargs) -> str:
    return tokenizer.render_chat(ChatInput(messages=messages, tools=tools, template_kwargs=template_kwargs))


def test_template_thinks_by_default(tokenizer):
    hi = [{"role": "system", "content": " Be brief. "}, {"role": "user", "content": "Hi"}]
    assert render(tokenizer, hi) == ("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n"
                                     "<|im_start|>assistant\n<think>\n")
    assert render(tokenizer, hi, enable_thinking=False).endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")


def test_template_writes_qwen3_coder_tool_calls_and_lists_tools(tokenizer):
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris and Oslo?"},
        {"role": "assistant", "content": "Checking.", "reasoning_content": "Two calls.", "tool_calls": [
            {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris", "days": 2}}},
            {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}]},
        {"role": "tool", "content": "sunny"},
        {"role": "tool", "content": "rain"},
    ]
    prompt = render(tokenizer, messages, tools=[WEATHER_TOOL])
    assert prompt.startswith("<|im_start|>system\n# Tools\n")
    assert "<tools>\n" + json.dumps(WEATHER_TOOL) + "\n</tools>" in prompt
    assert "</tool_call>\n\nBe brief.<|im_end|>\n<|im_start|>user\n" in prompt  # the system text after the tools
    assert ("<|im_start|>assistant\n<think>\nTwo calls.\n</think>\n\nChecking.\n\n<tool_call>\n<function=get_weather>\n"
            "<parameter=city>\nParis\n</parameter>\n<parameter=days>\n2\n</parameter>\n</function>\n</tool_call>\n"
            "<tool_call>\n<function=get_weather>\n<parameter=city>\nOslo\n</parameter>\n</function>\n</tool_call>"
            "<|im_end|>\n") in prompt
    assert prompt.endswith("<|im_start|>user\n<tool_response>\nsunny\n</tool_response>\n<tool_response>\nrain\n"
                           "</tool_response><|im_end|>\n<|im_start|>assistant\n<think>\n")
    assert resolve_tool_call_parser("auto", tokenizer.chat_template) == XML_PARSER


def test_template_drops_the_reasoning_of_earlier_turns(tokenizer):
    messages = [{"role": "user", "content": "1+1?"},
                {"role": "assistant", "content": "2", "reasoning_content": "Easy."},
                {"role": "user", "content": "2+2?"}]
    prompt = render(tokenizer, messages)
    assert "<|im_start|>assistant\n2<|im_end|>\n" in prompt and "Easy." not in prompt


def test_transformers_renders_our_template_to_the_same_ids(demo_qwen3_5_dir, tokenizer):
    pytest.importorskip("transformers")
    hf = auto_tokenizer(demo_qwen3_5_dir)
    messages = [{"role": "user", "content": "Weather in Paris?"},
                {"role": "assistant", "content": "", "tool_calls": [
                    {"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
                {"role": "tool", "content": "sunny"}]
    for thinking in (True, False):
        expected = hf.apply_chat_template(messages, tools=[WEATHER_TOOL], add_generation_prompt=True,
                                          enable_thinking=thinking, tokenize=True, return_dict=False)
        ours = tokenizer.encode(render(tokenizer, messages, tools=[WEATHER_TOOL], enable_thinking=thinking))
        assert ours == expected


@pytest.mark.reference
def test_our_template_renders_like_the_official_one_but_for_the_tools_text(demo_qwen3_5_dir, tokenizer):
    """Our wording of the tools preamble is our own; every other byte follows Qwen3.5's template."""
    config = json.loads((demo_qwen3_5_dir / "tokenizer_config.json").read_text())
    official = Tokenizer(HFTokenizer.from_file(str(demo_qwen3_5_dir / "tokenizer.json")), config,
                         OFFICIAL_TEMPLATE.read_text())
    conversations = [
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": " Hi \n"}],
        [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "<think>\nOld.\n</think>\n\nHello"},
         {"role": "user", "content": "Again"}],
        [{"role": "user", "content": "1+1?"}, {"role": "assistant", "content": "2", "reasoning_content": "Easy."},
         {"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "4", "reasoning_content": " Also. "},
         {"role": "assistant", "content": "<think>\nSent back inside.\n</think>\n\n  8"},
         {"role": "assistant", "content": "", "tool_calls": [
             {"type": "function", "function": {"name": "f", "arguments": {"x": "a\nb", "n": 3}}},
             {"type": "function", "function": {"name": "g", "arguments": {}}}]},
         {"role": "tool", "content": "ok"}, {"role": "tool", "content": "done"}],
    ]
    for messages in conversations:
        for thinking in (True, False):
            assert render(tokenizer, messages, enable_thinking=thinking) == \
                render(official, messages, enable_thinking=thinking)
