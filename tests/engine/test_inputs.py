"""check_prompt: the one place that refuses a prompt no model can continue, naming the field."""

import pytest

from xserv_engine.errors import InvalidRequest
from xserv_engine.inputs import ChatInput, check_images, check_prompt, image_parts

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


def chat_with_images(*messages):
    """ChatInput of (role, content) pairs; a list content is parts, bytes in it an image."""
    return ChatInput(messages=[
        {"role": role, "content": content if isinstance(content, str) else [
            {"type": "image", "image": part} if isinstance(part, bytes) else {"type": "text", "text": part}
            for part in content]}
        for role, content in messages])


def test_image_parts_are_the_prompts_images_in_order():
    chat = chat_with_images(("system", "Be brief."), ("user", ["Compare", b"first", "with", b"second"]),
                            ("assistant", "Done."), ("user", [b"third"]))
    assert image_parts(chat) == [b"first", b"second", b"third"]
    assert image_parts("text") == [] and image_parts([1, 2]) == []


@pytest.mark.parametrize("accepts, limit, messages, field, words", [
    (False, 4, [("user", ["What is this?", b"png"])], "chat.messages[0].parts[1]", "demo does not accept images"),
    (True, 4, [("system", [b"png"]), ("user", "hi")], "chat.messages[0].parts[0]", "system message"),
    (True, 2, [("user", [b"1", b"2"]), ("user", ["and", b"3"])], "chat.messages[1].parts[1]", "at most 2 image"),
])
def test_images_a_model_cannot_take_are_refused_naming_the_part(accepts, limit, messages, field, words):
    with pytest.raises(InvalidRequest) as info:
        check_images(chat_with_images(*messages), "demo", accepts, limit)
    assert info.value.field == field and words in str(info.value)


def test_images_within_the_limit_pass_on_a_model_that_takes_them():
    check_images(chat_with_images(("user", [b"1", "and", b"2"])), "vl", True, 2)
    check_images(chat_with_images(("user", "no images")), "text-only", False, 2)
