"""RunnerKind: what one engine serves, chosen at start (--runner) and fixed for its life.

generate runs Generate (text); pooling runs Embed (an embedding model's vectors); score runs Score
(a reranker's relevance). A call for another kind is refused, naming what the engine serves and
what to start instead (Unsupported: gRPC UNIMPLEMENTED). Imports no torch.
"""

import enum

from xserv_engine.errors import WrongRunner


class RunnerKind(enum.Enum):
    GENERATE = "generate"
    POOLING = "pooling"
    SCORE = "score"

    @classmethod
    def of(cls, pooling) -> "RunnerKind":
        """The kind of a runner built with `pooling` (a models.pooling.PoolingConfig, or None)."""
        if pooling is None:
            return cls.GENERATE
        return cls.POOLING if pooling.classify is None else cls.SCORE

    def check_serves(self, wanted: "RunnerKind", model_id: str) -> None:
        """Unsupported unless this engine serves `wanted`."""
        if self is not wanted:
            raise self.refusal(wanted, model_id)

    def refusal(self, wanted: "RunnerKind", model_id: str) -> WrongRunner:
        """What this engine answers a call for another kind: what it serves, what to use instead."""
        if wanted is RunnerKind.GENERATE:
            serves, use = _SERVES[self]
            message = f"model {model_id} serves {serves} (--runner {self.value}), not generation: use {use}"
        else:
            message = f"model {model_id} is {_IS[self]}; {_NEEDS[wanted]}"
        return WrongRunner(message, model_id, self.value, wanted.value)

_SERVES = {RunnerKind.POOLING: ("embeddings", "Embed (REST: /v1/embeddings)"),
           RunnerKind.SCORE: ("relevance scores", "Score (REST: /rerank)")}
_IS = {RunnerKind.GENERATE: "a generation model", RunnerKind.POOLING: "an embedding model: use Embed",
       RunnerKind.SCORE: "a reranker (--runner score): use Score"}
_NEEDS = {RunnerKind.POOLING: "Embed needs an embedding model (such as Qwen3-Embedding), served with --runner pooling",
          RunnerKind.SCORE: "Score needs a reranker (such as Qwen3-Reranker), served with --runner score"}
