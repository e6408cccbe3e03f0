"""The REST front's gRPC client: one channel per worker process, created lazily after fork.

gunicorn forks workers from a master that must never hold a gRPC channel (gRPC's threads do
not survive fork), so the channel is built on first use and rebuilt if the pid changed.
"""

import ipaddress
import json
import os
import socket
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import grpc
import grpc.experimental
from grpc_health.v1 import health_pb2, health_pb2_grpc

from xserv.v1 import engine_pb2, engine_pb2_grpc
from xserv_engine.tracing import current_trace_headers
from xserv_rest.config import RestConfig

HEALTH_TIMEOUT_S = 2.0
INFO_TIMEOUT_S = 5.0
ROUND_ROBIN = json.dumps({"loadBalancingConfig": [{"round_robin": {}}]})
CHANNEL_OPTIONS = (
    ("grpc.service_config", ROUND_ROBIN),
    ("grpc.max_receive_message_length", 64 * 1024 * 1024),
    ("grpc.max_send_message_length", 64 * 1024 * 1024),
    # An engine that restarts is found again within 2 s (gRPC's default backoff grows to 2 min).
    ("grpc.initial_reconnect_backoff_ms", 500),
    ("grpc.max_reconnect_backoff_ms", 2000),
    # Streamed messages are read on the calling thread instead of a per-channel spin thread
    # that hands each one over (a large share of the front's CPU: docs/benchmarks-log.md, "Through REST").
    (grpc.experimental.ChannelOptions.SingleThreadedUnaryStream, 1),
    # Connections of this channel only. From gRPC's process-wide pool a new channel would take
    # over another channel's connection to the same address, and with it a reconnect backoff to
    # a server gone from a port since reused: its first calls fail UNAVAILABLE at once.
    ("grpc.use_local_subchannel_pool", 1),
)


def grpc_target(engines: tuple[str, ...]) -> str:
    """One engine: its HOST:PORT (DNS names resolve to every address, balanced round robin).
    Several: an "ipv4:h1:p1,h2:p2" address list (names resolved now), balanced round robin."""
    if len(engines) == 1:
        return engines[0]
    addresses = [_resolve(engine) for engine in engines]
    if all(":" not in host for host, _ in addresses):
        return "ipv4:" + ",".join(f"{host}:{port}" for host, port in addresses)
    return "ipv6:" + ",".join(f"[{host}]:{port}" for host, port in addresses)


def _resolve(engine: str) -> tuple[str, str]:
    host, _, port = engine.rpartition(":")
    host = host.strip("[]")
    try:
        return str(ipaddress.ip_address(host)), port
    except ValueError:
        return socket.getaddrinfo(host, int(port), socket.AF_INET, socket.SOCK_STREAM)[0][4][0], port


class EngineClient:
    """Thread-safe: the worker's threads share one channel and its stub. Every call carries the
    engine token (when set) as "authorization: Bearer <token>" metadata."""

    def __init__(self, engines: tuple[str, ...], grpc_token: str | None = None,
                 request_timeout_s: float | None = None, tls: "EngineTls | None" = None,
                 trace_headers: Callable[[], tuple] | None = None):
        self.target = grpc_target(engines)
        self._trace_headers = trace_headers  # traces on: the current span's traceparent, for each call
        self._tls = tls
        self.request_timeout_s = request_timeout_s
        self._auth = (("authorization", f"Bearer {grpc_token}"),) if grpc_token else ()
        self._lock = threading.Lock()
        self._pid: int | None = None
        self._channel: grpc.Channel | None = None
        self._stub: engine_pb2_grpc.EngineServiceStub | None = None
        self._health: health_pb2_grpc.HealthStub | None = None
        self._served_model: engine_pb2.GetModelInfoResponse | None = None

    @classmethod
    def from_config(cls, config: RestConfig) -> "EngineClient":
        tls = None
        if config.engine_tls_ca is not None:
            tls = EngineTls.read(config.engine_tls_ca, config.engine_tls_cert, config.engine_tls_key)
        trace_headers = None if config.otlp_traces_endpoint is None else current_trace_headers
        return cls(config.engines, config.grpc_token, config.request_timeout_s, tls, trace_headers)

    def generate(self, request: engine_pb2.GenerateRequest, http_request_id: str | None = None):
        """Start a Generate call with the request timeout as its deadline: an iterator of
        GenerateResponse with .cancel(). The HTTP request id travels as x-request-id."""
        return self._engine().Generate(request, metadata=self._metadata(http_request_id),
                                       timeout=self.request_timeout_s)

    def embed(self, request: engine_pb2.EmbedRequest, http_request_id: str | None = None) -> grpc.Future:
        """Start an Embed call with generate()'s deadline and metadata: a future of EmbedResponse
        whose .cancel() ends the call (and the engine's work on it)."""
        return self._engine().Embed.future(request, metadata=self._metadata(http_request_id),
                                           timeout=self.request_timeout_s)

    def score(self, request: engine_pb2.ScoreRequest, http_request_id: str | None = None) -> grpc.Future:
        """Start a Score call, as embed() starts an Embed call: a future of ScoreResponse."""
        return self._engine().Score.future(request, metadata=self._metadata(http_request_id),
                                           timeout=self.request_timeout_s)

    def tokenize(self, request: engine_pb2.TokenizeRequest) -> engine_pb2.TokenizeResponse:
        return self._engine().Tokenize(request, timeout=INFO_TIMEOUT_S, metadata=self._auth)

    def detokenize(self, request: engine_pb2.DetokenizeRequest) -> engine_pb2.DetokenizeResponse:
        return self._engine().Detokenize(request, timeout=INFO_TIMEOUT_S, metadata=self._auth)

    def tokenizer_info(self) -> engine_pb2.GetTokenizerInfoResponse:
        return self._engine().GetTokenizerInfo(engine_pb2.GetTokenizerInfoRequest(), timeout=INFO_TIMEOUT_S,
                                               metadata=self._auth)

    def model_info(self) -> engine_pb2.GetModelInfoResponse:
        return self._engine().GetModelInfo(engine_pb2.GetModelInfoRequest(), timeout=INFO_TIMEOUT_S,
                                           metadata=self._auth)

    def served_model(self, fresh: bool = False) -> engine_pb2.GetModelInfoResponse:
        """The model's id and context length, asked once per process: they do not change while
        serving. Its LoRA adapters do (they are loaded and unloaded at runtime): `fresh` asks
        again and keeps the new answer (the KV counts change too; ask model_info() for those)."""
        if fresh or self._served_model is None:
            self._served_model = self.model_info()
        return self._served_model

    def load_lora_adapter(self, request: engine_pb2.LoadLoraAdapterRequest) -> engine_pb2.LoadLoraAdapterResponse:
        """Reading an adapter's weights may take a while: the request timeout, not INFO_TIMEOUT_S."""
        return self._engine().LoadLoraAdapter(request, timeout=self.request_timeout_s, metadata=self._auth)

    def unload_lora_adapter(self, request: engine_pb2.UnloadLoraAdapterRequest) -> None:
        self._engine().UnloadLoraAdapter(request, timeout=INFO_TIMEOUT_S, metadata=self._auth)

    def is_serving(self) -> bool:
        self._engine()
        try:
            reply = self._health.Check(health_pb2.HealthCheckRequest(service=""), timeout=HEALTH_TIMEOUT_S,
                                       metadata=self._auth)
        except grpc.RpcError:
            return False
        return reply.status == health_pb2.HealthCheckResponse.SERVING

    def close(self) -> None:
        with self._lock:
            if self._channel is not None and self._pid == os.getpid():
                self._channel.close()
            self._channel = self._stub = self._health = None
            self._pid = None

    def _engine(self) -> engine_pb2_grpc.EngineServiceStub:
        if self._pid != os.getpid():
            with self._lock:
                if self._pid != os.getpid():
                    if self._tls is None:
                        self._channel = grpc.insecure_channel(self.target, options=CHANNEL_OPTIONS)
                    else:
                        self._channel = grpc.secure_channel(self.target, self._tls.credentials(),
                                                            options=CHANNEL_OPTIONS)
                    self._stub = engine_pb2_grpc.EngineServiceStub(self._channel)
                    self._health = health_pb2_grpc.HealthStub(self._channel)
                    self._pid = os.getpid()
        return self._stub

    def _metadata(self, http_request_id: str | None) -> tuple:
        metadata = self._auth + ((("x-request-id", http_request_id),) if http_request_id else ())
        return metadata if self._trace_headers is None else metadata + self._trace_headers()


@dataclass(frozen=True)
class EngineTls:
    """PEM contents for TLS to the engines; the gRPC credentials are built per process (after fork)."""

    ca: bytes
    cert: bytes | None = None
    key: bytes | None = None

    @classmethod
    def read(cls, ca: str, cert: str | None, key: str | None) -> "EngineTls":
        def read(path: str | None) -> bytes | None:
            return None if path is None else Path(path).read_bytes()

        return cls(read(ca), read(cert), read(key))

    def credentials(self) -> grpc.ChannelCredentials:
        return grpc.ssl_channel_credentials(root_certificates=self.ca, private_key=self.key,
                                            certificate_chain=self.cert)
