"""What one benchmark run sends, to where, and how fast."""

from dataclasses import dataclass


@dataclass(frozen=True)
class BenchConfig:
    base_url: str  # up to and including /v1, e.g. http://127.0.0.1:8000/v1
    model: str
    endpoint: str = "chat"  # "chat" -> /chat/completions, "completions" -> /completions
    output_len: int = 128
    concurrency: int | None = None  # most requests in flight at once; None: no limit
    request_rate: float = float("inf")  # Poisson arrivals per second; inf: all at once
    ignore_eos: bool = True  # vLLM's extra field: generate exactly output_len tokens
    temperature: float = 0.0
    timeout_s: float = 600.0  # per request, from sending it to the end of its stream
    seed: int = 0  # arrival times
    api_key: str | None = None

    @property
    def path(self) -> str:
        return "/chat/completions" if self.endpoint == "chat" else "/completions"
