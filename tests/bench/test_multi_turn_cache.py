"""benchmarks/multi_turn_cache.py in a tiny run (2 conversations x 3 turns, 4-token answers) on
the demo model: every reusable prompt token comes from the cache, and only with the cache on."""

import argparse

import pytest

from tests.bench.test_benchmark_scripts import load_script


def test_a_tiny_multi_turn_run_serves_every_reusable_token_from_the_cache(demo_dir):
    bench = load_script("multi_turn_cache")
    args = argparse.Namespace(model=str(demo_dir), conversations=2, turns=3, max_tokens=4, system_words=40,
                              num_kv_blocks=256, kv_cache_memory_gb=None, mamba_track_interval=None)
    on, off = bench.run(args, True), bench.run(args, False)
    assert [(t.conversation, t.turn) for t in on.turns] == [(c, t) for c in range(2) for t in range(3)]
    reusable = [t.reusable_tokens for t in on.turns]
    assert all(r > 0 for r, t in zip(reusable, on.turns) if t.turn > 0)  # the conversation so far
    assert [t.cached_tokens for t in on.turns] == reusable
    assert [t.cached_tokens for t in off.turns] == [0] * 6
    assert on.hits_agree and off.hits_agree
    assert [t.answer_ids for t in on.turns] == [t.answer_ids for t in off.turns]
    assert "| on | 1.000 (" in bench.summary("on", on)


def test_on_a_hybrid_model_each_turn_resumes_from_a_snapshot(demo_qwen3_5_dir):
    """The Qwen3.5 demo (Gated DeltaNet layers): the cache serves the conversation so far from
    state snapshots at block ends, and the answers stay those of the cache off."""
    bench = load_script("multi_turn_cache")
    args = argparse.Namespace(model=str(demo_qwen3_5_dir), conversations=2, turns=3, max_tokens=4, system_words=40,
                              num_kv_blocks=256, kv_cache_memory_gb=None, mamba_track_interval=None)
    on, off = bench.run(args, True), bench.run(args, False)
    later = [t for t in on.turns if t.turn > 0]
    assert all(t.cached_tokens > 0 for t in later)
    assert sum(t.cached_tokens for t in later) >= 0.9 * sum(t.reusable_tokens for t in later)
    assert [t.cached_tokens for t in off.turns] == [0] * 6
    assert on.hits_agree
    assert [t.answer_ids for t in on.turns] == [t.answer_ids for t in off.turns]


@pytest.mark.e2e
def test_the_servers_run_prints_each_servers_row(demo_qwen3_5_dir, capsys, monkeypatch):
    """benchmarks/multi_turn_servers.py against xserv up with the cache on and off (no llama.cpp)."""
    bench = load_script("multi_turn_servers")
    monkeypatch.setattr("sys.argv", ["multi_turn_servers.py", "--model", str(demo_qwen3_5_dir), "--conversations", "1",
                                     "--turns", "3", "--max-tokens", "4", "--system-words", "40",
                                     "--xserv-args", "--dtype float32 --num-kv-blocks 256"])
    bench.main()
    out = capsys.readouterr().out
    on = next(line for line in out.splitlines() if line.startswith("| xserv, prefix cache on |"))
    off = next(line for line in out.splitlines() if line.startswith("| xserv, prefix cache off |"))
    assert not on.endswith("| 0 (0.00) |") and off.endswith("| 0 (0.00) |")
