"""HEVC codec, whole prefixes: the .kvc file (a header indexing chunk blobs, then the blobs)."""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable

import numpy as np
import torch

from kvcodec.codecs.base import EncodedChunk, Target
from kvcodec.codecs.hevc.decode import decode_chunk_blob, idle_decoders, inspect_chunk_blob, part_headers
from kvcodec.codecs.hevc.encode import check_kv, encode_chunks
from kvcodec.config import CodecConfig, resolution_pairs, torch_device
from kvcodec.container.format import (
    FILE_MAGIC,
    PLAIN,
    BlobEntry,
    FileHeader,
    check_chunk_against_file,
    content_id,
    crc32,
    file_chunk_key,
    object_version,
    parse_file,
    write_object,
)
from kvcodec.dtypes import DTYPE_NAMES, dtype_of
from kvcodec.errors import ChecksumError, ConfigError, FormatError, ShapeError
from kvcodec.restore.paged import PagedKV


def encode(
    kv: torch.Tensor,
    config: CodecConfig = CodecConfig(),
    *,
    encoder=None,
    on_chunk: Callable[[EncodedChunk], None] | None = None,
) -> bytes:
    """Encode a KV tensor (layers, 2, tokens, kv_heads, head_dim) into a kvcodec file (.kvc)."""
    check_kv(kv, config)  # before the file's id hashes it: anything else is a ShapeError, not an AttributeError
    file_id = content_id([kv], json.dumps(config.to_dict(), sort_keys=True))  # chunks keyed to this file
    count = -(-kv.shape[2] // config.chunk_tokens)
    keys = [file_chunk_key(file_id, i, count) for i in range(count)]
    chunks = encode_chunks(kv, config, encoder=encoder, on_chunk=on_chunk, keys=keys)
    entries, payloads, offset = [], [], 0
    for c in chunks:
        for res, blob in zip(c.resolutions, c.blobs):
            entries.append(BlobEntry(c.index, tuple(res), offset, len(blob), crc32(blob)))
            payloads.append(blob)
            offset += len(blob)
    L, _, T, H, D = kv.shape
    header = FileHeader(
        layers=L,
        kv_heads=H,
        head_dim=D,
        dtype=DTYPE_NAMES[kv.dtype],
        tokens=T,
        config=config.to_dict(),
        chunk_tokens=tuple(c.tokens for c in chunks),
        blobs=tuple(entries),
        file_id=file_id,
    )
    return write_object(FILE_MAGIC, header.to_json(), payloads)


def read_file_header(data: bytes | memoryview) -> tuple[FileHeader, memoryview]:
    return parse_file(data)


def file_chunks(
    data: bytes | memoryview,
    device: str | torch.device = "cpu",
    *,
    resolution: tuple[int, int] | None = None,
    out: Target | None = None,
) -> tuple[Target, list[tuple[memoryview, Target]]]:
    """Parse and verify a kvcodec file for decoding: returns the output KV tensor (allocated on
    `device` unless `out` is given) and, per chunk, its blob at `resolution` (default: the largest)
    with the slice of the output it restores into (a PagedKV output is every chunk's target: each
    chunk finds its tokens' blocks from its own start_token). Every blob's own header must name
    the chunk, first token and token count the file places it at. Decoders start here."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise ConfigError(
            f"a kvcodec file is decoded from its bytes (read the file first); got a {type(data).__name__}"
        )
    fh, payload = read_file_header(data)
    dtype = dtype_of(fh.dtype, "kvcodec file dtype")
    if resolution is None:
        resolution = max(fh.resolutions, key=lambda r: r[0] * r[1])
    elif isinstance(resolution, str):  # "512x512"
        pairs = resolution_pairs(resolution, "resolution")
        if len(pairs) != 1:
            raise ConfigError(f"resolution must be one frame size such as 512x512; got {resolution!r}")
        resolution = pairs[0]
    blobs = _chunk_blobs(fh, payload, tuple(resolution))
    if isinstance(out, PagedKV):
        out.check(fh.shape, dtype, 0)
    elif out is None:
        out = torch.empty(fh.shape, dtype=dtype, device=torch_device(device))
    elif tuple(out.shape) != fh.shape or out.dtype != dtype:
        raise ShapeError(f"output tensor is {tuple(out.shape)} {out.dtype}; file holds {fh.shape} {dtype}")
    jobs, start = [], 0
    for blob, tokens in zip(blobs, fh.chunk_tokens):
        jobs.append((blob, out if isinstance(out, PagedKV) else out[:, :, start : start + tokens]))
        start += tokens
    return out, jobs


def _chunk_blobs(fh: FileHeader, payload: memoryview, resolution: tuple[int, int]) -> list[memoryview]:
    """Each chunk's verified blob at `resolution`, checked against where the file places it; its
    frames laid out as every other coded chunk's (one encode codes a file with one plan)."""
    blobs, layouts = [], None
    for index in range(len(fh.chunk_tokens)):
        entry = fh.blob(index, resolution)
        blob = payload[entry.offset : entry.offset + entry.length]
        if crc32(blob) != entry.crc32:
            raise ChecksumError(f"chunk {index} at {resolution[0]}x{resolution[1]} fails its checksum")
        check_chunk_against_file(fh, index, inspect_chunk_blob(blob), resolution)
        layouts = _same_layouts(index, [h.layout for h in part_headers(blob)], layouts, resolution)
        blobs.append(blob)
    return blobs


def _same_layouts(index: int, layouts: list[dict], first: list[dict] | None, resolution) -> list[dict] | None:
    """The file's layouts so far (each part's): `first` where chunk `index` has the same (plain chunks
    have none), else FormatError: its header names another layout (altered, its checksums made again),
    and its video would be read as other values."""
    if not all(layouts):
        return first
    if first is not None and layouts != first:
        raise FormatError(
            f"chunk {index} at {resolution[0]}x{resolution[1]} lays its frames out otherwise than the file's other "
            "chunks (its header was altered)"
        )
    return layouts


def decode(
    data: bytes | memoryview,
    device: str | torch.device = "cpu",
    *,
    resolution: tuple[int, int] | None = None,
    out: Target | None = None,
    decoder=None,
    restore: str = "auto",
) -> Target:
    """Decode a kvcodec file into a KV tensor of its original shape and dtype on `device`
    (NVDEC for CUDA devices where available, restoring frame by frame; `out` and `restore` as in
    decode_chunk_blob)."""
    out, jobs = file_chunks(data, device, resolution=resolution, out=out)
    with contextlib.nullcontext(decoder) if decoder is not None else idle_decoders.borrow(out.device) as dec:
        for blob, target in jobs:
            decode_chunk_blob(blob, out=target, decoder=dec, restore=restore)
    return out


def inspect(data: bytes | memoryview) -> dict:
    """Summary of a kvcodec file: header, per-resolution bytes and ratio vs fp16."""
    fh, payload = read_file_header(data)
    fp16_bytes = 2 * int(np.prod(fh.shape))
    return {
        "format_version": object_version(data),
        "shape": list(fh.shape),
        "dtype": fh.dtype,
        "tokens": fh.tokens,
        "chunks": len(fh.chunk_tokens),
        "config": fh.config,
        "file_bytes": len(data),
        "fp16_bytes": fp16_bytes,
        "ratio_vs_fp16": fp16_bytes / len(data),  # the whole file: every stored resolution counts
        "resolutions": {f"{r[0]}x{r[1]}": _resolution_summary(fh, payload, r, fp16_bytes) for r in fh.resolutions},
    }


def describe(data: bytes | memoryview) -> dict:
    """`inspect` with the fields every kvcodec file's summary has (codecs/describe.py)."""
    from kvcodec.codecs.hevc.codec import hevc_id

    info = inspect(data)
    L, _, _, H, D = info["shape"]
    chunk_bytes = {name: r.pop("chunk_bytes") for name, r in info["resolutions"].items()}
    return {
        "format": "kvcodec-file",
        "version": info["format_version"],
        "codec": hevc_id(CodecConfig.from_dict(info["config"])),
        "layers": L,
        "kv_heads": H,
        "head_dim": D,
        **info,
        "chunk_bytes": chunk_bytes,
    }


def _resolution_summary(fh: FileHeader, payload: memoryview, res, fp16_bytes: int) -> dict:
    blobs = _chunk_blobs(fh, payload, tuple(res))  # each checksummed and checked against its place
    per_chunk = [part_headers(b) for b in blobs]
    total = sum(len(b) for b in blobs)
    streams: dict[str, int] = {}
    for h in (h for parts in per_chunk for h in parts):
        for s in h.streams:
            streams[s.name] = streams.get(s.name, 0) + s.length
    coded = [parts for parts in per_chunk if parts[0].quant != PLAIN]
    first = coded[0] if coded else per_chunk[0]  # a plain chunk (a few tokens) has no layout to show
    summary = {
        "bytes": total,
        "ratio_vs_fp16": fp16_bytes / total if total else 0.0,
        "streams": streams,
        "layout": first[0].layout,
        "frames_per_chunk": sum(h.frames for h in first),
        "video_bits": first[0].video_bits,
        "plain_chunks": len(per_chunk) - len(coded),
        "chunk_bytes": [len(b) for b in blobs],
    }
    if len(first) > 1:  # split chunks: each part has its own layout and video bits
        summary["parts"] = [
            {"layers": h.layers, "layout": h.layout, "frames": h.frames, "video_bits": h.video_bits} for h in first
        ]
    return summary
