"""A synthetic "model's" KV for the transform tests: correlated channels and layers (low rank +
noise), keys carrying RoPE; every text (seed) shares one mixing, so a calibration on two texts
fits a third."""

from __future__ import annotations

import torch

from kvcodec.transform import RopeSpec
from kvcodec.transform.rope import apply_rope

L, H, D = 4, 2, 16
ROPE = RopeSpec(10000.0, D)


def synthetic_kv(tokens: int, seed: int, first: int = 0, rank: int = 12, layers: int = L) -> torch.Tensor:
    """fp16 KV (layers, 2, tokens, H, D) of `tokens` positions from `first`, text `seed`."""
    g = torch.Generator().manual_seed(1234)  # the same mixing for every text: one "model"
    mix = torch.randn(rank, layers * 2 * H * D, generator=g) * torch.linspace(3, 0.2, rank)[:, None]
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, rank, generator=g) @ mix + 0.05 * torch.randn(tokens, layers * 2 * H * D, generator=g)
    kv = x.view(tokens, layers, 2, H, D).permute(1, 2, 0, 3, 4).contiguous()
    kv[:, 0] = apply_rope(kv[:, 0], torch.arange(first, first + tokens), ROPE)
    return kv.to(torch.float16)


def rel_mse(a: torch.Tensor, b: torch.Tensor) -> float:
    return float(((a.float() - b.float()) ** 2).mean() / (b.float() ** 2).mean())
