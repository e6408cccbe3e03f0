"""Per-request sampling parameters, validated once when the request arrives."""

import math
from dataclasses import dataclass, field

from xserv_engine.errors import InvalidRequest
from xserv_engine.structured.constraint import Constraint

MAX_N = 16
MAX_TOP_LOGPROBS = 20


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int | None = None  # None: up to the end of the context
    min_tokens: int = 0
    temperature: float = 1.0  # 0 means greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: disabled
    min_p: float = 0.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    logit_bias: dict[int, float] = field(default_factory=dict)
    n: int = 1
    logprobs: bool = False
    top_logprobs: int = 0
    skip_special_tokens: bool = True
    constraint: Constraint | None = None  # structured output: the answer must match it

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def validate(self, vocab_size: int) -> None:
        """Raise InvalidRequest naming the first field that cannot be served."""
        if self.max_tokens is not None:
            _check(self.max_tokens >= 1, "max_tokens", f"must be at least 1, got {self.max_tokens}")
        _check(0 <= self.min_tokens <= (self.max_tokens or self.min_tokens), "min_tokens",
               f"must be between 0 and max_tokens ({self.max_tokens}), got {self.min_tokens}")
        _check(_finite(self.temperature) and 0.0 <= self.temperature <= 2.0, "temperature",
               f"must be between 0 and 2, got {self.temperature}")
        _check(_finite(self.top_p) and 0.0 < self.top_p <= 1.0, "top_p",
               f"must be in (0, 1], got {self.top_p}")
        _check(self.top_k >= -1, "top_k", f"must be -1, 0 (disabled) or positive, got {self.top_k}")
        _check(_finite(self.min_p) and 0.0 <= self.min_p <= 1.0, "min_p",
               f"must be between 0 and 1, got {self.min_p}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            _check(_finite(value) and -2.0 <= value <= 2.0, name, f"must be between -2 and 2, got {value}")
        _check(_finite(self.repetition_penalty) and 0.0 < self.repetition_penalty <= 2.0,
               "repetition_penalty", f"must be in (0, 2], got {self.repetition_penalty}")
        _check(1 <= self.n <= MAX_N, "n", f"must be between 1 and {MAX_N}, got {self.n}")
        _check(0 <= self.top_logprobs <= MAX_TOP_LOGPROBS, "top_logprobs",
               f"must be between 0 and {MAX_TOP_LOGPROBS}, got {self.top_logprobs}")
        _check(all(s for s in self.stop), "stop", "stop strings must not be empty")
        _check(len(self.stop) <= 16, "stop", f"at most 16 stop strings, got {len(self.stop)}")
        for token_id in self.stop_token_ids:
            _check(0 <= token_id < vocab_size, "stop_token_ids", f"token id {token_id} is out of range")
        for token_id, bias in self.logit_bias.items():
            _check(0 <= token_id < vocab_size, "logit_bias", f"token id {token_id} is out of range")
            _check(_finite(bias) and -100.0 <= bias <= 100.0, "logit_bias",
                   f"bias for token {token_id} must be between -100 and 100, got {bias}")
        if self.seed is not None:
            _check(-(2**63) <= self.seed < 2**64, "seed", "must fit in 64 bits")


def _finite(value: float) -> bool:
    return not (math.isnan(value) or math.isinf(value))


def _check(ok: bool, field_name: str, message: str) -> None:
    if not ok:
        raise InvalidRequest(field_name, message)
