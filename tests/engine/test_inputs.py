"""check_prompt: the one place that refuses a prompt no model can continue, naming the field."""

import pytest

from xserv_engine.errors import InvalidRequest
from xserv_engine.inputs import ChatInput, check_prompt

VOCAB = 1000


@pytest.mark.parametrize("prompt, field", [
    ("", "text"),
    ([], "token_ids"),
    ([1, VOCAB], "token_ids"),
    ([-1], "token_ids"),
    (ChatInput(messages=[]), "chat.messages"),
])
def test_empty_or_impossible_prompts_name_the_field(prompt, field):
    with pytest.raises(InvalidRequest) as info:
        check_prompt(prompt, VOCAB)
    assert info.value.field == field


@pytest.mark.parametrize("prompt", ["hi", [0, VOCAB - 1], ChatInput(messages=[{"role": "user", "content": "hi"}])])
def test_servable_prompts_pass(prompt):
    check_prompt(prompt, VOCAB)
