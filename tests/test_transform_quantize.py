"""The transform codec's quantizer math (transform/quantize.py, rate.py): per-token step scale,
bin-centroid reconstruction offset, the entropy the size search measures. Pure functions, hypothesis."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcodec.transform import quantize, rate


@given(st.integers(1, 300), st.integers(0, 400), st.integers(0, quantize.MAX_FINE_BITS))
def test_token_scales_make_the_last_tokens_finer(tokens, fine, bits):
    s = quantize.token_scales(tokens, fine, bits)
    n_fine = min(fine, tokens) if bits else 0
    assert s.shape == (tokens,)
    assert torch.equal(s[: tokens - n_fine], torch.ones(tokens - n_fine))
    assert torch.equal(s[tokens - n_fine :], torch.full((n_fine,), 2.0**-bits))


@settings(max_examples=50, deadline=None)
@given(
    st.integers(1, 40),
    st.integers(1, 30),
    st.integers(0, 40),
    st.integers(0, 3),
    st.floats(1e-3, 1e3),
    st.integers(0, 2**31 - 1),
)
def test_finer_tokens_are_restored_within_their_own_half_step(tokens, d, fine, bits, scale, seed):
    g = torch.Generator().manual_seed(seed)
    y = torch.randn(tokens, d, generator=g, dtype=torch.float64) * scale
    steps = torch.rand(d, generator=g, dtype=torch.float64) * scale + scale / 10
    ts = quantize.token_scales(tokens, fine, bits, torch.float64)
    q = quantize.quantize(y, steps, ts)
    back = quantize.dequantize(q, steps, torch.float64, token_scale=ts)
    assert ((back - y).abs() <= steps[None, :] * ts[:, None] / 2 * (1 + 1e-9)).all()
    assert torch.equal(back, q.double() * steps[None, :] * ts[:, None])  # "centre": the bin centre


@given(st.lists(st.floats(0.0, 50.0), min_size=1, max_size=40))
def test_recon_offset_is_in_half_a_step_and_grows_with_the_step(ratios):
    r = torch.tensor(sorted(ratios), dtype=torch.float64)
    d = quantize.recon_offset(r)
    assert ((d >= 0) & (d < 0.5)).all()
    assert (d[1:] >= d[:-1] - 1e-12).all()
    small = r < 1e-3
    assert torch.allclose(d[small], r[small] * math.sqrt(2) / 12, rtol=1e-3, atol=1e-12)


@settings(max_examples=30, deadline=None)
@given(st.floats(0.05, 4.0), st.integers(1, 5))
def test_recon_offset_is_the_centroid_of_a_laplacian_bin(ratio, q):
    """Numerical centroid of the bin [q - 1/2, q + 1/2) steps under a Laplacian of deviation 1."""
    step, b = ratio, 1 / math.sqrt(2)
    x = torch.linspace((q - 0.5) * step, (q + 0.5) * step, 20001, dtype=torch.float64)
    w = torch.exp(-x / b)
    centroid = float((x * w).sum() / w.sum()) / step
    assert abs((q - centroid) - float(quantize.recon_offset(torch.tensor(ratio)))) < 1e-4


def test_laplace_reconstruction_lowers_the_error_of_laplacian_data():
    g = torch.Generator().manual_seed(0)
    sigmas = torch.tensor([1.0, 1.0, 1.0, 1.0], dtype=torch.float64)
    steps = torch.tensor([0.3, 1.0, 2.0, 3.0], dtype=torch.float64)  # ~3 bits down to ~0.5 bit
    e = torch.empty(200_000, 4, dtype=torch.float64).exponential_(generator=g)
    sign = torch.randint(0, 2, e.shape, generator=g) * 2 - 1
    y = e * sign / math.sqrt(2)  # Laplacian, deviation 1
    q = quantize.quantize(y, steps)
    err = {
        r: (quantize.dequantize(q, steps, torch.float64, sigmas=sigmas, recon=r) - y).pow(2).mean(0)
        for r in quantize.RECONS
    }
    assert (err["laplace"] < err["centre"]).all()
    assert float(err["laplace"][3] / err["centre"][3]) < 0.9  # coarse steps gain most (0.83 here)
    with pytest.raises(ValueError):
        quantize.dequantize(q, steps, recon="median")


@settings(max_examples=50, deadline=None)
@given(st.integers(1, 60), st.integers(1, 20), st.floats(0.1, 400.0), st.integers(0, 2**31 - 1))
def test_column_entropy_is_the_order0_entropy_of_each_column(t, c, scale, seed):
    g = torch.Generator().manual_seed(seed)
    q = (torch.randn(t, c, generator=g) * scale).round().to(torch.int32)
    want = 0.0
    for j in range(c):
        col = q[:, j].clamp(-128, 127)
        _, counts = torch.unique(col, return_counts=True)
        p = counts.double() / t
        want += -float((p * torch.log2(p)).sum()) * t
    want += rate.ESCAPE_BITS * int(((q < -128) | (q > 127)).sum())
    assert rate.column_entropy_bits(q) == pytest.approx(want, rel=1e-9, abs=1e-6)
