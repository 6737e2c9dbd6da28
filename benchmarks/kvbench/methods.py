"""Benchmark methods by name, and the chunk codec each one stores and fetches with.

A method is what the serving benchmarks (ttft, interference) compare: "raw" (fp16 KV as it is),
"zstd-3" (the same bytes zstd-compressed), "kvcodec-<quant>" (kvcodec's HEVC codec; "kvcodec":
the quant of the given config), "kvcodec-transform-<ratio>[-<coder>]" (the transform codec of a .kvt
at that target ratio vs fp16, its samples coded by <coder>: the codec's default unless named, or
hevc, zstd or mixed (HEVC and zstd chunks in turn), or ans (the "transform-ans" codec: the same
integers rANS-coded and decoded on the SMs), e.g. "kvcodec-transform-5",
"kvcodec-transform-5-hevc", "kvcodec-transform-5-ans"), or the name of any kvbench baseline
("cachegen", "lz4", ...), coded chunk by chunk as a ChunkCodec.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from kvbench.baselines.chunk import BaselineCodec
from kvcodec.codecs.transform.codec import CODERS, DEFAULT_CODER
from kvcodec.errors import ConfigError

LABELS = {"raw": "raw fp16 KV", "zstd-3": "zstd-3 KV", "cachegen": "CacheGen-style", "prefill": "full prefill"}
RAW_VARIANTS = {"raw": ("raw",), "zstd-3": ("zstd",)}
TRANSFORM = "kvcodec-transform"


SM_CODER = "ans"  # a method's coder naming the "transform-ans" codec rather than a "transform" coder
TRANSFORM_CODERS = (*CODERS, SM_CODER)


def transform_ratio(method: str) -> float | None:
    """The target ratio vs fp16 of a "kvcodec-transform-<ratio>[-<coder>]" method; None for any other method."""
    parts = _transform_parts(method)
    return None if parts is None else parts[0]


def transform_coder(method: str) -> str | None:
    """The sample coder a "kvcodec-transform-<ratio>[-<coder>]" method names; None where it names
    none (the codec's default) and for any other method."""
    parts = _transform_parts(method)
    return None if parts is None else parts[1]


def transform_codec(method: str, transform, **options: Any):  # noqa: ANN001, ANN201
    """The ChunkCodec of a "kvcodec-transform-<ratio>[-<coder>]" method over `transform` (a .kvt path
    or a Calibration): the registered "transform" codec with the method's coder, or "transform-ans"
    for the coder "ans"; options (chunk_tokens, resolutions, kvt_hash) go to the codec."""
    from kvcodec.codecs.registry import make_codec

    coder = transform_coder(method)
    if coder == SM_CODER:
        return make_codec("transform-ans", transform=transform, target_ratio=transform_ratio(method), **options)
    coder_option = {"coder": coder} if coder else {}
    return make_codec("transform", transform=transform, target_ratio=transform_ratio(method), **coder_option, **options)


def accuracy_of(records: dict[str, dict], method: str) -> dict:
    """The accuracy record ({method: record}, kvbench.ttft.load_accuracy) standing for `method`: its
    own; for a transform method without one, the record at the same ratio of the default coder, else
    of any coder (the same quantizer; each coder's bytes set its level, so values differ slightly)."""
    ratio = transform_ratio(method)
    if method in records or ratio is None:
        return records.get(method, {})
    base = f"{TRANSFORM}-{ratio:g}"
    return next((records[n] for n in (base, *(f"{base}-{c}" for c in TRANSFORM_CODERS)) if n in records), {})


def rd_name(method: str) -> str | None:
    """The benchmark method a benchmarks/rd.py transform record measures ("transform-zstd-r5" ->
    "kvcodec-transform-5": zstd is the default coder; "transform-hevc-r5" -> "kvcodec-transform-5-hevc");
    None for other names and the rd variants (no sink tokens, key weights)."""
    coder, _, rest = method.removeprefix("transform-").partition("-r")
    if not method.startswith("transform-") or coder not in TRANSFORM_CODERS or not rest.replace(".", "", 1).isdigit():
        return None
    return f"{TRANSFORM}-{float(rest):g}" + ("" if coder == DEFAULT_CODER else f"-{coder}")


def _transform_parts(method: str) -> tuple[float, str | None] | None:
    if not method.startswith(TRANSFORM + "-"):
        return None
    text, dash, coder = method[len(TRANSFORM) + 1 :].partition("-")
    if dash and coder not in TRANSFORM_CODERS:
        raise ConfigError(f"{method!r}: the transform's sample coder must be one of {TRANSFORM_CODERS}, got {coder!r}")
    try:
        ratio = float(text)
    except ValueError:
        raise ConfigError(f"{method!r}: the transform's target ratio must be a number, got {text!r}") from None
    if not ratio > 1:
        raise ConfigError(f"{method!r}: the transform's target ratio must be > 1")
    return ratio, coder or None


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
    ratio, coder = transform_ratio(method), transform_coder(method)
    if ratio is None:
        return LABELS.get(method, method)
    return f"kvcodec-transform {ratio:g}x" + (f" ({coder})" if coder else "")


def resolution_option(text: str | None) -> tuple[int, int] | None:
    """A bench's --resolution WxH (one frame size; None: not given), a bad value refused as a
    usage error before any work (kvcodec.cli.options.parse_resolutions)."""
    import click

    from kvcodec.cli.options import parse_resolutions

    sizes = parse_resolutions(text, "--resolution")
    if sizes and len(sizes) > 1:
        raise click.BadParameter(f"{text!r}: one frame size, e.g. 1024x1024", param_hint="--resolution")
    return sizes[0] if sizes else None


def frame_sizes(resolution) -> tuple[tuple[int, int], ...] | None:  # noqa: ANN001
    """method_codec's `resolutions` from a bench's one (w, h) option: None (each codec's own
    default frame size) where none was given."""
    return None if resolution is None else ((int(resolution[0]), int(resolution[1])),)


def method_codec(method: str, config, transform: str | Path | None = None, resolutions=None, **hevc_options: Any):  # noqa: ANN001, ANN201
    """The ChunkCodec of `method` with `config`'s chunking. `resolutions`: the frame sizes every
    method codes at; None: each codec's own default (`config`'s for the HEVC codec and the
    baselines, the transform codec's FRAME_SIZES for "kvcodec-transform-<ratio>": the defaults a
    user gets). `transform`: the .kvt a transform method codes with. hevc_options (e.g.
    pool=NvdecPool(...)) go to kvcodec's HEVC codec."""
    from kvcodec.codecs.registry import make_codec

    if resolutions is not None:
        config = dataclasses.replace(config, resolutions=tuple(resolutions))
    ratio = transform_ratio(method)
    if ratio is not None:
        if transform is None:
            raise ConfigError(f"method {method!r} needs a .kvt file (--transform PATH)")
        frames = {} if resolutions is None else {"resolutions": config.resolutions}
        return transform_codec(method, str(transform), chunk_tokens=config.chunk_tokens, **frames)
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


def encode_in_chunks(codec, kv) -> tuple[list, float]:  # noqa: ANN001
    """A chunk codec's chunks of kv, as a store holds them, and the seconds the encode took."""
    import time

    t0 = time.perf_counter()
    chunks = codec.encode_chunks(kv)
    return chunks, time.perf_counter() - t0


def decode_chunks_into(codec, chunks, out) -> float:  # noqa: ANN001
    """Every chunk decoded into its tokens of out (L, 2, T, H, D); the seconds it took."""
    import time

    t0 = time.perf_counter()
    for ch in chunks:
        codec.decode_chunk(ch.blobs[0], out[:, :, ch.start_token : ch.start_token + ch.tokens])
    return time.perf_counter() - t0


def chunk_bytes(chunks) -> int:  # noqa: ANN001
    """The bytes of every chunk blob: what a store holds of the chunks."""
    return sum(len(ch.blobs[0]) for ch in chunks)


# a transform method's statistics (bytes, encode and decode time, accuracy round trips): its KV coded in chunks
# of this many tokens, as a store holds it; a last chunk, or a KV shorter than one, holds the tokens left
STATS_CHUNK_TOKENS = 256


def chunked_transform_codec(method: str, transform, resolutions=None):  # noqa: ANN001, ANN201 - a TransformCodec
    """The chunk codec of a kvcodec-transform-<r> method for its statistics: the .kvt `transform` at target
    ratio r vs fp16, in STATS_CHUNK_TOKENS-token chunks (resolutions: None, the codec's own frame size)."""
    from kvcodec.config import CodecConfig

    return method_codec(
        method, CodecConfig(chunk_tokens=STATS_CHUNK_TOKENS), transform=transform, resolutions=resolutions
    )
