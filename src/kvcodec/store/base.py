"""The KVStore protocol, a base class with the shared behaviour, and the URL -> backend registry.

A store maps string keys to immutable byte objects. Backends are chosen by the URL's scheme through
a name registry (`register_store`); adding one means registering a factory, nothing else. Every
failure a backend meets (server down, timeout, I/O error) surfaces as `kvcodec.errors.StoreError`
carrying the store's URL (password redacted) and the original exception as `__cause__`.
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import logging
import re
import time
import urllib.parse
import uuid
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Any, Protocol, runtime_checkable

from kvcodec.errors import ConfigError, StoreError
from kvcodec.plugins import load_object

log = logging.getLogger(__name__)

_KEY_RE = re.compile(r"^[A-Za-z0-9._:/+=@-]{1,512}$")


@runtime_checkable
class KVStore(Protocol):
    """A byte-object store addressed by string keys.

    Keys: 1..512 characters of ``[A-Za-z0-9._:/+=@-]``; ``/`` is an ordinary character (no
    directories are implied). Values are immutable once written; writing a key again replaces it
    atomically (readers see the old or the new object, never a mix). Optional: ``probe_write()``
    (BaseStore has it; kvcodec.store.base.probe_write serves a store without it), ``size_many(keys)``
    (BaseStore's asks size() per key; kvcodec.store.base.size_many serves a store without it), and ``remote``: True
    where gets cross a network link (a fetch on CUDA then keeps two in flight; BaseStore's is False).
    """

    url: str

    def put(self, key: str, value: bytes) -> None:
        """Store `value` under `key` (atomically: a half-written object is never visible)."""

    def put_many(self, items: Mapping[str, bytes]) -> None:
        """Store several objects (one round trip where the backend allows)."""

    def get(self, key: str) -> bytes | None:
        """The object under `key`, or None when there is none."""

    def get_many(self, keys: Sequence[str]) -> list[bytes | None]:
        """Objects for `keys` in order (None for missing ones), in one round trip where possible."""

    def get_range(self, key: str, start: int, end: int) -> bytes:
        """Bytes [start, end) of the object (shorter at its end); StoreError if it is missing."""

    def iter_get(self, key: str, piece_bytes: int = 1 << 20) -> Iterator[bytes]:
        """Stream the object in pieces of at most `piece_bytes` (StoreError if it is missing)."""

    def size(self, key: str) -> int | None:
        """Size in bytes of the object, or None when there is none."""

    def exists(self, key: str) -> bool:
        """Whether `key` holds an object."""

    def exists_many(self, keys: Sequence[str]) -> list[bool]:
        """Existence of each key, in ONE query to the backend."""

    def delete(self, key: str) -> bool:
        """Remove `key`; True if it existed."""

    def delete_many(self, keys: Sequence[str]) -> int:
        """Remove several keys (one round trip where the backend allows); how many existed."""

    def list(self, prefix: str = "") -> Iterator[str]:
        """Keys starting with `prefix` (order unspecified)."""

    def close(self) -> None:
        """Release connections/handles. Idempotent."""


def check_key(key: str) -> str:
    if not isinstance(key, str) or not _KEY_RE.match(key):
        raise ConfigError(f"invalid store key {key!r}: 1..512 characters of [A-Za-z0-9._:/+=@-]")
    return key


def redact_url(url: str) -> str:
    """The URL with any password replaced by '***' (for messages and logs)."""
    try:
        p = urllib.parse.urlsplit(url)
    except ValueError:
        return url
    if p.password is None:
        return url
    netloc = p.netloc.rsplit("@", 1)
    user = p.username or ""
    return urllib.parse.urlunsplit(p._replace(netloc=f"{user}:***@{netloc[-1]}"))


class BaseStore:
    """Shared behaviour: batched calls in terms of single ones, streaming via ranges, context manager.

    Subclasses implement put, get, get_range, size, exists_many, delete, list, close (and may
    override the batched ones with real batched backend calls).
    """

    url: str = ""
    # whether gets cross a network link (a fetch on CUDA then keeps two in flight: fetcher.pipeline.default_net_workers)
    remote: bool = False

    # -- defaults in terms of the primitives ------------------------------------------------
    def put_many(self, items: Mapping[str, bytes]) -> None:
        for k, v in items.items():
            self.put(k, v)

    def get_many(self, keys: Sequence[str]) -> list[bytes | None]:
        return [self.get(k) for k in keys]

    def exists(self, key: str) -> bool:
        return self.exists_many([key])[0]

    def size_many(self, keys: Sequence[str]) -> list[int | None]:
        """size() of each key, in order (a backend with batched queries answers in one round trip)."""
        return [self.size(k) for k in keys]

    def delete_many(self, keys: Sequence[str]) -> int:
        return sum(self.delete(k) for k in keys)

    def iter_get(self, key: str, piece_bytes: int = 1 << 20) -> Iterator[bytes]:
        if piece_bytes < 1:
            raise ConfigError("piece_bytes must be >= 1")
        total = self.size(key)
        if total is None:
            raise StoreError(f"{self.url}: no object {key!r}")
        pos = 0
        while pos < total:
            piece = self.get_range(key, pos, min(total, pos + piece_bytes))
            if not piece:
                raise StoreError(f"{self.url}: object {key!r} shrank while streaming at byte {pos}")
            pos += len(piece)
            yield piece

    def probe_write(self) -> None:
        """Store and delete an empty object (probe_write's docstring); StoreError where the put fails."""
        probe_write(self)

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"{type(self).__name__}({redact_url(self.url)!r})"

    @contextlib.contextmanager
    def _errors(self, op: str, key: str | None = None):
        """Turn any backend exception into StoreError(url, op, key) with the cause chained."""
        try:
            yield
        except StoreError:
            raise
        except ConfigError:
            raise
        except Exception as e:  # noqa: BLE001 - every backend failure becomes a StoreError
            what = f" {key!r}" if key is not None else ""
            raise StoreError(f"{op}{what} on {redact_url(self.url)} failed: {type(e).__name__}: {e}") from e


def size_many(store: KVStore, keys: Sequence[str]) -> list[int | None]:
    """Each key's object size (None: no object), by the store's size_many where it has one (a
    plugin's store may not: then one size() per key)."""
    sizes = getattr(store, "size_many", None)
    return sizes(keys) if sizes is not None else [store.size(k) for k in keys]


def probe_write(store: KVStore) -> None:
    """Whether `store` takes writes, told by one: an empty object `kvcodec-write-probe/<random>` is
    put, then deleted. A refused put raises (StoreError from a kvcodec store); a refused delete is
    logged with the key left behind (the store takes writes all the same)."""
    key = f"kvcodec-write-probe/{uuid.uuid4().hex}"
    store.put(key, b"")
    try:
        store.delete(key)
    except Exception as e:  # noqa: BLE001 - the put went through: writes are taken
        log.warning("%s took a probe object but refused to delete it (%s): %s is left", redact_url(store.url), e, key)


# -- registry ---------------------------------------------------------------------------------

StoreFactory = Callable[..., KVStore]

# scheme -> "module:callable" (imported lazily so e.g. `redis` loads only when used) or a callable
_REGISTRY: dict[str, str | StoreFactory] = {
    "file": "kvcodec.store.file:FileStore.from_url",
    "memory": "kvcodec.store.memory:MemoryStore.from_url",
    "redis": "kvcodec.store.redis_store:RedisStore.from_url",
    "rediss": "kvcodec.store.redis_store:RedisStore.from_url",
    "redis+cluster": "kvcodec.store.redis_store:RedisStore.from_url",
    "rediss+cluster": "kvcodec.store.redis_store:RedisStore.from_url",
}
# More schemes come from installed plug-ins: entry points of group "kvcodec.stores" (name = scheme),
# e.g. the benchmarks' throttle:// (an emulated slow link, in the kvbench package).
PLUGIN_GROUP = "kvcodec.stores"


def register_store(scheme: str, factory: str | StoreFactory) -> None:
    """Register a backend: `factory(url, **options) -> KVStore`, or its "module:attr.path"."""
    _REGISTRY[scheme.lower()] = factory


def store_schemes() -> list[str]:
    return sorted({*_REGISTRY, *(ep.name for ep in importlib.metadata.entry_points(group=PLUGIN_GROUP))})


def open_store(url: str, *, deadline_s: float | None = None, **options: Any) -> KVStore:
    """Open the store a URL names, e.g. ``file:///var/kv``, ``memory://``, ``redis://h:6379/0``,
    ``rediss://:pw@h:6380/0``, ``redis+cluster://h:7000``, ``throttle://4?inner=memory://x``.

    Keyword options go to the backend (e.g. ``socket_timeout=2.0``, ``password=...``,
    ``ssl_ca_certs=...`` for Redis; ``fsync=True`` for files). A bare path means ``file://``.
    deadline_s: open (connect, first round trip) within this many seconds or raise StoreError
    then: a paused or unreachable server cannot hold the caller past its own deadline.
    """
    if deadline_s is not None:
        from kvcodec.store.deadline import call_by

        if not deadline_s > 0:
            raise ConfigError(f"deadline_s must be > 0; got {deadline_s}")
        return call_by(time.monotonic() + deadline_s, "open", redact_url(url), lambda: open_store(url, **options))
    if "://" not in url:  # a path, taken as it is: its "#", "?" and "%" are no URL syntax
        _refuse_mistyped_url(url)
        url = "file://" + urllib.parse.quote(url, safe="/")
    scheme = url.split("://", 1)[0].lower()
    target = _REGISTRY.get(scheme) or next(
        (ep.value for ep in importlib.metadata.entry_points(group=PLUGIN_GROUP, name=scheme)), None
    )
    if target is None:
        raise ConfigError(f"unknown store scheme {scheme!r} in {redact_url(url)}; known: {store_schemes()}")
    factory = load_object(target) if isinstance(target, str) else target
    try:
        return factory(url, **options)
    except (StoreError, ConfigError):
        raise
    except Exception as e:  # noqa: BLE001
        raise StoreError(f"cannot open store {redact_url(url)}: {type(e).__name__}: {e}") from e


def _refuse_mistyped_url(path: str) -> None:
    """A bare path is a file:// folder, but one that begins with a store scheme and a colon or two
    slashes ("file:/var/kv", "redis:6379", "rediss//h") is a mistyped URL: storing into a local folder of
    that name would lose nothing the user can see until the KV is not there. (./redis//h is a folder.)"""
    head = path.split("/", 1)[0]
    name = head.split(":", 1)[0].lower()
    if name in store_schemes() and (":" in head or path[len(head) :].startswith("//")):
        raise ConfigError(
            f"{redact_url(path)!r} looks like a mistyped {name}:// URL; write {name}://... (or ./{head}... for a folder)"
        )


def batched(seq: Iterable, n: int) -> Iterator[list]:
    buf: list = []
    for x in seq:
        buf.append(x)
        if len(buf) >= n:
            yield buf
            buf = []
    if buf:
        yield buf
