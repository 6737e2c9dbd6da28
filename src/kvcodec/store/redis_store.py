"""Redis stores: ``redis://[[user]:password@]host:port/db``, ``rediss://`` (TLS) and
``redis+cluster://host:port`` / ``rediss+cluster://`` (Redis Cluster), through the `redis` package.

Options (keyword arguments of `open_store`, all passed through to redis-py, plus these):
    socket_timeout (s, default 1.0), socket_connect_timeout (s, default 1.0): a dead, paused or
        unreachable server gives StoreError after about these times, never a hang (the timeout
        bounds each wait for bytes, not a whole transfer, so large values are not cut short).
    retries (default 1): reconnect attempts on connection errors (a restarted server). A timeout
        is not retried: a server that did not answer within socket_timeout is stalled, and a
        cache lookup must fall back to recompute rather than wait twice as long.
    For a deadline across several calls, wrap the store in kvcodec.store.DeadlineStore.
    namespace (default ""): a prefix prepended to every key (so several caches share one DB).
    password, username, ssl_ca_certs, ssl_certfile, ssl_keyfile, ssl_cert_reqs, ...: redis-py's.
See docs/STORE.md for the server's persistence settings.
"""

from __future__ import annotations

import urllib.parse
from collections.abc import Iterator, Mapping, Sequence
from typing import Any

from kvcodec.errors import ConfigError, StoreError
from kvcodec.store.base import BaseStore, batched, check_key, redact_url

_BATCH = 512  # keys per pipelined round trip in the batched calls


def _glob_escape(s: str) -> str:
    return "".join("\\" + c if c in "*?[]\\" else c for c in s)


class RedisStore(BaseStore):
    remote = True

    def __init__(self, client: Any, url: str, namespace: str = "", cluster: bool = False) -> None:
        self._r = client
        self.url = url
        self.namespace = namespace
        self.cluster = cluster

    @classmethod
    def from_url(
        cls,
        url: str,
        *,
        socket_timeout: float = 1.0,
        socket_connect_timeout: float = 1.0,
        retries: int = 1,
        namespace: str = "",
        **options: Any,
    ) -> RedisStore:
        import redis
        from redis.backoff import ExponentialBackoff
        from redis.retry import Retry

        scheme, rest = url.split("://", 1)
        cluster = scheme.endswith("+cluster")
        base_url = scheme.replace("+cluster", "") + "://" + rest
        db = urllib.parse.urlsplit(base_url).path.strip("/")
        if base_url.startswith(("redis://", "rediss://")) and db and not db.isdigit():  # redis-py reads it as db 0
            raise ConfigError(f"{redact_url(url)}: the database is a number, as in redis://host:6379/0; got {db!r}")
        if socket_timeout <= 0 or socket_connect_timeout <= 0:
            raise ConfigError("redis timeouts must be > 0")
        kw: dict[str, Any] = dict(
            socket_timeout=socket_timeout,
            socket_connect_timeout=socket_connect_timeout,
            retry=Retry(
                ExponentialBackoff(cap=0.5, base=0.05), max(0, int(retries)), supported_errors=(redis.ConnectionError,)
            ),
        )
        kw.update(options)
        if cluster:
            from redis.cluster import RedisCluster

            client = RedisCluster.from_url(base_url, **kw)
        else:
            client = redis.Redis.from_url(base_url, **kw)
        store = cls(client, url, namespace=namespace, cluster=cluster)
        with store._errors("connect"):
            client.ping()
        return store

    def _k(self, key: str) -> str:
        return self.namespace + check_key(key)

    def put(self, key: str, value: bytes) -> None:
        k = self._k(key)
        with self._errors("put", key):
            self._r.set(k, value)  # SET replaces atomically; readers never see a partial value

    def put_many(self, items: Mapping[str, bytes]) -> None:
        pairs = [(self._k(k), v) for k, v in items.items()]
        with self._errors("put_many"):
            for part in batched(pairs, _BATCH):
                pipe = self._r.pipeline(transaction=False)
                for k, v in part:
                    pipe.set(k, v)
                pipe.execute()

    def get(self, key: str) -> bytes | None:
        k = self._k(key)
        with self._errors("get", key):
            return self._r.mget([k])[0]  # MGET, not GET: a key of another type is no object (GET: WRONGTYPE)

    def get_many(self, keys: Sequence[str]) -> list[bytes | None]:
        ks = [self._k(k) for k in keys]
        out: list[bytes | None] = []
        with self._errors("get_many"):
            for part in batched(ks, _BATCH):
                if self.cluster:
                    pipe = self._r.pipeline(transaction=False)
                    for k in part:
                        pipe.get(k)
                    out.extend(_no_wrong_types(pipe.execute(raise_on_error=False)))
                else:
                    out.extend(self._r.mget(part))
        return out

    def get_range(self, key: str, start: int, end: int) -> bytes:
        if start < 0 or end < start:
            raise ConfigError(f"bad range [{start}, {end})")
        if end == start:
            if not self.exists(key):
                raise StoreError(f"{self.url}: no object {key!r}")
            return b""
        k = self._k(key)
        with self._errors("get_range", key):
            pipe = self._r.pipeline(transaction=False)
            pipe.exists(k)
            pipe.getrange(k, start, end - 1)
            present, data = pipe.execute()
        if not present:
            raise StoreError(f"{self.url}: no object {key!r}")
        return data

    def size(self, key: str) -> int | None:
        k = self._k(key)
        with self._errors("size", key):
            pipe = self._r.pipeline(transaction=False)
            pipe.type(k)
            pipe.strlen(k)
            kind, n = pipe.execute(raise_on_error=False)
        return int(n) if _is_value(kind) else None

    def size_many(self, keys: Sequence[str]) -> list[int | None]:
        ks = [self._k(k) for k in keys]
        out: list[int | None] = []
        with self._errors("size_many"):
            for part in batched(ks, _BATCH // 2):
                pipe = self._r.pipeline(transaction=False)
                for k in part:
                    pipe.type(k)
                    pipe.strlen(k)
                got = pipe.execute(raise_on_error=False)
                out.extend(int(n) if _is_value(kind) else None for kind, n in zip(got[::2], got[1::2]))
        return out

    def exists_many(self, keys: Sequence[str]) -> list[bool]:
        ks = [self._k(k) for k in keys]
        out: list[bool] = []
        with self._errors("exists_many"):
            for part in batched(ks, _BATCH):
                pipe = self._r.pipeline(transaction=False)
                for k in part:
                    pipe.type(k)
                out.extend(_is_value(x) for x in pipe.execute())
        return out

    def delete(self, key: str) -> bool:
        k = self._k(key)
        with self._errors("delete", key):
            return bool(self._r.delete(k))

    def delete_many(self, keys: Sequence[str]) -> int:
        ks = [self._k(k) for k in keys]
        with self._errors("delete_many"):
            if self.cluster:  # keys of one DEL must share a slot in a cluster
                return sum(int(self._r.delete(k)) for k in ks)
            return sum(int(self._r.delete(*part)) for part in batched(ks, _BATCH))

    def list(self, prefix: str = "") -> Iterator[str]:
        pat = _glob_escape(self.namespace + prefix) + "*"
        n = len(self.namespace)
        with self._errors("list", prefix):
            keys = [k.decode() if isinstance(k, bytes) else k for k in self._r.scan_iter(match=pat, count=1000)]
        for k in keys:
            yield k[n:]

    def close(self) -> None:
        try:
            self._r.close()
        except Exception:  # noqa: BLE001 - closing a dead connection is not an error
            pass


def _is_value(kind: bytes | str | Exception) -> bool:
    """Whether a key's TYPE is a stored object: a string. A key of another type (a list, a hash:
    not written by a store) is no object, so that a put writes the object over it (SET replaces any type)."""
    return kind in (b"string", "string")


def _no_wrong_types(replies: list) -> list[bytes | None]:
    """A pipeline's GET replies with a key of another type (WRONGTYPE) as no object; other errors raise."""
    import redis

    for r in replies:
        if isinstance(r, redis.ResponseError) and not str(r).startswith("WRONGTYPE"):
            raise r
    return [None if isinstance(r, redis.ResponseError) else r for r in replies]
