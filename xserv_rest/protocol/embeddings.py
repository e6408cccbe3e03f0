"""POST /v1/embeddings (OpenAI's embeddings API): the request, which builds its EmbedRequest, and
the answer, whose vectors go out as JSON numbers or, as OpenAI's, as base64 of little-endian
float32 bytes (what the openai SDK asks for when its caller names no encoding_format)."""

import base64
import struct
from typing import Annotated, Any, Literal

from pydantic import Field, ValidationError, ValidationInfo, WrapValidator, field_validator
from pydantic_core import PydanticCustomError

from xserv.v1 import engine_pb2
from xserv_engine.sampling_params import U32
from xserv_rest.protocol.base import Answer, FieldError, Limits, PositiveU32, RequestBody, TokenId

MAX_INPUTS = 2048  # OpenAI's limit on the inputs of one request
FORMS = "a string, an array of strings, an array of token ids, or an array of arrays of token ids"

Text = Annotated[str, Field(min_length=1)]
InputIds = Annotated[list[TokenId], Field(min_length=1)]


def _input(value: Any, handler) -> Any:
    """OpenAI's four forms, or a 400 that says which part is wrong."""
    try:
        return handler(value)
    except ValidationError:
        raise FieldError(*_problem(value)) from None


def _problem(value: Any) -> tuple[str, str]:
    """(param, message) of an `input` that none of the forms takes."""
    if value == "":
        return "input", "'input' must not be an empty string"
    if isinstance(value, list):
        if not value:
            return "input", "'input' must not be empty"
        if len(value) > MAX_INPUTS and isinstance(value[0], (str, list)):
            return "input", f"'input' must hold at most {MAX_INPUTS} inputs, got {len(value)}"
        for index, item in enumerate(value):
            if item == "" or item == []:
                return f"input[{index}]", f"'input[{index}]' must not be empty"
    return "input", f"'input' must be {FORMS} (token ids are integers from 0 to {U32})"


Input = Annotated[Text | InputIds | Annotated[list[Text], Field(min_length=1, max_length=MAX_INPUTS)]
                  | Annotated[list[InputIds], Field(min_length=1, max_length=MAX_INPUTS)], WrapValidator(_input)]


class EmbeddingRequest(RequestBody):
    model: str | None = Field(None, description="the served model's id, or omitted")
    input: Input = Field(description=f"what to embed: {FORMS}; at most {MAX_INPUTS} inputs, none empty, each no "
                                     "longer than the model's context")
    encoding_format: Literal["float", "base64"] | None = Field(
        None, description="float (the default): arrays of numbers; base64: each vector's little-endian float32 bytes")
    dimensions: PositiveU32 | None = Field(None, description="keep the first this-many values (Matryoshka), at "
                                                             "most the model's embedding size; default: all")
    user: str | None = Field(None, description="accepted and ignored")
    truncate_prompt_tokens: PositiveU32 | None = Field(None, description="vLLM extra: embed only the last this-many "
                                                                         "tokens of each input")

    @field_validator("dimensions")
    @classmethod
    def _dimensions_within_the_model_s(cls, dimensions: int | None, info: ValidationInfo) -> int | None:
        size = Limits.of(info).embedding_size
        if dimensions is not None and size and dimensions > size:
            raise PydanticCustomError("dimensions_limit", "must be between 1 and {size} (the model's embedding "
                                      "size), got {dimensions}", {"size": size, "dimensions": dimensions})
        return dimensions

    @property
    def batched(self) -> bool:
        """Whether `input` is an array of inputs (so the engine's inputs[i] is this body's input[i])."""
        return isinstance(self.input, list) and isinstance(self.input[0], (str, list))

    @property
    def inputs(self) -> list[str | list[int]]:
        return self.input if self.batched else [self.input]

    def to_grpc(self, request_id: str) -> engine_pb2.EmbedRequest:
        request = engine_pb2.EmbedRequest(request_id=request_id)
        for item in self.inputs:
            if isinstance(item, str):
                request.inputs.add(text=item)
            else:
                request.inputs.add().token_ids.ids.extend(item)
        if self.dimensions is not None:
            request.dimensions = self.dimensions
        if self.truncate_prompt_tokens is not None:
            request.truncate_prompt_tokens = self.truncate_prompt_tokens
        return request


class EmbeddingUsage(Answer):
    prompt_tokens: int = Field(description="summed over the inputs")
    total_tokens: int


class EmbeddingData(Answer):
    object: Literal["embedding"] = "embedding"
    index: int = Field(description="the input's place in `input`")
    embedding: list[float] | str = Field(description="the vector, or with encoding_format base64 its little-endian "
                                                     "float32 bytes in base64")


class EmbeddingList(Answer):
    object: Literal["list"] = "list"
    data: list[EmbeddingData]
    model: str
    usage: EmbeddingUsage


def embedding_list(reply: engine_pb2.EmbedResponse, model: str, encoding_format: str | None) -> EmbeddingList:
    encode = _base64 if encoding_format == "base64" else list
    data = [EmbeddingData(index=index, embedding=encode(embedding.values))
            for index, embedding in enumerate(reply.embeddings)]
    tokens = sum(embedding.prompt_tokens for embedding in reply.embeddings)
    return EmbeddingList(data=data, model=model, usage=EmbeddingUsage(prompt_tokens=tokens, total_tokens=tokens))


def _base64(values) -> str:
    return base64.b64encode(struct.pack(f"<{len(values)}f", *values)).decode("ascii")
