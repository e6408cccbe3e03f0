"""Prefix caching on hybrid models (engine/block_manager.py): a hit restores a snapshot of the
linear-attention states at the end of its last block, and only the rest of the prompt is
computed. What a user notices: the cached tokens usage reports, and greedy answers that equal
transformers' with or without a hit."""

import logging

import pytest

from tests.engine.conftest import generate, make_engine
from tests.engine.test_fidelity import hf_greedy
from tests.engine.test_hybrid_models import assert_idle_with_every_slot_free, hybrid, prompts  # noqa: F401 (a fixture)
from xserv_engine.errors import InvalidRequest


def ask(engine, model, prompt: list[int], tokens: int = 6) -> int:
    """Greedy tokens of `prompt`, checked against transformers'; returns the cached prompt tokens."""
    out = generate(engine, prompt, max_tokens=tokens, temperature=0.0, ignore_eos=True)
    assert out.token_ids() == hf_greedy(model, tuple(prompt), tokens)
    return out.final().usage.cached_prompt_tokens


@pytest.mark.parametrize("budget", [8192, 24], ids=["whole-prompts", "prompts-in-24-token-chunks"])
def test_each_turn_of_a_conversation_resumes_where_the_last_prompt_ended(hybrid, budget):
    """A chat re-sends its history: from the second turn on, everything up to the last prompt's
    last full block comes from the cache (chunks of 24 tokens end inside blocks of 16, so the
    snapshots come from inside a chunk too)."""
    path, model = hybrid
    engine = make_engine(path, max_num_batched_tokens=budget)
    try:
        history = prompts(11, lengths=(37,))[0]
        assert ask(engine, model, history) == 0
        for turn, more in enumerate(prompts(12, lengths=(21, 30, 9))):
            previous = len(history)
            history = history + more
            cached = ask(engine, model, history)
            assert cached == previous // 16 * 16, f"turn {turn + 2}"
        assert_idle_with_every_slot_free(engine)
    finally:
        engine.shutdown()


def test_a_prompt_that_repeats_an_answer_resumes_inside_it(hybrid):
    """An agent loop sends the model's own output back verbatim: the blocks decoding filled are
    hits too (37 prompt tokens and 30 generated: blocks end at 48 and 64 while decoding)."""
    path, model = hybrid
    engine = make_engine(path)
    try:
        prompt = prompts(20, lengths=(37,))[0]
        answer = generate(engine, prompt, max_tokens=30, temperature=0.0, ignore_eos=True).token_ids()
        assert ask(engine, model, prompt + answer + prompts(21, lengths=(10,))[0]) == 64
        assert_idle_with_every_slot_free(engine)
    finally:
        engine.shutdown()


def test_questions_after_one_system_prompt_share_its_blocks(hybrid):
    path, model = hybrid
    engine = make_engine(path)
    try:
        system = prompts(13, lengths=(50,))[0]
        first, second = (system + question for question in prompts(14, lengths=(12, 20)))
        assert ask(engine, model, first) == 0
        assert ask(engine, model, second) == 48  # the system prompt's 3 full blocks
    finally:
        engine.shutdown()


def test_snapshots_every_n_tokens_hit_at_those_boundaries_and_the_prompts_end(hybrid):
    path, model = hybrid
    engine = make_engine(path, mamba_track_interval=32)
    try:
        system = prompts(15, lengths=(60,))[0]
        first, second = (system + question for question in prompts(16, lengths=(12, 20)))
        assert ask(engine, model, first) == 0
        assert ask(engine, model, second) == 32  # a snapshot at 32, none at 48
        assert ask(engine, model, first + [7, 8, 9]) == 64  # the first prompt's last full block
    finally:
        engine.shutdown()


def test_a_small_snapshot_pool_evicts_the_oldest_and_stays_exact(hybrid):
    """Two snapshots: a long prompt keeps only its last two; the shared head of another prompt
    then misses, yet every answer equals transformers'."""
    path, model = hybrid
    engine = make_engine(path, mamba_snapshot_slots=2)
    try:
        head = prompts(17, lengths=(40,))[0]
        first, second = (head + tail for tail in prompts(18, lengths=(60, 5)))
        assert ask(engine, model, first) == 0  # 100 tokens: the snapshots at 80 and 96 are kept
        assert ask(engine, model, first + [5]) == 96
        assert ask(engine, model, second) == 0  # none left at 16 or 32
        assert ask(engine, model, second + [6]) == 32  # the second prompt's own
        bm = engine.block_manager
        assert len(bm.snapshot_of) + len(bm.free_snapshot_slots) == 2
        assert_idle_with_every_slot_free(engine)
    finally:
        engine.shutdown()


def test_another_chats_prompt_does_not_push_out_the_snapshot_a_chat_resumes_from(hybrid):
    """Three snapshots, two chats at once: the second chat's prompt (snapshots at 16, 32, 48)
    takes the first's inner ones (16, 32), not its 48, where the first chat's next turn resumes.
    Pure LRU gave the second all three and the first's next turn a miss."""
    path, model = hybrid
    engine = make_engine(path, mamba_snapshot_slots=3)
    try:
        a, b = prompts(22, lengths=(50, 50))
        assert ask(engine, model, a) == 0
        assert ask(engine, model, b) == 0
        assert ask(engine, model, a + [5, 6]) == 48
        assert ask(engine, model, b + [5, 6]) == 48
        assert_idle_with_every_slot_free(engine)
    finally:
        engine.shutdown()


def test_without_room_for_snapshots_prefix_caching_is_off_and_says_so(hybrid, caplog):
    path, model = hybrid
    with caplog.at_level(logging.INFO, logger="xserv_engine"):
        engine = make_engine(path, mamba_snapshot_slots=0)
    try:
        assert "prefix caching is off" in caplog.text
        prompt = prompts(19, lengths=(70,))[0]
        assert ask(engine, model, prompt) == ask(engine, model, prompt) == 0
    finally:
        engine.shutdown()


def test_an_interval_that_is_not_a_whole_number_of_blocks_is_refused(hybrid):
    path, _ = hybrid
    with pytest.raises(InvalidRequest, match="mamba_track_interval.*multiple of the block size"):
        make_engine(path, mamba_track_interval=24)
