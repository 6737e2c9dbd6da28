"""The transform codec's target-ratio level search: rate.LevelSearch against a fine bisection, and the
codec's sampled-chunk measurements (codecs/transform/level.SampleRate) against the encode's own
integers."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

from kvcodec.codecs.transform.codec import TransformCodec
from kvcodec.codecs.transform.level import SampleRate
from kvcodec.errors import ConfigError
from kvcodec.transform import rate
from kvcodec.transform.calibration import all_variances
from synthetic import synthetic_kv


def bisect(size_bits, target, lo, hi, iters=200):
    """The reference: the smallest level whose size is at most target, bisection on log theta."""
    a, b = math.log(lo), math.log(hi)
    if size_bits(lo) <= target:
        return lo
    for _ in range(iters):
        mid = 0.5 * (a + b)
        a, b = (mid, b) if size_bits(math.exp(mid)) > target else (a, mid)
    return math.exp(b)


def gaussian_rate(variances, tokens=64):
    """A decreasing size of theta as the coded data's: 0.5 log2(v / theta) + 0.25 bits per coded coordinate."""
    v = torch.tensor(variances, dtype=torch.float64)

    def size(theta: float) -> float:
        coded = v > theta
        return tokens * float((0.5 * torch.log2(v[coded] / theta) + 0.25).sum())

    return size


@settings(max_examples=60, deadline=None)
@given(
    st.lists(st.floats(1e-6, 1e3), min_size=1, max_size=200),
    st.floats(0.02, 0.98),
    st.floats(-6.0, 6.0),
)
@example([247.0, 324.0, 794.0, 1e-6, 1e-6], 0.02, 1.0)  # the target in a jump: regula falsi crawled (35 evaluations)
def test_level_search_finds_the_bisection_level_in_few_evaluations(variances, fraction, guess_offset):
    size = gaussian_rate(variances)
    top = max(variances)
    lo, hi = top * rate.MIN_LEVEL, top
    target = fraction * size(lo)
    want = bisect(size, target, lo, hi)
    search = rate.LevelSearch(size, lo, hi)
    got = search.solve(target, want * math.exp(guess_offset))
    assert size(got) <= target
    # within rtol of the target, or (a size that jumps) within the bracket tolerance of the reference level
    assert size(got) >= target * (1 - 1e-3) or abs(math.log(got / want)) <= 2 * rate.XTOL
    assert search.evals <= 30


def test_level_search_ends_at_the_range_edges():
    size = gaussian_rate([1.0, 0.5, 0.1])
    assert rate.LevelSearch(size, 1e-9, 1.0).solve(size(1e-9) * 2, 1e-3) == pytest.approx(1e-9)
    assert rate.LevelSearch(lambda theta: 1e9, 1e-9, 1.0).solve(10.0, 1e-3) == pytest.approx(1.0)
    with pytest.raises(ConfigError):
        rate.LevelSearch(size, 1e-9, 1.0).solve(0.0, 1e-3)


def test_a_second_search_starts_from_the_first_ones_sizes():
    size = gaussian_rate([10.0 / (1 + i) ** 1.5 for i in range(300)])
    search = rate.LevelSearch(size, 1e-9, 10.0)
    first = search.solve(0.3 * size(1e-4), 1e-4)
    evals = search.evals
    second = search.solve(0.3 * size(1e-4) * 0.9, first)  # a corrected target, a few percent away
    assert second > first and search.evals - evals <= 4
    assert size(second) == pytest.approx(0.3 * size(1e-4) * 0.9, rel=1e-3)


def codec(synthetic_kvt, **kw):
    return TransformCodec(synthetic_kvt, chunk_tokens=64, resolutions=((64, 64),), **kw)


@pytest.mark.parametrize("shuffled", [False, True])
def test_sample_entropy_is_that_of_the_encodes_integers(synthetic_kvt, shuffled):
    """Sorted columns cut to a level's (or, when they are not a leading slice, picked): the entropy of
    exactly the integers _symbols gives each sampled chunk (sinks zero, all tokens finer for fine)."""
    c = codec(synthetic_kvt, target_ratio=4.0, fine_tokens=8, fine_bits=2)
    kv = synthetic_kv(300, seed=9)
    y = c.coefficients(kv, 0)
    sample = SampleRate(c, None, kv, 0)
    if shuffled:  # the path for a basis whose coded columns are not the widest (a fallback block)
        perm = torch.randperm(y.shape[1], generator=torch.Generator().manual_seed(0))
        sample.chunks = [z.index_select(1, perm) for z in sample.raw]
        sample.rank = torch.argsort(perm)
    for theta in (1e-4, 1e-3, 1e-2):
        for fine in (0, 2):
            want = sum(
                rate.column_entropy_bits(c._symbols(y[s : s + 64], theta, s, 64 if fine else 0)) for s in sample.starts
            )
            assert sample.entropy(theta, fine) == pytest.approx(want / sample.tokens, rel=1e-9)


def reference_level(c: TransformCodec, kv: torch.Tensor) -> float:
    """The search before LevelSearch, bisected to the end: entropy of the sampled chunks' integers
    (_symbols on every coefficient), corrected once by their real bytes."""
    y = c.coefficients(kv, 0)
    T, sample = kv.shape[2], SampleRate(c, None, kv, 0)
    fine = min(c.fine_tokens, T)

    def per_token(theta, all_fine):
        bits = sum(rate.column_entropy_bits(c._symbols(y[s : s + 64], theta, s, 64 * all_fine)) for s in sample.starts)
        return bits / sample.tokens

    def est(theta):
        return ((T - fine) * per_token(theta, False) + fine * per_token(theta, True)) / T

    target = (16.0 * kv.numel() / c.target_ratio - c._overhead_bits(kv, 0)) / T
    top = max(float(c.cal.basis(g, k).variances.max()) for g in range(len(c.cal.groups)) for k in "kv")
    theta = bisect(est, target, top * rate.MIN_LEVEL, top, iters=60)
    actual = sum(8.0 * c._payload_bytes(y[s : s + 64], kv[:, :, s : s + 64], theta, s) for s in sample.starts)
    factor = actual / sample.tokens / per_token(theta, False)
    return bisect(est, target / factor, theta / 4, theta * 4, iters=60), est


@pytest.mark.parametrize("ratio", [3.0, 6.0])
def test_the_codecs_level_is_the_full_bisections(synthetic_kvt, ratio):
    """The level LevelSearch finds from a sample's entropy is the fine bisection's: its estimated size
    within 0.3% (the search stops up to 0.1% under its own target, and how far the two land apart
    depends on the machine's arithmetic: 0.23% on the GPU machines at 6x, under 0.05% on the VM).
    The same data gives the same level whatever the process coded before (another KV in between:
    byte-identical stores from any worker of one machine, in any order; not across machines)."""
    c = codec(synthetic_kvt, target_ratio=ratio, fine_tokens=8, fine_bits=2)
    kv = synthetic_kv(400, seed=21)
    want, est = reference_level(c, kv)
    var, w = all_variances(c.cal).to(torch.float64), c._weights()
    searched = c._searched_level(c._target_bits(kv, 0), None, kv, 0, var, w)
    assert est(searched) == pytest.approx(est(want), rel=3e-3)
    assert searched == pytest.approx(want, rel=0.02)
    got = c._level(None, kv, 0)
    assert got == rate.on_grid(searched)  # the codec codes at the grid's level nearest the search's
    c._level(None, synthetic_kv(400, seed=5) * 3, 0)
    assert c._level(None, kv, 0) == got
    full = c._searched_level(
        c._target_bits(kv, 0), c.coefficients(kv, 0), kv, 0, var, w
    )  # every coefficient given: the same sampled chunks
    assert full == pytest.approx(searched, rel=1e-3)


def test_a_level_the_grid_would_move_out_of_the_search_range_stays_as_searched(synthetic_kvt, monkeypatch):
    """Where the grid level nearest a searched level would code nothing (>= the widest variance),
    the searched level is kept. A budget the fp16 sink tokens alone exceed is searched as the ratio's
    budget without them (then on the grid); a KV of sink tokens alone codes nothing: the coarsest level."""
    c = codec(synthetic_kvt, target_ratio=3.0)
    kv = synthetic_kv(64, seed=4)
    var, w = all_variances(c.cal).to(torch.float64), c._weights()
    top = float((var * w).max())
    monkeypatch.setattr(TransformCodec, "_searched_level", lambda *a: top * 0.995)
    monkeypatch.setattr(rate, "on_grid", lambda theta: top * 1.01)  # the grid level nearest it
    assert c._ratio_level(None, kv, 0, var, w) == top * 0.995
    monkeypatch.setattr(TransformCodec, "_target_bits", lambda *a: -1.0)
    monkeypatch.setattr(rate, "on_grid", lambda theta: theta / 2)  # a grid level inside the range
    searched = []
    monkeypatch.setattr(TransformCodec, "_searched_level", lambda self, target, *a: searched.append(target) or top / 3)
    assert c._ratio_level(None, kv, 0, var, w) == top / 6
    assert searched == [16.0 * kv.numel() / 3.0 / kv.shape[2]]  # bits a token: the ratio's, no sink paid
    assert c._ratio_level(None, kv[:, :, : c.sink_tokens], 0, var, w) == top * 0.999


@settings(max_examples=60, deadline=None)
@given(st.floats(1e-12, 1e6))
def test_grid_levels_are_near_idempotent_and_ordered(theta):
    """A level moves at most half a grid step (in log scale) to a level the grid keeps as it is,
    and the grid keeps the levels' order."""
    snapped = rate.on_grid(theta)
    assert abs(math.log2(snapped / theta)) <= 0.5 / rate.LEVELS_PER_OCTAVE + 1e-12
    assert rate.on_grid(snapped) == snapped
    assert rate.on_grid(theta * 1.01) >= snapped


@settings(max_examples=40, deadline=None)
@given(st.integers(1, 80), st.integers(1, 30), st.floats(0.1, 400.0), st.integers(0, 2**31 - 1))
def test_entropy_on_any_device_is_the_numpy_one(t, c, scale, seed):
    """The torch path (a GPU's integers) gives the bits of the CPU's NumPy path, escapes included."""
    g = torch.Generator().manual_seed(seed)
    q = (torch.randn(t, c, generator=g) * scale + torch.randn(c, generator=g) * scale).round().to(torch.int32)
    assert rate._entropy_torch(q) == pytest.approx(rate.column_entropy_bits(q), rel=1e-9, abs=1e-6)
