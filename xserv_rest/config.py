"""REST front configuration: one frozen dataclass built at the CLI (or in wsgi.py) and passed down."""

import os
from dataclasses import dataclass

from xserv_engine.media import MediaPolicy

DEFAULT_ENGINE = "127.0.0.1:50051"


@dataclass(frozen=True)
class RestConfig:
    engines: tuple[str, ...] = (DEFAULT_ENGINE,)  # HOST:PORT of each engine replica
    host: str = "127.0.0.1"
    port: int = 8000
    # A stream's thread spends its life blocked on the gRPC stream (the GIL is released), so one
    # thread per concurrent stream is cheap: 2 workers x 128 threads hold 256 streams at once
    # without queuing in the front, and two processes keep JSON/SSE encoding off one GIL.
    workers: int = 2
    threads: int = 128
    # larger bodies get 413; room for a few photos as data: URLs (base64 adds a third)
    max_body_bytes: int = 32 * 1024 * 1024
    retry_after_s: int = 1  # Retry-After on 429 when the engine queue is full
    max_n: int = 16  # most choices one request may ask for
    request_timeout_s: float = 600.0  # the deadline of each Generate call, streams included
    drain_grace_s: float = 30.0  # after SIGTERM, how long running streams get to finish (gunicorn's graceful_timeout)
    api_keys: tuple[str, ...] = ()  # when set, requests must send "Authorization: Bearer <one of them>"
    grpc_token: str | None = None  # sent to the engines as "authorization: Bearer <token>"
    # TLS to the engines (PEM file paths): the CA that signed their certificates, and a client
    # certificate and key for engines that ask for one (mTLS). All None: plaintext.
    engine_tls_ca: str | None = None
    engine_tls_cert: str | None = None
    engine_tls_key: str | None = None
    # prometheus-client's multiprocess directory, made by `xserv rest` for its workers; None:
    # this process's metrics only.
    metrics_dir: str | None = None
    log_level: str = "info"
    # The Responses API's store (SQLite, shared by the workers); None: this process's memory.
    responses_store: str | None = None
    responses_max_age_s: float = 30 * 24 * 3600.0  # OpenAI keeps responses 30 days
    responses_max_bytes: int = 1024**3  # past this the oldest responses go
    max_background_responses: int = 64  # background responses running at once, all workers together; past it 429
    web_ui: bool = True  # the chat page at GET / (--no-web-ui: off)
    otlp_traces_endpoint: str | None = None  # OpenTelemetry traces to this OTLP gRPC collector; None: off
    media: MediaPolicy = MediaPolicy()  # image URLs: which hosts and directories, how long, how large


def default_responses_store() -> str:
    """$XDG_DATA_HOME/xserv/responses.sqlite3 (~/.local/share when unset); read at the CLI only."""
    data_home = os.environ.get("XDG_DATA_HOME") or os.path.join(os.path.expanduser("~"), ".local", "share")
    return os.path.join(data_home, "xserv", "responses.sqlite3")


def parse_engines(text: str) -> tuple[str, ...]:
    """"h1:p1,h2:p2" -> ("h1:p1", "h2:p2"); each entry must be HOST:PORT."""
    engines = tuple(part.strip() for part in text.split(",") if part.strip())
    if not engines:
        raise ValueError("--engine needs at least one HOST:PORT")
    for engine in engines:
        host, sep, port = engine.rpartition(":")
        if not sep or not host or not port.isdigit():
            raise ValueError(f"--engine entries must be HOST:PORT, got {engine!r}")
    return engines


def read_secrets(path: str, what: str) -> tuple[str, ...]:
    """The non-blank lines of a key or token file, stripped."""
    try:
        with open(path, encoding="utf-8") as file:
            secrets = tuple(line.strip() for line in file if line.strip())
    except OSError as exc:
        raise ValueError(f"cannot read {what} file {path}: {exc.strerror}") from None
    if not secrets:
        raise ValueError(f"{what} file {path} holds no {what}")
    return secrets
