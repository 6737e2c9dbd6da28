"""Chunk codecs: the ChunkCodec type, its registry and the built-in codecs (hevc, raw)."""

from kvcodec.codecs.base import ChunkCodec, ChunkInfo, EncodedChunk, Target
from kvcodec.codecs.registry import make_codec, register_codec, registered_codecs


def __getattr__(name):
    # The codecs themselves load on first use (hevc pulls in the video backends).
    if name == "HevcCodec":
        from kvcodec.codecs.hevc.codec import HevcCodec

        return HevcCodec
    if name == "RawCodec":
        from kvcodec.codecs.raw import RawCodec

        return RawCodec
    raise AttributeError(f"module 'kvcodec.codecs' has no attribute {name!r}")


__all__ = [
    "ChunkCodec",
    "ChunkInfo",
    "EncodedChunk",
    "HevcCodec",
    "RawCodec",
    "Target",
    "make_codec",
    "register_codec",
    "registered_codecs",
]
