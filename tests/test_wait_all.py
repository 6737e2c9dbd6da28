"""errors.wait_all: the futures' results, or the first failure raised without a reference cycle."""

from __future__ import annotations

import gc
import weakref
from concurrent.futures import ThreadPoolExecutor

import pytest

from kvcodec.errors import wait_all


class Payload:
    """What a failing job's frame holds (a chunk's buffers, say): freed once the error is."""


def job(i: int, payload: Payload) -> int:
    if i in (1, 2):
        raise ValueError(f"job {i} failed")
    return i * i


def _fail_and_drop() -> tuple[str, weakref.ref]:
    payload = Payload()
    with ThreadPoolExecutor(2) as ex:
        futures = [ex.submit(job, i, payload) for i in range(4)]
    held = weakref.ref(payload)
    del payload
    try:
        wait_all(futures)
    except ValueError as e:
        message = str(e)
    assert futures == []
    return message, held


def test_results_come_in_order():
    with ThreadPoolExecutor(2) as ex:
        assert wait_all([ex.submit(job, i, None) for i in (0, 3, 5)]) == [0, 9, 25]


def test_the_first_failure_is_raised_and_freed_without_the_collector():
    """The failed futures' errors hold their jobs' frames (the payload): once the caller lets the
    raised error go, nothing of it is left for a collector's pass to find."""
    gc.collect()
    gc.disable()
    try:
        message, held = _fail_and_drop()
        assert message == "job 1 failed"
        assert held() is None
    finally:
        gc.enable()
    with ThreadPoolExecutor(1) as ex, pytest.raises(ValueError, match="job 1"):
        wait_all([ex.submit(job, 1, None)])
