"""benchmarks/gpu_acceptance.py's dry run (tiny shapes on the CPU): the GPU run's every step,
so the script a lent GPU runs once cannot rot."""

import json
import subprocess
import sys

import pytest

from tests.bench.test_benchmark_scripts import REPO, load_script

SCRIPT = REPO / "benchmarks" / "gpu_acceptance.py"


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), "--dry-run", *args], cwd=REPO, capture_output=True,
                          text=True, timeout=900)


@pytest.mark.e2e  # the whole script in a process of its own: engines, transformers, every step (~15 s)
@pytest.mark.reference
def test_dry_run_checks_fidelity_and_measures_every_stream_count(tmp_path):
    out = tmp_path / "acceptance.json"
    proc = run("--out", str(out))
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert report["dry_run"] and [r["shape"] for r in report["results"]] == [
        "Qwen3-0.6B", "Qwen3-8B", "Qwen3-30B-A3B", "Qwen3.5-0.8B", "Qwen3.5-35B-A3B"]
    for r in report["results"]:
        f = r["fidelity"]
        assert f["greedy_equal"] == f["greedy_total"] == 2
        assert f["logits_max_abs_diff"] < 1e-4 * max(1.0, f["logits_max_abs"])
        assert [s["streams"] for s in r["streams"]] == [1, 4, 8]
        assert all(s["output_tokens"] == s["requested_tokens"] > 0 for s in r["streams"])
        assert r["batch1_decode_tok_s"] > 0 and 0 < r["roofline"]["fraction_measured"]
    table = out.with_suffix(".md").read_text()
    assert "| Qwen3-8B |" in table and "| Qwen3-30B-A3B |" in table and "batch-1 decode tok/s" in table
    assert "| Qwen3.5-0.8B |" in table and "| Qwen3.5-35B-A3B |" in table
    assert table.splitlines()[-1] in proc.stdout


def test_missing_configs_are_skipped_with_a_message(tmp_path, monkeypatch, capsys):
    out = tmp_path / "acceptance.json"
    monkeypatch.syspath_prepend(str(SCRIPT.parent))  # its `from acceptance_steps import ...`
    monkeypatch.setattr(sys, "argv", [str(SCRIPT), "--dry-run", "--out", str(out), "--reference-dir",
                                      str(tmp_path / "absent"), "--shapes", "Qwen3-8B"])
    assert load_script("gpu_acceptance").main() == 0
    stderr = capsys.readouterr().err
    assert "skipped" in stderr and "config-Qwen3-8B.json not found" in stderr
    assert json.loads(out.read_text())["results"] == [
        {"shape": "Qwen3-8B", "skipped": f"{tmp_path / 'absent' / 'qwen3' / 'config-Qwen3-8B.json'} not found"}]
