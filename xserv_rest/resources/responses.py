"""POST /v1/responses, GET and DELETE /v1/responses/{id}, POST /v1/responses/{id}/cancel and
GET /v1/responses/{id}/input_items: OpenAI's Responses API over the same chat Generate call as
/v1/chat/completions, with responses kept in the store (background ones generated with no client
attached, streamed ones replayable from any worker)."""

import time

import falcon

from xserv_rest.config import RestConfig
from xserv_rest.conversations.store import ConversationStore
from xserv_rest.disconnect import DisconnectWatcher
from xserv_rest.engine_client import EngineClient
from xserv_rest.errors import ApiError, invalid_request, to_api_error
from xserv_rest.generation import Generation
from xserv_rest.metrics import Metrics
from xserv_rest.resources.generation_resource import parse_body, read_body, request_limits
from xserv_rest.resources.models import selected_model
from xserv_rest.responses.background import BackgroundRuns
from xserv_rest.responses.builder import ResponseBuilder, new_id
from xserv_rest.responses.items import dump_items, listed, parse_items, with_ids
from xserv_rest.responses.objects import DeletedResponse, Response
from xserv_rest.responses.pages import page
from xserv_rest.responses.request import ResponsesRequest, in_responses_terms
from xserv_rest.responses.store import ResponseStore
from xserv_rest.responses.stream import Recorder, ResponseEventStream, ResponseRun, follow


class Responses:
    def __init__(self, config: RestConfig, engine: EngineClient, watcher: DisconnectWatcher, metrics: Metrics,
                 store: ResponseStore, conversations: ConversationStore):
        self.config = config
        self.engine = engine
        self.watcher = watcher
        self.metrics = metrics
        self.store = store
        self.conversations = conversations
        self.background = BackgroundRuns(store)

    def on_post(self, req: falcon.Request, resp: falcon.Response) -> None:
        raw = read_body(req, self.config.max_body_bytes)
        info = self.engine.served_model()
        limits = request_limits(self.config, info)
        request = parse_body(ResponsesRequest, raw, limits)
        model = selected_model(self.engine, request.model)
        input_items = with_ids(dump_items(request.input_items()))
        context = dump_items(parse_items(self._history(request))) + input_items
        response = Response(id=new_id("resp"), created_at=int(time.time()), model=model.id, **request.echo())
        req.context.engine_request_id = response.id
        chat = request.chat_request(parse_items(context), limits).to_grpc(response.id)
        chat.lora_name = model.lora_name
        builder = ResponseBuilder(response, request.logprobs)
        recorder = None
        if request.store_it:
            recorder = Recorder(self.store, context, keep_events=bool(request.stream),
                                finished=lambda stored: self._add_to_conversation(request, input_items, stored))
        if request.background:
            return self._start_background(req, resp, request, builder, chat, recorder)
        generation = Generation(self.engine, self.watcher, chat, req.env.get("gunicorn.socket"), self.metrics,
                                req.context.request_id)
        req.context.generation = generation
        try:
            generation.first()
        except Exception as exc:
            raise self._api_error(exc) from None
        if request.stream:
            resp.content_type = "text/event-stream"
            resp.cache_control = ["no-cache"]
            resp.stream = ResponseEventStream(ResponseRun(builder, generation, recorder, self._api_error))
            return
        try:
            for message in generation:
                builder.add(message)
            builder.end()
        except Exception as exc:
            raise self._api_error(exc) from None
        finally:
            generation.close()
        if recorder is not None:
            recorder.finish(builder.response.model_dump(mode="json"), [])
        resp.content_type = falcon.MEDIA_JSON
        resp.text = builder.response.model_dump_json()

    def _start_background(self, req: falcon.Request, resp: falcon.Response, request: ResponsesRequest,
                          builder: ResponseBuilder, chat, recorder: Recorder) -> None:
        """Answers at once (queued, or the stream of its events) while a thread of this worker runs it."""
        builder.response.status = "queued"
        queued = builder.response.model_dump(mode="json")
        limit = self.config.max_background_responses
        if not recorder.start(queued, background=True, max_background=limit):
            raise ApiError(429, f"{limit} background responses are running, the most this server runs at once "
                           "(--max-background-responses); retry later", type="rate_limit_error",
                           code="too_many_background_responses",
                           headers={"Retry-After": str(self.config.retry_after_s)})
        generation = Generation(self.engine, self.watcher, chat, None, self.metrics, req.context.request_id)
        self.background.start(ResponseRun(builder, generation, recorder, self._api_error))
        if request.stream:
            resp.content_type = "text/event-stream"
            resp.cache_control = ["no-cache"]
            resp.stream = follow(self.store, queued["id"], -1)
            return
        resp.media = queued

    def on_get_response(self, req: falcon.Request, resp: falcon.Response, response_id: str) -> None:
        stored = self._stored(response_id)
        if not req.get_param_as_bool("stream", default=False):
            resp.media = stored.response
            return
        after = req.get_param_as_int("starting_after", min_value=-1, default=-1)
        if not self.store.has_events(response_id):
            raise invalid_request(f"response '{response_id}' was not created with stream: true and store on, so it "
                                  "has no events to stream", param="stream")
        resp.content_type = "text/event-stream"
        resp.cache_control = ["no-cache"]
        resp.stream = follow(self.store, response_id, after)

    def on_delete_response(self, req: falcon.Request, resp: falcon.Response, response_id: str) -> None:
        if not self.store.delete(response_id):
            raise _not_found(response_id)
        resp.media = DeletedResponse(id=response_id).model_dump(mode="json")

    def on_post_cancel(self, req: falcon.Request, resp: falcon.Response, response_id: str) -> None:
        stored = self._stored(response_id)
        if not stored.response.get("background"):
            raise invalid_request("Only background responses can be cancelled.", param="response_id",
                                  code="invalid_state")
        cancelled = self.store.cancel(response_id)
        if cancelled is None:
            status = self._stored(response_id).response["status"]
            raise invalid_request(f"Cannot cancel a response that is {status}.", param="response_id",
                                  code="invalid_state")
        resp.media = cancelled

    def on_get_input_items(self, req: falcon.Request, resp: falcon.Response, response_id: str) -> None:
        stored = self._stored(response_id)
        resp.media = page([listed(item) for item in stored.context], req).model_dump(mode="json")

    def _stored(self, response_id: str):
        stored = self.store.get(response_id)
        if stored is None:
            raise _not_found(response_id)
        return stored

    def _history(self, request: ResponsesRequest) -> list[dict]:
        """The items before this input: the previous response's context and output, or the
        conversation's items."""
        if request.conversation_id is not None:
            items = self.conversations.items(request.conversation_id)
            if items is None:
                raise ApiError(404, f"'conversation': no conversation has id '{request.conversation_id}'",
                               param="conversation", code="not_found")
            return items
        if request.previous_response_id is None:
            return []
        stored = self.store.get(request.previous_response_id)
        if stored is None:
            raise ApiError(404, f"'previous_response_id': no stored response has id '{request.previous_response_id}' "
                           "(it was deleted, expired, or created with store: false)", param="previous_response_id",
                           code="not_found")
        return stored.context + stored.response["output"]

    def _add_to_conversation(self, request: ResponsesRequest, input_items: list[dict], response: dict) -> None:
        """A finished response's input and output join its conversation (a failed or cancelled one's do not)."""
        if request.conversation_id is not None and response["status"] in ("completed", "incomplete"):
            self.conversations.add_items(request.conversation_id, input_items + response["output"])

    def _api_error(self, exc: BaseException) -> ApiError:
        error = to_api_error(exc, self.config.retry_after_s, prompt_param="input")
        if error.param is not None:
            error.message, error.param = in_responses_terms(error.message, error.param)
        return error


def _not_found(response_id: str) -> ApiError:
    return ApiError(404, f"No response found with id '{response_id}'.", param="response_id", code="not_found")

