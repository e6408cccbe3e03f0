"""POST /rerank (also /v1/rerank, /v2/rerank) and POST /score: vLLM's reranking APIs (the
rerank one is also Jina's and Cohere's), each request building one ScoreRequest; the answers
as vLLM shapes them."""

from typing import Annotated, Any, Literal

from pydantic import Field, ValidationError, WrapValidator

from xserv.v1 import engine_pb2
from xserv_rest.protocol.base import Answer, FieldError, Model, PositiveU32, RequestBody, omitted
from xserv_rest.protocol.unsupported import unsupported

MAX_DOCUMENTS = 2048  # the engine's limit on the documents of one Score call

Text = Annotated[str, Field(min_length=1)]
Truncation = unsupported("xserv does not truncate documents for scoring; shorten them")


class DocumentObject(Model):
    """Cohere's and Jina's form of a document."""

    text: Text


def _refused(problem) -> Any:
    """A WrapValidator that turns pydantic's errors about a value into problem(value)'s
    (param, message), so that a 400 names the one item that is wrong."""

    def validate(value: Any, handler) -> Any:
        try:
            return handler(value)
        except ValidationError:
            raise FieldError(*problem(value)) from None

    return WrapValidator(validate)


def _texts_problem(name: str, value: Any, objects: bool) -> tuple[str, str]:
    """(param, message) of documents that none of their forms takes: the list, or its first bad
    item; `objects`: whether a document may also be {"text": ...}."""
    item_forms = 'a string or a {"text": string} object' if objects else "a string"
    forms = 'an array of strings or of {"text": string} objects' if objects else "a string or an array of strings"
    if value == "":
        return name, f"'{name}' must not be an empty string"
    if not isinstance(value, list):
        return name, f"'{name}' must be {forms}"
    if not value:
        return name, f"'{name}' must hold at least one document"
    if len(value) > MAX_DOCUMENTS:
        return name, f"'{name}' must hold at most {MAX_DOCUMENTS} documents, got {len(value)}"
    for index, item in enumerate(value):
        text = item.get("text") if objects and isinstance(item, dict) else item
        if text == "":
            return f"{name}[{index}]", f"'{name}[{index}]' must not be empty"
        if not isinstance(text, str):
            return f"{name}[{index}]", f"'{name}[{index}]' must be {item_forms}"
    return name, f"'{name}' must be {forms}"


def _documents_problem(value: Any) -> tuple[str, str]:
    return _texts_problem("documents", value, objects=True)


def _text_2_problem(value: Any) -> tuple[str, str]:
    return _texts_problem("text_2", value, objects=False)


def _query_problem(value: Any) -> tuple[str, str]:
    return "query", "'query' must not be empty" if value == "" else "'query' must be a string"


def _text_1_problem(value: Any) -> tuple[str, str]:
    if value == "" or value == [""]:
        name = "text_1" if value == "" else "text_1[0]"
        return name, f"'{name}' must not be empty"
    if isinstance(value, list) and len(value) > 1:
        return "text_1", ("'text_1' must be one query (a string or an array of one string): pairwise scoring, one "
                          "text_1 per text_2, is not supported; send one request per query")
    return "text_1", "'text_1' must be a string or an array of one string"


Query = Annotated[Text, _refused(_query_problem)]
Documents = Annotated[list[Text | DocumentObject], Field(min_length=1, max_length=MAX_DOCUMENTS),
                      _refused(_documents_problem)]
OneQuery = Annotated[Text | Annotated[list[Text], Field(min_length=1, max_length=1)], _refused(_text_1_problem)]
Texts = Annotated[Text | Annotated[list[Text], Field(min_length=1, max_length=MAX_DOCUMENTS)],
                  _refused(_text_2_problem)]
INSTRUCTION = ("xserv extra: the task in Qwen3-Reranker's template (<Instruct>: ...); default: \"Given a web search "
               "query, retrieve relevant passages that answer the query\"")


def score_request(request_id: str, query: str, documents: list[str], instruction: str | None
                  ) -> engine_pb2.ScoreRequest:
    request = engine_pb2.ScoreRequest(request_id=request_id, query=query, documents=documents)
    if instruction is not None:
        request.instruction = instruction
    return request


class RerankRequest(RequestBody):
    model: str | None = Field(None, description="the served model's id, or omitted")
    query: Query = Field(description="what the documents are ranked against")
    documents: Documents = Field(description=f"1 to {MAX_DOCUMENTS} documents, none empty: strings, or objects "
                                             "with a text (Cohere's and Jina's form)")
    top_n: PositiveU32 | None = Field(None, description="answer with the best this-many documents; default: all")
    return_documents: bool | None = Field(None, description="include each document's text in its result "
                                                            "(default: true)")
    instruction: Text | None = Field(None, description=INSTRUCTION)
    truncate_prompt_tokens: Truncation = None
    max_tokens_per_doc: Truncation = None

    @property
    def texts(self) -> list[str]:
        return [item if isinstance(item, str) else item.text for item in self.documents]

    def to_grpc(self, request_id: str) -> engine_pb2.ScoreRequest:
        return score_request(request_id, self.query, self.texts, self.instruction)


class ScoreRequest(RequestBody):
    model: str | None = Field(None, description="the served model's id, or omitted")
    text_1: OneQuery = Field(description="the query: a string, or an array of one string")
    text_2: Texts = Field(description=f"the documents to score against text_1: a string, or an array of 1 to "
                                      f"{MAX_DOCUMENTS} strings, none empty")
    instruction: Text | None = Field(None, description=INSTRUCTION)
    truncate_prompt_tokens: Truncation = None

    @property
    def query(self) -> str:
        return self.text_1 if isinstance(self.text_1, str) else self.text_1[0]

    @property
    def documents(self) -> list[str]:
        return [self.text_2] if isinstance(self.text_2, str) else self.text_2

    def param_names(self) -> dict[str, str]:
        """The engine's field names -> this body's (the engine's documents[3] is text_2[3])."""
        names = {"query": "text_1" if isinstance(self.text_1, str) else "text_1[0]", "documents": "text_2"}
        if isinstance(self.text_2, str):
            return names | {"documents[0]": "text_2"}
        return names | {f"documents[{index}]": f"text_2[{index}]" for index in range(len(self.text_2))}

    def to_grpc(self, request_id: str) -> engine_pb2.ScoreRequest:
        return score_request(request_id, self.query, self.documents, self.instruction)


class RerankDocument(Answer):
    text: str


class RerankResult(Answer):
    index: int = Field(description="the document's place in `documents`")
    document: RerankDocument | None = omitted()
    relevance_score: float = Field(description="from 0 (irrelevant) to 1 (relevant)")


class RerankUsage(Answer):
    total_tokens: int = Field(description="the prompts' tokens, summed over the documents")


class RerankResponse(Answer):
    id: str
    model: str
    usage: RerankUsage
    results: list[RerankResult] = Field(description="by relevance_score, highest first (equal scores in document "
                                                    "order), top_n of them")


def rerank_response(request_id: str, reply: engine_pb2.ScoreResponse, request: RerankRequest,
                    model: str) -> RerankResponse:
    scores = [document.score for document in reply.scores]
    ranked = sorted(range(len(scores)), key=lambda index: (-scores[index], index))[:request.top_n]
    texts = request.texts if request.return_documents is not False else None
    results = [RerankResult(index=index, relevance_score=scores[index],
                            document=RerankDocument(text=texts[index]) if texts else None) for index in ranked]
    tokens = sum(document.prompt_tokens for document in reply.scores)
    return RerankResponse(id=request_id, model=model, usage=RerankUsage(total_tokens=tokens), results=results)


class ScoreData(Answer):
    index: int = Field(description="the document's place in text_2")
    object: Literal["score"] = "score"
    score: float = Field(description="from 0 (irrelevant) to 1 (relevant)")


class ScoreUsage(Answer):
    prompt_tokens: int = Field(description="summed over the documents")
    total_tokens: int


class ScoreResponse(Answer):
    id: str
    object: Literal["list"] = "list"
    created: int
    model: str
    data: list[ScoreData] = Field(description="one per document, in text_2's order")
    usage: ScoreUsage


def score_response(request_id: str, created: int, reply: engine_pb2.ScoreResponse, model: str) -> ScoreResponse:
    data = [ScoreData(index=index, score=document.score) for index, document in enumerate(reply.scores)]
    tokens = sum(document.prompt_tokens for document in reply.scores)
    return ScoreResponse(id=request_id, created=created, model=model, data=data,
                         usage=ScoreUsage(prompt_tokens=tokens, total_tokens=tokens))
