"""One streamed request to an OpenAI-compatible endpoint, timed chunk by chunk.

Plain http.client on its own connection, so one thread holds one stream. The stream ends at
`data: [DONE]`, when the server closes the connection, or once a chunk carried finish_reason
and the usage chunk (asked for with stream_options.include_usage) arrived: some servers
(transformers serve) never send [DONE].
"""

import http.client
import json
import socket
import time
import urllib.parse
from dataclasses import dataclass, field

from xserv_cli.bench.config import BenchConfig


@dataclass
class RequestResult:
    ok: bool = False
    error_kind: str = ""  # e.g. "HTTP 429", "timeout", "stream error event"; "" when ok
    error: str = ""
    ttft_s: float = 0.0  # send -> first chunk with text
    latency_s: float = 0.0  # send -> end of stream
    chunk_times: list[float] = field(default_factory=list)  # arrival of each chunk with text, from send
    prompt_tokens: int | None = None  # from the server's usage, when it sent one
    completion_tokens: int | None = None

    @property
    def output_tokens(self) -> int:
        """From usage when the server reported it, else one per text chunk."""
        return self.completion_tokens if self.completion_tokens is not None else len(self.chunk_times)

    @property
    def itls_s(self) -> list[float]:
        return [b - a for a, b in zip(self.chunk_times, self.chunk_times[1:])]


class StreamError(Exception):
    def __init__(self, kind: str, message: str):
        super().__init__(message)
        self.kind = kind


def request_body(config: BenchConfig, prompt: str) -> dict:
    body = {"model": config.model, "max_tokens": config.output_len, "temperature": config.temperature,
            "stream": True, "stream_options": {"include_usage": True}}
    if config.ignore_eos:
        body["ignore_eos"] = True
    if config.endpoint == "chat":
        body["messages"] = [{"role": "user", "content": prompt}]
    else:
        body["prompt"] = prompt
    return body


def send_request(config: BenchConfig, prompt: str) -> RequestResult:
    result = RequestResult()
    start = time.perf_counter()
    try:
        _stream(config, request_body(config, prompt), start, result)
        result.ok = True
    except StreamError as exc:
        result.error_kind, result.error = exc.kind, str(exc)
    except ValueError as exc:  # a data: line that is not JSON
        result.error_kind, result.error = "malformed chunk", str(exc)
    except (socket.timeout, TimeoutError) as exc:
        result.error_kind, result.error = "timeout", str(exc) or "timed out"
    except (OSError, http.client.HTTPException) as exc:
        result.error_kind, result.error = f"connection: {type(exc).__name__}", str(exc)
    result.latency_s = time.perf_counter() - start
    return result


def _connect(base_url: str, timeout_s: float) -> tuple[http.client.HTTPConnection, str]:
    url = urllib.parse.urlsplit(base_url)
    cls = http.client.HTTPSConnection if url.scheme == "https" else http.client.HTTPConnection
    return cls(url.hostname, url.port, timeout=timeout_s), url.path.rstrip("/")


def _stream(config: BenchConfig, body: dict, start: float, result: RequestResult) -> None:
    conn, prefix = _connect(config.base_url, config.timeout_s)
    headers = {"Content-Type": "application/json", "Accept": "text/event-stream"}
    if config.api_key:
        headers["Authorization"] = f"Bearer {config.api_key}"
    try:
        conn.request("POST", prefix + config.path, body=json.dumps(body), headers=headers)
        resp = conn.getresponse()
        if resp.status != 200:
            raise StreamError(f"HTTP {resp.status}", resp.read(2000).decode("utf-8", "replace"))
        _read_events(resp, config, start, result)
    finally:
        conn.close()


def _read_events(resp: http.client.HTTPResponse, config: BenchConfig, start: float, result: RequestResult) -> None:
    finished = False
    while True:
        line = resp.readline()
        if not line:  # the server closed the stream
            break
        if time.perf_counter() - start > config.timeout_s:
            raise StreamError("timeout", f"stream still open after {config.timeout_s:.0f}s")
        line = line.strip()
        if not line.startswith(b"data:"):
            continue
        data = line[5:].strip()
        if data == b"[DONE]":
            break
        finished |= _take_chunk(json.loads(data), time.perf_counter() - start, result)
        if finished and result.completion_tokens is not None:
            break
    if not finished:
        raise StreamError("stream ended early", "the stream ended before any choice had a finish_reason")


def _take_chunk(chunk: dict, elapsed_s: float, result: RequestResult) -> bool:
    """Record one chunk; True when it carried a finish_reason."""
    if "error" in chunk:
        raise StreamError("stream error event", json.dumps(chunk["error"])[:2000])
    usage = chunk.get("usage")
    if usage:
        result.prompt_tokens = usage.get("prompt_tokens")
        result.completion_tokens = usage.get("completion_tokens")
    finished = False
    for choice in chunk.get("choices") or []:
        delta = choice.get("delta") or {}
        text = choice.get("text") or delta.get("content") or delta.get("reasoning_content") or delta.get("reasoning")
        if text:
            if not result.chunk_times:
                result.ttft_s = elapsed_s
            result.chunk_times.append(elapsed_s)
        finished |= bool(choice.get("finish_reason"))
    return finished
