"""The SSE hot path: one streamed chat token -> one `data: {...}\\n\\n` frame, per encoder.

    python benchmarks/sse_encode.py [--number 200000]

Each candidate builds the chunk of one content delta and serializes it to the frame's bytes; all
must produce the same bytes. Prints ns per chunk (best of 5 timeit repeats) for:
  dict+json.dumps    the encoder before the protocol models (a dict per chunk, json.dumps)
  model+dump_json    the pydantic chunk model, validated, then model_dump_json
  construct+dump     the pydantic chunk model without validation (model_construct), then model_dump_json
  head-cached        what xserv_rest.sse.Frames does: the stream's constant head serialized once,
                     json.dumps of the delta only
"""

import argparse
import json
import timeit

from xserv_rest.sse import Frames
from xserv_rest.protocol.chat import ChatCompletionChunk, ChunkChoice, Delta

HEAD = {"id": "chatcmpl-" + "0123456789abcdef" * 2, "object": "chat.completion.chunk", "created": 1764570000,
        "model": "Qwen/Qwen3-0.6B"}
TEXT = " the"


def dict_json(text: str) -> bytes:
    event = dict(HEAD, choices=[{"index": 0, "delta": {"content": text}, "logprobs": None, "finish_reason": None}])
    return b"data: " + json.dumps(event, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"


def model_dump(text: str) -> bytes:
    chunk = ChatCompletionChunk(**HEAD, choices=[ChunkChoice(index=0, delta=Delta(content=text))])
    return b"data: " + chunk.model_dump_json(exclude={"usage"}).encode() + b"\n\n"


def construct_dump(text: str) -> bytes:
    choice = ChunkChoice.model_construct(index=0, delta=Delta.model_construct(content=text), logprobs=None,
                                         finish_reason=None)
    chunk = ChatCompletionChunk.model_construct(**HEAD, choices=[choice])
    return b"data: " + chunk.model_dump_json(exclude={"usage"}).encode() + b"\n\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--number", type=int, default=200_000, help="chunks per timing")
    args = parser.parse_args()
    frames = Frames(HEAD["id"], HEAD["object"], HEAD["created"], HEAD["model"], include_usage=False)

    def head_cached(text: str) -> bytes:
        return frames.choice(0, {"delta": {"content": text}, "logprobs": None, "finish_reason": None})

    candidates = {"dict+json.dumps": dict_json, "model+dump_json": model_dump, "construct+dump": construct_dump,
                  "head-cached": head_cached}
    expected = dict_json(TEXT)
    for name, encode in candidates.items():
        assert encode(TEXT) == expected, (name, encode(TEXT), expected)
    for name, encode in candidates.items():
        best = min(timeit.repeat(lambda: encode(TEXT), number=args.number, repeat=5))
        print(f"{name:18s} {best / args.number * 1e9:8.0f} ns/chunk")


if __name__ == "__main__":
    main()
