"""Per-request sampling parameters, validated once when the request arrives.

BOUNDS is the one definition of what each numeric parameter accepts: SamplingParams.validate
checks it, and the REST front's protocol models (xserv_rest/protocol/sampling.py) turn it into
their pydantic constraints and so into /openapi.json. This module imports no torch.
"""

import math
from dataclasses import dataclass, field

from xserv_engine.errors import InvalidRequest, ModelLoadError
from xserv_engine.structured.constraint import Constraint

U32 = 2**32 - 1
MAX_N = 16
MAX_TOP_LOGPROBS = 20
MAX_STOP = 16  # stop strings per request


@dataclass(frozen=True)
class Bounds:
    """The closed range [low, high] of one parameter, or (low, high] when low_open."""

    low: float
    high: float
    low_open: bool = False
    description: str = ""

    def contains(self, value: float) -> bool:
        if isinstance(value, float) and not math.isfinite(value):
            return False
        above_low = value > self.low if self.low_open else value >= self.low
        return above_low and value <= self.high

    def text(self) -> str:
        """"between 0 and 2", "greater than 0 and at most 1": what error messages say."""
        low, high = _number(self.low), _number(self.high)
        return f"greater than {low} and at most {high}" if self.low_open else f"between {low} and {high}"


BOUNDS: dict[str, Bounds] = {
    "max_tokens": Bounds(1, U32, description="most tokens to generate"),
    "min_tokens": Bounds(0, U32, description="tokens generated before EOS or a stop token may end the answer"),
    "temperature": Bounds(0, 2, description="0 is greedy"),
    "top_p": Bounds(0, 1, low_open=True, description="nucleus sampling mass"),
    "top_k": Bounds(-1, 2**31 - 1, description="-1 or 0 disables"),
    "min_p": Bounds(0, 1, description="drop tokens less likely than min_p times the likeliest"),
    "presence_penalty": Bounds(-2, 2, description="OpenAI presence penalty"),
    "frequency_penalty": Bounds(-2, 2, description="OpenAI frequency penalty"),
    "repetition_penalty": Bounds(0, 2, low_open=True, description="1 disables; above 1 discourages repeats"),
    "n": Bounds(1, MAX_N, description="choices to generate"),
    "top_logprobs": Bounds(0, MAX_TOP_LOGPROBS, description="alternatives per token"),
    "prompt_logprobs": Bounds(0, MAX_TOP_LOGPROBS, description="alternatives per prompt token"),
    "seed": Bounds(0, 2**64 - 1, description="sampling seed"),
    "logit_bias": Bounds(-100, 100, description="added to the token's logit"),  # each bias
    "priority": Bounds(-2**31, 2**31 - 1, description="scheduling priority, lower first (vLLM's); non-zero needs "
                                                      "an engine started with --scheduling-policy priority"),
}


# What a model's generation_config.json may recommend for requests that set none of these (the
# keys vLLM reads from it; do_sample is ignored, as vLLM does).
MODEL_DEFAULT_FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


def model_sampling_defaults(generation: dict, source: str) -> dict[str, float]:
    """The sampling values a model's generation config recommends, checked against BOUNDS
    (ModelLoadError naming the file and the value otherwise: every request would fail)."""
    defaults = {}
    for name in MODEL_DEFAULT_FIELDS:
        value = generation.get(name)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not BOUNDS[name].contains(value):
            raise ModelLoadError(f"{source}: {name} must be {BOUNDS[name].text()}, got {value!r}; fix it, or start "
                                 f"the engine with --sampling-defaults openai to ignore the file's sampling values")
        defaults[name] = int(value) if name == "top_k" else float(value)
    return defaults


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
    # each prompt token's logprob given the tokens before it (raw model logprobs), with this many
    # alternatives; None: none (a request that asks for them is never served from the prefix cache)
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    constraint: Constraint | None = None  # structured output: the answer must match it
    # not sampling but scheduling: under --scheduling-policy priority, lower runs first; it rides
    # here as every other per-request setting does on its way to the Sequence
    priority: int = 0

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def validate(self, vocab_size: int) -> None:
        """Raise InvalidRequest naming the first field that cannot be served."""
        for name in ("max_tokens", "min_tokens", "temperature", "top_p", "top_k", "min_p", "presence_penalty",
                     "frequency_penalty", "repetition_penalty", "n", "top_logprobs", "prompt_logprobs", "seed",
                     "priority"):
            value = getattr(self, name)
            if value is not None:
                _check(BOUNDS[name].contains(value), name, f"must be {BOUNDS[name].text()}, got {value}")
        _check(self.min_tokens <= (self.max_tokens or self.min_tokens), "min_tokens",
               f"must be at most max_tokens ({self.max_tokens}), got {self.min_tokens}")
        _check(all(s for s in self.stop), "stop", "stop strings must not be empty")
        _check(len(self.stop) <= MAX_STOP, "stop", f"at most {MAX_STOP} stop strings, got {len(self.stop)}")
        for token_id in self.stop_token_ids:
            _check(0 <= token_id < vocab_size, "stop_token_ids", f"token id {token_id} is out of range")
        for token_id, bias in self.logit_bias.items():
            _check(0 <= token_id < vocab_size, "logit_bias", f"token id {token_id} is out of range")
            _check(BOUNDS["logit_bias"].contains(bias), "logit_bias",
                   f"bias for token {token_id} must be {BOUNDS['logit_bias'].text()}, got {bias}")


def _number(value: float) -> str:
    return str(int(value)) if float(value).is_integer() else f"{value:g}"


def _check(ok: bool, field_name: str, message: str) -> None:
    if not ok:
        raise InvalidRequest(field_name, message)
