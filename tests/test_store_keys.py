"""store.keys: text as one field of a store key, injective and reversible (hypothesis)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcodec.store.keys import SAFE, field_text, key_field


@settings(max_examples=300, deadline=None)
@given(texts=st.lists(st.text(max_size=16), min_size=2, max_size=2, unique=True))
def test_two_texts_never_share_a_field_and_each_reads_back(texts):
    fields = [key_field(t) for t in texts]
    assert fields[0] != fields[1]
    assert [field_text(f) for f in fields] == texts
    assert all(set(f) <= SAFE | {"="} for f in fields)


def test_characters_beyond_a_byte_do_not_read_as_two():
    """U+0100 was "=100" when a character's code took as many hex digits as it needed, as was "\\x10" + "0"."""
    assert key_field("\u0100") != key_field("\x100")
    assert key_field("") == "=" and key_field("a/b") == "a=2fb"


@pytest.mark.parametrize("field", ["=41", "=2F", "=2", "a=zz", "a b", "=="])
def test_other_spellings_are_not_fields(field):
    with pytest.raises(ValueError):
        field_text(field)
