"""The user-caused failures of the engine's calls, once: each call, the gRPC status and field
violation it ends with, and, where the REST front has a route for it, the OpenAI error a REST
client gets. tests/rest/test_error_cases.py runs every case against the fake engine the REST tests
use (tests/rest/fake_grpc_engine.py) and against real engines, so the two cannot drift."""

from dataclasses import dataclass

import grpc
from xserv.v1 import engine_pb2

LONG = "word " * 5000  # past the 4096-token context of both engines (the fake: a token per character)


@dataclass(frozen=True)
class RestError:
    path: str
    body: dict
    status: int
    param: str | None
    code: str | None = None


@dataclass(frozen=True)
class ErrorCase:
    id: str
    runner: str  # the kind of engine that serves the call: generate (with LoRA on), pooling or score
    rpc: str
    request: object  # the call's request message
    code: grpc.StatusCode
    field: str | None  # the google.rpc.BadRequest field violation; None: none
    says: str  # in the status' details
    rest: RestError | None = None


def _generate(params: dict | None = None, **input_field) -> engine_pb2.GenerateRequest:
    return engine_pb2.GenerateRequest(params=engine_pb2.SamplingParams(**(params or {"max_tokens": 4})), **input_field)


def _embed(*inputs, **fields) -> engine_pb2.EmbedRequest:
    return engine_pb2.EmbedRequest(inputs=[engine_pb2.EmbedInput(text=x) if isinstance(x, str) else
                                           engine_pb2.EmbedInput(token_ids=engine_pb2.TokenIds(ids=x)) for x in inputs],
                                   **fields)


INVALID, NOT_FOUND = grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.NOT_FOUND
ERROR_CASES = [
    ErrorCase("max_tokens past the context", "generate", "Generate",
              _generate({"max_tokens": 4090}, text="Hello " * 10), INVALID, "max_tokens",
              "maximum context length is 4096 tokens",
              RestError("/v1/completions", {"prompt": "Hello " * 10, "max_tokens": 4090}, 400, "max_tokens",
                        "context_length_exceeded")),
    ErrorCase("a token id past the vocabulary", "generate", "Generate", _generate(token_ids={"ids": [5, 151936]}),
              INVALID, "token_ids", "out of range",
              RestError("/v1/completions", {"prompt": [5, 151936], "max_tokens": 4}, 400, "prompt")),
    ErrorCase("a chat without messages", "generate", "Generate", _generate(chat={}), INVALID, "chat.messages",
              "at least one message",
              RestError("/v1/chat/completions", {"messages": []}, 400, "messages")),
    ErrorCase("top_p 0", "generate", "Generate", _generate({"max_tokens": 4, "top_p": 0.0}, text="Hi"), INVALID,
              "top_p", "top_p"),
    ErrorCase("an adapter not loaded", "generate", "Generate", _generate(text="Hi", lora_name="nope"), NOT_FOUND,
              "lora_name", "'nope' is not loaded",
              RestError("/v1/completions", {"prompt": "Hi", "model": "nope"}, 404, "model", "model_not_found")),
    ErrorCase("unloading an adapter not loaded", "generate", "UnloadLoraAdapter",
              engine_pb2.UnloadLoraAdapterRequest(lora_name="nope"), NOT_FOUND, "lora_name", "'nope' is not loaded",
              RestError("/v1/unload_lora_adapter", {"lora_name": "nope"}, 404, "lora_name", "model_not_found")),
    ErrorCase("no inputs", "pooling", "Embed", _embed(), INVALID, "inputs", "at least one input",
              RestError("/v1/embeddings", {"input": []}, 400, "input")),
    ErrorCase("an empty input", "pooling", "Embed", _embed("fine", ""), INVALID, "inputs[1].text", "must not be empty",
              RestError("/v1/embeddings", {"input": ["fine", ""]}, 400, "input[1]")),
    ErrorCase("an input's token id past the vocabulary", "pooling", "Embed", _embed("fine", [5, 151936]), INVALID,
              "inputs[1].token_ids", "out of range",
              RestError("/v1/embeddings", {"input": [[5], [5, 151936]]}, 400, "input[1]")),
    ErrorCase("an input past the context", "pooling", "Embed", _embed("fine", LONG), INVALID, "inputs[1]",
              "maximum context length of 4096",
              RestError("/v1/embeddings", {"input": ["fine", LONG]}, 400, "input[1]", "context_length_exceeded")),
    ErrorCase("more dimensions than the model has", "pooling", "Embed", _embed("fine", dimensions=300), INVALID,
              "dimensions", "dimensions",
              RestError("/v1/embeddings", {"input": "fine", "dimensions": 300}, 400, "dimensions")),
    ErrorCase("an empty query", "score", "Score", engine_pb2.ScoreRequest(query="", documents=["doc"]), INVALID,
              "query", "must not be empty",
              RestError("/rerank", {"query": "", "documents": ["doc"]}, 400, "query")),
    ErrorCase("no documents", "score", "Score", engine_pb2.ScoreRequest(query="q"), INVALID, "documents",
              "at least one document",
              RestError("/rerank", {"query": "q", "documents": []}, 400, "documents")),
    ErrorCase("an empty document", "score", "Score", engine_pb2.ScoreRequest(query="q", documents=["doc", ""]),
              INVALID, "documents[1]", "must not be empty",
              RestError("/rerank", {"query": "q", "documents": ["doc", ""]}, 400, "documents[1]")),
    ErrorCase("an empty instruction", "score", "Score",
              engine_pb2.ScoreRequest(query="q", documents=["doc"], instruction=""), INVALID, "instruction",
              "must not be empty"),
    ErrorCase("a document past the context", "score", "Score", engine_pb2.ScoreRequest(query="q", documents=[LONG]),
              INVALID, "documents[0]", "maximum context length of 4096",
              RestError("/rerank", {"query": "q", "documents": [LONG]}, 400, "documents[0]",
                        "context_length_exceeded")),
]
