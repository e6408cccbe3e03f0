"""benchmarks/multi_turn_cache.py in a tiny run (2 conversations x 3 turns, 4-token answers) on
the demo model: every reusable prompt token comes from the cache, and only with the cache on."""

import argparse

from tests.bench.test_benchmark_scripts import load_script


def test_a_tiny_multi_turn_run_serves_every_reusable_token_from_the_cache(demo_dir):
    bench = load_script("multi_turn_cache")
    args = argparse.Namespace(model=str(demo_dir), conversations=2, turns=3, max_tokens=4, system_words=40,
                              num_kv_blocks=256)
    on, off = bench.run(args, True), bench.run(args, False)
    assert [(t.conversation, t.turn) for t in on.turns] == [(c, t) for c in range(2) for t in range(3)]
    reusable = [t.reusable_tokens for t in on.turns]
    assert all(r > 0 for r, t in zip(reusable, on.turns) if t.turn > 0)  # the conversation so far
    assert [t.cached_tokens for t in on.turns] == reusable
    assert [t.cached_tokens for t in off.turns] == [0] * 6
    assert on.hits_agree and off.hits_agree
    assert [t.answer_ids for t in on.turns] == [t.answer_ids for t in off.turns]
    assert "| on | 1.000 (" in bench.summary("on", on)
