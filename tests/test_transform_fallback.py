"""The per-channel fallback (transform/fallback.py): a block keeps its fitted basis only where, on
held-out samples, it is at least as accurate as per-channel int-N of the same or fewer bytes."""

from __future__ import annotations

import math

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcodec.transform.calibration import GroupBasis, calibrate
from kvcodec.transform.fallback import (
    compare,
    diagonal_basis,
    falls_back,
    int_error_at,
    int_point,
    keeps_transform,
    levels,
    transform_point,
)
from kvcodec.transform.pca import fit_pca


def _noise(n: int, d: int, seed: int) -> torch.Tensor:
    """i.i.d. channels of unequal scale: nothing for a basis to decorrelate."""
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, d, generator=g, dtype=torch.float64) * torch.linspace(0.2, 3.0, d, dtype=torch.float64)


def _low_rank(n: int, d: int, seed: int, rank: int = 8) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    mix = torch.randn(rank, d, generator=torch.Generator().manual_seed(99), dtype=torch.float64)
    x = torch.randn(n, rank, generator=g, dtype=torch.float64) @ mix
    return x + 0.05 * torch.randn(n, d, generator=g, dtype=torch.float64)


def _fitted(x: torch.Tensor, w: torch.Tensor | None = None) -> GroupBasis:
    if w is None:
        mean, basis, var = fit_pca(x)
        return GroupBasis(mean.float(), basis.float(), var.float())
    sw = w.sqrt()
    mean, basis, var = fit_pca(x * sw)
    return GroupBasis((mean / sw).float(), (basis / sw[:, None]).float(), var.float(), w.float())


def _log_ratio(transform, per_channel) -> float:
    """Sum over levels of log(transform error / int error at equal or fewer bytes)."""
    pairs = [(e, int_error_at(per_channel, b)) for b, e in transform]
    return sum(math.log(max(e, 1e-300)) - math.log(max(i, 1e-300)) for e, i in pairs if math.isfinite(i))


def _decision_is_the_more_accurate(fitted: GroupBasis, held: torch.Tensor) -> bool:
    """falls_back agrees with the measured points: kept iff the transform's errors are, in geometric
    mean over the levels, at most int-N's at equal or fewer bytes; returns whether it fell back."""
    thetas = levels(fitted.variances)
    transform, per_channel = compare(fitted, held, thetas)
    fell = falls_back(fitted, held, thetas)
    assert fell == (_log_ratio(transform, per_channel) > 0)
    return fell


def test_low_rank_data_keeps_the_transform_and_a_noise_family_it_never_saw_falls_back():
    d = 48
    fitted = _fitted(_low_rank(8 * d, d, 3))
    assert not _decision_is_the_more_accurate(fitted, _low_rank(600, d, 4).float())
    # A channel family of i.i.d. noise the basis cannot compress: fitted on fewer tokens than
    # dimensions, the basis has no coordinates for most of it and drops that noise entirely, while
    # int-N codes every channel from the data it sees.
    mixed = lambda n, s: torch.cat([_low_rank(n, d // 2, s), 3 * _noise(n, d // 2, s + 50)], 1)  # noqa: E731
    assert _decision_is_the_more_accurate(_fitted(mixed(d // 2, 1)), mixed(600, 2).float())


def test_equal_bytes_not_equal_slope_noise_fitted_on_enough_tokens_keeps_the_basis():
    """On i.i.d. noise fitted on enough tokens the basis is about the identity and its water-filled
    steps beat int-N's equal widths at equal bytes: kept (no fallback needed to be never worse)."""
    d = 32
    assert not _decision_is_the_more_accurate(_fitted(_noise(40 * d, d, 1)), _noise(600, d, 2).float())


@settings(max_examples=30, deadline=None)
@given(
    st.lists(st.tuples(st.floats(0, 1e4), st.floats(0, 1e4)), min_size=1, max_size=4),
    st.lists(st.tuples(st.floats(0, 1e4), st.floats(0, 1e4)), min_size=0, max_size=8),
)
def test_keeps_transform_never_picks_the_larger_error_at_equal_bytes(transform, per_channel):
    kept = keeps_transform(transform, per_channel)
    assert kept == (_log_ratio(transform, per_channel) <= 0)
    if len(transform) == 1:  # one level: kept iff no int of at most its bytes is strictly more accurate
        ((tb, te),) = transform  # (errors under 1e-300 count as exact: their logs are floored there)
        assert kept == all(not (pb <= tb and max(pe, 1e-300) < max(te, 1e-300)) for pb, pe in per_channel)
    assert keeps_transform(transform, [])  # nothing of its size to compare against: kept
    assert keeps_transform([(b, 0.0) for b, _ in transform], per_channel)  # exact at its sizes: kept
    if not kept:  # a transform less accurate everywhere still falls back
        assert not keeps_transform([(b, 2 * e + 1) for b, e in transform], per_channel)


@settings(max_examples=8, deadline=None)
@given(st.integers(1, 12), st.sampled_from([0, 1]), st.integers(0, 10**6))
def test_the_decision_on_synthetic_blocks_matches_measured_points(rank, noise_family, seed):
    """Random low-rank blocks, with or without an i.i.d. noise family, fitted on enough or too few
    tokens, weighted or not: the decision is always the more accurate option at equal bytes."""
    d = 24
    g = torch.Generator().manual_seed(seed)
    mix = torch.randn(rank, d, generator=g, dtype=torch.float64)

    def data(n: int) -> torch.Tensor:
        x = torch.randn(n, rank, generator=g, dtype=torch.float64) @ mix
        if noise_family:
            x[:, d // 2 :] = 2 * torch.randn(n, d // 2, generator=g, dtype=torch.float64)
        return x + 0.01 * torch.randn(n, d, generator=g, dtype=torch.float64)

    w = torch.rand(d, generator=g, dtype=torch.float64) + 0.5 if seed % 2 else None
    fit_tokens = d // 2 if seed % 3 == 0 else 10 * d
    _decision_is_the_more_accurate(_fitted(data(fit_tokens), w), data(300).float())


def test_points_measure_the_weighted_error_and_bits():
    x = _noise(512, 16, 7).float()
    w = torch.rand(16, dtype=torch.float64) + 0.5
    bits8, err8 = int_point(x, w, 8)
    bits2, err2 = int_point(x, w, 2)
    assert bits2 < bits8 < 16 * 8 + 2 * 32 * 16 / 256 + 1e-6 and 0 < err8 < err2  # more bits, less error
    assert math.isclose(int_point(x, w * 2, 4)[1], 2 * int_point(x, w, 4)[1], rel_tol=1e-6)
    diag = diagonal_basis(x.double(), w)
    y = (x - diag.mean) @ diag.analysis
    bits, err = transform_point(diag, y, float(diag.variances[0]) * 10)  # level above every variance
    assert bits == 0 and math.isclose(err, float(((x - diag.mean).double().pow(2) * w).sum(1).mean()), rel_tol=1e-4)


def test_diagonal_basis_is_an_exact_per_channel_code_and_calibration_reports_fallbacks():
    x = _noise(400, 16, 5)
    w = torch.rand(16, dtype=torch.float64) + 0.5
    diag = diagonal_basis(x, w)
    y = (x.float() - diag.mean) @ diag.analysis
    assert torch.allclose(y @ diag.basis.T + diag.mean, x.float(), atol=1e-4)  # synthesis inverts analysis
    assert bool((diag.variances[:-1] >= diag.variances[1:]).all())  # widest first, as the codec expects
    kv = lambda n, s: _noise(n, 2 * 2 * 8, s).float().reshape(n, 1, 2, 2, 8).permute(1, 2, 0, 3, 4)  # noqa: E731
    quiet = kv(200, 1)
    quiet[:, :, :, 1] *= 1e-3  # a head near-constant in calibration, noisy in the held-out texts
    loud = kv(400, 2)
    loud[:, :, :, 1] *= 3.0
    cal = calibrate([quiet], None, sink_tokens=0, held_out=[loud], max_group=1)
    assert cal.info["fallback"] == ["g0.k", "g0.v"] and cal.info["held_out_tokens"] == 400
    cal = calibrate([kv(2000, 3)], None, sink_tokens=0, held_out=[kv(400, 2)], max_group=1)
    assert cal.info["fallback"] == []
