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


def untraced(error: BaseException) -> BaseException:
    """`error`, and the errors it was raised from, without their tracebacks: for an error kept and handed on as
    a value (a chunk's, a background job's), whose traceback's frames would hold what they held (the job, its
    buffers, the holder of the error itself), a cycle kept until the collector's next full pass."""
    seen, at = set(), error
    while at is not None and id(at) not in seen:
        seen.add(id(at))
        at.__traceback__ = None
        at = at.__cause__ or at.__context__
    return error


def wait_all(futures: list) -> list:
    """Every future's result, in order, once all are done; else the first failure, raised so that no
    frame on its way up holds the futures: a failed future holds its error, whose traceback holds the
    frames, so a frame holding the future made a cycle that kept both, and what the frames held (a
    chunk's buffers and targets), until the collector's next full pass. `futures` is emptied."""
    results, error = [], None
    for future in futures:
        try:
            results.append(future.result())
        except Exception as e:  # noqa: BLE001 - raised below once every future is done (an interrupt: now)
            error = error or e
    futures.clear()
    future = None
    if error is None:
        return results
    try:
        raise error
    finally:
        error = None  # the raise's traceback holds this frame
