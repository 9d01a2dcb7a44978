"""Stop strings across token boundaries, and the end of a stream."""

from __future__ import annotations

from service.engine.stopping import StopMatcher


def test_held_text_is_released_or_cut():
    m = StopMatcher(["END", ""])  # an empty stop string is ignored
    assert m.push("abcE") == ("abc", False)  # "E" may begin "END": held
    assert m.push("Nx") == ("ENx", False)
    assert m.push("yEN") == ("y", False)
    assert m.push("D and more") == ("", True)


def test_the_end_of_a_stream_matches_across_the_held_text():
    m = StopMatcher(["ab"])
    assert m.push("xa") == ("x", False)
    assert m.finish("b") == ("", True)
    m = StopMatcher(["ab"])
    assert m.push("xa") == ("x", False)
    assert m.finish("c") == ("ac", False)


def test_a_character_cut_by_the_end_of_the_stream_is_no_stop_string():
    """max_tokens can end a stream inside a multi-byte character: the detokenizer's last text then ends with
    U+FFFD, which the model never produced, so a stop string "\\ufffd" must not turn "length" into "stop"."""
    m = StopMatcher(["\ufffd"])
    assert m.push("🌟🌟") == ("🌟🌟", False)
    assert m.finish("\ufffd") == ("\ufffd", False)
    m = StopMatcher(["x\ufffd"])
    assert m.finish("ax\ufffd") == ("ax\ufffd", False)
    m = StopMatcher(["\ufffd"])  # a U+FFFD inside the text is real output: it matches
    assert m.finish("a\ufffdb") == ("a", True)
