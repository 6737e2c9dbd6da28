"""Background writer: after a prefill, encode the prompt's KV (CPU x265) and put it in the store.

When encoding cannot keep up with prefill (a GPU prefills thousands of tokens a second, a CPU
encodes far fewer), stores wait in a bounded backlog and the most valuable go first:
  * priority: each store's chunks weighted by how many recent prompts began with them (the chunk
    chain counted by `PrefixCounts`): popular prefixes first, then long ones, then older ones;
  * `StorePolicy.min_seen`: store only the part of a prompt that at least that many prompts began
    with (2: "seen twice"; the unique tail of a prompt is never encoded);
  * the backlog holds at most `max_pending` stores (each keeps slices of a request's KV cache
    alive, on the GPU when the model runs there): past it, the lowest-priority waiting store is
    dropped for a more valuable new one, else the new one is dropped; drops are logged and counted.
Submitting never waits for an encode: it takes a lock, hashes the prompt's chunks and returns.

Storing is background work and must never slow a request:
  * by default (`StorePolicy.encode_in="processes"`) stores are encoded in spawned worker
    processes (engine/encode_pool.py): the serving process only copies the prompt's KV into
    shared (pinned) host memory and hands it over, so encoding never holds its interpreter lock
    (encode threads in the serving process did: on an H200, 15 of them cost 7x the p50 TTFT of a
    stream of 2k-token prompts, one of them 1.7x); where a worker cannot be used (no store URL,
    a memory:// store, a codec that cannot cross, processes that fail to start) the storer
    encodes on its own threads as below (`encode_in="threads"` asks for that);
  * whatever encodes (the worker processes, or the storer's threads and the chunk threads of each
    encode) runs at `StorePolicy.nice` more OS niceness than the engine (Linux: per thread), so
    under contention the engine's thread and its torch threads get the cores; with processes the
    storer's own threads only hand stores over and stay at the engine's priority: a thread at
    lower priority that holds the interpreter lock while the OS runs the encoders in its place
    keeps the engine's thread waiting for the lock;
  * stores' chunks are encoded by `StorePolicy.encode_workers` threads in all (default: the cores
    less a few left to the serving process, `default_store_workers`; one x265 thread each),
    never x265's pool of every core; the worker processes run only on the other cores
    (`StorePolicy.pin`, `encode_cpus`): the cores left to serving stay free of them, so the
    engine's thread never lands on a core (and its caches) an encoder is using;
  * on a GPU, the stored KV is gathered on a CUDA stream of the storer's own: it waits for the
    prefill by an event recorded at submission (the engine never waits for it), the request's
    cache tensors are marked used on that stream (their memory is not reused while the storer
    reads it); on threads it is quantized there too and only the coded frames and side streams
    cross to the host. The prompt's KV is gathered from the cache's layers there (`gather_kv`: one
    stack and one permuted copy, not two operations per layer).
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import hashlib
import heapq
import itertools
import logging
import os
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np

from kvcodec.engine.encode_pool import EncodeProcessError
from kvcodec.errors import ConfigError, untraced
from kvcodec.kvspec.tensors import GroupedKV

log = logging.getLogger(__name__)

ENCODE_IN = ("processes", "threads")


@dataclasses.dataclass(frozen=True)
class StorePolicy:
    """What gets stored after a prefill.

    enabled: store at all.
    min_tokens: prompts shorter than this are not stored (None: one chunk of the codec config).
    max_tokens: store at most this many leading prompt tokens (None: all full chunks).
    skip_if_restored: skip when the restored prefix already covers every full chunk of the prompt.
    dtype: dtype the KV is stored from ("float16", "bfloat16", "float32"; None: the model's).
        quant="exact" restores exactly what was stored, so keep the model's dtype for bit-exact reuse.
    min_seen: store only the leading whole chunks that at least this many recent prompts (this one
        included) began with: 1 stores every prompt, 2 only prefixes seen twice (shared documents,
        system prompts), never a prompt's own tail.
    encode_workers: chunk encode threads in all (one x265 thread each); None:
        `default_store_workers()`, the cores this process may use less those left to serving.
    nice: OS niceness the storer's threads and processes run at above the engine's (0..19; 0:
        the same priority). Where the OS does not allow it, storing runs at the engine's priority.
    encode_in: "processes" (default): spawned worker processes encode and write each store, the
        serving process only copies its KV to shared memory; "threads": threads of the serving
        process (also where processes cannot be used; see the module doc).
    encode_processes: worker processes (encode_in="processes"); None: the split of the
        encode_workers threads that stores the most 2k-token prompts (encode_pool.split_workers).
    pin: run the worker processes on the serving process's cores less the ones left to serving
        (`encode_cpus`), never on those.
    """

    enabled: bool = True
    min_tokens: int | None = None
    max_tokens: int | None = None
    skip_if_restored: bool = True
    dtype: str | None = None
    min_seen: int = 1
    encode_workers: int | None = None
    nice: int = 10
    encode_in: str = "processes"
    encode_processes: int | None = None
    pin: bool = True

    def __post_init__(self) -> None:
        if isinstance(self.min_seen, bool) or not isinstance(self.min_seen, int) or self.min_seen < 1:
            raise ConfigError(f"StorePolicy.min_seen must be an integer >= 1; got {self.min_seen!r}")
        w = self.encode_workers
        if w is not None and (isinstance(w, bool) or not isinstance(w, int) or w < 1):
            raise ConfigError(f"StorePolicy.encode_workers must be None or an integer >= 1; got {w!r}")
        if isinstance(self.nice, bool) or not isinstance(self.nice, int) or not 0 <= self.nice <= 19:
            raise ConfigError(f"StorePolicy.nice must be an integer in 0..19; got {self.nice!r}")
        if self.encode_in not in ENCODE_IN:
            raise ConfigError(f"StorePolicy.encode_in must be one of {ENCODE_IN}; got {self.encode_in!r}")
        p = self.encode_processes
        if p is not None and (isinstance(p, bool) or not isinstance(p, int) or p < 1):
            raise ConfigError(f"StorePolicy.encode_processes must be None or an integer >= 1; got {p!r}")

    def background(self):  # noqa: ANN201 - kvcodec.codecs.hevc.encode.Background
        """How the storer's encodes run: encode_workers threads (default: default_store_workers()) at nice."""
        from kvcodec.codecs.hevc.encode import Background

        return Background(self.encode_workers or default_store_workers(), self.nice)


def default_store_workers() -> int:
    """Encode threads of a background store: the cores this process may use less
    `serving_cores` of them, at least 1; $KVCODEC_ENCODE_WORKERS (the encoder's own cap) still
    applies."""
    from kvcodec.layout.search import encode_workers, usable_cores

    cores = usable_cores()
    return max(1, min(cores - serving_cores(cores), encode_workers()))


def serving_cores(cores: int) -> int:
    """Cores left to the serving process out of `cores`: a quarter, at least 1 (16 -> 4). Its
    engine thread, the torch and CUDA threads and the storer's hand-off threads then find an idle
    core (not a busy core's sibling hyperthread) whenever they wake."""
    return max(1, cores // 4)


def encode_cpus(cpus: Any) -> tuple[int, ...] | None:
    """The CPUs encode worker processes run on, out of the serving process's `cpus`: all but the
    first serving_cores of them (16 -> the last 12); None (not pinned) with fewer than 2."""
    cpus = sorted(set(cpus))
    if len(cpus) < 2:
        return None
    return tuple(cpus[serving_cores(len(cpus)) :])


def affinity() -> tuple[int, ...]:
    """The CPUs this process may run on (empty where the OS does not tell)."""
    try:
        return tuple(sorted(os.sched_getaffinity(0)))
    except AttributeError:  # pragma: no cover - platforms without affinity
        return ()


class PrefixCounts:
    """How many recent prompts began with each chunk-aligned prefix: a bounded LRU of chained
    chunk hashes (the newest `capacity` prefixes)."""

    def __init__(self, chunk_tokens: int, capacity: int = 65536) -> None:
        self.chunk_tokens, self.capacity = chunk_tokens, capacity
        self._counts: collections.OrderedDict[bytes, int] = collections.OrderedDict()

    def observe(self, ids: Any, chunks: int) -> list[int]:
        """Count the prompt `ids` once; returns, per leading whole chunk (up to `chunks`), how many
        prompts so far (this one included) began with the prompt's tokens up to that chunk's end."""
        arr = np.asarray(ids, dtype=np.int64)
        prev, out = b"", []
        for j in range(chunks):
            prev = hashlib.blake2b(prev + arr[j * self.chunk_tokens : (j + 1) * self.chunk_tokens].tobytes()).digest()
            n = self._counts.pop(prev, 0) + 1
            self._counts[prev] = n
            out.append(n)
        while len(self._counts) > self.capacity:
            self._counts.popitem(last=False)
        return out


@dataclasses.dataclass(order=True)
class _Job:
    rank: tuple[int, int, int]  # (-value, -tokens, arrival): heap order, most valuable first
    ids: list[int] = dataclasses.field(compare=False)
    layers: Any = dataclasses.field(compare=False)
    future: Future = dataclasses.field(compare=False)
    submitted: float = dataclasses.field(compare=False)
    ready: Any = dataclasses.field(default=None, compare=False)  # CUDA event: the prefill is done

    @property
    def tokens(self) -> int:
        return len(self.ids)


class KVStorer:
    """Stores prefixes in the background (PrefixCache.put in worker processes, or on threads), most
    valuable prefix first, never blocking a request.

    store_url: the URL the prefix cache's store was opened from: worker processes open it too
        (None: stores are encoded on threads). max_pending: stores waiting, with one in each
        encoder (a thread, or a worker process) counted in.

    Callbacks (each optional): on_done(chunks_written | None, error | None) when a store ends;
    on_drop() when a store is dropped (backlog full); on_skip() when a prompt has no prefix seen
    min_seen times; on_stored(tokens, lag_s) when a prefix is in the store, lag_s from its
    submission."""

    def __init__(
        self,
        prefix_cache: Any,
        policy: StorePolicy,
        chunk_tokens: int,
        workers: int = 1,
        max_pending: int = 4,
        *,
        store_url: str | None = None,
    ) -> None:
        self.prefix_cache = prefix_cache
        self.policy = policy
        self.chunk_tokens = max(1, chunk_tokens)
        self.dropped = 0
        self.skipped = 0  # prompts whose prefix was not seen min_seen times
        self.stored_prefixes = 0
        self.stored_tokens = 0
        self.counts = PrefixCounts(self.chunk_tokens)
        self.settings = policy.background()
        self.processes = self._encode_pool(store_url)
        if self.processes is not None:
            workers = self.processes.processes  # one storer thread feeds each worker process
        self.max_pending = max(1, int(max_pending)) + max(0, workers - 1)
        self.encoder_pids: set[int] = set()  # the worker processes that encoded stores
        self._started: list[Future] = []  # the worker processes' start (their pids)
        self._starting: Future | None = None  # done when _started holds every start
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="kvcodec-store")
        self._streams: dict[Any, Any] = {}  # CUDA device -> the storer's stream
        self._waiting: list[_Job] = []  # heap
        self._pending: set[Future] = set()  # waiting or being encoded
        self._arrival = itertools.count()
        self._lock = threading.Lock()
        self.on_done: Any = None
        self.on_drop: Any = None
        self.on_stored: Any = None
        self.on_skip: Any = None

    def _encode_pool(self, store_url: str | None) -> Any:
        """The EncodePool stores go to (policy.encode_in == "processes" and the cache's stores can
        be written by another process), else None: threads."""
        if not self.policy.enabled or self.policy.encode_in != "processes" or self.prefix_cache is None:
            return None
        from kvcodec.engine.encode_pool import EncodePool, split_workers, worker_spec

        processes, threads = split_workers(self.settings.workers, self.policy.encode_processes)
        cpus = encode_cpus(affinity()) if self.policy.pin else None
        spec = worker_spec(self.prefix_cache, store_url, threads, self.settings.nice, cpus)
        if spec is None:
            log.info("KV stores are encoded on threads of this process (no store URL other processes can open)")
            return None
        try:
            return EncodePool(spec, processes)
        except Exception as e:  # noqa: BLE001 - no processes: threads
            log.warning("cannot make KV encode processes (%s): encoding on threads", e)
            return None

    @property
    def encode_in(self) -> str:
        """Where stores are encoded now: "processes" or "threads"."""
        return "threads" if self.processes is None else "processes"

    # -- what to store -------------------------------------------------------------------------
    def tokens_to_store(self, prompt_len: int, restored: int) -> int:
        p = self.policy
        if not p.enabled or self.prefix_cache is None:
            return 0
        min_tokens = p.min_tokens if p.min_tokens is not None else self.chunk_tokens
        if prompt_len < max(min_tokens, 1):
            return 0
        n = prompt_len if p.max_tokens is None else min(prompt_len, p.max_tokens)
        full = (n // self.chunk_tokens) * self.chunk_tokens
        if full == 0:
            return 0
        if p.skip_if_restored and restored >= full:
            return 0
        return n

    def _seen(self, prompt_ids: list[int], n: int, restored: int) -> tuple[int, int]:
        """(tokens to store under policy.min_seen, their value): the value is the sum over the
        stored chunks of how many prompts began with the prompt up to that chunk, i.e. chunks
        weighted by how often they were asked for (popular first, then long)."""
        with self._lock:
            seen = self.counts.observe(prompt_ids, n // self.chunk_tokens)
        if self.policy.min_seen > 1:
            shared = sum(1 for s in seen if s >= self.policy.min_seen)  # counts fall along the chain
            seen, n = seen[:shared], shared * self.chunk_tokens
            if n == 0 or (self.policy.skip_if_restored and restored >= n):
                return 0, 0
        return n, sum(seen) or 1

    @property
    def backlog(self) -> int:
        """Stores waiting for or in the encoder."""
        return len(self._pending)

    @property
    def backlog_tokens(self) -> int:
        """Tokens of the stores waiting for the encoder."""
        with self._lock:
            return sum(j.tokens for j in self._waiting)

    # -- queueing --------------------------------------------------------------------------------
    def submit(self, prompt_ids: list[int], cache: Any, restored: int = 0) -> Future | None:
        """Snapshot the first tokens of `cache` (no copy) and store them in the background, most
        valuable first; None when nothing is queued (nothing to store, or dropped)."""
        n = self.tokens_to_store(len(prompt_ids), restored)
        if n == 0:
            return None
        n, seen = self._seen(list(prompt_ids), n, restored)
        if n == 0:
            self.skipped += 1
            if self.on_skip:
                self.on_skip()
            return None
        # The request's cache writes later tokens after the prompt (in place, or into new storage
        # when it grows), so these views of the prompt's tokens stay unchanged while it decodes.
        from kvcodec.integrations.hf import layer_pairs

        job = _Job((-seen, -n, next(self._arrival)), list(prompt_ids[:n]), None, Future(), time.monotonic())
        evicted, start = None, False
        with self._lock:
            full = len(self._pending) >= self.max_pending
            if full:
                evicted = self._evict_for(job)
            if not full or evicted is not None:
                if isinstance(cache, GroupedKV):  # models with several KV layer groups
                    job.layers = cache.view(0, n)
                else:  # the layers' tensors; their first n tokens are taken on the storer's thread
                    job.layers = layer_pairs(cache)
                job.ready = _prefill_done(job.layers)
                heapq.heappush(self._waiting, job)
                self._pending.add(job.future)
                start = self.processes is not None and self._starting is None
                if start:
                    self._starting = Future()
        if evicted is not None:  # outside the lock: its future's callbacks take it
            evicted.future.set_result(None)
            self._drop(evicted.tokens, "a more valuable prefix came")
        elif full:
            self._drop(n, "backlog full")
            return None
        job.future.add_done_callback(self._forget)
        if start:  # the first store spawns the workers, from a thread of its own (not the engine's)
            threading.Thread(target=self._start_processes, name="kvcodec-store-start", daemon=True).start()
        self._pool.submit(self._run_next)
        return job.future

    def _evict_for(self, job: _Job) -> _Job | None:
        """Take the least valuable waiting store out if `job` is worth more (lock held)."""
        if not self._waiting:
            return None
        worst = max(self._waiting)
        if worst.rank <= job.rank:  # not less valuable than the new one (ties: the older stays)
            return None
        self._waiting.remove(worst)
        heapq.heapify(self._waiting)
        self._pending.discard(worst.future)
        worst.layers = None  # its KV slices are freed now
        return worst

    def _drop(self, tokens: int, why: str) -> None:
        self.dropped += 1
        log.warning("KV store backlog full (%d pending): not storing %d tokens (%s)", len(self._pending), tokens, why)
        if self.on_drop:
            self.on_drop()

    def _run_next(self) -> None:
        with self._lock:
            if not self._waiting:
                return  # its job was dropped for a more valuable one (which another run took)
            job = heapq.heappop(self._waiting)
        try:  # encoding here: this thread lowers itself for good (its encode threads inherit it)
            with self._background() if self.processes is None else contextlib.nullcontext(), self._on_stream(job):
                result = self._put(job)
            job.future.set_result(result)
        except Exception as e:  # reported by _put; the future carries it
            job.future.set_exception(untraced(e))  # its frames held the job (its KV) and the future holding it

    def _background(self) -> Any:
        from kvcodec.codecs.hevc.encode import background

        return background(self.settings)

    def _on_stream(self, job: _Job) -> Any:
        """On CUDA: the storer's stream (after the prefill's event), the job's tensors marked used
        on it; elsewhere nothing."""

        import torch

        if job.ready is None:
            return contextlib.nullcontext()
        tensors = _tensors(job.layers)
        device = tensors[0].device
        if device not in self._streams:
            self._streams[device] = torch.cuda.Stream(device)
        stream = self._streams[device]
        stream.wait_event(job.ready)
        for t in tensors:
            t.record_stream(stream)
        return torch.cuda.stream(stream)

    def start(self) -> None:
        """Start the encode worker processes now (a server calls this before its first request;
        otherwise the first store starts them). Returns at once; flush() waits for them."""
        with self._lock:
            start = self.processes is not None and self._starting is None
            if start:
                self._starting = Future()
        if start:
            self._start_processes()

    def _start_processes(self) -> None:
        """Spawn every worker process: from a thread at the engine's priority, so that a worker
        imports its modules without waiting behind the engine on a busy machine (a worker lowers
        itself to the storer's niceness before it takes stores); a pool that cannot start leaves
        storing on threads."""
        try:
            self._started = self.processes.start()
        except Exception as e:  # noqa: BLE001
            self._to_threads(e)
        finally:
            self._starting.set_result(None)

    def _to_threads(self, error: BaseException) -> None:
        with self._lock:
            pool, self.processes = self.processes, None
        if pool is not None:
            hint = ""
            if "bootstrapping phase" in str(error):  # multiprocessing's words for a script without a main guard
                hint = ' (run the engine under `if __name__ == "__main__":`: its workers import the main module)'
            log.warning("KV encode processes failed (%s): encoding on threads from now on%s", error, hint)
            pool.shutdown(wait=False)

    def _put(self, job: _Job) -> int:
        import torch

        layers, job.layers = job.layers, None
        try:
            pool = self.processes
            if isinstance(layers, GroupedKV):
                kv = layers.to("cpu", getattr(torch, self.policy.dtype) if self.policy.dtype else None)
            else:
                kv = gather_kv(layers, job.tokens)
                on_device = pool is not None or getattr(self.prefix_cache.codec, "encodes_on_device", False)
                if not on_device:
                    kv = kv.to("cpu")  # else the codec quantizes on the KV's GPU (HevcCodec)
                if self.policy.dtype:
                    kv = kv.to(getattr(torch, self.policy.dtype))
            del layers
            written = None
            if pool is not None and isinstance(kv, torch.Tensor):  # layer groups (GroupedKV) encode on threads
                try:
                    written, pid = pool.put(job.ids, kv)
                    self.encoder_pids.add(pid)
                except EncodeProcessError as e:
                    self._to_threads(e)
            if written is None:
                if (
                    isinstance(kv, torch.Tensor)
                    and kv.is_cuda
                    and not getattr(self.prefix_cache.codec, "encodes_on_device", False)
                ):
                    kv = kv.to("cpu")
                with self._background():
                    written = int(self.prefix_cache.put(job.ids, kv) or 0)
        except Exception as e:
            log.warning("storing %d tokens of KV failed: %s", job.tokens, e)
            if self.on_done:
                self.on_done(None, e)
            raise
        with self._lock:
            self.stored_prefixes += 1
            self.stored_tokens += job.tokens
        if self.on_done:
            self.on_done(written, None)
        if self.on_stored:
            self.on_stored(job.tokens, time.monotonic() - job.submitted)
        return written

    def _forget(self, fut: Future) -> None:
        with self._lock:
            self._pending.discard(fut)

    def flush(self, timeout: float | None = None) -> None:
        """Wait until every queued store has finished and the encode processes started for them
        are up (errors are logged, not raised)."""
        with self._lock:
            pending, starting = list(self._pending), self._starting
        if starting is not None:  # the workers the first store started, up
            with contextlib.suppress(Exception):
                starting.result(timeout=timeout)
            pending += self._started
        for f in pending:
            with contextlib.suppress(Exception):
                f.result(timeout=timeout)

    def shutdown(self, wait: bool = True) -> None:
        """Stop the workers; wait=False drops waiting stores (the ones being encoded finish)."""
        if not wait:
            with self._lock:
                waiting, self._waiting = self._waiting, []
            for job in waiting:
                job.layers = None
                job.future.cancel()
        self._pool.shutdown(wait=wait, cancel_futures=not wait)
        if self._starting is not None and not self._starting.done():  # its start was cancelled
            with contextlib.suppress(Exception):
                self._starting.set_result(None)
        if self.processes is not None:
            self.processes.shutdown(wait=wait)


def gather_kv(pairs: list[tuple[Any, Any]], tokens: int) -> Any:
    """The first `tokens` positions of a cache's (keys, values) per layer ([1, kv_heads, seq,
    head_dim] each) as one canonical (layers, 2, tokens, kv_heads, head_dim) tensor, as
    cache_to_tensor gives it, in one stack and one permuted copy (cache_to_tensor: three
    operations per layer, each holding the interpreter lock the engine's thread wants)."""
    import torch

    from kvcodec.integrations.hf import cache_to_tensor

    flat = [t for pair in pairs for t in pair]
    k0 = flat[0] if flat else None
    if k0 is None or k0.dim() != 4 or k0.shape[0] != 1 or any(t.shape != k0.shape or t.dtype != k0.dtype for t in flat):
        return cache_to_tensor([(k[:, :, :tokens], v[:, :, :tokens]) for k, v in pairs])  # its checks and errors
    if k0.shape[2] != tokens:
        flat = [t[:, :, :tokens] for t in flat]
    _, heads, _, dim = k0.shape
    return torch.stack(flat).view(len(pairs), 2, heads, tokens, dim).transpose(2, 3).contiguous()


def _tensors(layers: Any) -> list[Any]:
    """The tensors of a job's KV slices (a GroupedKV view or (k, v) pairs)."""
    if isinstance(layers, GroupedKV):
        return list(layers.tensors)
    return [t for pair in layers for t in pair]


def _prefill_done(layers: Any) -> Any:
    """A CUDA event recorded on the submitting (engine) thread's current stream after its prefill,
    when the KV is on a GPU; None elsewhere."""
    tensors = _tensors(layers)
    if not tensors or not tensors[0].is_cuda:
        return None
    import torch

    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(tensors[0].device))
    return event
