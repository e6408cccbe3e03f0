"""The `xserv engine` process: grpc.aio server + health + reflection, model load, drain on signal.

Lifecycle: listen at once with health NOT_SERVING -> load and warm up the model -> SERVING ->
(SIGTERM / SIGINT) NOT_SERVING, new calls UNAVAILABLE, running streams get `drain_grace`
seconds to finish -> server stopped -> engine shut down -> exit 0.
"""

import asyncio
import logging
import signal
import threading
import time
from typing import Callable

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection
from smg_grpc_proto import vllm_engine_pb2_grpc
from xserv.v1 import engine_pb2, engine_pb2_grpc

from xserv_engine.errors import XservError
from xserv_engine.media import MediaPolicy
from xserv_engine.server.auth import TokenAuthInterceptor
from xserv_engine.server.metrics import EngineMetrics
from xserv_engine.server.servicer import EngineServicer
from xserv_engine.server.tls import TlsFiles, server_credentials
from xserv_engine.server.vllm_worker.servicer import SERVICE_NAME as SMG_WORKER_SERVICE
from xserv_engine.server.vllm_worker.servicer import VllmEngineServicer

log = logging.getLogger("xserv.engine.server")

SERVICE_NAME = engine_pb2.DESCRIPTOR.services_by_name["EngineService"].full_name
_MIB = 1 << 20
SERVER_OPTIONS = [
    ("grpc.max_receive_message_length", 64 * _MIB),  # long token-id prompts and chats with tools
    ("grpc.max_send_message_length", 64 * _MIB),
    ("grpc.so_reuseport", 0),  # a second engine on a taken port must fail, not share it
    ("grpc.keepalive_time_ms", 30_000),  # ping idle clients to find dead connections
    ("grpc.keepalive_timeout_ms", 10_000),
    ("grpc.keepalive_permit_without_calls", 1),
    ("grpc.http2.min_recv_ping_interval_without_data_ms", 10_000),  # clients may ping every 10 s
    ("grpc.http2.max_pings_without_data", 0),
]


class EngineServer:
    """One grpc.aio server in front of one engine; create and use it inside a running loop."""

    def __init__(self, host: str, port: int, token: str | None = None, tls: TlsFiles | None = None, spans=None,
                 media: MediaPolicy = MediaPolicy(), mm_processor: str = "inprocess"):
        self.metrics = EngineMetrics()
        self.servicer = EngineServicer(metrics=self.metrics, spans=spans)
        self.smg_worker = VllmEngineServicer(self.servicer, media, mm_processor)
        self.health = health.aio.HealthServicer()
        self.engine = None
        interceptors = []
        if token is not None:
            denied = self.metrics.errors.labels(code="UNAUTHENTICATED").inc
            # Both generating services need it. SMG cannot send it (smg 1.13 puts no metadata on
            # its worker calls): an engine behind SMG is guarded by its network or mTLS instead.
            interceptors += [TokenAuthInterceptor(token, service, on_denied=denied)
                             for service in (SERVICE_NAME, SMG_WORKER_SERVICE)]
        self._server = grpc.aio.server(options=SERVER_OPTIONS, interceptors=interceptors)
        engine_pb2_grpc.add_EngineServiceServicer_to_server(self.servicer, self._server)
        vllm_engine_pb2_grpc.add_VllmEngineServicer_to_server(self.smg_worker, self._server)
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self._server)
        reflection.enable_server_reflection(
            (SERVICE_NAME, SMG_WORKER_SERVICE, health.SERVICE_NAME, reflection.SERVICE_NAME), self._server)
        address = f"{_bracket(host)}:{port}"
        if tls is None:
            self.port = self._server.add_insecure_port(address)
        else:
            self.port = self._server.add_secure_port(address, server_credentials(tls))
        self.address = f"{_bracket(host)}:{self.port}"

    async def start(self) -> None:
        await self._set_health(health_pb2.HealthCheckResponse.NOT_SERVING)
        await self._server.start()
        log.info("listening on %s (NOT_SERVING until the model is loaded)", self.address)

    async def load(self, load_engine: Callable[[], object]) -> None:
        """Build, start and warm up the engine off the event loop, then report SERVING."""
        started = time.monotonic()
        self.engine = await _in_daemon_thread(load_engine)
        await _in_daemon_thread(self.engine.start)
        await _in_daemon_thread(self.engine.warmup)
        self.servicer.attach(self.engine)
        await self._set_health(health_pb2.HealthCheckResponse.SERVING)
        info = self.engine.model_info()
        log.info("SERVING model=%s dtype=%s device=%s max_model_len=%d tool_call_parser=%s on %s "
                 "(ready in %.1f s)", info.model_id, info.dtype, info.device, info.max_model_len,
                 info.tool_call_parser, self.address, time.monotonic() - started)
        if self.engine.sampling_defaults:  # as vLLM says it: a request's unset fields change meaning
            log.info("sampling defaults from the model's generation_config.json (a request's own values win; "
                     "--sampling-defaults openai turns them off): %s",
                     " ".join(f"{name}={value:g}" for name, value in self.engine.sampling_defaults.items()))

    async def drain(self, grace: float, hurry: asyncio.Event | None = None) -> None:
        """NOT_SERVING, refuse new calls, let running streams finish for up to `grace` seconds
        (less if `hurry` is set), then stop the server (ending what is left) and the engine."""
        log.info("draining: NOT_SERVING, waiting up to %.0f s for running streams", grace)
        self.servicer.drain()
        await self.health.enter_graceful_shutdown()
        idle = asyncio.ensure_future(self.servicer.wait_idle(grace))
        await _first_done(idle, (hurry or asyncio.Event()).wait())
        if not (idle.done() and idle.result()):
            idle.cancel()
            log.warning("drain: aborting the streams still running")
        await self._server.stop(grace=None)
        await self.servicer.wait_idle(1.0)  # the cancelled streams' abort-on-exit has run
        if self.engine is not None:
            await asyncio.to_thread(self.engine.shutdown)
        log.info("stopped")

    async def stop_now(self) -> None:
        await self._server.stop(grace=None)

    async def _set_health(self, status) -> None:
        for name in ("", SERVICE_NAME):
            await self.health.set(name, status)


async def serve(load_engine: Callable[[], object], host: str, port: int, drain_grace: float,
                token: str | None = None, metrics_port: int | None = None, tls: TlsFiles | None = None,
                otlp_traces_endpoint: str | None = None, media: MediaPolicy = MediaPolicy(),
                mm_processor: str = "inprocess") -> int:
    """Run until SIGTERM / SIGINT, draining gracefully; a second signal cuts the grace short.
    With `token`, EngineService calls need `authorization: Bearer <token>`; with `metrics_port`
    (0: any free port) Prometheus metrics are served on host:metrics_port/metrics; with `tls`
    the port speaks only TLS (and asks for client certificates when tls.client_ca is set); with
    `otlp_traces_endpoint` each Generate call's spans go to that OTLP collector, flushed at exit;
    `media` is how the SMG worker service loads the image URLs of media_refs, `mm_processor`
    who preprocesses SMG's images (vllm_worker.servicer.MM_PROCESSORS)."""
    loop = asyncio.get_running_loop()
    stop, hurry = asyncio.Event(), asyncio.Event()

    def on_signal(signum: int) -> None:
        # the ordinary way to stop (xserv up sends SIGTERM on Ctrl-C): said as a request, not a fault
        name = signal.Signals(signum).name
        if stop.is_set():
            log.info("asked again to stop (%s): not waiting for the running streams", name)
            hurry.set()
        else:
            log.info("asked to stop (%s): shutting down cleanly", name)
            stop.set()

    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, on_signal, signum)
    spans = None
    if otlp_traces_endpoint is not None:
        from xserv_engine.server.call_spans import CallSpans

        spans = CallSpans(otlp_traces_endpoint)
    try:
        server = EngineServer(host, port, token, tls, spans, media, mm_processor)
    except RuntimeError as exc:  # grpc cannot bind: the port is taken or the host is not ours
        log.error("cannot listen on %s:%d: %s", host, port, exc)
        return 1
    if metrics_port is not None:
        try:
            server.metrics.serve(host, metrics_port)
        except OSError as exc:
            log.error("cannot serve metrics on %s:%d: %s", host, metrics_port, exc)
            return 1
    try:
        return await _run(server, load_engine, stop, hurry, drain_grace)
    finally:
        server.metrics.stop()
        if spans is not None:
            await asyncio.to_thread(spans.shutdown)


async def _run(server: EngineServer, load_engine, stop: asyncio.Event, hurry: asyncio.Event,
               drain_grace: float) -> int:
    await server.start()
    load = asyncio.ensure_future(server.load(load_engine))
    await _first_done(load, stop.wait())
    if not load.done():
        log.info("stopped while loading the model")
        await server.stop_now()
        return 0
    if load.exception() is not None:
        error = load.exception()
        # A user's mistake (ModelLoadError: bad path, unsupported checkpoint) needs no traceback.
        # exc_info takes the exception itself: outside an except block, True logs "NoneType: None".
        log.error("could not load the engine: %s", error, exc_info=None if isinstance(error, XservError) else error)
        await server.stop_now()
        return 1
    await stop.wait()
    await server.drain(drain_grace, hurry)
    return 0


async def _first_done(*awaitables) -> None:
    """Wait until one of the awaitables is done. Pending coroutines are cancelled; tasks
    passed in are left to the caller."""
    futures = [asyncio.ensure_future(a) for a in awaitables]
    _, pending = await asyncio.wait(futures, return_when=asyncio.FIRST_COMPLETED)
    for future, given in zip(futures, awaitables):
        if future in pending and future is not given:
            future.cancel()


LOAD_THREAD = "xserv-load"


def still_loading() -> bool:
    """A model load (or warm-up) is still running on its daemon thread: the process was stopped
    during it."""
    return any(thread.name == LOAD_THREAD and thread.is_alive() for thread in threading.enumerate())


async def _in_daemon_thread(fn: Callable[[], object]):
    """Run a slow blocking call (model load, warm-up) on a daemon thread, so that a signal
    during it can still end the process instead of waiting for it."""
    loop = asyncio.get_running_loop()
    future = loop.create_future()

    def run() -> None:
        result, error = None, None
        try:
            result = fn()
        except BaseException as exc:  # handed to the awaiting coroutine
            error = exc
        try:
            loop.call_soon_threadsafe(_settle, future, result, error)
        except RuntimeError:
            pass  # the loop is closed: the process stopped while this was running

    threading.Thread(target=run, name=LOAD_THREAD, daemon=True).start()
    return await future


def _settle(future: asyncio.Future, result, exc) -> None:
    if future.cancelled():
        return
    if exc is not None:
        future.set_exception(exc)
    else:
        future.set_result(result)


def _bracket(host: str) -> str:
    return f"[{host}]" if ":" in host and not host.startswith("[") else host
