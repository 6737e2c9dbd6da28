"""Store calls bounded by a deadline.

Store clients block in their own I/O (a paused Redis holds a call until its socket timeout), and
the KVStore API has no per-call timeout. With a deadline, each call runs on the stores' shared
worker threads (kvcodec.store.deadline.run_within) and the caller stops waiting when the deadline
passes: the call is abandoned (its thread finishes or fails on its own later), and the caller
gets a FetchError at once.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from concurrent.futures import TimeoutError as FutureTimeout
from numbers import Real
from typing import Any, TypeVar

from kvcodec.errors import ConfigError, FetchError, KVCodecError, StoreError
from kvcodec.store.deadline import run_within

T = TypeVar("T")


class Deadline:
    """An absolute monotonic deadline (None: no limit)."""

    def __init__(self, seconds: float | None, start: float | None = None) -> None:
        if seconds is not None and (isinstance(seconds, bool) or not isinstance(seconds, Real) or math.isnan(seconds)):
            raise ConfigError(f"a deadline is a number of seconds or None; got {seconds!r}")
        self.at = None if seconds is None else (time.monotonic() if start is None else start) + seconds
        self.seconds = seconds

    def left(self) -> float | None:
        return None if self.at is None else self.at - time.monotonic()

    @property
    def passed(self) -> bool:
        return self.at is not None and time.monotonic() >= self.at


def call(deadline: Deadline, what: str, fn: Callable[..., T], *args: Any) -> T:
    """fn(*args) within the deadline. FetchError when the deadline passes first; StoreError when
    fn fails with anything that is not a KVCodecError (a store wrapper's own exception)."""
    left = deadline.left()
    if left is None:
        return _guarded(what, fn, *args)
    if left <= 0:
        raise FetchError(f"{what}: the deadline of {deadline.seconds:.3f}s passed before the call")
    try:
        return run_within(left, _guarded, what, fn, *args)
    except FutureTimeout:
        raise FetchError(f"{what}: no answer within the deadline of {deadline.seconds:.3f}s") from None


def _guarded(what: str, fn: Callable[..., T], *args: Any) -> T:
    try:
        return fn(*args)
    except KVCodecError:
        raise
    except Exception as e:  # noqa: BLE001 - a wrapper store's own failure becomes a StoreError
        raise StoreError(f"{what} failed: {type(e).__name__}: {e}") from e
