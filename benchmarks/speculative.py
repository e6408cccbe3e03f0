"""Speculative decoding's speed and acceptance: the same engine with and without
--speculative-config, side by side in one process, on the same prompts.

    .venv/bin/python benchmarks/speculative.py                       # the demo model
    .venv/bin/python benchmarks/speculative.py --shape 0.6B          # Qwen3-0.6B's shape, random weights
    .venv/bin/python benchmarks/speculative.py --streams 1 4 16 64 --workloads loop
    .venv/bin/python benchmarks/speculative.py --shape 0.6B --draft-layers 7   # a draft model: the
        # target's first 7 layers (embeddings, final norm and LM head kept); --draft-layers 0: the
        # target itself drafting (acceptance's upper bound)

Workloads (random prompts of --input-len tokens, --output-len new tokens, ignore_eos):
  loop     greedy. Random-weight models fall into repeating loops under greedy decoding, so the
           n-gram lookup finds what comes next in the output itself: the case speculation is for
           (code edits, quoting answers, RAG), with whatever acceptance it measures.
  sampled  temperature 1: the model's next token is nearly random, drafts are rarely proposed and
           almost never right. What speculation costs where it cannot help.
  replay   greedy, with the n-gram lookup replaced by a replay of the plain engine's own output for
           that prompt, every other proposal's third draft wrong (acceptance about 0.75): text
           that repeats its context, for models whose random weights never loop (Qwen3.5's
           0.8B shape repeats no 2-gram in 200 greedy tokens). The lookup itself costs a few us.

Both engines are loaded at once (an idle engine waits without using the CPU) and each
(streams, workload) runs --passes times on each, alternating plain, speculative, speculative,
plain, ... in one process, so that this machine's drift within minutes (1.6x seen) weighs on
both alike. Prints the CPU, both sides' tok/s over all their runs, the ratio with the range of
the per-pair ratios, the acceptance rate (accepted / proposed draft tokens) and the mean tokens
per verified step, as one table. The speculating engine keeps what its payoff rule learned from
run to run, as a server does.
"""

import argparse
import json
import random
import sys
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from moe import cpu_description  # noqa: E402
from xserv_engine.config import EngineConfig  # noqa: E402
from xserv_engine.demo import default_model_dir  # noqa: E402
from xserv_engine.engine.engine_thread import EngineThread  # noqa: E402
from xserv_engine.engine.llm_engine import LLMEngine  # noqa: E402
from xserv_engine.sampling_params import SamplingParams  # noqa: E402

REFERENCE = Path(__file__).resolve().parents[1].parent / "shared" / "reference" / "qwen3"
BENCH_CACHE = Path.home() / ".cache" / "xserv" / "bench"
WORKLOADS = {"loop": dict(temperature=0.0), "sampled": dict(temperature=1.0), "replay": dict(temperature=0.0)}


def model_dir(args) -> str:
    if args.model:
        return args.model
    if args.shape == "demo":
        return str(default_model_dir())
    path = BENCH_CACHE / "Qwen3-0.6B-28layers-random"
    if not (path / "config.json").exists():  # written by make_random_model.py from the published config
        import subprocess

        config = REFERENCE / "config-Qwen3-0.6B.json"
        if not config.exists():
            sys.exit(f"speculative: {config} is absent (../shared); pass --model DIR")
        subprocess.run([sys.executable, str(Path(__file__).with_name("make_random_model.py")), "--config",
                        str(config), str(path)], check=True)
    return str(path)


def truncated_draft(model: str, layers: int) -> str:
    """The target with only its first `layers` decoder layers (0: the target itself), written once
    beside it: a draft model that shares its embeddings, head and tokenizer."""
    if layers == 0:
        return model
    from safetensors.torch import load_file, save_file

    src = Path(model)
    out = src.parent / f"{src.name}-draft-{layers}layers"
    if (out / "config.json").exists():
        return str(out)
    out.mkdir(parents=True, exist_ok=True)
    tensors = {}
    for shard in sorted(src.glob("*.safetensors")):
        for name, tensor in load_file(shard).items():
            if not name.startswith("model.layers.") or int(name.split(".")[2]) < layers:
                tensors[name] = tensor
    save_file(tensors, out / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((src / "config.json").read_text())
    (out / "config.json").write_text(json.dumps({**config, "num_hidden_layers": layers}, indent=2))
    for extra in src.iterdir():  # the tokenizer, chat template, generation config
        if extra.is_file() and ".safetensors" not in extra.name and extra.name != "config.json":
            (out / extra.name).write_bytes(extra.read_bytes())
    return str(out)


class Replay:
    """ngram_propose's stand-in for the replay workload: the next k tokens of a prompt's known
    greedy continuation, every other proposal's third draft wrong."""

    def __init__(self):
        self.continuations: dict[tuple[int, ...], list[int]] = {}
        self.calls = 0

    def __call__(self, token_ids: list[int], k: int, lookup_min: int, lookup_max: int) -> list[int]:
        for prompt, continuation in self.continuations.items():
            if tuple(token_ids[: len(prompt)]) == prompt:
                done = len(token_ids) - len(prompt)
                drafts = list(continuation[done : done + k])
                self.calls += 1
                if self.calls % 2 and len(drafts) > 2:
                    drafts[2] = (drafts[2] + 1) % 151643
                return drafts
        return []


REPLAY = Replay()


def run(engine: EngineThread, prompts: list[list[int]], params: SamplingParams, streams: int,
        outputs: list | None = None) -> tuple[float, int]:
    """(seconds, output tokens) of `prompts`, at most `streams` in flight; each prompt's tokens
    into outputs, if given."""
    slots = threading.Semaphore(streams)
    done = threading.Semaphore(0)
    tokens = [0]
    lock = threading.Lock()
    if outputs is not None:
        outputs[:] = [[] for _ in prompts]

    def on_output(out):
        with lock:
            tokens[0] += len(out.token_ids)
            if outputs is not None:
                outputs[int(out.request_id.rsplit("-", 1)[1])].extend(out.token_ids)
        if out.finished:
            slots.release()
            done.release()

    start = time.perf_counter()
    for i, prompt in enumerate(prompts):
        slots.acquire()
        engine.add_request(f"spec-bench-{id(prompts)}-{i}", prompt, params, on_output)
    for _ in prompts:
        done.acquire()
    return time.perf_counter() - start, tokens[0]


def start(args, model: str, speculative: str | None) -> EngineThread:
    config = EngineConfig(model=model, dtype=args.dtype, device="cpu", quantization=args.quantization,
                          max_num_seqs=max(args.streams), speculative_config=speculative,
                          language_model_only=args.language_model_only, kv_cache_memory_gb=args.kv_cache_memory_gb)
    engine = EngineThread(LLMEngine(config, progress=False))
    engine.start()
    warm = SamplingParams(max_tokens=32, temperature=0.0, ignore_eos=True)
    run(engine, [list(range(100, 164))] * 2, warm, 2)  # unclocked: the first steps after a start are slower
    return engine


def measure(engine: EngineThread, params: SamplingParams, streams: int, prompts: list) -> dict:
    """One run of `prompts` on `engine`: seconds, tokens and the speculation counters it moved."""
    before = engine.stats().spec
    seconds, tokens = run(engine, prompts, params, streams)
    after = engine.stats().spec
    row = {"seconds": seconds, "tokens": tokens, "proposed": 0, "accepted": 0, "verifies": 0}
    if after is not None:
        row |= {"proposed": after.num_draft_tokens - before.num_draft_tokens,
                "accepted": after.num_accepted_tokens - before.num_accepted_tokens,
                "verifies": after.num_drafts - before.num_drafts}
    return row


def total(rows: list[dict]) -> dict:
    """Runs added up; tok/s over all of them."""
    summed = {key: sum(row[key] for row in rows) for key in rows[0]}
    return summed | {"tok_s": summed["tokens"] / summed["seconds"]}


def compare(args, plain: EngineThread, spec: EngineThread, cases: list) -> dict:
    """Each case's runs on both engines, alternating plain, speculative, speculative, plain, ... so
    that a drift of the machine within minutes weighs on both alike; per case the two sides'
    totals and each pair's ratio."""
    results = {}
    for streams, workload, prompts in cases:
        params = SamplingParams(max_tokens=args.output_len, ignore_eos=True, seed=None, **WORKLOADS[workload])
        if workload == "replay":  # the continuations the drafts replay: one unclocked plain run
            outputs: list = []
            run(plain, prompts, params, streams, outputs)
            REPLAY.continuations = {tuple(p): out for p, out in zip(prompts, outputs)}
        runs = {"plain": [], "spec": []}
        for index in range(args.passes):
            order = ("plain", "spec") if index % 2 == 0 else ("spec", "plain")
            for side in order:
                runs[side].append(measure(plain if side == "plain" else spec, params, streams, prompts))
            print(f"speculative: {streams:>3} stream(s) {workload:7} pass {index + 1}: "
                  + ", ".join(f"{side} {runs[side][-1]['tokens'] / runs[side][-1]['seconds']:.1f} tok/s"
                              for side in ("plain", "spec")), file=sys.stderr, flush=True)
        pairs = [(s["tokens"] / s["seconds"]) / (p["tokens"] / p["seconds"]) for p, s in zip(runs["plain"], runs["spec"])]
        results[(streams, workload)] = {"plain": total(runs["plain"]), "spec": total(runs["spec"]), "pairs": pairs}
    return results


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", choices=("demo", "0.6B"), default="demo", help="the model (default: demo)")
    parser.add_argument("--model", default=None, help="a checkpoint directory instead of --shape")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--quantization", default=None, choices=("int8",))
    parser.add_argument("--streams", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--workloads", nargs="+", choices=sorted(WORKLOADS), default=["loop", "sampled"])
    parser.add_argument("--rounds", type=int, default=2, help="requests per stream in a run (default: 2)")
    parser.add_argument("--passes", type=int, default=4, help="runs per side and case, alternating (default: 4)")
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--speculative-config", default='{"method": "ngram", "num_speculative_tokens": 4}')
    parser.add_argument("--draft-layers", type=int, default=None, metavar="N",
                        help="speculate with a draft model: the target truncated to its first N layers (0: the "
                             "target itself) instead of --speculative-config's n-gram lookup")
    parser.add_argument("--draft-model", default=None, metavar="DIR",
                        help="speculate with this draft model (e.g. one of other random weights: drafts never "
                             "right, the worst case)")
    parser.add_argument("--language-model-only", action="store_true",
                        help="a vision-language checkpoint's text model alone (vLLM's flag)")
    parser.add_argument("--kv-cache-memory-gb", type=float, default=None, help="each engine's (default: 1 on CPU)")
    parser.add_argument("--json", default=None, metavar="PATH", help="write the results as JSON")
    args = parser.parse_args()
    model = model_dir(args)
    if args.draft_layers is not None or args.draft_model:
        draft = args.draft_model or truncated_draft(model, args.draft_layers)
        k = json.loads(args.speculative_config).get("num_speculative_tokens", 4)
        args.speculative_config = json.dumps({"model": draft, "num_speculative_tokens": k})
    rng = random.Random(0)
    cases = [(s, w, [[rng.randrange(0, 151643) for _ in range(args.input_len)] for _ in range(s * args.rounds)])
             for s in args.streams for w in args.workloads]
    cpu = cpu_description()
    print(f"speculative: CPU: {cpu}; model {model}", file=sys.stderr)
    if "replay" in args.workloads:
        import xserv_engine.engine.speculative as speculative

        speculative.ngram_propose = REPLAY
    plain, spec = start(args, model, None), start(args, model, args.speculative_config)
    try:
        results = compare(args, plain, spec, cases)
    finally:
        plain.shutdown()
        spec.shutdown()
    print(f"\n{Path(model).name} ({args.dtype}{', int8' if args.quantization else ''}), {args.input_len}-token "
          f"prompts, {args.output_len} new tokens, {args.rounds} request(s) per stream a run, {args.passes} runs a "
          f"side, alternating; {torch.get_num_threads()} threads\nCPU: {cpu}\n--speculative-config "
          f"{args.speculative_config}\n")
    print("| streams | workload | plain tok/s | speculative tok/s | ratio (pairs: min-max) | acceptance "
          "| tokens per verify | draft tokens |")
    print("|---|---|---|---|---|---|---|---|")
    for streams, workload, _ in cases:
        row = results[(streams, workload)]
        p, s = row["plain"], row["spec"]
        acceptance = f"{s['accepted'] / s['proposed']:.2f}" if s["proposed"] else "-"
        per_verify = f"{(s['verifies'] + s['accepted']) / s['verifies']:.2f}" if s["verifies"] else "-"
        print(f"| {streams} | {workload} | {p['tok_s']:.1f} | {s['tok_s']:.1f} | {s['tok_s'] / p['tok_s']:.2f}x "
              f"({min(row['pairs']):.2f}-{max(row['pairs']):.2f}) | {acceptance} | {per_verify} | {s['proposed']} |")
    if args.json:
        Path(args.json).write_text(json.dumps({"cpu": cpu, "model": model, "args": vars(args),
                                               "results": {str(k): v for k, v in results.items()}}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
