"""One MoE layer's experts through each implementation of xserv::fused_experts, by step size.

    python benchmarks/moe_experts.py [--experts 128 --hidden 2048 --intermediate 768 --top-k 8]

Defaults: Qwen3-30B-A3B's layer (../shared/reference/qwen3/config-Qwen3-30B-A3B.json), bf16,
random weights. For each number of tokens in a step (1-16: decode, 512: a prefill chunk), the
median of 5 calls of the CPU kernel ("native"), torch's grouped matmul ("grouped") and, with
--loop, the per-expert loop, taking turns, each call with fresh router logits (a call then reads
experts the last one did not leave in the cache, as a decode step's next layer does), with the
bytes of the experts that got tokens per second (the decode ceiling is the machine's read
bandwidth). NATIVE_MAX_PAIRS in xserv_engine/layers/fused_moe.py is set from this table.
"""

import argparse
import statistics
import time

import torch

from xserv_engine.layers import fused_moe
from xserv_engine.layers.fused_moe import NATIVE_MAX_PAIRS, fused_experts, route


ROUNDS = 5


def settle(*tensors: torch.Tensor, seconds: float = 5.0) -> None:
    """Read freshly written weights for a few seconds before timing: on the 2-vCPU VM the first
    seconds of reads of gigabytes just written ran 5-10x slower (docs/benchmarks-log.md)."""
    start = time.perf_counter()
    while time.perf_counter() - start < seconds:
        for tensor in tensors:
            tensor.max()


def timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--experts", type=int, default=128)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--intermediate", type=int, default=768)
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64, 128, 512, 1024])
    parser.add_argument("--loop", action="store_true", help="also time the per-expert loop (slow)")
    args = parser.parse_args()
    gen = torch.Generator().manual_seed(0)
    e, h, i, k = args.experts, args.hidden, args.intermediate, args.top_k
    w13 = torch.randn(e, 2 * i, h, generator=gen, dtype=torch.bfloat16).mul_(0.02)
    w2 = torch.randn(e, h, i, generator=gen, dtype=torch.bfloat16).mul_(0.02)
    impls = ["native", "grouped"] + ["loop"] * args.loop
    settle(w13, w2)
    print(f"{e} experts, top-{k}, hidden {h}, intermediate {i}, bf16, {torch.get_num_threads()} threads; "
          f"the op takes the kernel up to {NATIVE_MAX_PAIRS} pairs")
    print(f"{'tokens':>6} {'experts hit':>11} " + " ".join(f"{name + ' ms':>11} {'GB/s':>5}" for name in impls)
          + "  native/grouped speed")
    with torch.inference_mode():
        for tokens in args.tokens:
            seconds, hits = {name: [] for name in impls}, []
            for call in range(ROUNDS + 1):  # the first: a warm-up
                x = torch.randn(tokens, h, generator=gen).bfloat16()
                weights, ids = route(torch.randn(tokens, e, generator=gen).bfloat16(), k, True)
                for name in impls:
                    fused_moe.force_implementation(name)
                    took = timed(lambda: fused_experts(x, w13, w2, weights, ids))
                    if call:
                        seconds[name].append(took)
                if call:
                    hits.append(torch.unique(ids).numel())
            fused_moe.force_implementation(None)
            hit = statistics.mean(hits)
            nbytes = hit * 3 * h * i * 2
            seconds = {name: statistics.median(times) for name, times in seconds.items()}
            cells = " ".join(f"{seconds[n] * 1e3:11.2f} {nbytes / seconds[n] / 1e9:5.1f}" for n in impls)
            print(f"{tokens:6d} {hit:11.1f} {cells}  {seconds['grouped'] / seconds['native']:.2f}x", flush=True)


if __name__ == "__main__":
    main()
