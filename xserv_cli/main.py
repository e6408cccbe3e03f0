"""The `xserv` console script. Each subcommand lives in its own module and is imported lazily,
so `xserv rest` never imports torch."""

import argparse
import importlib
import os
import sys

# name -> (module with add_arguments(parser) and run(args) -> int, help)
SUBCOMMANDS = {
    "engine": ("xserv_engine.server.cli", "serve the gRPC engine"),
    "rest": ("xserv_rest.cli", "serve the OpenAI REST front (gunicorn) in front of engines"),
    "up": ("xserv_cli.up", "start engine and REST front together"),
    "make-demo-model": ("xserv_engine.demo_cli", "write the random-weight demo checkpoint"),
    "bench": ("xserv_cli.bench.cli", "load-test any OpenAI-compatible endpoint"),
}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    # grpc logs through absl, which writes its INFO lines to stderr unless told a level: Ctrl-C in
    # `xserv up` printed "I1207 ... chttp2_transport.cc ... Got goaway ... err=UNAVAILABLE" from the
    # front's channel, which reads like a fault. Before grpc is imported; the children inherit it.
    os.environ.setdefault("GRPC_VERBOSITY", "ERROR")
    parser = argparse.ArgumentParser(prog="xserv", description="Serve Qwen3 models over gRPC and OpenAI REST.")
    subparsers = parser.add_subparsers(dest="command", required=True)
    chosen = argv[0] if argv and argv[0] in SUBCOMMANDS else None
    modules = {}
    for name, (module_name, help_text) in SUBCOMMANDS.items():
        sub = subparsers.add_parser(name, help=help_text, description=help_text[0].upper() + help_text[1:] + ".")
        if name == chosen:
            modules[name] = importlib.import_module(module_name)
            modules[name].add_arguments(sub)
    args = parser.parse_args(argv)
    return modules[args.command].run(args) or 0
