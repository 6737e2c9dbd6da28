"""Restoring chunks straight into the blocks of a paged KV cache."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import kvcodec
from kvcodec import CodecConfig, PagedKV
from kvcodec.codec import decode_chunk_blob, encode_chunks
from kvcodec.errors import ShapeError

SMALL = ((144, 144),)


def _kv(tokens, layers=2, heads=2, dim=32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(layers, 2, tokens, heads, dim, generator=g) * torch.linspace(0.1, 2, dim)).half()


@given(st.integers(1, 70), st.sampled_from([4, 16, 32]), st.sampled_from(["int8", "int4", "exact"]), st.data())
@settings(max_examples=12, deadline=None)
def test_paged_restore_equals_dense_restore_through_the_block_table(tokens, block_size, quant, data):
    kv = _kv(tokens, seed=tokens)
    encoded = kvcodec.encode(kv, CodecConfig(quant=quant, chunk_tokens=24, resolutions=SMALL, search_layout=False))
    dense = kvcodec.decode(encoded)
    n_blocks = -(-tokens // block_size)
    total = n_blocks + 3
    table = data.draw(st.permutations(list(range(total))))[:n_blocks]
    pages = torch.full((2, 2, total, block_size, 2, 32), float("nan"), dtype=torch.float16)
    paged = PagedKV(pages, torch.tensor(table))
    assert kvcodec.decode(encoded, out=paged) is paged
    got = paged.gather(0, tokens)
    assert torch.equal(got.view(torch.int16), dense.view(torch.int16))
    unused = sorted(set(range(total)) - set(table))
    assert torch.isnan(pages[:, :, unused]).all()  # nothing written outside the sequence's blocks


def test_a_chunk_fills_its_own_tokens_from_its_start_token():
    kv = _kv(60)
    chunks = encode_chunks(kv, CodecConfig(quant="int8", chunk_tokens=24, resolutions=SMALL))
    pages = torch.zeros((2, 2, 8, 8, 2, 32), dtype=torch.float16)
    paged = PagedKV(pages, torch.tensor([7, 6, 5, 4, 3, 2, 1, 0]))
    decode_chunk_blob(chunks[1].blobs[0], out=paged)  # tokens 24..47 only
    ref = decode_chunk_blob(chunks[1].blobs[0])
    assert torch.equal(paged.gather(24, 24), ref)
    assert not paged.gather(0, 24).any() and not paged.gather(48, 16).any()


@pytest.mark.parametrize(
    "pages, table",
    [
        (torch.zeros((2, 2, 4, 8, 2, 32), dtype=torch.float16), [0, 1]),  # covers 16 of 40 tokens
        (torch.zeros((2, 2, 8, 8, 3, 32), dtype=torch.float16), list(range(5))),  # wrong heads
        (torch.zeros((2, 2, 8, 8, 2, 32), dtype=torch.float32), list(range(5))),  # wrong dtype
    ],
)
def test_pages_that_cannot_hold_the_prefix_are_refused(pages, table):
    encoded = kvcodec.encode(_kv(40), CodecConfig(quant="int8", chunk_tokens=24, resolutions=SMALL))
    with pytest.raises(ShapeError):
        kvcodec.decode(encoded, out=PagedKV(pages, torch.tensor(table)))


def test_block_ids_outside_the_pool_are_refused():
    with pytest.raises(ShapeError):
        PagedKV(torch.zeros((1, 2, 4, 8, 1, 8)), torch.tensor([0, 4]))
    with pytest.raises(ShapeError):
        PagedKV(torch.zeros((1, 2, 8, 1, 8)), torch.tensor([0]))


@pytest.mark.parametrize(
    "table, why",
    [([0, 2, 0], "more than once"), ([0.0, 1.0], "integers"), ([0.7, 1.2], "integers"), ([True, False], "integers")],
)
def test_a_block_table_naming_a_block_twice_or_not_of_integers_is_refused(table, why):
    """Two runs of one sequence in one block would overwrite each other; a float table was truncated to ids."""
    with pytest.raises(ShapeError, match=why):
        PagedKV(torch.zeros((1, 2, 4, 8, 1, 8)), torch.tensor(table))
    assert PagedKV(torch.zeros((1, 2, 4, 8, 1, 8)), [3, 0, 2]).block_table.tolist() == [3, 0, 2]
