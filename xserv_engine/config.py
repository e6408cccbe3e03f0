"""Engine configuration: one frozen dataclass built at the CLI and passed down."""

from dataclasses import dataclass


@dataclass(frozen=True)
class EngineConfig:
    model: str  # a Hugging Face Qwen3 directory (local path)
    dtype: str = "auto"  # auto | float32 | bfloat16 | float16
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    # int8: W8A8 weights quantized at load (layers/int8.py); int4: 4-bit weights, groups of 128
    # (layers/int4.py); None: the checkpoint's precision
    quantization: str | None = None
    max_model_len: int | None = None  # default: the model's max_position_embeddings, capped at 8192
    max_num_seqs: int = 256
    # fcfs | priority: admission by arrival, or by each request's priority (lower first) then
    # arrival, preempting lower priorities first (engine/scheduler.py; vLLM's --scheduling-policy)
    scheduling_policy: str = "fcfs"
    max_num_batched_tokens: int = 8192  # tokens per step; longer prompts are prefilled in chunks
    max_queued_requests: int = 1024
    block_size: int | None = None  # default: 64 on the torch path, 256 with flash-attn
    num_kv_blocks: int | None = None  # default: sized from kv_cache_memory_gb
    kv_cache_memory_gb: float | None = None  # default: 1 GB on CPU; on CUDA what gpu_memory_utilization leaves
    gpu_memory_utilization: float = 0.9
    enable_prefix_caching: bool = True
    # hybrid models' prefix cache (engine/block_manager.py): snapshots of the linear-attention states
    # every mamba_track_interval tokens (a multiple of the block size; default: every block, SGLang's
    # flag) in mamba_snapshot_slots slots (default: as many as a quarter of the cache budget holds)
    mamba_track_interval: int | None = None
    mamba_snapshot_slots: int | None = None
    attention_backend: str = "auto"  # auto | torch | flash | triton
    # every step eager: no CUDA graphs, no native CPU decode kernel (vLLM's --enforce-eager)
    enforce_eager: bool = False
    seed: int = 0
    # max_tokens of a request that sets none; default: generation_config.json's max_new_tokens,
    # else the rest of the context (OpenAI's semantics)
    default_max_tokens: int | None = None
    # model: a gRPC request's unset temperature / top_p / top_k / min_p / repetition_penalty take
    # generation_config.json's values (vLLM's --generation-config auto, SGLang's
    # --sampling-defaults model); openai: the OpenAI defaults (temperature 1, no top-p/top-k)
    sampling_defaults: str = "model"
    # a choice's output goes out every N tokens (its first and last always); None: auto, every
    # token while at most AUTO_STREAM_MESSAGES sequences decode, then fewer (LLMEngine)
    stream_interval: int | None = None
    model_id: str | None = None  # name reported to clients; default: the directory name
    # generate (Generate) | pooling (Embed: an embedding model) | score (Score: a reranker such as
    # Qwen3-Reranker) | auto: pooling for a directory with a sentence-transformers pooling config
    # (Qwen3-Embedding's modules.json), else generate
    runner: str = "auto"
    # LoRA adapters (models/lora.py): served at all only with enable_lora (the decoder's linears
    # then take each sequence's adapter); lora_modules: (name, PEFT directory) pairs loaded at start
    enable_lora: bool = False
    lora_modules: tuple[tuple[str, str], ...] = ()
    max_lora_rank: int = 64
    # the format of the model's tool calls (vLLM's names): hermes / qwen3 (Qwen3's JSON),
    # qwen3_coder (Qwen3-Coder's XML), auto (the one the chat template asks for)
    tool_call_parser: str = "auto"
    # --speculative-config: JSON as vLLM's, e.g. {"method": "ngram", "num_speculative_tokens": 4}
    # (engine/speculative.py); None: no speculation
    speculative_config: str | None = None
    # most images one prompt may hold (vLLM's --limit-mm-per-prompt '{"image": N}'; vLLM's default, 999)
    limit_mm_per_prompt: int = 999
    # a vision-language checkpoint's text model alone: its vision tower neither loaded nor run,
    # images refused (vLLM's --language-model-only)
    language_model_only: bool = False
