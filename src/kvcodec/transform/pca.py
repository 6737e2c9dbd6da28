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


def fit_pca(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(mean (d,), basis (d, d) with orthonormal columns, variances (d,) descending) of samples
    x (n, d), in float64. Raises ConfigError on NaN/inf or fewer than 2 samples."""
    if x.dim() != 2 or x.shape[0] < 2:
        raise ConfigError(f"PCA needs a (samples, dims) matrix with >= 2 samples; got {tuple(x.shape)}")
    x = x.to(torch.float64)
    if not torch.isfinite(x).all():
        raise ConfigError("calibration data holds NaN or infinity; refusing to fit a transform on it")
    mean = x.mean(0)
    c = x - mean
    cov = (c.T @ c) / (x.shape[0] - 1)
    var, vec = torch.linalg.eigh(cov)
    order = torch.argsort(var, descending=True)
    return mean, vec[:, order].contiguous(), var[order].clamp_min(0.0)
