"""OpenAI request bodies -> one xserv.v1.GenerateRequest (plus what rendering the answer needs)."""

import json
from dataclasses import dataclass

from xserv.v1 import engine_pb2
from xserv_rest.errors import invalid_request
from xserv_rest.fields import Fields

ROLE_ALIASES = {"developer": "system"}
ROLES = ("system", "developer", "user", "assistant", "tool")
MAX_STOP = 16  # stop strings per request, as the engine allows


@dataclass(frozen=True)
class GenerationRequest:
    stream: bool
    include_usage: bool
    n: int
    logprobs: bool  # return logprobs in the answer
    grpc_request: engine_pb2.GenerateRequest


def parse_chat(body: Fields, request_id: str) -> GenerationRequest:
    """POST /v1/chat/completions."""
    logprobs = bool(body.boolean("logprobs", False))
    top_logprobs = body.integer("top_logprobs", 0)
    if body.has("top_logprobs") and not logprobs:
        raise invalid_request("'top_logprobs' needs 'logprobs': true", param="top_logprobs")
    params = _sampling_params(body, logprobs, top_logprobs, "top_logprobs")
    request = engine_pb2.GenerateRequest(request_id=request_id, chat=_chat_input(body), params=params)
    return _generation_request(body, params, request)


def parse_completion(body: Fields, request_id: str) -> GenerationRequest:
    """POST /v1/completions: logprobs is the number of alternatives per token (0 for none)."""
    if body.boolean("echo", False):
        raise invalid_request("'echo' is not supported", param="echo")
    if body.has("suffix"):
        raise invalid_request("'suffix' is not supported", param="suffix")
    logprobs = body.integer("logprobs")
    params = _sampling_params(body, logprobs is not None, logprobs or 0, "logprobs")
    request = engine_pb2.GenerateRequest(request_id=request_id, params=params)
    prompt = _prompt(body)
    if isinstance(prompt, str):
        request.text = prompt
    else:
        request.token_ids.ids.extend(prompt)
    return _generation_request(body, params, request)


def _generation_request(body: Fields, params: engine_pb2.SamplingParams,
                        request: engine_pb2.GenerateRequest) -> GenerationRequest:
    body.string("user")  # unused, but its type is checked as documented
    stream = bool(body.boolean("stream", False))
    options = body.object("stream_options")
    if options is not None and not stream:
        raise invalid_request("'stream_options' is only allowed with 'stream': true", param="stream_options")
    include_usage = bool(options and options.boolean("include_usage", False))
    n = params.n if params.HasField("n") else 1
    return GenerationRequest(stream=stream, include_usage=include_usage, n=n, logprobs=params.logprobs,
                             grpc_request=request)


def _sampling_params(body: Fields, logprobs: bool, top_logprobs: int, top_param: str) -> engine_pb2.SamplingParams:
    params = engine_pb2.SamplingParams(logprobs=logprobs)
    values = {
        "max_tokens": body.integer("max_completion_tokens", body.integer("max_tokens")),
        "temperature": body.number("temperature"), "top_p": body.number("top_p"),
        "seed": body.integer("seed"), "n": body.integer("n"),
        "repetition_penalty": body.number("repetition_penalty"),
        "skip_special_tokens": body.boolean("skip_special_tokens"),
        "top_logprobs": top_logprobs, "min_tokens": body.integer("min_tokens"),
        "top_k": body.integer("top_k"), "min_p": body.number("min_p"),
        "presence_penalty": body.number("presence_penalty"),
        "frequency_penalty": body.number("frequency_penalty"),
        "ignore_eos": body.boolean("ignore_eos"),
        "include_stop_str_in_output": body.boolean("include_stop_str_in_output"),
    }
    for name, value in values.items():
        if value is not None:
            _set(params, name, value, top_param if name == "top_logprobs" else name)
    params.stop.extend(_stop(body))
    params.stop_token_ids.extend(_token_ids(body.array("stop_token_ids", []), "stop_token_ids"))
    for token_id, bias in _logit_bias(body).items():
        params.logit_bias[token_id] = bias
    return params


def _set(params: engine_pb2.SamplingParams, name: str, value, param: str) -> None:
    """Out-of-range values (negative counts, ids past 32 bits) are the caller's error."""
    try:
        setattr(params, name, value)
    except (ValueError, TypeError):
        raise invalid_request(f"'{param}' is out of range: {value}", param=param) from None


def _stop(body: Fields) -> list[str]:
    stop = body.raw("stop", [])
    stop = [stop] if isinstance(stop, str) else stop
    if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
        raise invalid_request("'stop' must be a string or an array of strings", param="stop")
    if len(stop) > MAX_STOP:
        raise invalid_request(f"'stop' holds at most {MAX_STOP} strings, got {len(stop)}", param="stop")
    return stop


def _logit_bias(body: Fields) -> dict[int, float]:
    bias = body.object("logit_bias")
    if bias is None:
        return {}
    result = {}
    for key in bias.data:
        if not (key.isascii() and key.isdigit() and len(key) <= 9):
            raise invalid_request(f"'logit_bias' keys must be token ids, got {key!r}", param="logit_bias")
        value = bias.number(key)
        if value is None:
            raise invalid_request("'logit_bias' values must be numbers", param="logit_bias")
        result[int(key)] = value
    return result


def _token_ids(values: list, param: str) -> list[int]:
    """JSON does not tell 7 from 7.0: integral numbers are token ids, as JSON Schema's integer."""
    if not all(_is_token_id(v) for v in values):
        raise invalid_request(f"'{param}' must be an array of token ids (non-negative integers)", param=param)
    return [int(v) for v in values]


def _is_token_id(value) -> bool:
    return (isinstance(value, (int, float)) and not isinstance(value, bool) and float(value).is_integer()
            and 0 <= value < 2**32)


def _prompt(body: Fields) -> str | list[int]:
    prompt = body.raw("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]  # a batch of one
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, list) and prompt and all(isinstance(v, (int, float)) for v in prompt):
        return _token_ids(prompt, "prompt")
    if prompt is None:
        raise invalid_request("'prompt' is required", param="prompt")
    raise invalid_request("'prompt' must be a string, an array of token ids, or an array holding one "
                          "of those (one prompt per request)", param="prompt")


def _chat_input(body: Fields) -> engine_pb2.ChatInput:
    messages = body.array("messages")
    if not messages:
        raise invalid_request("'messages' must be a non-empty array", param="messages")
    chat = engine_pb2.ChatInput(messages=[_message(Fields(m, f"messages[{i}]")) for i, m in enumerate(messages)])
    for i, tool in enumerate(body.array("tools", [])):
        chat.tools.append(json.dumps(Fields(tool, f"tools[{i}]").data, ensure_ascii=False))
    chat.tool_choice = _tool_choice(body)
    add_generation_prompt = body.boolean("add_generation_prompt")
    if add_generation_prompt is not None:
        chat.add_generation_prompt = add_generation_prompt
    kwargs = body.object("chat_template_kwargs")
    if kwargs is not None:
        enable_thinking = kwargs.boolean("enable_thinking")
        if enable_thinking is not None:
            chat.enable_thinking = enable_thinking
        rest = {k: v for k, v in kwargs.data.items() if k != "enable_thinking"}
        chat.template_kwargs_json = json.dumps(rest, ensure_ascii=False) if rest else ""
    return chat


def _message(message: Fields) -> engine_pb2.ChatMessage:
    role = message.string("role")
    if not role:
        raise invalid_request(f"'{message.param('role')}' is required", param=message.param("role"))
    if role not in ROLES:
        raise invalid_request(f"'{message.param('role')}' must be one of {', '.join(ROLES)}, got {role!r}",
                              param=message.param("role"))
    result = engine_pb2.ChatMessage(role=ROLE_ALIASES.get(role, role), content=_content(message),
                                    tool_call_id=message.string("tool_call_id", ""),
                                    name=message.string("name", ""))
    reasoning = message.string("reasoning_content", message.string("reasoning"))
    if reasoning is not None:
        result.reasoning_content = reasoning
    for i, call in enumerate(message.array("tool_calls", [])):
        result.tool_calls.append(_tool_call(Fields(call, message.param(f"tool_calls[{i}]"))))
    return result


def _content(message: Fields) -> str:
    content = message.raw("content", "")
    if isinstance(content, str):
        return content
    param = message.param("content")
    if not isinstance(content, list):
        raise invalid_request(f"'{param}' must be a string or an array of text parts", param=param)
    texts = []
    for i, part in enumerate(content):
        part = Fields(part, f"{param}[{i}]")
        if part.string("type") != "text":
            raise invalid_request(f"'{part.param('type')}': only text parts are supported", param=part.param("type"))
        texts.append(part.string("text", ""))
    return "\n".join(texts)


def _tool_call(call: Fields) -> engine_pb2.ToolCall:
    function = call.object("function") or Fields({}, call.param("function"))
    arguments = function.raw("arguments", "")
    if isinstance(arguments, dict):  # lenient, as vLLM: OpenAI sends the arguments as a JSON string
        arguments = json.dumps(arguments, ensure_ascii=False)
    if not isinstance(arguments, str):
        param = function.param("arguments")
        raise invalid_request(f"'{param}' must be a JSON string", param=param)
    return engine_pb2.ToolCall(id=call.string("id", ""), type=call.string("type", "function"),
                               name=function.string("name", ""), arguments=arguments)


def _tool_choice(body: Fields) -> str:
    choice = body.raw("tool_choice", "")
    if isinstance(choice, str):
        return choice
    function = Fields(choice, "tool_choice").object("function")
    name = function.string("name") if function else None
    if not name:
        raise invalid_request("'tool_choice' must be a string or {\"type\": \"function\", "
                              "\"function\": {\"name\": ...}}", param="tool_choice")
    return name
