"""Whether speculation pays, measured while serving.

A verification that accepts a drafts emits 1 + a tokens for the cost of the drafts (nothing for
an n-gram lookup, k small forward passes for a draft model) plus a target step over 1 + k rows.
Whether that beats plain decoding depends on the acceptance, the draft's cost, the batch size and
the machine: on a 2-core CPU a stranger draft model at temperature 1 accepts 45 % of its drafts
and still runs 0.8x (its steps read its whole LM head), while the same model on a GPU would win.
So the engine does not guess: for each range of decode batch sizes (1, 2-3, 4-7, ...: a step's
cost per row changes little inside one) it keeps the seconds per emitted token of steps that
chose to speculate and of steps that did not (exponential moving averages over whole engine steps,
drafting included; steps with prefill chunks are not counted), and speculates there while the
first is the smaller. The side not chosen is tried again for TRIAL_STEPS steps now and then, at
intervals that grow GROWTH-fold while the choice holds (FIRST_INTERVAL up to MAX_INTERVAL) and
start again when it flips, so a change of workload or machine load is seen and a side that keeps
losing costs a few steps in hundreds. A trial of a draft model has a price of its own, the draft
catching up on every position it skipped while off (a prefill of them, which the comparison
leaves out: steady speculation does not pay it, though it does pay each new prompt's); the next
trial then waits until that price is at most TRIAL_BUDGET of the plain steps between them.
"""

from dataclasses import dataclass, field

ALPHA = 0.3  # weight of a new step in its side's averages
MIN_SAMPLES = 3  # steps of each side measured before the averages decide
TRIAL_STEPS = 2
FIRST_INTERVAL = 16
GROWTH = 4
MAX_INTERVAL = 256
TRIAL_BUDGET = 0.05  # of the time between two trials, at most what the trial's catch-up costs


@dataclass
class _Side:
    per_step: float = 0.0  # seconds per step, averaged
    tokens: float = 0.0  # tokens emitted per step, averaged
    samples: int = 0

    @property
    def per_token(self) -> float:
        """Seconds per emitted token over the recent steps (a step that paid for a new prompt's
        catch-up weighs by its seconds, not as one ratio among many)."""
        return self.per_step / max(self.tokens, 1e-9)

    def add(self, seconds: float, tokens: int) -> None:
        if self.samples:
            self.per_step += ALPHA * (seconds - self.per_step)
            self.tokens += ALPHA * (tokens - self.tokens)
        else:
            self.per_step, self.tokens = seconds, tokens
        self.samples += 1


@dataclass
class _Range:
    """One range of decode batch sizes: its measurements and trial schedule."""
    speculating: _Side = field(default_factory=_Side)
    plain: _Side = field(default_factory=_Side)
    trying: bool | None = None  # the side on trial (None: none is)
    trial_left: int = 0
    until_trial: int = FIRST_INTERVAL
    interval: int = FIRST_INTERVAL
    trial_price: float = 0.0  # seconds the current trial spent outside its measured steps

    def speculate(self) -> bool:
        if self.speculating.samples < MIN_SAMPLES:
            return True
        if self.plain.samples < MIN_SAMPLES:
            return False
        best = self.speculating.per_token <= self.plain.per_token
        if self.trying is not None:
            if self.trial_left:
                self.trial_left -= 1
                return self.trying
            # the trial is over: a choice that held waits longer for its next one, and long
            # enough for the trial's own price to stay within TRIAL_BUDGET
            if best == self.trying:
                self.interval = FIRST_INTERVAL
            else:
                affordable = self.trial_price / (TRIAL_BUDGET * self.plain.per_step)
                self.interval = max(min(GROWTH * self.interval, MAX_INTERVAL), round(affordable))
            self.trying, self.until_trial, self.trial_price = None, self.interval, 0.0
        if self.until_trial:
            self.until_trial -= 1
            return best
        self.trying, self.trial_left = not best, TRIAL_STEPS - 1
        return self.trying


class Payoff:
    """Speculation's measured payoff by decode batch size: `speculate(n)` before a step's drafts
    are proposed, `observe(...)` once a decode-only step is done."""

    def __init__(self):
        self._ranges: dict[int, _Range] = {}

    def speculate(self, num_decodes: int) -> bool:
        return self._range(num_decodes).speculate()

    def observe(self, num_decodes: int, speculated: bool, seconds: float, tokens: int, catch_up: float = 0.0) -> None:
        """A decode-only step of num_decodes rows took `seconds` and emitted `tokens` (more than
        num_decodes where drafts stood); `speculated`: the step chose to speculate; `catch_up`:
        of its seconds, those a draft model spent on positions it had not computed. On trial
        after a time off, that is the trial's price, not speculation's; otherwise (a new
        prompt's) it is speculation's."""
        measured = self._range(num_decodes)
        if measured.trying:
            measured.trial_price += catch_up
            seconds -= catch_up
        (measured.speculating if speculated else measured.plain).add(seconds, tokens)

    def speedup(self, num_decodes: int) -> float | None:
        """Speculating's measured tokens per second over plain decoding's at this batch size."""
        measured = self._range(num_decodes)
        if not measured.speculating.samples or not measured.plain.samples:
            return None
        return measured.plain.per_token / measured.speculating.per_token

    def _range(self, num_decodes: int) -> _Range:
        """The range num_decodes is in: sizes from 2^i to 2^(i+1) - 1 share one."""
        key = num_decodes.bit_length()
        found = self._ranges.get(key)
        if found is None:  # not setdefault: that would build a _Range on every step
            found = self._ranges[key] = _Range()
        return found
