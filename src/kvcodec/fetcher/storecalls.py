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
    """An absolute monotonic deadline (None: no limit) that also passes, at once, when its caller's
    `cancelled()` says so (the request was aborted: its client went away)."""

    def __init__(
        self, seconds: float | None, start: float | None = None, cancelled: Callable[[], bool] | None = None
    ) -> None:
        if seconds is not None and (isinstance(seconds, bool) or not isinstance(seconds, Real) or math.isnan(seconds)):
            raise ConfigError(f"a deadline is a number of seconds or None; got {seconds!r}")
        self.at = None if seconds is None else (time.monotonic() if start is None else start) + seconds
        self.seconds = seconds
        self._cancelled = cancelled
        self._seen_cancelled = False  # once cancelled, always: a callback that flips back changes nothing

    @property
    def cancellable(self) -> bool:
        return self._cancelled is not None

    @property
    def cancelled(self) -> bool:
        if self._cancelled is None or self._seen_cancelled:
            return self._seen_cancelled
        try:
            self._seen_cancelled = bool(self._cancelled())
        except Exception:  # noqa: BLE001 - a callback that fails cannot keep a fetch going forever
            self._seen_cancelled = True
        return self._seen_cancelled

    def left(self) -> float | None:
        if self.cancelled:
            return 0.0
        return None if self.at is None else self.at - time.monotonic()

    @property
    def passed(self) -> bool:
        left = self.left()
        return left is not None and left <= 0

    def ended(self) -> str:
        """What ended the time: the caller's cancellation or the deadline."""
        if self.cancelled or self.seconds is None:
            return "the fetch was cancelled"
        return f"the deadline of {self.seconds:.3f}s passed"


def call(deadline: Deadline, what: str, fn: Callable[..., T], *args: Any) -> T:
    """fn(*args) within the deadline. FetchError when the deadline passes first; StoreError when
    fn fails with anything that is not a KVCodecError (a store wrapper's own exception)."""
    left = deadline.left()
    if left is None and not deadline.cancellable:
        return _guarded(what, fn, *args)
    if left is not None and left <= 0:
        raise FetchError(f"{what}: {deadline.ended()} before the call")
    give_up = (lambda: deadline.cancelled) if deadline.cancellable else None
    try:
        return run_within(left, _guarded, what, fn, *args, give_up=give_up)
    except FutureTimeout:
        if deadline.cancelled or deadline.seconds is None:
            raise FetchError(f"{what}: the fetch was cancelled while it waited") from None
        raise FetchError(f"{what}: no answer within the deadline of {deadline.seconds:.3f}s") from None


def _guarded(what: str, fn: Callable[..., T], *args: Any) -> T:
    try:
        return fn(*args)
    except KVCodecError:
        raise
    except Exception as e:  # noqa: BLE001 - a wrapper store's own failure becomes a StoreError
        raise StoreError(f"{what} failed: {type(e).__name__}: {e}") from e
