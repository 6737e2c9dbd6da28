"""An in-process shaped link: a store wrapper whose reads pass through a token-bucket link.

This is the fallback when a kernel-shaped link (kvbench.net.netns) is not permitted. Every object
read (get, get_many, get_range) occupies a single shared link for bytes / rate(t) seconds, in
FIFO order across threads, plus a fixed one-way delay; the calling thread sleeps until its bytes
have "arrived". The rate follows a JitterTrace (constant by default). Writes are not throttled
unless `throttle_puts=True`.

URL form: ``throttle://RATE_GBIT?inner=<url-encoded inner URL>&delay_ms=0.1``.
"""

from __future__ import annotations

import threading
import time
import urllib.parse
from collections.abc import Iterator, Mapping, Sequence

from kvbench.net.trace import JitterTrace
from kvcodec.errors import ConfigError
from kvcodec.store.base import BaseStore, KVStore, open_store, size_many


class TokenBucketLink:
    """A serial link of rate `trace.rate_at(t)`; `transfer(n)` blocks until n bytes have passed."""

    kind = "token-bucket"

    def __init__(self, trace: JitterTrace, delay_s: float = 0.0) -> None:
        self.trace = trace
        self.delay_s = float(delay_s)
        self._t0 = time.monotonic()
        self._free_at = 0.0  # trace time at which the link is idle again
        self._lock = threading.Lock()
        self.bytes_total = 0

    def reserve(self, nbytes: int, issued_at: float | None = None) -> float:
        """Book `nbytes` on the link starting no earlier than `issued_at` (monotonic); returns the
        monotonic time at which they have arrived."""
        now = (issued_at if issued_at is not None else time.monotonic()) - self._t0
        with self._lock:
            start = max(now, self._free_at)
            end = self.trace.transfer_end(start, nbytes)
            self._free_at = end
            self.bytes_total += nbytes
        return self._t0 + end + self.delay_s

    def transfer(self, nbytes: int, issued_at: float | None = None) -> None:
        until = self.reserve(nbytes, issued_at)
        while True:
            left = until - time.monotonic()
            if left <= 0:
                return
            time.sleep(left)

    def describe(self) -> dict:
        return {
            "link": self.kind,
            "trace": self.trace.name,
            "mean_gbit": self.trace.mean_gbit,
            "delay_ms": self.delay_s * 1e3,
        }


class ThrottledStore(BaseStore):
    """`store` seen through a TokenBucketLink of `rate_gbit` (or `jitter_trace`)."""

    remote = True  # its gets cross the shaped link

    def __init__(
        self,
        store: KVStore,
        rate_gbit: float | None = None,
        jitter_trace: JitterTrace | None = None,
        *,
        delay_ms: float = 0.0,
        throttle_puts: bool = False,
        link: TokenBucketLink | None = None,
    ) -> None:
        if link is None:
            if jitter_trace is None:
                if rate_gbit is None or rate_gbit <= 0:
                    raise ConfigError("ThrottledStore needs rate_gbit > 0 or a jitter_trace")
                jitter_trace = JitterTrace.constant(rate_gbit)
            link = TokenBucketLink(jitter_trace, delay_ms / 1e3)
        self.inner = store
        self.link = link
        self.throttle_puts = throttle_puts
        self.url = f"throttle://{link.trace.mean_gbit:g}?inner={urllib.parse.quote(store.url, safe='')}"

    @classmethod
    def from_url(cls, url: str, **options) -> ThrottledStore:
        p = urllib.parse.urlsplit(url)
        q = dict(urllib.parse.parse_qsl(p.query))
        inner_url = q.pop("inner", None)
        if not inner_url:
            raise ConfigError(f"throttle:// needs ?inner=<store url>: {url!r}")
        rate = float(p.netloc or q.pop("rate_gbit", "0") or 0)
        delay_ms = float(q.pop("delay_ms", options.pop("delay_ms", 0.0)))
        trace = options.pop("jitter_trace", None)
        if "trace" in q:
            trace = JitterTrace.load(q.pop("trace"))
        inner = open_store(inner_url, **options)
        return cls(inner, rate_gbit=rate or None, jitter_trace=trace, delay_ms=delay_ms)

    # reads: shaped
    def get(self, key: str) -> bytes | None:
        t = time.monotonic()
        v = self.inner.get(key)
        self.link.transfer(len(v) if v is not None else 0, t)
        return v

    def get_many(self, keys: Sequence[str]) -> list[bytes | None]:
        t = time.monotonic()
        vs = self.inner.get_many(keys)
        self.link.transfer(sum(len(v) for v in vs if v is not None), t)
        return vs

    def get_range(self, key: str, start: int, end: int) -> bytes:
        t = time.monotonic()
        v = self.inner.get_range(key, start, end)
        self.link.transfer(len(v), t)
        return v

    # writes: optionally shaped
    def put(self, key: str, value: bytes) -> None:
        t = time.monotonic()
        self.inner.put(key, value)
        if self.throttle_puts:
            self.link.transfer(len(value), t)

    def put_many(self, items: Mapping[str, bytes]) -> None:
        t = time.monotonic()
        self.inner.put_many(items)
        if self.throttle_puts:
            self.link.transfer(sum(len(v) for v in items.values()), t)

    # metadata: one delay, no payload
    def size(self, key: str) -> int | None:
        return self.inner.size(key)

    def exists_many(self, keys: Sequence[str]) -> list[bool]:
        return self.inner.exists_many(keys)

    def size_many(self, keys: Sequence[str]) -> list[int | None]:
        return size_many(self.inner, keys)

    def delete(self, key: str) -> bool:
        return self.inner.delete(key)

    def list(self, prefix: str = "") -> Iterator[str]:
        return self.inner.list(prefix)

    def close(self) -> None:
        self.inner.close()
