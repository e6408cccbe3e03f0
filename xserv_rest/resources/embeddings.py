"""POST /v1/embeddings: OpenAI's embeddings API over one Embed call (an embedding model, served
by an engine with the pooling runner). The call is watched for the client hanging up, as a
generation's is, so that the engine stops embedding for nobody."""

import uuid

import falcon

from xserv_rest.config import RestConfig
from xserv_rest.disconnect import DisconnectWatcher
from xserv_rest.engine_call import result_of
from xserv_rest.engine_client import EngineClient
from xserv_rest.protocol.base import Limits
from xserv_rest.protocol.embeddings import EmbeddingRequest, embedding_list
from xserv_rest.resources.generation_resource import parse_body, read_body
from xserv_rest.resources.models import served_model


class Embeddings:
    def __init__(self, config: RestConfig, engine: EngineClient, watcher: DisconnectWatcher):
        self.config = config
        self.engine = engine
        self.watcher = watcher

    def on_post(self, req: falcon.Request, resp: falcon.Response) -> None:
        raw = read_body(req, self.config.max_body_bytes)
        info = self.engine.served_model()
        request = parse_body(EmbeddingRequest, raw, Limits(embedding_size=info.embedding_size or None))
        served_model(self.engine, request.model)
        request_id = f"embd-{uuid.uuid4().hex}"
        req.context.engine_request_id = request_id
        if not request.batched:  # the engine's inputs[0] is this body's whole input
            req.context.param_names = {"input[0]": "input"}
        call = self.engine.embed(request.to_grpc(request_id), req.context.request_id)
        reply = result_of(call, req, self.watcher, self.engine.request_timeout_s)
        resp.text = embedding_list(reply, info.model_id, request.encoding_format).model_dump_json()

