"""Stores kept off the engine's way (issue 24, target 2): encode worker processes pinned to the
cores not left to serving, and (StorePolicy.pause_for_prefill) stopped while the engine prefills,
at most a share of the time.
Real worker processes and signals; the stop and the continue are read from the kernel (waitpid),
never waited for by time; the pause budget runs on an injected clock."""

from __future__ import annotations

import contextlib
import os
import sys

import pytest
import torch

from kvcodec.codecs.raw import RawCodec
from kvcodec.engine.storer import (
    PAUSE_SHARE,
    KVStorer,
    PauseBudget,
    StorePolicy,
    affinity,
    encode_cpus,
    serving_cores,
)
from kvcodec.fetcher import PrefixCache
from kvcodec.store import open_store

linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="SIGSTOP, waitpid and CPU affinity")


def test_encode_cpus_leave_the_first_serving_cores_to_the_engine():
    assert encode_cpus(range(16)) == tuple(range(4, 16))  # a quarter left to serving
    assert encode_cpus([9, 3, 5, 7]) == (5, 7, 9)  # the serving process's own CPUs, in order
    assert encode_cpus([0, 1]) == (1,)
    assert encode_cpus([2]) is None and encode_cpus([]) is None  # nothing to leave: not pinned
    for n in (2, 3, 8, 64):
        cpus = encode_cpus(range(n))
        assert len(cpus) == n - serving_cores(n) and not set(cpus) & set(range(serving_cores(n)))


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def test_pause_budget_lets_every_short_prefill_pause_and_caps_a_stream_of_them():
    clock = Clock()
    budget = PauseBudget(share=0.5, burst_s=1.0, clock=clock)
    assert budget.begin()
    clock.t += 1.5  # one long prefill overruns the credit once ...
    assert budget.end() == 1.5
    assert not budget.begin()  # ... and is paid back before the next pause
    clock.t += 1.0
    assert not budget.begin()  # 0.5 s of credit accrued: back to zero, not above
    clock.t += 0.2
    assert budget.begin()
    budget.end()

    # a stream like serve_store's (a 30 ms prefill every 125 ms): every prefill pauses
    clock, granted = Clock(), 0
    budget = PauseBudget(clock=clock)
    for _ in range(400):
        granted += budget.begin()
        clock.t += 0.03
        budget.end()
        clock.t += 0.095
    assert granted == 400

    # back-to-back prefills (100 s of them): the encoders stopped at most the share (+ one burst)
    clock, paused = Clock(), 0.0
    budget = PauseBudget(clock=clock)
    for _ in range(1000):
        if budget.begin():
            clock.t += 0.1
            paused += budget.end()
        else:
            clock.t += 0.1
    assert 0.45 * 100 <= paused <= PAUSE_SHARE * 100 + 1.0 + 0.1


def raw_storer(tmp_path, **policy) -> KVStorer:
    url = f"file://{tmp_path / 'store'}"
    cache = PrefixCache(open_store(url), "m", RawCodec(chunk_tokens=4), "cpu")
    return KVStorer(cache, StorePolicy(encode_workers=2, encode_processes=2, **policy), 4, store_url=url)


def started(storer: KVStorer) -> tuple[int, ...]:
    storer.start()
    storer.flush()  # every worker up
    pids = storer.processes.pids()
    assert len(pids) == 2 and os.getpid() not in pids
    return pids


def layers(tokens: int, seed: int = 0) -> list:
    kv = torch.randn(1, 1, tokens, 2, generator=torch.Generator().manual_seed(seed))
    return [(kv, kv + 1)]


def wait_state(pid: int, flag: int, check) -> None:  # noqa: ANN001
    """Block until the kernel reports child `pid` stopped (WUNTRACED) or continued (WCONTINUED)."""
    got, status = os.waitpid(pid, flag)
    assert got == pid and check(status), status


@linux_only
def test_workers_run_only_on_the_cores_not_left_to_serving(tmp_path):
    cpus = encode_cpus(affinity())
    if cpus is None or not hasattr(os, "sched_getaffinity"):
        pytest.skip("one CPU: nothing to pin")
    storer = raw_storer(tmp_path)
    try:
        assert storer.processes.spec.cpus == cpus
        for pid in started(storer):
            for tid in os.listdir(f"/proc/{pid}/task"):  # every thread of the worker
                assert os.sched_getaffinity(int(tid)) == set(cpus)
    finally:
        storer.shutdown()
    unpinned = raw_storer(tmp_path, pin=False)
    try:
        assert unpinned.processes.spec.cpus is None
        assert all(os.sched_getaffinity(pid) == set(affinity()) for pid in started(unpinned))
    finally:
        unpinned.shutdown()


@linux_only
def test_workers_are_stopped_while_the_engine_prefills_and_their_stores_go_on_after(tmp_path):
    storer = raw_storer(tmp_path, pause_for_prefill=True)
    try:
        pids = started(storer)
        with storer.prefilling():  # nothing to store: nothing stopped
            pass
        assert storer.paused_s == 0.0
        with storer.prefilling():
            pass
        first = storer.submit(list(range(8)), layers(8))
        signalled, pause = [], storer.processes.pause
        storer.processes.pause = lambda: signalled.append(pause())
        with storer.prefilling():
            assert signalled == [pids]  # sent: the waits below cannot hang
            for pid in pids:
                wait_state(pid, os.WUNTRACED, os.WIFSTOPPED)
            second = storer.submit(list(range(100, 112)), layers(12, 1))  # waits for the workers
        for pid in pids:
            wait_state(pid, os.WCONTINUED, os.WIFCONTINUED)
        assert first.result(timeout=120) == 2 and second.result(timeout=120) == 3
        assert storer.paused_s > 0 and storer.stored_prefixes == 2
    finally:
        storer.shutdown()


def test_no_pause_without_the_policy_without_stores_or_without_budget(tmp_path):
    calls: list[str] = []

    def run(storer: KVStorer, pending: bool) -> list[str]:  # noqa: FBT001
        calls.clear()
        storer.processes.pause = lambda: calls.append("pause")
        storer.processes.resume = lambda: calls.append("resume")
        if pending:
            storer._pending.add(object())
        with storer.prefilling():
            calls.append("prefill")
        storer._pending.clear()
        return list(calls)

    storer = raw_storer(tmp_path, pause_for_prefill=True)
    off = raw_storer(tmp_path)  # the default: not paused
    try:
        assert run(storer, pending=True) == ["pause", "prefill", "resume"]
        assert run(storer, pending=False) == ["prefill"]
        assert run(off, pending=True) == ["prefill"]
        clock = Clock()
        storer.pauses = PauseBudget(burst_s=0.1, clock=clock)
        storer.pauses.begin()
        clock.t += 1.0
        storer.pauses.end()  # 0.9 s over the budget
        assert run(storer, pending=True) == ["prefill"]
        with pytest.raises(RuntimeError), storer.prefilling():  # a failed prefill still resumes
            clock.t += 10.0
            storer._pending.add(object())
            raise RuntimeError("prefill failed")
    finally:
        storer._pending.clear()
        storer.shutdown()
        off.shutdown()


@pytest.mark.slow
def test_the_engine_prefills_inside_the_storers_pause_and_decodes_outside(smol, tmp_path):
    from kvcodec.engine import Engine

    model, tok = smol
    with Engine(
        model, tokenizer=tok, store_url=f"file://{tmp_path}", device="cpu", codec=RawCodec(chunk_tokens=16)
    ) as eng:
        inside, seen = [False], []
        pause = eng.storer.prefilling

        @contextlib.contextmanager
        def recorded():
            with pause():
                inside[0] = True
                try:
                    yield
                finally:
                    inside[0] = False

        def tagged(name: str, fn):  # noqa: ANN001, ANN202
            def call(*a, **k):  # noqa: ANN002, ANN003, ANN202
                seen.append((name, inside[0]))
                return fn(*a, **k)

            return call

        eng.storer.prefilling = recorded
        eng.runner.prefill_chunk = tagged("prefill", eng.runner.prefill_chunk)
        eng.runner.decode = tagged("decode", eng.runner.decode)
        eng.runner.decode_batched = tagged("decode", eng.runner.decode_batched)
        text = "The miller kept a canoe tied to a post by the river, and a lamp in the mill's window. "
        eng.generate([text * 2, "Q: " + text], max_new_tokens=3, ignore_eos=True, wait_for_store=True)
    assert {n for n, _ in seen} == {"prefill", "decode"}
    assert all(inside for n, inside in seen if n == "prefill") and not any(i for n, i in seen if n == "decode")
