"""What a kvcodec file is, whatever its format: `describe(data)` reads its magic and hands it to
that format's own reader, which verifies it (header, checksums, every chunk's header against the
place the file gives it) and summarizes it.

Every summary has the same core fields: `format` (its header's format name), `magic`, `version`
(of that format), `codec` (the id of the codec that wrote it), `dtype`, `layers`, `tokens`,
`chunks`, `file_bytes`, `fp16_bytes` (the KV it holds, as fp16), `ratio_vs_fp16` (the whole
file) and `chunk_bytes` (per stored resolution, each chunk's bytes in token order); the formats
add their own (the HEVC file its config and layouts, the transform file its calibration, the
grouped file its groups). A format is one entry of READERS: magic -> "module:function".
"""

from __future__ import annotations

from typing import Any

from kvcodec.errors import FormatError, TruncatedError
from kvcodec.plugins import load_object

READERS: dict[bytes, str] = {
    b"KVCF": "kvcodec.codecs.hevc_file:describe",  # .kvc: HEVC (and split-stream) chunks
    b"KVTF": "kvcodec.codecs.transform_file:describe",  # .kvc written with --transform (transform, transform-ans)
    b"KVGF": "kvcodec.codecs.grouped_file:describe",  # a multi-group prefix (kvspec.GroupedKV)
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


def ratio(fp16_bytes: int, size: int) -> float:
    return fp16_bytes / size if size else 0.0
