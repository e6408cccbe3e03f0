"""`xserv make-demo-model DIR [--arch qwen3|qwen3_5]`: write a random-weight demo checkpoint to a directory."""

import argparse
import sys

from xserv_engine.demo import QWEN3_DEMO, write_demo_model
from xserv_engine.demo_qwen3_5 import QWEN3_5_DEMO

ARCHS = {"qwen3": QWEN3_DEMO, "qwen3_5": QWEN3_5_DEMO}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("dir", metavar="DIR", help="directory to write the checkpoint into")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random weights (default 0)")
    parser.add_argument("--arch", choices=sorted(ARCHS), default="qwen3",
                        help="qwen3: Qwen3ForCausalLM (default); qwen3_5: a Qwen3.5 hybrid (Gated DeltaNet and "
                             "gated attention layers), text weights only, with Qwen3.5's vocabulary")


def run(args: argparse.Namespace) -> int:
    model = ARCHS[args.arch]
    write_demo_model(args.dir, seed=args.seed, model=model)
    print(f"wrote {model.model_id} (random weights, random output) to {args.dir}", file=sys.stderr)
    return 0
