"""The high/low bit split and the packed low bit planes (pure functions, property-based)."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcodec.quant import bitsplit


@st.composite
def unit_samples(draw):
    units = draw(st.integers(1, 6))
    tokens = draw(st.integers(1, 12))
    dim = draw(st.sampled_from([8, 16, 24]))
    bits = torch.tensor([draw(st.integers(2, 8)) for _ in range(units)])
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    samples = torch.randint(0, 256, (units, tokens, dim), generator=g, dtype=torch.int64)
    samples = (samples % (2**bits).view(-1, 1, 1)).to(torch.uint8)
    return samples, bits


@given(unit_samples(), st.integers(1, 8))
@settings(max_examples=80, deadline=None)
def test_split_join_round_trip_and_ranges(data, video_bits):
    samples, bits = data
    counts = bitsplit.low_bit_counts(bits, video_bits)
    assert torch.equal(counts, (bits - video_bits).clamp(min=0))
    high, low = bitsplit.split(samples, counts)
    assert torch.equal(bitsplit.join(high, low, counts), samples)
    top = torch.minimum(bits, torch.full_like(bits, video_bits))
    assert (high.long() < (2**top).view(-1, 1, 1)).all()
    assert (low.long() < (2**counts).view(-1, 1, 1)).all()


@given(unit_samples(), st.integers(1, 8), st.data())
@settings(max_examples=80, deadline=None)
def test_packed_planes_round_trip_whole_and_per_token_slice(data, video_bits, draw):
    samples, bits = data
    units, tokens, dim = samples.shape
    counts = bitsplit.low_bit_counts(bits, video_bits)
    _, low = bitsplit.split(samples, counts)
    planes = bitsplit.pack_low(low, counts)
    assert planes.shape == (bitsplit.plane_count(counts), tokens * units * dim // 8)
    assert torch.equal(bitsplit.unpack_low(planes, units, dim), low) or planes.shape[0] == 0
    first = draw.draw(st.integers(0, tokens - 1))
    n = draw.draw(st.integers(1, tokens - first))
    part = bitsplit.unpack_low(bitsplit.plane_slice(planes, first, n, units, dim), units, dim)
    if planes.shape[0]:
        assert torch.equal(part, low[:, first : first + n])
    else:
        assert part.shape == (units, 0, dim) or (part == 0).all()


def test_unit_without_low_bits_leaves_its_plane_bits_zero():
    samples = torch.full((2, 4, 8), 0b1011, dtype=torch.uint8)
    counts = bitsplit.low_bit_counts(torch.tensor([4, 2]), 2)  # unit 0 keeps 2 low bits, unit 1 none
    _, low = bitsplit.split(samples, counts)
    planes = bitsplit.pack_low(low, counts)
    # token-major: per token 8 values of unit 0 (one byte) then 8 of unit 1 (one byte, all zero)
    assert planes.shape == (2, 8)
    assert planes[0].tolist() == [255, 0] * 4 and planes[1].tolist() == [255, 0] * 4


def test_pack_refuses_a_shape_that_does_not_fill_whole_bytes():
    assert not bitsplit.can_split(3, 5)
    with pytest.raises(ValueError):
        bitsplit.pack_low(torch.zeros(3, 2, 5, dtype=torch.uint8), torch.tensor([1, 1, 1]))


@given(unit_samples(), st.integers(1, 8))
@settings(max_examples=40, deadline=None)
def test_numpy_and_torch_plane_packing_agree(data, video_bits):
    samples, bits = data
    units, tokens, dim = samples.shape
    counts = bitsplit.low_bit_counts(bits, video_bits)
    planes = bitsplit.plane_count(counts)
    _, low = bitsplit.split(samples, counts)
    if (units * dim) % 8 or planes == 0:
        return
    flat = low.permute(1, 0, 2).reshape(-1)
    assert torch.equal(bitsplit.pack_low(low, counts), bitsplit.pack_planes_torch(flat, planes))
