"""`file://DIR`: objects as files under a directory (the embedded default store).

Layout: ``DIR/objects/<2-char fan-out>/<quoted key>``. Writes go to ``DIR/tmp/`` first and are
moved into place with ``os.replace`` (atomic on POSIX), so a reader never sees a half-written
object; a crash leaves only stray temp files, which `open` cleans when they are old.

With a capacity (``capacity_bytes=`` or ``?capacity=64G``) the store evicts least recently used
objects once it holds more: a read marks an object used (its mtime), and a put that takes the
total past the capacity deletes the oldest objects down to 90% of it (the one just written
stays). Several processes may share the directory: eviction rescans it.
"""

from __future__ import annotations

import hashlib
import os
import re
import stat
import tempfile
import threading
import time
import urllib.parse
from collections.abc import Iterator, Sequence
from pathlib import Path

from kvcodec.atomic import NEW_FILE_MODE
from kvcodec.errors import ConfigError, StoreError
from kvcodec.store.base import BaseStore, check_key

_STALE_TMP_S = 3600.0
_TMP_PREFIX = "put-"  # the store's own temporary files: the only ones it ever deletes from its tmp folder
NAME_MAX = 255  # bytes of one path component on common file systems
NAME_PART = 200  # characters of a longer escaped name per folder
_LOW_WATER = 0.9  # eviction frees down to this fraction of the capacity
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?)i?b?\s*$", re.IGNORECASE)
_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


def parse_size(text: str | int) -> int:
    """Bytes from an int or a string like "512", "64M", "1.5GiB" (binary units)."""
    if isinstance(text, int) and not isinstance(text, bool):
        value = text
    else:
        m = _SIZE.match(str(text))
        if not m:
            raise ConfigError(f"capacity {text!r}: expected bytes, e.g. 1073741824, 512M or 64G")
        value = int(float(m.group(1)) * _UNITS[m.group(2).lower()])
    if value < 1:
        raise ConfigError(f"capacity must be at least 1 byte; got {text!r}")
    return value


class FileStore(BaseStore):
    def __init__(
        self,
        root: str | os.PathLike,
        *,
        fsync: bool = False,
        capacity_bytes: int | str | None = None,
        url: str | None = None,
    ) -> None:
        self.root = Path(root)
        self.url = url or f"file://{self.root}"
        self.fsync = bool(fsync)
        self.capacity = None if capacity_bytes is None else parse_size(capacity_bytes)
        self._used: int | None = None  # bytes held, counted on first need
        self._lock = threading.Lock()
        self._objects = self.root / "objects"
        self._tmp = self.root / "tmp"
        with self._errors("open"):
            self._objects.mkdir(parents=True, exist_ok=True)
            self._tmp.mkdir(parents=True, exist_ok=True)
            now = time.time()
            for p in self._tmp.glob(_TMP_PREFIX + "*"):  # a put that died: never anything else of the folder
                try:
                    if p.is_file() and now - p.stat().st_mtime > _STALE_TMP_S:
                        p.unlink()
                except OSError:  # gone meanwhile, or a read-only store (served for fetches only)
                    pass

    @classmethod
    def from_url(cls, url: str, **options) -> FileStore:
        p = urllib.parse.urlsplit(url)
        path = urllib.parse.unquote(p.netloc + p.path)
        if not path:
            raise ConfigError(f"file store URL needs a directory: {url!r}")
        q = dict(urllib.parse.parse_qsl(p.query))
        if "fsync" in q and "fsync" not in options:
            options["fsync"] = q["fsync"].lower() in ("1", "true", "yes")
        if "capacity" in q and "capacity_bytes" not in options:
            options["capacity_bytes"] = q["capacity"]
        return cls(path, url=url, **options)

    # -- paths -------------------------------------------------------------------------------
    @staticmethod
    def _fan(key: str) -> str:
        return hashlib.blake2b(key.encode(), digest_size=1).hexdigest()

    def _path(self, key: str) -> Path:
        check_key(key)
        return self._objects.joinpath(self._fan(key), *object_parts(key))

    # -- primitives --------------------------------------------------------------------------
    def put(self, key: str, value: bytes) -> None:
        path = self._path(key)
        if self.capacity is not None and len(value) > self.capacity:
            raise StoreError(f"{self.url}: object {key!r} of {len(value)} bytes exceeds the capacity {self.capacity}")
        old_size = self._size_or_zero(path) if self.capacity is not None else 0
        with self._errors("put", key):
            fd, tmp = self._new_tmp()
            try:
                with os.fdopen(fd, "wb") as f:
                    os.fchmod(f.fileno(), NEW_FILE_MODE)  # a store shared by users or hosts: not mkstemp's 0600
                    f.write(value)
                    if self.fsync:
                        f.flush()
                        os.fsync(f.fileno())
                _move_into(tmp, path)
            except BaseException:
                try:
                    os.unlink(tmp)
                except FileNotFoundError:
                    pass
                raise
            if self.fsync:
                _fsync_folder(path.parent)
        if self.capacity is not None:
            self._account(len(value) - old_size, keep=path)

    def probe_write(self) -> None:
        """A file made and removed where every put starts (its tmp folder): no object is written,
        so capacity accounting and eviction never run for the probe."""
        with self._errors("probe_write"):
            fd, tmp = self._new_tmp()
            os.close(fd)
            os.unlink(tmp)

    def _new_tmp(self) -> tuple[int, str]:
        """A new file in the tmp folder, where a put writes before it moves the file into place."""
        self._tmp.mkdir(exist_ok=True)  # its tmp folder removed: storing resumes; the store's folder is not made again
        return tempfile.mkstemp(dir=self._tmp, prefix=_TMP_PREFIX)

    def get(self, key: str) -> bytes | None:
        path = self._path(key)
        with self._errors("get", key):
            try:
                data = _read_regular(path, 0, None)
            except FileNotFoundError:
                return None
            self._touch(path)
            return data

    def get_range(self, key: str, start: int, end: int) -> bytes:
        path = self._path(key)
        if start < 0 or end < start:
            raise ConfigError(f"bad range [{start}, {end})")
        with self._errors("get_range", key):
            try:
                data = _read_regular(path, start, end)
                self._touch(path)
                return data
            except FileNotFoundError:
                raise StoreError(f"{self.url}: no object {key!r}") from None

    def size(self, key: str) -> int | None:
        path = self._path(key)
        with self._errors("size", key):
            try:
                st = path.stat()
            except FileNotFoundError:
                return None
            return st.st_size if stat.S_ISREG(st.st_mode) else None  # as exists_many: only files are objects

    def exists_many(self, keys: Sequence[str]) -> list[bool]:
        paths = [self._path(k) for k in keys]
        with self._errors("exists_many"):
            return [p.is_file() for p in paths]

    def delete(self, key: str) -> bool:
        path = self._path(key)
        with self._errors("delete", key):
            size = self._size_or_zero(path)
            try:
                path.unlink()
            except FileNotFoundError:
                return False
            self._prune(path.parent)
            if self.capacity is not None:
                self._account(-size)
            return True

    def list(self, prefix: str = "") -> Iterator[str]:
        with self._errors("list", prefix):
            for sub in sorted(self._objects.iterdir()):
                for p in _files(sub):
                    key = key_of_parts(p.relative_to(sub).parts)
                    if key.startswith(prefix):
                        yield key

    def close(self) -> None:
        pass

    # -- capacity (LRU by mtime) -------------------------------------------------------------
    def used_bytes(self) -> int:
        """Bytes of all objects (a scan of the directory)."""
        with self._errors("used_bytes"):
            return sum(size for _, _, size in self._scan())

    def _scan(self) -> list[tuple[float, Path, int]]:
        out = []
        for sub in self._objects.iterdir():
            for p in _files(sub):
                try:
                    st = p.stat()
                except FileNotFoundError:
                    continue
                out.append((st.st_mtime, p, st.st_size))
        return out

    @staticmethod
    def _size_or_zero(path: Path) -> int:
        try:
            return path.stat().st_size
        except FileNotFoundError:
            return 0

    def _touch(self, path: Path) -> None:
        if self.capacity is not None:
            try:
                os.utime(path)
            except FileNotFoundError:  # evicted or replaced meanwhile: nothing to mark
                pass

    def _account(self, delta: int, keep: Path | None = None) -> None:
        with self._lock, self._errors("evict"):
            if self._used is None:
                self._used = self.used_bytes()
            else:
                self._used = max(0, self._used + delta)
            if self._used > self.capacity:
                self._used = self._evict(keep)

    def _evict(self, keep: Path | None) -> int:
        """Delete least recently used objects until at most _LOW_WATER * capacity remain."""
        objects = sorted(self._scan(), key=lambda o: o[0])
        used = sum(size for _, _, size in objects)
        target = int(self.capacity * _LOW_WATER)
        for _, path, size in objects:
            if used <= target:
                break
            if path == keep:
                continue
            try:
                path.unlink()
                used -= size
            except FileNotFoundError:
                pass
            self._prune(path.parent)
        return used

    def _prune(self, folder: Path) -> None:
        """Remove the folders a long key's object sat in (object_parts) once they hold nothing; a
        put racing this makes its folders again (_move_into)."""
        while folder.parent != self._objects and folder != self._objects:
            try:
                folder.rmdir()
            except OSError:  # not empty (another object, a put under way) or already gone
                return
            folder = folder.parent


def _fsync_folder(folder: Path) -> None:
    """The folder's entries to disk; nothing where a delete of the object pruned it meanwhile."""
    try:
        dfd = os.open(folder, os.O_RDONLY)
    except FileNotFoundError:
        return
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)


def _move_into(tmp: str, path: Path, attempts: int = 8) -> None:
    """os.replace(tmp, path), making path's folders first, and again where a delete pruned them
    between the two (FileStore._prune). An empty folder at the object's path (made by hand: no
    object's folder has such a name, object_parts) is removed so that the put goes through."""
    for attempt in range(attempts):
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            os.replace(tmp, path)
            return
        except (FileNotFoundError, FileExistsError):  # a folder pruned between two steps of these
            if attempt == attempts - 1 or not os.path.exists(tmp):
                raise
        except IsADirectoryError:
            if attempt == attempts - 1:
                raise
            try:
                path.rmdir()  # OSError where it holds something: the put's error names it
            except FileNotFoundError:  # another put removed it first
                pass


def object_parts(key: str) -> tuple[str, ...]:
    """The path, below its fan folder, of the file holding `key`: its escaped name (a "." or ".."
    escaped too), as one component where it fits NAME_MAX, else cut into NAME_PART pieces of which
    all but the last name folders and end in a bare "%" (no escaped name ends so). Pure;
    key_of_parts inverts it."""
    name = urllib.parse.quote(key, safe="")
    if len(name) <= NAME_MAX:
        return (_no_dots(name),)
    pieces = [name[i : i + NAME_PART] for i in range(0, len(name), NAME_PART)]
    return (*(p + "%" for p in pieces[:-1]), _no_dots(pieces[-1]))


def key_of_parts(parts: Sequence[str]) -> str:
    """The key whose object_parts are `parts`. Pure."""
    return urllib.parse.unquote("".join(p[:-1] for p in parts[:-1]) + parts[-1])


def _no_dots(name: str) -> str:
    """A name that is "." or ".." (the folder itself, its parent) with its dots escaped."""
    return "%2E" * len(name) if name in (".", "..") else name


def _files(folder: Path) -> Iterator[Path]:
    """The regular files below `folder`, at any depth (long keys' objects sit in folders of their
    own): a FIFO, device or socket at an object path holds no object, as size() and get() say."""
    try:
        entries = list(folder.iterdir())
    except (FileNotFoundError, NotADirectoryError):  # pruned by a delete meanwhile, or never a folder
        return
    for p in entries:
        if p.is_dir():
            yield from _files(p)
        elif p.is_file():
            yield p


_NONBLOCK = getattr(os, "O_NONBLOCK", 0)  # 0 where the platform has no such flag (and no FIFOs)


def _read_regular(path: Path, start: int, end: int | None) -> bytes:
    """Bytes [start, end) of the regular file at `path` (end None: to its end). Anything else at
    an object's path (a FIFO, device, socket or folder someone left there) is an error before it
    is opened, and the open does not block, so no reader waits for a FIFO's writer for good."""
    _check_regular(path, os.stat(path).st_mode)
    fd = os.open(path, os.O_RDONLY | _NONBLOCK | getattr(os, "O_BINARY", 0))
    try:
        _check_regular(path, os.fstat(fd).st_mode)  # replaced between the stat and the open
        if _NONBLOCK:
            os.set_blocking(fd, True)
        with os.fdopen(fd, "rb", closefd=False) as f:
            f.seek(start)
            return f.read() if end is None else f.read(end - start)
    finally:
        os.close(fd)


def _check_regular(path: Path, mode: int) -> None:
    if not stat.S_ISREG(mode):
        raise OSError(f"{path} is not a regular file: remove it, or put the key again to replace it")
