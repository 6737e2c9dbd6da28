"""PCA (Karhunen-Loeve) bases and the grouping of layers they are fitted over."""

from __future__ import annotations

import torch

from kvcodec.errors import ConfigError

MIN_TOKENS_PER_DIM = 2.0  # below this a covariance is not worth estimating: refuse
TARGET_TOKENS_PER_DIM = 4.0  # group size is chosen to keep at least this many samples per dimension


def group_layers(
    layers: int,
    layer_dim: int,
    tokens: int,
    *,
    tokens_per_dim: float = TARGET_TOKENS_PER_DIM,
    max_group: int | None = None,
) -> tuple[tuple[int, ...], ...]:
    """Consecutive layer groups, as large as `tokens` calibration samples support (at least
    tokens_per_dim samples per dimension of a group), of near-equal sizes. Raises ConfigError when
    the data cannot support even one layer per group."""
    if layers < 1 or layer_dim < 1:
        raise ConfigError(f"need at least one layer and one dimension; got {layers} x {layer_dim}")
    if tokens < MIN_TOKENS_PER_DIM * layer_dim:
        raise ConfigError(
            f"{tokens} calibration tokens are too few: one layer has {layer_dim} dimensions and needs at least "
            f"{int(MIN_TOKENS_PER_DIM * layer_dim)} tokens (give more or longer KV files)"
        )
    size = max(1, min(layers, int(tokens // (tokens_per_dim * layer_dim))))
    if max_group is not None:
        size = max(1, min(size, max_group))
    count = -(-layers // size)
    bounds = [round(i * layers / count) for i in range(count + 1)]
    return tuple(tuple(range(bounds[i], bounds[i + 1])) for i in range(count))


def sample_covariance(c: torch.Tensor) -> torch.Tensor:
    """Unbiased sample covariance of centred samples c (n, d)."""
    return (c.T @ c) / (c.shape[0] - 1)


def shrinkage_intensity(c: torch.Tensor) -> float:
    """Ledoit-Wolf intensity in [0, 1] for shrinking the off-diagonal covariances of centred
    samples c (n, d) toward 0 (target: the diagonal; Schaefer & Strimmer 2005, target D):
    the summed estimated variance of the off-diagonal entries over their summed squares."""
    n = c.shape[0]
    s = sample_covariance(c)
    w_bar = s * ((n - 1) / n)
    sq = c * c
    var_s = (n / (n - 1) ** 3) * (sq.T @ sq - n * w_bar * w_bar)  # Var of each s_ij
    off = ~torch.eye(s.shape[0], dtype=torch.bool, device=s.device)
    denom = float((s[off] ** 2).sum())
    if denom <= 0.0:
        return 0.0
    return min(1.0, max(0.0, float(var_s[off].sum()) / denom))


def ledoit_wolf_covariance(c: torch.Tensor) -> torch.Tensor:
    """Sample covariance with its off-diagonal entries shrunk toward 0 by shrinkage_intensity."""
    s = sample_covariance(c)
    lam = shrinkage_intensity(c)
    return (1.0 - lam) * s + lam * torch.diag(torch.diagonal(s))


COVARIANCES = {"sample": sample_covariance, "ledoit-wolf": ledoit_wolf_covariance}


def fit_pca(x: torch.Tensor, covariance: str = "sample") -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(mean (d,), basis (d, d) with orthonormal columns, variances (d,) descending) of samples
    x (n, d), in float64, from the named covariance estimator (COVARIANCES). Raises ConfigError
    on NaN/inf, fewer than 2 samples or an unknown estimator."""
    if covariance not in COVARIANCES:
        raise ConfigError(f"covariance estimator must be one of {sorted(COVARIANCES)}; got {covariance!r}")
    if x.dim() != 2 or x.shape[0] < 2:
        raise ConfigError(f"PCA needs a (samples, dims) matrix with >= 2 samples; got {tuple(x.shape)}")
    x = x.to(torch.float64)
    if not torch.isfinite(x).all():
        raise ConfigError("calibration data holds NaN or infinity; refusing to fit a transform on it")
    mean = x.mean(0)
    cov = COVARIANCES[covariance](x - mean)
    var, vec = torch.linalg.eigh(cov)
    order = torch.argsort(var, descending=True)
    return mean, vec[:, order].contiguous(), var[order].clamp_min(0.0)
