"""POST /v1/responses, GET and DELETE /v1/responses/{id}: OpenAI's Responses API over the same
chat Generate call as /v1/chat/completions, with finished responses kept in the store."""

import time

import falcon

from xserv_rest.config import RestConfig
from xserv_rest.disconnect import DisconnectWatcher
from xserv_rest.engine_client import EngineClient
from xserv_rest.errors import ApiError, to_api_error
from xserv_rest.generation import Generation
from xserv_rest.metrics import Metrics
from xserv_rest.protocol.base import Limits
from xserv_rest.resources.generation_resource import parse_body, read_body
from xserv_rest.resources.models import selected_model
from xserv_rest.responses.builder import ResponseBuilder, new_id
from xserv_rest.responses.items import dump_items, parse_items
from xserv_rest.responses.objects import DeletedResponse, Response
from xserv_rest.responses.request import ResponsesRequest, responses_param
from xserv_rest.responses.store import ResponseStore
from xserv_rest.responses.stream import ResponseEventStream


class Responses:
    def __init__(self, config: RestConfig, engine: EngineClient, watcher: DisconnectWatcher, metrics: Metrics):
        self.config = config
        self.engine = engine
        self.watcher = watcher
        self.metrics = metrics
        self.store = ResponseStore(config.responses_store, config.responses_max_age_s,
                                   config.responses_max_bytes)

    def on_post(self, req: falcon.Request, resp: falcon.Response) -> None:
        raw = read_body(req, self.config.max_body_bytes)
        info = self.engine.served_model()
        limits = Limits(max_n=self.config.max_n, max_model_len=info.max_model_len)
        request = parse_body(ResponsesRequest, raw, limits)
        model = selected_model(self.engine, request.model)
        items = self._history(request.previous_response_id) + request.input_items()
        response = Response(id=new_id("resp"), created_at=int(time.time()), model=model.id, **request.echo())
        req.context.engine_request_id = response.id
        chat = request.chat_request(items, limits).to_grpc(response.id)
        chat.lora_name = model.lora_name
        generation = Generation(self.engine, self.watcher, chat, req.env.get("gunicorn.socket"), self.metrics,
                                req.context.request_id)
        try:
            generation.first()
        except Exception as exc:
            raise self._api_error(exc) from None
        builder = ResponseBuilder(response, request.logprobs)

        def finished(response: Response) -> None:
            if request.store_it:
                self.store.put(response.model_dump(mode="json"), dump_items(items))

        if request.stream:
            resp.content_type = "text/event-stream"
            resp.cache_control = ["no-cache"]
            resp.stream = ResponseEventStream(builder, generation, finished, self._api_error)
            return
        try:
            for message in generation:
                builder.add(message)
            builder.end()
        except Exception as exc:
            raise self._api_error(exc) from None
        finally:
            generation.close()
        finished(builder.response)
        resp.content_type = falcon.MEDIA_JSON
        resp.text = builder.response.model_dump_json()

    def on_get_response(self, req: falcon.Request, resp: falcon.Response, response_id: str) -> None:
        stored = self.store.get(response_id)
        if stored is None:
            raise _not_found(response_id)
        resp.media = stored.response

    def on_delete_response(self, req: falcon.Request, resp: falcon.Response, response_id: str) -> None:
        if not self.store.delete(response_id):
            raise _not_found(response_id)
        resp.media = DeletedResponse(id=response_id).model_dump(mode="json")

    def _history(self, previous_response_id: str | None) -> list:
        """The conversation up to and including the previous response's output, as items."""
        if previous_response_id is None:
            return []
        stored = self.store.get(previous_response_id)
        if stored is None:
            raise ApiError(404, f"'previous_response_id': no stored response has id '{previous_response_id}' (it was "
                           "deleted, expired, or created with store: false)", param="previous_response_id",
                           code="not_found")
        return parse_items(stored.context + stored.response["output"])

    def _api_error(self, exc: BaseException) -> ApiError:
        error = to_api_error(exc, self.config.retry_after_s, prompt_param="input")
        if error.param is not None:
            error.param = responses_param(error.param)
        return error


def _not_found(response_id: str) -> ApiError:
    return ApiError(404, f"No response found with id '{response_id}'.", param="response_id", code="not_found")
