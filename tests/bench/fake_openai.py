"""A tiny OpenAI-style SSE server for the bench client's tests, on a free loopback port.

Each streamed request gets max_tokens text chunks ("tok0 ", "tok1 ", ...) spaced delay_s apart,
a finish_reason, then (as configured) a usage chunk and `data: [DONE]`. Variants: no [DONE]
with the connection held open afterwards (like transformers serve), no usage, and every
`fail_every`-th request failing with HTTP 500 or with an error event mid-stream.
"""

import json
import sys
import threading
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


@dataclass
class Behaviour:
    delay_s: float = 0.002
    send_done: bool = True
    send_usage: bool = True
    hold_open: bool = False  # after the last chunk, keep the connection open until the server stops
    fail_every: int = 0  # 0: never; else requests number k, 2k, ... fail
    fail_with: str = "http"  # "http" (500 before streaming) or "event" (error event after a chunk)
    prompt_tokens: int = 7


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    request_queue_size = 256  # the default listen backlog of 5 drops a burst's SYNs (1 s retry)

    def handle_error(self, request, client_address) -> None:
        """A client that hangs up mid-stream (what the load tests' timeouts do) is not an error
        here; anything else still prints its traceback."""
        if not isinstance(sys.exc_info()[1], (BrokenPipeError, ConnectionResetError)):
            super().handle_error(request, client_address)


class FakeOpenAI:
    def __init__(self, behaviour: Behaviour):
        self.behaviour = behaviour
        self.requests: list[dict] = []
        self.stopping = threading.Event()
        self._lock = threading.Lock()
        self._server = _Server(("127.0.0.1", 0), self._handler())
        # stop() waits for serve_forever's next poll: a short one, not the 0.5 s default
        self._thread = threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True)
        self._thread.start()

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self._server.server_address[1]}/v1"

    def stop(self) -> None:
        self.stopping.set()
        self._server.shutdown()
        self._server.server_close()

    def _count(self, body: dict) -> int:
        with self._lock:
            self.requests.append(body)
            return len(self.requests)

    def _handler(self):
        fake = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args) -> None:
                pass

            def do_GET(self) -> None:
                self._send_json(200, {"object": "list", "data": [{"id": "fake-model", "object": "model"}]})

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                number = fake._count(body)
                b = fake.behaviour
                failing = b.fail_every and number % b.fail_every == 0
                if failing and b.fail_with == "http":
                    self._send_json(500, {"error": {"message": "boom", "type": "internal_error"}})
                    return
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.send_header("Transfer-Encoding", "chunked")
                self.end_headers()
                self._stream(body, b, failing)

            def _stream(self, body: dict, b: Behaviour, failing: bool) -> None:
                chat = "messages" in body
                for i in range(body["max_tokens"]):
                    fake.stopping.wait(b.delay_s)
                    text = f"tok{i} "
                    choice = {"index": 0, "delta": {"content": text}} if chat else {"index": 0, "text": text}
                    self._event({"choices": [choice | {"finish_reason": None}]})
                    if failing:
                        self._event({"error": {"message": "engine fell over", "type": "internal_error"}})
                        return self._end()
                last = {"index": 0, "delta": {}} if chat else {"index": 0, "text": ""}
                self._event({"choices": [last | {"finish_reason": "length"}]})
                if b.send_usage:
                    self._event({"choices": [], "usage": {"prompt_tokens": b.prompt_tokens,
                                                          "completion_tokens": body["max_tokens"]}})
                if b.send_done:
                    self._frame(b"data: [DONE]\n\n")
                if b.hold_open:
                    fake.stopping.wait(30)
                self._end()

            def _event(self, payload: dict) -> None:
                self._frame(f"data: {json.dumps(payload)}\n\n".encode())

            def _frame(self, data: bytes) -> None:
                self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
                self.wfile.flush()

            def _end(self) -> None:
                self.wfile.write(b"0\r\n\r\n")
                self.wfile.flush()
                self.close_connection = True

            def _send_json(self, status: int, payload: dict) -> None:
                data = json.dumps(payload).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        return Handler
