"""Logits -> next tokens: penalties, biases, min_tokens, greedy or sampled, and logprobs.

Rows are processed batched; per-row Python work happens only for rows that ask for a feature
that needs it (penalties, bias, a seed), so a plain batch costs a few batched ops.
"""

from dataclasses import dataclass

import torch

from xserv_engine.engine.sequence import Sequence
from xserv_engine.structured.bitmask import Candidates
from xserv_engine.structured.manager import masked_rows


@dataclass
class SampleLogprobs:
    logprob: float
    top_ids: list[int]
    top_logprobs: list[float]


@dataclass
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[SampleLogprobs | None]


class Sampler:
    def __init__(self, eos_token_ids: tuple[int, ...]):
        self.eos_token_ids = list(eos_token_ids)

    @torch.inference_mode()
    def __call__(self, logits: torch.Tensor, seqs: list[Sequence]) -> SamplerOutput:
        guided = masked_rows(seqs)
        if not guided and all(_plain_greedy(s.params) for s in seqs):
            return SamplerOutput(argmax(logits).tolist(), [None] * len(seqs))  # no float32 copy
        logits = logits.float()  # [B, V]
        candidates = None
        if guided:  # grammar masks first: penalties, temperature and top-k/p/min-p see allowed tokens only
            candidates = seqs[guided[0]].guide.owner.apply(
                logits, guided, [seqs[i].guide for i in guided], narrowable=[not seqs[i].params.logprobs for i in guided])
        # rows in candidates stay unmasked: each penalty and bias maps -inf to -inf, so applying
        # them before or after the mask is the same, and _choose draws among the allowed ids only
        for i, seq in enumerate(seqs):
            self._adjust_row(logits[i], seq)
        logprobs = self._logprobs(logits, seqs)
        token_ids = self._choose(logits, seqs, candidates)
        chosen = token_ids.tolist()  # the step's one host sync
        return SamplerOutput(chosen, [self._pick_logprob(lp, t) for lp, t in zip(logprobs, chosen)])

    def _adjust_row(self, row: torch.Tensor, seq: Sequence) -> None:
        p = seq.params
        if p.logit_bias:
            ids = torch.tensor(list(p.logit_bias.keys()), device=row.device)
            row[ids] += torch.tensor(list(p.logit_bias.values()), device=row.device)
        if p.repetition_penalty != 1.0:
            ids = torch.tensor(sorted(set(seq.token_ids)), device=row.device)
            values = row[ids]
            row[ids] = torch.where(values > 0, values / p.repetition_penalty, values * p.repetition_penalty)
        if (p.presence_penalty or p.frequency_penalty) and seq.num_completion_tokens:
            counts = torch.bincount(torch.tensor(seq.completion_token_ids, device=row.device), minlength=row.numel())
            row -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0)
        if seq.num_completion_tokens < p.min_tokens:
            row[self.eos_token_ids + list(p.stop_token_ids)] = float("-inf")

    def _logprobs(self, logits: torch.Tensor, seqs: list[Sequence]) -> list:
        rows = [i for i, s in enumerate(seqs) if s.params.logprobs]
        out: list = [None] * len(seqs)
        if not rows:
            return out
        lp = torch.log_softmax(logits[rows], dim=-1)
        for j, i in enumerate(rows):
            k = seqs[i].params.top_logprobs
            top = lp[j].topk(k) if k else None
            out[i] = (lp[j], top)
        return out

    @staticmethod
    def _pick_logprob(entry, token_id: int) -> SampleLogprobs | None:
        if entry is None:
            return None
        row, top = entry
        if top is None:
            return SampleLogprobs(row[token_id].item(), [], [])
        return SampleLogprobs(row[token_id].item(), top.indices.tolist(), top.values.tolist())

    def _choose(self, logits: torch.Tensor, seqs: list[Sequence], candidates: Candidates | None) -> torch.Tensor:
        if candidates is None:
            return self._choose_rows(logits, seqs)
        token_ids = torch.empty(len(seqs), dtype=torch.long, device=logits.device)
        narrowed = set(candidates.rows)
        full = [i for i in range(len(seqs)) if i not in narrowed]
        if full:
            token_ids[full] = self._choose_rows(logits[full], [seqs[i] for i in full])
        picked = self._choose_rows(candidates.narrow(logits), [seqs[i] for i in candidates.rows])  # [R] into ids
        token_ids[candidates.rows] = candidates.ids.gather(1, picked[:, None]).squeeze(1)
        return token_ids

    def _choose_rows(self, logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        greedy = [i for i, s in enumerate(seqs) if s.params.greedy]
        if len(greedy) == len(seqs):
            return argmax(logits)
        rows = [i for i, s in enumerate(seqs) if not s.params.greedy]
        if not greedy:
            return self._sample(logits, seqs)  # no copy of the rows
        token_ids = torch.empty(len(seqs), dtype=torch.long, device=logits.device)
        token_ids[rows] = self._sample(logits[rows], [seqs[i] for i in rows])
        token_ids[greedy] = argmax(logits[greedy])
        return token_ids

    def _sample(self, logits: torch.Tensor, seqs: list[Sequence]) -> torch.Tensor:
        device = logits.device
        temperatures = [s.params.temperature for s in seqs]
        if any(t != 1.0 for t in temperatures):
            logits = logits / torch.tensor(temperatures, device=device)[:, None]
        top_k = [s.params.top_k if s.params.top_k > 0 else 0 for s in seqs]
        if any(top_k):
            logits = _apply_top_k(logits, top_k)
        probs = torch.softmax(logits, dim=-1)
        min_p = torch.tensor([s.params.min_p for s in seqs], device=device)
        if bool((min_p > 0).any()):
            probs = probs.masked_fill(probs < min_p[:, None] * probs.max(dim=-1, keepdim=True).values, 0.0)
        top_p = torch.tensor([s.params.top_p for s in seqs], device=device)
        if bool((top_p < 1).any()):
            probs = _apply_top_p(probs, top_p)
        # Inverse CDF: one uniform number per row and a binary search, much cheaper on the CPU
        # than torch.multinomial or an exponential race over the vocabulary. A seeded row
        # draws from its own generator, so it is reproducible whatever else is in the batch.
        cdf = probs.cumsum(dim=-1)  # [B, V]; masked tokens add nothing, so they are never hit
        u = torch.rand(len(seqs), 1, device=device)
        for i, seq in enumerate(seqs):
            if seq.generator is not None:
                u[i] = torch.rand(1, generator=seq.generator).item()
        chosen = torch.searchsorted(cdf, u * cdf[:, -1:], right=True).squeeze(1)
        return chosen.clamp_(max=probs.shape[1] - 1)


TOP_P_CANDIDATES = 4096
ARGMAX_CHUNK = 1024


def argmax(logits: torch.Tensor) -> torch.Tensor:
    """Row-wise argmax of [B, V] logits, the first maximum on ties (as torch.argmax).

    Two passes: the max of every chunk of ARGMAX_CHUNK columns, then the argmax inside each row's
    best chunk. On the CPU, torch's argmax/max(dim) over a bf16 vocabulary-wide row is slow (a
    scalar index-tracking loop); amax is vectorised (docs/benchmarks.md has the timings; on a GPU
    the two are even).
    """
    b, v = logits.shape
    c = ARGMAX_CHUNK
    if v <= 2 * c:
        return logits.argmax(dim=-1)
    full = v - v % c
    chunk_max = logits[:, :full].view(b, -1, c).amax(dim=-1)  # [B, V // c]
    if full < v:  # the ragged tail is one more (shorter) chunk
        chunk_max = torch.cat([chunk_max, logits[:, full:].amax(dim=-1, keepdim=True)], dim=1)
    best = chunk_max.float().argmax(dim=-1)  # first chunk holding the row's max
    cols = (best[:, None] * c + torch.arange(c, device=logits.device)).clamp_(max=v - 1)
    # clamping repeats the last column after the real ones, so the first maximum is unchanged
    return best * c + logits.gather(1, cols).float().argmax(dim=-1)


def _plain_greedy(p) -> bool:
    return (p.greedy and not p.logprobs and not p.logit_bias and p.min_tokens == 0
            and p.repetition_penalty == 1.0 and not p.presence_penalty and not p.frequency_penalty)


def _apply_top_k(logits: torch.Tensor, top_k: list[int]) -> torch.Tensor:
    vocab = logits.shape[-1]
    k = torch.tensor([t if t else vocab for t in top_k], device=logits.device).clamp(max=vocab)
    kth = logits.topk(int(k.max()), dim=-1).values.gather(1, (k - 1)[:, None])  # [B, 1]
    return logits.masked_fill(logits < kth, float("-inf"))


def _apply_top_p(probs: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    # A full sort of the vocabulary is slow on the CPU; the nucleus of a trained model is
    # almost always inside its top few thousand tokens, so look there first.
    k = min(TOP_P_CANDIDATES, probs.shape[1])
    top_probs, top_ids = probs.topk(k, dim=-1)  # sorted, descending
    if bool((top_probs.sum(dim=-1) >= top_p).all()):
        mass_before = top_probs.cumsum(dim=-1) - top_probs
        top_probs = top_probs.masked_fill(mass_before > top_p[:, None], 0.0)
        return torch.zeros_like(probs).scatter_(1, top_ids, top_probs)
    sorted_probs, order = probs.sort(dim=-1, descending=True)
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
    sorted_probs = sorted_probs.masked_fill(mass_before > top_p[:, None], 0.0)
    return torch.zeros_like(probs).scatter_(1, order, sorted_probs)
