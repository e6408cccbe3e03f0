"""The vision tower alone, as the engine runs it for one image: the Qwen3.5-0.8B tower's shape
(random weights, bf16) over a 1024x768 image's 3,072 patches, its attention by the native op
(layers/ops.py vision_attention) and by torch's SDPA (the torch path), run in turns.

    .venv/bin/python benchmarks/vision_tower.py                  # 2 threads, 3 rounds
    .venv/bin/python benchmarks/vision_tower.py --threads 1 --rounds 5

Prints each way's CPU time (the process's, all threads: steadier than wall time beside other
jobs) and wall time, best and median over the rounds, and how far the two outputs differ.
--model reads a checkpoint directory's vision_config instead of the 0.8B shape.
"""

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("GOMP_SPINCOUNT", "10000")  # as the engine runs (xserv_engine/openmp.py)

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
from moe import cpu_description  # noqa: E402

from xserv_engine.layers import linear, native, ops  # noqa: E402
from xserv_engine.models.qwen3_vision import Qwen3VisionModel, VisionConfig  # noqa: E402

# Qwen3.5-0.8B's vision_config (the 2B to 9B towers are wider, the same depth)
QWEN3_5_0_8B = dict(depth=12, hidden_size=768, intermediate_size=3072, num_heads=12, out_hidden_size=1024,
                    num_position_embeddings=2304, patch_size=16, temporal_patch_size=2, spatial_merge_size=2)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, default=None, help="a checkpoint directory (its vision_config)")
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--height", type=int, default=768)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args(argv)

    torch.set_num_threads(args.threads)
    vision = json.loads((args.model / "config.json").read_text())["vision_config"] if args.model else QWEN3_5_0_8B
    cfg = VisionConfig.from_hf(vision)
    factor = cfg.patch_size * cfg.spatial_merge_size
    h, w = args.height // factor * cfg.spatial_merge_size, args.width // factor * cfg.spatial_merge_size
    torch.manual_seed(0)
    tower = Qwen3VisionModel(cfg)
    with torch.no_grad():
        for p in tower.parameters():
            p.normal_(0, 0.02)
    tower = tower.to(torch.bfloat16).eval()
    grid, pixels = [(1, h, w)], torch.randn(h * w, cfg.patch_dim)
    ways = {"torch SDPA": False}
    if native.load_torch_ops() and linear.native_bf16():
        ways["native vision_attention"] = True
    else:
        print("the native attention does not run here (needs the native ops, AVX512-BF16, no AMX)")
    print(f"CPU: {cpu_description()}; torch threads {torch.get_num_threads()}")
    print(f"tower: depth {cfg.depth}, width {cfg.hidden_size}, {cfg.num_heads} heads x {cfg.head_dim}; "
          f"{h * w} patches ({args.width}x{args.height})\n")

    times: dict[str, list[tuple[float, float]]] = {name: [] for name in ways}
    outputs = {}
    with torch.inference_mode():
        for name, on in ways.items():  # warm-up, and each way's output
            ops.set_native(on)
            outputs[name] = tower(pixels, grid).embeddings.float()
        for _ in range(args.rounds):
            for name, on in ways.items():
                ops.set_native(on)
                wall, cpu = time.perf_counter(), time.process_time()
                tower(pixels, grid)
                times[name].append((time.process_time() - cpu, time.perf_counter() - wall))
    ops.set_native(False)
    print("| attention | CPU s best | CPU s median | wall s best | wall s median |\n|---|---|---|---|---|")
    for name, runs in times.items():
        cpu, wall = [r[0] for r in runs], [r[1] for r in runs]
        print(f"| {name} | {min(cpu):.2f} | {statistics.median(cpu):.2f} | {min(wall):.2f} | "
              f"{statistics.median(wall):.2f} |")
    if len(outputs) == 2:
        a, b = outputs.values()
        print(f"\nmax |native - SDPA| over the image's embeddings: {(a - b).abs().max():.3g} "
              f"(largest |embedding| {b.abs().max():.3g})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
