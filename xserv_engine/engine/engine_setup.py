"""Everything derived from an EngineConfig once, at start: device, dtype, model, KV-cache size.

Derived values are returned here, never written back into the config.
"""

import enum
import logging
from dataclasses import dataclass

import torch

from xserv_engine.config import EngineConfig
from xserv_engine.engine.decode_buckets import CPU_TRACED_BATCH
from xserv_engine.engine.device import release_freed_memory, resolve_device, resolve_dtype, retain_freed_memory
from xserv_engine.engine.model_runner import WARMUP_ROUNDS, ModelRunner
from xserv_engine.engine.mtp_drafter import MtpDrafter
from xserv_engine.engine.runner_kind import RunnerKind
from xserv_engine.engine.speculative import DraftModel, SpeculativeConfig
from xserv_engine.errors import InvalidRequest, ModelLoadError
from xserv_engine.layers import fused_moe, native, ops
from xserv_engine.layers.attention import select_backend
from xserv_engine.models.int4_formats import Int4Checkpoint
from xserv_engine.models.loader import ModelDir, has_mtp_weights, read_model_dir
from xserv_engine.models.pooling import PoolingConfig
from xserv_engine.models.quantization import Int8Checkpoint
from xserv_engine.models.qwen3 import Qwen3Config
from xserv_engine.tokenizer.tokenizer import Tokenizer

log = logging.getLogger(__name__)
startup = logging.getLogger("xserv.engine.startup")  # shown at the default level (server.cli.configure_logging)
DEFAULT_MAX_MODEL_LEN = 8192
CPU_KV_CACHE_BYTES = 1 * 2**30
FLASH_BLOCK_SIZE = 256  # flash_attn_with_kvcache needs paged blocks of a multiple of 256 tokens
# The torch path reads the cache block by block: longer blocks mean fewer, longer rows per step
# (docs/benchmarks-log.md has the comparison with 16); prefix-cache hits then come in 64-token steps.
TORCH_BLOCK_SIZE = 64
# The CPU warm-up (ModelRunner.warmup, all its rounds) is cut to about this much work, so that a
# large model on a small CPU is ready in seconds: the demo model warms with the whole token
# budget, a Qwen3-0.6B shape with ~380-token prefills (timings in docs/benchmarks-log.md).
CPU_WARMUP_FLOPS = 1e12


@dataclass(frozen=True)
class EngineSetup:
    model_dir: ModelDir
    model_id: str
    tokenizer: Tokenizer
    runner: ModelRunner
    device: torch.device
    dtype: torch.dtype
    block_size: int
    num_blocks: int
    max_model_len: int
    max_num_batched_tokens: int  # the scheduler's token budget per step; longer prompts are chunked
    pooling: PoolingConfig | None  # the pooling runner's (embeddings); None: the generate runner
    route: "Route"  # how the forward runs (choose_route)
    draft: DraftModel | MtpDrafter | None = None  # speculative decoding's drafter, if it has one
    max_num_seqs: int = 256  # config.max_num_seqs, capped by the state pool of a hybrid model
    num_state_slots: int = 0  # hybrid models: sequences whose linear-attention states the pool holds
    state_slot_bytes: int = 0  # one slot's states over all layers
    snapshot_slots: range = range(0)  # hybrid prefix cache: the pool's slots for snapshots
    snapshot_interval: int = 1  # blocks between snapshots

    @classmethod
    def build(cls, config: EngineConfig, progress: bool = True,
              speculative: SpeculativeConfig | None = None) -> "EngineSetup":
        model_dir = read_model_dir(config.model, config.language_model_only)
        device = resolve_device(config.device)
        dtype = resolve_dtype(config.dtype, device)
        if device.type == "cpu":
            retain_freed_memory()
        tokenizer = Tokenizer.from_dir(model_dir.path)
        backend = select_backend(config.attention_backend, device)
        block_size = config.block_size or (FLASH_BLOCK_SIZE if backend.name == "flash" else TORCH_BLOCK_SIZE)
        if backend.name == "flash" and block_size % FLASH_BLOCK_SIZE:
            block_size = FLASH_BLOCK_SIZE
        pooling = _pooling(config.runner, model_dir, tokenizer)
        kind = RunnerKind.of(pooling)
        if kind is not RunnerKind.GENERATE and config.enable_lora:
            raise InvalidRequest("enable_lora", "LoRA adapters are served with the generate runner only")
        _check_quantization(config.quantization, model_dir, device)
        mtp = speculative is not None and speculative.method == "mtp"
        if mtp:
            _check_mtp(model_dir)
        runner = ModelRunner(model_dir, device, dtype, backend, block_size, progress, pooling=pooling,
                             lora=config.enable_lora, quantization=config.quantization, mtp=mtp)
        draft = MtpDrafter(runner, speculative.num_speculative_tokens) if mtp else None
        if speculative is not None and speculative.model:
            draft = _draft_model(speculative.model, model_dir, device, dtype, backend, block_size,
                                 progress, config.quantization)
        block_bytes = runner.kv_block_bytes() + (draft.runner.kv_block_bytes() if draft else 0)
        budget = _cache_budget(config, device)
        budget -= _encoder_cache_bytes(runner, budget)
        slot_bytes = runner.state_slot_bytes()
        num_slots = _state_slots(config, budget, slot_bytes)
        num_snapshots, interval = _snapshots(config, budget, slot_bytes, block_size, kind)
        num_blocks = config.num_kv_blocks or _blocks_for_memory(budget - (num_slots + num_snapshots) * slot_bytes,
                                                                block_bytes)
        runner.allocate_kv_cache(num_blocks)
        num_snapshots = min(num_snapshots, num_blocks)  # one per block at most
        max_num_seqs = config.max_num_seqs
        snapshot_slots = range(0)
        if slot_bytes:
            snapshot_slots = runner.allocate_states(num_slots, num_snapshots)
            log.info("state pool: %d sequences x %.1f MiB of linear-attention states (%.2f GiB), beside %d KV blocks "
                     "of %.1f MiB", num_slots, slot_bytes / 2**20, num_slots * slot_bytes / 2**30, num_blocks,
                     block_bytes / 2**20)
            if num_snapshots:
                log.info("prefix cache: %d snapshots of the states (%.2f GiB), every %d tokens of a prompt and at its "
                         "last full block", num_snapshots, num_snapshots * slot_bytes / 2**30, interval * block_size)
            if num_slots < max_num_seqs:
                log.warning("max_num_seqs lowered from %d to %d: the state pool holds %d sequences",
                            max_num_seqs, num_slots, num_slots)
                max_num_seqs = num_slots
        if draft is not None:  # the same blocks: the target's block tables index both caches
            draft.runner.allocate_kv_cache(num_blocks)
        max_model_len = min(config.max_model_len or DEFAULT_MAX_MODEL_LEN,
                            model_dir.config.max_position_embeddings, num_blocks * block_size)
        if config.max_model_len and config.max_model_len > max_model_len:
            log.warning("max_model_len lowered from %d to %d (position limit or KV-cache size)",
                        config.max_model_len, max_model_len)
        max_num_batched_tokens = config.max_num_batched_tokens
        if max_num_batched_tokens < 1:
            raise InvalidRequest("max_num_batched_tokens", f"must be at least 1, got {max_num_batched_tokens}")
        route, why = choose_route(config, device, backend.graph_safe, model_dir.config.is_moe, kind,
                                  traceable=not runner.has_packed_linears(), hybrid=model_dir.config.is_hybrid)
        startup.info("route: %s (%s)", route.value, why)
        if route is Route.CUDA_GRAPHS:
            runner.use_bucketed_decode(max_num_seqs, max_model_len, capture=True)
        if device.type == "cpu":
            ops.set_native(route in (Route.CPU_NATIVE, Route.CPU_TRACED))
        if model_dir.config.is_moe:
            fused_moe.prepare(device, dtype)
        if device.type == "cpu":
            release_freed_memory()  # the load's; the warm-up's temporaries are then kept for the first steps
            tokens = warmup_tokens(model_dir.config, max_num_batched_tokens)
            startup.info("warming up: %d-token prefills%s", tokens,
                         ", then tracing decode batches" if route is Route.CPU_TRACED else "")
            runner.warmup(tokens, max_num_seqs)
            if draft is not None:
                draft.runner.warmup(tokens, max_num_seqs)
        if route is Route.CPU_TRACED:  # after warm-up: traced as steps will run
            runner.use_bucketed_decode(min(max_num_seqs, CPU_TRACED_BATCH), max_model_len, capture=True)
            if runner.decode_buckets is None:
                route = Route.CPU_NATIVE
                log.warning("route: %s instead: the forward could not be traced (logged above)", route.value)
        log.info("engine ready: %s on %s (%s), %s runner, %d KV blocks of %d tokens, max_model_len %d",
                 model_dir.path, device, dtype, config.runner, num_blocks, block_size, max_model_len)
        return cls(model_dir, config.model_id or model_dir.path.name, tokenizer, runner, device, dtype,
                   block_size, num_blocks, max_model_len, max_num_batched_tokens, pooling, route, draft,
                   max_num_seqs, num_slots if slot_bytes else 0, slot_bytes, snapshot_slots, interval)


class Route(enum.Enum):
    """How the engine's forward runs, decided once at start (choose_route), logged, and reported
    by GetModelInfo (decode_route). Every route runs the one model definition (models/qwen3.py);
    they differ in what runs its ops and whether decode steps replay captured graphs."""

    CUDA_GRAPHS = "cuda-graphs"  # decode steps of up to max_num_seqs replay CUDA graphs; the rest eager
    CUDA_EAGER = "cuda-eager"  # every step op by op
    CPU_TRACED = "cpu-traced"  # cpu-native, and decode steps of up to CPU_TRACED_BATCH sequences replay traces
    CPU_NATIVE = "cpu-native"  # the model's small ops and int8 linears in layers/cpu_ops.cpp (torch ops)
    CPU_TORCH = "cpu-torch"  # plain torch ops: the reference, and the fallback where the native ops cannot build


def choose_route(config: EngineConfig, device: torch.device, graph_safe: bool, moe: bool,
                 kind: RunnerKind, traceable: bool = True, hybrid: bool = False) -> tuple[Route, str]:
    """The route of this engine's steps, and why (the one place it is decided). traceable: no
    linear of the model is oneDNN's (torch.jit cannot trace its packed weights). hybrid: the
    model has linear-attention layers, whose decode steps are not captured as CUDA graphs (yet)."""
    if device.type == "cuda":
        if config.enforce_eager:
            return Route.CUDA_EAGER, "--enforce-eager"
        if hybrid:
            return Route.CUDA_EAGER, "linear-attention (hybrid) steps are not captured"
        if kind is not RunnerKind.GENERATE:
            return Route.CUDA_EAGER, f"the {kind.value} runner only prefills"
        if not graph_safe:
            return Route.CUDA_EAGER, "the attention backend cannot be captured"
        if moe:  # the expert grouping's sizes are data-dependent
            return Route.CUDA_EAGER, "mixture-of-experts steps are not captured"
        return Route.CUDA_GRAPHS, f"decode batches up to {config.max_num_seqs}"
    if config.enforce_eager:
        return Route.CPU_TORCH, "--enforce-eager"
    if not native.load_torch_ops():
        return Route.CPU_TORCH, "the native CPU ops did not build (logged above)"
    why = "layers/cpu_ops.cpp, built for this CPU"
    if kind is not RunnerKind.GENERATE:
        return Route.CPU_NATIVE, f"{why}; the {kind.value} runner only prefills"
    if not traceable:
        return Route.CPU_NATIVE, f"{why}; oneDNN's packed linears cannot be traced"
    return Route.CPU_TRACED, f"{why}; decode batches up to {min(config.max_num_seqs, CPU_TRACED_BATCH)} traced"


def _check_quantization(quantization: str | None, model_dir: ModelDir, device: torch.device) -> None:
    """int8 and int4 weights (asked for, or the checkpoint's) run on the CPU only: on CUDA, refused
    by name; so is asking for one on a checkpoint already in the other."""
    if quantization not in (None, "int8", "int4"):
        raise InvalidRequest("quantization", f"must be int8, int4 or unset, got {quantization!r}")
    held = ("int8" if isinstance(model_dir.quantization, Int8Checkpoint)
            else "int4" if isinstance(model_dir.quantization, Int4Checkpoint) else None)
    if quantization and held and quantization != held:
        raise InvalidRequest("quantization", f"{quantization} asked for, but the checkpoint's weights are {held} "
                             f"({model_dir.quantization.method if held == 'int4' else 'compressed-tensors'}): "
                             "serve it without --quantization")
    if (quantization or held) and device.type != "cpu":
        raise InvalidRequest("quantization", f"{quantization or held} weights run on the CPU only, not on {device}; "
                             "on CUDA serve the bfloat16 checkpoint or an fp8 one (e.g. Qwen/Qwen3-8B-FP8)")


def _pooling(runner: str, model_dir: ModelDir, tokenizer: Tokenizer) -> PoolingConfig | None:
    """The pooling of --runner pooling (the directory's sentence-transformers config, else the last
    token, normalized: what decoder embedding models use), or of auto on an embedding directory;
    of --runner score, the last token's "no" and "yes" logits; None for generate."""
    if runner not in ("auto", "generate", "pooling", "score"):
        raise InvalidRequest("runner", f"must be auto, generate, pooling or score, got {runner!r}")
    if runner == "score":
        no, yes = tokenizer.token_id("no"), tokenizer.token_id("yes")
        if no is None or yes is None:
            raise InvalidRequest("runner", "score needs a tokenizer with the tokens 'no' and 'yes' (Qwen3-Reranker's)")
        return PoolingConfig(normalize=False, classify=(no, yes))
    if runner == "generate" or (runner == "auto" and model_dir.pooling is None):
        return None
    return model_dir.pooling or PoolingConfig()


def _cache_budget(config: EngineConfig, device: torch.device) -> float:
    """Bytes for the KV cache, of a hybrid model the state pool, of a vision-language model the
    encoder cache."""
    if config.kv_cache_memory_gb is not None:
        return config.kv_cache_memory_gb * 2**30
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        return free - total * (1 - config.gpu_memory_utilization)
    return CPU_KV_CACHE_BYTES


def _encoder_cache_bytes(runner: ModelRunner, budget: float) -> int:
    """The vision tower's output cache when full (0 without a tower): it shares the cache budget,
    so the KV cache leaves it room. It holds up to CACHE_TOKENS image tokens and at most a quarter
    of the budget (a large tower's features on the CPU's 1 GiB default would take half)."""
    if runner.images is None:
        return 0
    cache = runner.images
    per_token = cache.cache_bytes // cache.capacity
    cache.capacity = max(1, min(cache.capacity, int(budget // 4 // per_token)))
    log.info("encoder cache: up to %d image tokens (%.1f MiB), taken from the cache budget before the KV cache",
             cache.capacity, cache.cache_bytes / 2**20)
    return cache.cache_bytes


def _state_slots(config: EngineConfig, budget: float, slot_bytes: int) -> int:
    """The state pool's sequences: max_num_seqs, or as many as half the budget holds (the other
    half is the KV cache's); with num_kv_blocks given, the budget is the pool's alone."""
    if not slot_bytes:
        return 0
    share = budget if config.num_kv_blocks else budget / 2
    slots = min(config.max_num_seqs, int(share // slot_bytes))
    if slots < 1:
        raise InvalidRequest("kv_cache_memory_gb", f"{share / 2**30:.2f} GB holds no sequence's linear-attention "
                                                   f"states ({slot_bytes / 2**20:.1f} MiB each)")
    return slots


def _snapshots(config: EngineConfig, budget: float, slot_bytes: int, block_size: int,
               kind: RunnerKind) -> tuple[int, int]:
    """(snapshot slots, blocks between snapshots) of a hybrid model's prefix cache: 0 slots with
    prefix caching off, for a model without linear-attention states, or for a pooling runner."""
    interval = config.mamba_track_interval or block_size
    if interval < block_size or interval % block_size:
        raise InvalidRequest("mamba_track_interval", f"must be a multiple of the block size ({block_size} tokens), "
                                                     f"got {interval}")
    if not slot_bytes or not config.enable_prefix_caching or kind is not RunnerKind.GENERATE:
        return 0, interval // block_size
    slots = config.mamba_snapshot_slots
    if slots is None:
        slots = int(budget / 4 // slot_bytes)
    elif slots < 0:
        raise InvalidRequest("mamba_snapshot_slots", f"must be 0 or more, got {slots}")
    return slots, interval // block_size


def _blocks_for_memory(budget: float, block_bytes: int) -> int:
    num_blocks = int(budget // block_bytes)
    if num_blocks < 2:
        raise InvalidRequest("kv_cache_memory_gb", f"{budget / 2**30:.2f} GB holds fewer than 2 KV blocks")
    return num_blocks


def _check_mtp(model_dir: ModelDir) -> None:
    """method mtp needs the checkpoint's multi-token-prediction layer."""
    if not has_mtp_weights(model_dir):
        raise InvalidRequest("speculative_config.method", f"mtp drafts with the checkpoint's multi-token-prediction "
                             f"layer, and {model_dir.path.name} has none (no mtp.* weights, or "
                             "mtp_num_hidden_layers 0 in config.json); use --speculative-config with method ngram "
                             "or draft_model")


def _draft_model(path: str, target: ModelDir, device, dtype, backend, block_size: int, progress: bool,
                 quantization: str | None) -> DraftModel:
    """speculative_config.model, checked against the target (the same vocabulary and tokenizer)
    and loaded as the target is (dtype, quantization, attention backend, block size)."""
    try:
        draft_dir = read_model_dir(path)
    except ModelLoadError as exc:
        raise InvalidRequest("speculative_config.model", str(exc)) from None
    if draft_dir.config.is_hybrid:  # its own states would need keeping per draft as the target's are
        raise InvalidRequest("speculative_config.model", f"{draft_dir.path.name} has linear-attention layers; a draft "
                                                         "model must be a Qwen3 (attention-only) model")
    if draft_dir.config.vocab_size != target.config.vocab_size:
        raise InvalidRequest("speculative_config.model", f"the draft model's vocabulary has {draft_dir.config.vocab_size} "
                             f"tokens, the model's {target.config.vocab_size}: a draft must share its tokenizer")
    ours, theirs = target.path / "tokenizer.json", draft_dir.path / "tokenizer.json"
    if ours.is_file() and theirs.is_file() and ours.read_bytes() != theirs.read_bytes():
        raise InvalidRequest("speculative_config.model", f"{theirs} differs from the model's tokenizer.json: "
                             "a draft must share the model's tokenizer")
    runner = ModelRunner(draft_dir, device, dtype, backend, block_size, progress, quantization=quantization)
    log.info("speculative draft model: %s (%d layers)", draft_dir.path, draft_dir.config.num_hidden_layers)
    return DraftModel(runner)


def warmup_tokens(c: Qwen3Config, max_num_batched_tokens: int) -> int:
    """The CPU warm-up's prefill size: the scheduler's whole budget, or what keeps its rounds
    within CPU_WARMUP_FLOPS (2 per weight of the decoder layers per token; an MoE layer's experts
    count top_k times, its router once)."""
    q, kv = c.num_attention_heads * c.head_dim, c.num_key_value_heads * c.head_dim
    attention = c.hidden_size * (q + 2 * kv) + q * c.hidden_size
    moe = c.hidden_size * (3 * c.num_experts_per_tok * c.moe_intermediate_size + c.num_experts)
    mlp = [moe if c.is_moe_layer(i) else 3 * c.hidden_size * c.intermediate_size for i in range(c.num_hidden_layers)]
    affordable = CPU_WARMUP_FLOPS / WARMUP_ROUNDS // (2 * (attention * c.num_hidden_layers + sum(mlp)))
    return max(1, min(max_num_batched_tokens, int(affordable)))
