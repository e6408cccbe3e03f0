"""Builds a Response from the engine's messages and names every step as OpenAI's stream events.

The engine's output arrives as reasoning text, then content text, then tool-call pieces; each
run of one kind is one output item (reasoning, message, function_call). Opening an item emits
output_item.added (and content_part.added), its pieces emit deltas, closing it emits the .done
events. A non-streamed answer is built by the same steps with the events dropped, so the two
answers are the same.
"""

import time
import uuid

from xserv.v1 import engine_pb2
from xserv_rest.errors import ApiError
from xserv_rest.protocol.logprobs import TokenLogprob
from xserv_rest.render import UsageCounter, chat_logprobs
from xserv_rest.responses.objects import (FunctionCallOutput, IncompleteDetails, InputTokensDetails, OutputMessage,
                                          OutputText, OutputTokensDetails, ReasoningContent, ReasoningOutput,
                                          Response, ResponseError, ResponseUsage)

Event = dict
# The items that hold text: their id prefix, their one content part, their events' prefix.
TEXT_ITEMS = {ReasoningOutput: ("rs", ReasoningContent, "response.reasoning_text"),
              OutputMessage: ("msg", OutputText, "response.output_text")}


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


class ResponseBuilder:
    def __init__(self, response: Response, logprobs: bool = False):
        self.response = response
        self.logprobs = logprobs  # the answer text's token logprobs, in output_text and its events
        self.sequence = 0
        self.item = None  # the output item being written
        self.call_items: dict[int, FunctionCallOutput] = {}  # engine tool-call index -> its item
        self.usage = UsageCounter()
        self.finish = engine_pb2.FINISH_REASON_UNSPECIFIED

    def start(self) -> list[Event]:
        """response.created (a background response is still queued there), then in_progress."""
        created = self._event("response.created", response=self.response.model_dump(mode="json"))
        self.response.status = "in_progress"
        return [created, self._event("response.in_progress", response=self.response.model_dump(mode="json"))]

    def add(self, message: engine_pb2.GenerateResponse) -> list[Event]:
        events = []
        if message.reasoning_text:
            events += self._content(ReasoningOutput, message.reasoning_text)
        if message.text:
            # A message that ends the reasoning carries its tokens' logprobs too: those are left out.
            logprobs = self.logprobs and not message.reasoning_text
            events += self._content(OutputMessage, message.text,
                                    chat_logprobs(message.logprobs)["content"] if logprobs else [])
        for delta in message.tool_calls:
            events += self._tool_call(delta)
        self.usage.add(message)
        if message.finish_reason != engine_pb2.FINISH_REASON_UNSPECIFIED:
            self.finish = message.finish_reason
        return events

    def end(self) -> list[Event]:
        """Closes the last item and sets the status from the finish reason: the final event."""
        length = self.finish == engine_pb2.FINISH_REASON_LENGTH
        events = self._close("incomplete" if length else "completed")
        response = self.response
        response.usage = self._usage()
        response.completed_at = int(time.time())
        if self.finish == engine_pb2.FINISH_REASON_ABORT:
            return events + self.fail(ApiError(500, "the engine aborted the request", code="server_error"))
        if length:
            response.status = "incomplete"
            response.incomplete_details = IncompleteDetails(reason="max_output_tokens")
            return events + [self._event("response.incomplete", response=response.model_dump(mode="json"))]
        response.status = "completed"
        return events + [self._event("response.completed", response=response.model_dump(mode="json"))]

    def fail(self, error: ApiError) -> list[Event]:
        """An error after the stream started: OpenAI's `error` event, then response.failed."""
        self.response.status = "failed"
        self.response.error = ResponseError(code=error.code or error.type, message=error.message)
        return [self._event("error", code=error.code or error.type, message=error.message, param=error.param),
                self._event("response.failed", response=self.response.model_dump(mode="json"))]

    def _content(self, kind: type, text: str, logprobs: list[dict] | None = None) -> list[Event]:
        """A piece of reasoning (kind ReasoningOutput, no logprobs) or answer text (OutputMessage)."""
        prefix, part, event = TEXT_ITEMS[kind]
        events = []
        if not isinstance(self.item, kind):
            events += self._open(kind(id=new_id(prefix)))
            events += self._part_added(part())
        content = self.item.content[0]
        content.text += text
        extra = {}
        if logprobs is not None:
            content.logprobs += [TokenLogprob.model_validate(logprob) for logprob in logprobs]
            extra["logprobs"] = logprobs
        return events + [self._event(f"{event}.delta", **self._where(), content_index=0, delta=text, **extra)]

    def _tool_call(self, delta: engine_pb2.ToolCallDelta) -> list[Event]:
        events = []
        if delta.index not in self.call_items:
            item = FunctionCallOutput(id=new_id("fc"), call_id=delta.id or new_id("call"), name=delta.name)
            self.call_items[delta.index] = item
            events += self._open(item)
        if self.call_items[delta.index] is not self.item:
            return events  # a piece of a call already closed: the engine sends calls in order
        self.item.arguments += delta.arguments
        if delta.arguments:
            events.append(self._event("response.function_call_arguments.delta", **self._where(),
                                      delta=delta.arguments))
        return events

    def _open(self, item) -> list[Event]:
        events = self._close("completed")
        self.item = item
        self.response.output.append(item)
        return events + [self._event("response.output_item.added", output_index=len(self.response.output) - 1,
                                     item=item.model_dump(mode="json"))]

    def _part_added(self, part) -> list[Event]:
        self.item.content.append(part)
        return [self._event("response.content_part.added", **self._where(), content_index=0,
                            part=part.model_dump(mode="json"))]

    def _close(self, status: str) -> list[Event]:
        item, self.item = self.item, None
        if item is None:
            return []
        where = self._where(item)
        item.status = status
        events = []
        if isinstance(item, FunctionCallOutput):
            events.append(self._event("response.function_call_arguments.done", **where, name=item.name,
                                      arguments=item.arguments))
        else:
            _, _, event = TEXT_ITEMS[type(item)]
            part = item.content[0].model_dump(mode="json")
            extra = {"logprobs": part["logprobs"]} if isinstance(item, OutputMessage) else {}
            events.append(self._event(f"{event}.done", **where, content_index=0, text=part["text"], **extra))
            events.append(self._event("response.content_part.done", **where, content_index=0, part=part))
        return events + [self._event("response.output_item.done", output_index=where["output_index"],
                                     item=item.model_dump(mode="json"))]

    def _where(self, item=None) -> dict:
        item = item or self.item
        return {"item_id": item.id, "output_index": self.response.output.index(item)}

    def _usage(self) -> ResponseUsage:
        usage = self.usage
        return ResponseUsage(input_tokens=usage.prompt_tokens,
                             input_tokens_details=InputTokensDetails(cached_tokens=usage.cached_tokens),
                             output_tokens=usage.completion_tokens,
                             output_tokens_details=OutputTokensDetails(
                                 reasoning_tokens=usage.reasoning_tokens),
                             total_tokens=usage.prompt_tokens + usage.completion_tokens)

    def _event(self, type: str, **fields) -> Event:
        event = {"type": type, "sequence_number": self.sequence, **fields}
        self.sequence += 1
        return event
