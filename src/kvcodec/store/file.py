"""`file://DIR`: objects as files under a directory (the embedded default store).

Layout: ``DIR/objects/<2-char fan-out>/<quoted key>``. Writes go to ``DIR/tmp/`` first and are
moved into place with ``os.replace`` (atomic on POSIX), so a reader never sees a half-written
object; a crash leaves only stray temp files, which `open` cleans when they are old.
"""

from __future__ import annotations

import hashlib
import os
import tempfile
import time
import urllib.parse
from collections.abc import Iterator, Sequence
from pathlib import Path

from kvcodec.errors import ConfigError, StoreError
from kvcodec.store.base import BaseStore, check_key

_STALE_TMP_S = 3600.0


class FileStore(BaseStore):
    def __init__(self, root: str | os.PathLike, *, fsync: bool = False, url: str | None = None) -> None:
        self.root = Path(root)
        self.url = url or f"file://{self.root}"
        self.fsync = bool(fsync)
        self._objects = self.root / "objects"
        self._tmp = self.root / "tmp"
        with self._errors("open"):
            self._objects.mkdir(parents=True, exist_ok=True)
            self._tmp.mkdir(parents=True, exist_ok=True)
            now = time.time()
            for p in self._tmp.iterdir():
                try:
                    if now - p.stat().st_mtime > _STALE_TMP_S:
                        p.unlink()
                except FileNotFoundError:
                    pass

    @classmethod
    def from_url(cls, url: str, **options) -> "FileStore":
        p = urllib.parse.urlsplit(url)
        path = urllib.parse.unquote(p.netloc + p.path)
        if not path:
            raise ConfigError(f"file store URL needs a directory: {url!r}")
        q = dict(urllib.parse.parse_qsl(p.query))
        if "fsync" in q and "fsync" not in options:
            options["fsync"] = q["fsync"].lower() in ("1", "true", "yes")
        return cls(path, url=url, **options)

    # -- paths -------------------------------------------------------------------------------
    @staticmethod
    def _fan(key: str) -> str:
        return hashlib.blake2b(key.encode(), digest_size=1).hexdigest()

    def _path(self, key: str) -> Path:
        check_key(key)
        return self._objects / self._fan(key) / urllib.parse.quote(key, safe="")

    # -- primitives --------------------------------------------------------------------------
    def put(self, key: str, value: bytes) -> None:
        path = self._path(key)
        with self._errors("put", key):
            path.parent.mkdir(exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=self._tmp, prefix="put-")
            try:
                with os.fdopen(fd, "wb") as f:
                    f.write(value)
                    if self.fsync:
                        f.flush()
                        os.fsync(f.fileno())
                os.replace(tmp, path)
            except BaseException:
                try:
                    os.unlink(tmp)
                except FileNotFoundError:
                    pass
                raise
            if self.fsync:
                dfd = os.open(path.parent, os.O_RDONLY)
                try:
                    os.fsync(dfd)
                finally:
                    os.close(dfd)

    def get(self, key: str) -> bytes | None:
        path = self._path(key)
        with self._errors("get", key):
            try:
                return path.read_bytes()
            except FileNotFoundError:
                return None

    def get_range(self, key: str, start: int, end: int) -> bytes:
        path = self._path(key)
        if start < 0 or end < start:
            raise ConfigError(f"bad range [{start}, {end})")
        with self._errors("get_range", key):
            try:
                with open(path, "rb") as f:
                    f.seek(start)
                    return f.read(end - start)
            except FileNotFoundError:
                raise StoreError(f"{self.url}: no object {key!r}") from None

    def size(self, key: str) -> int | None:
        path = self._path(key)
        with self._errors("size", key):
            try:
                return path.stat().st_size
            except FileNotFoundError:
                return None

    def exists_many(self, keys: Sequence[str]) -> list[bool]:
        paths = [self._path(k) for k in keys]
        with self._errors("exists_many"):
            return [p.is_file() for p in paths]

    def delete(self, key: str) -> bool:
        path = self._path(key)
        with self._errors("delete", key):
            try:
                path.unlink()
                return True
            except FileNotFoundError:
                return False

    def list(self, prefix: str = "") -> Iterator[str]:
        with self._errors("list", prefix):
            for sub in sorted(self._objects.iterdir()):
                if not sub.is_dir():
                    continue
                for p in sub.iterdir():
                    key = urllib.parse.unquote(p.name)
                    if key.startswith(prefix):
                        yield key

    def close(self) -> None:
        pass
