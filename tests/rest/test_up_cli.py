"""`xserv up` command lines, and the front's freedom from torch."""

import argparse
import signal
import subprocess
import sys

from xserv_cli import up
from xserv_rest import cli as rest_cli
from xserv_rest import gunicorn_conf
from xserv_engine.media import MediaPolicy, media_policy_from_args
from xserv_engine.server import cli as engine_cli


def command_lines(*argv: str) -> tuple[list[str], list[str]]:
    parser = argparse.ArgumentParser()
    up.add_arguments(parser)
    engine, rest = up.child_commands(parser.parse_args(list(argv)))
    return engine[3:], rest[3:]  # after "python -m xserv_cli"


def test_each_flag_goes_to_its_process():
    engine, rest = command_lines("--model", "/models/qwen3", "--port", "9000", "--grpc-port", "6000",
                                 "--host", "0.0.0.0", "--no-prefix-caching", "--max-num-seqs", "8",
                                 "--threads", "32", "--api-key", "k", "--log-level", "debug")
    assert engine == ["engine", "--host", "127.0.0.1", "--port", "6000", "--model", "/models/qwen3",
                      "--max-num-seqs", "8", "--no-prefix-caching", "--log-level", "debug"]
    assert rest == ["rest", "--engine", "127.0.0.1:6000", "--host", "0.0.0.0", "--port", "9000",
                    "--log-level", "debug", "--threads", "32", "--api-key", "k"]


def test_repeated_keys_and_limits_reach_the_front():
    _, rest = command_lines("--api-key", "a", "--api-key", "b", "--api-key-file", "/etc/keys",
                            "--max-n", "4", "--request-timeout", "30")
    assert rest[rest.index("--max-n"):] == ["--max-n", "4", "--request-timeout", "30.0", "--api-key", "a",
                                            "--api-key", "b", "--api-key-file", "/etc/keys"]


def test_defaults_stay_unsaid():
    engine, rest = command_lines()
    assert engine == ["engine", "--host", "127.0.0.1", "--port", "50051"]
    assert rest == ["rest", "--engine", "127.0.0.1:50051", "--host", "127.0.0.1", "--port", "8000",
                    "--log-level", "info"]


def test_the_drain_grace_reaches_the_engine_and_the_front():
    # The front used to keep gunicorn's 30 s while the engine waited 120: a stream still running
    # at 30 s was cut by the front in the middle of the engine's grace.
    engine, rest = command_lines("--drain-grace", "120")
    assert engine[engine.index("--drain-grace") + 1] == rest[rest.index("--drain-grace") + 1] == "120.0"
    parser = argparse.ArgumentParser()
    rest_cli.add_arguments(parser)
    config = rest_cli.config_from_args(parser.parse_args(rest[1:]))
    assert gunicorn_conf.settings(config)["graceful_timeout"] == 120


def test_the_image_flags_reach_the_front_and_the_engine(tmp_path):
    # The engine under `up` used to get none of them, so the image URLs an SMG router forwards
    # in media_refs were refused there unless they were data: URLs.
    engine, rest = command_lines("--allowed-media-domains", "images.example.com", "cdn.example.com",
                                 "--allowed-local-media-path", str(tmp_path), "--media-fetch-timeout", "2",
                                 "--max-image-bytes", "1000", "--limit-mm-per-prompt", '{"image": 2}')
    assert engine[engine.index("--limit-mm-per-prompt") + 1] == '{"image": 2}'
    expected = MediaPolicy(("images.example.com", "cdn.example.com"), str(tmp_path), 2.0, 1000)
    for argv, add_arguments in ((rest, rest_cli.add_arguments), (engine, engine_cli.add_arguments)):
        parser = argparse.ArgumentParser()
        add_arguments(parser)
        assert media_policy_from_args(parser.parse_args(argv[1:])) == expected


def test_the_front_and_the_command_never_import_torch():
    """Every module of xserv_rest and xserv_cli (up, bench) imports without torch: the front runs
    on a CPU box in front of GPU engines."""
    code = ("import importlib, pkgutil, sys, xserv_cli, xserv_rest\n"
            "for package in (xserv_rest, xserv_cli):\n"
            "    for module in pkgutil.walk_packages(package.__path__, package.__name__ + '.'):\n"
            "        if module.name != 'xserv_cli.__main__':\n"
            "            importlib.import_module(module.name)\n"
            "sys.exit('torch' in sys.modules)")
    assert subprocess.run([sys.executable, "-c", code]).returncode == 0


def _child(on_sigterm: str) -> subprocess.Popen:
    code = ("import signal, sys, time\n"
            f"signal.signal(signal.SIGTERM, {on_sigterm})\n"
            "print('ready', flush=True)\n"
            "time.sleep(60)\n")
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    assert child.stdout.readline() == "ready\n"
    return child


def test_after_a_requested_stop_up_exits_0_only_if_both_children_stopped_cleanly():
    clean = "lambda *_: sys.exit(0)"
    for rest_on_sigterm, expected in ((clean, 0), ("signal.SIG_IGN", 128 + 9)):
        children = {"engine": _child(clean), "rest": _child(rest_on_sigterm)}
        for child in children.values():  # what Ctrl-C / SIGTERM forwarding did already
            child.send_signal(signal.SIGTERM)
        assert up._shut_down(children, failed=False, grace_s=1.0) == expected  # a front stuck past the grace: killed


def test_port_zero_picks_one_free_port_that_both_processes_are_told():
    parser = argparse.ArgumentParser()
    up.add_arguments(parser)
    args = parser.parse_args(["--port", "0", "--grpc-port", "0"])
    up.resolve_free_ports(args)
    assert args.port > 0 and args.grpc_port > 0
    engine, rest = (cmd[3:] for cmd in up.child_commands(args))
    assert engine[engine.index("--port") + 1] == str(args.grpc_port)
    assert rest[rest.index("--engine") + 1] == f"127.0.0.1:{args.grpc_port}"
    assert rest[rest.index("--port") + 1] == str(args.port)
    kept = parser.parse_args(["--port", "9000", "--grpc-port", "6000"])
    up.resolve_free_ports(kept)
    assert (kept.port, kept.grpc_port) == (9000, 6000)


def test_a_worker_that_exits_by_unwinding_leaves_the_metrics_directory_to_the_next_one(monkeypatch):
    """gunicorn's workers are forks of the front's run(); one killed for a timeout exits with
    sys.exit, unwinding through run(). It must not remove the metrics directory the master and
    the next worker use (CI: "Worker failed to boot", FileNotFoundError in prometheus-client)."""
    import os

    seen = {}

    def run_like_gunicorn(self):
        metrics_dir = os.environ[rest_cli.MULTIPROC_ENV]
        pid = os.fork()
        if pid == 0:  # the worker: exits by unwinding, as after a timeout's SIGABRT
            raise SystemExit(1)
        os.waitpid(pid, 0)
        seen.update(dir=metrics_dir, after_worker_exit=os.path.isdir(metrics_dir))

    monkeypatch.setattr(rest_cli.RestApplication, "run", run_like_gunicorn)
    parser = argparse.ArgumentParser()
    rest_cli.add_arguments(parser)
    before = os.environ.get(rest_cli.MULTIPROC_ENV)
    try:
        rest_cli.run(parser.parse_args([]))
    except SystemExit:  # the forked worker, unwound through run(): it leaves here
        os._exit(0)
    finally:
        if before is None:
            os.environ.pop(rest_cli.MULTIPROC_ENV, None)
    assert seen["after_worker_exit"] is True
    assert not os.path.exists(seen["dir"])  # the master still cleans up


def test_the_mm_processor_reaches_the_engine_only():
    # an SMG router in front of `up`'s engine preprocesses images itself only if the engine says so
    engine, rest = command_lines("--mm-processor", "router")
    assert engine[engine.index("--mm-processor") + 1] == "router" and "--mm-processor" not in rest
    parser = argparse.ArgumentParser()
    engine_cli.add_arguments(parser)
    assert parser.parse_args(engine[1:]).mm_processor == "router"
    assert "--mm-processor" not in command_lines()[0]  # the default stays unsaid
