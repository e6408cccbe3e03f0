"""The steps of gpu_acceptance.py: fidelity to transformers, stream throughput, the decode roofline.

Run as part of that script (so `from acceptance_steps import ...`), on CUDA or, tiny, on the CPU.
"""

import random
import statistics
import threading
import time

import torch

from xserv_engine.config import EngineConfig
from xserv_engine.engine.engine_thread import EngineThread
from xserv_engine.engine.llm_engine import LLMEngine
from xserv_engine.sampling_params import SamplingParams

# nominal HBM bandwidth, bytes/s, by a substring of torch.cuda.get_device_name()
NOMINAL_BANDWIDTH = {"H200": 4.8e12, "H100 NVL": 3.9e12, "H100 PCIe": 2.0e12, "H100": 3.35e12,
                     "A100-SXM4-80GB": 2.04e12, "A100": 1.56e12, "L40S": 0.864e12}


def start_engine(config: EngineConfig) -> EngineThread:
    engine = EngineThread(LLMEngine(config, progress=False))
    engine.start()
    return engine


def generate_all(engine: EngineThread, prompts, max_tokens, temperature: float, tag: str):
    """Submit every prompt at once; per request, its (arrival time, new tokens) outputs. Returns
    (outputs, start time, end time)."""
    outputs = [[] for _ in prompts]
    done = threading.Semaphore(0)

    def listener(i):
        def on_output(out):
            outputs[i].append((time.perf_counter(), out.token_ids))
            if out.finished:
                done.release()
        return on_output

    start = time.perf_counter()
    for i, (prompt, n) in enumerate(zip(prompts, max_tokens)):
        params = SamplingParams(max_tokens=n, temperature=temperature, ignore_eos=True, seed=i)
        engine.add_request(f"{tag}-{i}", prompt, params, listener(i))
    for _ in prompts:
        done.acquire()
    return outputs, start, time.perf_counter()


def tokens_of(outputs) -> list[int]:
    return [t for _, ids in outputs for t in ids]


def check_fidelity(config: EngineConfig, model_dir, prompt_lens, new_tokens: int) -> dict:
    """fp32 on both sides: prefill logits and greedy tokens against transformers."""
    from transformers import AutoModelForCausalLM

    torch.backends.cuda.matmul.allow_tf32 = False
    rng = random.Random(1)
    prompts = [[rng.randrange(151643) for _ in range(n)] for n in prompt_lens]
    engine = start_engine(config)
    try:
        ours = engine.engine.runner.prompt_logits(engine.engine.block_manager, prompts)
        outputs, _, _ = generate_all(engine, prompts, [new_tokens] * len(prompts), 0.0, "fidelity")
    finally:
        engine.shutdown()
    del engine
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).to(config.device).eval()
    diff, scale, equal, start = 0.0, 0.0, 0, 0
    with torch.inference_mode():
        for prompt, out in zip(prompts, outputs):
            ids = torch.tensor([prompt], device=config.device)
            ref = hf(ids).logits[0].float()
            diff = max(diff, (ours[start : start + len(prompt)] - ref).abs().max().item())
            scale = max(scale, ref.abs().max().item())
            start += len(prompt)
            gen = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                              min_new_tokens=new_tokens, do_sample=False, pad_token_id=0)
            equal += gen[0, len(prompt):].tolist() == tokens_of(out)
    del hf
    return {"prompt_lens": list(prompt_lens), "new_tokens": new_tokens, "logits_max_abs_diff": diff,
            "logits_max_abs": scale, "greedy_equal": equal, "greedy_total": len(prompts)}


def measure_streams(config: EngineConfig, workloads, batch1_new_tokens: int) -> dict:
    """workloads: (streams, prompts, output lengths, temperature). Also batch-1 decode tok/s:
    one stream's tokens after its first, over the time between its first and last."""
    started = time.perf_counter()
    engine = start_engine(config)
    try:
        engine.warmup()
        startup = time.perf_counter() - started
        prompt = [random.Random(2).randrange(151643) for _ in range(128)]
        decode = []
        for r in range(2):  # the first round warms what the engine's warm-up did not
            outputs, _, _ = generate_all(engine, [prompt], [batch1_new_tokens], 0.0, f"b1-{r}")
            times = [t for t, ids in outputs[0] if ids]
            decode.append((len(tokens_of(outputs[0])) - 1) / (times[-1] - times[0]))
        streams = []
        for n, prompts, lengths, temperature in workloads:
            outputs, start, end = generate_all(engine, prompts, lengths, temperature, f"s{n}")
            produced = sum(len(tokens_of(o)) for o in outputs)
            ttft = statistics.median(next(t for t, ids in o if ids) - start for o in outputs)
            streams.append({"streams": n, "temperature": temperature, "requested_tokens": sum(lengths),
                            "output_tokens": produced,
                            "seconds": round(end - start, 3), "output_tok_s": produced / (end - start),
                            "ttft_p50_s": round(ttft, 4)})
        dtype = str(engine.setup.dtype).removeprefix("torch.")
        backend = engine.runner.backend.name
        graphs = engine.runner.decode_buckets is not None and bool(engine.runner.decode_buckets.graphs)
    finally:
        engine.shutdown()
    return {"dtype": dtype, "attention_backend": backend, "cuda_graphs": graphs, "startup_s": round(startup, 1),
            "batch1_decode_tok_s": decode[-1], "streams": streams}


def weight_bytes(c: dict, itemsize: int) -> int:
    """What one decode step of one sequence reads: every decoder weight (of an MoE layer, the
    router and the top-k experts), the final norm and the LM head (the embedding is a gather of B
    rows; a tied head is the embedding read whole). A hybrid model's (Qwen3.5: a nested
    text_config) linear-attention layers add their projections and conv, and read and write the
    sequence's fp32 recurrent state."""
    c = c.get("text_config", c)
    h, d = c["hidden_size"], c["head_dim"]
    q, kv = c["num_attention_heads"] * d, c["num_key_value_heads"] * d
    mlp = 3 * h * c.get("intermediate_size", 0)
    if c.get("num_experts"):  # Qwen3-30B-A3B's layers are all MoE (decoder_sparse_step 1, no mlp_only_layers)
        mlp = h * (c["num_experts"] + 3 * c["num_experts_per_tok"] * c["moe_intermediate_size"])
        mlp += h * (3 * c.get("shared_expert_intermediate_size", 0) + 1)
    types = c.get("layer_types") or ["full_attention"] * c["num_hidden_layers"]
    gate = q if "layer_types" in c else 0  # the hybrid models' attention output gate
    full = h * (q + gate + 2 * kv) + q * h + mlp + 2 * h + 2 * d
    total = sum(itemsize * full for t in types if t == "full_attention")
    if "linear_attention" in types:
        hk, hv = c["linear_num_key_heads"], c["linear_num_value_heads"]
        dk, dv = c["linear_key_head_dim"], c["linear_value_head_dim"]
        conv = 2 * hk * dk + hv * dv
        weights = h * (conv + hv * dv + 2 * hv) + hv * dv * h + conv * c["linear_conv_kernel_dim"] + mlp + 2 * h
        state = 2 * 4 * hv * dk * dv  # fp32, read and written
        total += types.count("linear_attention") * (itemsize * weights + state)
    return total + itemsize * (h + c["vocab_size"] * h)


def copy_bandwidth(device: str, nbytes: int) -> float:
    """Bytes/s read + written by a device-to-device copy (the best of 5 rounds)."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    best = float("inf")
    for _ in range(5):
        if device == "cuda":
            torch.cuda.synchronize()
        start = time.perf_counter()
        dst.copy_(src)
        if device == "cuda":
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - start)
    return 2 * nbytes / best


def decode_roofline(config: dict, dtype: str, tok_s: float, device: str) -> dict:
    nbytes = weight_bytes(config, torch.finfo(getattr(torch, dtype)).bits // 8)
    measured = copy_bandwidth(device, 2 << 30 if device == "cuda" else 256 << 20)
    name = torch.cuda.get_device_name() if device == "cuda" else ""
    nominal = next((bw for key, bw in NOMINAL_BANDWIDTH.items() if key in name), None)
    return {"weight_bytes": nbytes, "bandwidth_measured": measured, "bandwidth_nominal": nominal,
            "roofline_tok_s_measured": measured / nbytes, "fraction_measured": tok_s * nbytes / measured,
            "fraction_nominal": tok_s * nbytes / nominal if nominal else None}
