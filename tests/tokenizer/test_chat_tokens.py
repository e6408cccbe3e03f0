"""ChatTokens: each model's own ids of <think>, </think>, <tool_call>, </tool_call> and <|im_start|>,
looked up by text; Qwen3's and Qwen3.5's differ."""

from tokenizers import Tokenizer as HFTokenizer

from xserv_engine.tokenizer.chat_tokens import ChatTokens
from xserv_engine.tokenizer.tokenizer import Tokenizer

QWEN3_TOKENS = ChatTokens(think_start=151667, think_end=151668, tool_call_start=151657, tool_call_end=151658,
                          im_start=151644)
QWEN3_5_TOKENS = ChatTokens(think_start=248068, think_end=248069, tool_call_start=248058, tool_call_end=248059,
                            im_start=248045)
TEXTS = {"think_start": "<think>", "think_end": "</think>", "tool_call_start": "<tool_call>",
         "tool_call_end": "</tool_call>", "im_start": "<|im_start|>"}


def test_each_model_gets_the_ids_its_tokenizer_encodes_the_tags_to(tokenizer, demo_qwen3_5_dir):
    qwen3_5 = Tokenizer.from_dir(demo_qwen3_5_dir)
    assert (tokenizer.chat_tokens, qwen3_5.chat_tokens) == (QWEN3_TOKENS, QWEN3_5_TOKENS)
    for each in (tokenizer, qwen3_5):
        for name, text in TEXTS.items():
            assert each.encode(text) == [getattr(each.chat_tokens, name)], text


def test_a_vocabulary_without_a_tag_has_none_for_it(demo_dir):
    hf = HFTokenizer.from_file(str(demo_dir / "tokenizer.json"))
    lookup = {"<think>": None, "</think>": None}
    tokens = ChatTokens.lookup(lambda text: lookup[text] if text in lookup else hf.token_to_id(text))
    assert (tokens.think_start, tokens.think_end) == (None, None)
    assert tokens.tag_texts() == {151657: "<tool_call>", 151658: "</tool_call>"}
