"""Benchmark methods by name, and the chunk codec each one stores and fetches with.

A method is what the serving benchmarks (ttft, interference) compare: "raw" (fp16 KV as it is),
"zstd-3" (the same bytes zstd-compressed), "kvcodec-<quant>" (kvcodec's HEVC codec; "kvcodec":
the quant of the given config), "kvcodec-transform-<ratio>" (the transform codec of a .kvt at that
target ratio vs fp16, e.g. "kvcodec-transform-5"), or the name of any kvbench baseline
("cachegen", "lz4", ...), coded chunk by chunk as a ChunkCodec.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from kvbench.baselines.chunk import BaselineCodec
from kvcodec.errors import ConfigError

LABELS = {"raw": "raw fp16 KV", "zstd-3": "zstd-3 KV", "cachegen": "CacheGen-style", "prefill": "full prefill"}
RAW_VARIANTS = {"raw": ("raw",), "zstd-3": ("zstd",)}
TRANSFORM = "kvcodec-transform"


def transform_ratio(method: str) -> float | None:
    """The target ratio vs fp16 of a "kvcodec-transform-<ratio>" method; None for any other method."""
    if not method.startswith(TRANSFORM + "-"):
        return None
    text = method[len(TRANSFORM) + 1 :]
    try:
        ratio = float(text)
    except ValueError:
        raise ConfigError(f"{method!r}: the transform's target ratio must be a number, got {text!r}") from None
    if not ratio > 1:
        raise ConfigError(f"{method!r}: the transform's target ratio must be > 1")
    return ratio


def expand_methods(methods: list[str], ratios: list[float]) -> list[str]:
    """Methods with a bare "kvcodec-transform" replaced by one "kvcodec-transform-<r>" per ratio."""
    out: list[str] = []
    for m in methods:
        out += [f"{TRANSFORM}-{r:g}" for r in ratios] if m == TRANSFORM else [m]
    for m in out:
        transform_ratio(m)  # a bad ratio is refused here, before anything is measured
    return list(dict.fromkeys(out))


def label(method: str) -> str:
    """The name a table or chart shows for `method`."""
    ratio = transform_ratio(method) if method.startswith(TRANSFORM + "-") else None
    return f"kvcodec-transform {ratio:g}x" if ratio is not None else LABELS.get(method, method)


def method_codec(method: str, config, transform: str | Path | None = None, **hevc_options: Any):  # noqa: ANN001, ANN201
    """The ChunkCodec of `method` with `config`'s chunking and resolutions. `transform`: the .kvt
    a "kvcodec-transform-<ratio>" method codes with. hevc_options (e.g. pool=NvdecPool(...)) go to
    kvcodec's HEVC codec."""
    from kvcodec.codecs.registry import make_codec

    ratio = transform_ratio(method)
    if ratio is not None:
        if transform is None:
            raise ConfigError(f"method {method!r} needs a .kvt file (--transform PATH)")
        return make_codec(
            "transform",
            transform=str(transform),
            target_ratio=ratio,
            chunk_tokens=config.chunk_tokens,
            resolutions=config.resolutions,
        )
    if method == "kvcodec" or method.startswith("kvcodec-"):
        quant = method.split("-", 1)[1] if "-" in method else config.quant
        return make_codec("hevc", config=dataclasses.replace(config, quant=quant), **hevc_options)
    if method in RAW_VARIANTS:
        return make_codec(
            "raw",
            variants=RAW_VARIANTS[method],
            zstd_level=3,
            chunk_tokens=config.chunk_tokens,
            resolutions=config.resolutions,
        )
    return BaselineCodec(method, config.chunk_tokens, config.resolutions)
