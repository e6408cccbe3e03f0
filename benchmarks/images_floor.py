"""The compute floor of one image request on this machine: how fast any server could answer
benchmarks/images.py's request if every multiply ran at the CPU's measured matmul rate.

    .venv/bin/python benchmarks/images_floor.py --llama-ttft 9.96 --llama-tok-s 2.9

Counts the multiply-adds of one image request on the checkpoint's shapes (read from its
safetensors headers and config, nothing loaded): the vision tower over the image's patches (patch
embedding, every block's linears, bidirectional attention, the merger), then the text prefill of
the prompt (every decoder linear, causal attention in the full-attention layers, the Gated
DeltaNet's chunked rule, one LM-head row). It then measures torch's bf16 matmul rate (every core)
at each part's own GEMM shapes: the tower's MLP, its attention's Q K^T and P V at head dim 64 (one
dimension 64 wide: slower per FLOP, as the table shows), the text MLP. The floor is each
part's FLOPs at its shapes' rate. Nothing real runs that fast (softmax, norms, convolutions, the
recurrence, decoding and resizing the image, and the Python around them are left out), so a real
server's time is above the floor. For scale it also times torch's own attention kernel (SDPA) at
the tower's shape, softmax and all.
Given llama.cpp's measured TTFT and 8-stream tokens/s (benchmarks/images.py), it prints the best
ratios any server using these GEMMs could reach, beside issue 51's targets (TTFT <= 0.5x,
8 streams >= 2x).
"""

import argparse
import sys
import time
from pathlib import Path

import torch
from safetensors import safe_open

sys.path.insert(0, str(Path(__file__).resolve().parent))
from moe import cpu_description  # noqa: E402

from xserv_engine.models.loader import read_model_dir  # noqa: E402
from xserv_engine.multimodal.image_processor import ImageProcessorConfig, smart_resize  # noqa: E402

DEFAULT_MODEL = Path.home() / ".cache/xserv/bench/Qwen3.5-0.8B-24layers-vision-random"
GDN_CHUNK = 64


def weight_shapes(model_dir: Path) -> dict[str, list[int]]:
    shapes = {}
    for path in sorted(model_dir.glob("*.safetensors")):
        with safe_open(str(path), "pt") as f:
            shapes.update({name: f.get_slice(name).get_shape() for name in f.keys()})
    return shapes


def numel(shape: list[int]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def vision_flops(shapes: dict, vision, patches: int) -> dict[str, float]:
    """Each matrix multiplies every patch (the merger's, every merged token) once: 2 FLOPs a weight."""
    merged = patches // vision.spatial_merge_size ** 2
    linears = sum(2 * patches * numel(s) for name, s in shapes.items()
                  if name.startswith("model.visual.blocks.") and name.endswith(".weight") and len(s) == 2)
    linears += 2 * patches * numel(shapes["model.visual.patch_embed.proj.weight"])
    linears += sum(2 * merged * numel(s) for name, s in shapes.items()
                   if name.startswith("model.visual.merger.") and name.endswith(".weight") and len(s) == 2)
    # Q K^T and P V over all patch pairs of the image, every head: 4 N^2 d per block
    attention = vision.depth * 4 * patches ** 2 * vision.hidden_size
    return {"vision linears": linears, "vision attention": attention}


def text_flops(shapes: dict, text, tokens: int) -> dict[str, float]:
    prefix = "model.language_model.layers."
    linears = sum(2 * tokens * numel(s) for name, s in shapes.items()
                  if name.startswith(prefix) and name.endswith(".weight") and len(s) == 2)
    head = shapes.get("lm_head.weight", shapes["model.language_model.embed_tokens.weight"])
    full = text.layer_types.count("full_attention")
    linear_layers = text.layer_types.count("linear_attention")
    # causal Q K^T and P V: half the pairs
    attention = full * 2 * tokens ** 2 * text.num_attention_heads * text.head_dim
    dk, dv, heads = text.linear.key_head_dim, text.linear.value_head_dim, text.linear.num_value_heads
    # the chunked rule per token and head: the chunk's intra attention (q k^T, then times v and the
    # decayed k v products) and the state's read and update (q S, k S, k^T v)
    gdn = linear_layers * tokens * heads * (2 * GDN_CHUNK * (2 * dk + dv) + 6 * dk * dv)
    return {"text linears": linears, "text attention": attention, "Gated DeltaNet": gdn,
            "LM head (1 row)": 2 * numel(head)}


def matmul_rate(m: int, k: int, n: int, seconds: float = 1.5) -> float:
    """torch's bf16 matmul rate at [m, k] x [k, n], FLOP/s, on every core."""
    a, b = torch.randn(m, k, dtype=torch.bfloat16), torch.randn(k, n, dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    runs, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        a @ b
        runs += 1
    return 2 * m * k * n * runs / (time.perf_counter() - start)


def attention_seconds(n: int, heads: int, head_dim: int, seconds: float = 1.5) -> float:
    """torch's own attention (SDPA, its CPU flash kernel) over one image of n patches, one layer, bf16."""
    q, k, v = (torch.randn(1, heads, n, head_dim, dtype=torch.bfloat16) for _ in range(3))
    for _ in range(2):
        torch.nn.functional.scaled_dot_product_attention(q, k, v)
    runs, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        torch.nn.functional.scaled_dot_product_attention(q, k, v)
        runs += 1
    return (time.perf_counter() - start) / runs


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", type=Path, default=DEFAULT_MODEL,
                        help="the checkpoint (default: images.py's, in the user cache)")
    parser.add_argument("--width", type=int, default=1024)
    parser.add_argument("--height", type=int, default=768)
    parser.add_argument("--text-tokens", type=int, default=23,
                        help="prompt tokens besides the image's (default: 23, images.py's question and template)")
    parser.add_argument("--streams", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=32, help="new tokens per request (default: 32)")
    parser.add_argument("--llama-ttft", type=float, default=None, help="llama.cpp's median TTFT, s (images.py)")
    parser.add_argument("--llama-tok-s", type=float, default=None, help="llama.cpp's tok/s at --streams (images.py)")
    args = parser.parse_args(argv)

    text = read_model_dir(str(args.model)).config  # xserv's reading, defaults filled
    vision = text.vision
    pre = ImageProcessorConfig.from_dir(str(args.model))
    h, w = smart_resize(args.height, args.width, pre.factor, pre.min_pixels, pre.max_pixels)
    patches = (h // pre.patch_size) * (w // pre.patch_size)
    tokens = patches // pre.merge_size ** 2 + args.text_tokens
    shapes = weight_shapes(args.model)
    flops = {**vision_flops(shapes, vision, patches), **text_flops(shapes, text, tokens)}
    total = sum(flops.values())

    print(f"CPU: {cpu_description()}; torch threads {torch.get_num_threads()}")
    print(f"{args.model.name}: a {args.width}x{args.height} image -> {h}x{w}, {patches} patches, "
          f"{patches // pre.merge_size ** 2} image tokens; prompt {tokens} tokens\n")
    print("| part | GFLOP |\n|---|---|")
    for name, value in flops.items():
        print(f"| {name} | {value / 1e9:.1f} |")
    print(f"| **one image request** | **{total / 1e9:.0f}** |\n")

    head_dim = vision.hidden_size // vision.num_heads
    gemms = {  # each part's own GEMM shape(s): [m, k] x [k, n]
        "vision linears": [(patches, vision.hidden_size, vision.intermediate_size)],
        "vision attention": [(patches, head_dim, patches), (patches, patches, head_dim)],
        "text linears": [(tokens, text.hidden_size, text.intermediate_size)],
    }
    shape_rates = {shape: matmul_rate(*shape) for shapes_ in gemms.values() for shape in shapes_}
    shape_rates[(4096, 4096, 4096)] = matmul_rate(4096, 4096, 4096)
    print("| torch bf16 matmul [m, k] x [k, n] | GFLOP/s |\n|---|---|")
    for shape, rate in shape_rates.items():
        print(f"| {list(shape)} | {rate / 1e9:.0f} |")
    peak = max(shape_rates.values())
    # each part at the mean rate of its own shapes (others, small, at the peak)
    part_rates = {name: len(shapes_) / sum(1 / shape_rates[s] for s in shapes_) for name, shapes_ in gemms.items()}
    floor = sum(value / part_rates.get(name, peak) for name, value in flops.items())
    print(f"\nfloor of one image request, every part at its own shapes' matmul rate: {floor:.2f} s "
          f"({total / peak:.2f} s were all of it at the best rate, {peak / 1e9:.0f} GFLOP/s)")
    # what torch's attention kernel takes for the tower's attention (softmax included), for comparison
    sdpa = vision.depth * attention_seconds(patches, vision.num_heads, head_dim)
    at_rate = flops["vision attention"] / part_rates["vision attention"]
    print(f"the tower's attention in torch's SDPA (softmax and all): {sdpa:.2f} s, against {at_rate:.2f} s "
          f"for its matmuls at their rate; the floor with it: {floor - at_rate + sdpa:.2f} s")
    if args.llama_ttft:
        print(f"  against llama.cpp's TTFT {args.llama_ttft:.2f} s: {floor / args.llama_ttft:.2f}x at best "
              f"(target <= 0.50x)")
    # N requests prefill at the floor; their decode steps are left out (they only lower the ceiling)
    ceiling = args.streams * args.max_tokens / (args.streams * floor)
    print(f"{args.streams} streams of {args.max_tokens} tokens: at most {ceiling:.1f} tok/s "
          f"(prefills alone at the floor)")
    if args.llama_tok_s:
        print(f"  against llama.cpp's {args.llama_tok_s:.1f} tok/s: {ceiling / args.llama_tok_s:.2f}x at best "
              f"(target >= 2x)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
