"""Plain chunk blobs: a chunk's values in their own dtype, zstd-coded when that is smaller.

A chunk of a few tokens costs more as video than as its raw values: the quantization side
information (offset and step per channel, 4 bytes) and the channel centres (1 byte) outweigh
the data, and a frame is padded to its full size. Such a chunk is stored plain instead, which
is also lossless: the decoder restores every bit, whatever quantization was asked for. The
codec keeps the coded blob unless it is at least as large as the values themselves
(`prefer_plain`), so chunks of real length are never affected.
"""

from __future__ import annotations

import logging

import torch
import zstandard

from kvcodec.container.format import CHUNK_MAGIC, PLAIN, ChunkHeader, StreamEntry, crc32, write_object
from kvcodec.dtypes import DTYPE_NAMES, DTYPES
from kvcodec.errors import CorruptStreamError

log = logging.getLogger(__name__)
ZSTD_LEVEL = 3


def prefer_plain(coded_bytes: int, raw_bytes: int) -> bool:
    """Whether a chunk whose coded blob has `coded_bytes` should be stored plain: only when the
    coding does not shrink the `raw_bytes` of its values (small chunks)."""
    return coded_bytes >= raw_bytes


def keep_smaller(coded: bytes, x: torch.Tensor, **where) -> bytes:
    """`coded`, or the plain blob of `x` when the coding expands it and plain is smaller
    (`where`: chunk_index, start_token, resolution, key as for plain_chunk_blob)."""
    if not prefer_plain(len(coded), x.numel() * x.element_size()):
        return coded
    plain = plain_chunk_blob(x, **where)
    if len(plain) >= len(coded):
        return coded
    log.info(
        "chunk %d (%d tokens): coded %d bytes >= its %d bytes of values; stored plain (lossless) in %d bytes",
        where["chunk_index"],
        x.shape[2],
        len(coded),
        x.numel() * x.element_size(),
        len(plain),
    )
    return plain


def plain_chunk_blob(
    x: torch.Tensor,
    *,
    chunk_index: int,
    start_token: int,
    resolution: tuple[int, int],
    key: str | None = None,
) -> bytes:
    """A chunk blob holding `x` (layers, 2, tokens, kv_heads, head_dim) bit for bit."""
    layers, _, tokens, kv_heads, head_dim = x.shape
    raw = x.detach().to("cpu").contiguous().view(torch.uint8).numpy().tobytes()
    packed = zstandard.ZstdCompressor(level=ZSTD_LEVEL).compress(raw)
    codec, data = ("zstd", packed) if len(packed) < len(raw) else ("raw", raw)
    header = ChunkHeader(
        layers=layers,
        kv_heads=kv_heads,
        head_dim=head_dim,
        dtype=DTYPE_NAMES[x.dtype],
        chunk_index=chunk_index,
        start_token=start_token,
        tokens=tokens,
        quant=PLAIN,
        layer_bits=(),
        param_dtype="",
        resolution=tuple(resolution),
        layout={},
        frames=0,
        streams=(StreamEntry(PLAIN, codec, len(data), crc32(data)),),
        key=key,
    )
    return write_object(CHUNK_MAGIC, header.to_json(), [data])


def plain_values(h: ChunkHeader, streams: dict[str, memoryview]) -> torch.Tensor:
    """The values of a verified plain chunk (its streams already checksummed), on the CPU."""
    size = h.decoded_bytes
    entry = h.streams[0]
    data = streams[PLAIN]
    if entry.codec == "zstd":
        try:
            data = zstandard.ZstdDecompressor().decompress(bytes(data), max_output_size=size)
        except zstandard.ZstdError as e:
            raise CorruptStreamError(f"plain stream does not decompress: {e}") from e
    if len(data) != size or entry.codec not in ("zstd", "raw"):
        raise CorruptStreamError(f"plain stream holds {len(data)} bytes ({entry.codec}); the header announces {size}")
    values = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    return values.view(DTYPES[h.dtype]).view(h.shape)
