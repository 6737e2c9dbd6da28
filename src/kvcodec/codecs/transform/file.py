"""Transform-coded KV files (.kvc written with --transform, magic KVTF): a header naming the
transform's sha256, the codec, the KV's shape and the chunks, then the chunk blobs (KVTC) of one
resolution, in token order (docs/FORMAT.md).

Version 2 (`kvtf_version`) also writes the settings every chunk was coded with (theta,
key_weight, sink, fine tail, recon, coder, resolution): each chunk's own header must say exactly
what the file says about it (its index, first token, length, shape, dtype, transform, codec and
settings), so a chunk moved, repeated, dropped or edited consistently (checksums recomputed) is
refused, not decoded into the wrong place or with the wrong parameters. Version 1 files (no
settings) still read: their chunks must agree with each other.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from kvcodec.codecs.transform.codec import CHUNK_MAGIC as TRANSFORM_MAGIC
from kvcodec.codecs.transform.codec import TransformCodec
from kvcodec.codecs.transform.header import (
    SETTING_CODERS,
    check_header,
    check_named_settings,
    chunk_coder,
    positive_number,
    sink_count,
)
from kvcodec.codecs.transform_ans.header import CHUNK_MAGIC as ANS_MAGIC
from kvcodec.codecs.transform_ans.header import AnsChunkHeader
from kvcodec.container import validate as v
from kvcodec.container.format import (
    content_id,
    crc32,
    file_chunk_key,
    file_chunk_key_fits,
    read_object,
    split_streams,
    write_object,
)
from kvcodec.errors import ChecksumError, ConfigError, FormatError, TruncatedError
from kvcodec.transform.quantize import MAX_FINE_BITS, RECONS

FILE_MAGIC = b"KVTF"
FORMAT_NAME = "kvcodec-transform-file"
KVTF_VERSION = 2
READABLE_KVTF_VERSIONS = (1, 2)  # 1: no format tag, no settings
DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}
# the chunk header fields every chunk of a file shares (version 1: checked chunk against chunk)
SHARED = ("theta", "key_weight", "fine_bits", "recon", "coder", "resolution")
MAX_CHUNKS = 1 << 20


def _entry(x: Any, field: str) -> tuple[int, int, int]:
    if not isinstance(x, list) or len(x) != 3:
        raise v.fail(field, x, "[tokens, length, crc32]")
    return (
        v.integer(1, v.MAX_TOKENS)(x[0], f"{field}.tokens"),
        v.integer(1, 1 << 40)(x[1], f"{field}.length"),
        v.integer(0, 0xFFFFFFFF)(x[2], f"{field}.crc32"),
    )


def _shape(x: Any, field: str) -> tuple[int, ...]:
    dims = v.listing(v.integer(1, v.MAX_TOKENS), 5, 5)(x, field)
    L, two, _, H, D = dims
    if two != 2 or max(L, H, D) > v.MAX_DIM:
        raise v.fail(field, x, f"[layers, 2, tokens, kv_heads, head_dim], each dimension at most {v.MAX_DIM}")
    return dims


SETTINGS = v.record(
    {
        "theta": positive_number(),
        "key_weight": positive_number(0.0, 1e12),
        "sink_tokens": v.integer(0, v.MAX_TOKENS),
        "chunk_tokens": v.integer(1, v.MAX_TOKENS),
        "fine_tokens": v.integer(0, v.MAX_TOKENS),
        "fine_bits": v.integer(0, MAX_FINE_BITS),
        "recon": v.choice(RECONS),
        "coder": v.choice((*SETTING_CODERS, "ans")),  # ans: chunks of the transform-ans codec (KVTA)
        "resolution": v.listing(v.integer(16, v.MAX_FRAME_SIDE), 2, 2),
    }
)
FIELDS: dict[str, v.Check] = {
    "kvt": v.text(64),
    "codec": v.text(512),
    "shape": _shape,
    "dtype": v.choice(tuple(DTYPES)),
    "chunks": v.listing(_entry, 1, MAX_CHUNKS),
}
FIELDS_V2 = {**FIELDS, "settings": SETTINGS, "file_id": v.text(64)}


def encode_file(kv: torch.Tensor, codec: TransformCodec, on_chunk=None) -> bytes:
    file_id = content_id([kv], codec.id)
    count = -(-kv.shape[2] // codec.chunk_tokens)
    keys = [file_chunk_key(file_id, i, count) for i in range(count)]  # version 2: bound to the file; 1: none
    chunks = codec.encode_chunks(kv, keys=keys, on_chunk=on_chunk)
    blobs = [c.blobs[0] for c in chunks]
    first = codec.header(blobs[0])
    header = {
        "format": FORMAT_NAME,
        "kvtf_version": KVTF_VERSION,
        "kvt": codec.kvt_hash,
        "codec": codec.id,
        "shape": list(kv.shape),
        "dtype": str(kv.dtype).replace("torch.", ""),
        "chunks": [[c.tokens, len(b), crc32(b)] for c, b in zip(chunks, blobs)],
        "file_id": file_id,
        "settings": {
            "theta": first["theta"],
            "key_weight": first["key_weight"],
            "sink_tokens": codec.sink_tokens,
            "chunk_tokens": codec.chunk_tokens,
            "fine_tokens": codec.fine_tokens,
            "fine_bits": first["fine_bits"],
            "recon": first["recon"],
            "coder": codec.coder,
            "resolution": list(first["resolution"]),
        },
    }
    return write_object(FILE_MAGIC, header, blobs)


def read_header(data: bytes | memoryview) -> tuple[dict, memoryview]:
    """The file's header, every field type- and range-checked, and its payload (exactly the
    chunks' bytes: no trailing bytes); refused before any allocation when the KV it announces is
    not what its chunks add up to or is implausibly large for the file."""
    h, payload = read_object(data, FILE_MAGIC, "transform-coded KV file")
    version = h.get("kvtf_version", 1)
    if isinstance(version, bool) or version not in READABLE_KVTF_VERSIONS:
        raise v.fail("kvtf_version", version, f"one of {READABLE_KVTF_VERSIONS}")
    if version >= 2 and h.get("format") != FORMAT_NAME:
        raise v.fail("format", h.get("format"), repr(FORMAT_NAME))
    fields = FIELDS_V2 if version >= 2 else FIELDS
    extra = sorted(set(h) - set(fields) - ({"format", "kvtf_version"} if version >= 2 else set()))
    if extra:
        raise FormatError(f"transform-coded KV file header (version {version}) has unknown fields {extra}")
    checked = v.fields_of(h, fields, {})
    shape, chunks = checked["shape"], checked["chunks"]
    if sum(c[0] for c in chunks) != shape[2]:
        raise v.fail("chunks", [c[0] for c in chunks][:8], f"chunk token counts adding up to shape[2]={shape[2]}")
    need = sum(c[1] for c in chunks)
    if len(payload) < need:
        raise TruncatedError(f"transform-coded KV file truncated: {len(payload)} of {need} payload bytes")
    if len(payload) > need:
        raise FormatError(f"transform-coded KV file has {len(payload) - need} unexpected bytes after its last chunk")
    decoded = math.prod(shape) * torch.tensor([], dtype=DTYPES[checked["dtype"]]).element_size()
    v.check_expansion(decoded, len(memoryview(data)), "transform-coded KV file")
    settings = checked.get("settings")
    if settings is not None:
        _check_settings(settings, chunks)
        check_named_settings(settings, checked["codec"])
        checked["settings"] = {**settings, "resolution": list(settings["resolution"])}
    out = {**h, **checked, "kvtf_version": version, "shape": list(shape), "chunks": [list(c) for c in chunks]}
    return out, payload


def _check_settings(s: dict, chunks: tuple) -> None:
    """Every chunk but the last holds chunk_tokens tokens; the last at most that many."""
    sizes = [c[0] for c in chunks]
    if any(t != s["chunk_tokens"] for t in sizes[:-1]) or sizes[-1] > s["chunk_tokens"]:
        raise v.fail(
            "chunks", sizes[:8], f"chunks of settings.chunk_tokens={s['chunk_tokens']} tokens (the last fewer)"
        )


def expected_chunk(h: dict, index: int, start: int, tokens: int) -> dict[str, Any]:
    """What the header of chunk `index` (tokens [start, start + tokens)) of file header `h` must say."""
    L, _, T, H, D = h["shape"]
    want: dict[str, Any] = {
        "index": index,
        "start_token": start,
        "tokens": tokens,
        "shape": [L, H, D],
        "dtype": h["dtype"],
        "kvt": h["kvt"],
        "codec": h["codec"],
    }
    s = h.get("settings")
    if s is not None:
        end = start + tokens
        want.update({k: s[k] for k in SHARED})
        want["coder"] = chunk_coder(s["coder"], index)  # mixed: each chunk's own
        want["sink"] = sink_count(s["sink_tokens"], start, tokens)
        want["fine_tokens"] = max(0, end - max(start, T - s["fine_tokens"])) if s["fine_bits"] else 0
    return want


def check_chunk(h: dict, ch: dict, want: dict[str, Any], first: dict | None) -> None:
    """Refuse chunk header `ch` unless it says what the file says about it (and, in a version 1
    file, shares the first chunk's settings)."""
    if first is not None and h.get("settings") is None:
        want = {**want, **{k: first[k] for k in SHARED}}
    index, count, file_id = want["index"], len(h["chunks"]), h.get("file_id")
    if not file_chunk_key_fits(ch.get("key"), file_id, index, count):
        want = {**want, "key": file_chunk_key(file_id, index, count)}
    for name, value in want.items():
        got = ch.get(name)
        if (list(got) if isinstance(got, tuple) else got) != value:
            raise FormatError(
                f"chunk at position {index} of the transform-coded file says {name}={got!r}; "
                f"the file expects {value!r} (a chunk moved, repeated, dropped or edited)"
            )


def decode_file(data: bytes | memoryview, codec: TransformCodec, device: str | torch.device = "cpu") -> torch.Tensor:
    h, payload = read_header(data)
    if h["kvt"] != codec.kvt_hash:
        raise ConfigError(
            f"file was coded with transform {h['kvt'][:16]}, the given .kvt is {codec.kvt_hash[:16]}: "
            "decode it with the .kvt it was encoded with"
        )
    codec.cal.check_shape(tuple(h["shape"]))
    chunks = _verified_chunks(h, payload, codec.header)  # every chunk verified before any allocation
    out = torch.empty(tuple(h["shape"]), dtype=DTYPES[h["dtype"]], device=torch.device(device))
    for blob, _, s, tokens in chunks:
        codec.decode_chunk(blob, out[:, :, s : s + tokens])
    return out


def _verified_chunks(h: dict, payload: memoryview, header_of) -> list[tuple[memoryview, dict, int, int]]:
    """(blob, its header, first token, tokens) of every chunk of file header `h`: each one's
    checksum verified and its header (`header_of(blob)`) saying what the file says about it."""
    out, pos, start, first = [], 0, 0, None
    for i, (tokens, length, crc) in enumerate(h["chunks"]):
        blob = payload[pos : pos + length]
        if crc32(blob) != crc:
            raise ChecksumError(f"chunk {i} fails its checksum")
        ch = header_of(blob)
        check_chunk(h, ch, expected_chunk(h, i, start, tokens), first)
        first = first or ch
        out.append((blob, ch, start, tokens))
        pos, start = pos + length, start + tokens
    return out


def _transform_chunk(blob: memoryview) -> dict:
    h, payload = read_object(blob, TRANSFORM_MAGIC, "transform-coded chunk")
    h, entries = check_header(h)
    split_streams(payload, entries, f"transform chunk {h['index']}")
    return h


def _ans_chunk(blob: memoryview) -> dict:
    h, payload = read_object(blob, ANS_MAGIC, "transform-ANS chunk")
    ah = AnsChunkHeader.from_json(h)
    split_streams(payload, ah.streams, f"transform-ANS chunk {ah.index}")
    return ah.restorer_fields()


CHUNK_HEADERS = {TRANSFORM_MAGIC: _transform_chunk, ANS_MAGIC: _ans_chunk}  # by chunk magic


def chunk_header(blob: memoryview) -> dict:
    """A chunk's checked header without its .kvt (what inspect shows): a transform (KVTC) or a
    transform-ANS (KVTA) chunk, read by its own reader."""
    reader = CHUNK_HEADERS.get(bytes(blob[:4]))
    if reader is None:
        raise FormatError(f"transform-coded file holds a chunk of magic {bytes(blob[:4])!r}, not a transform chunk")
    return reader(blob)


def _settings_of_chunks(headers: list[dict], entries: list) -> dict[str, Any]:
    """A version 1 file's settings (it writes none), from its chunks: their shared fields, the sink
    and fine tokens they hold, the first chunk's length."""
    return {
        **{k: headers[0][k] for k in SHARED},
        "sink_tokens": sum(ch["sink"] for ch in headers),
        "chunk_tokens": entries[0][0],
        "fine_tokens": sum(ch["fine_tokens"] for ch in headers),
    }


def describe(data: bytes | memoryview) -> dict[str, Any]:
    """The file's summary (codecs/describe.py) from its header and every chunk's verified header:
    the calibration (`kvt`, the sha256 of the .kvt it was coded with) and settings, the chunks'
    sizes, levels and stream totals. Needs no .kvt."""
    h, payload = read_header(data)
    chunks = _verified_chunks(h, payload, chunk_header)
    L, _, T, H, D = h["shape"]
    settings = h.get("settings") or _settings_of_chunks([ch for _, ch, _, _ in chunks], h["chunks"])
    streams: dict[str, int] = {}
    for _, ch, _, _ in chunks:
        for name, _, length, _ in ch["streams"]:
            streams[name] = streams.get(name, 0) + length
    fp16_bytes = 2 * math.prod(h["shape"])
    return {
        "format": FORMAT_NAME,
        "version": h["kvtf_version"],
        "codec": h["codec"],
        "kvt": h["kvt"],
        "coder": settings["coder"],
        "shape": h["shape"],
        "dtype": h["dtype"],
        "layers": L,
        "kv_heads": H,
        "head_dim": D,
        "tokens": T,
        "chunks": len(chunks),
        "chunk_tokens": settings["chunk_tokens"],
        "file_bytes": len(memoryview(data)),
        "fp16_bytes": fp16_bytes,
        "ratio_vs_fp16": fp16_bytes / len(memoryview(data)),
        "settings": settings,
        "streams": streams,
        "chunk_bytes": {"x".join(map(str, settings["resolution"])): [len(b) for b, _, _, _ in chunks]},
        "chunk_theta": [ch["theta"] for _, ch, _, _ in chunks],
    }


def describe_chunk(blob: bytes | memoryview) -> dict[str, Any]:
    """One transform (KVTC) or transform-ANS (KVTA) chunk blob's summary (codecs/describe.py):
    its header and streams checked, no .kvt needed."""
    from kvcodec.codecs.describe import chunk_summary

    view = memoryview(blob)
    h = chunk_header(view)
    L, H, D = h["shape"]
    streams: dict[str, int] = {}
    for name, _, length, _ in h["streams"]:
        streams[name] = streams.get(name, 0) + length
    ans = h["coder"] == "ans"
    return chunk_summary(
        view,
        h["resolution"],
        2 * L * 2 * h["tokens"] * H * D,
        format="kvcodec-transform-ans-chunk" if ans else "kvcodec-transform-chunk",
        version=h["ans_version"] if ans else h["transform_version"],
        codec=h["codec"],
        kvt=h["kvt"],
        coder=h["coder"],
        dtype=h["dtype"],
        layers=L,
        kv_heads=H,
        head_dim=D,
        tokens=h["tokens"],
        chunk_index=h["index"],
        start_token=h["start_token"],
        key=h.get("key"),
        theta=h["theta"],
        streams=streams,
        frames=h.get("frames", 0),
        pieces=list(h.get("pieces") or []),  # version 3: each frame's own stream, its bytes
    )
