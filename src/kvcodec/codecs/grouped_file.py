"""A whole multi-group KV prefix (kvspec.GroupedKV) as one file, magic "KVGF".

    data = encode_grouped(gkv, GroupedCodec(HevcCodec(CodecConfig(quant="exact"))))
    gkv2 = decode_grouped(data, codec)               # the same codec (its id is in the file)
    inspect_grouped(data)                            # spec, groups, positions, sizes per resolution

Container framing (docs/FORMAT.md); JSON header: {"format": "kvcodec-grouped-file",
"grouped_version": 1, "codec": codec id, "spec", "stop", "starts", "chunk_tokens", "blobs":
[{"chunk_index", "resolution", "offset", "length", "crc32"}]}; payload: the grouped chunk blobs
(KVCG), every chunk at every resolution of the codec.
"""

from __future__ import annotations

from typing import Any

import torch

from kvcodec.codecs.grouped import GROUPED_VERSION, GroupedCodec
from kvcodec.container.format import crc32, read_object, write_object
from kvcodec.dtypes import DTYPES
from kvcodec.errors import ChecksumError, ConfigError, FormatError, ShapeError, TruncatedError
from kvcodec.kvspec import GroupedKV, KVSpec

MAGIC = b"KVGF"
FORMAT_NAME = "kvcodec-grouped-file"
_BLOB_FIELDS = ("chunk_index", "resolution", "offset", "length", "crc32")


def encode_grouped(kv: GroupedKV, codec: GroupedCodec) -> bytes:
    """Every chunk of `kv` at every resolution of `codec`, in one file."""
    if not isinstance(codec, GroupedCodec):
        raise ConfigError(f"encode_grouped needs a GroupedCodec; got {type(codec).__name__}")
    blobs, payloads, offset = [], [], 0
    for chunk in codec.encode_chunks(kv):
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
        "blobs": blobs,
    }
    return write_object(MAGIC, header, payloads)


def _read(data: bytes | memoryview) -> tuple[dict[str, Any], KVSpec, memoryview]:
    header, payload = read_object(data, MAGIC, "grouped kvcodec file")
    if header.get("format") != FORMAT_NAME or header.get("grouped_version") != GROUPED_VERSION:
        raise FormatError(f"grouped file version {header.get('grouped_version')!r} is not {GROUPED_VERSION}")
    spec = KVSpec.from_dict(header.get("spec"))
    try:
        blobs = [{f: b[f] for f in _BLOB_FIELDS} for b in header["blobs"]]
        ok = all(
            isinstance(b[f], int) and b[f] >= 0 for b in blobs for f in ("chunk_index", "offset", "length", "crc32")
        )
        stop, starts = int(header["stop"]), tuple(int(s) for s in header["starts"])
    except (KeyError, TypeError, ValueError) as e:
        raise FormatError(f"grouped file header is malformed: {e!r}") from e
    if (
        not ok
        or len(starts) != len(spec.groups)
        or not isinstance(header.get("chunk_tokens"), int)
        or header["chunk_tokens"] < 1
    ):
        raise FormatError("grouped file header lists impossible blobs or starts")
    end = max((b["offset"] + b["length"] for b in blobs), default=0)
    if len(payload) != end:
        raise (TruncatedError if len(payload) < end else FormatError)(
            f"grouped file payload has {len(payload)} bytes; its blobs take {end}"
        )
    header.update(blobs=blobs, stop=stop, starts=starts)
    return header, spec, payload


def decode_grouped(
    data: bytes | memoryview,
    codec: GroupedCodec,
    device: str | torch.device = "cpu",
    resolution: tuple[int, int] | None = None,
) -> GroupedKV:
    """The GroupedKV a file holds, restored on `device` from one resolution (default: the first)."""
    header, spec, payload = _read(data)
    if header.get("codec") != codec.id:
        raise ConfigError(f"the file was written by codec {header.get('codec')}; this codec is {codec.id}")
    res = list(resolution or codec.resolutions[0])
    ct, stop, starts = int(header["chunk_tokens"]), header["stop"], header["starts"]
    chunks = sorted((b for b in header["blobs"] if b["resolution"] == res), key=lambda b: b["chunk_index"])
    if [b["chunk_index"] for b in chunks] != list(range(-(-stop // ct))):
        raise FormatError(f"grouped file does not hold every chunk of its {stop} tokens at {res}")
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
        blob = payload[b["offset"] : b["offset"] + b["length"]]
        if crc32(blob) != b["crc32"]:
            raise ChecksumError(f"grouped file: chunk {b['chunk_index']} checksum mismatch")
        start = b["chunk_index"] * ct
        codec.decode_chunk(blob, out.view(start, min(start + ct, stop)))
    return out


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
