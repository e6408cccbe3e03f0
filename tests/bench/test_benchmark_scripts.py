"""benchmarks/compare.py's table, benchmarks/make_random_model.py's checkpoints (dense and MoE), and the
embeddings, LoRA and MoE scripts run whole at tiny settings."""

import importlib.util
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


def test_make_random_model_writes_the_configs_shape(tmp_path, monkeypatch):
    config = demo.CONFIG | {"num_hidden_layers": 2, "tie_word_embeddings": False}
    (tmp_path / "config.json").write_text(json.dumps(config))
    out = tmp_path / "model"
    script = str(REPO / "benchmarks" / "make_random_model.py")
    monkeypatch.setattr(sys, "argv", [script, "--config", str(tmp_path / "config.json"), str(out)])
    assert load_script("make_random_model").main() == 0
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

    (tmp_path / "config.json").write_text(json.dumps(TINY_MOE))
    out = tmp_path / "model"
    script = str(REPO / "benchmarks" / "make_random_model.py")
    monkeypatch.setattr(sys, "argv", [script, "--config", str(tmp_path / "config.json"), "--num-layers", "3", str(out)])
    assert load_script("make_random_model").main() == 0
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
                           "--input-len", "16", "--output-len", "6", "--paired", "2", "--json", str(tmp_path / "r.json")],
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
