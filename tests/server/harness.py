"""Runs an EngineServer on its own event-loop thread, so plain (sync) tests can use real stubs."""

import asyncio
import threading

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from xserv.v1 import engine_pb2_grpc

from xserv_engine.media import MediaPolicy
from xserv_engine.server.serve import EngineServer


class ServerThread:
    def __init__(self, token: str | None = None, media: MediaPolicy = MediaPolicy()):
        self._token, self._media = token, media
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="test-grpc-loop", daemon=True)
        self._thread.start()
        self.server: EngineServer = self.call(self._start())
        self.channel = grpc.insecure_channel(f"127.0.0.1:{self.server.port}")
        self.stub = engine_pb2_grpc.EngineServiceStub(self.channel)
        self.health = health_pb2_grpc.HealthStub(self.channel)

    async def _start(self) -> EngineServer:
        server = EngineServer("127.0.0.1", 0, self._token, media=self._media)
        await server.start()
        return server

    def call(self, coro, timeout: float = 10):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def submit(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    def load(self, engine) -> None:
        self.call(self.server.load(lambda: engine))

    def health_status(self, service: str = "") -> str:
        response = self.health.Check(health_pb2.HealthCheckRequest(service=service), timeout=5)
        return health_pb2.HealthCheckResponse.ServingStatus.Name(response.status)

    def close(self) -> None:
        self.channel.close()
        self.call(self.server.stop_now())
        if self.server.engine is not None:
            self.server.engine.shutdown()
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=5)
