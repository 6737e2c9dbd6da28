"""Pure math of the transform codec: RoPE, PCA, grouping, allocation, quantization."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcodec.errors import ConfigError, CorruptStreamError
from kvcodec.transform import alloc, inverse, pca, quantize, weights
from kvcodec.transform.rope import RopeSpec, apply_rope, inv_freq, remove_rope

specs = st.builds(
    lambda theta, half_dim, frac, style, scaling: RopeSpec(
        theta, 2 * half_dim, max(2, int(2 * half_dim * frac) // 2 * 2), style, *scaling
    ),
    st.floats(10.0, 1e7),
    st.integers(1, 64),
    st.sampled_from([1.0, 0.5, 0.25]),
    st.sampled_from(["half", "interleaved"]),
    st.sampled_from([("default",), ("linear", 4.0), ("llama3", 8.0, 1.0, 4.0, 128)]),
)


@settings(max_examples=60, deadline=None)
@given(spec=specs, start=st.integers(0, 100_000), tokens=st.integers(1, 12), seed=st.integers(0, 2**31))
def test_rope_round_trip(spec, start, tokens, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(3, tokens, 2, spec.head_dim, generator=g, dtype=torch.float64)
    pos = torch.arange(start, start + tokens)
    y = apply_rope(x, pos, spec)
    assert torch.allclose(remove_rope(y, pos, spec), x, atol=1e-9)
    # a rotation keeps norms; channels beyond rotary_dim are untouched
    assert torch.allclose(y.norm(dim=-1), x.norm(dim=-1), atol=1e-9)
    assert torch.equal(y[..., spec.rotary :], x[..., spec.rotary :])


def test_rope_matches_transformers_rotate_half():
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    spec = RopeSpec(100000.0, 64)
    pos = torch.arange(5, 17)
    x = torch.randn(1, 3, 12, 64, dtype=torch.float64)  # (batch, heads, tokens, dim) as transformers holds it
    f = inv_freq(spec)
    emb = torch.cat([pos[:, None] * f[None], pos[:, None] * f[None]], dim=-1)[None]
    _, want = apply_rotary_pos_emb(x, x, emb.cos(), emb.sin())
    got = apply_rope(x[0].transpose(0, 1), pos, spec).transpose(0, 1)[None]  # ours: (tokens, heads, dim)
    assert torch.allclose(got, want, atol=1e-10)


def test_rope_rejects_bad_settings():
    with pytest.raises(ConfigError):
        RopeSpec(1e4, 64, rotary_dim=63)
    with pytest.raises(ConfigError):
        RopeSpec(1e4, 64, scaling="yarn")
    with pytest.raises(ConfigError):
        RopeSpec(float("nan"), 64)


@settings(max_examples=30, deadline=None)
@given(n=st.integers(8, 200), d=st.integers(1, 24), seed=st.integers(0, 2**31))
def test_pca_basis_orthonormal_and_decorrelates(n, d, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d, generator=g, dtype=torch.float64) @ torch.randn(d, d, generator=g, dtype=torch.float64)
    mean, basis, var = pca.fit_pca(x)
    assert torch.allclose(basis.T @ basis, torch.eye(d, dtype=torch.float64), atol=1e-8)
    assert (var[:-1] >= var[1:] - 1e-9).all()
    y = (x - mean) @ basis
    assert torch.allclose(y.var(0), var, rtol=1e-6, atol=1e-8)
    assert torch.allclose(mean + y @ basis.T, x, atol=1e-8)


def test_pca_refuses_nan_and_tiny_data():
    with pytest.raises(ConfigError, match="NaN"):
        pca.fit_pca(torch.tensor([[1.0, float("nan")], [0.0, 1.0], [2.0, 2.0]]))
    with pytest.raises(ConfigError):
        pca.fit_pca(torch.ones(1, 3))


@settings(max_examples=60, deadline=None)
@given(
    layers=st.integers(1, 80),
    layer_dim=st.integers(1, 512),
    tokens=st.integers(1, 200_000),
    max_group=st.one_of(st.none(), st.integers(1, 10)),
)
def test_group_sizes_adapt_to_data(layers, layer_dim, tokens, max_group):
    if tokens < pca.MIN_TOKENS_PER_DIM * layer_dim:
        with pytest.raises(ConfigError, match="too few"):
            pca.group_layers(layers, layer_dim, tokens, max_group=max_group)
        return
    groups = pca.group_layers(layers, layer_dim, tokens, max_group=max_group)
    assert [i for g in groups for i in g] == list(range(layers))
    sizes = [len(g) for g in groups]
    assert max(sizes) - min(sizes) <= 1
    if max(sizes) > 1:  # a group of several layers only when the data supports it
        assert tokens >= pca.TARGET_TOKENS_PER_DIM * layer_dim * (max(sizes) - 1)
    if max_group is not None:
        assert max(sizes) <= max_group


variances = st.lists(st.floats(1e-6, 1e4), min_size=1, max_size=300).map(
    lambda v: torch.tensor(sorted(v, reverse=True), dtype=torch.float64)
)


@settings(max_examples=60, deadline=None)
@given(v=variances, bits=st.floats(0.05, 8.0))
def test_water_filling_meets_budget(v, bits):
    theta = alloc.water_level(v, bits)
    got = float(alloc.coordinate_bits(v, theta).mean())
    assert got <= bits + 1e-6
    # budget met unless every coordinate is already cheaper than asked
    full = float(alloc.coordinate_bits(v, theta * 0.999).mean())
    assert full >= bits - 1e-3 or got == pytest.approx(bits, abs=1e-3)
    steps = alloc.steps_for(v, theta)
    dropped = v <= theta
    assert (steps[dropped] == 0).all() and (steps[~dropped] > 0).all()
    assert torch.allclose(steps[~dropped], torch.full_like(steps[~dropped], math.sqrt(12 * theta)))


def test_water_filling_gives_zero_bits_to_small_coordinates():
    v = torch.tensor([100.0, 10.0, 1.0, 1e-4, 1e-6])
    theta = alloc.water_level(v, 1.0)
    b = alloc.coordinate_bits(v, theta)
    assert b[0] > b[1] > 0 and b[-1] == 0 and b[-2] == 0
    with pytest.raises(ConfigError):
        alloc.water_level(v, 0.0)


@settings(max_examples=60, deadline=None)
@given(
    shape=st.tuples(st.integers(1, 20), st.integers(1, 30)), scale=st.floats(0.01, 1000.0), seed=st.integers(0, 2**31)
)
def test_quantize_error_bounded_by_half_step(shape, scale, seed):
    g = torch.Generator().manual_seed(seed)
    y = torch.randn(*shape, generator=g, dtype=torch.float64) * scale
    steps = torch.rand(shape[1], generator=g, dtype=torch.float64) * 2 + 0.01
    q = quantize.quantize(y, steps)
    assert ((quantize.dequantize(q, steps, torch.float64) - y).abs() <= steps / 2 + 1e-9).all()


@settings(max_examples=60, deadline=None)
@given(values=st.lists(st.integers(-100_000, 100_000), min_size=1, max_size=400))
def test_samples_and_escapes_are_lossless(values):
    q = torch.tensor(values, dtype=torch.int32).reshape(1, -1)
    samples, idx, vals = quantize.to_samples(q)
    assert samples.dtype == torch.uint8
    raw = quantize.pack_escapes(idx, vals)
    i2, v2 = quantize.unpack_escapes(raw)
    assert torch.equal(quantize.from_samples(samples, i2, v2), q)
    assert idx.size == sum(1 for v in values if not -128 <= v <= 127)


def test_escape_stream_damage_is_an_error():
    raw = quantize.pack_escapes(np.array([3, 9], np.int64), np.array([500, -700], np.int32))
    with pytest.raises(CorruptStreamError):
        quantize.unpack_escapes(raw[:-1])
    i, v = quantize.unpack_escapes(raw)
    with pytest.raises(CorruptStreamError):
        quantize.from_samples(torch.zeros(2, 2, dtype=torch.uint8), i, v)


fishers = st.tuples(st.integers(1, 4), st.integers(1, 3), st.integers(1, 8), st.integers(0, 2**31)).map(
    lambda a: torch.rand(a[0], 2, a[1], 2 * a[2], generator=torch.Generator().manual_seed(a[3])).pow(4)
)


@settings(max_examples=60, deadline=None)
@given(f=fishers, alpha=st.floats(0.0, 1.0), style=st.sampled_from(["half", "interleaved", None]))
def test_channel_weights_are_positive_mean_one_and_monotone(f, alpha, style):
    w = weights.channel_weights(f, rope_style=style, alpha=alpha)
    assert w.shape == f.shape and bool((w > 0).all())
    assert float(w.mean()) == pytest.approx(1.0, rel=1e-9)
    if style is None:  # a more sensitive channel never gets a smaller weight
        order = torch.argsort(f.reshape(-1))
        assert bool((w.reshape(-1)[order].diff() >= -1e-12).all())
    else:  # the two channels RoPE mixes share a weight (keys only)
        assert torch.allclose(w[:, 0], weights.pair_average(w[:, 0], style))
    if alpha == 0:
        assert torch.allclose(w, torch.ones_like(w))


def test_channel_weights_refuse_bad_fisher():
    for bad in (torch.ones(2, 3, 1, 4), -torch.ones(2, 2, 1, 4), torch.zeros(2, 2, 1, 4)):
        with pytest.raises(ConfigError):
            weights.channel_weights(bad)


@settings(max_examples=30, deadline=None)
@given(n=st.integers(20, 80), d=st.integers(2, 12), seed=st.integers(0, 2**31))
def test_weighted_klt_inverts_and_decorrelates_the_scaled_channels(n, d, seed):
    from kvcodec.transform.calibration import fit_group

    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d, generator=g, dtype=torch.float64) @ torch.randn(d, d, generator=g, dtype=torch.float64)
    w = torch.rand(d, generator=g, dtype=torch.float64) * 10 + 0.1
    b = fit_group(x, w)
    y = (x.float() - b.mean) @ b.analysis
    assert torch.allclose(y @ b.basis.T + b.mean, x.float(), atol=1e-3 * float(x.abs().max()) + 1e-4)
    cov = torch.cov(y.T.double())
    off = cov - torch.diag(torch.diag(cov))
    assert float(off.abs().max()) <= 1e-3 * float(cov.abs().max()) + 1e-9
    # coefficient variances are those of the weighted channels: their sum is sum_c w_c var(x_c)
    assert float(b.variances.sum()) == pytest.approx(float((w * x.var(0)).sum()), rel=1e-3)


@given(st.integers(1, 40), st.integers(0, 24), st.floats(1e-6, 1e4))
@settings(max_examples=40, deadline=None)
def test_half_basis_rounds_to_float16_under_a_power_of_two_scale(rows, cols, magnitude):
    g = torch.Generator().manual_seed(rows * 100 + cols)
    block = torch.randn((rows, cols), generator=g, dtype=torch.float64) * magnitude
    if block.numel():
        block[0, 0] = 0.0
    half, scale = inverse.half_basis(block)
    assert half.dtype == torch.float16 and half.shape == block.shape
    assert math.frexp(scale)[0] == 0.5  # a power of two: scaling back is exact
    assert bool((half.double().abs() <= 1).all())
    back = half.double() * scale
    normal = block.abs() >= 2.0**-14 * scale
    err = (back - block).abs()
    assert bool((err[normal] <= 2.0**-11 * block.abs()[normal]).all())  # round to 11 significant bits
    assert bool((err[~normal] <= 2.0**-25 * scale).all())  # subnormal: a multiple of 2^-24 of the scale
    q = torch.randint(-inverse.HALF_MAX, inverse.HALF_MAX + 1, (cols, 3), generator=g).double()
    assert torch.equal((half.float()[:, :, None] * q.float()[None]).double(), half.double()[:, :, None] * q[None])
