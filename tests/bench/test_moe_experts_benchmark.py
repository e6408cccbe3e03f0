"""benchmarks/moe_experts.py at a tiny shape: every implementation of the op is timed, per step size."""

import subprocess
import sys

import pytest

from tests.bench.test_benchmark_scripts import REPO


@pytest.mark.e2e  # the whole script in a process of its own
def test_moe_experts_benchmark_times_every_implementation():
    proc = subprocess.run([sys.executable, str(REPO / "benchmarks" / "moe_experts.py"), "--experts", "4",
                           "--hidden", "64", "--intermediate", "32", "--top-k", "2", "--tokens", "1", "8", "--loop"],
                          cwd=REPO, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = proc.stdout.splitlines()
    assert "native ms" in lines[1] and "grouped ms" in lines[1] and "loop ms" in lines[1]
    rows = [line.split() for line in lines[2:]]
    assert [row[0] for row in rows] == ["1", "8"]
    # ms then GB/s per implementation; at this tiny shape a slow call's GB/s rounds to 0.0
    assert all(float(ms) > 0 and float(gbs) >= 0 for row in rows for ms, gbs in zip(row[2:8:2], row[3:8:2]))
