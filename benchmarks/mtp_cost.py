"""What one MTP draft step costs beside one target step, on a random Qwen3.5 checkpoint with a
multi-token-prediction layer (Qwen3.5-0.8B's shape by default). Random weights make its drafts
worthless, so its acceptance cannot be measured here: only its cost.

    .venv/bin/python benchmarks/mtp_cost.py                # writes the checkpoint once (make_random_model.py --mtp)
    .venv/bin/python benchmarks/mtp_cost.py --model DIR --passes 4

Two engines in one process, alternated pass by pass, one stream of --input-len random prompt
tokens and --output-len greedy new tokens each pass: a plain one, and one with
{"method": "mtp", "num_speculative_tokens": 1, "disable_when_slower": false} whose back-off is
switched off, so that every step drafts. Timed (medians, milliseconds): the plain engine's
decode steps (ModelRunner.run of one row: the whole model); the MTP engine's draft steps
(MtpDrafter.propose: the layer over the 2 positions a step verified, the LM head, argmax) and its
verifications (ModelRunner.run of 2 rows).

Then the payoff rule (engine/spec_payoff.py) with such a drafter: a third engine, with
{"method": "mtp", "num_speculative_tokens": 1} as a server would run it (rule and back-off on),
alternated with the plain one for --passes more passes; its tok/s against plain decoding's, and
how many of its decode steps were verifications (trials and probes) rather than plain steps.
"""

import argparse
import json
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from moe import cpu_description  # noqa: E402
from xserv_engine.config import EngineConfig  # noqa: E402
from xserv_engine.engine import speculative  # noqa: E402
from xserv_engine.engine.engine_thread import EngineThread  # noqa: E402
from xserv_engine.engine.llm_engine import LLMEngine  # noqa: E402
from xserv_engine.engine.model_runner import ModelRunner  # noqa: E402
from xserv_engine.engine.mtp_drafter import MtpDrafter  # noqa: E402
from xserv_engine.sampling_params import SamplingParams  # noqa: E402

CONFIG = Path(__file__).resolve().parents[1].parent / "shared" / "reference" / "qwen3_5" / "config-Qwen3.5-0.8B.json"
DEFAULT_MODEL = Path.home() / ".cache" / "xserv" / "bench" / "Qwen3.5-0.8B-24layers-random-mtp"
MTP = '{"method": "mtp", "num_speculative_tokens": 1, "disable_when_slower": false}'
SERVED = '{"method": "mtp", "num_speculative_tokens": 1}'


def model_dir(args) -> str:
    if args.model:
        return args.model
    if not (DEFAULT_MODEL / "config.json").exists():
        if not CONFIG.exists():
            sys.exit(f"mtp_cost: {CONFIG} is absent (../shared); pass --model DIR")
        subprocess.run([sys.executable, str(Path(__file__).with_name("make_random_model.py")), "--config",
                        str(CONFIG), "--mtp", str(DEFAULT_MODEL)], check=True)
    return str(DEFAULT_MODEL)


def timing(times: dict) -> None:
    """Record the seconds of every draft step and of every decode-only model step (by rows)."""
    propose, run = MtpDrafter.propose, ModelRunner.run

    def timed_propose(self, seqs, rooms):
        start = time.perf_counter()
        out = propose(self, seqs, rooms)
        times["draft step"].append(time.perf_counter() - start)
        return out

    def timed_catch_up(self, seqs):
        start = time.perf_counter()
        catch_up(self, seqs)
        times["catch-up"].append(time.perf_counter() - start)

    def timed_run(self, batch):
        start = time.perf_counter()
        out = run(self, batch)
        if not batch.prefills:
            key = "verification (2 rows)" if batch.verifies else "target step (1 row)"
            times[key].append(time.perf_counter() - start)
            if not batch.verifies:
                times.setdefault(id(self), []).append(time.perf_counter() - start)  # per engine
        return out

    catch_up = MtpDrafter.catch_up
    MtpDrafter.propose, MtpDrafter.catch_up, ModelRunner.run = timed_propose, timed_catch_up, timed_run


def generate(engine: EngineThread, prompt: list[int], max_tokens: int) -> float:
    """Seconds to generate max_tokens greedy tokens after prompt."""
    done = []
    start = time.perf_counter()
    engine.add_request(f"mtp-cost-{time.perf_counter_ns()}", prompt,
                       SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True),
                       lambda out: done.append(time.perf_counter()) if out.finished else None)
    while not done:
        time.sleep(0.005)
    return done[0] - start


def start(model: str, dtype: str, speculative_config: str | None) -> EngineThread:
    engine = EngineThread(LLMEngine(EngineConfig(model=model, dtype=dtype, device="cpu", language_model_only=True,
                                                 speculative_config=speculative_config), progress=False))
    engine.start()
    generate(engine, [random.Random(1).randrange(0, 151643) for _ in range(64)], 16)  # unclocked warm-up
    return engine


def alternate(engines: list[EngineThread], passes: int, input_len: int, output_len: int, name: str) -> list:
    """passes runs of one random prompt each on every engine, the order flipped each pass; the
    seconds of each run, per engine."""
    rng = random.Random(0)
    seconds = [[] for _ in engines]
    for index in range(passes):
        prompt = [rng.randrange(0, 151643) for _ in range(input_len)]
        order = list(range(len(engines))) if index % 2 == 0 else list(range(len(engines)))[::-1]
        for i in order:
            seconds[i].append(generate(engines[i], prompt, output_len))
        print(f"mtp_cost: {name} pass {index + 1} done", file=sys.stderr, flush=True)
    return seconds


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="a Qwen3.5 checkpoint with mtp.* weights")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--passes", type=int, default=3)
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    args = parser.parse_args()
    model = model_dir(args)
    times = {"target step (1 row)": [], "draft step": [], "verification (2 rows)": [], "catch-up": []}
    plain = start(model, args.dtype, None)
    try:
        backoff = speculative.BACKOFF_AFTER
        speculative.BACKOFF_AFTER = 10**9  # every step drafts: the cost of a draft step, not the rule's choice
        always = start(model, args.dtype, MTP)
        timing(times)
        for value in times.values():
            value.clear()
        try:
            alternate([plain, always], args.passes, args.input_len, args.output_len, "cost")
            drafted, cost = always.stats().spec, {key: list(value) for key, value in times.items()}
        finally:
            always.shutdown()
        speculative.BACKOFF_AFTER = backoff
        served = start(model, args.dtype, SERVED)
        try:
            before = served.stats().spec
            caught_up, plain_before = len(times["catch-up"]), len(times[id(plain.engine.runner)])
            seconds = alternate([plain, served], args.passes, args.input_len, args.output_len, "payoff")
            after = served.stats().spec
            plain_steps = times[id(plain.engine.runner)][plain_before:]
            served_steps = times[id(served.engine.runner)]
            payoff = {"verifications": after.num_drafts - before.num_drafts, "catch-ups": times["catch-up"][caught_up:],
                      "plain step ms": 1000 * statistics.median(plain_steps),
                      "its plain step ms": 1000 * statistics.median(served_steps)}
        finally:
            served.shutdown()
    finally:
        plain.shutdown()
    report(args, model, cost, drafted, seconds, payoff)
    return 0


def report(args, model: str, times: dict, drafted, seconds: list, payoff: dict) -> None:
    cpu = cpu_description()
    medians = {key: 1000 * statistics.median(value) for key, value in times.items() if value and isinstance(key, str)}
    print(f"\n{Path(model).name} ({args.dtype}), {args.input_len}-token prompt, {args.output_len} new tokens, "
          f"{args.passes} passes a side; {torch.get_num_threads()} threads\nCPU: {cpu}\n\n--speculative-config {MTP}, "
          f"back-off off: accepted {drafted.num_accepted_tokens} of {drafted.num_draft_tokens} drafts\n")
    print("| step | median ms | steps timed | / target step | first one ms |")
    print("|---|---|---|---|---|")
    base = medians["target step (1 row)"]
    for key, value in medians.items():  # the first: what a shape met for the first time costs
        print(f"| {key} | {value:.2f} | {len(times[key])} | {value / base:.2f} | {1000 * times[key][0]:.2f} |")
    tokens = args.passes * args.output_len
    plain_rate, served_rate = tokens / sum(seconds[0]), tokens / sum(seconds[1])
    pairs = [p / s for p, s in zip(*seconds)]
    print(f"\n--speculative-config {SERVED} (payoff rule and back-off on) against plain decoding: "
          f"{plain_rate:.1f} -> {served_rate:.1f} tok/s, {served_rate / plain_rate:.2f}x (pairs {min(pairs):.2f}-"
          f"{max(pairs):.2f}); {payoff['verifications']} of its ~{tokens} decode steps verified drafts; "
          f"{len(payoff['catch-ups'])} catch-ups, {1000 * sum(payoff['catch-ups']):.0f} ms in all; median plain "
          f"step {payoff['its plain step ms']:.2f} ms (the plain engine's {payoff['plain step ms']:.2f} ms)")
    print(json.dumps({"cpu": cpu, "model": model, "median_ms": medians, "plain_tok_s": plain_rate,
                      "mtp_tok_s": served_rate, "payoff": payoff}), file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
