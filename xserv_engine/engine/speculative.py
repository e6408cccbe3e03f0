"""Speculative decoding: propose a few tokens per sequence, check them all in one forward pass.

At one stream a decode step is bound by reading the weights, so the target model scores k
proposed tokens (and the position after them) in about the time of one. The scheduler asks the
Speculator for each decode's drafts (`propose`); the model runner lays a sequence with drafts out
as 1 + k decode rows (its last token, then each draft), each attending to the cache up to its own
position, so that each row's logits are what plain decoding would compute there; `verify` then
decides which drafts stand.

Verification of greedy rows, and of rows whose drafts have no distribution (n-gram lookup,
a grammar row): at each position the target's token is chosen exactly as plain decoding would
choose it (the Sampler, on a view of the sequence with the drafts before that position appended:
penalties, bias, min_tokens, temperature, top-k/p, min-p and the row's seeded draws all
apply), and the draft stands while it equals that token. The first position where they differ
emits the target's token; if all k stand, the position after them emits one more. For a sampled
row this is the rejection sampling of Leviathan et al. with a one-hot draft: accept d with
probability p(d), else draw from p without d, renormalised, which is one draw x ~ p and "accept
iff x == d". Every emitted token is distributed as the target's. A seeded row's draws are a
function of its seed and position (sampler.seeded_uniforms), so its verification draws at each
position what plain decoding draws there, and its output is plain decoding's whichever steps
speculate.

A draft model samples a sampled row's drafts from its own processed distribution q (the same
Sampler steps on the draft's logits) and keeps q; `rejection_sample` then accepts d with
probability min(1, p(d) / q(d)) and, at the first rejection, draws from max(0, p - q)
renormalised: the emitted tokens are again distributed as the target's, and a draft close to
the target is accepted about as often at temperature 1 as at 0 (with one-hot drafts a sampled
row accepts only p(d), near 0 for a flat distribution). A seeded row instead draws its draft at
each position with the number the target's draw there will use, and is verified as a one-hot
draft: the draft stands exactly when it is the target's own seeded draw, so its output is plain
decoding's, and a draft distribution close to the target's picks the same token from the same
number (inverse CDF) about as often as rejection sampling would accept it.

Which steps speculate (`Speculator.budget`): none once more than `disable_by_batch_size`
sequences decode (vLLM's knob: at large batches the forward is bound by compute, and checking
tokens that may be thrown away costs throughput); none at a batch size where speculating steps
were measured to emit fewer tokens per second than plain ones (`disable_when_slower`, the
payoff rule of spec_payoff.py: drafts that are accepted can still cost more than they earn); a
sequence whose drafts were all rejected `BACKOFF_AFTER` times running stops proposing for a
while, so text the drafts cannot predict costs little more than plain decoding. A draft model,
whose every draft costs a step of its own, also probes: one draft at a sequence's start and after
each miss, all k once one stands. Rows with a LoRA adapter decode without drafts in the same
batch. A row with an output grammar keeps the drafts its grammar accepts (`_grammatical`) and
each verified position is masked by a copy of its matcher advanced over the drafts before it
(`DraftGuide`); its own matcher advances over the tokens that stand only.
"""

import json
import time
from dataclasses import asdict, dataclass

import numpy as np
import torch

from xserv_engine.engine.block_manager import BlockManager
from xserv_engine.engine.sequence import BACKOFF_STEPS
from xserv_engine.engine.spec_payoff import Payoff
from xserv_engine.errors import InvalidRequest
from xserv_engine.layers.attention import AttentionMetadata
from xserv_engine.layers.sampler import Sampler, SamplerOutput, argmax, inverse_cdf, uniforms
from xserv_engine.outputs import SpecStats
from xserv_engine.structured.guide import DraftGuide

METHODS = ("ngram", "draft_model", "mtp")
MAX_SPECULATIVE_TOKENS = 16
DEFAULT_DISABLE_BY_BATCH_SIZE = 8
# verifications in a row with nothing accepted before a sequence pauses (a draft model's, after
# a miss, are probes of one draft: a miss costs it one step of its own, not k)
BACKOFF_AFTER = 2
# each pause BACKOFF_GROWTH times the last, up to MAX_BACKOFF_STEPS: where drafts are never right
# (a 4-layer random draft model: 0.88-0.92x of plain decoding with pauses of 8 doubling to 64 on
# the Qwen3-0.6B shape) only a few verifications in a request's first hundred steps are paid
BACKOFF_GROWTH = 4
MAX_BACKOFF_STEPS = 256


@dataclass(frozen=True)
class SpeculativeConfig:
    """--speculative-config, as vLLM spells it."""
    method: str = "ngram"  # ngram | draft_model (implied by `model`) | mtp (the checkpoint's own layer)
    num_speculative_tokens: int = 4
    model: str | None = None  # draft_model: a smaller Qwen3 with the target's vocabulary
    prompt_lookup_max: int = 4
    prompt_lookup_min: int = 2
    # speculate only while at most this many sequences decode (vLLM's disable_by_batch_size)
    disable_by_batch_size: int = DEFAULT_DISABLE_BY_BATCH_SIZE
    # and only at batch sizes where it is measured faster than plain decoding (spec_payoff.py)
    disable_when_slower: bool = True

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)


def parse_speculative_config(text: str | dict | None) -> SpeculativeConfig | None:
    """The JSON of --speculative-config, checked; InvalidRequest names the field at fault."""
    if text is None or text == "":
        return None
    try:
        raw = json.loads(text) if isinstance(text, str) else dict(text)
    except json.JSONDecodeError as exc:
        raise InvalidRequest("speculative_config", f"is not JSON: {exc}") from None
    if not isinstance(raw, dict):
        raise InvalidRequest("speculative_config", "must be a JSON object")
    known = {f for f in SpeculativeConfig.__dataclass_fields__}
    method = raw.setdefault("method", "draft_model" if raw.get("model") else "ngram")
    if method not in METHODS:
        raise InvalidRequest("speculative_config.method", f"must be one of {', '.join(METHODS)}, got {method!r}")
    if (method == "draft_model") != bool(raw.get("model")):
        raise InvalidRequest("speculative_config.model", "a draft model's directory goes with method draft_model, "
                             "and only with it")
    if raw.get("model") is not None and not isinstance(raw["model"], str):
        raise InvalidRequest("speculative_config.model", f"must be a directory path, got {raw['model']!r}")
    unknown = sorted(set(raw) - known)
    if unknown:
        raise InvalidRequest(f"speculative_config.{unknown[0]}", f"is not a field; known: {', '.join(sorted(known))}")
    for name in known - {"method", "model", "disable_when_slower"}:
        value = raw.get(name)
        if value is not None and (not isinstance(value, int) or isinstance(value, bool)):
            raise InvalidRequest(f"speculative_config.{name}", f"must be an integer, got {value!r}")
    if not isinstance(raw.get("disable_when_slower", True), bool):
        raise InvalidRequest("speculative_config.disable_when_slower",
                             f"must be true or false, got {raw['disable_when_slower']!r}")
    config = SpeculativeConfig(**{k: v for k, v in raw.items() if v is not None})
    if "num_speculative_tokens" not in raw:
        raise InvalidRequest("speculative_config.num_speculative_tokens", "is required")
    if not 1 <= config.num_speculative_tokens <= MAX_SPECULATIVE_TOKENS:
        raise InvalidRequest("speculative_config.num_speculative_tokens",
                             f"must be 1..{MAX_SPECULATIVE_TOKENS}, got {config.num_speculative_tokens}")
    if config.prompt_lookup_min < 1:
        raise InvalidRequest("speculative_config.prompt_lookup_min", f"must be at least 1, got {config.prompt_lookup_min}")
    if config.prompt_lookup_max < config.prompt_lookup_min:
        raise InvalidRequest("speculative_config.prompt_lookup_max",
                             f"must be at least prompt_lookup_min ({config.prompt_lookup_min}), "
                             f"got {config.prompt_lookup_max}")
    if config.disable_by_batch_size < 1:
        raise InvalidRequest("speculative_config.disable_by_batch_size",
                             f"must be at least 1, got {config.disable_by_batch_size}")
    return config


def ngram_propose(token_ids: list[int], k: int, lookup_min: int, lookup_max: int) -> list[int]:
    """Prompt lookup (vLLM's ngram, llama.cpp's lookup): the k tokens that followed the latest
    earlier occurrence of the sequence's last n tokens, for the longest n in [lookup_min,
    lookup_max] that occurs, the copy running on into its own output; [] when none occurs."""
    n_tokens = len(token_ids)
    if n_tokens <= lookup_min or k <= 0:
        return []
    tokens = np.asarray(token_ids, dtype=np.int64)
    ends = np.flatnonzero(tokens[:-1] == tokens[-1])  # earlier places the last token occurs: one pass
    length = 1  # ends: where the last `length` tokens occur, ending there
    best, best_length = None, 0
    while len(ends) and length < lookup_max:
        ends = ends[ends >= length]  # one token longer: the token before must match too
        ends = ends[tokens[ends - length] == tokens[-1 - length]]
        length += 1
        if len(ends) and length >= lookup_min:
            best, best_length = int(ends[-1]), length  # the latest one: nearest context, most likely to go on
    if best is None:
        return []
    start = best + 1
    # copied as LZ77 copies, overlapping its own output: a loop of period p shorter than k (the
    # latest match ends p tokens before the end) still gives k drafts
    proposal = token_ids[start : start + k]
    while len(proposal) < k:
        proposal.append(proposal[len(proposal) - (n_tokens - start)])
    return proposal


class SequenceView:
    """A sequence as the Sampler sees it at a verified position: its tokens with the drafts
    before that position appended. Only what the Sampler reads."""
    __slots__ = ("seq", "extra", "guide")

    def __init__(self, seq, extra: list[int]):
        self.seq, self.extra = seq, extra
        self.guide = DraftGuide(seq.guide, extra) if seq.guide is not None else None

    @property
    def params(self):
        return self.seq.params

    @property
    def seed(self):
        return self.seq.seed

    @property
    def token_ids(self) -> list[int]:
        return self.seq.token_ids + self.extra

    @property
    def num_completion_tokens(self) -> int:
        return self.seq.num_completion_tokens + len(self.extra)

    @property
    def completion_token_ids(self) -> list[int]:
        return self.seq.completion_token_ids + self.extra


def _grammatical(seq, drafts: list[int]) -> list[int]:
    """The drafts up to the first one the sequence's grammar would refuse: a refused token can
    never stand, and the positions after it have no grammar state to mask with."""
    if seq.guide is None or not drafts:
        return drafts
    return drafts[: seq.guide.matcher.valid_prefix(drafts)]


def verify_rows(seq) -> list:
    """The rows whose logits a sequence's step produces, as the Sampler sees them: the sequence
    itself, or with drafts one view per position (0..k drafts before it)."""
    drafts = seq.spec_token_ids
    if not drafts:
        return [seq]
    return [SequenceView(seq, drafts[:j]) for j in range(len(drafts) + 1)]


def accepted_run(drafts: list[int], chosen: list[int]) -> int:
    """How many drafts stand: the length of the run where each equals the target's choice at
    its position (chosen has len(drafts) + 1 entries)."""
    m = 0
    while m < len(drafts) and drafts[m] == chosen[m]:
        m += 1
    return m


class Speculator:
    def __init__(self, config: SpeculativeConfig, draft: "DraftModel | None" = None):
        self.config = config
        self.draft = draft  # draft_model's, or mtp's (engine/mtp_drafter.py); None: n-gram lookup
        self.stats = SpecStats(accepted_per_pos=[0] * config.num_speculative_tokens)
        self.payoff = Payoff() if config.disable_when_slower else None
        self.clock = time.perf_counter  # the payoff rule's (tests drive their own)
        self._step_started = 0.0
        self._catch_up = 0.0  # of this step: seconds a draft model spent catching up
        self._speculating = False  # this step's choice

    def budget(self, num_decodes: int) -> int:
        """Drafts per sequence this step: k while few sequences decode and speculating is
        measured to pay at this batch size (or is on trial), none otherwise."""
        if not 0 < num_decodes <= self.config.disable_by_batch_size:
            return 0
        if self.payoff is not None and not self.payoff.speculate(num_decodes):
            return 0
        self._speculating = True
        return self.config.num_speculative_tokens

    def begin_step(self) -> None:
        self._step_started, self._catch_up, self._speculating = self.clock(), 0.0, False

    def end_step(self, batch, output: SamplerOutput) -> None:
        """An engine step is done: its time since begin_step, scheduling and drafting included,
        goes to the payoff rule if it was decode-only, on the side the step chose (a speculating
        step whose rows found no drafts, or backed off, is one: what the choice costs and earns
        is what is compared), with the time a draft model spent catching up (spec_payoff.py:
        a new prompt's counts, a trial's after a time off spaces the trials out)."""
        if self.payoff is None or batch.prefills or not batch.decodes:
            return
        seconds = self.clock() - self._step_started
        accepted = sum(len(tokens) for tokens in output.spec_tokens.values())
        self.payoff.observe(len(batch.decodes), self._speculating, seconds, len(batch.sampled) + accepted,
                            catch_up=self._catch_up)

    def propose(self, seqs: list, rooms: list[int], blocks: BlockManager) -> None:
        """Set each decode's spec_token_ids: up to rooms[i] drafts, as many as have KV slots
        (BlockManager.reserve_drafts); none for rows that cannot speculate or that backed off."""
        wanted = [(seq, room) for seq, room in zip(seqs, rooms) if room > 0 and self._may_speculate(seq)]
        if self.draft is None:
            c = self.config
            for seq, room in wanted:
                drafts = _grammatical(seq, ngram_propose(seq.token_ids, room, c.prompt_lookup_min, c.prompt_lookup_max))
                seq.spec_token_ids = drafts[: blocks.reserve_drafts(seq, len(drafts))] if drafts else []
            return
        # the draft model writes its KV where the drafts' go: slots first, then the drafts
        wanted = [(seq, blocks.reserve_drafts(seq, 1 if seq.spec.probing else room)) for seq, room in wanted]
        wanted = [(seq, room) for seq, room in wanted if room > 0]
        if wanted:
            seqs, rooms = zip(*wanted)
            started = self.clock()
            self.draft.catch_up(seqs)
            self._catch_up += self.clock() - started
            for seq, drafts in zip(seqs, self.draft.propose(seqs, rooms)):
                seq.spec_token_ids = _grammatical(seq, drafts)

    @staticmethod
    def _may_speculate(seq) -> bool:
        state = seq.spec
        if state.pause > 0:
            state.pause -= 1
            return False
        return seq.lora is None and (seq.guide is None or seq.guide.drafts_allowed)

    def record(self, seq, num_drafts: int, num_accepted: int) -> None:
        """After a verification, before its tokens are appended: the counters, the sequence's
        own and its backoff."""
        s = self.stats
        s.num_drafts += 1
        s.num_draft_tokens += num_drafts
        s.num_accepted_tokens += num_accepted
        for pos in range(num_accepted):
            s.accepted_per_pos[pos] += 1
        state = seq.spec
        state.draft_tokens += num_drafts
        state.accepted_tokens += num_accepted
        if self.draft is not None:  # its steps wrote the KV of the last token and of each draft that stood
            state.draft_cached = len(seq) + min(num_accepted, num_drafts - 1)
        if num_accepted:
            state.misses, state.backoff, state.probing = 0, BACKOFF_STEPS, False
            return
        state.misses, state.probing = state.misses + 1, True
        if state.misses >= BACKOFF_AFTER:
            state.pause, state.misses = state.backoff, 0
            state.backoff = min(state.backoff * BACKOFF_GROWTH, MAX_BACKOFF_STEPS)


def drawn(seq) -> bool:
    """Whether a sequence's drafts were sampled with a distribution (q) that its verification
    uses: a draft model's, for an unseeded sampled row without a grammar."""
    probs, drafts = seq.spec.draft_probs, seq.spec_token_ids
    return probs is not None and len(drafts) == len(probs) > 0 and _keeps_draft_probs(seq)


def _draws_drafts(seq) -> bool:
    """Whether a draft model samples this row's drafts (rather than taking its greedy choice)."""
    return not seq.params.greedy and seq.guide is None


def _keeps_draft_probs(seq) -> bool:
    """Whether a row's drafts are verified by rejection_sample against their q: sampled ones, but
    not a seeded row's (verified one-hot, with the target's own seeded draws)."""
    return _draws_drafts(seq) and seq.seed is None


def rejection_sample(p: torch.Tensor, q: torch.Tensor, drafts: list[int],
                     generator: torch.Generator | None) -> tuple[int, int]:
    """Leviathan et al.'s test of k drafts drawn from q [k, V] against the target's p [k+1, V]:
    (how many stand, the token after them). Draft j stands with probability
    min(1, p_j(d) / q_j(d)); at the first that does not, the token is drawn from max(0, p_j - q_j)
    renormalised; if all stand, from p_k. k + 1 uniform numbers per call, from generator."""
    k = len(drafts)
    u = torch.rand(k + 1, generator=generator, device=p.device)
    index = torch.arange(k, device=p.device)
    ids = torch.tensor(drafts, device=p.device)
    stands = (u[:k] * q[index, ids] < p[index, ids]).tolist()
    m = stands.index(False) if False in stands else k
    row = p[m]
    if m < k:
        residual = (p[m] - q[m]).clamp_(min=0.0)
        if residual.sum() > 0:  # else p <= q everywhere, so p == q: no draft is ever refused there
            row = residual
    return m, int(inverse_cdf(row[None], u[k:]).item())


def verify(sampler: Sampler, logits: torch.Tensor, seqs: list, rows: list | None = None) -> SamplerOutput:
    """The step's tokens from logits [rows, V] laid out as verify_rows lays out seqs (rows: those
    views, if made already, so that the grammar masks filled for them are used): for a
    sequence with drafts, the drafts that stand and the target's token after them (its first
    token in token_ids, the rest in spec_tokens); for the others, their one token."""
    rows = rows if rows is not None else [row for seq in seqs for row in verify_rows(seq)]
    starts, i = [], 0
    for seq in seqs:
        starts.append(i)
        i += len(seq.spec_token_ids) + 1
    tested = {j for j, seq in enumerate(seqs) if drawn(seq)}  # rejection_sample's; the Sampler chooses the rest
    if tested:
        keep = [r for j, seq in enumerate(seqs) if j not in tested
                for r in range(starts[j], starts[j] + len(seq.spec_token_ids) + 1)]
        out = sampler(logits[keep], [rows[r] for r in keep]) if keep else SamplerOutput([], [])
    else:
        keep, out = range(len(rows)), sampler(logits, rows)
    chosen = dict(zip(keep, zip(out.token_ids, out.logprobs)))
    token_ids, logprobs, spec_tokens = [], [], {}
    for j, (seq, start) in enumerate(zip(seqs, starts)):
        drafts = seq.spec_token_ids
        if j in tested:
            emitted = _rejection_test(sampler, logits[start : start + len(drafts) + 1],
                                      rows[start : start + len(drafts) + 1], seq)
            seq.spec.draft_probs = None
        else:
            run = [chosen[r] for r in range(start, start + len(drafts) + 1)]
            m = accepted_run(drafts, [t for t, _ in run])
            emitted = run[: m + 1]
        token_ids.append(emitted[0][0])
        logprobs.append(emitted[0][1])
        if drafts:
            spec_tokens[seq.seq_id] = emitted[1:]
    return SamplerOutput(token_ids, logprobs, spec_tokens=spec_tokens)


def _rejection_test(sampler: Sampler, logits: torch.Tensor, rows: list, seq) -> list[tuple]:
    """A drawn row's emitted (token, logprob) pairs: rejection_sample over the target's
    processed distributions at its k + 1 positions and the draft's q."""
    drafts = seq.spec_token_ids
    p, entries = sampler.distribution(logits, rows)
    m, token = rejection_sample(p, seq.spec.draft_probs.to(p.device), drafts, None)
    emitted = drafts[:m] + [token]
    return [(t, sampler.pick_logprob(entries[j], t)) for j, t in enumerate(emitted)]


class DraftModel:
    """method draft_model: a smaller model with the target's vocabulary proposes, one batched
    decode step per draft position: its greedy choice for a greedy row or a grammar row, a draw
    from its processed distribution q (kept for `rejection_sample`) for a sampled row. Its KV
    cache has the target's blocks (the same count and size) and is indexed by the target's block
    tables, so a sequence's draft KV is freed and preempted with the sequence's own blocks. It
    runs only when it proposes: first a chunk over the positions it has not computed
    (`SeqSpecState.draft_cached` on; the whole prompt the first time, or after a preemption),
    then its k steps. A sequence that backs off costs the draft nothing."""

    def __init__(self, runner):
        self.runner = runner  # a ModelRunner of the draft checkpoint, KV allocated like the target's

    @torch.inference_mode()
    def propose(self, seqs: tuple, rooms: tuple[int, ...]) -> list[list[int]]:
        """Drafts, up to rooms[i] for seqs[i] (KV slots reserved up to its last draft); a
        sampled row's distributions go to its spec.draft_probs; `catch_up` first."""
        r = self.runner
        drafts: list[list[int]] = [[] for _ in seqs]
        probs: list[list[torch.Tensor]] = [[] for _ in seqs]
        feed = [seq.last_token for seq in seqs]
        for step in range(max(rooms)):  # step s feeds position len - 1 + s: the last token, then drafts
            rows = [i for i, room in enumerate(rooms) if room > step]
            positions = [len(seqs[i]) - 1 + step for i in rows]
            row_seqs = [seqs[i] for i in rows]
            meta = AttentionMetadata(
                slot_mapping=r.tensor([r.slot(seq, p) for seq, p in zip(row_seqs, positions)], torch.int64),
                num_prefill_tokens=0, decode=r.decode_metadata(row_seqs, positions))
            r.backend.prepare(meta, r.block_size)
            hidden = r.model(r.tensor([feed[i] for i in rows], torch.int64), r.tensor(positions, torch.int64), meta)
            logits = r.model.compute_logits(hidden)
            chosen = argmax(logits).tolist()
            sampled = [(j, i) for j, i in enumerate(rows) if _draws_drafts(seqs[i])]
            for (j, _), token_id in zip(sampled, self._draw(logits, sampled, seqs, drafts, probs) if sampled else []):
                chosen[j] = token_id
            for i, token_id in zip(rows, chosen):
                drafts[i].append(token_id)
                feed[i] = token_id
        for seq, q in zip(seqs, probs):
            seq.spec.draft_probs = torch.stack(q) if q else None
        return drafts

    def _draw(self, logits: torch.Tensor, sampled: list[tuple[int, int]], seqs: tuple, drafts: list,
              probs: list) -> list[int]:
        """The draws for sampled (row of logits, index in seqs) pairs from q, the Sampler's
        steps on the draft's logits over views of the sequences with their drafts so far; each
        q appended to its sequence's probs."""
        views = [SequenceView(seqs[i], drafts[i]) for _, i in sampled]
        q, _ = self.runner.sampler.distribution(logits[[j for j, _ in sampled]], views, logprobs=False)
        for (_, i), row in zip(sampled, q):
            if _keeps_draft_probs(seqs[i]):
                probs[i].append(row)
        return inverse_cdf(q, uniforms(views, q.device)).tolist()  # a seeded row: its target's numbers

    @torch.inference_mode()
    def catch_up(self, seqs: tuple) -> None:
        """The draft's KV of every position before each sequence's last token, in one forward of
        chunks (prompt chunks as the target's, so prefix-cached blocks get the draft's KV too)."""
        behind = [seq for seq in seqs if seq.spec.draft_cached < len(seq) - 1]
        if not behind:
            return
        r = self.runner
        starts, ends = [seq.spec.draft_cached for seq in behind], [len(seq) - 1 for seq in behind]
        input_ids, positions, slots = [], [], []
        for seq, start, end in zip(behind, starts, ends):
            input_ids.extend(seq.token_ids[start:end])
            positions.extend(range(start, end))
            slots.extend(r.slots(seq, start, end))
        meta = AttentionMetadata(slot_mapping=r.tensor(slots, torch.int64), num_prefill_tokens=len(input_ids),
                                 prefill=r.prefill_metadata(behind, starts, ends))
        r.backend.prepare(meta, r.block_size)
        r.model(r.tensor(input_ids, torch.int64), r.tensor(positions, torch.int64), meta)
        for seq in behind:
            seq.spec.draft_cached = len(seq) - 1
