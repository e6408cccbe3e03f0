"""Embedding throughput: xserv's pooling runner vs transformers' Qwen3Model the way
sentence-transformers runs it (inputs sorted by length, left-padded batches, the last token's hidden
state, normalized), same inputs, same dtype, same run.

    .venv/bin/python benchmarks/embeddings.py [--model DIR] [--dtype bfloat16] [--inputs 256] [--rounds 3]

Inputs are random token ids with lengths drawn from 16..--max-len (documents of mixed size, the
usual embedding workload); both sides get the same ids. Prints input tokens/s of each side, their
ratio, and the smallest cosine similarity between the two sides' vectors (a check that both embed
the same thing: ~1.0 in fp32, >0.99 in bf16). Any Qwen3 checkpoint will do (the demo model by
default): the engine runs it with --runner pooling, transformers loads its body with AutoModel.
"""

import argparse
import random
import statistics
import threading
import time

import torch
import torch.nn.functional as F

from xserv_engine.config import EngineConfig
from xserv_engine.demo import default_model_dir
from xserv_engine.engine.engine_thread import EngineThread
from xserv_engine.engine.llm_engine import LLMEngine
from xserv_engine.models.pooling import EmbedParams

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def make_inputs(n: int, max_len: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(0, 151643) for _ in range(rng.randint(16, max_len))] for _ in range(n)]


def run_xserv(engine: EngineThread, inputs: list[list[int]], tag: str) -> tuple[float, list[torch.Tensor]]:
    vectors: list = [None] * len(inputs)
    done = threading.Semaphore(0)

    def collect(i):
        def on_output(out):
            vectors[i] = torch.tensor(out.embedding)
            done.release()
        return on_output

    start = time.perf_counter()
    for i, ids in enumerate(inputs):
        engine.add_embed_request(f"{tag}-{i}", ids, EmbedParams(), collect(i))
    for _ in inputs:
        done.acquire()
    return time.perf_counter() - start, vectors


def run_transformers(model, inputs: list[list[int]], batch: int) -> tuple[float, list[torch.Tensor]]:
    """On a thread of its own (CPU torch keeps an OpenMP team per thread that has run an op; the
    engine's thread runs slower while another team exists: see engine_throughput.py)."""
    result = {}

    def work():
        order = sorted(range(len(inputs)), key=lambda i: -len(inputs[i]))
        vectors: list = [None] * len(inputs)
        start = time.perf_counter()
        with torch.inference_mode():
            for b in range(0, len(order), batch):
                rows = order[b : b + batch]
                width = max(len(inputs[i]) for i in rows)
                ids = torch.tensor([[0] * (width - len(inputs[i])) + inputs[i] for i in rows])
                mask = torch.tensor([[0] * (width - len(inputs[i])) + [1] * len(inputs[i]) for i in rows])
                hidden = model(input_ids=ids, attention_mask=mask).last_hidden_state[:, -1]  # left padding
                for i, row in zip(rows, F.normalize(hidden.float(), dim=-1)):
                    vectors[i] = row
        result["out"] = time.perf_counter() - start, vectors

    thread = threading.Thread(target=work)
    thread.start()
    thread.join()
    return result["out"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="a Qwen3 checkpoint directory (default: the demo model)")
    parser.add_argument("--dtype", default="bfloat16" if torch.backends.mkldnn.is_available() else "float32",
                        choices=sorted(DTYPES))
    parser.add_argument("--inputs", type=int, default=256)
    parser.add_argument("--max-len", type=int, default=512)
    parser.add_argument("--batch", type=int, default=32, help="transformers' batch size (sentence-transformers' default)")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    model_dir = args.model or default_model_dir()
    torch.set_num_threads(torch.get_num_threads())

    from transformers import AutoModel

    engine = EngineThread(LLMEngine(EngineConfig(model=model_dir, dtype=args.dtype, runner="pooling"), progress=False))
    engine.start()
    engine.warmup()
    hf = AutoModel.from_pretrained(model_dir, dtype=DTYPES[args.dtype]).eval()
    print(f"model {model_dir}, {args.dtype}, {args.inputs} inputs of 16..{args.max_len} tokens, "
          f"torch threads {torch.get_num_threads()}", flush=True)
    ratios, ours, theirs = [], [], []
    for r in range(args.rounds):
        inputs = make_inputs(args.inputs, args.max_len, seed=r)  # fresh ids each round: no prefix-cache hits
        tokens = sum(map(len, inputs))
        xs_s, xs_vectors = run_xserv(engine, inputs, f"r{r}")
        hf_s, hf_vectors = run_transformers(hf, inputs, args.batch)
        cosine = min(F.cosine_similarity(a, b, dim=0).item() for a, b in zip(xs_vectors, hf_vectors))
        ours.append(tokens / xs_s)
        theirs.append(tokens / hf_s)
        ratios.append(ours[-1] / theirs[-1])
        print(f"round {r}: {tokens} tokens; xserv {ours[-1]:.0f} tok/s ({xs_s:.2f} s), transformers "
              f"{theirs[-1]:.0f} tok/s ({hf_s:.2f} s), ratio {ratios[-1]:.2f}, min cosine {cosine:.5f}", flush=True)
    engine.shutdown()
    print(f"median: xserv {statistics.median(ours):.0f} tok/s, transformers {statistics.median(theirs):.0f} tok/s, "
          f"xserv / transformers {statistics.median(ratios):.2f}")


if __name__ == "__main__":
    main()
