"""A view of a store whose every call returns (or raises StoreError) by a deadline.

A paused or overloaded server makes a socket call block until the backend's own timeout; a fetch
that must fall back to recompute by its deadline cannot wait for that. `DeadlineStore(store,
deadline)` runs each call on a worker thread and waits at most until `deadline`
(`time.monotonic()` seconds). A call still blocked then is abandoned: its thread finishes when
the backend's timeout fires (`socket_timeout` for Redis), its result is dropped, and the caller
gets a StoreError at the deadline.
"""

from __future__ import annotations

import concurrent.futures
import queue
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, TypeVar

from kvcodec.errors import StoreError, StoreTimeoutError
from kvcodec.store.base import BaseStore, KVStore, probe_write, size_many

T = TypeVar("T")
_POOL_LOCK = threading.Lock()
_POOL: CallThreads | None = None
_WORKERS = 32  # abandoned calls hold a worker only until their backend times out


class CallThreads:
    """Up to `workers` daemon threads that run store calls, started as calls need them. Not a
    ThreadPoolExecutor: the interpreter joins those threads at exit, and a call abandoned at its
    deadline may block until its backend times out (never, for a server paused without a timeout)."""

    def __init__(self, workers: int) -> None:
        self._workers, self._started = workers, 0
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._idle = threading.Semaphore(0)
        self._lock = threading.Lock()

    def submit(self, fn: Callable[..., T], *args: Any) -> concurrent.futures.Future:
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._jobs.put((future, fn, args))
        if not self._idle.acquire(blocking=False):
            with self._lock:
                if self._started < self._workers:
                    self._started += 1
                    name = f"kvcodec-store-call_{self._started}"
                    threading.Thread(target=self._work, name=name, daemon=True).start()
        return future

    def _work(self) -> None:
        while True:
            future, fn, args = self._jobs.get()
            if future.set_running_or_notify_cancel():
                try:
                    future.set_result(fn(*args))
                except BaseException as e:  # noqa: BLE001 - the caller gets it from the future
                    future.set_exception(e)
            del future, fn, args  # nothing of a finished call is kept while this thread waits
            self._idle.release()


def _pool() -> CallThreads:
    global _POOL
    with _POOL_LOCK:
        if _POOL is None:
            _POOL = CallThreads(_WORKERS)
        return _POOL


GIVE_UP_POLL_S = 0.02  # how often run_within asks give_up() while a call runs


def run_within(seconds: float | None, fn: Callable[..., T], *args: Any, give_up: Callable[[], bool] | None = None) -> T:
    """fn(*args) on a shared worker thread; concurrent.futures.TimeoutError when it has not
    answered within `seconds` (None: no limit) or once `give_up()` returns True, asked every
    GIVE_UP_POLL_S (the call is abandoned and finishes on its own later)."""
    future = _pool().submit(fn, *args)
    end = None if seconds is None else time.monotonic() + seconds
    try:
        while True:
            left = None if end is None else max(0.0, end - time.monotonic())
            wait = left if give_up is None else (GIVE_UP_POLL_S if left is None else min(left, GIVE_UP_POLL_S))
            try:
                return future.result(timeout=wait)
            except concurrent.futures.TimeoutError:
                if future.done():  # fn's own TimeoutError (a socket's), not this wait's
                    return future.result()
                if give_up is None or give_up() or (left is not None and left <= wait):
                    raise
    except BaseException:  # this wait's timeout, or give_up() failing: the call is abandoned
        future.cancel()
        raise


def call_by(deadline: float | None, op: str, url: str, fn: Callable[..., T], *args: Any) -> T:
    """fn(*args), or StoreError once time.monotonic() passes `deadline` (None: no limit)."""
    if deadline is None:
        return fn(*args)
    left = deadline - time.monotonic()
    if left <= 0:
        raise StoreError(f"{op} on {url}: deadline passed before the call")
    try:
        return run_within(left, fn, *args)
    except concurrent.futures.TimeoutError:
        raise StoreTimeoutError(f"{op} on {url} did not answer within the deadline ({left:.3f}s left)") from None


class DeadlineStore(BaseStore):
    """`inner` with every call bounded by `deadline` (time.monotonic() seconds; None: unbounded).
    Closing the view leaves `inner` open."""

    def __init__(self, inner: KVStore, deadline: float | None) -> None:
        self.inner = inner
        self.deadline = deadline
        self.url = inner.url
        self.remote = bool(getattr(inner, "remote", False))

    def _call(self, op: str, *args: Any) -> Any:
        return call_by(self.deadline, op, self.url, getattr(self.inner, op), *args)

    def put(self, key: str, value: bytes) -> None:
        self._call("put", key, value)

    def put_many(self, items: Mapping[str, bytes]) -> None:
        self._call("put_many", items)

    def get(self, key: str) -> bytes | None:
        return self._call("get", key)

    def get_many(self, keys: Sequence[str]) -> list[bytes | None]:
        return self._call("get_many", keys)

    def get_range(self, key: str, start: int, end: int) -> bytes:
        return self._call("get_range", key, start, end)

    def size(self, key: str) -> int | None:
        return self._call("size", key)

    def exists_many(self, keys: Sequence[str]) -> list[bool]:
        return self._call("exists_many", keys)

    def size_many(self, keys: Sequence[str]) -> list[int | None]:
        return call_by(self.deadline, "size_many", self.url, size_many, self.inner, keys)  # a plugin's store too

    def delete(self, key: str) -> bool:
        return self._call("delete", key)

    def delete_many(self, keys: Sequence[str]) -> int:
        return self._call("delete_many", keys)

    def list(self, prefix: str = "") -> Iterator[str]:
        yield from call_by(self.deadline, "list", self.url, lambda: list(self.inner.list(prefix)))

    def probe_write(self) -> None:
        probe = getattr(self.inner, "probe_write", None) or (lambda: probe_write(self.inner))  # a plugin's store
        call_by(self.deadline, "probe_write", self.url, probe)

    def close(self) -> None:
        pass
