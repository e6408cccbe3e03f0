"""Load a Hugging Face Qwen3-family checkpoint directory from a local path (no hub access): the
Qwen3 generation and the hybrid one (Qwen3.5, Qwen3.5-MoE, Qwen3-Next: models/hybrid_weights.py)."""

import json
import logging
import re
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors import safe_open
from tqdm import tqdm

from xserv_engine.errors import ModelLoadError
from xserv_engine.models import hybrid_weights
from xserv_engine.models.int4_formats import Int4Checkpoint
from xserv_engine.models.int4_weights import Int4Weights
from xserv_engine.models.pooling import PoolingConfig, read_pooling_config
from xserv_engine.models.quantization import FP8_DTYPES, Fp8Checkpoint, Int8Checkpoint, checkpoint_quantization
from xserv_engine.models.qwen3 import Qwen3Config, Qwen3ForCausalLM
from xserv_engine.sampling_params import model_sampling_defaults

log = logging.getLogger(__name__)
# Qwen3Model: a checkpoint of the body alone (an embedding model saved with transformers' AutoModel)
SUPPORTED_ARCHITECTURES = {"Qwen3ForCausalLM", "Qwen3Model", "Qwen3MoeForCausalLM",
                           "Qwen3_5ForConditionalGeneration", "Qwen3_5ForCausalLM",
                           "Qwen3_5MoeForConditionalGeneration", "Qwen3_5MoeForCausalLM", "Qwen3NextForCausalLM",
                           "Qwen3VLForConditionalGeneration", "Qwen3VLMoeForConditionalGeneration"}
SUPPORTED_MODEL_TYPES = {"qwen3", "qwen3_moe", "qwen3_5", "qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text", "qwen3_next",
                         "qwen3_vl", "qwen3_vl_moe"}
# one expert's tensor in a checkpoint -> a slice of the layer's stacked experts (FusedExperts)
_EXPERT = re.compile(r"\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
_EXPERT_SLICES = {"gate_proj": ("w13_weight", 0), "up_proj": ("w13_weight", 1), "down_proj": ("w2_weight", 0)}
_STACKED_EXPERTS = (".experts.w13_weight", ".experts.w2_weight")  # transformers 5's stacked form, renamed
_EMBEDDING = "embed_tokens.weight"  # a CPU model reads it from the file (_reads_in_place)


@dataclass(frozen=True)
class ModelDir:
    path: Path
    hf_config: dict
    config: Qwen3Config
    checkpoint_dtype: str  # torch_dtype / dtype from config.json
    eos_token_ids: tuple[int, ...]
    max_new_tokens: int | None  # generation_config.json's default completion length, if any
    # generation_config.json's recommended temperature, top_p, top_k, min_p, repetition_penalty
    sampling_defaults: dict[str, float]
    quantization: Fp8Checkpoint | Int8Checkpoint | Int4Checkpoint | None  # None: full precision
    # an embedding model's pooling (sentence-transformers' modules.json); None: a generation model
    pooling: PoolingConfig | None = None


def read_model_dir(path: str, language_model_only: bool = False) -> ModelDir:
    """language_model_only: a vision-language checkpoint's text model alone (vLLM's flag)."""
    root = Path(path).expanduser()
    if not root.is_dir():
        raise ModelLoadError(f"model directory {root} does not exist")
    config_file = root / "config.json"
    if not config_file.is_file():
        raise ModelLoadError(f"{root} has no config.json: not a Hugging Face model directory")
    hf_config = json.loads(config_file.read_text())
    generation_file = root / "generation_config.json"
    generation = json.loads(generation_file.read_text()) if generation_file.is_file() else {}
    architectures = set(hf_config.get("architectures") or [])
    if not architectures & SUPPORTED_ARCHITECTURES and hf_config.get("model_type") not in SUPPORTED_MODEL_TYPES:
        raise ModelLoadError(
            f"{root}: architecture {sorted(architectures) or hf_config.get('model_type')} is not supported "
            f"(supported: {sorted(SUPPORTED_ARCHITECTURES)})"
        )
    if not _weight_files(root):
        raise ModelLoadError(f"{root} has no *.safetensors weights")
    config = Qwen3Config.from_hf(hf_config, language_model_only)
    if config.vision is not None and not _holds_tensors(root, "model.visual."):
        # xserv's Qwen3.5 demo and benchmarks/make_random_model.py write the text weights alone
        log.warning("%s: its config has a vision tower but its files hold no model.visual.* weights: "
                    "serving its text model alone; requests with images are refused", root)
        config = Qwen3Config.from_hf(hf_config, language_model_only=True)
    return ModelDir(
        path=root,
        hf_config=hf_config,
        config=config,
        checkpoint_dtype=str(hf_config.get("torch_dtype") or hf_config.get("dtype") or "float32"),
        eos_token_ids=_eos_token_ids(generation, hf_config),
        max_new_tokens=generation.get("max_new_tokens"),
        sampling_defaults=model_sampling_defaults(generation, str(generation_file)),
        quantization=checkpoint_quantization(hf_config, str(root)),
        pooling=read_pooling_config(root),
    )


def load_model(model_dir: ModelDir, model: Qwen3ForCausalLM, progress: bool = True) -> dict:
    """Copy the checkpoint's tensors into `model` (already on its device and dtype), but for the
    token embedding that a CPU model reads from the file (_reads_in_place); fp8 weights are
    dequantized on the way (models/quantization.py). Returns, for a compressed-tensors int8
    checkpoint, {module name: (int8 weight, float32 scales)} of its int8 linears, whose parameters
    in `model` stay unfilled until layers/int8.quantize_model installs them; for a 4-bit one,
    {module name: Int4Weight, or for a layer's experts (w13, w2)} for layers/int4.quantize_model;
    else {}."""
    params = dict(model.named_parameters())
    dtype = next(iter(params.values())).dtype
    loaded: set[str] = set()
    int8 = Int8Weights(model, params) if isinstance(model_dir.quantization, Int8Checkpoint) else None
    with ExitStack() as stack:
        paths = _weight_files(model_dir.path)
        files = [stack.enter_context(safe_open(str(file), framework="pt")) for file in paths]
        where = {name: f for f in files for name in f.keys()}
        path_of = {name: path for path, f in zip(paths, files) for name in f.keys()}
        # an embedding checkpoint saved from the body alone names its tensors without "model."
        bare = not any(name.startswith("model.") for name in where)
        as_named = {name: "model." + name if bare and name != "lm_head.weight" else name for name in where}
        int4 = None
        if isinstance(model_dir.quantization, Int4Checkpoint):
            int4 = Int4Weights(model_dir.quantization, model, params, lambda n: locate(model, params, n),
                               as_named.values())
        if isinstance(model_dir.quantization, Fp8Checkpoint):
            log.info("fp8 checkpoint: weights dequantized to %s at load", dtype)
        skipped: set[str] = set()
        with tqdm(total=len(where), desc="Loading weights", unit="tensor", disable=not progress) as bar:
            for name, f in where.items():
                full_name = as_named[name]
                part = hybrid_weights.skipped_part(full_name, model.mtp is not None, model.visual is not None)
                if part is not None:
                    if part not in skipped:
                        skipped.add(part)
                        log.info("%s: %s's weights are not loaded (not served yet)", model_dir.path, part)
                elif int8 is not None and name.endswith(".weight_scale"):
                    int8.scale(full_name.removesuffix("_scale"), f.get_tensor(name))
                elif int4 is not None and int4.takes(full_name):
                    loaded |= int4.part(full_name, f.get_tensor(name))
                else:
                    source = f
                    if name.endswith(_EMBEDDING):  # read through a mapping of its own (_reads_in_place)
                        source = stack.enter_context(safe_open(str(path_of[name]), framework="pt"))
                    tensor = _checkpoint_tensor(model_dir, where, name, source, dtype)
                    if tensor is not None and tensor.dtype == torch.int8:
                        if int8 is None:
                            raise ModelLoadError(f"{model_dir.path}: {name} is int8 but config.json has no "
                                                 "compressed-tensors quantization_config")
                        target = int8.weight(full_name, tensor)
                        if target:
                            loaded.add(target)
                    elif tensor is not None:
                        for view_name, view in hybrid_weights.checkpoint_views(model_dir.config, full_name, tensor):
                            loaded |= _load_tensor_names(model, params, view_name, view)
                bar.update(1)
    missing = _expected_names(model) - loaded
    if model_dir.config.tie_word_embeddings:
        missing.discard("lm_head.weight")
    if missing:
        raise ModelLoadError(f"{model_dir.path}: checkpoint lacks {sorted(missing)[:5]} ({len(missing)} tensors)")
    if int4 is not None:
        return int4.finish(loaded)
    return int8.modules(loaded, model_dir.path) if int8 is not None else {}


class Int8Weights:
    """The int8 weights and per-channel scales of a compressed-tensors checkpoint, gathered by the
    model's (fused) parameter names as full-precision weights are."""

    def __init__(self, model: Qwen3ForCausalLM, params: dict):
        self.model = model
        linears = {f"{name}.weight" for name, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
        self.q = {n: torch.empty(p.shape, dtype=torch.int8) for n, p in params.items() if n in linears}
        self.s = {n: torch.empty(p.shape[0], dtype=torch.float32) for n in self.q for p in [params[n]]}
        self.int8: set[str] = set()
        self.scaled: set[str] = set()

    def weight(self, name: str, tensor: torch.Tensor) -> str | None:
        if _EXPERT.search(name):
            raise ModelLoadError(f"int8 expert weight {name}: int8 experts are not supported (serve the full-precision "
                                 "checkpoint; its attention can run in int8 with --quantization int8)")
        target = _load_tensor(self.model, self.q, name, tensor)
        if target:
            self.int8.add(target)
        return target

    def scale(self, weight_name: str, scale: torch.Tensor) -> None:
        target = _load_tensor(self.model, self.s, weight_name, scale.float().reshape(-1))
        if target:
            self.scaled.add(target)

    def modules(self, loaded: set[str], where) -> dict:
        if self.int8 - self.scaled:
            raise ModelLoadError(f"{where}: int8 weights without a weight_scale: {sorted(self.int8 - self.scaled)[:3]}")
        bases = {t.split("#")[0] for t in self.int8}
        mixed = {t.split("#")[0] for t in loaded - self.int8} & bases
        if mixed:
            raise ModelLoadError(f"{where}: {sorted(mixed)[0]} mixes int8 and full-precision parts")
        return {name.removesuffix(".weight"): (self.q[name], self.s[name]) for name in sorted(bases)}


def _checkpoint_tensor(model_dir: ModelDir, where: dict, name: str, f, dtype: torch.dtype) -> torch.Tensor | None:
    """The tensor `name` as the model holds it; None for a quantization scale (read with its weight)."""
    quant = model_dir.quantization
    if quant is not None and quant.is_scale(name):
        return None
    tensor = f.get_tensor(name)
    if tensor.dtype in FP8_DTYPES:
        if quant is None:
            raise ModelLoadError(f"{model_dir.path}: {name} is fp8 but config.json has no quantization_config")
        scale_name = name + quant.scale_suffix
        scale = where[scale_name].get_tensor(scale_name) if scale_name in where else None
        return quant.dequantize(name, tensor, scale, dtype)
    return tensor


def _load_tensor_names(model, params, name: str, tensor: torch.Tensor) -> set[str]:
    """_load_tensor, as the names _expected_names counts: a stacked experts tensor fills each expert."""
    target = _load_tensor(model, params, name, tensor)
    if target is None:
        return set()
    if target.endswith(_STACKED_EXPERTS):
        stacked = target.rsplit(".", 1)[-1]
        projs = [p for p, (s, _) in _EXPERT_SLICES.items() if s == stacked]
        return {f"{target}#{e}.{p}" for e in range(params[target].shape[0]) for p in projs}
    return {target}


@dataclass(frozen=True)
class Slot:
    """Where a checkpoint tensor's rows go: rows [start, start + size) of parameter `target` (of
    its expert `expert` for stacked experts); `label` is the name _expected_names counts."""

    target: str
    label: str
    expert: int | None
    start: int
    size: int


def locate(model, params, name: str) -> Slot | None:
    """The slot of checkpoint tensor `name` (a weight's name), None for one the model does not hold."""
    if name == "lm_head.weight" and (model.config.tie_word_embeddings or model.lm_head is None):
        return None
    expert = _EXPERT.search(name)
    if expert:
        stacked, half = _EXPERT_SLICES[expert.group(2)]
        target = f"{name[: expert.start()]}.experts.{stacked}"
        if target not in params:
            raise ModelLoadError(f"unexpected tensor {name} in checkpoint (layer {name.split('.')[2]} has no experts)")
        rows = model.config.moe_intermediate_size if stacked == "w13_weight" else params[target].shape[1]
        return Slot(target, f"{target}#{expert.group(1)}.{expert.group(2)}", int(expert.group(1)), half * rows, rows)
    for ckpt_name, (fused, shard) in model.packed_modules.items():
        if f".{ckpt_name}." in name:
            target = name.replace(ckpt_name, fused)
            return Slot(target, f"{target}#{shard}", None, *_shard_rows(model, params[target], shard))
    if name not in params:
        if "rotary_emb" in name:
            return None
        raise ModelLoadError(f"unexpected tensor {name} in checkpoint")
    return Slot(name, name, None, 0, params[name].shape[0] if params[name].dim() else 1)


def _load_tensor(model, params, name: str, tensor: torch.Tensor) -> str | None:
    slot = locate(model, params, name)
    if slot is None:
        return None
    param = params[slot.target].data
    if slot.label == slot.target:  # the whole parameter
        if _reads_in_place(slot.target, param, tensor):
            params[slot.target].data = tensor
        else:
            param.copy_(tensor)
        return slot.label
    if slot.expert is not None:
        param = param[slot.expert]
    param.narrow(0, slot.start, slot.size).copy_(tensor)
    return slot.label


def _reads_in_place(target: str, param: torch.Tensor, tensor: torch.Tensor) -> bool:
    """Whether `tensor`, the token embedding, becomes its parameter as the file holds it, not
    copied: on the CPU, in the checkpoint's dtype. safetensors maps the file copy-on-write, and the
    loader reads the embedding through a mapping of its own, which holds only the embedding's pages
    once the load's mapping is gone: a lookup reads a token's row from the page cache, so an untied
    model never holds its embedding in its own memory (1.2 GB for Qwen3-8B in bf16) and a tied one
    holds only its head's packed copy. As with llama.cpp's mmap, a served checkpoint file must not
    be truncated in place (one replaced by a new file, as downloads and converters write them, is
    safe)."""
    return (target.endswith(_EMBEDDING) and param.device.type == "cpu" and tensor.device.type == "cpu"
            and tensor.dtype == param.dtype and tensor.shape == param.shape and tensor.is_contiguous())


def _shard_rows(model, param: torch.Tensor, shard) -> tuple[int, int]:
    """(first row, rows) of shard `shard` of a fused parameter."""
    cfg = model.config
    if shard in ("q", "k", "v", "gate"):
        q, kv = cfg.num_attention_heads * cfg.head_dim, cfg.num_key_value_heads * cfg.head_dim
        start, size = {"q": (0, q), "k": (q, kv), "v": (q + kv, kv), "gate": (q + 2 * kv, q)}[shard]
    elif shard in ("qkv", "z", "b", "a"):
        s = cfg.linear
        sizes = {"qkv": s.conv_dim, "z": s.value_dim, "b": s.num_value_heads, "a": s.num_value_heads}
        order = list(sizes)
        start, size = sum(sizes[x] for x in order[: order.index(shard)]), sizes[shard]
    else:  # gate_proj, up_proj: halves of gate_up_proj (a dense MLP's or a shared expert's)
        size = param.shape[0] // 2
        start = shard * size
    return start, size


def has_mtp_weights(model_dir: ModelDir) -> bool:
    """Whether the checkpoint holds a multi-token-prediction layer (`mtp.*` tensors, and a config
    that counts them), read from the files' headers."""
    return bool(model_dir.config.mtp_num_hidden_layers) and _holds_tensors(model_dir.path, "mtp.")


def _holds_tensors(root: Path, prefix: str) -> bool:
    """Whether any weight file under root holds a tensor named prefix..., from the files' headers."""
    for file in _weight_files(root):
        with safe_open(str(file), framework="pt") as f:
            if any(name.startswith(prefix) for name in f.keys()):
                return True
    return False


def _expected_names(model: Qwen3ForCausalLM) -> set[str]:
    shards: dict[str, list] = {}
    for fused, shard in model.packed_modules.values():
        if shard != "gate" or model.config.attn_output_gate:
            shards.setdefault(fused, []).append(shard)
    expected = set()
    for name, param in model.named_parameters(remove_duplicate=False):
        stacked = name.rsplit(".", 1)[-1]
        if name.endswith((".experts.w13_weight", ".experts.w2_weight")):
            projs = [p for p, (s, _) in _EXPERT_SLICES.items() if s == stacked]
            expected |= {f"{name}#{e}.{p}" for e in range(param.shape[0]) for p in projs}
            continue
        fused = next((f for f in shards if f".{f}." in name), None)
        expected |= {f"{name}#{s}" for s in shards[fused]} if fused else {name}
    return expected


def _weight_files(root: Path) -> list[Path]:
    index = root / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return [root / f for f in sorted(set(weight_map.values()))]
    return sorted(root.glob("*.safetensors"))


def _eos_token_ids(generation: dict, hf_config: dict) -> tuple[int, ...]:
    ids: list[int] = []
    # a vision-language config keeps its text model's under text_config
    for source in (generation, hf_config, hf_config.get("text_config") or {}):
        eos = source.get("eos_token_id")
        for token_id in eos if isinstance(eos, list) else [eos] if eos is not None else []:
            if token_id not in ids:
                ids.append(int(token_id))
    return tuple(ids)
