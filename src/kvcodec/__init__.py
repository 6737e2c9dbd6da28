"""kvcodec: fast remote KV-cache prefix reuse; KV caches quantized or transform-coded, then coded losslessly with
zstd (decompressed on idle host cores) or as HEVC video (decoded on the GPU's NVDEC engines)."""

from kvcodec.codec import decode, decode_chunk_blob, encode, encode_chunks, inspect, inspect_chunk_blob
from kvcodec.codecs import ChunkCodec, ChunkInfo, EncodedChunk, make_codec, register_codec, registered_codecs
from kvcodec.config import CodecConfig
from kvcodec.errors import (
    ChecksumError,
    ConfigError,
    CorruptStreamError,
    FormatError,
    KVCodecError,
    ShapeError,
    TruncatedError,
)
from kvcodec.restore.paged import PagedKV

__version__ = "0.1.0"


def __getattr__(name):
    # Cache adapters import transformers; load them on first use only.
    if name in ("cache_to_tensor", "tensor_to_cache"):
        from kvcodec.integrations import hf

        return getattr(hf, name)
    raise AttributeError(f"module 'kvcodec' has no attribute {name!r}")


__all__ = [
    "ChunkCodec",
    "ChunkInfo",
    "EncodedChunk",
    "make_codec",
    "register_codec",
    "registered_codecs",
    "CodecConfig",
    "PagedKV",
    "encode",
    "decode",
    "encode_chunks",
    "decode_chunk_blob",
    "inspect",
    "inspect_chunk_blob",
    "cache_to_tensor",
    "tensor_to_cache",
    "KVCodecError",
    "FormatError",
    "TruncatedError",
    "ChecksumError",
    "CorruptStreamError",
    "ShapeError",
    "ConfigError",
]
