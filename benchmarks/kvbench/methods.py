"""Benchmark methods by name, and the chunk codec each one stores and fetches with.

A method is what the serving benchmarks (ttft, interference) compare: "raw" (fp16 KV as it is),
"zstd-3" (the same bytes zstd-compressed), "kvcodec-<quant>" (kvcodec's HEVC codec; "kvcodec":
the quant of the given config), or the name of any kvbench baseline ("cachegen", "lz4", ...),
coded chunk by chunk as a ChunkCodec.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from kvbench.baselines.chunk import BaselineCodec

LABELS = {"raw": "raw fp16 KV", "zstd-3": "zstd-3 KV", "cachegen": "CacheGen-style", "prefill": "full prefill"}
RAW_VARIANTS = {"raw": ("raw",), "zstd-3": ("zstd",)}


def method_codec(method: str, config, **hevc_options: Any):  # noqa: ANN001, ANN201
    """The ChunkCodec of `method` with `config`'s chunking and resolutions. hevc_options (e.g.
    pool=NvdecPool(...)) go to kvcodec's HEVC codec."""
    from kvcodec.codecs.registry import make_codec

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
