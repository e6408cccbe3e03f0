"""GPU acceptance run: fidelity to transformers, throughput and the batch-1 HBM roofline.

For each of the Qwen3-0.6B, Qwen3-8B and Qwen3-30B-A3B (MoE) shapes (the published configs in
../shared/reference/qwen3), with random weights (30B-A3B cut to 16 of its 48 layers: the whole
model is 61 GB in bf16, more than the GPU machine's disk holds beside the rest), and the hybrid
Qwen3.5-0.8B and Qwen3.5-35B-A3B (cut to 8 of its 40 layers) of ../shared/reference/qwen3_5,
whose Gated DeltaNet layers run fla-core's kernels where the cuda extra installed them (their
norms, decays and gates randomized as the tests' hybrid checkpoints are, so a wrong layer shows):
  1. fidelity (fp32): prefill logits of a varlen batch against transformers' Qwen3, and greedy
     tokens of concurrent requests (decoded through the CUDA graphs) against `generate`;
  2. throughput (the default dtype, bf16 on CUDA, default engine settings): 1, 64 and 256
     concurrent streams of 128 prompt / 128 output tokens; for Qwen3-0.6B the 256-stream
     workload is nano-vllm's bench.py (input and output lengths drawn from 100-1024,
     temperature 0.6, ignore_eos);
  3. batch-1 decode tok/s against the roofline weight bytes / memory bandwidth (bandwidth
     measured here by a device copy, and the device's nominal figure where known).
Writes one JSON and prints a table (also written next to the JSON, .md). On a CPU, or with
--dry-run, the same steps run on tiny shapes cut from the same configs (fp32), which is what CI
runs so the script cannot rot.

    python benchmarks/gpu_acceptance.py [--out gpu_acceptance.json] [--dry-run] [--shapes Qwen3-0.6B]
"""

import argparse
import gc
import json
import random
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from acceptance_steps import check_fidelity, decode_roofline, measure_streams  # benchmarks/acceptance_steps.py
from xserv_engine.config import EngineConfig

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository: tests.support
REFERENCE = Path(__file__).resolve().parents[2] / "shared" / "reference"
SHAPES = {"Qwen3-0.6B": "qwen3/config-Qwen3-0.6B.json", "Qwen3-8B": "qwen3/config-Qwen3-8B.json",
          "Qwen3-30B-A3B": "qwen3/config-Qwen3-30B-A3B.json", "Qwen3.5-0.8B": "qwen3_5/config-Qwen3.5-0.8B.json",
          "Qwen3.5-35B-A3B": "qwen3_5/config-Qwen3.5-35B-A3B.json"}
# every layer's shape, a third (a fifth) of the layers (see above); whole [linear x3, full] groups
GPU_LAYERS = {"Qwen3-30B-A3B": 16, "Qwen3.5-35B-A3B": 8}
TINY = {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 16, "max_position_embeddings": 4096}
TINY_MOE = {"moe_intermediate_size": 32, "num_experts": 8, "num_experts_per_tok": 2}
TINY_HYBRID = {"num_hidden_layers": 4, "head_dim": 32, "linear_num_key_heads": 2, "linear_num_value_heads": 4,
               "linear_key_head_dim": 16, "linear_value_head_dim": 24, "shared_expert_intermediate_size": 48}
TINY_VISION = {"depth": 1, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2, "out_hidden_size": 64,
               "num_position_embeddings": 64}
TIME_BUDGET_S = 8 * 60


@dataclass(frozen=True)
class Plan:
    device: str
    fidelity_prompt_lens: tuple[int, ...]
    fidelity_new_tokens: int
    batch1_new_tokens: int
    streams: tuple[int, ...]  # the last one runs nano-vllm's workload
    prompt_len: int  # every stream count but the last
    output_len: int
    nano_len_range: tuple[int, int]  # nano-vllm's input/output lengths: uniform over this range
    kv_cache_gb_fidelity: float


GPU = Plan("cuda", (7, 33, 64, 130), 16, 256, (1, 64, 256), 128, 128, (100, 1024), 4.0)
DRY = Plan("cpu", (5, 17), 6, 8, (1, 4, 8), 16, 8, (8, 24), 0.25)


def build_checkpoint(config: dict, out: Path, device: str, dtype: torch.dtype) -> None:
    """A random-weight Qwen3 of config's shape, made by transformers on the device and saved,
    with xserv's demo tokenizer files beside it."""
    import shutil

    from transformers import AutoConfig, AutoModelForCausalLM

    from xserv_engine.demo import QWEN3_DEMO, default_model_dir
    from xserv_engine.demo_qwen3_5 import QWEN3_5_DEMO

    torch.manual_seed(0)
    fields = {k: v for k, v in config.items() if k not in ("architectures", "torch_dtype", "model_type")}
    hf_config = AutoConfig.for_model(config["model_type"], **fields)  # qwen3, qwen3_moe, qwen3_5, qwen3_5_moe
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(hf_config).eval()
    finally:
        torch.set_default_dtype(torch.float32)
    if "text_config" in config:  # hybrid: transformers' init would hide a wrong norm, decay or gate
        from tests.support.hybrid_checkpoint import randomize

        randomize(model, seed=0)
    model.save_pretrained(out)
    del model
    demo = Path(default_model_dir(QWEN3_5_DEMO if "text_config" in config else QWEN3_DEMO))  # its vocabulary
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        shutil.copy(demo / name, out / name)


def release() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def workloads(name: str, plan: Plan) -> list[tuple]:
    """(streams, prompts, output lengths, temperature) per stream count: greedy prompt_len /
    output_len, but for Qwen3-0.6B at the most streams nano-vllm's bench.py workload (the
    8B shape keeps the short one, to stay within the time budget)."""
    rng = random.Random(0)
    out = []
    for n in plan.streams:
        if n == plan.streams[-1] and name == "Qwen3-0.6B":
            lo, hi = plan.nano_len_range
            out.append((n, [[rng.randrange(10000) for _ in range(rng.randint(lo, hi))] for _ in range(n)],
                        [rng.randint(lo, hi) for _ in range(n)], 0.6))
        else:
            out.append((n, [[rng.randrange(151643) for _ in range(plan.prompt_len)] for _ in range(n)],
                        [plan.output_len] * n, 0.0))
    return out


def run_shape(name: str, config: dict, plan: Plan, workdir: Path) -> dict:
    started = time.perf_counter()
    model_dir = workdir / name
    store_dtype = torch.bfloat16 if plan.device == "cuda" else torch.float32
    build_checkpoint(config, model_dir, plan.device, store_dtype)
    built = time.perf_counter() - started
    text = config.get("text_config", config)
    result = {"shape": name, "config": {k: text[k] for k in TINY | {"vocab_size": 0} if k in text},
              "build_s": round(built, 1)}
    fidelity_config = EngineConfig(model=str(model_dir), dtype="float32", device=plan.device,
                                   kv_cache_memory_gb=plan.kv_cache_gb_fidelity, max_num_seqs=16)
    result["fidelity"] = check_fidelity(fidelity_config, model_dir, plan.fidelity_prompt_lens,
                                        plan.fidelity_new_tokens)
    release()
    serving = EngineConfig(model=str(model_dir), device=plan.device, max_num_seqs=max(plan.streams))
    result.update(measure_streams(serving, workloads(name, plan), plan.batch1_new_tokens))
    result["roofline"] = decode_roofline(config, result["dtype"], result["batch1_decode_tok_s"], plan.device)
    release()
    result["total_s"] = round(time.perf_counter() - started, 1)
    return result


def table(results: list[dict], streams: tuple[int, ...]) -> str:
    heads = " | ".join(f"{n} stream{'s' * (n > 1)} tok/s" for n in streams)
    rows = [f"| shape | logits max abs diff | greedy equal | {heads} | batch-1 decode tok/s "
            "| of roofline (measured bw) | of roofline (nominal bw) |", "|---" * (6 + len(streams)) + "|"]
    for r in results:
        if "skipped" in r:
            rows.append(f"| {r['shape']} | skipped: {r['skipped']} |" + " |" * (4 + len(streams)))
            continue
        f, roof = r["fidelity"], r["roofline"]
        nominal = f"{roof['fraction_nominal']:.2f}" if roof["fraction_nominal"] is not None else "n/a"
        rows.append(f"| {r['shape']} | {f['logits_max_abs_diff']:.1e} | {f['greedy_equal']}/{f['greedy_total']} | "
                    + " | ".join(f"{x['output_tok_s']:.0f}" for x in r["streams"])
                    + f" | {r['batch1_decode_tok_s']:.1f} | {roof['fraction_measured']:.2f} | {nominal} |")
    return "\n".join(rows)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="gpu_acceptance.json", help="the JSON to write (the table goes to .md beside)")
    parser.add_argument("--dry-run", action="store_true", help="tiny shapes on the CPU (automatic without CUDA)")
    parser.add_argument("--shapes", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    parser.add_argument("--reference-dir", type=Path, default=REFERENCE, help="where the published configs are")
    args = parser.parse_args()
    dry = args.dry_run or not torch.cuda.is_available()
    plan = DRY if dry else GPU
    started = time.perf_counter()
    results = []
    with tempfile.TemporaryDirectory(prefix="xserv-acceptance-") as tmp:
        for name in args.shapes:
            path = args.reference_dir / SHAPES[name]
            if not path.is_file():
                print(f"[{name}] skipped: {path} not found (the published configs live in "
                      "shared/reference beside the repository)", file=sys.stderr)
                results.append({"shape": name, "skipped": f"{path} not found"})
                continue
            config = json.loads(path.read_text())
            text = config.get("text_config", config)  # a hybrid config nests the text model's
            if dry:
                text |= TINY | (TINY_MOE if text.get("num_experts") else {})
                if "text_config" in config:
                    text |= TINY_HYBRID
                    config["vision_config"] |= TINY_VISION
            elif name in GPU_LAYERS:
                text["num_hidden_layers"] = GPU_LAYERS[name]
            if "layer_types" in text:
                text["layer_types"] = text["layer_types"][: text["num_hidden_layers"]]
            print(f"[{name}] {'dry run, tiny shape, ' if dry else ''}{plan.device} ...", file=sys.stderr, flush=True)
            results.append(run_shape(name, config, plan, Path(tmp)))
    elapsed = time.perf_counter() - started
    device = torch.cuda.get_device_name() if not dry else "cpu (dry run)"
    report = {"device": device, "dry_run": dry, "plan": asdict(plan), "elapsed_s": round(elapsed, 1),
              "within_budget": elapsed < TIME_BUDGET_S, "results": results,
              "nano_vllm_published": {"hardware": "RTX 4070 Laptop", "workload": "Qwen3-0.6B, 256 seqs, 100-1024 in/out",
                                      "vllm_tok_s": 1361.84, "nano_vllm_tok_s": 1434.13, "ratio": 1.053}}
    out = Path(args.out)
    out.write_text(json.dumps(report, indent=2))
    text = table(results, plan.streams)
    out.with_suffix(".md").write_text(f"{device}, {elapsed:.0f} s\n\n{text}\n")
    print(text)
    print(f"{device}: {elapsed:.0f} s (budget {TIME_BUDGET_S} s); JSON in {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
