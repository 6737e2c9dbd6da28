"""Chunk codecs: the ChunkCodec type, its registry and the built-in codecs (hevc, raw, transform,
transform-ans, grouped)."""

from kvcodec.codecs.base import ChunkCodec, ChunkInfo, EncodedChunk, Target
from kvcodec.codecs.registry import make_codec, register_codec, registered_codecs

_CLASSES = {  # name -> the module that defines it: the codecs load on first use (hevc pulls in the video backends)
    "HevcCodec": "kvcodec.codecs.hevc.codec",
    "RawCodec": "kvcodec.codecs.raw",
    "TransformCodec": "kvcodec.codecs.transform.codec",
    "TransformAnsCodec": "kvcodec.codecs.transform_ans.codec",
    "GroupedCodec": "kvcodec.codecs.grouped",
}


def __getattr__(name):
    if name in _CLASSES:
        import importlib

        return getattr(importlib.import_module(_CLASSES[name]), name)
    raise AttributeError(f"module 'kvcodec.codecs' has no attribute {name!r}")


__all__ = [
    "ChunkCodec",
    "ChunkInfo",
    "EncodedChunk",
    "GroupedCodec",
    "HevcCodec",
    "RawCodec",
    "Target",
    "TransformAnsCodec",
    "TransformCodec",
    "make_codec",
    "register_codec",
    "registered_codecs",
]
