"""Logits -> next tokens: penalties, biases, min_tokens, greedy or sampled, and logprobs.

Rows are processed batched; per-row Python work happens only for rows that ask for a feature
that needs it (penalties, bias, a seed), so a plain batch costs a few batched ops.
"""

from dataclasses import dataclass, field
from typing import Callable

import torch

from xserv_engine.engine.sequence import Sequence
from xserv_engine.layers import ops
from xserv_engine.structured.bitmask import Candidates
from xserv_engine.structured.manager import TOP_K_CHECKS, masked_rows, take_mask_first


@dataclass
class SampleLogprobs:
    logprob: float
    top_ids: list[int]
    top_logprobs: list[float]


@dataclass
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[SampleLogprobs | None]
    # seq_id -> (index of the first prompt token covered, the logprobs of the prompt tokens that
    # this step's chunk of that prompt predicts), for sequences that asked for prompt logprobs
    prompt_logprobs: dict[int, tuple[int, list[SampleLogprobs]]] = field(default_factory=dict)
    # seq_id -> the pooled vector [dimensions] of each embedding request whose prompt this step ended
    embeddings: dict[int, torch.Tensor] = field(default_factory=dict)
    # seq_id -> the tokens after token_ids' one, with their logprobs, of each sequence whose drafts
    # this step verified: the drafts that stood past the first, then the target's own (empty when
    # only the first position's token came out; engine/speculative.py)
    spec_tokens: dict[int, list[tuple[int, SampleLogprobs | None]]] = field(default_factory=dict)


class Sampler:
    def __init__(self, eos_token_ids: tuple[int, ...]):
        self.eos_token_ids = list(eos_token_ids)

    @torch.inference_mode()
    def __call__(self, logits: torch.Tensor, seqs: list[Sequence]) -> SamplerOutput:
        guided = masked_rows(seqs)
        if not guided and all(_plain_greedy(s) for s in seqs):
            return SamplerOutput(argmax(logits).tolist(), [None] * len(seqs))  # no float32 copy
        logits = logits.float()  # [B, V]
        candidates = None
        first = [take_mask_first(seqs[i]) for i in guided]
        masked = [i for i, m in zip(guided, first) if m]
        unmasked = [i for i, m in zip(guided, first) if not m]  # the manager's doc
        top_k = [i for i in unmasked if seqs[i].params.top_k > 0 and not seqs[i].params.greedy]
        drawn_first = sorted(set(unmasked) - set(top_k))  # masked only if refused
        if masked:  # grammar masks first: penalties, temperature and top-k/p/min-p see allowed tokens only
            candidates = seqs[masked[0]].guide.owner.apply(
                logits, masked, [seqs[i].guide for i in masked], narrowable=[not seqs[i].params.logprobs for i in masked])
        # rows in candidates stay unmasked: each penalty and bias maps -inf to -inf, so applying
        # them before or after the mask is the same, and _choose draws among the allowed ids only
        self.adjust(logits, seqs)
        if top_k:
            candidates = Candidates.join([candidates, self._allowed_top_k(logits, seqs, top_k)])
        logprobs = self._logprobs(logits, seqs)
        token_ids = self._choose(logits, seqs, candidates, keep=bool(drawn_first))
        chosen = token_ids.tolist()  # the step's one host sync (two when a drawn-first row is refused)
        if drawn_first:
            self._draw_refused_again(logits, seqs, drawn_first, chosen)
        return SamplerOutput(chosen, [self.pick_logprob(lp, t) for lp, t in zip(logprobs, chosen)])

    def _allowed_top_k(self, logits: torch.Tensor, seqs: list, rows: list[int]) -> Candidates | None:
        """Candidates of constrained top-k rows, found without a mask where possible: a row's
        likeliest tokens, checked in order until k of them are allowed, are the k best allowed
        tokens, so the masked row's top-k exactly (up to exact ties of the k-th logit), and its
        min-p and top-p then see the same k. A row whose TOP_K_CHECKS likeliest hold fewer than k
        allowed tokens is masked (in place, or narrowed among the Candidates)."""
        guides = [seqs[i].guide for i in rows]
        owner = guides[0].owner
        ks = [min(seqs[i].params.top_k, logits.shape[1]) for i in rows]
        checks = min(logits.shape[1], TOP_K_CHECKS)  # mask_first took rows of a larger k
        ranked = logits[rows].topk(checks, dim=-1).indices.tolist()
        found = owner.allowed_in_order(guides, ranked, ks)
        failed = [j for j, ids in enumerate(found) if ids is None]
        parts = []
        kept = [j for j, ids in enumerate(found) if ids is not None]
        if kept:
            ids = torch.zeros(len(kept), max(ks[j] for j in kept), dtype=torch.long)
            valid = torch.zeros(ids.shape, dtype=torch.bool)
            for r, j in enumerate(kept):
                ids[r, : len(found[j])] = torch.tensor(sorted(found[j]))  # ascending, as a mask's candidates
                valid[r, : len(found[j])] = True
            parts.append(Candidates([rows[j] for j in kept], ids.to(logits.device), valid.to(logits.device)))
        if failed:
            parts.append(owner.apply(logits, [rows[j] for j in failed], [guides[j] for j in failed],
                                     narrowable=[True] * len(failed)))
        return Candidates.join(parts)

    def _draw_refused_again(self, logits: torch.Tensor, seqs: list, rows: list[int], chosen: list[int]) -> None:
        """Rows drawn before their mask whose token the grammar refuses. A sampled one draws
        REDRAWS more from the same distribution and takes the first its grammar allows (rejection
        sampling, so still the masked distribution exactly); one that draws none, or a greedy
        one, is masked and drawn again from its adjusted logits (which the first draw left as
        they were). Into chosen."""
        guides = [seqs[i].guide for i in rows]
        owner = guides[0].owner
        refused = [rows[j] for j in owner.refused(guides, [chosen[i] for i in rows])]
        if not refused:
            return
        draws: dict[int, list[int]] = {}
        sampled = [i for i in refused if not seqs[i].params.greedy]
        if sampled:
            batch = [_Redraw(seqs[i], stream=1) for i in sampled]
            weights, _ = self._weights(logits[sampled], batch)  # a copy; drawn-first rows have no top-k
            draws = dict(zip(sampled, inverse_cdf(weights, uniforms(batch, logits.device, per_row=REDRAWS)).tolist()))
        taken = owner.first_allowed([seqs[i].guide for i in refused], [draws.get(i, []) for i in refused])
        masked = []
        for i, token_id in zip(refused, taken):
            if token_id is None:
                masked.append(i)
            else:
                chosen[i] = token_id
        if not masked:
            return
        again = logits[masked]  # a copy of the rows
        candidates = owner.apply(again, list(range(len(masked))), [seqs[i].guide for i in masked],
                                 narrowable=[True] * len(masked))
        redraws = [_Redraw(seqs[i], stream=2) for i in masked]
        for i, token_id in zip(masked, self._choose(again, redraws, candidates).tolist()):
            chosen[i] = token_id

    def adjust(self, logits: torch.Tensor, seqs: list[Sequence]) -> None:
        """Penalties, bias and min_tokens, in place on float32 logits [B, V]."""
        for i, seq in enumerate(seqs):
            if not _unadjusted(seq):
                self._adjust_row(logits[i], seq)

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
            ids, counts = torch.unique(torch.tensor(seq.completion_token_ids, device=row.device), return_counts=True)
            row[ids] -= p.frequency_penalty * counts + p.presence_penalty
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
    def pick_logprob(entry, token_id: int) -> SampleLogprobs | None:
        if entry is None:
            return None
        row, top = entry
        if top is None:
            return SampleLogprobs(row[token_id].item(), [], [])
        return SampleLogprobs(row[token_id].item(), top.indices.tolist(), top.values.tolist())

    def _choose(self, logits: torch.Tensor, seqs: list[Sequence], candidates: Candidates | None,
                keep: bool = False) -> torch.Tensor:
        """One token per row. keep: leave logits as they are (else sampling works in place on them)."""
        if candidates is None:
            return self._choose_rows(logits, seqs, keep)
        token_ids = torch.empty(len(seqs), dtype=torch.long, device=logits.device)
        narrowed = set(candidates.rows)
        full = [i for i in range(len(seqs)) if i not in narrowed]
        if full:
            token_ids[full] = self._choose_rows(logits[full], [seqs[i] for i in full])
        picked = self._choose_rows(candidates.narrow(logits), [seqs[i] for i in candidates.rows])  # [R] into ids
        token_ids[candidates.rows] = candidates.ids.gather(1, picked[:, None]).squeeze(1)
        return token_ids

    def _choose_rows(self, logits: torch.Tensor, seqs: list[Sequence], keep: bool = False) -> torch.Tensor:
        greedy = [i for i, s in enumerate(seqs) if s.params.greedy]
        if len(greedy) == len(seqs):
            return argmax(logits)
        groups = _by_top_k(seqs, [i for i, s in enumerate(seqs) if not s.params.greedy])
        if not greedy and len(groups) == 1:
            return self._sample(logits, seqs, keep)  # no copy of the rows
        token_ids = torch.empty(len(seqs), dtype=torch.long, device=logits.device)
        for group in groups:
            token_ids[group] = self._sample(logits[group], [seqs[i] for i in group])
        if greedy:
            token_ids[greedy] = argmax(logits[greedy])
        return token_ids

    def _sample(self, logits: torch.Tensor, seqs: list[Sequence], keep: bool = False) -> torch.Tensor:
        """One draw per row from softmax(logits / temperature), after top-k, min-p and top-p.
        Works in place on logits (a float32 tensor no one reads after sampling) unless keep."""
        weights, ids = self._weights(logits, seqs, keep)
        chosen = inverse_cdf(weights, uniforms(seqs, logits.device))
        return chosen if ids is None else ids.gather(1, chosen[:, None]).squeeze(1)

    @torch.inference_mode()
    def distribution(self, logits: torch.Tensor, seqs: list, logprobs: bool = True) -> tuple[torch.Tensor, list]:
        """What a sampled row (without a grammar) draws from: each row's probabilities over the
        vocabulary [B, V] after penalties, bias, min_tokens, temperature, top-k, min-p and
        top-p, as _sample draws them; and, if asked, the rows' logprob entries as __call__
        reports them (pick one with pick_logprob). Speculative decoding's rejection sampling
        compares two of these."""
        logits = logits.to(torch.float32, copy=True)
        self.adjust(logits, seqs)
        entries = self._logprobs(logits, seqs) if logprobs else [None] * len(seqs)
        groups = _by_top_k(seqs, range(len(seqs)))
        if len(groups) == 1:
            return self._probabilities(logits, seqs), entries  # no copy of the rows
        probs = torch.empty_like(logits)
        for group in groups:
            probs[group] = self._probabilities(logits[group], [seqs[i] for i in group])
        return probs, entries

    def _probabilities(self, logits: torch.Tensor, seqs: list) -> torch.Tensor:
        weights, ids = self._weights(logits, seqs)
        probs = weights.div_(weights.sum(dim=-1, keepdim=True))
        if ids is not None:  # top-k rows: k columns, back into the vocabulary
            probs = torch.zeros(len(seqs), logits.shape[1], device=logits.device).scatter_(1, ids, probs)
        return probs

    def _weights(self, logits: torch.Tensor, seqs: list[Sequence],
                 keep: bool = False) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Unnormalised probabilities of each row after temperature, top-k, min-p and top-p,
        in place on float32 logits (in a new tensor if keep); with a top-k, over each row's k
        candidates, whose vocabulary ids come second ([B, k]), else None."""
        device = logits.device
        temperatures = [s.params.temperature for s in seqs]
        if any(t != 1.0 for t in temperatures):
            scale = torch.tensor(temperatures, device=device)[:, None]
            logits, keep = (logits.div(scale) if keep else logits.div_(scale)), False
        ids = None  # with a top-k: [B, k] vocabulary ids of the columns of logits
        if any(s.params.top_k > 0 for s in seqs):  # _choose_rows sends rows with a top-k together
            vocab = logits.shape[1]
            top_k = [min(s.params.top_k, vocab) if s.params.top_k > 0 else vocab for s in seqs]
            logits, ids = _top_k_candidates(logits, top_k)  # what follows reads k columns, not V
            keep = False  # new tensors
        # unnormalised probabilities, the row's most likely token at exactly 1: no softmax pass
        top = row_max(logits)[:, None]
        weights = (logits.sub(top) if keep else logits.sub_(top)).exp_()
        min_p = [s.params.min_p for s in seqs]
        if any(min_p):  # relative to the row's top probability, which is 1 here
            weights.masked_fill_(weights < torch.tensor(min_p, device=device)[:, None], 0.0)
        top_p = [s.params.top_p for s in seqs]
        if any(p < 1 for p in top_p):
            probs = weights.div_(weights.sum(dim=-1, keepdim=True))
            weights = _apply_top_p(probs, torch.tensor(top_p, device=device))
        return weights, ids


class _Redraw:
    """A refused drawn-first row as a further draw sees it: its parameters, seed and position,
    and a stream of seeded_uniforms other than its first draw's (whose numbers are known to
    have picked a refused token) and than any earlier redraw's."""
    __slots__ = ("params", "seed", "num_completion_tokens", "stream")

    def __init__(self, seq, stream: int):
        self.params, self.seed, self.num_completion_tokens = seq.params, seq.seed, seq.num_completion_tokens
        self.stream = stream


def _by_top_k(seqs: list, rows) -> list[list[int]]:
    """rows (indices into seqs) in groups to sample apart: those with a top-k, then those
    without. A step whose every row has a top-k works on k columns instead of the vocabulary, so
    one client's top-k rows do not pay for another's full rows. Empty groups left out."""
    top_k = [i for i in rows if seqs[i].params.top_k > 0]
    return [g for g in (top_k, [i for i in rows if seqs[i].params.top_k <= 0]) if g]


def uniforms(seqs: list, device, per_row: int = 0) -> torch.Tensor:
    """One uniform number per row [B], or per_row of them [B, per_row]. A seeded row's are a
    function of its seed and position (`seeded_uniforms`): the same whatever else is in the
    batch, and whether its tokens come one a step or several (speculative decoding)."""
    u = torch.rand(len(seqs), *((per_row,) if per_row else ()), device=device)
    for i, seq in enumerate(seqs):
        if seq.seed is not None:
            drawn = seeded_uniforms(seq.seed, seq.num_completion_tokens, max(per_row, 1), getattr(seq, "stream", 0))
            u[i] = drawn.to(device).view(u[i].shape)
    return u


def seeded_uniforms(seed: int, position: int, count: int = 1, stream: int = 0) -> torch.Tensor:
    """count uniform numbers [count] of a seeded row's completion token `position`: a fresh
    generator seeded by a mix of the three (splitmix64's finaliser), so that neighbouring seeds
    and positions draw unrelated numbers."""
    x = (seed * 0x9E3779B97F4A7C15 + position * 0xBF58476D1CE4E5B9 + stream * 0x94D049BB133111EB) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return torch.rand(count, generator=torch.Generator().manual_seed(x ^ (x >> 31)))


_MASK64 = 2**64 - 1
# more draws of a sampled constrained row whose first draw its grammar refused, before it is
# masked: each costs a chunked search of the row and a check (a few us), a mask up to ~1 ms
REDRAWS = 8
PROMPT_LOGPROB_ROWS = 256  # prompt positions per LM-head call: [256, V] float32 is ~150 MB for Qwen3
TOP_P_CANDIDATES = 4096
TOP_P_FLOOR_CANDIDATES = 1024  # per row on average, for _nucleus_by_floor
ARGMAX_CHUNK = 1024
CDF_CHUNK = 1024


def prompt_logprobs(lm_head: Callable[[torch.Tensor], torch.Tensor], hidden: torch.Tensor, targets: list[int],
                    top: int) -> list[SampleLogprobs]:
    """The raw logprob of targets[i] under the logits of hidden[i] ([len(targets), H]), with the
    `top` likeliest tokens: a prompt token given the tokens before it."""
    out: list[SampleLogprobs] = []
    for i in range(0, len(targets), PROMPT_LOGPROB_ROWS):
        lp = torch.log_softmax(lm_head(hidden[i : i + PROMPT_LOGPROB_ROWS]).float(), dim=-1)  # [R, V]
        ids = torch.tensor(targets[i : i + PROMPT_LOGPROB_ROWS], device=lp.device)
        chosen = lp.gather(1, ids[:, None])[:, 0].tolist()
        if top:
            best = lp.topk(top)
            out.extend(SampleLogprobs(c, t, v) for c, t, v in zip(chosen, best.indices.tolist(), best.values.tolist()))
        else:
            out.extend(SampleLogprobs(c, [], []) for c in chosen)
    return out


def argmax(logits: torch.Tensor) -> torch.Tensor:
    """Row-wise argmax of [B, V] logits, the first maximum on ties (as torch.argmax).

    With the native CPU ops, one op (argmax_rows: one pass a row). Otherwise two passes: the max
    of every chunk of ARGMAX_CHUNK columns, then the argmax inside each row's best chunk. On the
    CPU, torch's argmax/max(dim) over a bf16 vocabulary-wide row is slow (a scalar index-tracking
    loop); amax is vectorised (docs/benchmarks-log.md has the timings; on a GPU the two are even).
    """
    if ops.native(logits) and logits.dtype in (torch.bfloat16, torch.float32) and logits.stride(-1) == 1:
        return torch.ops.xserv_cpu.argmax_rows(logits)
    b, v = logits.shape
    c = ARGMAX_CHUNK
    if v <= 2 * c:
        return logits.argmax(dim=-1)
    best = _chunk_max(logits).float().argmax(dim=-1)  # first chunk holding the row's max
    cols = (best[:, None] * c + torch.arange(c, device=logits.device)).clamp_(max=v - 1)
    # clamping repeats the last column after the real ones, so the first maximum is unchanged
    return best * c + logits.gather(1, cols).float().argmax(dim=-1)


def row_max(logits: torch.Tensor) -> torch.Tensor:
    """Row-wise max of [B, V] logits, through the same vectorised chunked amax as argmax."""
    if logits.shape[1] <= 2 * ARGMAX_CHUNK:
        return logits.amax(dim=-1)
    return _chunk_max(logits).amax(dim=-1)


def _chunk_max(logits: torch.Tensor) -> torch.Tensor:
    """[B, V] -> [B, ceil(V / ARGMAX_CHUNK)]: the max of each chunk of columns (amax is
    vectorised on the CPU, argmax/max(dim) over a bf16 row is not)."""
    b, v = logits.shape
    c = ARGMAX_CHUNK
    full = v - v % c
    chunk_max = logits[:, :full].view(b, full // c, c).amax(dim=-1)  # [B, V // c]
    if full < v:  # the ragged tail is one more (shorter) chunk
        chunk_max = torch.cat([chunk_max, logits[:, full:].amax(dim=-1, keepdim=True)], dim=1)
    return chunk_max


def inverse_cdf(weights: torch.Tensor, u: torch.Tensor) -> torch.Tensor:
    """For each row of non-negative weights [B, V] (not all zero), the token whose cumulative
    weight first exceeds u * the row's total: a draw in proportion to the weights, never a
    token of weight 0, whatever the rounding. u [B]: one draw a row, [B]; u [B, M]: M
    independent draws a row, [B, M].

    In two levels, as argmax: the sums of CDF_CHUNK-wide chunks pick the chunk, a cumulative
    sum inside that chunk alone picks the token. A prefix sum over the whole vocabulary is a
    serial loop on the CPU (~0.37 ms per 152k-token row); this reads each row once, in
    parallel, and adds up [B, V / CDF_CHUNK + M * CDF_CHUNK] numbers serially.
    """
    b, v = weights.shape
    c = CDF_CHUNK
    one = u.dim() == 1
    u = u[:, None] if one else u  # [B, M]
    full = v - v % c
    sums = weights[:, :full].view(b, full // c, c).sum(dim=-1)  # [B, V // c]; explicit: V may be < c
    if full < v:  # the ragged tail is one more (shorter) chunk
        sums = torch.cat([sums, weights[:, full:].sum(dim=-1, keepdim=True)], dim=1)
    cdf = sums.cumsum(dim=-1)  # [B, chunks]
    total = cdf[:, -1:]
    # just below the total at most: the first chunk the cdf passes then has weight, even when
    # u * total rounds up to the total
    target = torch.minimum(u * total, torch.nextafter(total, torch.zeros_like(total)))  # [B, M]
    chunk = torch.searchsorted(cdf, target, right=True).clamp_(max=cdf.shape[1] - 1)  # [B, M]
    inside = (target - (cdf.gather(1, chunk) - sums.gather(1, chunk))).clamp_(min=0.0)  # [B, M]
    cols = chunk[:, :, None] * c + torch.arange(c, device=weights.device)  # [B, M, c]; the tail chunk runs past v
    row = (weights.gather(1, cols.clamp(max=v - 1).flatten(1)).view(cols.shape)
           .masked_fill_(cols >= v, 0.0).cumsum_(dim=-1))
    # the chunk's own cumulative sum rounds differently from its sum: stay below its last value
    inside = torch.minimum(inside, torch.nextafter(row[:, :, -1], torch.zeros_like(inside)))
    picked = torch.searchsorted(row, inside[:, :, None], right=True).clamp_(max=c - 1).squeeze(2)
    drawn = chunk * c + picked  # [B, M]
    return drawn.squeeze(1) if one else drawn


def _unadjusted(seq: Sequence) -> bool:
    """No bias, no penalty and no min_tokens to go: adjust() leaves the row as it is."""
    p = seq.params
    return (not p.logit_bias and p.repetition_penalty == 1.0 and not p.presence_penalty
            and not p.frequency_penalty and seq.num_completion_tokens >= p.min_tokens)


def _untouched(seq: Sequence) -> bool:
    """Nothing but the draw reads or changes the row: unadjusted, no logprobs."""
    return _unadjusted(seq) and not seq.params.logprobs


def _plain_greedy(seq: Sequence) -> bool:
    return seq.params.greedy and _untouched(seq)


def _nucleus_by_floor(probs: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor | None:
    """_apply_top_p through the few tokens that can be in a nucleus, or None when too many can.

    A token of the nucleus has probability >= (1 - p) / V: the tokens below that hold less than
    1 - p together, so the mass before them exceeds p (halved here, against rounding). Sorting
    only those (a few hundred per row for a trained model) replaces a top-k of thousands over the
    whole vocabulary (47 ms at 64 rows) or a full sort (420 ms)."""
    b, v = probs.shape
    possible = probs >= ((1 - top_p) / (2 * v))[:, None]
    if int(torch.count_nonzero(possible)) > TOP_P_FLOOR_CANDIDATES * b:  # not .sum(): a 78 MB int64 copy
        return None
    row, col = possible.nonzero().unbind(1)  # rows, then columns, ascending
    p = probs[row, col].double()
    # by row, then most likely first; stable, so equal probabilities stay in vocabulary order
    order = (row * 2 - p).sort(stable=True).indices
    row, col, p = row[order], col[order], p[order]
    before = p.cumsum(0) - p  # the mass before each token, counted from the first row's start
    starts = torch.ones_like(row, dtype=torch.bool)
    starts[1:] = row[1:] != row[:-1]
    before -= before[starts][torch.cumsum(starts, 0) - 1]  # ... from its own row's start
    keep = before <= top_p.double()[row]
    out = torch.zeros_like(probs)
    out[row[keep], col[keep]] = p[keep].to(probs.dtype)
    return out


def _top_k_candidates(logits: torch.Tensor, top_k: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's top_k[i] largest logits and their ids [B, max k], in vocabulary order (so a
    draw is the one the full row masked to those tokens would give); a row's columns past its
    own k hold -inf. Top-k sampling needs nothing else of the row: at 64 rows of 151,936 the
    rest of the sampling then runs over k columns instead of the vocabulary (39 -> 10 ms, k 50)."""
    k = max(top_k)
    values, ids = logits.topk(k, dim=-1)  # sorted, descending
    if min(top_k) < k:
        past = torch.arange(k, device=logits.device)[None, :] >= torch.tensor(top_k, device=logits.device)[:, None]
        values.masked_fill_(past, float("-inf"))
    ids, order = ids.sort(dim=-1)
    return values.gather(1, order), ids


def _apply_top_p(probs: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """probs [B, V] (rows summing to 1), each row's tokens outside its nucleus set to 0: the
    most likely tokens whose probability mass before them is at most top_p."""
    rows = (top_p < 1).nonzero().squeeze(1)
    if len(rows) < len(top_p):  # a row without top-p keeps every token
        probs[rows] = _apply_top_p(probs[rows], top_p[rows])
        return probs
    nucleus = _nucleus_by_floor(probs, top_p)
    if nucleus is not None:
        return nucleus
    # A full sort of the vocabulary is slow on the CPU; the nucleus of a trained model is
    # almost always inside its top few thousand tokens, so look there first.
    k = min(TOP_P_CANDIDATES, probs.shape[1])
    top_probs, top_ids = probs.topk(k, dim=-1)  # sorted, descending; equal ones in no set order
    top_ids, by_id = top_ids.sort(dim=-1)
    top_probs, by_prob = top_probs.gather(1, by_id).sort(dim=-1, descending=True, stable=True)
    top_ids = top_ids.gather(1, by_prob)  # equal ones now in vocabulary order, as the nucleus wants
    if bool((top_probs.sum(dim=-1) >= top_p).all()):
        mass_before = top_probs.cumsum(dim=-1) - top_probs
        top_probs = top_probs.masked_fill(mass_before > top_p[:, None], 0.0)
        return torch.zeros_like(probs).scatter_(1, top_ids, top_probs)
    sorted_probs, order = probs.sort(dim=-1, descending=True, stable=True)
    mass_before = sorted_probs.cumsum(dim=-1) - sorted_probs
    sorted_probs = sorted_probs.masked_fill(mass_before > top_p[:, None], 0.0)
    return torch.zeros_like(probs).scatter_(1, order, sorted_probs)
