"""What 8-bit (or 4-bit) weights cost in accuracy: KL divergence of the quantized model's next-token
distribution from the bf16 model's, and how often their top tokens agree, for xserv's W8A8 int8 and
llama.cpp's Q8_0 (or, with --quantization int4, xserv's int4 and llama.cpp's Q4_K_M and Q4_0) on
the same weights and the same text.

    python benchmarks/int8_accuracy.py --llama-cpp-dir ../llamacpp/src      # needs llama-perplexity built
    python benchmarks/int8_accuracy.py                                       # xserv alone
    python benchmarks/int8_accuracy.py --quantization int4 --llama-cpp-dir ../llamacpp/src

The text is this repository's README and docs (about 30k tokens), cut into --chunks chunks of --ctx
tokens; as llama.cpp's `llama-perplexity --kl-divergence` does, the positions of each chunk's second
half are scored (their context is at least half a chunk). xserv: the bf16 and the quantized engine
(the same checkpoint, --quantization int8 or int4) each run a prefill of every chunk; per position,
KL(bf16 || quantized) over the whole vocabulary in float64. llama.cpp: llama-perplexity on the bf16
GGUF writes its logits (--kl-divergence-base), then on each quantized GGUF compares
(--kl-divergence); its "Mean KLD", "99.0%" KLD and "Same top p" are read from its output.
Checkpoint and GGUFs as benchmarks/int8.py and int4.py make them (make_random_model.py,
convert_hf_to_gguf.py, llama-quantize from the bf16 GGUF).
"""

import argparse
import re
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from int4 import quantized_gguf  # noqa: E402
from moe import REFERENCE, checkpoint, cpu_description, gguf  # noqa: E402
from xserv_engine.config import EngineConfig  # noqa: E402
from xserv_engine.engine.llm_engine import LLMEngine  # noqa: E402
from xserv_engine.tokenizer.tokenizer import Tokenizer  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
LLAMA_TYPES = {"int8": ("Q8_0",), "int4": ("Q4_K_M", "Q4_0")}  # llama.cpp's types beside xserv's


def corpus() -> str:
    return "\n\n".join(p.read_text() for p in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))])


def xserv_kl(model: str, chunks: list[list[int]], quantization: str = "int8") -> dict:
    """Per scored position: KL(bf16 || quantized) and whether their argmax agrees."""
    config = dict(model=model, dtype="bfloat16", device="cpu", enable_prefix_caching=False,
                  max_num_batched_tokens=max(map(len, chunks)), kv_cache_memory_gb=0.25)
    full = LLMEngine(EngineConfig(**config), progress=False)
    quant = LLMEngine(EngineConfig(**config, quantization=quantization), progress=False)
    kls, same = [], []
    for i, tokens in enumerate(chunks):
        half = len(tokens) // 2
        p = full.runner.prompt_logits(full.block_manager, [tokens])[half:].double().log_softmax(-1)
        q = quant.runner.prompt_logits(quant.block_manager, [tokens])[half:].double().log_softmax(-1)
        kls.append((p.exp() * (p - q)).sum(-1))
        same.append(p.argmax(-1) == q.argmax(-1))
        print(f"int8_accuracy: xserv {quantization} chunk {i + 1}/{len(chunks)}", file=sys.stderr, flush=True)
    kl, agree = torch.cat(kls), torch.cat(same).double()
    return {"positions": kl.numel(), "mean": kl.mean().item(), "p99": kl.quantile(0.99).item(),
            "same_top": agree.mean().item()}


def llama_kl(args, model: str, text: Path) -> dict:
    """llama.cpp's type name -> its KL from the bf16 GGUF's logits (Q8_0; Q4_K_M and Q4_0 for int4)."""
    perplexity = Path(args.llama_perplexity)
    found = {}
    with tempfile.TemporaryDirectory() as tmp:
        base = Path(tmp) / "bf16.kld"
        common = ["-f", str(text), "-c", str(args.ctx), "--chunks", str(args.chunks), "-t", str(args.threads)]
        subprocess.run([str(perplexity), "-m", gguf(args, model, "bf16"), "--kl-divergence-base", str(base),
                        *common], check=True, capture_output=True, text=True)
        for qtype in LLAMA_TYPES[args.quantization]:
            path = gguf(args, model, "q8_0") if qtype == "Q8_0" else quantized_gguf(args, model, qtype)
            out = subprocess.run([str(perplexity), "-m", path, "--kl-divergence-base", str(base), "--kl-divergence",
                                  *common], check=True, capture_output=True, text=True)
            found[qtype] = kld_summary(out.stdout + out.stderr)
    return found


def kld_summary(log: str) -> dict:
    def number(pattern: str) -> float:
        match = re.search(pattern, log)
        if not match:
            raise RuntimeError(f"llama-perplexity output has no {pattern!r}:\n{log[-2000:]}")
        return float(match.group(1))

    return {"positions": None, "mean": number(r"Mean\s+KLD:\s+([-\d.e]+)"), "p99": number(r"99\.0%\s+KLD:\s+([-\d.e]+)"),
            "same_top": number(r"Same top p:\s+([-\d.e]+)") / 100}


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default=str(REFERENCE / "config-Qwen3-0.6B.json"))
    parser.add_argument("--num-layers", type=int, default=None)
    parser.add_argument("--model", default=None, help="checkpoint directory; written there when absent")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--ctx", type=int, default=512, help="tokens per chunk (default: 512)")
    parser.add_argument("--chunks", type=int, default=4, help="chunks scored (default: 4: 1024 positions)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--llama-cpp-dir", default=None, help="llama.cpp source tree; without it llama.cpp is skipped")
    parser.add_argument("--llama-perplexity", default=None, help="default: LLAMA_CPP_DIR/build/bin/llama-perplexity")
    parser.add_argument("--convert-python", default=sys.executable)
    parser.add_argument("--quantization", choices=("int8", "int4"), default="int8",
                        help="xserv's, beside llama.cpp's Q8_0 (int8) or Q4_K_M and Q4_0 (int4) (default: int8)")
    parser.add_argument("--llama-quantize", default=None, help="default: beside llama-perplexity")
    args = parser.parse_args(argv)
    if args.llama_cpp_dir and args.llama_perplexity is None:
        args.llama_perplexity = str(Path(args.llama_cpp_dir) / "build" / "bin" / "llama-perplexity")
    if args.llama_perplexity and args.llama_quantize is None:
        args.llama_quantize = str(Path(args.llama_perplexity).with_name("llama-quantize"))
    args.gguf_base = "bf16"  # the 4-bit GGUFs are made from the bf16 one (int4.quantized_gguf)
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    cpu = cpu_description()
    model = checkpoint(args)
    text = corpus()
    tokens = Tokenizer.from_dir(Path(model)).encode(text)
    if len(tokens) < args.ctx * args.chunks:
        sys.exit(f"int8_accuracy: the text has {len(tokens)} tokens, fewer than {args.chunks} chunks of {args.ctx}")
    chunks = [tokens[i * args.ctx : (i + 1) * args.ctx] for i in range(args.chunks)]
    label = "int8 (W8A8)" if args.quantization == "int8" else "int4 (W4A8)"
    rows = {f"xserv {label} vs bf16": xserv_kl(model, chunks, args.quantization)}
    print(f"int8_accuracy: xserv {rows}", file=sys.stderr, flush=True)
    if args.llama_cpp_dir:
        with tempfile.NamedTemporaryFile("w", suffix=".txt") as f:
            f.write(text)
            f.flush()
            rows |= {f"llama.cpp {qtype} vs bf16": r for qtype, r in llama_kl(args, model, Path(f.name)).items()}
    print(f"\n{Path(model).name}: {args.chunks} chunks of {args.ctx} tokens of the repo's docs, the second half of "
          f"each scored\nCPU: {cpu}")
    print(f"{'':<28}{'mean KL':>12}{'KL p99':>12}{'same top-1':>12}")
    for name, r in rows.items():
        print(f"{name:<28}{r['mean']:>12.5f}{r['p99']:>12.5f}{r['same_top']:>12.1%}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
