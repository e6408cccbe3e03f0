"""`xserv up`: the engine and the REST front together, as two child processes.

It starts `xserv engine` (gRPC on 127.0.0.1:--grpc-port) and `xserv rest` (HTTP on --host:--port)
in process groups of their own, waits until both are healthy, prints where they are, forwards
Ctrl-C / SIGTERM to both (the engine drains, gunicorn finishes its streams) and exits when they
have. If either dies on its own, the other is stopped and `up` exits non-zero. A child whose
parent dies gets SIGTERM from the kernel, so none is left behind. torch is never imported here.
"""

import argparse
import ctypes
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from xserv_engine.errors import ModelLoadError
from xserv_engine.media import add_media_arguments
from xserv_engine.models.pooling import read_pooling_config
from xserv_engine.server import cli as engine_cli
from xserv_engine.tracing import TracingUnavailable, check_available
from xserv_rest import cli as rest_cli
from xserv_rest.config import RestConfig, read_secrets

ENGINE_HOST = "127.0.0.1"
PR_SET_PDEATHSIG = 1
# after SIGTERM, the children get their drain grace plus this long (the engine's shutdown after
# the grace) before SIGKILL
KILL_MARGIN_S = 30.0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("addresses")
    group.add_argument("--host", default="127.0.0.1", help="REST bind address (default: %(default)s)")
    group.add_argument("--port", type=int, default=8000, help="REST port; 0 picks a free one (default: %(default)s)")
    group.add_argument("--grpc-port", type=int, default=50051,
                       help=f"engine gRPC port, bound on {ENGINE_HOST}; 0 picks a free one (default: %(default)s)")
    group.add_argument("--ready-timeout", type=float, default=900.0,
                       help="seconds to wait for both to become healthy (default: %(default)s)")
    engine_cli.add_engine_arguments(parser)
    engine_cli.add_serving_arguments(parser)
    engine_cli.add_mm_processor_argument(parser)
    parser.set_defaults(log_level=None)  # unset: the engine and the front keep their own defaults
    rest_cli.add_front_arguments(parser)


def child_commands(args: argparse.Namespace) -> tuple[list[str], list[str]]:
    """The engine's and the front's command lines; every flag left at its default stays unsaid."""
    xserv = [sys.executable, "-m", "xserv_cli"]
    engine = [*xserv, "engine", "--host", ENGINE_HOST, "--port", str(args.grpc_port),
              *_forwarded(args, engine_cli.add_engine_arguments, engine_cli.add_serving_arguments,
                          add_media_arguments,  # the engine loads the URLs of SMG's media_refs
                          engine_cli.add_mm_processor_argument)]
    rest = [*xserv, "rest", "--engine", f"{ENGINE_HOST}:{args.grpc_port}", "--host", args.host,
            "--port", str(args.port), "--log-level", _rest_log_level(args),
            *_forwarded(args, rest_cli.add_front_arguments), *_drain_flags(args), *_token_flags(args),
            *_trace_flags(args)]
    return engine, rest


def _drain_flags(args: argparse.Namespace) -> list[str]:
    """The engine's --drain-grace, handed to the front too: gunicorn would otherwise cut a stream
    at its own grace while the engine still lets it run."""
    return [] if args.drain_grace == RestConfig().drain_grace_s else ["--drain-grace", str(args.drain_grace)]


def _trace_flags(args: argparse.Namespace) -> list[str]:
    """The engine's --otlp-traces-endpoint, handed to the front too: one trace spans both."""
    return [] if args.otlp_traces_endpoint is None else ["--otlp-traces-endpoint", args.otlp_traces_endpoint]


def _token_flags(args: argparse.Namespace) -> list[str]:
    """The engine's --grpc-token(-file), handed to the front too, so that its calls pass."""
    if args.grpc_token_file is not None:
        return ["--grpc-token-file", args.grpc_token_file]
    return [] if args.grpc_token is None else ["--grpc-token", args.grpc_token]


def _rest_log_level(args: argparse.Namespace) -> str:
    """--log-level as given, else the front's own default (the engine's default is quieter)."""
    return args.log_level or RestConfig().log_level


def _forwarded(args: argparse.Namespace, *add_functions) -> list[str]:
    scratch = argparse.ArgumentParser(add_help=False)
    for add in add_functions:
        add(scratch)
    argv = []
    for action in scratch._actions:  # argparse keeps no public list of a parser's options
        value = getattr(args, action.dest)
        if value == action.default or value is None:
            continue
        flag = action.option_strings[-1]
        if action.nargs == 0:
            argv.append(flag)
        elif isinstance(value, list):  # a repeatable flag (action="append")
            argv += [part for item in value for part in (flag, str(item))]
        else:
            argv += [flag, str(value)]
    return argv


def resolve_free_ports(args: argparse.Namespace) -> None:
    """--port 0 / --grpc-port 0: a free port picked here (as --metrics-port 0 does), so that both
    children, the readiness check and the banner agree on it."""
    if args.grpc_port == 0:
        args.grpc_port = _free_port(ENGINE_HOST)
    if args.port == 0:
        args.port = _free_port(args.host)


def _free_port(host: str) -> int:
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]


def run(args: argparse.Namespace) -> int:
    if args.otlp_traces_endpoint is not None:
        try:
            check_available()
        except TracingUnavailable as exc:
            raise SystemExit(f"xserv up: {exc}")
    resolve_free_ports(args)
    engine_cmd, rest_cmd = child_commands(args)
    children = {"engine": _spawn(engine_cmd), "rest": _spawn(rest_cmd)}
    stopping = _forward_signals(children)
    try:
        stop_grace_s = args.drain_grace + KILL_MARGIN_S
        if not _wait_ready(args, children, stopping):
            return _shut_down(children, not stopping, stop_grace_s)
        _print_ready(args)
        while not stopping and all(child.poll() is None for child in children.values()):
            time.sleep(0.2)
        return _shut_down(children, not stopping, stop_grace_s)
    finally:
        _sweep(children)


def _spawn(cmd: list[str]) -> subprocess.Popen:
    return subprocess.Popen(cmd, process_group=0, preexec_fn=_die_with_parent)


def _die_with_parent() -> None:
    """Runs in the child before exec: SIGTERM it if `xserv up` dies, even by SIGKILL (Linux)."""
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


def _forward_signals(children: dict[str, subprocess.Popen]) -> list[int]:
    """Ctrl-C / SIGTERM: the first asks both children to drain; a second one kills them."""
    stopping: list[int] = []

    def on_signal(signum, frame) -> None:
        stopping.append(signum)
        for child in children.values():
            _signal(child, signal.SIGTERM if len(stopping) == 1 else signal.SIGKILL)

    signal.signal(signal.SIGINT, on_signal)
    signal.signal(signal.SIGTERM, on_signal)
    return stopping


def _wait_ready(args, children: dict[str, subprocess.Popen], stopping: list[int]) -> bool:
    deadline = time.monotonic() + args.ready_timeout
    with grpc.insecure_channel(f"{ENGINE_HOST}:{args.grpc_port}") as channel:
        health = health_pb2_grpc.HealthStub(channel)
        while time.monotonic() < deadline and not stopping:
            if any(child.poll() is not None for child in children.values()):
                return False
            if _engine_serving(health) and _rest_healthy(args):
                return True
            time.sleep(0.25)
    if not stopping:
        print(f"xserv up: not healthy after {args.ready_timeout:.0f}s; stopping", file=sys.stderr)
    return False


def _engine_serving(health: health_pb2_grpc.HealthStub) -> bool:
    try:
        reply = health.Check(health_pb2.HealthCheckRequest(service=""), timeout=1)
    except grpc.RpcError:
        return False
    return reply.status == health_pb2.HealthCheckResponse.SERVING


def _rest_healthy(args) -> bool:
    try:
        with urllib.request.urlopen(f"{_rest_url(args)}/health", timeout=2) as resp:
            return resp.status == 200
    except OSError:
        return False


def _rest_url(args) -> str:
    host = "127.0.0.1" if args.host in ("0.0.0.0", "", "::") else args.host
    return f"http://{host}:{args.port}"


def _print_ready(args) -> None:
    url = _rest_url(args)
    api_key = _first_api_key(args)
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    request = urllib.request.Request(f"{url}/v1/models", headers=headers)
    with urllib.request.urlopen(request, timeout=5) as resp:
        cards = json.load(resp)["data"]
    model, adapters = cards[0]["id"], [card["id"] for card in cards[1:]]  # the base model, then its LoRA adapters
    if args.runner == "score":
        path, body = "rerank", json.dumps({"model": model, "query": "What is xserv?",
                                           "documents": ["A serving system.", "A fruit."]})
    elif _embeds(args):
        path, body = "embeddings", json.dumps({"model": model, "input": "Hello!"})
    else:
        path, body = "chat/completions", json.dumps({"model": model, "messages": [{"role": "user", "content": "Hello!"}]})
    chat = path == "chat/completions"
    auth = f" -H 'Authorization: Bearer {api_key}'" if api_key else ""
    lora = [f"  LoRA         {', '.join(adapters)}  (a request's \"model\" picks one)"] if adapters else []
    print("\n".join([f"xserv up: serving {model}", f"  OpenAI REST  {url}/v1",
                     f"  gRPC         {ENGINE_HOST}:{args.grpc_port}  (grpcurl -plaintext {ENGINE_HOST}:{args.grpc_port} list)",
                     *lora,
                     f"  try: curl {url}/v1/{path} -H 'Content-Type: application/json'{auth} -d '{body}'",
                     *([f"  chat page    {url}/  (open it in a browser)"] if chat and not args.no_web_ui else []),
                     "  Ctrl-C stops both."]), flush=True)


def _embeds(args) -> bool:
    """Whether the engine runs the pooling runner (an embedding model): the engine's own rule."""
    if args.runner != "auto" or args.model is None:
        return args.runner == "pooling"
    try:
        return read_pooling_config(Path(args.model).expanduser()) is not None
    except ModelLoadError:
        return False


def _first_api_key(args) -> str | None:
    """A key the front accepts (--api-key repeats; --api-key-file adds keys), for the banner."""
    keys = list(args.api_key or ())
    if args.api_key_file:
        keys += read_secrets(args.api_key_file, "API key")
    return keys[0] if keys else None


def _shut_down(children: dict[str, subprocess.Popen], failed: bool, grace_s: float) -> int:
    """Stop what still runs, killing what has not stopped grace_s after SIGTERM. After a
    requested stop: 0 if both children stopped cleanly, else the first one's exit code (a child
    killed after the grace period counts); after a failure: the first failure's exit code."""
    dead = [(name, child.returncode) for name, child in children.items() if child.poll() is not None]
    if failed and dead:
        print(f"xserv up: {dead[0][0]} exited with code {dead[0][1]}; stopping the rest", file=sys.stderr)
    if failed:  # after Ctrl-C / SIGTERM the children have had their signal already
        for child in children.values():
            _signal(child, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for child in children.values():
        try:
            child.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            _signal(child, signal.SIGKILL)
            child.wait()
    if failed:
        return next((code for _, code in dead if code), 1)
    for name, child in children.items():
        if child.returncode:
            code = child.returncode if child.returncode > 0 else 128 - child.returncode
            print(f"xserv up: {name} stopped with exit code {child.returncode}", file=sys.stderr)
            return code
    return 0


def _signal(child: subprocess.Popen, signum: int) -> None:
    if child.poll() is None:
        child.send_signal(signum)


def _sweep(children: dict[str, subprocess.Popen]) -> None:
    """Kill whatever is left in the children's process groups (e.g. orphaned gunicorn workers)."""
    for child in children.values():
        if child.poll() is None:
            child.kill()
            child.wait()
        try:
            os.killpg(child.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
