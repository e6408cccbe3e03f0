"""Write a random-weight Qwen3, Qwen3-MoE, Qwen3.5 or Qwen3.5-MoE checkpoint of a given config's shape, for benchmarks.

    python benchmarks/make_random_model.py --config ../shared/reference/qwen3/config-Qwen3-0.6B.json OUT
    python benchmarks/make_random_model.py --config ../shared/reference/qwen3/config-Qwen3-30B-A3B.json \
        --num-layers 8 OUT
    python benchmarks/make_random_model.py --config ../shared/reference/qwen3_5/config-Qwen3.5-35B-A3B.json \
        --num-layers 8 OUT
    python benchmarks/make_random_model.py --config ../shared/reference/qwen3_5/config-Qwen3.5-0.8B.json --vision OUT

bf16 weights under Hugging Face names (norms ones and their biases zeros, the rest, routers
included, normal(0, 0.02), so
that tokens pick varied experts), sharded at about 2 GB with a model.safetensors.index.json when
larger. A Qwen3.5 config (a `text_config` inside) gives its text weights as transformers 5 names
them for Qwen3_5ForConditionalGeneration (`model.language_model.*`), an MoE layer's experts one
by one beside its gated shared expert; no vision tower unless --vision asks for one
(`model.visual.*`, named and shaped as transformers 5 saves the config's architecture, with the
preprocessor_config.json and the chat template Qwen3.5's releases ship), and no multi-token-prediction layer unless
--mtp asks for one (`mtp.*`, as the real checkpoints have: xserv drafts with it under
`--speculative-config '{"method": "mtp", ...}'`; llama.cpp's converter leaves it out with --no-mtp). The tokenizer, chat template and
generation config are copied from xserv's demo model of the same generation (the real Qwen3 or
Qwen3.5 vocabulary). Output is random text: the checkpoint measures speed, never answers.
"""

import argparse
import json
import re
import shutil
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file
from tqdm import tqdm

from xserv_engine import demo_qwen3_5
from xserv_engine.demo import QWEN3_DEMO, default_model_dir, mlp_shapes, weight_shapes

SHARD_BYTES = 2 * 1024**3
COPIED = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "generation_config.json")
# Qwen3.5's own chat template, which renders an image part as its placeholder (the demo's has no images)
QWEN3_5_TEMPLATE = Path(__file__).resolve().parents[2] / "shared" / "reference" / "qwen3_5" / "chat_template-Qwen3.5-4B.jinja"
# as Qwen3-VL's and Qwen3.5's releases ship it: images kept between 256 and 16,384 merged tokens
PREPROCESSOR = {"size": {"shortest_edge": 65536, "longest_edge": 16777216}, "patch_size": 16,
                "temporal_patch_size": 2, "merge_size": 2, "image_mean": [0.5, 0.5, 0.5],
                "image_std": [0.5, 0.5, 0.5], "processor_class": "Qwen3VLProcessor",
                "image_processor_type": "Qwen2VLImageProcessorFast"}


def shard(shapes: list[tuple[str, tuple[int, ...]]]) -> list[list[tuple[str, tuple[int, ...]]]]:
    """Consecutive groups of tensors of at most SHARD_BYTES (bf16) each, a lone bigger tensor excepted."""
    shards, size = [[]], 0
    for name, shape in shapes:
        nbytes = 2 * torch.Size(shape).numel()
        if shards[-1] and size + nbytes > SHARD_BYTES:
            shards.append([])
            size = 0
        shards[-1].append((name, shape))
        size += nbytes
    return shards


def is_hybrid(config: dict) -> bool:
    """A Qwen3.5 config: Gated DeltaNet and full-attention layers, the text model's shape in text_config."""
    return "text_config" in config


def text_config(config: dict) -> dict:
    """The text model's config: a Qwen3.5's text_config, else config itself."""
    return config.get("text_config", config)


def hybrid_weight_shapes(text: dict) -> list[tuple[str, tuple[int, ...]]]:
    """Qwen3.5 text tensors for `text` (a text_config): the demo's layout; with num_experts, each
    layer's MLP is a router and per-expert projections, then a shared expert and its gate."""
    if not text.get("num_experts"):
        return demo_qwen3_5.weight_shapes(text)
    shared = text | {"intermediate_size": text["shared_expert_intermediate_size"]}
    shapes = []  # the demo's dense MLP, at the shared expert's size, becomes the shared expert
    for name, shape in demo_qwen3_5.weight_shapes(shared):
        p, mlp, projection = name.partition(".mlp.")
        if not mlp:
            shapes.append((name, shape))
            continue
        if projection == "gate_proj.weight":
            shapes += mlp_shapes(text, True, p + mlp)
        shapes.append((f"{p}.mlp.shared_expert.{projection}", shape))
        if projection == "down_proj.weight":
            shapes.append((p + ".mlp.shared_expert_gate.weight", (1, text["hidden_size"])))
    return shapes


def checkpoint_shapes(config: dict) -> list[tuple[str, tuple[int, ...]]]:
    """Every tensor the checkpoint of `config` holds, named and shaped as Hugging Face writes it."""
    return hybrid_weight_shapes(config["text_config"]) if is_hybrid(config) else weight_shapes(config)


def vision_shapes(config: dict) -> list[tuple[str, tuple[int, ...]]]:
    """The vision tower's tensors (`model.visual.*`) as transformers 5 saves config's architecture,
    read off that model built on the meta device (nothing allocated), not written out by hand."""
    import transformers

    fields = {k: v for k, v in config.items() if k not in ("architectures", "transformers_version", "torch_dtype")}
    with torch.device("meta"):
        model = getattr(transformers, config["architectures"][0])(transformers.AutoConfig.for_model(**fields))
    return [(name, tuple(t.shape)) for name, t in model.state_dict().items() if name.startswith("model.visual.")]


def random_tensor(name: str, shape: tuple[int, ...], generator: torch.Generator) -> torch.Tensor:
    """A norm's weight ones and its bias (a vision LayerNorm's) zeros; anything else normal(0, 0.02)."""
    if re.search(r"norm\d?\.weight$", name):
        return torch.ones(shape, dtype=torch.bfloat16)
    if re.search(r"norm\d?\.bias$", name):
        return torch.zeros(shape, dtype=torch.bfloat16)
    return torch.normal(0.0, 0.02, shape, generator=generator).to(torch.bfloat16)


def write_weights(out: Path, config: dict, seed: int, vision: bool = False) -> None:
    """The text weights, then (vision) the tower's, drawn in that order: the text ones are the same either way."""
    generator = torch.Generator().manual_seed(seed)
    shapes = checkpoint_shapes(config) + (vision_shapes(config) if vision else [])
    groups = shard(shapes)
    names = ["model.safetensors"] if len(groups) == 1 else [
        f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors" for i in range(len(groups))]
    weight_map, total = {}, 0
    with tqdm(total=len(shapes), desc="random weights", unit="tensor", file=sys.stderr) as progress:
        for file_name, group in zip(names, groups):
            tensors = {}
            for name, shape in group:
                tensors[name] = random_tensor(name, shape, generator)
                weight_map[name] = file_name
                total += 2 * tensors[name].numel()
                progress.update()
            save_file(tensors, str(out / file_name), metadata={"format": "pt"})
    if len(groups) > 1:
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")


def write_random_model(config_path: str, out_dir: str | Path, num_layers: int | None = None, seed: int = 0,
                       mtp: bool = False, vision: bool = False) -> dict:
    """Write the checkpoint into out_dir (created); return its config. mtp: a Qwen3.5's with one
    multi-token-prediction layer; vision: with its vision tower and preprocessor_config.json."""
    config = json.loads(Path(config_path).read_text()) | {"torch_dtype": "bfloat16"}
    text = with_layers(config, num_layers, mtp)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    demo = Path(default_model_dir(demo_qwen3_5.QWEN3_5_DEMO if is_hybrid(config) else QWEN3_DEMO))
    for name in COPIED:
        shutil.copy(demo / name, out / name)
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    write_weights(out, config, seed, vision)
    if vision:
        (out / "preprocessor_config.json").write_text(json.dumps(PREPROCESSOR, indent=2) + "\n")
        shutil.copy(QWEN3_5_TEMPLATE, out / "chat_template.jinja")
    tower = " with its vision tower" if vision else ""
    print(f"wrote a random-weight {text['num_hidden_layers']}-layer {config.get('model_type', 'qwen3')}{tower} to {out}",
          file=sys.stderr)
    return config


def with_layers(config: dict, num_layers: int | None, mtp: bool = False) -> dict:
    """Keep the first num_layers decoder layers (all when None) in `config`, in place; return the
    text model's config (config itself, or a Qwen3.5's text_config, whose layer_types are cut
    too and which gets one multi-token-prediction layer with mtp, else none: none is written)."""
    text = text_config(config)
    if num_layers is not None:
        text["num_hidden_layers"] = num_layers
    if is_hybrid(config):
        text["layer_types"] = text["layer_types"][: text["num_hidden_layers"]]
        text["mtp_num_hidden_layers"] = 1 if mtp else 0
    return text


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", required=True,
                        help="a Qwen3, Qwen3-MoE, Qwen3.5 or Qwen3.5-MoE config.json (e.g. config-Qwen3-0.6B.json)")
    parser.add_argument("--num-layers", type=int, default=None,
                        help="keep only the first N decoder layers (e.g. a 48-layer MoE that would not fit in memory)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--mtp", action="store_true",
                        help="Qwen3.5: write its multi-token-prediction layer (mtp.*) too, for method mtp")
    parser.add_argument("--vision", action="store_true",
                        help="write the vision tower too (model.visual.*) and a preprocessor_config.json, so that "
                             "the checkpoint takes images; the config must have a vision_config")
    parser.add_argument("out", help="directory to write (created)")
    args = parser.parse_args()
    config = json.loads(Path(args.config).read_text())
    if args.mtp and not is_hybrid(config):
        parser.error("--mtp: only a Qwen3.5 config has a multi-token-prediction layer")
    if args.vision and not (is_hybrid(config) and "vision_config" in config and config.get("architectures")):
        parser.error("--vision: only a Qwen3.5 config with its vision_config and architectures "
                     "(e.g. config-Qwen3.5-0.8B.json)")
    write_random_model(args.config, args.out, args.num_layers, args.seed, args.mtp, args.vision)
    return 0


if __name__ == "__main__":
    sys.exit(main())
