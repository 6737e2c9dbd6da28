"""`memory://[NAME]`: an in-process dict. A named space is shared by every store opened on the same
URL in this process (handy for tests and benchmarks); ``memory://`` alone is private.

With a capacity (``capacity_bytes=`` or ``?capacity=512M``) a put that takes the space past it
evicts the least recently used objects (gets count as use), never the object just written."""

from __future__ import annotations

import threading
import urllib.parse
from collections import OrderedDict
from collections.abc import Iterator, Mapping, Sequence

from kvcodec.errors import ConfigError, StoreError
from kvcodec.store.base import BaseStore, check_key
from kvcodec.store.file import parse_size

_SPACES: dict[str, OrderedDict[str, bytes]] = {}
_SPACES_LOCK = threading.Lock()


class MemoryStore(BaseStore):
    def __init__(
        self, name: str | None = None, *, capacity_bytes: int | str | None = None, url: str | None = None
    ) -> None:
        self.url = url or f"memory://{name or ''}"
        self.capacity = None if capacity_bytes is None else parse_size(capacity_bytes)
        self._lock = threading.Lock()
        if name:
            with _SPACES_LOCK:
                self._data = _SPACES.setdefault(name, OrderedDict())
        else:
            self._data = OrderedDict()
        self._closed = False

    @classmethod
    def from_url(cls, url: str, **options) -> MemoryStore:
        unknown = set(options) - {"capacity_bytes"}
        if unknown:
            raise ConfigError(f"memory store takes only capacity_bytes; got {sorted(unknown)}")
        p = urllib.parse.urlsplit(url)
        q = dict(urllib.parse.parse_qsl(p.query))
        if "capacity" in q and "capacity_bytes" not in options:
            options["capacity_bytes"] = q["capacity"]
        return cls((p.netloc + p.path).strip("/") or None, url=url, **options)

    @staticmethod
    def drop_space(name: str) -> None:
        with _SPACES_LOCK:
            _SPACES.pop(name, None)

    def _check(self) -> None:
        if self._closed:
            raise StoreError(f"{self.url}: store is closed")

    def put(self, key: str, value: bytes) -> None:
        self.put_many({key: value})

    def put_many(self, items: Mapping[str, bytes]) -> None:
        for k, v in items.items():
            check_key(k)
            if self.capacity is not None and len(v) > self.capacity:
                raise StoreError(f"{self.url}: object {k!r} of {len(v)} bytes exceeds the capacity {self.capacity}")
        self._check()
        with self._lock:
            for k, v in items.items():
                self._data[k] = bytes(v)
                self._data.move_to_end(k)
            self._evict(keep=set(items))

    def get(self, key: str) -> bytes | None:
        check_key(key)
        self._check()
        with self._lock:
            value = self._data.get(key)
            if value is not None and self.capacity is not None:
                self._data.move_to_end(key)
        return value

    def used_bytes(self) -> int:
        with self._lock:
            return sum(len(v) for v in self._data.values())

    def _evict(self, keep: set[str]) -> None:
        """Drop least recently used objects until the space fits its capacity (lock held)."""
        if self.capacity is None:
            return
        used = sum(len(v) for v in self._data.values())
        for k in list(self._data):
            if used <= self.capacity:
                break
            if k not in keep:
                used -= len(self._data.pop(k))

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
