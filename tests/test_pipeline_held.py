"""The driven fetch's in-order finish (fetcher/pipeline.py: _consume_driven, _held, MIN_FINISH_BYTES)
without CUDA: a driver whose chunks complete after a given number of polls, the finishes recorded.
Ready chunks are held until they reach MIN_FINISH_BYTES or the prefix's end; a fetch that stops
early (a failed chunk, a session error, the deadline) restores what it held first and says so.
No clock: chunks complete by poll counts, the deadline by a counter."""

from __future__ import annotations

import queue
import threading
import types

import pytest

from kvcodec.errors import CorruptStreamError, FetchError
from kvcodec.fetcher import pipeline

SMALL = 1 << 20  # values of a chunk: 2 MiB of fp16-equivalent KV


class Driver:
    """Chunk i completes at poll ready[i] (None: never); poll number `fails_at` raises, and so
    does a wait once `wait_fails` (the session a chunk's pieces are on failed)."""

    def __init__(self, ready, bad=(), fails_at=None, wait_fails=False):
        self.ready, self.bad, self.fails_at, self.wait_fails = ready, set(bad), fails_at, wait_fails
        self.submitted, self.polls = set(), 0

    def submit_many(self, batch):
        self.submitted |= {i for i, _, _ in batch}

    def _due(self):
        return sorted(i for i in self.submitted if self.ready[i] is not None and self.polls >= self.ready[i])

    def poll(self):
        self.polls += 1
        if self.fails_at is not None and self.polls >= self.fails_at:
            raise RuntimeError("the session died")
        done = self._due()
        self.submitted -= set(done)
        return [(i, CorruptStreamError(f"chunk {i} is bad") if i in self.bad else f"part {i}", 0.0) for i in done]

    def has_done(self):
        return bool(self._due())

    def pending(self, i):
        return i in self.submitted

    def wait(self, i, timeout_s, flush):
        self.polls += 1  # time passes
        if self.wait_fails and self.polls >= 4:
            raise RuntimeError("the session died while waited on")

    def flush_stuck(self):
        pass

    def end_all(self):
        pass


class Deadline:
    """Passed once the driver has been polled `after` times (None: never)."""

    def __init__(self, driver, after):
        self.driver, self.after = driver, after

    def left(self):
        return None if self.after is None or self.driver.polls < self.after else -1.0

    def ended(self):
        return "the deadline passed"


def _fetch(driver, n, values=SMALL, max_inflight=64, deadline_after=None):
    """(tokens restored, error, the finishes' chunk lists) of a driven consume loop over n chunks of one token."""
    p = object.__new__(pipeline.FetchPipeline)
    p.plan = types.SimpleNamespace(metas=[types.SimpleNamespace(values=values)] * n, n_tokens=n)
    p.s = types.SimpleNamespace(max_inflight=max_inflight)
    p.dec_q, p.res_q, p.stop = queue.Queue(), queue.Queue(), threading.Event()
    p.deadline = Deadline(driver, deadline_after)
    finishes = []

    def restore_run(ready, restored):
        finishes.append([i for i, _ in ready])
        return restored + len(ready), None

    p._restore_run = restore_run
    p._submit = lambda drv, fed, items: (fed.update({i: None for i, _, _ in items}), drv.submit_many(items))
    p._staged = lambda i, part, fed, busy=None: p.res_q.put(
        (i, part if isinstance(part, Exception) else None, None if isinstance(part, Exception) else part)
    )
    for i in range(n):
        p.dec_q.put((i, 0, b""))
    restored, error = p._consume_driven(driver)
    return restored, error, finishes


def test_a_short_prefixs_chunks_are_finished_once_when_the_last_is_ready():
    restored, error, finishes = _fetch(Driver([1, 2, 3, 4, 5, 6, 7, 8]), 8)
    assert (restored, error, finishes) == (8, None, [list(range(8))])


def test_without_a_minimum_every_ready_run_is_finished_at_once(monkeypatch):
    monkeypatch.setattr(pipeline, "MIN_FINISH_BYTES", 0)
    restored, error, finishes = _fetch(Driver([1, 2, 3, 4]), 4)
    assert (restored, error) == (4, None) and len(finishes) > 1 and sum(finishes, []) == [0, 1, 2, 3]


def test_large_chunks_are_finished_as_soon_as_they_reach_the_minimum():
    each = pipeline.MIN_FINISH_BYTES // 2 // 2 + 1  # values: two chunks' fp16 bytes reach the minimum
    restored, error, finishes = _fetch(Driver([1, 3, 5, 7, 9, 11]), 6, values=each)
    assert restored == 6 and error is None
    assert finishes == [[0, 1], [2, 3], [4, 5]]


def test_a_run_holding_half_the_inflight_slots_is_finished():
    restored, _, finishes = _fetch(Driver([1, 3, 5, 7, 9, 11]), 6, max_inflight=4)
    assert restored == 6 and all(len(f) <= 2 for f in finishes) and sum(finishes, []) == list(range(6))


def test_a_failed_chunk_stops_the_fetch_after_the_held_chunks_before_it_are_restored():
    restored, error, finishes = _fetch(Driver([1, 1, 4, 1, 1, 1], bad={2}), 6)
    assert restored == 2 and finishes == [[0, 1]]
    assert isinstance(error, CorruptStreamError) and "chunk 2" in str(error)


def test_a_deadline_restores_the_held_chunks_first_and_counts_them():
    restored, error, finishes = _fetch(Driver([1, 1, None, 1, 1, 1]), 6, deadline_after=5)
    assert restored == 2 and finishes == [[0, 1]]
    assert isinstance(error, FetchError) and "after 2 of 6 tokens" in str(error)


def test_a_failing_session_restores_the_held_chunks_and_names_the_first_chunk_not_restored():
    restored, error, finishes = _fetch(Driver([1, 1, None, None], fails_at=4), 4)
    assert restored == 2 and finishes == [[0, 1]]
    assert isinstance(error, FetchError) and "chunk 2 failed to decode" in str(error)


def test_a_session_failing_while_waited_on_restores_the_held_chunks_and_names_the_chunk_it_held():
    restored, error, finishes = _fetch(Driver([1, 1, None, None], wait_fails=True), 4)
    assert restored == 2 and finishes == [[0, 1]]
    assert isinstance(error, FetchError) and "chunk 2 failed to decode" in str(error)


@pytest.mark.parametrize("n", [1, 2, 5])
def test_every_chunk_is_restored_once_in_order_whatever_order_they_complete_in(n):
    ready = list(range(n, 0, -1))  # the last first
    restored, error, finishes = _fetch(Driver(ready), n)
    assert (restored, error) == (n, None) and sum(finishes, []) == list(range(n))
