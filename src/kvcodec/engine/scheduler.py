r"""Iteration-level scheduler with fetch-aware admission of prefix-reusing requests.

Queues (all FCFS by arrival time):

    add() --lookup--> miss ----------------------------> waiting ---+
                 \--> hit --> fetching (background thread) -> ready -+--> running (admitted at
                                                                          the next iteration)

`policy="fetch-aware"` (default): a request whose prompt starts with a stored prefix is parked in
`fetching` while a worker thread fetches and decodes its KV; it joins the running batch at the first
iteration after the KV is restored and then prefills only its new tokens. Requests without reuse
are admitted FCFS from `waiting` and never wait behind a fetch.

`policy="blocking"` (for comparison, like a synchronous KV loader): one FCFS queue; when the head
request has a stored prefix, its fetch runs inside `schedule()`, on the engine's thread, so the
whole engine (running decodes and every later arrival) waits for it.

A failed fetch (store down, corrupt object, deadline passed) is not an error for the request: it
keeps the tokens restored before the failure (possibly none) and prefills the rest. Each fetch's
deadline and the tensor it restores into come from the engine (`deadline_for`, `target_for`).
"""

from __future__ import annotations

import collections
import inspect
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Protocol

from kvcodec.engine.config import POLICIES, EngineConfig
from kvcodec.engine.sequence import Request, State
from kvcodec.errors import ConfigError

log = logging.getLogger(__name__)


class PrefixSource(Protocol):
    """What the scheduler needs from a prefix cache (kvcodec.fetcher.PrefixCache has this; a fetch
    that also takes `cancelled=` is told when its request is aborted)."""

    def lookup(self, token_ids: list[int], deadline_s: float | None = None) -> int: ...

    def fetch(self, token_ids: list[int], n_tokens: int, out: Any = None, deadline_s: float | None = None) -> Any: ...


def _takes(method: Any, name: str) -> bool:
    """Whether `method` takes the keyword `name` (a PrefixSource's fetch `cancelled`, its lookup
    `deadline_s`: PrefixCache's do; another source's are called without them)."""
    try:
        params = inspect.signature(method).parameters
    except (AttributeError, TypeError, ValueError):
        return False
    return name in params or any(p.kind is p.VAR_KEYWORD for p in params.values())


class Scheduler:
    """Decides, before each engine iteration, which requests join the running batch.

    prefix_cache: a PrefixSource, or None for no reuse.
    max_batch: most requests in the running batch.
    max_prefill_tokens: soft budget of new (non-restored) prompt tokens prefilled per iteration
        (at least one request is always admitted when a slot is free).
    min_reuse_tokens: a stored prefix shorter than this is not fetched (recomputed instead).
    fetch_deadline_s: bounds each prefix's lookup, and its fetch from the lookup's start (fetch-aware; blocking:
        from the fetch's start, once admitted); past it the fetch stops and the rest is recomputed.
    deadline_for: (request, tokens) -> deadline in seconds (or None) for reading a prefix of `tokens`,
        used instead of fetch_deadline_s (the lookup asks it for the whole prompt, the fetch for the match).
    target_for: request -> the tensor to restore its prefix into (None: the fetch allocates one).
    """

    def __init__(
        self,
        prefix_cache: PrefixSource | None = None,
        policy: str = EngineConfig.policy,  # the defaults are the engine's (one place to change them)
        max_batch: int = EngineConfig.max_batch,
        max_prefill_tokens: int = EngineConfig.max_prefill_tokens,
        min_reuse_tokens: int = EngineConfig.min_reuse_tokens,
        fetch_workers: int = EngineConfig.fetch_workers,
        fetch_deadline_s: float | None = None,
        deadline_for: Callable[[Request, int], float | None] | None = None,
        target_for: Callable[[Request], Any] | None = None,
    ) -> None:
        if policy not in POLICIES:
            raise ConfigError(f"scheduler policy must be one of {POLICIES}; got {policy!r}")
        if max_batch < 1:
            raise ConfigError(f"max_batch must be >= 1; got {max_batch}")
        self.prefix_cache = prefix_cache
        self._fetch_cancels = _takes(getattr(prefix_cache, "fetch", None), "cancelled")
        self._lookup_bounded = _takes(getattr(prefix_cache, "lookup", None), "deadline_s")
        self.policy = policy
        self.max_batch = max_batch
        self.max_prefill_tokens = max_prefill_tokens
        self.min_reuse_tokens = max(1, min_reuse_tokens)
        self.deadline_for = deadline_for or (lambda req, tokens: fetch_deadline_s)
        self.target_for = target_for or (lambda req: None)
        self.waiting: collections.deque[Request] = collections.deque()
        self.fetching: list[Request] = []
        self.ready: list[Request] = []
        self.running: list[Request] = []
        self.cv = threading.Condition()
        self._pool = (
            ThreadPoolExecutor(max_workers=fetch_workers, thread_name_prefix="kvcodec-fetch")
            if prefix_cache is not None and policy == "fetch-aware"
            else None
        )

    # ---- arrival -------------------------------------------------------------------------------
    def add(self, req: Request) -> None:
        """Queue a request. The prefix lookup runs here, on the caller's thread, never the engine's; its time
        counts against the fetch's deadline (a store that answers slowly costs no more than recomputing)."""
        lookup_start = time.perf_counter()
        req.matched_tokens = self._lookup(req)
        with self.cv:
            if req.matched_tokens and self.policy == "fetch-aware":
                req.state = State.FETCHING
                req.fetch_start, req.deadline_start = time.perf_counter(), lookup_start
                self.fetching.append(req)
                req.fetch_future = self._pool.submit(self._fetch, req)
                req.fetch_future.add_done_callback(self._fetch_done)
            else:
                req.state = State.WAITING
                self.waiting.append(req)
            self.cv.notify_all()

    def _lookup(self, req: Request) -> int:
        if self.prefix_cache is None or not req.reuse or req.prompt_len < 2:
            return 0
        bound = {"deadline_s": self.deadline_for(req, req.prompt_len)} if self._lookup_bounded else {}
        try:
            matched = int(self.prefix_cache.lookup(req.prompt_ids, **bound))
        except Exception as e:  # a store that is down is a miss, not a failed request
            log.warning("prefix lookup failed for %s: %s", req.request_id, e)
            req.fetch_error = f"lookup: {e}"
            return 0
        return matched if matched >= self.min_reuse_tokens else 0

    # ---- fetching ------------------------------------------------------------------------------
    def _fetch(self, req: Request) -> None:
        """Fetch the matched prefix into req.restored_kv (runs on a worker or, blocking, inline)."""
        req.fetch_start = req.fetch_start or time.perf_counter()
        try:
            deadline = req.fetch_deadline_s = self.deadline_for(req, req.matched_tokens)
            since = req.deadline_start or req.fetch_start  # fetch-aware: from the lookup's start
            left = None if deadline is None else deadline - (time.perf_counter() - since)
            if req.aborted or (left is not None and left <= 0):
                why = (
                    "aborted before its fetch began"
                    if req.aborted
                    else "its deadline passed in its lookup or while it waited for a fetch worker"
                )
                return self._not_fetched(req, why)
            out = self.target_for(req)
            cancel = {"cancelled": lambda: req.aborted} if self._fetch_cancels else {}
            res = self.prefix_cache.fetch(req.prompt_ids, req.matched_tokens, out=out, deadline_s=left, **cancel)
            restored = int(getattr(res, "tokens_restored", 0) or 0)
            req.restored_tokens = restored
            req.restored_kv = res.kv if restored else None
            err = getattr(res, "error", None)
            if err is not None:
                req.fetch_error = str(err) or type(err).__name__
            stats = getattr(res, "stats", None) or {}
            req.fetch_stats = dict(stats) if isinstance(stats, dict) else dict(vars(stats))
        except Exception as e:  # a fetch that blows up is recomputed, never fatal
            log.warning("fetch failed for %s, recomputing: %s", req.request_id, e)
            req.restored_tokens = 0
            req.restored_kv = None
            req.fetch_error = f"{type(e).__name__}: {e}"
        req.fetch_end = time.perf_counter()

    @staticmethod
    def _not_fetched(req: Request, why: str) -> None:
        req.fetch_error, req.restored_tokens, req.restored_kv = why, 0, None
        req.fetch_end = time.perf_counter()

    def _fetch_done(self, fut: Future) -> None:
        with self.cv:
            for req in self.fetching:
                if req.fetch_future is fut:
                    self.fetching.remove(req)
                    req.state = State.READY
                    self.ready.append(req)
                    break
            self.cv.notify_all()

    # ---- per iteration -------------------------------------------------------------------------
    def schedule(self) -> list[Request]:
        """Requests admitted to the running batch this iteration (to be prefilled now)."""
        with self.cv:
            free = self.max_batch - len(self.running)
            if free <= 0:
                return []
            if self.policy == "blocking":
                cands = list(self.waiting)
            else:
                cands = sorted(list(self.ready) + list(self.waiting), key=lambda r: r.arrival_time)
            admitted: list[Request] = []
            budget = self.max_prefill_tokens
            for req in cands:
                if req.aborted:
                    continue  # take_aborted() retires it
                if len(admitted) >= free:
                    break
                need = req.prompt_len - min(req.matched_tokens, req.prompt_len - 1)
                if admitted and need > budget:
                    break
                budget -= need
                admitted.append(req)
            for req in admitted:
                if req.state is State.READY:
                    self.ready.remove(req)
                else:
                    self.waiting.remove(req)
        if self.policy == "blocking":
            for req in admitted:
                if req.matched_tokens:
                    self._fetch(req)  # stalls the engine: that is the point of this policy
        now = time.perf_counter()
        with self.cv:
            for req in admitted:
                req.state = State.RUNNING
                req.scheduled_time = now
                self.running.append(req)
        return admitted

    def take_aborted(self) -> list[Request]:
        """Remove and return the aborted requests that have not joined the running batch."""
        with self.cv:
            gone = [r for r in (*self.waiting, *self.ready) if r.aborted]
            for r in gone:
                (self.ready if r.state is State.READY else self.waiting).remove(r)
        return gone

    def drain(self) -> list[Request]:
        """Remove and return every unfinished request (shutdown); fetches still running are left
        to finish on their own."""
        with self.cv:
            reqs = [*self.running, *self.ready, *self.waiting, *self.fetching]
            self.running.clear(), self.ready.clear(), self.waiting.clear(), self.fetching.clear()
            return reqs

    def finish(self, req: Request) -> None:
        with self.cv:
            if req in self.running:
                self.running.remove(req)
            req.state = State.FINISHED
            self.cv.notify_all()

    # ---- state ---------------------------------------------------------------------------------
    def has_unfinished(self) -> bool:
        with self.cv:
            return bool(self.waiting or self.fetching or self.ready or self.running)

    def has_schedulable(self) -> bool:
        with self.cv:
            return bool(self.running or self.waiting or self.ready)

    def wait_for_work(self, timeout: float | None = None) -> bool:
        """Block until a request can run (or timeout); True if there is one."""
        with self.cv:
            return self.cv.wait_for(lambda: bool(self.running or self.waiting or self.ready), timeout)

    def counts(self) -> dict[str, int]:
        with self.cv:
            return {
                "waiting": len(self.waiting),
                "fetching": len(self.fetching),
                "ready": len(self.ready),
                "running": len(self.running),
            }

    def shutdown(self, wait: bool = True) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=wait, cancel_futures=not wait)
