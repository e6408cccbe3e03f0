"""The step's bitmask fills on a thread beside the forward pass: a model step that fails while a
fill is in flight fails only its own requests, and the constrained requests after it still get
valid answers, with every matcher freed."""

import json

import jsonschema

from tests.engine.conftest import make_engine
from tests.structured.schemas import PERSON
from tests.structured.test_engine import PERSON_CONSTRAINT, assert_all_freed, run_concurrently


def test_a_step_that_fails_with_a_fill_in_flight_fails_only_its_requests(demo_dir):
    engine = make_engine(demo_dir, max_model_len=512, num_kv_blocks=128)
    runner = engine.engine.runner
    real_run, calls = runner.run, []

    def fail_the_third_step(batch):
        calls.append(len(batch.sampled))
        if len(calls) == 3:  # a decode step: its constrained rows' fill has started
            raise RuntimeError("injected model failure")
        return real_run(batch)

    runner.run = fail_the_third_step
    try:
        first = run_concurrently(engine, 4, max_tokens=200, temperature=1.0, constraint=PERSON_CONSTRAINT)
        failed = [c for c in first if c.final().finish_reason == "abort"]
        assert failed and all(c.final().error for c in failed)
        for collector in first:
            if collector not in failed:
                jsonschema.validate(json.loads(collector.text()), PERSON)
        after = run_concurrently(engine, 4, max_tokens=200, temperature=1.0, constraint=PERSON_CONSTRAINT)
        for collector in after:
            assert collector.final().finish_reason == "stop"
            jsonschema.validate(json.loads(collector.text()), PERSON)
        assert_all_freed(engine)
    finally:
        engine.shutdown()
