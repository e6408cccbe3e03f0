"""Stop strings end the text at the right place and never leak."""

from xserv_engine.tokenizer.stop import StopStringMatcher


def run(matcher, pieces):
    shown, matched = [], None
    for piece in pieces:
        text, matched = matcher.feed(piece)
        shown.append(text)
        if matched is not None:
            return "".join(shown), matched
    return "".join(shown) + matcher.flush(), None


def test_stop_inside_one_piece():
    assert run(StopStringMatcher(("STOP",), False), ["abc STOP def"]) == ("abc ", "STOP")


def test_stop_split_across_many_pieces_never_leaks():
    matcher = StopStringMatcher(("</answer>",), False)
    shown = []
    for piece in ["The answer is 42", "<", "/ans", "we", "r>", " trailing"]:
        text, matched = matcher.feed(piece)
        shown.append(text)
        assert "<" not in "".join(shown)
        if matched:
            break
    assert "".join(shown) == "The answer is 42"
    assert matched == "</answer>"


def test_include_stop():
    assert run(StopStringMatcher(("\n\n",), True), ["para one\n", "\npara two"]) == ("para one\n\n", "\n\n")


def test_multiple_stops_first_occurrence_wins():
    matcher = StopStringMatcher(("world", "lo w", "xyz"), False)
    assert run(matcher, ["hel", "lo wor", "ld"]) == ("hel", "lo w")
    matcher = StopStringMatcher(("ab", "abc"), True)
    assert run(matcher, ["xxabcd"]) == ("xxabc", "abc")


def test_prefix_that_does_not_complete_is_released():
    matcher = StopStringMatcher(("STOP",), False)
    assert matcher.feed("go ST") == ("go ", None)
    assert matcher.feed("O") == ("", None)
    assert matcher.feed("RM now") == ("STORM now", None)


def test_flush_returns_a_partial_prefix_that_never_matched():
    matcher = StopStringMatcher(("<|stop|>",), False)
    assert matcher.feed("end <|st") == ("end ", None)
    assert matcher.flush() == "<|st"
    assert matcher.flush() == ""


def test_unicode_and_overlapping_prefixes():
    assert run(StopStringMatcher(("。\n",), False), ["你好。", "。", "\n再见"]) == ("你好。", "。\n")
    assert run(StopStringMatcher(("aab",), False), ["a", "a", "a", "a", "b", "c"]) == ("aa", "aab")


def test_no_stops_passes_text_through():
    matcher = StopStringMatcher((), False)
    assert matcher.feed("anything") == ("anything", None)
    assert matcher.flush() == ""
