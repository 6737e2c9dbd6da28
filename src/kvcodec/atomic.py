"""Files written whole or not at all, with the permissions a plain open() would give them."""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path


def _read_umask() -> int:
    mask = os.umask(0o022)  # the process-wide mask cannot be read without setting it
    os.umask(mask)
    return mask


NEW_FILE_MODE = 0o666 & ~_read_umask()  # mkstemp's 0600 would hide outputs from the group and others


@contextlib.contextmanager
def replacing(path: str | Path, suffix: str = ".part", mode: int = NEW_FILE_MODE) -> Iterator[str]:
    """A temporary file's path beside `path`, moved over `path` (with `mode`) when the block ends
    without an error and removed when it does not: readers see the old file or the whole new one."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=suffix)
    os.close(fd)
    try:
        yield tmp
        os.chmod(tmp, mode)
        os.replace(tmp, path)
    except OSError as e:
        Path(tmp).unlink(missing_ok=True)
        if e.filename is None and e.errno is not None:  # a write's error (a full disk, a size limit) names no file
            raise type(e)(e.errno, f"{e.strerror} (writing {path})") from e
        raise
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def write_atomic(path: str | Path, data: bytes) -> None:
    """Write `data` to `path` whole or not at all."""
    with replacing(path) as tmp, open(tmp, "wb") as f:
        f.write(data)
