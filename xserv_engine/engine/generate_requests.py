"""GenerateRequests: a Generate call's prompt and sampling params checked, rendered and tokenized
into the Request the engine thread adds (its n sequences, their output streams and grammars).

Any thread may call it: it reads only what never changes after the engine starts, and the LoRA
registry. A request's max_tokens is checked against the context here, where the prompt's length
is first known.
"""

from dataclasses import replace

from xserv_engine.engine.lora_registry import LoraRegistry
from xserv_engine.engine.output_stream import OutputStream
from xserv_engine.engine.request import OnOutput, Request
from xserv_engine.engine.runner_kind import RunnerKind
from xserv_engine.engine.sequence import Sequence
from xserv_engine.errors import ContextTooLong, InvalidRequest
from xserv_engine.inputs import ChatInput, PromptInput, TokenImages, check_images, check_prompt
from xserv_engine.multimodal.prompt_images import ImagePrompts
from xserv_engine.sampling_params import SamplingParams
from xserv_engine.structured.manager import StructuredOutputManager
from xserv_engine.tokenizer.parsers import prompt_opens_reasoning
from xserv_engine.tokenizer.tokenizer import Tokenizer
from xserv_engine.tokenizer.tool_call_parsers import call_parser


def fitted_max_tokens(params: SamplingParams, prompt_tokens: int, max_model_len: int,
                      default_max_tokens: int | None) -> SamplingParams:
    """params with max_tokens set: as asked if it fits after the prompt (else ContextTooLong), or,
    unset, the default (the model's generation_config or --default-max-tokens) cut to the room left."""
    room = max_model_len - prompt_tokens
    if params.max_tokens is None:
        if room < 1:
            raise ContextTooLong(prompt_tokens, 1, max_model_len)
        return replace(params, max_tokens=min(room, default_max_tokens or room))
    if params.max_tokens > room:
        raise ContextTooLong(prompt_tokens, params.max_tokens, max_model_len)
    return params


class GenerateRequests:
    def __init__(self, kind: RunnerKind, model_id: str, tokenizer: Tokenizer, vocab_size: int, max_model_len: int,
                 default_max_tokens: int | None, by_priority: bool, block_size: int,
                 structured: StructuredOutputManager, tool_call_parser: str, loras: LoraRegistry,
                 accepts_images: bool, image_limit: int, image_prompts: ImagePrompts | None = None):
        """image_prompts: a vision-language model's (expands each image's placeholder)."""
        self.kind, self.model_id, self.tokenizer = kind, model_id, tokenizer
        self.accepts_images, self.image_limit, self.image_prompts = accepts_images, image_limit, image_prompts
        self.vocab_size, self.max_model_len, self.default_max_tokens = vocab_size, max_model_len, default_max_tokens
        self.by_priority, self.block_size = by_priority, block_size
        self.structured, self.tool_call_parser, self.loras = structured, tool_call_parser, loras

    def make(self, request_id: str, prompt: PromptInput, params: SamplingParams, on_output: OnOutput,
             lora_name: str | None = None) -> Request:
        """Validate, render and tokenize (InvalidRequest, ContextTooLong; NotFound for a lora_name
        not loaded). Slow for a long chat: callers run it off their event loop."""
        self.kind.check_serves(RunnerKind.GENERATE, self.model_id)
        params.validate(self.vocab_size)
        if params.priority and not self.by_priority:
            raise InvalidRequest("priority", f"got priority {params.priority}, but this engine schedules first come, "
                                             "first served: start it with --scheduling-policy priority")
        lora = self.loras.get_adapter(lora_name) if lora_name else None
        prompt_ids, _ = self.tokenize(prompt)
        images = None
        if self.image_prompts is not None:  # InvalidRequest for bytes that are not an image
            prompt_ids, images = self.image_prompts.expand(prompt, prompt_ids)
        params = fitted_max_tokens(params, len(prompt_ids), self.max_model_len, self.default_max_tokens)
        # InvalidRequest if it cannot compile
        grammar = self.structured.request_grammar(prompt, params, self.tokenizer.chat_tokens, self.tool_call_parser)
        request = self._build(request_id, prompt, prompt_ids, params, on_output, grammar, lora)
        for seq in request.seqs:
            seq.images = images
        return request

    def tokenize(self, prompt: PromptInput) -> tuple[list[int], str]:
        """(token ids, the text they encode: the rendered chat, or "" for token ids)."""
        check_prompt(prompt, self.vocab_size)
        check_images(prompt, self.model_id, self.accepts_images, self.image_limit)
        if isinstance(prompt, ChatInput):
            text = self.tokenizer.render_chat(prompt)
            return self.tokenizer.encode(text), text
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt), prompt
        if isinstance(prompt, TokenImages):
            return list(prompt.token_ids), ""
        return list(prompt), ""

    def _build(self, request_id, prompt, prompt_ids, params, on_output, grammar, lora) -> Request:
        is_chat = isinstance(prompt, ChatInput)
        parse_tools = is_chat and bool(prompt.tools) and prompt.tool_choice != "none"
        parse_call = call_parser(self.tool_call_parser, prompt.tools) if parse_tools else None
        tokens = self.tokenizer.chat_tokens
        opens_reasoning = is_chat and prompt_opens_reasoning(prompt_ids, tokens)
        seqs = [Sequence(prompt_ids, params, self.block_size, index=i, lora=lora) for i in range(params.n)]
        if grammar is not None:
            for seq in seqs:
                seq.guide = self.structured.guide(grammar, prompt_ids, is_chat, tokens)
        streams = {
            seq.seq_id: OutputStream(self.tokenizer, params, starts_in_reasoning=opens_reasoning,
                                     parse_reasoning=is_chat, parse_tools=parse_tools, parse_call=parse_call)
            for seq in seqs
        }
        return Request(request_id, on_output, seqs, streams)
