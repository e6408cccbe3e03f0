"""`xserv rest`: the OpenAI REST front under gunicorn (gthread workers), in front of engines.

`xserv up` reuses add_front_arguments() (the flags it passes through unchanged); --engine,
--host, --port and --log-level it sets itself.
"""

import argparse
import logging

from gunicorn.app.base import BaseApplication

from xserv_rest import gunicorn_conf
from xserv_rest.app import create_app
from xserv_rest.config import DEFAULT_ENGINE, RestConfig, parse_engines
from xserv_rest.engine_client import EngineClient

_defaults = RestConfig()


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--engine", default=DEFAULT_ENGINE, metavar="HOST:PORT[,HOST:PORT...]",
                        help="engine gRPC address(es); several are balanced round robin "
                             f"(default {DEFAULT_ENGINE})")
    add_listen_arguments(parser)
    add_front_arguments(parser)
    parser.add_argument("--log-level", default=_defaults.log_level,
                        choices=["debug", "info", "warning", "error"], help="gunicorn log level")


def add_listen_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--host", default=_defaults.host, help=f"HTTP bind address (default {_defaults.host})")
    parser.add_argument("--port", type=int, default=_defaults.port, help=f"HTTP port (default {_defaults.port})")


def add_front_arguments(parser: argparse.ArgumentParser) -> None:
    """The flags `xserv up` passes through to the front as they are."""
    group = parser.add_argument_group("REST front")
    group.add_argument("--workers", type=int, default=_defaults.workers,
                       help=f"gunicorn worker processes (default {_defaults.workers})")
    group.add_argument("--threads", type=int, default=_defaults.threads,
                       help="threads per worker = concurrent requests per worker, streams included "
                            f"(default {_defaults.threads})")
    group.add_argument("--max-body-bytes", type=int, default=_defaults.max_body_bytes,
                       help=f"larger request bodies get 413 (default {_defaults.max_body_bytes})")
    group.add_argument("--retry-after", type=int, default=_defaults.retry_after_s,
                       help="Retry-After seconds sent with 429 when the engine queue is full "
                            f"(default {_defaults.retry_after_s})")
    group.add_argument("--api-key", default=None,
                       help="require 'Authorization: Bearer KEY' on every route but /health")


def config_from_args(args: argparse.Namespace) -> RestConfig:
    return RestConfig(engines=parse_engines(args.engine), host=args.host, port=args.port,
                      workers=args.workers, threads=args.threads, max_body_bytes=args.max_body_bytes,
                      retry_after_s=args.retry_after, api_key=args.api_key, log_level=args.log_level)


class RestApplication(BaseApplication):
    """gunicorn, configured in code. load() runs in each worker after fork (no preload), so the
    app, and later its gRPC channel, are never built in the master."""

    def __init__(self, config: RestConfig):
        self.config = config
        super().__init__()

    def load_config(self) -> None:
        for name, value in gunicorn_conf.settings(self.config).items():
            self.cfg.set(name, value)

    def load(self):
        return create_app(self.config, EngineClient(self.config.engines))


def run(args: argparse.Namespace) -> int:
    try:
        config = config_from_args(args)
    except ValueError as exc:
        raise SystemExit(f"xserv rest: {exc}")
    logging.basicConfig(level=config.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    RestApplication(config).run()
    return 0
