"""Exceptions raised by kvcodec. Every failure a caller can act on is a subclass of KVCodecError."""

from __future__ import annotations


class KVCodecError(Exception):
    """Base class of every error kvcodec raises on purpose."""


class FormatError(KVCodecError):
    """The bytes are not a kvcodec container, or of a version this build cannot read."""


class TruncatedError(FormatError):
    """The container or stream ends before the data its header announces."""


class ChecksumError(FormatError):
    """A stream's checksum does not match its bytes (corruption in storage or transit)."""


class CorruptStreamError(FormatError):
    """A video or byte stream decoded to something other than what the header announces."""


class ShapeError(KVCodecError):
    """A KV tensor or cache does not have the shape, dtype or model identity expected."""


class ConfigError(KVCodecError):
    """An invalid codec, store or engine configuration."""


class BackendUnavailableError(KVCodecError):
    """A requested video backend (NVDEC, NVENC, ...) is not usable on this machine."""


class StoreError(KVCodecError):
    """A KV store failed: down, timed out, or returned an object that does not verify."""


class StoreTimeoutError(StoreError):
    """A store call did not answer within its deadline (it may yet succeed later)."""


class FetchError(KVCodecError):
    """A fetch of a stored prefix stopped; the caller should recompute the remaining tokens."""
