"""A whole multi-group KV prefix (kvspec.GroupedKV) as one file, magic "KVGF".

    data = encode_grouped(gkv, GroupedCodec(HevcCodec(CodecConfig(quant="exact"))))
    gkv2 = decode_grouped(data, codec)               # the same codec (its id is in the file)
    inspect_grouped(data)                            # spec, groups, positions, sizes per resolution

Container framing (docs/FORMAT.md); JSON header: {"format": "kvcodec-grouped-file",
"grouped_version": 2, "codec": codec id, "spec", "stop", "starts", "chunk_tokens", "blobs":
[{"chunk_index", "resolution", "offset", "length", "crc32"}]}; payload: the grouped chunk blobs
(KVCG), every chunk at every resolution of the codec.
"""

from __future__ import annotations

import json
import math
from typing import Any

import torch

from kvcodec.codecs.grouped import GROUPED_VERSION, READABLE_VERSIONS, GroupedCodec, chunk_info, spec_of
from kvcodec.container import validate as v
from kvcodec.container.format import (
    BLOB_FIELDS,
    content_id,
    crc32,
    file_chunk_key,
    file_chunk_key_fits,
    read_object,
    write_object,
)
from kvcodec.dtypes import DTYPES
from kvcodec.errors import ChecksumError, ConfigError, FormatError, ShapeError, TruncatedError
from kvcodec.kvspec import GroupedKV, KVSpec

MAGIC = b"KVGF"
FORMAT_NAME = "kvcodec-grouped-file"


def encode_grouped(kv: GroupedKV, codec: GroupedCodec) -> bytes:
    """Every chunk of `kv` at every resolution of `codec`, in one file."""
    if not isinstance(codec, GroupedCodec):
        raise ConfigError(f"encode_grouped needs a GroupedCodec; got {type(codec).__name__}")
    blobs, payloads, offset = [], [], 0
    file_id = content_id(kv.tensors, codec.id, json.dumps(kv.spec.to_dict(), sort_keys=True), str(kv.starts))
    count = -(-kv.stop // codec.chunk_tokens)
    keys = [file_chunk_key(file_id, n, count) for n in range(count)]
    for chunk in codec.encode_chunks(kv, keys=keys):
        for res, blob in zip(chunk.resolutions, chunk.blobs):
            blobs.append(
                {
                    "chunk_index": chunk.index,
                    "resolution": list(res),
                    "offset": offset,
                    "length": len(blob),
                    "crc32": crc32(blob),
                }
            )
            payloads.append(blob)
            offset += len(blob)
    header = {
        "format": FORMAT_NAME,
        "grouped_version": GROUPED_VERSION,
        "codec": codec.id,
        "spec": kv.spec.to_dict(),
        "stop": kv.stop,
        "starts": list(kv.starts),
        "chunk_tokens": codec.chunk_tokens,
        "file_id": file_id,
        "blobs": blobs,
    }
    return write_object(MAGIC, header, payloads)


_BLOB = v.record(BLOB_FIELDS)  # as a dict
_FIELDS = {
    "codec": v.text(1024),
    "stop": v.integer(1, v.MAX_TOKENS),
    "starts": v.listing(v.integer(0, v.MAX_TOKENS), 1, 4 * v.MAX_DIM),
    "chunk_tokens": v.integer(1, v.MAX_TOKENS),
    "blobs": v.listing(_BLOB, 1, 1 << 24),
    "file_id": v.text(64),
}


def _read(data: bytes | memoryview) -> tuple[dict[str, Any], KVSpec, memoryview]:
    """The file's header, every field type- and range-checked, and its payload. Refused before
    any allocation: blobs that do not tile the payload exactly (gaps, overlaps, trailing bytes),
    a blob list that is not one blob per chunk and resolution, starts past the stop, and a KV
    implausibly large for the file."""
    header, payload = read_object(data, MAGIC, "grouped kvcodec file")
    fields = (*_FIELDS, "spec")
    version = v.tagged_version(header, FORMAT_NAME, "grouped_version", READABLE_VERSIONS, fields, "grouped file")
    spec = spec_of(header.get("spec"))
    f = v.fields_of(header, _FIELDS, {} if version >= 2 else {"file_id": None})
    stop, starts, ct, blobs = f["stop"], f["starts"], f["chunk_tokens"], list(f["blobs"])
    if len(starts) != len(spec.groups) or max(starts) > stop:
        raise v.fail("starts", list(starts)[:8], f"{len(spec.groups)} first positions, none past stop={stop}")
    resolutions = {tuple(b["resolution"]) for b in blobs}
    chunks = -(-stop // ct)
    have = sorted((b["chunk_index"], tuple(b["resolution"])) for b in blobs)
    if len(blobs) != chunks * len(resolutions) or have != sorted((c, r) for c in range(chunks) for r in resolutions):
        raise v.fail("blobs", f"{len(blobs)} entries", f"one blob per chunk ({chunks}) and resolution")
    pos = 0
    for b in sorted(blobs, key=lambda b: b["offset"]):
        if b["offset"] != pos:
            raise v.fail("blobs", b, f"blobs laid end to end (the next at offset {pos})")
        pos += b["length"]
    if len(payload) != pos:
        raise (TruncatedError if len(payload) < pos else FormatError)(
            f"grouped file payload has {len(payload)} bytes; its blobs take {pos}"
        )
    if spec.dtype not in v.DTYPE_BYTES:
        raise v.fail("spec.dtype", spec.dtype, "one of " + ", ".join(v.DTYPE_BYTES))
    decoded = sum(math.prod(g.shape(stop - s)) for g, s in zip(spec.groups, starts)) * v.DTYPE_BYTES[spec.dtype]
    v.check_expansion(decoded, len(memoryview(data)), "grouped kvcodec file")
    header.update(f, version=version, stop=stop, starts=starts, blobs=blobs)
    return header, spec, payload


def _accepts(codec: GroupedCodec, file_codec: str, version: int) -> bool:
    """Whether `codec` decodes a file written by codec id `file_codec` (a version 1 file names the
    same codec with the version 1 prefix)."""
    return file_codec == codec.id or (
        version == 1 and file_codec == codec.id.replace(f"grouped-v{GROUPED_VERSION}-", "grouped-v1-", 1)
    )


def decode_grouped(
    data: bytes | memoryview,
    codec: GroupedCodec,
    device: str | torch.device = "cpu",
    resolution: tuple[int, int] | None = None,
) -> GroupedKV:
    """The GroupedKV a file holds, restored on `device` from one resolution (default: the first).
    Each chunk must say it is the chunk its entry lists (index, first token, tokens, resolution)."""
    header, spec, payload = _read(data)
    if not _accepts(codec, header["codec"], header["version"]):
        raise ConfigError(f"the file was written by codec {header['codec']}; this codec is {codec.id}")
    res = list(resolution or codec.resolutions[0])
    ct, stop, starts = header["chunk_tokens"], header["stop"], header["starts"]
    if ct != codec.chunk_tokens:
        raise v.fail("chunk_tokens", ct, f"{codec.chunk_tokens} (the codec's)")
    chunks = sorted((b for b in header["blobs"] if list(b["resolution"]) == res), key=lambda b: b["chunk_index"])
    if not chunks:
        raise FormatError(f"grouped file holds no chunk at {res}")
    dtype = DTYPES[spec.dtype]
    try:
        out = GroupedKV(
            spec,
            stop,
            starts,
            tuple(torch.empty(g.shape(stop - s), dtype=dtype, device=device) for g, s in zip(spec.groups, starts)),
        )
    except ShapeError as e:
        raise FormatError(f"grouped file header: {e}") from e
    for b in chunks:
        blob = _verified_blob(header, spec, payload, b, codec.inspect_chunk)
        start = b["chunk_index"] * ct
        codec.decode_chunk(blob, out.view(start, min(start + ct, stop)))
    return out


def _verified_blob(
    header: dict[str, Any], spec: KVSpec, payload: memoryview, b: dict[str, Any], inspect_chunk
) -> memoryview:
    """Blob entry `b`'s bytes, checksummed, its header (`inspect_chunk(blob)`) saying it is the
    chunk the entry lists."""
    blob = payload[b["offset"] : b["offset"] + b["length"]]
    if crc32(blob) != b["crc32"]:
        raise ChecksumError(f"grouped file: chunk {b['chunk_index']} checksum mismatch")
    _check_chunk(inspect_chunk(blob), header, spec, b["chunk_index"])
    return blob


def expected_parts(starts: list[int], start: int, stop: int) -> list[tuple[int, int, int]]:
    """(group, first position, positions) of each group's part in the chunk of positions [start, stop) of a
    file whose groups hold positions from `starts`: what the chunk holds of each, in group order. Pure."""
    firsts = [(g, max(s, start)) for g, s in enumerate(starts)]
    return [(g, first, stop - first) for g, first in firsts if first < stop]


def _check_chunk(info, header: dict[str, Any], spec: KVSpec, index: int) -> None:
    """Refuse a chunk blob that is not chunk `index` of this file: its place, its file and the file's chunk
    count (the key), the file's spec (dtype included) and each group's positions the file's starts give."""
    if not isinstance(getattr(info, "parts", None), tuple):
        raise FormatError(f"grouped file: the chunk listed as chunk {index} is not a grouped chunk blob")
    ct, stop = header["chunk_tokens"], header["stop"]
    start = index * ct
    end = min(start + ct, stop)
    count, file_id = -(-stop // ct), header["file_id"]
    got = {"index": info.index, "start_token": info.start_token, "tokens": info.tokens, "key": info.key}
    want = {"index": index, "start_token": start, "tokens": end - start, "key": file_chunk_key(file_id, index, count)}
    if file_chunk_key_fits(info.key, file_id, index, count):  # the older form of the key too
        want["key"] = info.key
    got |= {"spec": info.spec, "parts": [(p.group, p.start, p.tokens) for p in info.parts]}
    want |= {"spec": spec, "parts": expected_parts(header["starts"], start, end)}
    for name, value in want.items():
        if got[name] != value:
            raise FormatError(
                f"grouped file: the chunk listed as chunk {index} says {name}={got[name]}; expected {value} "
                "(a chunk moved, of another file, or a file header edited)"
            )


def inspect_grouped(data: bytes | memoryview) -> dict[str, Any]:
    """Header facts: spec, groups (name, layers, first position held), positions, sizes per resolution."""
    header, spec, _ = _read(data)
    sizes: dict[str, int] = {}
    for b in header["blobs"]:
        key = "x".join(map(str, b["resolution"]))
        sizes[key] = sizes.get(key, 0) + b["length"]
    groups = [{"name": g.name, "layers": list(g.layers), "start": s} for g, s in zip(spec.groups, header["starts"])]
    return {
        "format": FORMAT_NAME,
        "codec": header["codec"],
        "dtype": spec.dtype,
        "layers": len(spec.layers),
        "tokens": header["stop"],
        "groups": groups,
        "chunk_tokens": header["chunk_tokens"],
        "bytes_per_resolution": sizes,
    }


def describe(data: bytes | memoryview) -> dict[str, Any]:
    """`inspect_grouped` with the fields every kvcodec file's summary has (codecs/describe.py),
    every blob checksummed and its header checked against its place (no codec needed)."""
    header, spec, payload = _read(data)
    info = inspect_grouped(data)
    chunk_bytes: dict[str, list[int]] = {}
    for b in sorted(header["blobs"], key=lambda b: b["chunk_index"]):
        _verified_blob(header, spec, payload, b, chunk_info)
        chunk_bytes.setdefault("x".join(map(str, b["resolution"])), []).append(b["length"])
    fp16_bytes = 2 * sum(math.prod(g.shape(header["stop"] - s)) for g, s in zip(spec.groups, header["starts"]))
    for g, group in zip(spec.groups, info["groups"]):
        group.update(kind=g.kind, heads=g.heads, head_dim=g.head_dim)
    return {
        **info,
        "version": header["version"],
        "chunks": -(-header["stop"] // header["chunk_tokens"]),
        "file_bytes": len(memoryview(data)),
        "fp16_bytes": fp16_bytes,
        "ratio_vs_fp16": fp16_bytes / len(memoryview(data)),
        "chunk_bytes": chunk_bytes,
    }
