"""`xserv make-demo-model DIR`: write the random-weight demo checkpoint to a directory."""

import argparse
import sys

from xserv_engine.demo import MODEL_ID, write_demo_model


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("dir", metavar="DIR", help="directory to write the checkpoint into")
    parser.add_argument("--seed", type=int, default=0, help="seed of the random weights (default 0)")


def run(args: argparse.Namespace) -> int:
    write_demo_model(args.dir, seed=args.seed)
    print(f"wrote {MODEL_ID} (random weights, random output) to {args.dir}", file=sys.stderr)
    return 0
