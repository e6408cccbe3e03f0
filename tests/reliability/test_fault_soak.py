"""The fault soak through SMG, bounded (tests/reliability/fault_soak.py; scripts/fault_soak.py runs
it longer): two engines behind `smg launch` and a REST front straight to both, a mixed load on
both, one engine SIGKILLed and restarted, the other drained. Every request completes correctly or
ends with a clean OpenAI error within its deadline; afterwards every KV block is free, no process
is left and the engine's RSS is within 10 % of its warm value."""

import pytest

from .fault_soak import SoakPlan, run_soak

pytestmark = [pytest.mark.e2e, pytest.mark.soak]

PLAN = SoakPlan(duration_s=90, warmup_s=15, threads=8, deadline_s=60, max_requests=4000)


def test_a_killed_and_a_drained_engine_behind_smg_lose_no_request(tmp_path):
    report = run_soak(PLAN, tmp_path)
    print(report.summary())
    assert report.problems(PLAN.deadline_s) == [], report.failures
    assert [event.split(" ", 1)[1] for event in report.events] == [
        "SIGKILL engine0", "engine0 restarted, SERVING", "SIGTERM engine1", "engine1 drained, exit 0"]
    assert report.count("completed") >= 100 and report.count("cancelled") and report.count("vanished")
    assert all(report.outcomes[f"completed_{kind}"] for kind in ("stream", "json", "tool", "n2")), report.outcomes
    assert report.kv_blocks.keys() == report.rss_end_mb.keys() == {"engine0-restarted"}
    assert report.smg_healthy["engine0-restarted"], report.smg_healthy  # SMG took it back
