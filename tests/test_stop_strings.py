"""The server's stop-string hold-back (server/streaming.py StopPrefixes): at every step it holds
back exactly the longest end of the text that begins some stop string, however the text grew or
changed, as the definition computed from scratch does."""

from __future__ import annotations

import pytest

pytest.importorskip("starlette")
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from kvcodec.server.streaming import StopPrefixes  # noqa: E402

CHARS = "ab "


def begun(text: str, stop: tuple[str, ...]) -> int:
    """The definition: the longest k < len(s), over stop strings s, with text ending in s[:k]."""
    return max((k for s in stop for k in range(min(len(s) - 1, len(text)), 0, -1) if text.endswith(s[:k])), default=0)


@settings(max_examples=300, deadline=None)
@given(
    st.lists(st.text(CHARS, min_size=0, max_size=6), max_size=3),
    st.lists(st.tuples(st.booleans(), st.text(CHARS, max_size=3)), min_size=1, max_size=8),
)
def test_held_back_text_is_the_longest_end_that_begins_a_stop(stop, steps):
    stop = tuple(stop)
    held, text = StopPrefixes(stop), ""
    for changed, piece in steps:
        if changed and text:  # a later token changed earlier text (a tokenizer merge)
            text = text[:-1] + "z"
        text += piece
        assert held.held(text) == begun(text, stop)


def test_long_stop_strings_fed_token_by_token():
    # 16 stop strings of 1023 characters and an answer of their repeated first character: the case
    # where comparing every candidate prefix at each token was quadratic (1.7 ms a token, measured);
    # the matcher reads each new character once (held.read: what it has read so far)
    held, text = StopPrefixes(tuple("a" * 1022 + "b" for _ in range(16))), ""
    for _ in range(300):
        text += "aaaa"
        assert held.held(text) == min(len(text), 1022) and held.read == text
