"""method mtp: drafts from the checkpoint's multi-token-prediction layer (models/mtp.py).

The layer at position i reads the target's hidden state there and the token after it, so the
model runner keeps, for each sequence, the target's hidden states of the positions the layer has
not run over yet (`keep_hidden`: every prompt chunk's rows, a decode's row, a verification's rows
that stood). When the sequence next drafts, the layer runs over them in one chunk, whose last
row (the position before the sequence's last token) yields the first draft; each further draft
feeds the layer's own output hidden state and the draft before it, one position on. Its KV has
the target's blocks (the same block tables), so it is freed and preempted with them; the draft
steps' KV past the verified positions is written over by the next chunk, with the target's
hidden states. After a prefix-cache hit or a preemption the chunk starts where the target's
computation did: the layer's KV before that is what the cached blocks' first computation left.
The layer rotates by the target's positions (vLLM's Qwen3.5 MTP too): an image prompt's MRoPE
positions, and past the image the position plus the prompt's rope delta, in the chunk and in
every draft step.

A sequence that did not draft for a while (backed off, or the payoff rule chose plain steps)
has more than k + 1 positions waiting: `catch_up` runs all but the last k + 1 of them, which the
payoff rule counts apart (spec_payoff.py), as it counts a draft model's catch-up; the last k + 1,
what a steadily speculating sequence has, go with the first draft.

Drafts are the layer's greedy choice for every row: a sampled row's are verified as one-hot
drafts (engine/speculative.py), which keeps the target's distribution.
"""

from dataclasses import dataclass, field

import torch

from xserv_engine.layers.attention import AttentionMetadata
from xserv_engine.layers.sampler import argmax


@dataclass
class MtpState:
    """A sequence's target hidden states the layer has not run over: positions start.. on."""
    start: int
    hidden: list[torch.Tensor] = field(default_factory=list)  # [n, H] chunks, in position order

    @property
    def end(self) -> int:
        return self.start + sum(len(h) for h in self.hidden)


def keep_hidden(seq, start: int, hidden: torch.Tensor) -> None:
    """The target's hidden states [n, H] of seq's positions start.. (a copy: hidden is a view of a
    whole step's). Rows that do not follow the kept ones (a prefix-cache hit, a preemption) start
    afresh from them."""
    state = seq.spec.mtp
    if state is None or state.end != start:
        seq.spec.mtp = state = MtpState(start)
    state.hidden.append(hidden.clone())


class MtpDrafter:
    """Speculator's drafter for method mtp (DraftModel's interface: catch_up, then propose)."""

    def __init__(self, runner, num_speculative_tokens: int):
        self.runner = runner  # the target's: its model holds the layer (model.mtp)
        self.steady = num_speculative_tokens + 1  # positions waiting at a speculating sequence's steps

    @torch.inference_mode()
    def catch_up(self, seqs: tuple) -> None:
        """The layer over each sequence's waiting positions but its last `steady`."""
        behind = [seq for seq in seqs if _waiting(seq) > self.steady]
        if behind:
            self._chunk(behind, [_waiting(seq) - self.steady for seq in behind])

    @torch.inference_mode()
    def propose(self, seqs: tuple, rooms: tuple[int, ...]) -> list[list[int]]:
        """Drafts, up to rooms[i] for seqs[i] (KV slots reserved up to its last draft)."""
        r = self.runner
        hidden = self._chunk(seqs, [_waiting(seq) for seq in seqs])  # [len(seqs), H]: each one's last row
        drafts: list[list[int]] = [[token] for token in argmax(r.model.compute_logits(hidden)).tolist()]
        for step in range(1, max(rooms)):  # step s at position len - 2 + s, fed draft s
            rows = [i for i, room in enumerate(rooms) if room > step]
            row_seqs = [seqs[i] for i in rows]
            positions = [len(seq) - 2 + step for seq in row_seqs]  # past any prompt: text positions
            rope_positions = [p + _rope_delta(seq) for seq, p in zip(row_seqs, positions)]
            meta = AttentionMetadata(
                slot_mapping=r.tensor([r.slot(seq, p) for seq, p in zip(row_seqs, positions)], torch.int64),
                num_prefill_tokens=0, decode=r.decode_metadata(row_seqs, positions))
            r.backend.prepare(meta, r.block_size)
            index = r.tensor(rows, torch.int64)
            out = r.model.draft(r.tensor([drafts[i][-1] for i in rows], torch.int64),
                                r.tensor(rope_positions, torch.int64), hidden[index], meta, step)
            hidden[index] = out  # each row's input to its next step
            for i, token in zip(rows, argmax(r.model.compute_logits(out)).tolist()):
                drafts[i].append(token)
        return drafts

    def _chunk(self, seqs, counts: list[int]) -> torch.Tensor:
        """The layer over the first counts[i] waiting positions of seqs[i], in one forward; their
        hidden states drop out of the sequences' MtpState. Returns its output at each chunk's last
        row [len(seqs), H]."""
        r = self.runner
        input_ids, positions, slots, hidden, last, starts = [], [], [], [], [], []
        for seq, count in zip(seqs, counts):
            state = seq.spec.mtp
            start, end = state.start, state.start + count
            waiting = torch.cat(state.hidden) if len(state.hidden) > 1 else state.hidden[0]
            hidden.append(waiting[:count])
            state.start, state.hidden = end, [waiting[count:]] if count < len(waiting) else []
            input_ids.extend(seq.token_ids[start + 1 : end + 1])  # the token after each position
            positions.append(_target_positions(seq, start, end))
            slots.extend(r.slots(seq, start, end))
            last.append(len(input_ids) - 1)
            starts.append(start)
        ends = [start + count for start, count in zip(starts, counts)]
        meta = AttentionMetadata(slot_mapping=r.tensor(slots, torch.int64), num_prefill_tokens=len(input_ids),
                                 prefill=r.prefill_metadata(list(seqs), starts, ends))
        r.backend.prepare(meta, r.block_size)
        out = r.model.draft(r.tensor(input_ids, torch.int64), _one_row_if_text(torch.cat(positions, dim=1)).to(r.device),
                            torch.cat(hidden), meta)
        return out[r.tensor(last, torch.int64)]


def _waiting(seq) -> int:
    """Positions whose target hidden state the layer has not run over: up to the one before the
    sequence's last token (the last token's own comes with the step that feeds it)."""
    state = seq.spec.mtp
    waiting = 0 if state is None else state.end - state.start
    assert state is None or state.end == len(seq) - 1, (state.start, state.end, len(seq))
    return waiting


def _target_positions(seq, start: int, end: int) -> torch.Tensor:
    """The rotary positions [3, end - start] the target gave positions start..: an image prompt's
    MRoPE positions (its rope delta added past the image), else the positions themselves."""
    if seq.images is not None:
        return seq.images.positions_of(start, end)
    return torch.arange(start, end).expand(3, -1)


def _one_row_if_text(mrope: torch.Tensor) -> torch.Tensor:
    """MRoPE's [3, T], or one position per row [T] where the axes agree (no image token), which
    the native rotary op takes."""
    return mrope[0] if torch.equal(mrope[0], mrope[1]) and torch.equal(mrope[0], mrope[2]) else mrope


def _rope_delta(seq) -> int:
    return seq.images.rope_delta if seq.images is not None else 0
