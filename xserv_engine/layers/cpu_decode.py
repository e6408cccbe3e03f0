"""Decode steps of a few sequences on the CPU as one native call (cpu_decode.cpp).

At batch 1 the torch path spends most of a decode step outside the LM head: ~40 small ops per
decoder layer, each with its own dispatch and OpenMP fork, cost more than the layers' arithmetic
(docs/benchmarks.md, "One stream"). The CPU has no CUDA graphs to replay them, so a decode-only
step of up to MAX_BATCH sequences - embedding, decoder layers, final norm, the LM head for up to
LM_HEAD_BATCH of them, and the sampling of plain rows (Sampler.plain_draws; rows with penalties,
a bias or logprobs over a float32 copy of the logits that Sampler adjusts first) - runs as one C++
function instead, compiled once per machine with the system's g++ (layers/native.py; a second or
two, cached) and called through ctypes. Without a compiler, with --enforce-eager, or where holding the layers' weights a second
time would take too much memory, the engine runs the torch path as before.
"""

import ctypes
import logging
import os
from pathlib import Path

import torch
from torch import nn

from xserv_engine.engine.sequence import Sequence
from xserv_engine.layers import native
from xserv_engine.layers.sampler import PlainDraws

log = logging.getLogger(__name__)
SOURCE = Path(__file__).with_name("cpu_decode.cpp")
FLAGS = native.FLAGS
# Decode steps of up to this many sequences run in the kernel. Whole steps on the demo model
# (layers' weights 8 MB, in cache), kernel vs the torch path, in-process: bf16 1.5x at 12
# sequences, 1.3-1.4x at 16-32, 1.1-1.3x at 48-64; fp32 1.03-1.2x at 12-24, even at 32-64. Served
# (gRPC, bf16), where the server's own threads need the cores the kernel keeps busy: 1.18x at 12
# streams, 1.08x at 24, 0.95x at 32, 0.9x at 64 - so 24. A Qwen3-0.6B shape (880 MB of layers) is
# 0.86x already at 8, so 4 there (docs/benchmarks.md).
MAX_BATCH = 24
MAX_BATCH_LARGE = 4
LARGE_LAYER_BYTES = 64 * 2**20  # decoder layers' weights above this take MAX_BATCH_LARGE
# The kernel reads plain [out, in] weights while the torch path keeps oneDNN-packed copies, so
# the decoder layers' weights (and an untied LM head) are held twice; at most this fraction of
# the machine's memory.
MAX_COPY_OF_MEMORY = 1 / 8
LM_HEAD_BATCH = 2
TOP_K_MAX = 64  # top-k rows up to this k are sampled in the kernel (TOP_K_MAX in cpu_decode.cpp)
MAX_HEAD_DIM = 1024  # the kernel's per-head scratch
DTYPES = {torch.bfloat16: "bf16", torch.float32: "f32"}  # the kernel's function suffix per dtype
# the matmul weights packed for oneDNN, of which this kernel keeps a plain copy
PLAIN_WEIGHTS = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj", "lm_head")


class _Layer(ctypes.Structure):
    _fields_ = [(name, ctypes.c_void_p) for name in
                ("input_norm", "qkv", "q_norm", "k_norm", "o", "post_norm", "gate_up", "down", "k_cache", "v_cache")]


class _Model(ctypes.Structure):
    _fields_ = ([(name, ctypes.c_int64) for name in ("hidden", "intermediate", "heads", "kv_heads", "head_dim",
                                                     "layers", "block_size", "slots", "max_context", "vocab")]
                + [("eps", ctypes.c_float), ("scale", ctypes.c_float)]
                + [(name, ctypes.c_void_p) for name in ("embed", "lm_head", "final_norm", "cos", "signed_sin")]
                + [("layer", ctypes.POINTER(_Layer))])


class _Step(ctypes.Structure):
    _fields_ = [("batch", ctypes.c_int64), ("token_ids", ctypes.c_void_p), ("positions", ctypes.c_void_p),
                ("slots", ctypes.c_void_p), ("block_tables", ctypes.c_void_p), ("table_stride", ctypes.c_int64),
                ("hidden", ctypes.c_void_p), ("logits", ctypes.c_void_p), ("temperature", ctypes.c_void_p),
                ("uniform", ctypes.c_void_p), ("top_k", ctypes.c_void_p), ("top_p", ctypes.c_void_p),
                ("min_p", ctypes.c_void_p), ("chosen", ctypes.c_void_p), ("work", ctypes.c_void_p),
                ("threads", ctypes.c_int32)]


def plain_weights(model: nn.Module) -> dict[str, torch.Tensor]:
    """The matmul weights the kernel reads, taken before pack_cpu_linears replaces them: the
    decoder layers' and the LM head's, unless it is the embedding (tied), which stays plain."""
    tied = model.config.tie_word_embeddings
    return {name: module.weight for name, module in model.named_modules()
            if name.rsplit(".", 1)[-1] in PLAIN_WEIGHTS and isinstance(module, nn.Linear)
            and not (tied and name == "lm_head")}


def load_library() -> ctypes.CDLL | None:
    """The compiled kernel (built on first use, then cached), or None, logged, where it cannot be."""
    path = native.build(SOURCE, FLAGS, "the CPU decode kernel")
    try:
        return ctypes.CDLL(str(path)) if path is not None else None
    except OSError as exc:
        log.warning("the CPU decode kernel did not load (%s): decode steps run the torch path", exc)
        return None


def _bytes(weights: dict[str, torch.Tensor]) -> int:
    return sum(w.numel() * w.element_size() for w in weights.values())


def _physical_memory() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):  # not on this platform: no limit
        return 0


def native_matmul(lib: ctypes.CDLL, weight: torch.Tensor):
    """x [B, K] (float32) -> x @ weight.T [B, N] in weight's dtype, through the matvec the kernel
    runs its LM head with (benchmarks/roofline.py times it)."""
    fn = getattr(lib, f"cpu_matmul_{DTYPES[weight.dtype]}")
    fn.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p] + [ctypes.c_int64] * 3 + [ctypes.c_int32]
    n, k = weight.shape

    def matmul(x: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
        assert x.dtype == torch.float32 and x.is_contiguous() and out.shape == (x.shape[0], n)
        fn(weight.data_ptr(), x.data_ptr(), out.data_ptr(), x.shape[0], n, k, torch.get_num_threads())
        return out

    return matmul


class CpuDecode:
    """Runs decode-only steps of up to max_batch sequences through the kernel; holds every
    pointer it passes (weights, KV cache, buffers), so none moves or is freed under it."""

    def __init__(self, lib: ctypes.CDLL, model: nn.Module, weights: dict[str, torch.Tensor], dtype: torch.dtype,
                 block_size: int, max_model_len: int):
        cfg, inner = model.config, model.model
        layer_bytes = _bytes({name: w for name, w in weights.items() if name != "lm_head"})
        max_batch = MAX_BATCH if layer_bytes <= LARGE_LAYER_BYTES else MAX_BATCH_LARGE
        self.fn = getattr(lib, f"cpu_decode_{DTYPES[dtype]}")
        self.sample_fn = getattr(lib, f"cpu_sample_{DTYPES[dtype]}")  # over logits oneDNN computed
        self.sample_f32_fn = lib.cpu_sample_f32  # over float32 logits of any model (adjusted ones)
        for fn in (self.fn, self.sample_fn, self.sample_f32_fn):
            fn.argtypes, fn.restype = [ctypes.POINTER(_Model), ctypes.POINTER(_Step)], None
        self.max_batch, self.block_size = max_batch, block_size
        self.hidden = torch.empty(max_batch, cfg.hidden_size, dtype=dtype)
        self.out = torch.empty(max_batch, cfg.vocab_size, dtype=dtype)
        self._keep = [self.hidden, self.out]  # everything whose address the kernel holds
        layers = (_Layer * cfg.num_hidden_layers)()
        for i, layer in enumerate(inner.layers):
            attn = layer.self_attn
            tensors = [layer.input_layernorm.weight, weights[f"model.layers.{i}.self_attn.qkv_proj"],
                       attn.q_norm.weight, attn.k_norm.weight, weights[f"model.layers.{i}.self_attn.o_proj"],
                       layer.post_attention_layernorm.weight, weights[f"model.layers.{i}.mlp.gate_up_proj"],
                       weights[f"model.layers.{i}.mlp.down_proj"], attn.attn.k_cache, attn.attn.v_cache]
            for field, tensor in zip(_Layer._fields_, tensors):
                setattr(layers[i], field[0], self._pointer(tensor, dtype))
        kv_heads, slots, head_dim = inner.layers[0].self_attn.attn.k_cache.shape
        self.max_blocks = -(-max_model_len // block_size)
        self.model = _Model(
            hidden=cfg.hidden_size, intermediate=cfg.intermediate_size, heads=cfg.num_attention_heads,
            kv_heads=kv_heads, head_dim=head_dim, layers=cfg.num_hidden_layers, block_size=block_size,
            slots=slots, max_context=self.max_blocks * block_size, vocab=cfg.vocab_size, eps=cfg.rms_norm_eps,
            scale=head_dim**-0.5, embed=self._pointer(inner.embed_tokens.weight, dtype),
            lm_head=self._pointer(weights.get("lm_head", inner.embed_tokens.weight), dtype),
            final_norm=self._pointer(inner.norm.weight, dtype),
            cos=self._pointer(inner.rotary.cos, torch.float32),
            signed_sin=self._pointer(inner.rotary.signed_sin, torch.float32), layer=layers)
        self._keep.append(layers)
        lib.cpu_decode_work_floats.argtypes = [ctypes.POINTER(_Model), ctypes.c_int64]
        lib.cpu_decode_work_floats.restype = ctypes.c_int64
        work = torch.empty(lib.cpu_decode_work_floats(ctypes.byref(self.model), max_batch), dtype=torch.float32)
        self._keep.append(work)
        # the step's inputs, written in place each step
        self.token_ids = (ctypes.c_int64 * max_batch)()
        self.positions = (ctypes.c_int64 * max_batch)()
        self.slots = (ctypes.c_int64 * max_batch)()
        self.tables = (ctypes.c_int32 * (max_batch * self.max_blocks))()
        self.temperature = (ctypes.c_float * max_batch)()
        self.uniform = (ctypes.c_float * max_batch)()
        self.top_k = (ctypes.c_int32 * max_batch)()
        self.top_p = (ctypes.c_float * max_batch)()
        self.min_p = (ctypes.c_float * max_batch)()
        self.chosen = (ctypes.c_int64 * max_batch)()
        self.step = _Step(batch=0, token_ids=ctypes.addressof(self.token_ids),
                          positions=ctypes.addressof(self.positions), slots=ctypes.addressof(self.slots),
                          block_tables=ctypes.addressof(self.tables), table_stride=self.max_blocks,
                          temperature=ctypes.addressof(self.temperature), uniform=ctypes.addressof(self.uniform),
                          top_k=ctypes.addressof(self.top_k), top_p=ctypes.addressof(self.top_p),
                          min_p=ctypes.addressof(self.min_p),
                          hidden=self.hidden.data_ptr(), logits=self.out.data_ptr(), work=work.data_ptr(),
                          threads=1)
        self._model_ref, self._step_ref = ctypes.byref(self.model), ctypes.byref(self.step)
        # steps of up to this many sequences run the LM head in the kernel, larger ones oneDNN's
        self.lm_head_batch = LM_HEAD_BATCH
        self._compute_logits = model.compute_logits

    @staticmethod
    def supports(model: nn.Module, weights: dict[str, torch.Tensor], dtype: torch.dtype,
                 backend_name: str) -> str | None:
        """Why this model cannot use the kernel, or None."""
        cfg = model.config
        if cfg.is_moe:
            return "mixture-of-experts layers (the kernel has dense MLPs only)"
        copy_bytes, memory = _bytes(weights), _physical_memory()
        if memory and copy_bytes > memory * MAX_COPY_OF_MEMORY:
            return (f"its plain copy of the decoder layers' weights ({copy_bytes / 2**30:.1f} GiB) would exceed "
                    f"{MAX_COPY_OF_MEMORY:.0%} of this machine's memory")
        if dtype not in DTYPES:
            return f"dtype {dtype} (the kernel has bfloat16 and float32)"
        if backend_name != "torch":
            return f"attention backend {backend_name} (the kernel reads the torch backend's cache layout)"
        if cfg.head_dim > MAX_HEAD_DIM or cfg.head_dim % 2 or cfg.num_attention_heads % cfg.num_key_value_heads:
            return f"head_dim {cfg.head_dim} with {cfg.num_attention_heads}/{cfg.num_key_value_heads} heads"
        return None

    def warm(self) -> None:
        """One call at full batch before serving: its scratch memory is page-faulted in here,
        not in the first user's step. Writes position 0 of block 0, which no request owns yet."""
        self.tables[:] = [0] * len(self.tables)
        for b in range(self.max_batch):
            self.token_ids[b] = self.positions[b] = self.slots[b] = 0
        self.step.batch, self.step.threads = self.max_batch, torch.get_num_threads()
        self.fn(self._model_ref, self._step_ref)

    def _pointer(self, tensor: torch.Tensor, dtype: torch.dtype) -> int:
        if tensor.dtype != dtype or not tensor.is_contiguous() or tensor.device.type != "cpu":
            raise ValueError(f"it reads contiguous {dtype} CPU tensors, got a {tensor.dtype} one of shape "
                             f"{tuple(tensor.shape)}")
        self._keep.append(tensor)
        return tensor.data_ptr()

    def logits(self, seqs: list[Sequence]) -> torch.Tensor:
        """The logits [B, V] of one decode step of seqs (len(seqs) <= max_batch), in a buffer the
        next call overwrites; writes each sequence's new key and value into the cache, as the
        torch path does."""
        native_head = len(seqs) <= self.lm_head_batch
        self._run(seqs, self.out.data_ptr() if native_head else None, None)
        if native_head:
            return self.out[: len(seqs)]
        return self._compute_logits(self.hidden[: len(seqs)])

    def sample(self, seqs: list[Sequence], draws: PlainDraws) -> list[int]:
        """One decode step of seqs that also picks their next tokens in the kernel, from
        Sampler.plain_draws(seqs, TOP_K_MAX) (what Sampler would pick, to float rounding): in the
        same call up to lm_head_batch sequences, in a second one over oneDNN's logits above."""
        if len(seqs) > self.lm_head_batch:
            return self.sample_logits(self.logits(seqs).contiguous(), draws)
        self._set_draws(draws, len(seqs))
        self._run(seqs, self.out.data_ptr(), ctypes.addressof(self.chosen))
        return self.chosen[: len(seqs)]

    def sample_logits(self, logits: torch.Tensor, draws: PlainDraws) -> list[int]:
        """The tokens of rows of contiguous logits [B, V] (B <= max_batch; the model dtype or
        float32), held while the kernel reads them, as Sampler would pick them for draws."""
        n = logits.shape[0]
        fn = self.sample_f32_fn if logits.dtype == torch.float32 else self.sample_fn
        if logits.dtype not in (torch.float32, self.out.dtype) or not logits.is_contiguous() or n > self.max_batch:
            raise ValueError(f"it samples up to {self.max_batch} contiguous rows in {self.out.dtype} or float32, "
                             f"got {logits.dtype} {tuple(logits.shape)}")
        self._set_draws(draws, n)
        self.step.batch, self.step.threads = n, torch.get_num_threads()
        self.step.logits, self.step.chosen = logits.data_ptr(), ctypes.addressof(self.chosen)
        fn(self._model_ref, self._step_ref)
        return self.chosen[:n]

    def _set_draws(self, draws: PlainDraws, n: int) -> None:
        self.temperature[:n], self.uniform[:n], self.top_k[:n] = draws.temperature, draws.uniform, draws.top_k
        self.top_p[:n], self.min_p[:n] = draws.top_p, draws.min_p

    def _run(self, seqs: list[Sequence], logits: int | None, chosen: int | None) -> None:
        bs, stride = self.block_size, self.max_blocks
        for b, seq in enumerate(seqs):
            pos = len(seq) - 1
            table = seq.block_table
            self.token_ids[b] = seq.last_token
            self.positions[b] = pos
            self.slots[b] = table[pos // bs] * bs + pos % bs
            self.tables[b * stride : b * stride + len(table)] = table
        self.step.batch = len(seqs)
        self.step.logits, self.step.chosen = logits, chosen
        self.step.threads = torch.get_num_threads()
        self.fn(self._model_ref, self._step_ref)  # ctypes lets go of the GIL for the call
