import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcodec.errors import ConfigError
from kvcodec.layout.tiling import (
    PAD_SAMPLE,
    PLANES,
    LayoutPlan,
    candidate_plans,
    frame_blocks,
    pack_frame,
    pixel_positions,
    unpack_frame,
)

shapes = st.tuples(
    st.sampled_from([(144, 144), (256, 256), (512, 256), (160, 320)]),
    st.integers(1, 60),  # units
    st.sampled_from([16, 32, 64, 128]),  # head_dim
    st.sampled_from([1, 16, 100, 256]),  # chunk tokens
)


@given(shapes)
@settings(max_examples=60, deadline=None)
def test_every_candidate_is_a_valid_injective_layout(shape):
    (w, h), units, dim, chunk = shape
    try:
        plans = candidate_plans(w, h, units, dim, chunk)
    except ConfigError:
        return  # too many heads for the frame: refused with a clear error
    for plan in plans:
        assert 1 <= plan.tokens_per_frame <= chunk
        assert plan.capacity >= units
        pos = pixel_positions(plan)
        assert pos.numel() == units * plan.tokens_per_frame * dim
        assert pos.unique().numel() == pos.numel()
        assert int(pos.max()) < PLANES * w * h


@given(shapes, st.integers(0, 1000))
@settings(max_examples=40, deadline=None)
def test_no_tile_mixes_two_heads(shape, seed):
    (w, h), units, dim, chunk = shape
    try:
        plan = candidate_plans(w, h, units, dim, chunk)[seed % 3 if seed % 3 < 1 else 0]
    except ConfigError:
        return
    pos = pixel_positions(plan).view(units, -1)
    plane = pos // (w * h)
    y = (pos % (w * h)) // w
    x = pos % w
    tile_id = (plane * plan.tiles_y + y // plan.tile_h) * plan.tiles_x + x // plan.tile_w
    for u in range(units):
        assert tile_id[u].unique().numel() == 1  # one unit, one tile
    assert tile_id[:, 0].unique().numel() == units  # and no two units share a tile


@given(shapes, st.integers(0, 2**31 - 1))
@settings(max_examples=40, deadline=None)
def test_pack_then_unpack_is_identity(shape, seed):
    (w, h), units, dim, chunk = shape
    try:
        plan = candidate_plans(w, h, units, dim, chunk)[0]
    except ConfigError:
        return
    g = torch.Generator().manual_seed(seed)
    block = torch.randint(0, 256, (units, plan.tokens_per_frame, dim), generator=g, dtype=torch.uint8)
    frame = pack_frame(block, plan)
    assert frame.shape == (PLANES, h, w)
    assert torch.equal(unpack_frame(frame, plan), block)


def test_frame_blocks_cover_all_tokens_and_pad_the_last():
    plan = candidate_plans(144, 144, 4, 16, 10)[0]
    data = torch.arange(4 * 23 * 16).remainder(251).to(torch.uint8).view(4, 23, 16)
    got = list(frame_blocks(data, plan))
    assert sum(n for _, n, _ in got) == 23
    start, n, last = got[-1]
    assert torch.equal(last[:, :n], data[:, start:])
    assert (last[:, n:] == PAD_SAMPLE).all()  # a constant: next to free for x265 (a repeated token was not)


def test_plan_rejects_impossible_shapes():
    with pytest.raises(ConfigError):
        LayoutPlan(144, 144, 4, 16, tokens_per_frame=10, tile_w=16, tile_h=11)
    with pytest.raises(ConfigError, match="no tile layout"):
        candidate_plans(144, 144, 10_000, 128, 256)
