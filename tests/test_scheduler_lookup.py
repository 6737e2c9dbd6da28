"""The scheduler's prefix lookup runs under the request's fetch deadline: a store that stops
answering costs a request no more than recomputing its prompt, not the store client's timeout."""

from __future__ import annotations

import threading
import time

import torch

from kvcodec.codecs.raw import RawCodec
from kvcodec.engine import Request, Scheduler, State
from kvcodec.fetcher import DecodeProfile, PrefixCache
from kvcodec.store import open_store

CHUNK = 16


class GatedStore:
    """A real store whose existence queries wait at `gate` while it is closed (a paused server)."""

    def __init__(self, inner) -> None:  # noqa: ANN001
        self.inner, self.url = inner, "gated+" + inner.url
        self.gate, self.waiting = threading.Event(), threading.Event()
        self.gate.set()

    def __getattr__(self, name: str):  # noqa: ANN204
        return getattr(self.inner, name)

    def exists_many(self, keys):  # noqa: ANN001, ANN201
        if not self.gate.is_set():
            self.waiting.set()
            self.gate.wait(60)
        found = self.inner.exists_many(keys)
        self.answered_at = time.perf_counter()
        return found


def stored_cache() -> tuple[PrefixCache, GatedStore, list[int]]:
    codec = RawCodec(chunk_tokens=CHUNK)
    store = GatedStore(open_store("memory://"))
    cache = PrefixCache(store, "m", codec, "cpu", profile=DecodeProfile.default(((256, 256),)), policy="fixed:0")
    ids = list(range(500, 500 + 3 * CHUNK))
    cache.put(ids, torch.randn((2, 2, len(ids), 2, 32)).half())
    return cache, store, ids


def add_on_a_thread(sched: Scheduler, req: Request) -> threading.Thread:
    t = threading.Thread(target=sched.add, args=(req,), daemon=True)
    t.start()
    return t


def test_a_stalled_lookup_ends_at_the_deadline_and_the_request_recomputes() -> None:
    cache, store, ids = stored_cache()
    sched = Scheduler(cache, policy="fetch-aware", fetch_deadline_s=0.2)
    store.gate.clear()
    try:
        req = Request(prompt_ids=ids + [7])
        adding = add_on_a_thread(sched, req)
        adding.join(30)  # the store stays stalled for 60 s: only the deadline ends the lookup sooner
        assert store.waiting.is_set() and not adding.is_alive()
        assert store.gate.is_set() is False  # still stalled when the request was queued
    finally:
        store.gate.set()
    assert req.matched_tokens == 0 and req.state is State.WAITING
    assert req.fetch_error.startswith("lookup:") and "deadline" in req.fetch_error


def test_the_deadline_asked_for_the_lookup_covers_the_whole_prompt() -> None:
    cache, _, ids = stored_cache()
    asked: list[int] = []
    sched = Scheduler(cache, policy="fetch-aware", deadline_for=lambda req, tokens: asked.append(tokens) or 30.0)
    req = Request(prompt_ids=ids + [7])
    sched.add(req)
    req.fetch_future.result(60)
    assert asked == [len(ids) + 1, 3 * CHUNK]  # the lookup: the whole prompt; the fetch: what it matched
    assert req.matched_tokens == 3 * CHUNK and req.fetch_start is not None


def test_the_fetch_starts_after_the_lookup_and_its_deadline_counts_from_the_lookup() -> None:
    cache, store, ids = stored_cache()
    sched = Scheduler(cache, policy="fetch-aware", fetch_deadline_s=30.0)
    req = Request(prompt_ids=ids + [7])
    before = time.perf_counter()
    sched.add(req)
    req.fetch_future.result(60)
    assert before <= req.deadline_start <= store.answered_at <= req.fetch_start  # fetch_s leaves the lookup out
    assert req.restored_tokens == 3 * CHUNK


class OneArgumentLookup:
    """A prefix source whose lookup takes only the token ids (the PrefixSource protocol before deadlines)."""

    def __init__(self, cache: PrefixCache) -> None:
        self.cache = cache

    def lookup(self, token_ids):  # noqa: ANN001, ANN201
        return self.cache.lookup(token_ids)

    def fetch(self, *args, **kwargs):  # noqa: ANN002, ANN003, ANN201
        return self.cache.fetch(*args, **kwargs)


def test_a_source_whose_lookup_takes_no_deadline_is_asked_without_one() -> None:
    cache, _, ids = stored_cache()
    sched = Scheduler(OneArgumentLookup(cache), policy="fetch-aware", fetch_deadline_s=30.0)
    req = Request(prompt_ids=ids + [7])
    sched.add(req)
    req.fetch_future.result(60)
    assert req.fetch_error is None and req.matched_tokens == req.restored_tokens == 3 * CHUNK
