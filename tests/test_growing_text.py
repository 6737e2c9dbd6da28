"""The server's incremental detokenization (server/streaming.py GrowingText): after every token its text is
the decode of the whole list, wherever that decode ends in a complete character, for decoders that join
their tokens' bytes, split multi-byte characters across tokens, or clean up spaces across tokens."""

from __future__ import annotations

import pytest

pytest.importorskip("starlette")
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from kvcodec.server.streaming import GrowingText  # noqa: E402

# byte pieces of tokens: ASCII words and spaces, whole and split multi-byte characters
PIECES = [
    b"a",
    b" b",
    b" ",
    b".",
    b".x",
    b"\xc3",
    b"\xa9",
    b"\xe2\x82",
    b"\xac",
    "é".encode(),
    " ü".encode(),
    b"\xf0\x9f",
    b"\x98\x80",
]


def joined(ids: list[int]) -> str:
    return b"".join(PIECES[i] for i in ids).decode("utf-8", errors="replace")


def cleaned(ids: list[int]) -> str:
    """A decoder whose text is not its tokens' texts joined: " ." becomes "." across tokens."""
    return joined(ids).replace(" .", ".")


def stripped(ids: list[int]) -> str:
    """A decoder that drops the leading space of its first token (as SentencePiece's does)."""
    return joined(ids).removeprefix(" ")


@settings(max_examples=400, deadline=None)
@given(st.sampled_from([joined, cleaned, stripped]), st.lists(st.integers(0, len(PIECES) - 1), max_size=150))
def test_the_grown_text_is_the_whole_decode_at_every_complete_character(decode, ids):
    grown = GrowingText(decode)
    for k, tok in enumerate(ids, 1):
        text, whole = grown.add(tok), decode(ids[:k])
        if not whole.endswith("\ufffd"):
            assert text == whole
        else:  # waiting for the character's last bytes: what it holds is text of the whole decode
            assert whole.startswith(text) or text == decode(ids[: k - 1]).rstrip("\ufffd")


def test_a_long_list_is_decoded_a_window_at_a_time():
    calls = []

    def counted(ids):
        calls.append(len(ids))
        return joined(ids)

    grown = GrowingText(counted)
    for _ in range(2000):
        grown.add(0)
    assert grown.text == "a" * 2000 and max(calls) <= 2 * GrowingText.CONTEXT + 2
