"""`xserv rest`: the OpenAI REST front under gunicorn (gthread workers), in front of engines.

`xserv up` reuses add_front_arguments() (the flags it passes through unchanged); --engine,
--host, --port, --log-level, --drain-grace and the engine token it sets itself.
"""

import argparse
import dataclasses
import logging
import os
import shutil
import tempfile

from gunicorn.app.base import BaseApplication

from xserv_rest import gunicorn_conf
from xserv_engine.tracing import INSTALL_HINT, TracingUnavailable, check_available
from xserv_rest.config import DEFAULT_ENGINE, RestConfig, default_responses_store, parse_engines, read_secrets
from xserv_engine.media import add_media_arguments, media_policy_from_args

_defaults = RestConfig()
# prometheus-client picks its multiprocess mode from this variable when it is first imported.
MULTIPROC_ENV = "PROMETHEUS_MULTIPROC_DIR"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--engine", default=DEFAULT_ENGINE, metavar="HOST:PORT[,HOST:PORT...]",
                        help="engine gRPC address(es); several are balanced round robin "
                             f"(default {DEFAULT_ENGINE})")
    add_listen_arguments(parser)
    add_front_arguments(parser)
    group = parser.add_argument_group("engine authentication")
    group.add_argument("--grpc-token", default=None, metavar="TOKEN",
                       help="sent to the engines as 'authorization: Bearer TOKEN' on every gRPC call")
    group.add_argument("--grpc-token-file", default=None, metavar="PATH",
                       help="read --grpc-token from the first line of PATH")
    tls = parser.add_argument_group("TLS to the engines (docs/scale-out.md)")
    tls.add_argument("--engine-tls-ca", default=None, metavar="PEM",
                     help="speak TLS to the engines, trusting certificates signed by this CA")
    tls.add_argument("--engine-tls-cert", default=None, metavar="PEM",
                     help="client certificate for engines that require one (xserv engine --grpc-tls-client-ca)")
    tls.add_argument("--engine-tls-key", default=None, metavar="PEM", help="the private key of --engine-tls-cert")
    parser.add_argument("--log-level", default=_defaults.log_level,
                        choices=["debug", "info", "warning", "error"], help="log level")
    parser.add_argument("--drain-grace", type=float, default=_defaults.drain_grace_s, metavar="S",
                        help="seconds running streams get to finish after SIGTERM (default %(default)g)")
    parser.add_argument("--otlp-traces-endpoint", default=None, metavar="URL",
                        help="export OpenTelemetry traces to this OTLP gRPC collector (HOST:PORT or "
                             f"http://HOST:PORT; https:// for TLS); needs {INSTALL_HINT} (default: off)")


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
    group.add_argument("--max-n", type=int, default=_defaults.max_n,
                       help=f"most choices (n) one request may ask for (default {_defaults.max_n})")
    group.add_argument("--request-timeout", type=float, default=_defaults.request_timeout_s, metavar="S",
                       help="seconds a request (a whole stream included) may take before it gets 504 "
                            f"and the engine aborts it (default {_defaults.request_timeout_s:g})")
    group.add_argument("--retry-after", type=int, default=_defaults.retry_after_s,
                       help="Retry-After seconds sent with 429 when the engine queue is full "
                            f"(default {_defaults.retry_after_s})")
    group.add_argument("--api-key", action="append", default=None, metavar="KEY",
                       help="require 'Authorization: Bearer KEY' on the API routes; repeatable")
    group.add_argument("--api-key-file", default=None, metavar="PATH",
                       help="accepted API keys, one per line (adds to --api-key)")
    group.add_argument("--responses-store", default=None, metavar="PATH",
                       help="SQLite file of stored /v1/responses, shared by the workers (default "
                            "$XDG_DATA_HOME/xserv/responses.sqlite3, ~/.local/share when unset)")
    group.add_argument("--responses-store-max-mb", type=int, default=_defaults.responses_max_bytes // 2**20,
                       metavar="MB", help="past this size the oldest stored responses go (default %(default)s)")
    group.add_argument("--responses-store-max-days", type=float, default=_defaults.responses_max_age_s / 86400,
                       metavar="DAYS", help="stored responses older than this go (default %(default)g)")
    group.add_argument("--max-background-responses", type=int, default=_defaults.max_background_responses,
                       metavar="N", help="background responses running at once, all workers together; more get 429 "
                                         "(default %(default)s)")
    group.add_argument("--no-web-ui", action="store_true",
                       help="serve no chat page at / (by default a browser there gets one)")
    add_media_arguments(parser)

def config_from_args(args: argparse.Namespace) -> RestConfig:
    api_keys = tuple(args.api_key or ())
    if args.api_key_file:
        api_keys += read_secrets(args.api_key_file, "API key")
    grpc_token = args.grpc_token
    if args.grpc_token_file:
        grpc_token = read_secrets(args.grpc_token_file, "gRPC token")[0]
    if args.max_n < 1 or args.request_timeout <= 0 or args.drain_grace < 0:
        raise ValueError("--max-n must be at least 1, --request-timeout positive and --drain-grace not negative")
    if (args.engine_tls_cert is None) != (args.engine_tls_key is None) or (args.engine_tls_cert and not args.engine_tls_ca):
        raise ValueError("--engine-tls-cert and --engine-tls-key go together, with --engine-tls-ca")
    for flag, path in (("--engine-tls-ca", args.engine_tls_ca), ("--engine-tls-cert", args.engine_tls_cert),
                       ("--engine-tls-key", args.engine_tls_key)):
        if path is not None and not os.path.isfile(path):  # fails here, not later in each worker
            raise ValueError(f"{flag} {path}: no such file")
    media = media_policy_from_args(args)
    if args.otlp_traces_endpoint is not None:
        try:
            check_available()
        except TracingUnavailable as exc:
            raise ValueError(str(exc)) from None
    return RestConfig(engines=parse_engines(args.engine), host=args.host, port=args.port,
                      workers=args.workers, threads=args.threads, max_body_bytes=args.max_body_bytes,
                      retry_after_s=args.retry_after, max_n=args.max_n,
                      request_timeout_s=args.request_timeout, drain_grace_s=args.drain_grace,
                      api_keys=api_keys, grpc_token=grpc_token,
                      log_level=args.log_level, engine_tls_ca=args.engine_tls_ca,
                      engine_tls_cert=args.engine_tls_cert, engine_tls_key=args.engine_tls_key,
                      responses_store=args.responses_store or default_responses_store(),
                      responses_max_bytes=args.responses_store_max_mb * 2**20,
                      responses_max_age_s=args.responses_store_max_days * 86400,
                      max_background_responses=args.max_background_responses, web_ui=not args.no_web_ui,
                      otlp_traces_endpoint=args.otlp_traces_endpoint,
                      media=media)


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
        # Imported here, in the worker: prometheus-client must first be imported after
        # PROMETHEUS_MULTIPROC_DIR is set, and the master never needs the app.
        from xserv_rest.app import create_app
        from xserv_rest.engine_client import EngineClient

        return create_app(self.config, EngineClient.from_config(self.config))


def run(args: argparse.Namespace) -> int:
    try:
        config = config_from_args(args)
    except ValueError as exc:
        raise SystemExit(f"xserv rest: {exc}")
    logging.basicConfig(level=config.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    metrics_dir = tempfile.mkdtemp(prefix="xserv-rest-metrics-")
    master = os.getpid()
    try:
        os.environ[MULTIPROC_ENV] = metrics_dir  # inherited by the workers gunicorn forks
        RestApplication(dataclasses.replace(config, metrics_dir=metrics_dir)).run()
    finally:
        # only the master removes it: a worker is a fork of this frame, and one that exits by
        # unwinding (sys.exit after a timeout's SIGABRT) would otherwise delete it under the
        # worker that replaces it, which then fails to boot (FileNotFoundError in prometheus-client)
        if os.getpid() == master:
            shutil.rmtree(metrics_dir, ignore_errors=True)
    return 0
