"""`memory://[NAME]`: an in-process dict. A named space is shared by every store opened on the same
URL in this process (handy for tests and benchmarks); ``memory://`` alone is private."""

from __future__ import annotations

import threading
import urllib.parse
from collections.abc import Iterator, Mapping, Sequence

from kvcodec.errors import ConfigError, StoreError
from kvcodec.store.base import BaseStore, check_key

_SPACES: dict[str, dict[str, bytes]] = {}
_SPACES_LOCK = threading.Lock()


class MemoryStore(BaseStore):
    def __init__(self, name: str | None = None, *, url: str | None = None) -> None:
        self.url = url or f"memory://{name or ''}"
        self._lock = threading.Lock()
        if name:
            with _SPACES_LOCK:
                self._data = _SPACES.setdefault(name, {})
        else:
            self._data = {}
        self._closed = False

    @classmethod
    def from_url(cls, url: str, **options) -> "MemoryStore":
        if options:
            raise ConfigError(f"memory store takes no options; got {sorted(options)}")
        p = urllib.parse.urlsplit(url)
        return cls((p.netloc + p.path).strip("/") or None, url=url)

    @staticmethod
    def drop_space(name: str) -> None:
        with _SPACES_LOCK:
            _SPACES.pop(name, None)

    def _check(self) -> None:
        if self._closed:
            raise StoreError(f"{self.url}: store is closed")

    def put(self, key: str, value: bytes) -> None:
        check_key(key)
        self._check()
        with self._lock:
            self._data[key] = bytes(value)

    def put_many(self, items: Mapping[str, bytes]) -> None:
        for k in items:
            check_key(k)
        self._check()
        with self._lock:
            self._data.update({k: bytes(v) for k, v in items.items()})

    def get(self, key: str) -> bytes | None:
        check_key(key)
        self._check()
        return self._data.get(key)

    def get_range(self, key: str, start: int, end: int) -> bytes:
        v = self.get(key)
        if v is None:
            raise StoreError(f"{self.url}: no object {key!r}")
        if start < 0 or end < start:
            raise ConfigError(f"bad range [{start}, {end})")
        return v[start:end]

    def size(self, key: str) -> int | None:
        v = self.get(key)
        return None if v is None else len(v)

    def exists_many(self, keys: Sequence[str]) -> list[bool]:
        for k in keys:
            check_key(k)
        self._check()
        return [k in self._data for k in keys]

    def delete(self, key: str) -> bool:
        check_key(key)
        self._check()
        with self._lock:
            return self._data.pop(key, None) is not None

    def list(self, prefix: str = "") -> Iterator[str]:
        self._check()
        with self._lock:
            keys = [k for k in self._data if k.startswith(prefix)]
        yield from keys

    def close(self) -> None:
        self._closed = True
