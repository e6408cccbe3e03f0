"""What a CPU engine start costs: seconds to ready and the memory the process then holds.

    .venv/bin/python benchmarks/engine_start.py [--model DIR] [--dtype bfloat16] [--quantization int8]

Starts one engine in this process, as `xserv engine` does (warm-up and decode traces included),
and prints one table row: seconds to ready, the KV cache's size, and from /proc/self/status the
process's own memory (RssAnon: weights, KV cache, retained temporaries), the checkpoint pages it
maps (RssFile: the token embedding, read in place) and its peak (VmHWM). Memory is the process's,
so run each setting in a fresh process. Linux only. The demo model by default.
"""

import argparse
import time
from pathlib import Path

from xserv_engine.config import EngineConfig
from xserv_engine.demo import default_model_dir
from xserv_engine.engine.llm_engine import LLMEngine

FIELDS = ("RssAnon", "RssFile", "VmHWM")


def process_memory_mib() -> dict[str, int]:
    """FIELDS of /proc/self/status, in MiB."""
    lines = Path("/proc/self/status").read_text().splitlines()
    return {key: int(line.split()[1]) // 1024 for line in lines for key in FIELDS if line.startswith(key + ":")}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", help="a Hugging Face model directory (default: the demo model)")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--quantization", choices=["int8", "int4"])
    args = parser.parse_args()
    model = args.model or str(default_model_dir())
    start = time.perf_counter()
    engine = LLMEngine(EngineConfig(model=model, dtype=args.dtype, quantization=args.quantization), progress=False)
    ready_s = time.perf_counter() - start
    memory = process_memory_mib()
    setup = engine.setup
    kv_mib = setup.num_blocks * engine.runner.kv_block_bytes() // 2**20
    print("| model | dtype | quantization | ready (s) | KV cache (MiB) | RssAnon (MiB) | RssFile (MiB) | peak (MiB) |")
    print("|---|---|---|---|---|---|---|---|")
    print(f"| {Path(model).name} | {str(setup.dtype).removeprefix('torch.')} | {args.quantization or '-'} | "
          f"{ready_s:.1f} | {kv_mib} | {memory['RssAnon']} | {memory['RssFile']} | {memory['VmHWM']} |")


if __name__ == "__main__":
    main()
