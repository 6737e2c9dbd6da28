"""Moved to kvcodec.codecs.raw (kept so earlier imports keep working)."""

from kvcodec.codecs.raw import MAGIC, RawCodec

__all__ = ["MAGIC", "RawCodec"]
