"""What the engine streams back for each request: one RequestOutput per step per choice."""

from dataclasses import dataclass, field, replace


@dataclass(frozen=True)
class Usage:
    prompt_tokens: int
    completion_tokens: int
    cached_prompt_tokens: int
    reasoning_tokens: int = 0  # of completion_tokens: <think> (when generated) through </think>


@dataclass(frozen=True)
class TokenLogprob:
    token_id: int
    token: str  # the token's text, decoded alone (may be a partial UTF-8 piece shown with U+FFFD)
    token_bytes: bytes
    logprob: float | None  # None: a prompt's first token, which nothing predicts
    top: tuple["TokenLogprob", ...] = ()


@dataclass(frozen=True)
class ToolCallDelta:
    index: int  # position of the call in this choice's answer
    id: str = ""  # set on the first delta of a call
    name: str = ""  # set on the first delta of a call
    arguments: str = ""  # a fragment of the JSON arguments


@dataclass(frozen=True)
class RequestOutput:
    request_id: str
    index: int  # choice index, for n > 1
    token_ids: tuple[int, ...] = ()  # new tokens since the last output of this choice
    text: str = ""  # new content text
    reasoning_text: str = ""  # new text inside <think>...</think>
    tool_calls: tuple[ToolCallDelta, ...] = ()
    logprobs: tuple[TokenLogprob, ...] = ()
    # SamplingParams.prompt_logprobs: every prompt token's, on the choice's first output
    prompt_logprobs: tuple[TokenLogprob, ...] = ()
    finish_reason: str | None = None  # None until the last output: stop, length, tool_calls, abort
    matched_stop: str | int | None = None  # the stop string or stop token id that ended it
    usage: Usage | None = None  # set on the last output of each choice
    prompt_tokens: int = 0  # the prompt's length, on every output of a generating choice
    scheduled_at: float | None = None  # time.monotonic() when the choice's prefill began (traces: queue time)
    error: str | None = None  # internal failure of this request (the engine keeps serving)
    embedding: tuple[float, ...] | None = None  # an embedding request's vector, on its only output
    # speculative decoding: (draft tokens proposed, of them accepted) for the choice, on its last output
    spec_tokens: tuple[int, int] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def then(self, later: "RequestOutput") -> "RequestOutput":
        """This output followed by the next one of the same choice, as one output (what a
        consumer that fell behind by a step gets: the same text, tokens and calls, fewer messages)."""
        calls = list(self.tool_calls)
        for delta in later.tool_calls:
            # a call's first delta (id, name) keeps its own arguments: what the parser gave it, ""
            # - as OpenAI streams a call; fragments join only fragments
            if calls and calls[-1].index == delta.index and not calls[-1].id and not delta.id and not delta.name:
                calls[-1] = replace(calls[-1], arguments=calls[-1].arguments + delta.arguments)
            else:
                calls.append(delta)
        return replace(
            later, token_ids=self.token_ids + later.token_ids, text=self.text + later.text,
            reasoning_text=self.reasoning_text + later.reasoning_text, tool_calls=tuple(calls),
            logprobs=self.logprobs + later.logprobs, prompt_logprobs=self.prompt_logprobs + later.prompt_logprobs,
        )


def coalesce(outputs: list[RequestOutput]) -> list[RequestOutput]:
    """Join consecutive outputs of each choice, in order of first appearance; an output that
    finishes its choice or carries an error is never joined to what follows it."""
    merged: list[RequestOutput] = []
    open_at: dict[int, int] = {}  # choice index -> its output in `merged` that may still grow
    for out in outputs:
        at = open_at.get(out.index)
        if at is None:
            merged.append(out)
            at = len(merged) - 1
        else:
            merged[at] = merged[at].then(out)
        if merged[at].finished or merged[at].error is not None:
            open_at.pop(out.index, None)
        else:
            open_at[out.index] = at
    return merged


@dataclass
class SpecStats:
    """Speculative decoding's counters since start, vLLM's spec_decode_* (engine/speculative.py)."""
    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)


@dataclass(frozen=True)
class EngineStats:
    running: int
    waiting: int
    free_blocks: int
    total_blocks: int
    prefix_cache_hits: int = 0
    prefix_cache_queries: int = 0
    preemptions: int = 0
    generated_tokens: int = 0
    prompt_tokens: int = 0  # the prompts of the sequences that have started generating (or were pooled)
    spec: SpecStats | None = None  # speculative decoding's counters, when it is configured
    free_state_slots: int = 0  # hybrid models: the state pool's free slots
    total_state_slots: int = 0


@dataclass(frozen=True)
class LoraInfo:
    name: str
    path: str
    rank: int


@dataclass(frozen=True)
class ModelInfo:
    model_id: str
    max_model_len: int
    vocab_size: int
    eos_token_ids: tuple[int, ...]
    dtype: str
    device: str
    block_size: int
    extra: dict = field(default_factory=dict)
    runner: str = "generate"  # generate | pooling
    embedding_size: int = 0  # the pooling runner's vector width (the hidden size)
    lora_enabled: bool = False
    max_lora_rank: int = 0
    lora_adapters: tuple[LoraInfo, ...] = ()
    tool_call_parser: str = "hermes"  # the format of the model's tool calls: hermes (JSON) | qwen3_coder (XML)
    decode_route: str = ""  # how steps run (engine_setup.Route): cuda-graphs | cuda-eager | cpu-traced | cpu-native | cpu-torch
    quantization: str = ""  # int8 (W8A8 weights) | int4 (4-bit weights) | "" (the dtype's)
    speculative_config: str = ""  # the --speculative-config in force, as JSON; "" without speculation
    state_slot_bytes: int = 0  # hybrid models: one sequence's linear-attention states, all layers
    random_weights: bool = False  # xserv's demo model: everything it writes is random text
    max_images_per_prompt: int = 0  # --limit-mm-per-prompt; 0: the model accepts no images
