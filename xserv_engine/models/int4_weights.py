"""The 4-bit weights of an AWQ, GPTQ or compressed-tensors W4A16 checkpoint, gathered by the
model's (fused) parameters as full-precision weights are.

A module's tensors (qweight, qzeros, scales, ...) are held until it has all of them, then become
one Int4Weight (models/int4_formats.py) and its rows are copied into the 4-bit stack of the
parameter they belong to (q, k and v into qkv_proj's; each expert into its layer's stacked
experts), so the checkpoint's packed tensors are in memory one module at a time. A parameter whose
parts cannot share one stack (some in full precision, as a checkpoint's `ignore` list can make
them, or different group sizes or act-order permutations) is served in full precision instead:
its 4-bit parts dequantized exactly into it.
"""

import logging
from collections.abc import Callable, Iterable

import torch

from xserv_engine.errors import ModelLoadError
from xserv_engine.layers.int4 import Int4Weight, dequantize
from xserv_engine.models import hybrid_weights
from xserv_engine.models.int4_formats import Int4Checkpoint

log = logging.getLogger(__name__)
_EXPERT_STACKS = (".w13_weight", ".w2_weight")


class Int4Weights:
    def __init__(self, quant: Int4Checkpoint, model, params: dict, locate: Callable, names: Iterable[str]):
        """names: every tensor name in the checkpoint (as the loader names them); locate(name) ->
        the loader's Slot for a weight name, or None."""
        self.quant, self.model, self.params, self.locate = quant, model, params, locate
        self.expected: dict[str, set[str]] = {}  # module -> the parts the checkpoint has for it
        for name in names:
            module = quant.module_of(name)
            if module is not None:
                self.expected.setdefault(module, set()).add(name.rpartition(".")[2])
        self.pending: dict[str, dict[str, torch.Tensor]] = {}
        self.stacks: dict[str, Int4Weight] = {}  # parameter name -> its 4-bit rows
        self.slots: dict[str, list] = {}  # parameter name -> the slots filled in its stack
        self.dense: set[str] = set()  # parameters served in full precision, 4-bit parts dequantized

    def takes(self, name: str) -> bool:
        return self.quant.module_of(name) is not None

    def part(self, name: str, tensor: torch.Tensor) -> set[str]:
        """Hold one part of a 4-bit module; once it has all, place its weight. Returns the labels
        (as _expected_names counts them) placed."""
        module, _, part = name.rpartition(".")
        parts = self.pending.setdefault(module, {})
        parts[part] = tensor
        if set(parts) != self.expected[module]:
            return set()
        weight = self.quant.weight(module, self.pending.pop(module))
        return {label for view_name, view in _views(self.model.config, module, weight)
                for label in [self._place(view_name, view)] if label}

    def finish(self, loaded: set[str]) -> dict:
        """{module name: Int4Weight} of the 4-bit linears and {experts module name: (w13, w2)} of
        the 4-bit MoE experts, after every tensor was read (`loaded`: every label filled)."""
        if self.pending:
            module, parts = next(iter(self.pending.items()))
            raise ModelLoadError(f"{module}: 4-bit weight has only {sorted(parts)} of {sorted(self.expected[module])}")
        in_4_bits = {slot.label for slots in self.slots.values() for slot in slots}
        full_precision = {label.split("#")[0] for label in loaded - in_4_bits}
        for target in [t for t in self.stacks if t in full_precision]:
            self._make_dense(target, "mixes 4-bit and full-precision parts")
        for target in [t for t in self.stacks if t.endswith(_EXPERT_STACKS)]:
            base = target.rsplit(".", 1)[0]
            if not all(base + s in self.stacks for s in _EXPERT_STACKS):
                self._make_dense(target, "has 4-bit experts in one projection only")
        prequantized: dict = {t.removesuffix(".weight"): w for t, w in self.stacks.items()
                              if not t.endswith(_EXPERT_STACKS)}
        for target in self.stacks:
            if target.endswith(_EXPERT_STACKS[0]):
                base = target.removesuffix(_EXPERT_STACKS[0])
                prequantized[base] = (self.stacks[target], self.stacks[base + _EXPERT_STACKS[1]])
        return prequantized

    def _place(self, name: str, weight: Int4Weight) -> str | None:
        slot = self.locate(name)
        if slot is None:
            return None
        param = self.params[slot.target]
        if weight.shape != (slot.size, param.shape[-1]):
            raise ModelLoadError(f"{name}: a 4-bit weight of shape {weight.shape}, the model's is "
                                 f"{(slot.size, param.shape[-1])}")
        if slot.expert is not None and weight.perm is not None:
            raise ModelLoadError(f"{name}: act-order (desc_act) experts are not supported")
        stack = self.stacks.get(slot.target)
        if stack is None and slot.target not in self.dense:
            stack = self.stacks[slot.target] = _empty_stack(param, weight)
        elif stack is not None and not _compatible(stack, weight):
            self._make_dense(slot.target, "has parts of different group sizes or act-order permutations")
        if slot.target in self.dense:
            self._dequantize_into(slot, weight)
        else:
            for buffer, rows in zip(_parts(stack), _parts(weight)):
                (buffer if slot.expert is None else buffer[slot.expert]).narrow(0, slot.start, slot.size).copy_(rows)
            self.slots.setdefault(slot.target, []).append(slot)
        return slot.label

    def _make_dense(self, target: str, why: str) -> None:
        log.info("%s %s: served in full precision, its 4-bit parts dequantized", target, why)
        stack = self.stacks.pop(target)
        self.dense.add(target)
        for slot in self.slots.pop(target, []):
            rows = [(p if slot.expert is None else p[slot.expert]).narrow(0, slot.start, slot.size)
                    for p in _parts(stack)]
            self._dequantize_into(slot, Int4Weight(*rows, stack.group_size, stack.perm))

    def _dequantize_into(self, slot, weight: Int4Weight) -> None:
        param = self.params[slot.target].data
        rows = (param if slot.expert is None else param[slot.expert]).narrow(0, slot.start, slot.size)
        w = dequantize(weight, param.dtype)
        if weight.perm is None:
            rows.copy_(w)
        else:
            rows[:, weight.perm] = w


def _views(cfg, module: str, weight: Int4Weight) -> list[tuple[str, Int4Weight]]:
    """The weight as the model's rows (a hybrid checkpoint's q_proj split into q and its gate, ...):
    each part takes the views a full-precision weight would, row for row."""
    views = [hybrid_weights.checkpoint_views(cfg, module + ".weight", part) for part in _parts(weight)]
    return [(name, Int4Weight(q, s, z, weight.group_size, weight.perm))
            for (name, q), (_, s), (_, z) in zip(*views)]


def _parts(weight: Int4Weight) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    return weight.qweight, weight.scales, weight.zeros


def _empty_stack(param: torch.Tensor, weight: Int4Weight) -> Int4Weight:
    """4-bit buffers for every row of `param` ([N, K] or experts' [E, N, K])."""
    lead, k = param.shape[:-1], param.shape[-1]
    groups = k // weight.group_size
    return Int4Weight(torch.empty(*lead, k // 2, dtype=torch.uint8), torch.empty(*lead, groups, dtype=torch.float32),
                      torch.empty(*lead, groups, dtype=torch.uint8), weight.group_size, weight.perm)


def _compatible(stack: Int4Weight, weight: Int4Weight) -> bool:
    if stack.group_size != weight.group_size or (stack.perm is None) != (weight.perm is None):
        return False
    return stack.perm is None or torch.equal(stack.perm, weight.perm)
