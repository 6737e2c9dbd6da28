"""Type and range checks of a transform-coded chunk's header (magic KVTC), so that a damaged or
forged header reaches the restore path only as well-typed fields it can trust: a FormatError
naming the field otherwise (never a KeyError, a TypeError or a NaN level deep in the math).

Version 1 chunks have no fine_tokens / fine_bits / recon (read as 0, 0, "centre"); version 2
chunks must carry all three. Version 3 adds `pieces`: the byte length of each frame of the video
where every frame is coded as its own picture that decodes alone (parameter sets and an IDR
picture each), so a fetch may decode them on several NVDEC engines; [] where the video is one
stream (read so from versions 1 and 2)."""

from __future__ import annotations

import math
import re
from typing import Any

from kvcodec.container import validate as v
from kvcodec.container.format import StreamEntry
from kvcodec.errors import FormatError
from kvcodec.transform.quantize import MAX_FINE_BITS, RECONS

CODERS = ("hevc", "zstd")  # a chunk's own sample coder
SETTING_CODERS = (*CODERS, "mixed")  # a codec's (and a file's) coder setting
MIXED_TURN = ("hevc", "zstd")  # the mixed setting: chunk i's samples coded by MIXED_TURN[i % 2]
DTYPES = ("float16", "bfloat16", "float32")
STREAM_NAMES = ("escapes", "sink", "video", "samples")
VERSIONS = (1, 2, 3)
V1_DEFAULTS = {"fine_tokens": 0, "fine_bits": 0, "recon": "centre"}  # fields version 2 added
V2_DEFAULTS = {"pieces": []}  # the field version 3 added


def chunk_coder(setting: str, index: int) -> str:
    """The sample coder of chunk `index` under a codec's coder setting. "mixed" codes the odd chunks
    with zstd and the even ones as video, so a fetch of a prefix keeps NVDEC and the host's cores
    busy at once (benchmarks/results/ttft-h200-engine-mixed.md)."""
    return MIXED_TURN[index % len(MIXED_TURN)] if setting == "mixed" else setting


def sink_count(sink_tokens: int, start_token: int, tokens: int) -> int:
    """How many of a chunk's first tokens are sink tokens (kept exact, the `sink` header field): those of
    the prefix's first `sink_tokens` that fall in its tokens [start_token, start_token + tokens). Pure."""
    return max(0, min(sink_tokens - start_token, tokens))


def finer_tail(fine_tokens: int, fine_bits: int) -> tuple[int, int]:
    """(fine_tokens, fine_bits) as a codec keeps them: both 0 where either is (no finer tail). Pure."""
    return (fine_tokens, fine_bits) if fine_tokens and fine_bits else (0, 0)


# what a transform codec's id names of its settings (TransformCodec.id: ...-kw{key weight:g}-s{sink tokens}-c{chunk
# tokens}-f{fine tokens}x{fine bits}-{recon}[-...]: older ones end there); the oldest name none of them
_NAMED = re.compile(r"-kw(?P<key_weight>[^-]+(?:-\d+)?)-s(?P<sink_tokens>\d+)-c(?P<chunk_tokens>\d+)"
                    r"-f(?P<fine_tokens>\d+)x(?P<fine_bits>\d+)-(?P<recon>[a-z]+)(?:-|$)")  # fmt: skip


def named_settings(codec_id: str) -> dict[str, Any] | None:
    """The settings a transform codec's id names: key_weight (as its id writes it, `:g`), sink_tokens,
    chunk_tokens, fine_tokens, fine_bits (both 0 where it has no finer tail) and recon; None for an id
    that names none. Pure."""
    m = _NAMED.search(codec_id)
    if m is None:
        return None
    return {k: x if k in ("key_weight", "recon") else int(x) for k, x in m.groupdict().items()}


def check_named(h: dict) -> None:
    """FormatError unless a checked chunk header's settings are those its `codec` field names: a header
    edited with its checksum made again (key weight, sink tokens, finer tail, reconstruction) must not
    restore other values than were stored. Headers whose codec names none pass (older codecs')."""
    named = named_settings(h["codec"])
    if named is None:
        return
    checks = (
        ("key_weight", f"{h['key_weight']:g}" == named["key_weight"]),
        ("sink", h["sink"] == sink_count(named["sink_tokens"], h["start_token"], h["tokens"])),
        ("fine_tokens", h["fine_tokens"] <= min(named["fine_tokens"], h["tokens"])),
        ("fine_bits", not h["fine_tokens"] or h["fine_bits"] == named["fine_bits"]),
        ("recon", h["recon"] == named["recon"]),
    )
    if wrong := [f"{name} {h[name]!r}" for name, ok in checks if not ok]:
        raise FormatError(
            f"transform chunk {h['index']} states {', '.join(wrong)}; its codec {h['codec']!r} stores otherwise "
            "(its header was altered)"
        )


def check_named_settings(settings: dict, codec_id: str) -> None:
    """FormatError unless a transform file's settings are those its codec's id names (where it names them)."""
    named = named_settings(codec_id)
    if named is None:
        return
    fine = finer_tail(settings["fine_tokens"], settings["fine_bits"])
    got = {
        "key_weight": f"{settings['key_weight']:g}",
        "sink_tokens": settings["sink_tokens"],
        "chunk_tokens": settings["chunk_tokens"],
        "fine_tokens": fine[0],
        "fine_bits": fine[1],
        "recon": settings["recon"],
    }
    if wrong := [f"{k} {got[k]!r}" for k in got if got[k] != named[k]]:
        raise FormatError(
            f"transform-coded file's settings say {', '.join(wrong)}; its codec {codec_id!r} stores otherwise "
            "(its header was altered)"
        )


def positive_number(lo: float = 0.0, hi: float = 1e30) -> v.Check:
    def check(x: Any, field: str) -> float:
        if isinstance(x, bool) or not isinstance(x, (int, float)) or not math.isfinite(x) or not lo < x <= hi:
            raise v.fail(field, x, f"a finite number in ({lo:g}, {hi:g}]")
        return x

    return check


def _stream(x: Any, field: str) -> StreamEntry:
    if not isinstance(x, list) or len(x) != 4:
        raise v.fail(field, x, "[name, codec, length, crc32]")
    return StreamEntry(
        v.choice(STREAM_NAMES)(x[0], f"{field}.name"),
        v.choice(v.STREAM_CODECS)(x[1], f"{field}.codec"),
        v.integer(0, 1 << 40)(x[2], f"{field}.length"),
        v.integer(0, 0xFFFFFFFF)(x[3], f"{field}.crc32"),
    )


FIELDS: dict[str, v.Check] = {
    "transform_version": v.integer(0, 1 << 16),
    "kvt": v.text(64),
    "codec": v.text(512),
    "index": v.integer(0, v.MAX_TOKENS),
    "start_token": v.integer(0, v.MAX_TOKENS),
    "tokens": v.integer(1, v.MAX_TOKENS),
    "shape": v.listing(v.integer(1, v.MAX_DIM), 3, 3),
    "dtype": v.choice(DTYPES),
    "theta": positive_number(),
    "key_weight": positive_number(0.0, 1e12),
    "sink": v.integer(0, v.MAX_TOKENS),
    "coder": v.choice(CODERS),
    "resolution": v.pair(v.integer(16, v.MAX_FRAME_SIDE)),
    "frames": v.integer(0, v.MAX_TOKENS),
    "escapes": v.integer(0, v.MAX_TOKENS),
    "streams": v.listing(_stream, 1, len(STREAM_NAMES)),
    "key": v.text(512, optional=True),
    "fine_tokens": v.integer(0, v.MAX_TOKENS),
    "fine_bits": v.integer(0, MAX_FINE_BITS),
    "recon": v.choice(RECONS),
    "pieces": v.listing(v.integer(1, 1 << 40), 0, v.MAX_TOKENS),
}


def check_header(h: Any) -> tuple[dict, tuple[StreamEntry, ...]]:
    """The header with every field checked (shape and resolution as lists of ints), and its
    stream entries; FormatError for a missing, mistyped or out-of-range field, a stream named
    twice, or a stream the coder needs that is missing."""
    if not isinstance(h, dict):
        raise FormatError("transform chunk header is not a JSON object")
    version = FIELDS["transform_version"](h.get("transform_version"), "transform_version")
    if version not in VERSIONS:
        raise FormatError(f"transform chunk version {version} is not readable (this reads {VERSIONS})")
    defaults = {**(V1_DEFAULTS if version == 1 else {}), **(V2_DEFAULTS if version < 3 else {})}
    known = set(FIELDS) - set(defaults)
    extra = sorted(set(h) - known)
    if extra:
        raise FormatError(f"transform chunk header (version {version}) has unknown fields {extra}")
    checks = {k: c for k, c in FIELDS.items() if k in known}
    checked = {**defaults, **v.fields_of(h, checks, {"key": None})}
    entries = checked.pop("streams")
    names = [e.name for e in entries]
    need = {"escapes", "video" if checked["coder"] == "hevc" else "samples"} | ({"sink"} if checked["sink"] else set())
    if len(set(names)) != len(names) or not need <= set(names):
        raise FormatError(
            f"transform chunk streams {names} do not fit coder {checked['coder']!r} (need {sorted(need)})"
        )
    for field in ("sink", "fine_tokens"):
        if checked[field] > checked["tokens"]:
            raise v.fail(field, checked[field], f"at most tokens={checked['tokens']}")
    _check_pieces(checked, entries)
    checked["shape"], checked["resolution"] = list(checked["shape"]), list(checked["resolution"])
    checked["pieces"] = list(checked["pieces"])
    return {**h, **checked, "streams": h["streams"]}, entries


def _check_pieces(h: dict, entries: tuple[StreamEntry, ...]) -> None:
    """The pieces, where there are any, are one per frame of a video chunk and add up to its video."""
    pieces = h["pieces"]
    if not pieces:
        return
    video = next((e.length for e in entries if e.name == "video"), None)
    if h["coder"] != "hevc" or len(pieces) != h["frames"] or sum(pieces) != video:
        raise v.fail(
            "pieces", list(pieces)[:8], f"one byte length per frame ({h['frames']}) adding up to the video's {video}"
        )
