"""benchmarks/compare.py's table, benchmarks/make_random_model.py's checkpoints (dense and MoE), and the
embeddings, engine-start, LoRA and MoE scripts run whole at tiny settings."""

import importlib.util
import io
import json
import re
import sys
from pathlib import Path

import pytest
from safetensors import safe_open

from xserv_engine import demo
from xserv_cli.bench.report import Latency, Report

REPO = Path(__file__).resolve().parents[2]


def load_script(name: str):
    spec = importlib.util.spec_from_file_location(name, REPO / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def report(output_tok_s: float, ttft_p50: float) -> Report:
    latency = Latency(mean=10.0, p50=ttft_p50, p90=ttft_p50, p99=2 * ttft_p50)
    return Report(config={}, num_requests=4, completed=4, failed=0, duration_s=1.0, prompt_tokens=0,
                  output_tokens=40, request_throughput=4.0, output_throughput=output_tok_s,
                  total_token_throughput=output_tok_s, ttft_ms=latency, tpot_ms=latency, itl_ms=latency,
                  e2e_ms=latency, errors={}, error_examples={})


def test_comparison_table_has_both_rows_and_ratios():
    compare = load_script("compare")
    table = compare.comparison_table({"xserv": report(300.0, 50.0), "transformers serve": report(100.0, 200.0)})
    rows = table.splitlines()
    assert rows[1].split()[:4] == ["xserv", "4/0", "10.0", "300.0"]
    assert rows[3].split()[4:8] == ["1.00x", "3.00x", "0.25x", "0.25x"]


def make_random_model(tmp_path: Path, monkeypatch, config: dict, *flags: str) -> Path:
    """Run benchmarks/make_random_model.py's command line on `config`; the checkpoint's directory."""
    (tmp_path / "config.json").write_text(json.dumps(config))
    out = tmp_path / "model"
    script = str(REPO / "benchmarks" / "make_random_model.py")
    monkeypatch.setattr(sys, "argv", [script, "--config", str(tmp_path / "config.json"), *flags, str(out)])
    assert load_script("make_random_model").main() == 0
    return out


def test_make_random_model_writes_the_configs_shape(tmp_path, monkeypatch):
    config = demo.CONFIG | {"num_hidden_layers": 2, "tie_word_embeddings": False}
    out = make_random_model(tmp_path, monkeypatch, config)
    assert json.loads((out / "config.json").read_text())["num_hidden_layers"] == 2
    assert (out / "tokenizer.json").read_bytes() == (Path(demo.default_model_dir()) / "tokenizer.json").read_bytes()
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        shapes = {name: tuple(f.get_slice(name).get_shape()) for name in f.keys()}
    assert shapes["lm_head.weight"] == (config["vocab_size"], config["hidden_size"])
    assert shapes["model.layers.1.self_attn.k_proj.weight"] == (2 * 64, 256)
    assert len(shapes) == 1 + 2 * 11 + 1 + 1


@pytest.mark.e2e  # the whole script in a process of its own
def test_embeddings_benchmark_runs_and_both_sides_embed_alike():
    import re
    import subprocess

    out = subprocess.run([sys.executable, str(REPO / "benchmarks" / "embeddings.py"), "--inputs", "6", "--max-len", "40",
                          "--rounds", "1", "--dtype", "float32"], capture_output=True, text=True, timeout=300,
                         check=True, cwd=REPO).stdout
    cosine = float(re.search(r"min cosine ([0-9.]+)", out).group(1))
    assert cosine > 0.9999, out
    assert re.search(r"xserv / transformers [0-9.]+", out), out


@pytest.mark.e2e  # the whole script in a process of its own: its memory is the process's
def test_engine_start_benchmark_prints_the_start_and_the_memory(demo_dir):
    import subprocess

    out = subprocess.run([sys.executable, str(REPO / "benchmarks" / "engine_start.py"), "--model", str(demo_dir),
                          "--dtype", "bfloat16"], capture_output=True, text=True, timeout=300, check=True,
                         cwd=REPO).stdout
    header, _, row = out.strip().splitlines()[-3:]
    values = dict(zip(header.strip("|").split("|"), row.strip("|").split("|")))
    values = {key.strip(): value.strip() for key, value in values.items()}
    assert (values["model"], values["dtype"], values["quantization"]) == (demo_dir.name, "bfloat16", "-"), out
    assert float(values["ready (s)"]) > 0, out
    kv, anon, peak = (int(values[key]) for key in ("KV cache (MiB)", "RssAnon (MiB)", "peak (MiB)"))
    assert 0 < kv < anon <= peak, out


@pytest.mark.e2e  # the whole script in a process of its own: one engine, two adapters, every workload
def test_lora_benchmark_prints_each_workloads_speed():
    import re
    import subprocess

    out = subprocess.run([sys.executable, str(REPO / "benchmarks" / "lora.py"), "--concurrency", "2", "--rounds", "1",
                          "--max-tokens", "4", "--rank", "4"], capture_output=True, text=True, timeout=300,
                         check=True, cwd=REPO).stdout
    rows = {m.group(1): float(m.group(2)) for m in re.finditer(r"^\| 2 \| ([\w ,]+) \| ([0-9.]+) \|", out, re.MULTILINE)}
    assert set(rows) == {"base", "base, op by op", "adapter", "mixed"}, out
    assert all(speed > 0 for speed in rows.values()), out


TINY_MOE = {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "vocab_size": 64, "hidden_size": 32,
            "intermediate_size": 48, "moe_intermediate_size": 16, "num_hidden_layers": 5, "num_attention_heads": 4,
            "num_key_value_heads": 2, "head_dim": 8, "num_experts": 4, "num_experts_per_tok": 2,
            "decoder_sparse_step": 1, "mlp_only_layers": [1], "tie_word_embeddings": False}


def fused_name(name: str) -> str:
    """transformers 5 keeps a layer's experts as two stacked tensors: gate_up_proj [E, 2I, H], down_proj [E, H, I]."""
    return re.sub(r"experts\.\d+\.(gate|up)_proj\.weight", "experts.gate_up_proj",
                  re.sub(r"experts\.\d+\.down_proj\.weight", "experts.down_proj", name))


def test_make_random_model_writes_a_moe_checkpoint_transformers_loads(tmp_path, monkeypatch):
    import torch
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    out = make_random_model(tmp_path, monkeypatch, TINY_MOE, "--num-layers", "3")
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        written = {name: f.get_tensor(name) for name in f.keys()}
    assert "model.layers.1.mlp.gate_proj.weight" in written and "model.layers.3.mlp.gate.weight" not in written
    assert written["model.layers.2.mlp.experts.3.down_proj.weight"].shape == (32, 16)
    reference = Qwen3MoeForCausalLM(Qwen3MoeConfig(**TINY_MOE | {"num_hidden_layers": 3}))
    assert {fused_name(name) for name in written} == set(reference.state_dict())
    model, info = Qwen3MoeForCausalLM.from_pretrained(out, output_loading_info=True)
    assert not any(info[key] for key in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    gate_up = model.model.layers[2].mlp.experts.gate_up_proj[3]
    expected = torch.cat([written["model.layers.2.mlp.experts.3.gate_proj.weight"],
                          written["model.layers.2.mlp.experts.3.up_proj.weight"]])
    assert torch.equal(gate_up.to(torch.bfloat16), expected)
    router = written["model.layers.0.mlp.gate.weight"].float()
    assert 0.01 < router.std() < 0.03  # random normal like the rest, so tokens pick varied experts


@pytest.mark.e2e  # the whole script: writes a tiny dense checkpoint, runs xserv up; llama.cpp not given, so skipped
def test_moe_benchmark_runs_xserv_alone(tmp_path):
    import subprocess

    (tmp_path / "config.json").write_text(json.dumps(demo.CONFIG | {"num_hidden_layers": 2}))
    script = str(REPO / "benchmarks" / "moe.py")
    done = subprocess.run([sys.executable, script, "--config", str(tmp_path / "config.json"), "--model",
                           str(tmp_path / "model"), "--streams", "1", "2", "--rounds", "1", "--input-len", "16",
                           "--output-len", "4", "--passes", "2"], capture_output=True, text=True, timeout=300, cwd=REPO)
    assert done.returncode == 0, done.stderr
    assert "llama.cpp skipped" in done.stderr and "CPU: " in done.stdout
    assert "pass 1 of 2" in done.stdout and "pass 2 of 2" in done.stdout, done.stdout
    rows = re.findall(r"^xserv +(\d+)/0 +4\.0 +([0-9.]+)", done.stdout, re.MULTILINE)
    assert [done for done, _ in rows] == ["1", "2"] * 2 and all(float(speed) > 0 for _, speed in rows), done.stdout


@pytest.mark.e2e  # the whole script on a tiny checkpoint, xserv int8 alone: the table and the phase-paired rounds
def test_int8_benchmark_prints_phase_paired_rounds(tmp_path):
    import subprocess

    (tmp_path / "config.json").write_text(json.dumps(demo.CONFIG | {"num_hidden_layers": 2}))
    script = str(REPO / "benchmarks" / "int8.py")
    done = subprocess.run([sys.executable, script, "--config", str(tmp_path / "config.json"), "--model",
                           str(tmp_path / "model"), "--servers", "xserv-int8", "--streams", "1", "--rounds", "1",
                           "--input-len", "16", "--output-len", "6", "--paired", "2", "--prefill-len", "40",
                           "--prefill-rounds", "2", "--json", str(tmp_path / "r.json")],
                          capture_output=True, text=True, timeout=300, cwd=REPO)
    assert done.returncode == 0, done.stderr
    assert "memory read bandwidth" in done.stdout and "xserv int8 at one stream" in done.stdout, done.stdout
    fraction = re.search(r"^  xserv-int8 +([0-9.]+) of the int8 ceiling \(rounds", done.stdout, re.MULTILINE)
    assert fraction and float(fraction.group(1)) > 0, done.stdout
    # the sum on one thread beside all threads', the same minute: which kind of minute the run had
    assert re.search(r"^the sum after the servers: [0-9.]+ GB/s on all \d+ threads, [0-9.]+ on one \([0-9.]+x\)$",
                     done.stdout, re.MULTILINE), done.stdout
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["one_thread_gb_s"] > 0
    rounds = report["xserv-int8 paired"]
    assert len(rounds) == 2 and all(r["gb_s"] > 0 and r["itl_p50_ms"] > 0 for r in rounds)
    # the long prompts, each timed alone: the server counted them as the prompt asked
    assert re.search(r"^  xserv-int8 +median [0-9.]+, best [0-9.]+ \(rounds [0-9.]+ [0-9.]+; 40 prompt tokens\)$",
                     done.stdout, re.MULTILINE), done.stdout
    assert [r["prompt_tokens"] for r in report["xserv-int8 prefill"]] == [40, 40]


TINY_QWEN3_5_MOE_TEXT = {
    "model_type": "qwen3_5_moe_text", "vocab_size": 248320, "hidden_size": 64, "num_hidden_layers": 8,
    "layer_types": ["linear_attention"] * 3 + ["full_attention"] + ["linear_attention"] * 3 + ["full_attention"],
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "linear_conv_kernel_dim": 4,
    "linear_key_head_dim": 8, "linear_value_head_dim": 8, "linear_num_key_heads": 2, "linear_num_value_heads": 4,
    "moe_intermediate_size": 16, "shared_expert_intermediate_size": 24, "num_experts": 4, "num_experts_per_tok": 2,
    "rope_parameters": {"rope_type": "default", "rope_theta": 10000000.0, "partial_rotary_factor": 0.25,
                        "mrope_section": [1, 1, 0], "mrope_interleaved": True},
    "tie_word_embeddings": False, "mtp_num_hidden_layers": 1}
TINY_QWEN3_5_MOE = {
    "architectures": ["Qwen3_5MoeForConditionalGeneration"], "model_type": "qwen3_5_moe", "tie_word_embeddings": False,
    "text_config": TINY_QWEN3_5_MOE_TEXT,
    "vision_config": {"model_type": "qwen3_5_moe_vision", "depth": 1, "hidden_size": 32, "intermediate_size": 32,
                      "num_heads": 2, "out_hidden_size": 64}}


def test_make_random_model_writes_a_qwen3_5_moe_checkpoint_transformers_loads(tmp_path, monkeypatch):
    from transformers import Qwen3_5MoeForConditionalGeneration

    from xserv_engine.demo_qwen3_5 import QWEN3_5_DEMO

    out = make_random_model(tmp_path, monkeypatch, TINY_QWEN3_5_MOE, "--num-layers", "4")
    text = json.loads((out / "config.json").read_text())["text_config"]
    assert text["layer_types"] == ["linear_attention"] * 3 + ["full_attention"] and text["mtp_num_hidden_layers"] == 0
    qwen3_5_demo = Path(demo.default_model_dir(QWEN3_5_DEMO))
    assert (out / "tokenizer.json").read_bytes() == (qwen3_5_demo / "tokenizer.json").read_bytes()
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        shapes = {name: tuple(f.get_slice(name).get_shape()) for name in f.keys()}
    assert shapes["model.language_model.layers.3.mlp.experts.2.down_proj.weight"] == (64, 16)
    assert shapes["model.language_model.layers.0.mlp.shared_expert.up_proj.weight"] == (24, 64)
    model, info = Qwen3_5MoeForConditionalGeneration.from_pretrained(out, output_loading_info=True)
    text_weights = {name for name in model.state_dict() if not name.startswith("model.visual.")}
    assert {fused_name(name) for name in shapes} == text_weights  # every text weight, named as transformers names it
    assert all(name.startswith("model.visual.") for name in info["missing_keys"]), info  # no vision tower written
    assert not info["unexpected_keys"] and not info["mismatched_keys"], info


def test_int8_benchmark_prints_each_target_ratio(capsys):
    int8 = load_script("int8")
    args = int8.parse_args(["--streams", "1", "16", "--prefill-len", "2048"])
    results = {"xserv-int8": {1: report(30.0, 50.0), 16: report(300.0, 50.0)},
               "llama.cpp-q8_0": {1: report(20.0, 50.0), 16: report(80.0, 50.0)},
               "xserv-bf16": {1: report(15.0, 50.0), 16: report(200.0, 50.0)},
               "llama.cpp-bf16": {1: report(16.0, 50.0), 16: report(100.0, 50.0)}}
    # (GB/s, ITL p50 ms): xserv's round caught a minute half as fast, so per GB/s 3.2x, not 1.6x
    paired = {"xserv-int8": [(20.0, 25.0)], "llama.cpp-q8_0": [(40.0, 40.0)]}
    prefill = {"xserv-int8": [(7.0, 2048), (5.0, 2048)], "llama.cpp-q8_0": [(16.0, 2048)],
               "xserv-bf16": [(8.0, 2048)], "llama.cpp-bf16": [(12.0, 2048)]}
    int8.print_targets(args, results, paired, prefill)
    lines = capsys.readouterr().out.splitlines()
    assert lines[2:] == [
        "  1 stream, xserv-bf16 / llama.cpp-bf16: 0.94x tok/s, phase-paired decode rate per GB/s - (target 1.0x)",
        "  2048-token prompt's TTFT, llama.cpp-bf16 / xserv-bf16: 1.50x (target 2.0x)",
        "  1 stream, xserv-int8 / llama.cpp-q8_0: 1.50x tok/s, phase-paired decode rate per GB/s 3.20x (target 1.2x)",
        "  2048-token prompt's TTFT, llama.cpp-q8_0 / xserv-int8: 3.20x (target 2.0x)",
        "  16 streams, xserv's best / llama.cpp's best: 3.00x tok/s (target 2.5x)",
        "  2048-token prompt's TTFT, llama.cpp's best / xserv's best: 2.40x (target 2.0x)"], lines


def test_make_random_model_with_mtp_writes_a_layer_that_method_mtp_serves(tmp_path, monkeypatch):
    """--mtp: mtp.* tensors (experts and a shared expert, as the MoE layers) that transformers
    leaves alone and xserv drafts with; the output is plain decoding's."""
    from transformers import Qwen3_5MoeForConditionalGeneration

    from tests.engine.conftest import generate, make_engine

    out = make_random_model(tmp_path, monkeypatch, TINY_QWEN3_5_MOE, "--num-layers", "4", "--mtp")
    assert json.loads((out / "config.json").read_text())["text_config"]["mtp_num_hidden_layers"] == 1
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        shapes = {name: tuple(f.get_slice(name).get_shape()) for name in f.keys()}
    assert shapes["mtp.fc.weight"] == (64, 128)
    assert shapes["mtp.layers.0.mlp.experts.3.down_proj.weight"] == (64, 16)
    assert shapes["mtp.layers.0.mlp.shared_expert_gate.weight"] == (1, 64)
    _, info = Qwen3_5MoeForConditionalGeneration.from_pretrained(out, output_loading_info=True)
    assert all(name.startswith("model.visual.") for name in info["missing_keys"]), info
    outputs = []
    for config in (None, '{"method": "mtp", "num_speculative_tokens": 2, "disable_when_slower": false}'):
        engine = make_engine(out, language_model_only=True, speculative_config=config)
        try:
            outputs.append(generate(engine, list(range(1000, 1020)), max_tokens=12, temperature=0.0,
                                    ignore_eos=True).token_ids())
            if config:
                assert engine.stats().spec.num_draft_tokens > 0
        finally:
            engine.shutdown()
    assert outputs[0] == outputs[1]


TINY_QWEN3_5_VL = {
    "architectures": ["Qwen3_5ForConditionalGeneration"], "model_type": "qwen3_5", "tie_word_embeddings": False,
    "image_token_id": 248056, "video_token_id": 248057, "vision_start_token_id": 248053, "vision_end_token_id": 248054,
    "text_config": {key: value for key, value in TINY_QWEN3_5_MOE_TEXT.items()
                    if not key.startswith(("moe_", "shared_expert", "num_experts"))}
    | {"model_type": "qwen3_5_text", "intermediate_size": 96},
    "vision_config": {"model_type": "qwen3_5_vision", "depth": 2, "hidden_size": 32, "intermediate_size": 48,
                      "num_heads": 2, "out_hidden_size": 64, "num_position_embeddings": 64}}


def test_make_random_model_with_vision_writes_a_tower_transformers_and_xserv_load(tmp_path, monkeypatch):
    """--vision: every model.visual.* tensor transformers expects, random like the text (norms
    ones), a preprocessor_config.json as Qwen ships; xserv loads it as a model that takes images."""
    from transformers import AutoImageProcessor, Qwen3_5ForConditionalGeneration

    from xserv_engine.layers.attention import TorchAttentionBackend
    from xserv_engine.models.loader import load_model, read_model_dir
    from xserv_engine.models.qwen3 import Qwen3ForCausalLM

    out = make_random_model(tmp_path, monkeypatch, TINY_QWEN3_5_VL, "--num-layers", "4", "--vision")
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        written = {name: f.get_tensor(name) for name in f.keys()}
    assert written["model.visual.blocks.1.attn.qkv.weight"].shape == (96, 32)
    assert written["model.visual.patch_embed.proj.weight"].shape == (32, 3, 2, 16, 16)
    assert (written["model.visual.merger.norm.weight"] == 1).all()
    assert 0.01 < written["model.visual.merger.linear_fc1.weight"].float().std() < 0.03
    model, info = Qwen3_5ForConditionalGeneration.from_pretrained(out, output_loading_info=True)
    assert not any(info[key] for key in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    assert AutoImageProcessor.from_pretrained(out).merge_size == 2
    assert "<|vision_start|><|image_pad|><|vision_end|>" in (out / "chat_template.jinja").read_text()

    model_dir = read_model_dir(str(out))
    assert model_dir.config.accepts_images
    xserv_model = Qwen3ForCausalLM(model_dir.config, TorchAttentionBackend())
    load_model(model_dir, xserv_model, progress=False)
    assert xserv_model.visual is not None


def test_make_random_model_text_weights_do_not_change_with_vision(tmp_path, monkeypatch):
    """Without --vision the same text weights, no tower and no preprocessor_config.json."""
    (tmp_path / "a").mkdir(), (tmp_path / "b").mkdir()
    with_tower = make_random_model(tmp_path / "a", monkeypatch, TINY_QWEN3_5_VL, "--num-layers", "4", "--vision")
    text_only = make_random_model(tmp_path / "b", monkeypatch, TINY_QWEN3_5_VL, "--num-layers", "4")
    assert not (text_only / "preprocessor_config.json").exists()
    with safe_open(str(with_tower / "model.safetensors"), "pt") as a, \
            safe_open(str(text_only / "model.safetensors"), "pt") as b:
        assert set(b.keys()) == {name for name in a.keys() if not name.startswith("model.visual.")}
        name = "model.language_model.layers.3.self_attn.q_proj.weight"
        assert (a.get_tensor(name) == b.get_tensor(name)).all()


def test_images_benchmark_sends_each_server_new_images_of_the_asked_size():
    from PIL import Image

    images = load_script("images")
    png = images.image_png(1024, 768, seed=3)
    assert Image.open(io.BytesIO(png)).size == (1024, 768)
    assert png == images.image_png(1024, 768, seed=3)  # the same bytes to both servers
    taken = images.Images(images.parse_args(["--rounds", "2"]))
    first, second = taken.take(2), taken.take(2)
    assert len(set(first + second)) == 4  # never the same image twice: no cache holds it


@pytest.mark.e2e  # the script's xserv half on a tiny Qwen3.5 vision checkpoint: xserv up, image requests, the table
def test_images_benchmark_runs_xserv_alone(tmp_path, demo_dir):
    import subprocess

    from tests.support.vl_checkpoint import write_vl_model

    write_vl_model(tmp_path / "model", demo_dir, "qwen3_5")
    script = str(REPO / "benchmarks" / "images.py")
    done = subprocess.run([sys.executable, script, "--model", str(tmp_path / "model"), "--only", "xserv",
                           "--rounds", "2", "--streams", "2", "--max-tokens", "3", "--width", "128", "--height", "96",
                           "--json", str(tmp_path / "r.json")], capture_output=True, text=True, timeout=300, cwd=REPO)
    assert done.returncode == 0, done.stderr
    assert "CPU: " in done.stdout and re.search(r"^\| xserv \| \d+ \| \d+ \| \d+ \| [0-9.]+ \|", done.stdout,
                                                  re.MULTILINE), done.stdout
    result = json.loads((tmp_path / "r.json").read_text())["xserv"]
    assert result["prompt_tokens"] > 12  # the image's 4 x 3 merged tokens and the question
    assert result["cached_tokens"] == 0  # a new image each time: nothing served from xserv's caches
    assert result["streams_completion_tokens"] == [3, 3] and result["streams_tok_s"] > 0
    assert len(result["ttft_s"]) == 2 and all(t > 0 for t in result["ttft_s"])


def test_images_benchmark_prints_each_servers_row_and_the_target_ratios():
    images = load_script("images")
    results = {"xserv": {"ttft_s": [2.0, 1.0, 3.0], "prompt_tokens": 790, "streams_tok_s": 12.0,
                         "streams_ttft_s": [4.0, 6.0], "load": (2.0, 3.5)},
               "llama.cpp": {"ttft_s": [4.0, 5.0, 6.0], "prompt_tokens": 791, "streams_tok_s": 4.0,
                             "streams_ttft_s": [9.0, 11.0], "load": (3.0, 3.0)}}
    assert images.table(results, 8)[2:] == ["| xserv | 790 | 1000 | 2000 | 12.0 | 5000 | 2.0 / 3.5 |",
                                             "| llama.cpp | 791 | 4000 | 5000 | 4.0 | 10000 | 3.0 / 3.0 |"]
    assert images.ratios(results, 8) == [
        "  TTFT at 1 stream, xserv / llama.cpp: 0.40x median, 0.25x best (target at most 0.5x: met)",
        "  8 streams tok/s, xserv / llama.cpp: 3.00x (target at least 2.0x: met)"]
    assert images.ratios({"xserv": results["xserv"]}, 8) == []  # xserv alone: nothing to compare


@pytest.mark.e2e  # runs the script whole, on a checkpoint transformers loads too
def test_images_floor_counts_the_flops_torch_counts(tmp_path, monkeypatch):
    """images_floor.py's count: the tower's linears and attention exactly what torch's FLOP counter
    counts in transformers' tower (eager attention), the text linears those of transformers' text
    model; its floor is printed against llama.cpp's numbers."""
    import torch
    from torch.utils.flop_counter import FlopCounterMode
    from transformers import Qwen3_5ForConditionalGeneration

    from xserv_engine.models.loader import read_model_dir

    floor = load_script("images_floor")
    out = make_random_model(tmp_path, monkeypatch, TINY_QWEN3_5_VL, "--num-layers", "4", "--vision")
    model = Qwen3_5ForConditionalGeneration.from_pretrained(out, attn_implementation="eager").eval()
    config, shapes = read_model_dir(str(out)).config, floor.weight_shapes(out)
    patches = 8 * 12
    with FlopCounterMode(display=False) as counter, torch.no_grad():
        model.model.visual(torch.randn(patches, 3 * 2 * 16 * 16), grid_thw=torch.tensor([[1, 8, 12]]))
    assert sum(floor.vision_flops(shapes, config.vision, patches).values()) == counter.get_total_flops()

    text_linears = sum(2 * 50 * module.weight.numel() for name, module in model.model.language_model.named_modules()
                       if isinstance(module, torch.nn.Linear))
    assert floor.text_flops(shapes, config, 50)["text linears"] == text_linears

    out_text = io.StringIO()
    monkeypatch.setattr(sys, "stdout", out_text)
    monkeypatch.setattr(floor, "matmul_rate", lambda m, k, n: 1e9)  # the same rate at every shape
    monkeypatch.setattr(floor, "attention_seconds", lambda n, heads, head_dim: 0.5)
    assert floor.main(["--model", str(out), "--width", "256", "--height", "384", "--llama-ttft", "1.0"]) == 0
    printed = out_text.getvalue()
    assert "384x256, 384 patches, 96 image tokens; prompt 119 tokens" in printed
    expected = (sum(floor.vision_flops(shapes, config.vision, 384).values())
                + sum(floor.text_flops(shapes, config, 119).values())) / 1e9
    assert f"own shapes' matmul rate: {expected:.2f} s" in printed
    assert "the tower's attention in torch's SDPA (softmax and all): 1.00 s" in printed  # 2 layers
    assert f"against llama.cpp's TTFT 1.00 s: {expected:.2f}x at best" in printed


def test_vision_tower_benchmark_times_both_attentions_on_a_small_image(capsys):
    from xserv_engine.layers import linear, native
    assert load_script("vision_tower").main(["--width", "128", "--height", "96", "--rounds", "1", "--threads", "1"]) == 0
    out = capsys.readouterr().out
    assert "48 patches (128x96)" in out
    assert re.search(r"^\| torch SDPA \| \d+\.\d\d \|", out, re.MULTILINE), out
    if native.load_torch_ops() and linear.native_bf16():
        assert re.search(r"^\| native vision_attention \| \d+\.\d\d \|", out, re.MULTILINE), out
        assert float(re.search(r"max \|native - SDPA\|.*: (\S+) ", out).group(1)) < 0.01, out
