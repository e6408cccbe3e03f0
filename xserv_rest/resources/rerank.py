"""POST /rerank (/v1/rerank, /v2/rerank) and POST /score: vLLM's reranking APIs over one Score
call (a reranker such as Qwen3-Reranker, served by an engine with the score runner). The call is
watched for the client hanging up, as an embedding's is."""

import time
import uuid

import falcon

from xserv.v1 import engine_pb2
from xserv_rest.config import RestConfig
from xserv_rest.disconnect import DisconnectWatcher
from xserv_rest.engine_call import result_of
from xserv_rest.engine_client import EngineClient
from xserv_rest.protocol.rerank import RerankRequest, ScoreRequest, rerank_response, score_response
from xserv_rest.resources.generation_resource import parse_body, read_body
from xserv_rest.resources.models import served_model


class ScoreResource:
    def __init__(self, config: RestConfig, engine: EngineClient, watcher: DisconnectWatcher):
        self.config = config
        self.engine = engine
        self.watcher = watcher

    def score(self, req: falcon.Request, request: engine_pb2.ScoreRequest) -> engine_pb2.ScoreResponse:
        req.context.engine_request_id = request.request_id
        call = self.engine.score(request, req.context.request_id)
        return result_of(call, req, self.watcher, self.engine.request_timeout_s)


class Rerank(ScoreResource):
    def on_post(self, req: falcon.Request, resp: falcon.Response) -> None:
        request = parse_body(RerankRequest, read_body(req, self.config.max_body_bytes))
        info = served_model(self.engine, request.model)
        request_id = f"rerank-{uuid.uuid4().hex}"
        reply = self.score(req, request.to_grpc(request_id))
        resp.text = rerank_response(request_id, reply, request, info.model_id).model_dump_json()


class Score(ScoreResource):
    def on_post(self, req: falcon.Request, resp: falcon.Response) -> None:
        request = parse_body(ScoreRequest, read_body(req, self.config.max_body_bytes))
        info = served_model(self.engine, request.model)
        request_id = f"score-{uuid.uuid4().hex}"
        req.context.param_names = request.param_names()
        reply = self.score(req, request.to_grpc(request_id))
        resp.text = score_response(request_id, int(time.time()), reply, info.model_id).model_dump_json()
