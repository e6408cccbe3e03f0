"""Bearer-token check for EngineService calls (`xserv engine --grpc-token`).

Clients send the metadata `authorization: Bearer <token>`. Calls to xserv.v1.EngineService
without the right token end with UNAUTHENTICATED; grpc.health.v1.Health and server reflection
stay open, so load balancers and `grpcurl list` work without it.
"""

import hmac
from typing import Callable

import grpc

UNAUTHENTICATED_MESSAGE = "missing or invalid token"


class TokenAuthInterceptor(grpc.aio.ServerInterceptor):
    def __init__(self, token: str, service: str, on_denied: Callable[[], None] = lambda: None):
        self._expected = f"Bearer {token}".encode()
        self._prefix = f"/{service}/"
        self._on_denied = on_denied

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None or not handler_call_details.method.startswith(self._prefix):
            return handler
        if self._authorized(handler_call_details.invocation_metadata):
            return handler
        self._on_denied()
        return _denying(handler)

    def _authorized(self, metadata) -> bool:
        given = next((value for key, value in metadata or () if key == "authorization"), "")
        given = given.encode() if isinstance(given, str) else given
        return hmac.compare_digest(given, self._expected)


def _denying(handler: grpc.RpcMethodHandler) -> grpc.RpcMethodHandler:
    """A handler of the same kind as `handler` that answers UNAUTHENTICATED."""

    async def deny(request, context):
        await context.abort(grpc.StatusCode.UNAUTHENTICATED, UNAUTHENTICATED_MESSAGE)

    serializers = {"request_deserializer": handler.request_deserializer,
                   "response_serializer": handler.response_serializer}
    if handler.request_streaming and handler.response_streaming:
        return grpc.stream_stream_rpc_method_handler(deny, **serializers)
    if handler.request_streaming:
        return grpc.stream_unary_rpc_method_handler(deny, **serializers)
    if handler.response_streaming:
        return grpc.unary_stream_rpc_method_handler(deny, **serializers)
    return grpc.unary_unary_rpc_method_handler(deny, **serializers)


def read_token(token: str | None, token_file: str | None) -> str | None:
    """The token from --grpc-token or the first line of --grpc-token-file (None: no auth)."""
    if token_file is not None:
        with open(token_file) as f:
            token = f.readline().strip()
        if not token:
            raise ValueError(f"--grpc-token-file {token_file}: the file is empty")
    return token or None
