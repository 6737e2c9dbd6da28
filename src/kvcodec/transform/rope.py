"""Rotary position embedding (RoPE) removal and re-application for keys.

Keys are stored after RoPE: key(t) = R(t) k(t). Removing R(t) before the decorrelating
transform lets one basis serve every position; decode re-applies it with the token's absolute
position. Two pairings are supported: "half" (transformers' rotate_half: channel i pairs with
i + rotary_dim/2) and "interleaved" (GPT-J: 2i with 2i+1). Partial rotary rotates only the first
rotary_dim channels. Frequencies are computed here for the default, linear and llama3 scalings;
any other scaling (YaRN, LongRoPE, dynamic NTK at its base length, ...) is carried as its explicit
list of frequencies (`scaling="explicit"`), so apply and remove stay exact inverses whatever it is.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import torch

from kvcodec.errors import ConfigError

STYLES = ("half", "interleaved")
SCALINGS = ("default", "linear", "llama3", "explicit")
# model types whose keys are rotated in (2i, 2i+1) pairs (GPT-J style); others use rotate_half
INTERLEAVED_MODEL_TYPES = ("glm", "cohere", "cohere2", "deepseek_v2", "gptj", "codegen")
# model types whose RoPE is fixed in transformers' code, not named in the config: base 10000 over the
# config's `rotary_dim` leading channels of each head
IMPLICIT_ROPE_MODEL_TYPES = ("gptj", "codegen")


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
    frequencies: tuple[float, ...] | None = None  # scaling "explicit": the rotary/2 angular frequencies

    def __post_init__(self) -> None:
        rd = self.rotary
        if self.frequencies is not None:
            object.__setattr__(self, "frequencies", tuple(float(f) for f in self.frequencies))
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
        if (self.scaling == "explicit") != (self.frequencies is not None):
            raise ConfigError("rope frequencies are given exactly when the scaling is 'explicit'")
        if self.frequencies is not None and (
            len(self.frequencies) != rd // 2 or not all(math.isfinite(f) and f >= 0 for f in self.frequencies)
        ):
            raise ConfigError(f"explicit rope frequencies must be {rd // 2} finite numbers >= 0")

    @property
    def rotary(self) -> int:
        return self.head_dim if self.rotary_dim is None else int(self.rotary_dim)

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        if self.frequencies is None:
            del d["frequencies"]  # .kvt files without explicit frequencies keep their former bytes
        else:
            d["frequencies"] = list(self.frequencies)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> RopeSpec:
        if not isinstance(d, dict):
            raise ConfigError(f"rope settings must be an object; got {type(d).__name__}")
        fields = {f.name for f in dataclasses.fields(cls)}
        unknown = set(d) - fields
        if unknown:
            raise ConfigError(f"unknown rope settings {sorted(unknown)}")
        try:
            return cls(**d)
        except TypeError as e:  # a required setting missing
            raise ConfigError(f"rope settings {d}: {e}") from e

    @classmethod
    def from_hf_config(cls, config: Any, layer_type: str | None = None) -> RopeSpec:
        """The rotary settings of a transformers (text) config; for configs that give RoPE per layer
        type (`rope_parameters` keyed by `layer_types` entries), those of `layer_type` (default: the
        type of layer 0)."""
        get = getattr(config, "get_text_config", None)
        c = get(decoder=True) if get is not None else config
        heads = int(c.num_attention_heads)
        head_dim = int(getattr(c, "head_dim", None) or c.hidden_size // heads)
        params = rope_parameters(c, layer_type)
        mt = str(getattr(c, "model_type", ""))
        theta = params.get("rope_theta", getattr(c, "rope_theta", None))
        if theta is None and mt in IMPLICIT_ROPE_MODEL_TYPES:
            return cls(10000.0, head_dim, int(getattr(c, "rotary_dim", None) or head_dim), "interleaved")
        if theta is None:
            raise ConfigError(
                f"the model config names no rope_theta{f' for {layer_type} layers' if layer_type else ''}"
            )
        kind = params.get("rope_type", params.get("type", "default")) or "default"
        partial = float(params.get("partial_rotary_factor", getattr(c, "partial_rotary_factor", 1.0)) or 1.0)
        rotary = int(head_dim * partial) // 2 * 2
        style = "interleaved" if getattr(c, "rope_interleave", mt in INTERLEAVED_MODEL_TYPES) else "half"
        if kind == "default":
            return cls(float(theta), head_dim, rotary, style)
        if kind == "linear":
            return cls(float(theta), head_dim, rotary, style, kind, factor=float(params["factor"]))
        if kind == "llama3":
            return cls(
                float(theta),
                head_dim,
                rotary,
                style,
                kind,
                factor=float(params["factor"]),
                low_freq_factor=float(params["low_freq_factor"]),
                high_freq_factor=float(params["high_freq_factor"]),
                original_max_position=int(params["original_max_position_embeddings"]),
            )
        freqs = _hf_frequencies(config, kind, layer_type, rotary)
        return cls(float(theta), head_dim, rotary, style, "explicit", frequencies=freqs)


def rope_parameters(config: Any, layer_type: str | None = None) -> dict[str, Any]:
    """The RoPE parameter dict of one layer type (transformers 5 nests them by layer type when they differ)."""
    params = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    if not isinstance(params, dict):
        raise ConfigError(f"the model config's rope_parameters is a {type(params).__name__}, not a mapping")
    nested = {k: v for k, v in params.items() if isinstance(v, dict)}
    if not nested:
        return dict(params)
    types = list(getattr(config, "layer_types", None) or [])
    key = layer_type or (types[0] if types else next(iter(nested)))
    if key not in nested:
        raise ConfigError(f"the model config gives RoPE for layer types {sorted(nested)}, not for {key!r} layers")
    return dict(nested[key])


def _hf_frequencies(config: Any, kind: str, layer_type: str | None, rotary: int) -> tuple[float, ...]:
    """Frequencies of a scaling type this module does not compute, from transformers' own RoPE init
    (its attention factor scales keys uniformly: a constant the transform absorbs)."""
    try:
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    except ImportError as e:  # pragma: no cover - transformers is a dependency
        raise ConfigError(f"rope scaling {kind!r} needs transformers: {e}") from e
    fn = ROPE_INIT_FUNCTIONS.get(kind)
    if fn is None:
        raise ConfigError(f"rope scaling {kind!r} is not supported (known: default, {', '.join(ROPE_INIT_FUNCTIONS)})")
    get = getattr(config, "get_text_config", None)
    c = get(decoder=True) if get is not None else config
    try:
        kw = (
            {"layer_type": layer_type}
            if layer_type and isinstance(getattr(c, "rope_parameters", {}).get(layer_type), dict)
            else {}
        )
        freqs = fn(c, "cpu", **kw)[0]
    except (KeyError, TypeError, ValueError, AttributeError) as e:
        raise ConfigError(f"rope scaling {kind!r}: cannot compute its frequencies from the config ({e})") from e
    if freqs.numel() != rotary // 2:
        raise ConfigError(
            f"rope scaling {kind!r} gives {freqs.numel()} frequencies; the rotary dim {rotary} needs {rotary // 2}"
        )
    return tuple(float(f) for f in freqs.to(torch.float64))


def inv_freq(spec: RopeSpec) -> torch.Tensor:
    """(rotary/2,) float64 angular frequencies, after scaling."""
    r = spec.rotary
    if spec.frequencies is not None:
        return torch.tensor(spec.frequencies, dtype=torch.float64)
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
