"""Transform-coded KV files (.kvc written with --transform): a header naming the transform's
sha256 and the chunks, then the chunk blobs of one resolution."""

from __future__ import annotations

import torch

from kvcodec.codecs.transform import TransformCodec
from kvcodec.container.format import crc32, read_object, write_object
from kvcodec.errors import ChecksumError, ConfigError, FormatError, TruncatedError

FILE_MAGIC = b"KVTF"
DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}


def encode_file(kv: torch.Tensor, codec: TransformCodec, on_chunk=None) -> bytes:
    chunks = codec.encode_chunks(kv, on_chunk=on_chunk)
    blobs = [c.blobs[0] for c in chunks]
    header = {
        "kvt": codec.kvt_hash,
        "codec": codec.id,
        "shape": list(kv.shape),
        "dtype": str(kv.dtype).replace("torch.", ""),
        "chunks": [[c.tokens, len(b), crc32(b)] for c, b in zip(chunks, blobs)],
    }
    return write_object(FILE_MAGIC, header, blobs)


def read_header(data: bytes | memoryview) -> tuple[dict, memoryview]:
    h, payload = read_object(data, FILE_MAGIC, "transform-coded KV file")
    try:
        need = sum(int(n) for _, n, _ in h["chunks"])
        shape, dtype = tuple(int(s) for s in h["shape"]), h["dtype"]
    except (KeyError, TypeError, ValueError) as e:
        raise FormatError(f"transform-coded KV file header is incomplete: {e}") from e
    if len(payload) < need:
        raise TruncatedError(f"transform-coded KV file truncated: {len(payload)} of {need} payload bytes")
    if dtype not in DTYPES or len(shape) != 5:
        raise FormatError("transform-coded KV file has an invalid shape or dtype")
    return h, payload


def decode_file(data: bytes | memoryview, codec: TransformCodec, device: str | torch.device = "cpu") -> torch.Tensor:
    h, payload = read_header(data)
    if h["kvt"] != codec.kvt_hash:
        raise ConfigError(
            f"file was coded with transform {h['kvt'][:16]}, the given .kvt is {codec.kvt_hash[:16]}: "
            "decode it with the .kvt it was encoded with"
        )
    out = torch.empty(tuple(h["shape"]), dtype=DTYPES[h["dtype"]], device=torch.device(device))
    pos = start = 0
    for i, (tokens, length, crc) in enumerate(h["chunks"]):
        blob = payload[pos : pos + length]
        if crc32(blob) != crc:
            raise ChecksumError(f"chunk {i} fails its checksum")
        codec.decode_chunk(blob, out[:, :, start : start + tokens])
        pos, start = pos + length, start + tokens
    return out
