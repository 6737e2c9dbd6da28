"""kvcodec: fast remote KV-cache prefix reuse; KV caches quantized or transform-coded, then coded losslessly with
zstd (decompressed on idle host cores) or as HEVC video (decoded on the GPU's NVDEC engines)."""

from kvcodec.errors import (
    ChecksumError,
    ConfigError,
    CorruptStreamError,
    FormatError,
    KVCodecError,
    ShapeError,
    TruncatedError,
)

__version__ = "0.1.0"

# The rest of the API imports torch (and the cache adapters transformers): each is loaded on first
# use, so that what imports only a submodule (the command line's --help and usage errors) stays fast.
_LAZY = {
    **dict.fromkeys(
        ("decode", "decode_chunk_blob", "encode", "encode_chunks", "inspect", "inspect_chunk_blob"), "codec"
    ),
    **dict.fromkeys(
        ("ChunkCodec", "ChunkInfo", "EncodedChunk", "make_codec", "register_codec", "registered_codecs"), "codecs"
    ),
    "CodecConfig": "config",
    "PagedKV": "restore.paged",
    **dict.fromkeys(("cache_to_tensor", "tensor_to_cache"), "integrations.hf"),
}


def __getattr__(name):
    import importlib

    if name in _LAZY:
        value = getattr(importlib.import_module(f"kvcodec.{_LAZY[name]}"), name)
        globals()[name] = value  # looked up once
        return value
    try:  # a submodule: `import kvcodec` then `kvcodec.codec.check_kv` worked when the root imported it
        return importlib.import_module(f"kvcodec.{name}")
    except ModuleNotFoundError as e:
        if e.name != f"kvcodec.{name}":
            raise
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
