"""What a kvcodec file is, whatever its format: `describe(data)` reads its magic and hands it to
that format's own reader, which verifies it (header, checksums, every chunk's header against the
place the file gives it) and summarizes it.

Every summary has the same core fields: `format` (its header's format name), `magic`, `version`
(of that format), `codec` (the id of the codec that wrote it), `dtype`, `layers`, `tokens`,
`chunks`, `file_bytes`, `fp16_bytes` (the KV it holds, as fp16), `ratio_vs_fp16` (the whole
file) and `chunk_bytes` (per stored resolution, each chunk's bytes in token order); the formats
add their own (the HEVC file its config and layouts, the transform file its calibration, the
grouped file its groups). A chunk blob (as a store holds it) reads the same way: one chunk, with
its index, first token and key. A format is one entry of READERS: magic -> "module:function".
"""

from __future__ import annotations

from typing import Any

from kvcodec.errors import FormatError, TruncatedError
from kvcodec.plugins import load_object

READERS: dict[bytes, str] = {
    b"KVCF": "kvcodec.codecs.hevc.file:describe",  # .kvc: HEVC (and split-stream) chunks
    b"KVTF": "kvcodec.codecs.transform.file:describe",  # .kvc written with --transform (transform, transform-ans)
    b"KVGF": "kvcodec.codecs.grouped_file:describe",  # a multi-group prefix (kvspec.GroupedKV)
    # one chunk blob, as a store holds it (a file:// store's objects are files)
    b"KVCC": "kvcodec.codecs.hevc.decode:describe_chunk",
    b"KVCS": "kvcodec.codecs.hevc.decode:describe_chunk",
    b"KVTC": "kvcodec.codecs.transform.file:describe_chunk",
    b"KVTA": "kvcodec.codecs.transform.file:describe_chunk",
    b"KVCG": "kvcodec.codecs.grouped:describe_chunk",
    b"KVRW": "kvcodec.codecs.raw:describe_chunk",  # the raw baseline codec's chunks
}
CORE = ("format", "magic", "version", "codec", "dtype", "layers", "tokens", "chunks", "file_bytes", "fp16_bytes")
CORE += ("ratio_vs_fp16", "chunk_bytes")  # every reader gives these (tests/test_inspect.py)


def describe(data: bytes | memoryview) -> dict[str, Any]:
    """The summary of a kvcodec file (module docstring); FormatError for data that is no kvcodec
    file, TruncatedError / ChecksumError / FormatError for a damaged one."""
    magic = bytes(memoryview(data)[:4])
    target = READERS.get(magic)
    if target is None:
        known = ", ".join(m.decode() for m in READERS)
        if 0 < len(magic) < 4 and any(m.startswith(magic) for m in READERS):
            raise TruncatedError(f"kvcodec file truncated: {len(data)} bytes")
        raise FormatError(f"not a kvcodec file: magic {magic!r} (inspect reads {known})")
    return {"magic": magic.decode(), **load_object(target)(data)}


def chunk_summary(blob: bytes | memoryview, resolution, fp16_bytes: int, **fields: Any) -> dict[str, Any]:
    """The core fields of one chunk blob (`fields`: format, version, codec, dtype, layers, tokens
    and the format's own), its bytes and ratio vs fp16 at its one resolution."""
    size = len(memoryview(blob))
    res = f"{resolution[0]}x{resolution[1]}"
    return {
        **fields,
        "chunks": 1,
        "file_bytes": size,
        "fp16_bytes": fp16_bytes,
        "ratio_vs_fp16": fp16_bytes / size,
        "chunk_bytes": {res: [size]},
    }
