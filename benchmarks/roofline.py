"""The LM-head roofline: the decode speed if a step cost only its [batch, H] x [H, V] matmul.

Used by engine_throughput.py and compare.py (run as scripts, so `from roofline import ...`).
"""

import time

import torch

DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


def lm_head_roofline(model: str, dtype: str, batch: int, rounds: int = 5, repeats: int = 10) -> float:
    """Tokens/s of the LM-head matmul alone: the faster of F.linear and the oneDNN-packed linear
    the engine uses on the CPU, the best of several rounds, so neither the kernel choice nor
    machine noise can flatter a ratio to it."""
    from xserv_engine.layers.linear import pack_cpu_linears
    from xserv_engine.models.loader import read_model_dir

    cfg = read_model_dir(model).config
    x = torch.randn(batch, cfg.hidden_size, dtype=DTYPES[dtype])
    plain = torch.nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False, dtype=DTYPES[dtype])
    packed = torch.nn.Sequential(torch.nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False, dtype=DTYPES[dtype]))
    pack_cpu_linears(packed, DTYPES[dtype])
    best = float("inf")
    with torch.inference_mode():
        for head in (plain, packed):
            head(x)
            for _ in range(rounds):
                start = time.perf_counter()
                for _ in range(repeats):
                    head(x)
                best = min(best, (time.perf_counter() - start) / repeats)
    return batch / best
