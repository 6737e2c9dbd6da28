"""Rotary position embedding (RoPE) removal and re-application for keys.

Keys are stored after RoPE: key(t) = R(t) k(t). Removing R(t) before the decorrelating
transform lets one basis serve every position; decode re-applies it with the token's absolute
position. Two pairings are supported: "half" (transformers' rotate_half: channel i pairs with
i + rotary_dim/2) and "interleaved" (GPT-J: 2i with 2i+1). Partial rotary rotates only the first
rotary_dim channels.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch

from kvcodec.errors import ConfigError

STYLES = ("half", "interleaved")
SCALINGS = ("default", "linear", "llama3")


@dataclasses.dataclass(frozen=True)
class RopeSpec:
    """A model's rotary settings. scaling: ("default"|"linear"|"llama3", parameters)."""

    theta: float
    head_dim: int
    rotary_dim: int | None = None  # None: the whole head
    style: str = "half"
    scaling: str = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position: int = 8192

    def __post_init__(self) -> None:
        rd = self.rotary
        if not (self.theta > 0 and math.isfinite(self.theta)):
            raise ConfigError(f"rope theta must be a positive number; got {self.theta}")
        if rd <= 0 or rd > self.head_dim or rd % 2:
            raise ConfigError(f"rotary_dim must be even and in 2..{self.head_dim}; got {rd}")
        if self.style not in STYLES:
            raise ConfigError(f"rope style must be one of {STYLES}; got {self.style!r}")
        if self.scaling not in SCALINGS:
            raise ConfigError(f"rope scaling {self.scaling!r} is not supported (supported: {', '.join(SCALINGS)})")
        if self.factor <= 0:
            raise ConfigError(f"rope scaling factor must be > 0; got {self.factor}")

    @property
    def rotary(self) -> int:
        return self.head_dim if self.rotary_dim is None else int(self.rotary_dim)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> RopeSpec:
        fields = {f.name for f in dataclasses.fields(cls)}
        unknown = set(d) - fields
        if unknown:
            raise ConfigError(f"unknown rope settings {sorted(unknown)}")
        return cls(**d)

    @classmethod
    def from_hf_config(cls, config: Any) -> RopeSpec:
        """The rotary settings of a transformers (text) config."""
        get = getattr(config, "get_text_config", None)
        c = get(decoder=True) if get is not None else config
        heads = int(c.num_attention_heads)
        head_dim = int(getattr(c, "head_dim", None) or c.hidden_size // heads)
        params = dict(getattr(c, "rope_parameters", None) or getattr(c, "rope_scaling", None) or {})
        theta = params.get("rope_theta", getattr(c, "rope_theta", None))
        if theta is None:
            raise ConfigError("the model config names no rope_theta")
        kind = params.get("rope_type", params.get("type", "default")) or "default"
        partial = float(getattr(c, "partial_rotary_factor", params.get("partial_rotary_factor", 1.0)) or 1.0)
        extra = {}
        if kind == "linear":
            extra = dict(factor=float(params["factor"]))
        elif kind == "llama3":
            extra = dict(
                factor=float(params["factor"]),
                low_freq_factor=float(params["low_freq_factor"]),
                high_freq_factor=float(params["high_freq_factor"]),
                original_max_position=int(params["original_max_position_embeddings"]),
            )
        return cls(float(theta), head_dim, int(head_dim * partial) // 2 * 2, "half", kind, **extra)


def inv_freq(spec: RopeSpec) -> torch.Tensor:
    """(rotary/2,) float64 angular frequencies, after scaling."""
    r = spec.rotary
    f = 1.0 / (spec.theta ** (torch.arange(0, r, 2, dtype=torch.float64) / r))
    if spec.scaling == "linear":
        return f / spec.factor
    if spec.scaling == "llama3":
        wavelen = 2 * math.pi / f
        low_wl = spec.original_max_position / spec.low_freq_factor
        high_wl = spec.original_max_position / spec.high_freq_factor
        smooth = (spec.original_max_position / wavelen - spec.low_freq_factor) / (
            spec.high_freq_factor - spec.low_freq_factor
        )
        mid = (1 - smooth) * f / spec.factor + smooth * f
        return torch.where(wavelen > low_wl, f / spec.factor, torch.where(wavelen < high_wl, f, mid))
    return f


def _rotate(x: torch.Tensor, positions: torch.Tensor, spec: RopeSpec, sign: float) -> torch.Tensor:
    """Rotate channel pairs of x (..., tokens, heads, head_dim) by sign * position * freq."""
    r = spec.rotary
    angles = positions.to(torch.float64)[:, None] * inv_freq(spec).to(positions.device)[None, :]
    cos = torch.cos(angles).to(x.dtype)[:, None, :]  # (tokens, 1, r/2)
    sin = (sign * torch.sin(angles)).to(x.dtype)[:, None, :]
    rot, rest = x[..., :r], x[..., r:]
    if spec.style == "half":
        a, b = rot[..., : r // 2], rot[..., r // 2 :]
    else:
        a, b = rot[..., 0::2], rot[..., 1::2]
    na, nb = a * cos - b * sin, b * cos + a * sin
    if spec.style == "half":
        out = torch.cat([na, nb], dim=-1)
    else:
        out = torch.stack([na, nb], dim=-1).flatten(-2)
    return torch.cat([out, rest], dim=-1) if rest.shape[-1] else out


def apply_rope(x: torch.Tensor, positions: torch.Tensor, spec: RopeSpec) -> torch.Tensor:
    """RoPE at absolute `positions` (tokens,) on x (..., tokens, heads, head_dim)."""
    return _rotate(x, positions, spec, 1.0)


def remove_rope(x: torch.Tensor, positions: torch.Tensor, spec: RopeSpec) -> torch.Tensor:
    """The inverse of apply_rope (a rotation by the opposite angles)."""
    return _rotate(x, positions, spec, -1.0)
