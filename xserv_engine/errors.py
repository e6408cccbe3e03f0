"""Typed errors for failures a user can cause. Mapped to gRPC status in server/status.py only."""


class XservError(Exception):
    """Base class for errors reported to the caller instead of crashing the engine."""


class InvalidRequest(XservError):
    """A request field has a value the engine cannot serve; `field` names it."""

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field = field
        self.message = message


class ContextTooLong(XservError):
    """The prompt plus max_tokens does not fit in max_model_len."""

    def __init__(self, prompt_tokens: int, max_tokens: int, max_model_len: int):
        super().__init__(
            f"this model's maximum context length is {max_model_len} tokens, but the request "
            f"asks for {prompt_tokens + max_tokens} ({prompt_tokens} in the prompt, "
            f"{max_tokens} for the completion); shorten the prompt or lower max_tokens"
        )
        self.prompt_tokens = prompt_tokens
        self.max_tokens = max_tokens
        self.max_model_len = max_model_len


class InputTooLong(ContextTooLong):
    """An input to embed or score is longer than the context; `field` names it (inputs[i], documents[i])."""

    def __init__(self, field: str, input_tokens: int, max_model_len: int, remedy: str = "shorten it"):
        XservError.__init__(
            self, f"{field} has {input_tokens} tokens, more than this model's maximum context length of "
                  f"{max_model_len}; {remedy}")
        self.field = field
        self.prompt_tokens = input_tokens
        self.max_tokens = 0
        self.max_model_len = max_model_len


class NotFound(XservError):
    """A request names something the engine does not have (a LoRA adapter not loaded)."""

    def __init__(self, field: str, message: str):
        super().__init__(message)
        self.field = field
        self.message = message


class Unsupported(XservError):
    """A call this engine does not serve: Embed on a generation model, Generate on an embedding model."""


class WrongRunner(Unsupported):
    """A call for another kind of model than the engine serves (RunnerKind.refusal). Both kinds
    travel as a structured detail, so that the REST front says it in its own terms."""

    def __init__(self, message: str, model_id: str, serves: str, wanted: str):
        super().__init__(message)
        self.model_id = model_id
        self.serves = serves  # RunnerKind values: generate | pooling | score
        self.wanted = wanted


class EngineOverloaded(XservError):
    """The waiting queue is full (max_queued_requests)."""

    def __init__(self, max_queued: int):
        super().__init__(f"engine queue is full ({max_queued} requests waiting); retry later")
        self.max_queued = max_queued


class EngineUnavailable(XservError):
    """The engine is not serving (loading, draining or stopped)."""


class ModelLoadError(XservError):
    """A model directory is missing, incomplete or of an unsupported architecture."""
