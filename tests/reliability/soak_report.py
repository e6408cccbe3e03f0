"""What a fault soak (tests/reliability/fault_soak.py) saw, and which of it fails the soak."""

import collections
from dataclasses import dataclass, field

RSS_GROWTH_LIMIT = 0.10  # an engine's RSS at the end over its RSS once warm


@dataclass
class SoakReport:
    outcomes: collections.Counter = field(default_factory=collections.Counter)
    failures: list[str] = field(default_factory=list)  # the first few, described
    slowest_s: float = 0.0
    retried_by_smg: float = 0.0
    smg_healthy: dict[str, bool] = field(default_factory=dict)  # engine -> SMG routes to it at the end
    rss_warm_mb: dict[str, float] = field(default_factory=dict)  # engine -> RSS after its warm-up
    rss_end_mb: dict[str, float] = field(default_factory=dict)  # engine alive at the end -> RSS then
    kv_blocks: dict[str, tuple[int, int, int]] = field(default_factory=dict)  # engine -> (free, total, running)
    left_behind: list[int] = field(default_factory=list)
    events: list[str] = field(default_factory=list)  # the faults, with their time

    @property
    def requests(self) -> int:
        return sum(self.outcomes.values())

    def count(self, prefix: str) -> int:
        return sum(n for outcome, n in self.outcomes.items() if outcome.startswith(prefix))

    def problems(self, deadline_s: float) -> list[str]:
        problems = [f"{n} requests {outcome}" for outcome, n in self.outcomes.items() if outcome.startswith("bad")]
        if self.slowest_s > deadline_s:
            problems.append(f"a request took {self.slowest_s:.1f} s, past its deadline of {deadline_s:.0f} s")
        problems += [f"{name}: {free}/{total} KV blocks free, {running} running"
                     for name, (free, total, running) in self.kv_blocks.items() if free != total or running]
        problems += [f"{name}: RSS {self.rss_warm_mb[name]:.0f} -> {end:.0f} MB" for name, end in self.rss_end_mb.items()
                     if end > self.rss_warm_mb[name] * (1 + RSS_GROWTH_LIMIT)]
        problems += [f"process {pid} left behind" for pid in self.left_behind]
        return problems

    def summary(self) -> str:
        return (f"{self.requests} requests: {self.count('completed')} completed, {self.count('clean_error')} clean "
                f"errors, {self.count('cancelled')} cancelled and {self.count('vanished')} vanished on purpose, "
                f"{self.count('bad')} bad; retried by SMG {self.retried_by_smg:.0f}, healthy in SMG at the end "
                f"{self.smg_healthy}; slowest {self.slowest_s:.1f} s; "
                f"by outcome {dict(sorted(self.outcomes.items()))}; RSS MB warm {self.rss_warm_mb}, at the end "
                f"{self.rss_end_mb}; "
                f"KV (free, total, running) {self.kv_blocks}; faults {self.events}")
