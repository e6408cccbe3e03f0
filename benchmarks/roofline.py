"""The LM-head roofline: the decode speed if a step cost only its [batch, H] x [H, V] matmul.

Used by engine_throughput.py and compare.py (run as scripts, so `from roofline import ...`).
"""

import time

import torch

DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


def lm_head_roofline(model: str, dtype: str, batch: int, rounds: int = 5, repeats: int = 10) -> float:
    """Tokens/s of the LM-head matmul alone: the faster of F.linear and the oneDNN-packed linear
    the engine uses on the CPU; the best of several rounds, so neither the kernel choice nor
    machine noise can flatter a ratio to it."""
    return LMHead(model, dtype, batch).tok_s(rounds, repeats)


class LMHead:
    """The model's LM-head matmul at one batch size, built once and timed as often as asked (a
    benchmark can sample it between its own rounds, on a machine whose speed drifts)."""

    def __init__(self, model: str, dtype: str, batch: int):
        from xserv_engine.layers.linear import pack_cpu_linears
        from xserv_engine.models.loader import read_model_dir

        cfg = read_model_dir(model).config
        self.batch = batch
        self.x = torch.randn(batch, cfg.hidden_size, dtype=DTYPES[dtype])
        plain = torch.nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False, dtype=DTYPES[dtype])
        packed = torch.nn.Sequential(torch.nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False, dtype=DTYPES[dtype]))
        pack_cpu_linears(packed, DTYPES[dtype])
        self.heads = {"F.linear": plain, "oneDNN packed": packed}

    def tok_s(self, rounds: int = 5, repeats: int = 10) -> float:
        """batch / the best time of any head over `rounds` rounds of `repeats` calls."""
        return max(self.tok_s_by_head(rounds, repeats).values())

    def tok_s_by_head(self, rounds: int = 5, repeats: int = 10) -> dict[str, float]:
        """batch / each head's best time over `rounds` rounds of `repeats` calls."""
        out = {}
        with torch.inference_mode():
            for name, head in self.heads.items():
                head(self.x)
                best = float("inf")
                for _ in range(rounds):
                    start = time.perf_counter()
                    for _ in range(repeats):
                        head(self.x)
                    best = min(best, (time.perf_counter() - start) / repeats)
                out[name] = self.batch / best
        return out
