"""A unary engine call (Embed, Score) made for an HTTP request: watched for the client hanging
up, as a generation is, so that the engine stops working for nobody; the request timeout ends
it as it ends a generation."""

import falcon
import grpc

from xserv_rest.disconnect import DisconnectWatcher
from xserv_rest.generation import ClientGone, timed_out


def result_of(call: grpc.Future, req: falcon.Request, watcher: DisconnectWatcher, timeout_s: float | None):
    """The engine's answer; a hang-up (the watcher cancels the call) is ClientGone, the deadline
    a 504."""
    stop_watching = watcher.watch(req.env.get("gunicorn.socket"), call.cancel)
    try:
        return call.result()
    except grpc.FutureCancelledError:
        raise ClientGone() from None
    except grpc.RpcError as exc:
        if exc.code() == grpc.StatusCode.DEADLINE_EXCEEDED and timeout_s is not None:
            raise timed_out(timeout_s) from None
        raise
    finally:
        stop_watching()
