"""Protobuf <-> engine types. The only module that knows both sides (from_pb / to_pb)."""

import json
from collections.abc import Mapping
from dataclasses import replace
from typing import Any

from xserv.v1 import engine_pb2

from xserv_engine.errors import InvalidRequest
from xserv_engine.inputs import ChatInput, PromptInput
from xserv_engine.models.pooling import MAX_EMBED_INPUTS, EmbedParams
from xserv_engine.outputs import EngineStats, LoraInfo, ModelInfo, RequestOutput, TokenLogprob
from xserv_engine.sampling_params import SamplingParams
from xserv_engine.structured.constraint import CHOICE, JSON_OBJECT, Constraint

FINISH_REASONS = {
    "stop": engine_pb2.FINISH_REASON_STOP,
    "length": engine_pb2.FINISH_REASON_LENGTH,
    "tool_calls": engine_pb2.FINISH_REASON_TOOL_CALLS,
    "abort": engine_pb2.FINISH_REASON_ABORT,
}

# proto3 `optional` fields: unset means "the model's default or SamplingParams'", not zero.
_OPTIONAL_PARAMS = ("max_tokens", "temperature", "top_p", "top_k", "min_p", "seed", "repetition_penalty", "n",
                    "skip_special_tokens", "prompt_logprobs")
_PLAIN_PARAMS = ("min_tokens", "include_stop_str_in_output", "ignore_eos", "presence_penalty", "frequency_penalty",
                 "logprobs", "top_logprobs")


def generate_request_from_pb(request: engine_pb2.GenerateRequest, defaults: Mapping[str, float] | None = None,
                             ) -> tuple[str, PromptInput, SamplingParams]:
    """GenerateRequest -> (request_id, prompt, params); request_id may be empty. `defaults` (the
    engine's sampling_defaults) fill the sampling fields the request leaves unset. The values are
    checked by the engine (SamplingParams.validate, check_prompt), not here."""
    params = replace(sampling_params_from_pb(request.params, defaults), priority=request.priority)
    return request.request_id, _prompt_from_pb(request), params


def tokenize_input_from_pb(request: engine_pb2.TokenizeRequest) -> str | ChatInput:
    kind = request.WhichOneof("input")
    if kind == "chat":
        return chat_from_pb(request.chat)
    if kind == "text":
        return request.text
    raise InvalidRequest("input", "set one of text or chat")


def _prompt_from_pb(request: engine_pb2.GenerateRequest) -> PromptInput:
    kind = request.WhichOneof("input")
    if kind == "text":
        return request.text
    if kind == "token_ids":
        return list(request.token_ids.ids)
    if kind == "chat":
        return chat_from_pb(request.chat)
    raise InvalidRequest("input", "set one of text, token_ids or chat")


def sampling_params_from_pb(params: engine_pb2.SamplingParams, defaults: Mapping[str, float] | None = None,
                            ) -> SamplingParams:
    values: dict[str, Any] = {name: getattr(params, name) for name in _PLAIN_PARAMS}
    values.update(defaults or {})
    values.update({name: getattr(params, name) for name in _OPTIONAL_PARAMS if params.HasField(name)})
    values["stop"] = tuple(params.stop)
    values["stop_token_ids"] = tuple(params.stop_token_ids)
    values["logit_bias"] = dict(params.logit_bias)
    values["constraint"] = _constraint_from_pb(params)
    return SamplingParams(**values)


def _constraint_from_pb(params: engine_pb2.SamplingParams) -> Constraint | None:
    kind = params.WhichOneof("constraint")
    if kind is None:
        return None
    if kind == CHOICE:
        spec = tuple(params.choice.choices)
    elif kind == JSON_OBJECT:
        spec = ""
    else:
        spec = getattr(params, kind)
    return Constraint(kind, spec, whitespace_flexible=params.whitespace_flexible)


def chat_from_pb(chat: engine_pb2.ChatInput) -> ChatInput:
    messages = [_message_from_pb(i, message) for i, message in enumerate(chat.messages)]
    return ChatInput(
        messages=messages,
        tools=[_tool_from_json(i, text) for i, text in enumerate(chat.tools)] or None,
        add_generation_prompt=chat.add_generation_prompt if chat.HasField("add_generation_prompt") else True,
        tool_choice=chat.tool_choice or "auto",
        parallel_tool_calls=chat.parallel_tool_calls if chat.HasField("parallel_tool_calls") else True,
        template_kwargs=_template_kwargs_from_pb(chat),
    )


def _message_from_pb(position: int, message: engine_pb2.ChatMessage) -> dict[str, Any]:
    if not message.role:
        raise InvalidRequest(f"chat.messages[{position}].role", "the role is empty")
    result: dict[str, Any] = {"role": message.role, "content": _content_from_pb(position, message)}
    if message.HasField("reasoning_content"):
        result["reasoning_content"] = message.reasoning_content
    if message.tool_calls:
        result["tool_calls"] = [_tool_call_from_pb(call) for call in message.tool_calls]
    if message.tool_call_id:
        result["tool_call_id"] = message.tool_call_id
    if message.name:
        result["name"] = message.name
    return result


def _content_from_pb(position: int, message: engine_pb2.ChatMessage) -> str | list[dict[str, Any]]:
    """The content string, or with images the parts in order (ChatInput's form); text-only parts
    are joined with newlines as OpenAI's text parts are, so text-only templates render them."""
    if not message.parts:
        return message.content
    if message.content:
        raise InvalidRequest(f"chat.messages[{position}].content", "set content or parts, not both")
    parts = [_part_from_pb(position, j, part) for j, part in enumerate(message.parts)]
    if all(part["type"] == "text" for part in parts):
        return "\n".join(part["text"] for part in parts)
    return parts


def _part_from_pb(position: int, index: int, part: engine_pb2.ContentPart) -> dict[str, Any]:
    kind = part.WhichOneof("part")
    if kind == "text":
        return {"type": "text", "text": part.text}
    if kind == "image" and part.image.data:
        return {"type": "image", "image": part.image.data}
    what = "image.data is empty" if kind == "image" else "set one of text or image"
    raise InvalidRequest(f"chat.messages[{position}].parts[{index}]", what)


def _tool_call_from_pb(call: engine_pb2.ToolCall) -> dict[str, Any]:
    return {
        "id": call.id,
        "type": call.type or "function",
        "function": {"name": call.name, "arguments": _arguments(call.arguments)},
    }


def _arguments(text: str) -> dict[str, Any] | str:
    """Qwen3's template takes a mapping (re-serialized with tojson) or the text as it is."""
    try:
        parsed = json.loads(text)
    except ValueError:
        return text
    return parsed if isinstance(parsed, dict) else text


def _tool_from_json(position: int, text: str) -> dict[str, Any]:
    try:
        tool = json.loads(text)
    except ValueError as exc:
        raise InvalidRequest("chat.tools", f"tool {position} is not valid JSON: {exc}") from None
    if not isinstance(tool, dict):
        raise InvalidRequest("chat.tools", f"tool {position} must be a JSON object")
    return tool


def _template_kwargs_from_pb(chat: engine_pb2.ChatInput) -> dict[str, Any]:
    kwargs: dict[str, Any] = {}
    if chat.template_kwargs_json:
        try:
            kwargs = json.loads(chat.template_kwargs_json)
        except ValueError as exc:
            raise InvalidRequest("chat.template_kwargs_json", f"not valid JSON: {exc}") from None
        if not isinstance(kwargs, dict):
            raise InvalidRequest("chat.template_kwargs_json", "must be a JSON object")
    if chat.HasField("enable_thinking"):
        kwargs["enable_thinking"] = chat.enable_thinking
    return kwargs


def generate_response_to_pb(output: RequestOutput) -> engine_pb2.GenerateResponse:
    response = engine_pb2.GenerateResponse(
        request_id=output.request_id,
        index=output.index,
        token_ids=output.token_ids,
        text=output.text,
        reasoning_text=output.reasoning_text,
        tool_calls=[
            engine_pb2.ToolCallDelta(index=d.index, id=d.id, name=d.name, arguments=d.arguments)
            for d in output.tool_calls
        ],
        logprobs=[_logprob_to_pb(lp) for lp in output.logprobs],
        prompt_logprobs=[_logprob_to_pb(lp) for lp in output.prompt_logprobs],
        prompt_tokens=output.prompt_tokens,
    )
    if output.finish_reason is not None:
        response.finish_reason = FINISH_REASONS[output.finish_reason]
    if isinstance(output.matched_stop, str):
        response.matched_stop_str = output.matched_stop
    elif isinstance(output.matched_stop, int):
        response.matched_stop_token_id = output.matched_stop
    if output.usage is not None:
        response.usage.prompt_tokens = output.usage.prompt_tokens
        response.usage.completion_tokens = output.usage.completion_tokens
        response.usage.cached_prompt_tokens = output.usage.cached_prompt_tokens
        response.usage.reasoning_tokens = output.usage.reasoning_tokens
    return response


def _logprob_to_pb(logprob: TokenLogprob) -> engine_pb2.TokenLogprob:
    return engine_pb2.TokenLogprob(
        token_id=logprob.token_id,
        token=logprob.token,
        token_bytes=logprob.token_bytes,
        logprob=logprob.logprob,
        top_logprobs=[
            engine_pb2.TopLogprob(token_id=t.token_id, token=t.token, token_bytes=t.token_bytes, logprob=t.logprob)
            for t in logprob.top
        ],
    )


def tokenizer_info_to_pb(tokenizer) -> engine_pb2.GetTokenizerInfoResponse:
    special = tokenizer.special_tokens
    return engine_pb2.GetTokenizerInfoResponse(
        eos_token=special.get("eos_token"), bos_token=special.get("bos_token"), pad_token=special.get("pad_token"),
        chat_template=tokenizer.chat_template or "", vocab_size=tokenizer.vocab_size)


def model_info_to_pb(info: ModelInfo, stats: EngineStats) -> engine_pb2.GetModelInfoResponse:
    return engine_pb2.GetModelInfoResponse(
        model_id=info.model_id,
        max_model_len=info.max_model_len,
        vocab_size=info.vocab_size,
        eos_token_ids=info.eos_token_ids,
        dtype=info.dtype,
        device=info.device,
        block_size=info.block_size,
        kv_blocks_total=stats.total_blocks,
        kv_blocks_free=stats.free_blocks,
        num_running=stats.running,
        num_waiting=stats.waiting,
        runner=info.runner,
        embedding_size=info.embedding_size,
        lora_adapters=[lora_adapter_to_pb(adapter) for adapter in info.lora_adapters],
        lora_enabled=info.lora_enabled,
        max_lora_rank=info.max_lora_rank,
        tool_call_parser=info.tool_call_parser,
        decode_route=info.decode_route,
        quantization=info.quantization,
        speculative_config=info.speculative_config,
        state_slots_total=stats.total_state_slots,
        state_slots_free=stats.free_state_slots,
        state_slot_bytes=info.state_slot_bytes,
        random_weights=info.random_weights,
        max_images_per_prompt=info.max_images_per_prompt,
    )


def lora_adapter_to_pb(adapter: LoraInfo) -> engine_pb2.LoraAdapter:
    """A loaded adapter (LoraInfo, or the engine's LoraAdapter: the same name, path and rank)."""
    return engine_pb2.LoraAdapter(name=adapter.name, path=adapter.path, rank=adapter.rank)


def embed_inputs_from_pb(request: engine_pb2.EmbedRequest) -> list[str | list[int]]:
    """The inputs, each present and non-empty (InvalidRequest naming inputs[i]); token ranges and
    lengths are the engine's to check."""
    if not request.inputs:
        raise InvalidRequest("inputs", "give at least one input")
    if len(request.inputs) > MAX_EMBED_INPUTS:
        raise InvalidRequest("inputs", f"at most {MAX_EMBED_INPUTS} inputs per call, got {len(request.inputs)}")
    inputs: list[str | list[int]] = []
    for i, one in enumerate(request.inputs):
        kind = one.WhichOneof("input")
        if kind is None:
            raise InvalidRequest(f"inputs[{i}]", "set one of text or token_ids")
        value = one.text if kind == "text" else list(one.token_ids.ids)
        if not value:
            raise InvalidRequest(f"inputs[{i}].{kind}", "must not be empty")
        inputs.append(value)
    return inputs


def embed_params_from_pb(request: engine_pb2.EmbedRequest) -> EmbedParams:
    return EmbedParams(
        dimensions=request.dimensions if request.HasField("dimensions") else None,
        truncate_prompt_tokens=request.truncate_prompt_tokens if request.HasField("truncate_prompt_tokens") else None,
    )


def score_request_from_pb(request: engine_pb2.ScoreRequest) -> tuple[str, list[str], str | None]:
    """(query, documents, instruction or None), each present (InvalidRequest naming the field)."""
    if not request.query:
        raise InvalidRequest("query", "must not be empty")
    if not request.documents:
        raise InvalidRequest("documents", "give at least one document")
    if len(request.documents) > MAX_EMBED_INPUTS:
        raise InvalidRequest("documents", f"at most {MAX_EMBED_INPUTS} documents per call, got {len(request.documents)}")
    for i, document in enumerate(request.documents):
        if not document:
            raise InvalidRequest(f"documents[{i}]", "must not be empty")
    instruction = request.instruction if request.HasField("instruction") else None
    if instruction == "":
        raise InvalidRequest("instruction", "must not be empty (leave it unset for the reranker's default)")
    return request.query, list(request.documents), instruction


def score_to_pb(output: RequestOutput) -> engine_pb2.DocumentScore:
    return engine_pb2.DocumentScore(score=output.embedding[0], prompt_tokens=output.usage.prompt_tokens)


def embedding_to_pb(output: RequestOutput) -> engine_pb2.Embedding:
    return engine_pb2.Embedding(values=output.embedding, prompt_tokens=output.usage.prompt_tokens,
                                cached_prompt_tokens=output.usage.cached_prompt_tokens)
