"""Distortion weights: how much the model feels a squared error on each KV channel.

The codec minimises weighted squared error sum_c w_c (x_c - x_c')^2 instead of plain MSE. With a
diagonal weight per channel, the best transform is the PCA of the scaled channels z = sqrt(w) x
(a weighted KLT): coefficients y = B^T sqrt(w) (x - mean), restored as x = mean + B y / sqrt(w).
The weights come from a diagonal Fisher information (kvcodec.integrations.hf_fisher), averaged over tokens; for
keys, the two channels RoPE rotates into each other share one weight (the rotation angle varies
with the position, so only their mean is meaningful once RoPE is removed).
"""

from __future__ import annotations

import torch

from kvcodec.errors import ConfigError

FLOOR = 1e-3  # weights below FLOOR x their mean are raised to it: a noisy near-zero estimate must not zero a channel


def pair_average(k: torch.Tensor, style: str = "half") -> torch.Tensor:
    """(..., D) per-channel values with each RoPE pair replaced by the pair's mean."""
    d = k.shape[-1]
    if d % 2:
        raise ConfigError(f"RoPE pairs need an even head_dim; got {d}")
    if style == "half":
        avg = 0.5 * (k[..., : d // 2] + k[..., d // 2 :])
        return torch.cat([avg, avg], -1)
    pairs = k.reshape(*k.shape[:-1], d // 2, 2).mean(-1, keepdim=True)
    return pairs.expand(*pairs.shape[:-1], 2).reshape(k.shape)


def channel_weights(
    fisher: torch.Tensor, *, rope_style: str | None = "half", rotary_dim: int | None = None, alpha: float = 0.5
) -> torch.Tensor:
    """Per-channel weights (layers, 2, heads, dim), mean 1 over all channels, from a token-averaged diagonal
    Fisher (layers, 2, heads, dim): tempered as fisher**alpha (alpha 0: plain MSE, 1: the Fisher
    as measured) and floored at FLOOR x the mean."""
    if fisher.dim() != 4 or fisher.shape[1] != 2:
        raise ConfigError(f"Fisher must be (layers, 2, heads, dim); got {tuple(fisher.shape)}")
    f = fisher.to(torch.float64).clone()
    if not torch.isfinite(f).all() or (f < 0).any() or float(f.sum()) <= 0:
        raise ConfigError("Fisher information must be finite, non-negative and not all zero")
    if rope_style is not None:
        r = f.shape[-1] if rotary_dim is None else rotary_dim
        f[:, 0, :, :r] = pair_average(f[:, 0, :, :r], rope_style)
    f = f.clamp_min(FLOOR * float(f.mean())) ** alpha
    return f / f.mean()
