"""One MoE layer's experts through each implementation of xserv::fused_experts, by step size.

    python benchmarks/moe_experts.py [--experts 128 --hidden 2048 --intermediate 768 --top-k 8]

Defaults: Qwen3-30B-A3B's layer (../shared/reference/qwen3/config-Qwen3-30B-A3B.json), bf16,
random weights and router logits. For each number of tokens in a step (1-8: decode, 512: a
prefill chunk), the best of 5 calls of the CPU kernel ("native"), torch's grouped matmul
("grouped") and, with --loop, the per-expert loop, with the bytes of the experts that got tokens
per second (the decode ceiling is the machine's read bandwidth). NATIVE_MAX_PAIRS in
xserv_engine/layers/fused_moe.py is set from this table.
"""

import argparse
import time

import torch

from xserv_engine.layers import fused_moe
from xserv_engine.layers.fused_moe import NATIVE_MAX_PAIRS, fused_experts, route


def best_of(fn, rounds: int = 5) -> float:
    fn()
    best = float("inf")
    for _ in range(rounds):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--experts", type=int, default=128)
    parser.add_argument("--hidden", type=int, default=2048)
    parser.add_argument("--intermediate", type=int, default=768)
    parser.add_argument("--top-k", type=int, default=8)
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64, 128, 512])
    parser.add_argument("--loop", action="store_true", help="also time the per-expert loop (slow)")
    args = parser.parse_args()
    gen = torch.Generator().manual_seed(0)
    e, h, i, k = args.experts, args.hidden, args.intermediate, args.top_k
    w13 = (torch.randn(e, 2 * i, h, generator=gen) * 0.02).bfloat16()
    w2 = (torch.randn(e, h, i, generator=gen) * 0.02).bfloat16()
    impls = ["native", "grouped"] + ["loop"] * args.loop
    print(f"{e} experts, top-{k}, hidden {h}, intermediate {i}, bf16, {torch.get_num_threads()} threads; "
          f"the op takes the kernel up to {NATIVE_MAX_PAIRS} pairs")
    print(f"{'tokens':>6} {'experts hit':>11} " + " ".join(f"{name + ' ms':>11} {'GB/s':>5}" for name in impls)
          + "  native/grouped speed")
    with torch.inference_mode():
        for tokens in args.tokens:
            x = torch.randn(tokens, h, generator=gen).bfloat16()
            weights, ids = route(torch.randn(tokens, e, generator=gen).bfloat16(), k, True)
            hit = torch.unique(ids).numel()
            nbytes = hit * 3 * h * i * 2
            seconds = {}
            for name in impls:
                fused_moe.force_implementation(name)
                seconds[name] = best_of(lambda: fused_experts(x, w13, w2, weights, ids))
            fused_moe.force_implementation(None)
            cells = " ".join(f"{seconds[n] * 1e3:11.2f} {nbytes / seconds[n] / 1e9:5.1f}" for n in impls)
            print(f"{tokens:6d} {hit:11d} {cells}  {seconds['grouped'] / seconds['native']:.2f}x", flush=True)


if __name__ == "__main__":
    main()
