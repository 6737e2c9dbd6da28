"""codecs.base: a chunk restored in another dtype than it was stored in (narrowed_checked, decode_chunk_as)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from kvcodec.codecs.base import decode_chunk_as, narrowed_checked, stored_dtype
from kvcodec.codecs.raw import RawCodec
from kvcodec.errors import ShapeError

FINITE = st.floats(-1e38, 1e38, allow_nan=False)


@given(st.lists(FINITE, min_size=1, max_size=64))
def test_narrowing_refuses_exactly_the_finite_values_float16_cannot_hold(values):
    kv = torch.tensor(values, dtype=torch.bfloat16)
    fits = bool(torch.isfinite(kv.to(torch.float16)).all())
    if fits:
        assert torch.equal(narrowed_checked(kv, torch.float16, "chunk 0"), kv.to(torch.float16))
    else:
        with pytest.raises(ShapeError, match="chunk 0 restores torch.bfloat16 values beyond"):
            narrowed_checked(kv, torch.float16, "chunk 0")


@given(st.lists(FINITE, min_size=1, max_size=64))
def test_widening_returns_the_tensor_itself_for_the_copy_to_cast(values):
    kv = torch.tensor(values, dtype=torch.float16)
    assert narrowed_checked(kv, torch.bfloat16, "c") is kv
    assert narrowed_checked(kv, torch.float32, "c") is kv


def test_values_already_inf_or_nan_are_not_refused():
    kv = torch.tensor([float("inf"), float("nan"), 1.0], dtype=torch.bfloat16)
    out = narrowed_checked(kv, torch.float16, "c")
    assert out[0] == float("inf") and out[1].isnan() and out[2] == 1


def test_decode_chunk_as_casts_or_refuses_and_checks_the_shape():
    codec = RawCodec(chunk_tokens=4)
    kv = torch.randn(2, 2, 4, 3, 8, dtype=torch.bfloat16)
    blob = next(iter(codec.encode_chunks(kv))).blobs[0]
    assert stored_dtype(codec.inspect_chunk(blob)) == torch.bfloat16
    got = decode_chunk_as(codec, blob, (2, 2, 4, 3, 8), torch.float32, "cpu", "chunk 0")
    assert got.dtype == torch.float32 and torch.equal(got, kv.float())
    assert torch.equal(decode_chunk_as(codec, blob, (2, 2, 4, 3, 8), torch.float16, "cpu", "c"), kv.half())
    kv[1, 1, 2, 0, 0] = 1e6
    big = next(iter(codec.encode_chunks(kv))).blobs[0]
    with pytest.raises(ShapeError, match="beyond the range"):
        decode_chunk_as(codec, big, (2, 2, 4, 3, 8), torch.float16, "cpu", "c")
    with pytest.raises(ShapeError, match=r"holds \(2, 2, 4, 3, 8\); the target takes \(2, 2, 4, 2, 8\)"):
        decode_chunk_as(codec, blob, (2, 2, 4, 2, 8), torch.bfloat16, "cpu", "c")


@pytest.mark.parametrize("dtype", [torch.uint8, torch.int8, torch.float8_e4m3fn])
def test_a_cache_of_integers_or_fp8_is_refused_by_name_not_cast(dtype):
    # vLLM's int8/fp8 caches: torch.finfo raised TypeError out of the connector for integer ones; fp8 saturated
    # silently, without vLLM's k/v scales
    codec = RawCodec(chunk_tokens=4)
    blob = next(iter(codec.encode_chunks(torch.randn(2, 2, 4, 3, 8, dtype=torch.float16)))).blobs[0]
    with pytest.raises(ShapeError, match="is not one kvcodec restores into"):
        decode_chunk_as(codec, blob, (2, 2, 4, 3, 8), dtype, "cpu", "chunk 0")
