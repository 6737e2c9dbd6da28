"""zstd-coded streams decompressed straight into a caller's buffer (a pinned upload buffer, say)."""

from __future__ import annotations

import threading

import numpy as np
import zstandard

from kvcodec.errors import CorruptStreamError

_zstd = threading.local()  # a decompression context per thread: making one per stream costs more than small streams


def unzstd_into(data, buf: np.ndarray, name: str) -> int:
    """Decompress `data` into `buf`; the decompressed size (buf.size + 1 when there is more)."""
    dctx = getattr(_zstd, "dctx", None)
    if dctx is None:
        dctx = _zstd.dctx = zstandard.ZstdDecompressor()
    view, got = memoryview(buf).cast("B"), 0
    try:
        with dctx.stream_reader(data) as reader:
            while got < buf.size:
                n = reader.readinto(view[got:])
                if not n:
                    return got
                got += n
            return got + len(reader.read(1))
    except zstandard.ZstdError as e:
        raise CorruptStreamError(f"stream {name!r} does not decompress: {e}") from e
