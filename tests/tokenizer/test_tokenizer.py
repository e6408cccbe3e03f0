"""Loading a model directory's tokenizer: files, template precedence, clear errors."""

import json
import shutil

import pytest

from xserv_engine.errors import InvalidRequest, ModelLoadError
from xserv_engine.inputs import ChatInput
from xserv_engine.tokenizer.tokenizer import Tokenizer

HELLO = ChatInput([{"role": "user", "content": "hello"}])


@pytest.fixture
def model_dir(demo_dir, tmp_path):
    """A copy of the demo tokenizer files without chat_template.jinja."""
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(demo_dir / name, tmp_path / name)
    return tmp_path


def set_config_template(model_dir, template):
    config = json.loads((model_dir / "tokenizer_config.json").read_text())
    config["chat_template"] = template
    (model_dir / "tokenizer_config.json").write_text(json.dumps(config))


def test_missing_tokenizer_json_is_a_clear_load_error(tmp_path):
    with pytest.raises(ModelLoadError, match="no tokenizer.json"):
        Tokenizer.from_dir(tmp_path)


def test_broken_files_are_load_errors(model_dir):
    (model_dir / "tokenizer_config.json").write_text("{not json")
    with pytest.raises(ModelLoadError, match="tokenizer_config.json"):
        Tokenizer.from_dir(model_dir)
    (model_dir / "tokenizer.json").write_text("{}")
    with pytest.raises(ModelLoadError, match="tokenizer.json"):
        Tokenizer.from_dir(model_dir)


def test_chat_template_file_wins_over_config(model_dir):
    set_config_template(model_dir, "config:{{ messages[0].content }}")
    assert Tokenizer.from_dir(model_dir).render_chat(HELLO) == "config:hello"
    (model_dir / "chat_template.jinja").write_text("file:{{ messages[0].content }}")
    assert Tokenizer.from_dir(model_dir).render_chat(HELLO) == "file:hello"


def test_named_templates_use_default(model_dir):
    named = [{"name": "tool_use", "template": "tools"}, {"name": "default", "template": "d"}]
    set_config_template(model_dir, named)
    assert Tokenizer.from_dir(model_dir).render_chat(HELLO) == "d"


def test_template_sees_special_tokens_and_kwargs(model_dir):
    template = "{{ eos_token }}|{{ bos_token is defined }}|{{ mode }}|{{ add_generation_prompt }}"
    set_config_template(model_dir, template)
    chat = ChatInput([], add_generation_prompt=False, template_kwargs={"mode": "fast"})
    assert Tokenizer.from_dir(model_dir).render_chat(chat) == "<|im_end|>|False|fast|False"


def test_no_template_is_a_request_error(model_dir):
    tokenizer = Tokenizer.from_dir(model_dir)
    assert tokenizer.encode("hello") == [14990]
    with pytest.raises(InvalidRequest, match="no chat template"):
        tokenizer.render_chat(HELLO)
