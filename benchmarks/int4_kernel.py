"""The 4-bit op against the 8-bit one on a model's decoder linears: every linear of --layers layers
of a Qwen3 shape, random weights (int4: groups of 128, zeros anywhere in 0..15), run back to back
as a decode step runs them, at 1, 4 and 16 rows of bf16 activations, on one thread (or --threads).

    python benchmarks/int4_kernel.py                       # Qwen3-0.6B's linears, all 28 layers
    python benchmarks/int4_kernel.py --shape 8B --layers 2
    python benchmarks/int4_kernel.py --shape 8B --layers 2 --threads 2   # as the server decodes

Timed two ways, alternating int4 and int8 each round, best of --rounds: wall time, and the
thread's CPU time (time.thread_time), which still counts the cycles a core waits on memory but not
the time another process holds it: on a VM whose two cores other work shares, the CPU time is the
comparison that survives the load (the wall times are printed beside it, with the load average).
With --threads above 1 the CPU time is the process's (time.process_time): all the threads' cycles.
"""

import argparse
import time

import torch

from xserv_engine.layers import int8, ops

GROUP = 128
SHAPES = {  # (N, K) of qkv, o, gate_up, down
    "0.6B": [(4096, 1024), (1024, 2048), (6144, 1024), (1024, 3072)],
    "8B": [(6144, 4096), (4096, 4096), (24576, 4096), (4096, 12288)],
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", choices=SHAPES, default="0.6B")
    parser.add_argument("--layers", type=int, default=28)
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    cpu_time = time.thread_time if args.threads == 1 else time.process_time
    w4, w8 = [], []
    for _ in range(args.layers):
        for n, k in SHAPES[args.shape]:
            qweight = torch.randint(0, 256, (n, k // 2), dtype=torch.uint8)
            zeros = torch.randint(0, 16, (n, k // GROUP), dtype=torch.uint8)
            w4.append((ops.prepare_int4(qweight, torch.rand(n, k // GROUP) * 0.01, zeros, GROUP), n, k))
            w8.append(int8.Int8Linear(torch.randint(-127, 128, (n, k), dtype=torch.int8), torch.rand(n), "native"))
    int4_bytes = sum(p[0].numel() + p[1].numel() * 4 + p[2].numel() for p, _, _ in w4)
    int8_bytes = sum(linear.packed.numel() + linear.scale.numel() * 4 for linear in w8)
    print(f"{args.shape} shape, {args.layers} layers: {len(w4)} linears, int4 {int4_bytes / 1e6:.0f} MB, "
          f"int8 {int8_bytes / 1e6:.0f} MB; {args.threads} thread(s)")
    for rows in (1, 4, 16):
        xs = {k: torch.randn(rows, k).bfloat16() for _, _, k in w4}
        runs = {"int4": lambda: [ops.int4_linear(xs[k], *p, GROUP, n) for p, n, k in w4],
                "int8": lambda: [linear(xs[linear.in_features]) for linear in w8]}
        best = {name: (float("inf"), float("inf")) for name in runs}
        for name, run in runs.items():
            run()
        for _ in range(args.rounds):
            for name, run in runs.items():
                cpu, wall = cpu_time(), time.perf_counter()
                run()
                cpu, wall = 1000 * (cpu_time() - cpu), 1000 * (time.perf_counter() - wall)
                best[name] = (min(best[name][0], cpu), min(best[name][1], wall))
        (c4, t4), (c8, t8) = best["int4"], best["int8"]
        print(f"rows {rows:2d}: CPU ms int4 {c4:.1f}, int8 {c8:.1f} (int8 / int4 {c8 / c4:.2f}x; int4 at "
              f"{int4_bytes / c4 / 1e6:.1f} GB/s, int8 {int8_bytes / c8 / 1e6:.1f}); wall ms int4 {t4:.1f}, "
              f"int8 {t8:.1f} ({t8 / t4:.2f}x)")
    print("load average", " ".join(open("/proc/loadavg").read().split()[:3]))


if __name__ == "__main__":
    main()
