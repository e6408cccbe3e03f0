"""A request with no max_tokens: the model's generation_config max_new_tokens, the engine's
--default-max-tokens, or (neither set) the rest of the context, as OpenAI's API does."""

import json
import shutil

import pytest

from tests.engine.conftest import generate, make_engine

PROMPT = "Hello there"


@pytest.fixture
def model_dir(tmp_path, tied_model_dir):
    path = tmp_path / "model"
    shutil.copytree(tied_model_dir, path)
    return path


def _set_max_new_tokens(model_dir, value):
    config_file = model_dir / "generation_config.json"
    generation = json.loads(config_file.read_text()) if config_file.is_file() else {}
    generation["max_new_tokens"] = value
    config_file.write_text(json.dumps(generation))


def _completion_tokens(engine, **params) -> tuple[int, str]:
    final = generate(engine, PROMPT, temperature=0.0, ignore_eos=True, **params).final()
    return final.usage.completion_tokens, final.finish_reason


def test_generation_config_max_new_tokens_is_the_default(model_dir):
    _set_max_new_tokens(model_dir, 5)
    engine = make_engine(model_dir, max_model_len=128)
    try:
        assert _completion_tokens(engine) == (5, "length")
        assert _completion_tokens(engine, max_tokens=9) == (9, "length")  # an explicit value wins
    finally:
        engine.shutdown()


def test_engine_flag_overrides_the_generation_config(model_dir):
    _set_max_new_tokens(model_dir, 5)
    engine = make_engine(model_dir, max_model_len=128, default_max_tokens=3)
    try:
        assert _completion_tokens(engine) == (3, "length")
    finally:
        engine.shutdown()


def test_without_a_default_the_completion_fills_the_context(model_dir):
    engine = make_engine(model_dir, max_model_len=48)
    try:
        prompt_tokens = len(engine.tokenize(PROMPT)[0])
        assert _completion_tokens(engine) == (48 - prompt_tokens, "length")
    finally:
        engine.shutdown()
