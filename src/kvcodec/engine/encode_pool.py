"""Background stores encoded in worker processes, out of the serving process's interpreter lock.

The serving process only copies a prompt's KV into a shared-memory buffer (on a GPU: one copy on
the storer's CUDA stream into buffers registered as pinned memory, so the copy engine moves it
without a staging copy) and sends the buffer's name, the token ids and the tensor's shape to a
worker. Workers are spawned (never forked from a process holding CUDA and threads), run at the
storer's niceness, encode on their CPU (GPUs are hidden from them) with `threads` chunk threads each,
and write through a PrefixCache of their own opened from the same store URL, model id and codec,
so the stored bytes and keys are those of an in-process put.

Codecs cross to the workers as factories (`portable_codec`, a registry by codec class; any codec
that pickles and keeps its id works too); a store must be reachable by URL from another process
(file://, redis://, ...; not memory://). Where either is missing, or the processes cannot start,
the storer encodes on its threads instead (engine/storer.py).
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import functools
import logging
import math
import multiprocessing
import os
import pickle
import signal
import threading
import time
import weakref
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from multiprocessing import shared_memory
from typing import Any

import torch

from kvcodec.errors import BackendUnavailableError, KVCodecError, StoreError

log = logging.getLogger(__name__)

LOCAL_SCHEMES = ("memory",)  # stores another process cannot see
BUFFER_ALIGN = 8 << 20  # shared buffers grow in steps of 8 MiB (reused across stores)
STORE_CHUNKS = 8  # chunks of a typical store (a 2k-token prompt, 256 tokens a chunk): split_workers
MAX_PROCESSES = 8  # each worker is an interpreter with torch imported (~0.3-0.5 GB, seconds to start)


class EncodeProcessError(BackendUnavailableError):
    """The encode processes cannot take a store (they did not start, or one died)."""


class EncodeWorkerError(KVCodecError):
    """A store failed in a worker with an error that cannot cross back as itself (its type and
    message are kept in the text)."""


@dataclasses.dataclass(frozen=True)
class WorkerSpec:
    """What a worker process needs to write stores as the engine's PrefixCache would."""

    store_url: str
    model_id: str
    codec: Callable[[], Any]  # a picklable factory of the codec (portable_codec)
    store_partial: bool = True
    namespace: str | None = None
    threads: int = 1  # chunk threads per worker
    niceness: int = 0  # absolute OS niceness of the worker (its threads inherit it)
    cpus: tuple[int, ...] | None = None  # the CPUs the worker runs on (None: the serving process's)


def split_workers(workers: int, processes: int | None = None, chunks: int = STORE_CHUNKS) -> tuple[int, int]:
    """(processes, chunk threads per process) for at most `workers` encode threads in all:
    `processes` if given, else the split that stores the most stores of `chunks` chunks per
    chunk encode time, the fewest processes among equals, at least 2 threads and at most
    MAX_PROCESSES processes. A worker encodes one store at a time, its chunks in rounds of its
    thread count: 14 threads as 2 x 7 take two rounds for 8 chunks (1 store per round), as 7 x 2
    1.75 stores per round; 12 threads as 3 x 4 1.5."""
    workers = max(1, int(workers))
    if processes:
        procs = max(1, min(workers, processes))
        return procs, max(1, workers // procs)
    chunks = max(1, int(chunks))

    def rate(procs: int) -> float:  # stores per chunk encode time
        return procs / math.ceil(chunks / (workers // procs))

    most = max(1, min(MAX_PROCESSES, workers // 2))
    procs = max(range(1, most + 1), key=lambda p: (rate(p), -p))
    return procs, workers // procs


# -- codecs that cross to a worker --------------------------------------------------------------
def _hevc_factory(codec: Any) -> Callable[[], Any]:
    from kvcodec.codecs.hevc.codec import HevcCodec

    return functools.partial(HevcCodec, codec.config)


def _transform_factory(codec: Any, **extra: Any) -> Callable[[], Any]:
    c = codec
    return functools.partial(
        type(c),
        c.cal,
        kvt_hash=c.kvt_hash,
        target_ratio=c.target_ratio,
        bits_per_value=c.bits_per_value,
        theta=c.theta,
        key_weight=c.key_weight,
        sink_tokens=c.sink_tokens,
        fine_tokens=c.fine_tokens,
        fine_bits=c.fine_bits,
        recon=c.recon,
        coder=c.coder,
        chunk_tokens=c.chunk_tokens,
        resolutions=c.resolutions,
        **extra,
    )


def _transform_ans_factory(codec: Any) -> Callable[[], Any]:
    return _transform_factory(codec, block=codec.params.block, lanes=codec.params.lanes)


# codec class path -> factory maker (the encode side only: decoders and NVDEC pools stay behind)
PORTABLE_CODECS: dict[str, Callable[[Any], Callable[[], Any]]] = {
    "kvcodec.codecs.hevc.codec.HevcCodec": _hevc_factory,
    "kvcodec.codecs.transform.codec.TransformCodec": _transform_factory,
    "kvcodec.codecs.transform_ans.codec.TransformAnsCodec": _transform_ans_factory,
}


def _copy_of(codec: Any) -> Any:
    return codec


def portable_codec(codec: Any) -> Callable[[], Any] | None:
    """A picklable factory making, in another process, a codec that encodes as `codec` does (the
    same id); None where there is none (the storer then encodes on threads)."""
    name = f"{type(codec).__module__}.{type(codec).__qualname__}"
    make = PORTABLE_CODECS.get(name)
    try:
        factory = make(codec) if make else functools.partial(_copy_of, codec)
        pickle.loads(pickle.dumps(factory))
        same = factory().id == codec.id
    except Exception as e:  # noqa: BLE001 - any codec that cannot cross stays on threads
        log.info("codec %s cannot be sent to encode processes (%s): storing on threads", name, e)
        return None
    return factory if same else None


def worker_spec(
    prefix_cache: Any, store_url: str | None, threads: int, nice: int, cpus: tuple[int, ...] | None = None
) -> WorkerSpec | None:
    """The WorkerSpec of an engine's PrefixCache, or None where its stores cannot be encoded in
    another process (no store URL, a process-local store, tensor-parallel shards, layer groups).
    cpus: the CPUs the workers are pinned to (None: not pinned)."""
    from kvcodec.fetcher import PrefixCache

    if not store_url or type(prefix_cache) is not PrefixCache or prefix_cache.shard is not None:
        return None
    if "://" in store_url and store_url.split("://", 1)[0].lower() in LOCAL_SCHEMES:
        return None
    factory = portable_codec(prefix_cache.codec)
    if factory is None:
        return None
    base = os.getpriority(os.PRIO_PROCESS, os.getpid()) if hasattr(os, "getpriority") else 0
    return WorkerSpec(
        store_url,
        prefix_cache.model_id,
        factory,
        store_partial=prefix_cache.store_partial,
        namespace=prefix_cache.namespace,
        threads=max(1, threads),
        niceness=min(19, base + max(0, nice)),
        cpus=tuple(cpus) if cpus else None,
    )


# -- shared buffers (serving process) ------------------------------------------------------------
class SharedBuffer:
    """A shared-memory block the storer copies one store's KV into; pinned for CUDA copies."""

    def __init__(self, nbytes: int) -> None:
        self.nbytes = max(BUFFER_ALIGN, -(-int(nbytes) // BUFFER_ALIGN) * BUFFER_ALIGN)
        self.shm = shared_memory.SharedMemory(create=True, size=self.nbytes)
        self.bytes = torch.frombuffer(self.shm.buf, dtype=torch.uint8, count=self.nbytes)
        self.pinned = False

    @property
    def name(self) -> str:
        return self.shm.name

    def view(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        n = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
        return self.bytes[:n].view(dtype).view(shape)

    def pin(self) -> None:
        """Register the block with CUDA (page-locked): device-to-host copies into it are DMA."""
        if self.pinned or not torch.cuda.is_available():
            return
        rc = torch.cuda.cudart().cudaHostRegister(self.bytes.data_ptr(), self.nbytes, 0)
        self.pinned = int(rc) == 0

    def close(self) -> None:
        if self.pinned:
            torch.cuda.cudart().cudaHostUnregister(self.bytes.data_ptr())
            self.pinned = False
        del self.bytes
        with contextlib.suppress(BufferError):  # a view still alive: unmapped at exit
            self.shm.close()
        self.shm.unlink()


class BufferPool:
    """At most `limit` SharedBuffers, reused: acquire waits while all are in use."""

    def __init__(self, limit: int) -> None:
        self.limit = max(1, limit)
        self._free: list[SharedBuffer] = []
        self._count = 0
        self._closed = False
        self._cond = threading.Condition()

    def acquire(self, nbytes: int) -> SharedBuffer:
        with self._cond:
            while True:
                fits = [b for b in self._free if b.nbytes >= nbytes]
                if fits:
                    buf = min(fits, key=lambda b: b.nbytes)
                    self._free.remove(buf)
                    return buf
                if self._count < self.limit:
                    self._count += 1
                    break
                if self._free:  # every free one is too small: replace the smallest
                    small = min(self._free, key=lambda b: b.nbytes)
                    self._free.remove(small)
                    small.close()
                    break
                self._cond.wait()
        try:
            return SharedBuffer(nbytes)
        except BaseException:
            with self._cond:
                self._count -= 1
                self._cond.notify()
            raise

    def reserve(self, nbytes: int, pin: bool = False) -> int:
        """Make every buffer not made yet (up to the limit) now, of at least `nbytes`, pinned with
        `pin`, and leave them free: the pool's first store pays for their shared memory and CUDA
        page-locking, not later stores running beside requests. Returns how many were made."""
        with self._cond:
            want = self.limit - self._count
            self._count += want
        made: list[SharedBuffer] = []
        try:
            for _ in range(want):
                made.append(SharedBuffer(nbytes))
                if pin:
                    made[-1].pin()
        finally:
            with self._cond:
                self._count -= want - len(made)
                self._free.extend(made)
                self._cond.notify_all()
        return len(made)

    def release(self, buf: SharedBuffer) -> None:
        with self._cond:
            if not self._closed:
                self._free.append(buf)
                self._cond.notify()
                return
            self._count -= 1
        buf.close()  # in use while the pool closed

    def close(self) -> None:
        """Free the buffers now, and the ones in use as they come back."""
        with self._cond:
            free, self._free, self._closed = self._free, [], True
            self._count -= len(free)
        for b in free:
            b.close()


class EncodePool:
    """`processes` spawned encode workers and the shared buffers their stores travel in.

    put(ids, kv) blocks the calling (storer) thread until a worker has encoded and written the
    store: call it from as many threads as there are processes."""

    def __init__(self, spec: WorkerSpec, processes: int) -> None:
        self.spec, self.processes = spec, max(1, processes)
        self.buffers = BufferPool(self.processes)
        weakref.finalize(self, self.buffers.close)  # an engine never closed: its shared memory is freed at exit
        self._decided = threading.Event()  # the first store is done (its coding decisions on disk)
        self._first = threading.Lock()
        ctx = multiprocessing.get_context("spawn")
        self._executor = ProcessPoolExecutor(
            self.processes, mp_context=ctx, initializer=_init_worker, initargs=(spec, ctx.Barrier(self.processes))
        )

    def start(self) -> list[Any]:
        """Start every worker now (each builds the codec, pins itself and opens the store, or does so on its
        first store where the store is down now):
        futures of their pids, one per worker (each answers once all of them are up)."""
        with interrupts_blocked():
            return [self._running().submit(_worker_pid) for _ in range(self.processes)]

    def _running(self) -> ProcessPoolExecutor:
        if self._executor is None:
            raise RuntimeError("the encode pool is shut down")  # as a shut-down executor's submit says
        return self._executor

    def pids(self) -> tuple[int, ...]:
        """The worker processes' ids (none before the first submit spawns them)."""
        try:
            return tuple(getattr(self._executor, "_processes", None) or ())
        except RuntimeError:  # the executor changed its table meanwhile (a worker died): next time
            return ()

    def put(self, ids: list[int], kv: torch.Tensor) -> tuple[int, int]:
        """(chunks written, worker pid): `kv` (on a GPU on the caller's current stream, or on the
        CPU) copied into a shared buffer, encoded and written by a worker.

        The pool's first store runs alone: its worker makes the per-model coding decisions (trial
        encodes, kept in the plan cache file) that the others then read, instead of each process
        deciding on its own first chunk (stored bytes that depend on which document came first);
        it also makes (and pins, for CUDA KV) the shared buffers of all processes. A first store that
        fails (a store that is down fails before anything is coded) leaves that to the next store."""
        if not self._decided.is_set():
            with self._first:
                if not self._decided.is_set():
                    self.buffers.reserve(kv.numel() * kv.element_size(), pin=kv.is_cuda)
                    written = self._put(ids, kv)
                    self._decided.set()
                    return written
        return self._put(ids, kv)

    def _put(self, ids: list[int], kv: torch.Tensor) -> tuple[int, int]:
        kv = kv.contiguous()
        shape, dtype = tuple(kv.shape), str(kv.dtype).removeprefix("torch.")
        buf = self.buffers.acquire(kv.numel() * kv.element_size())
        try:
            host = buf.view(shape, kv.dtype)
            if kv.is_cuda:
                buf.pin()
                host.copy_(kv, non_blocking=buf.pinned)
                torch.cuda.current_stream(kv.device).synchronize()
            else:
                host.copy_(kv)
            del host, kv
            try:  # the pool's own failures, not the encode's errors
                with interrupts_blocked():  # a submit may spawn a worker
                    future = self._running().submit(_encode, list(ids), buf.name, shape, dtype)
            except (BrokenProcessPool, OSError, RuntimeError) as e:  # broken, cannot spawn, shut down
                raise EncodeProcessError(f"{type(e).__name__}: {e}") from e
            try:
                return future.result()
            except BrokenProcessPool as e:
                raise EncodeProcessError(f"{type(e).__name__}: {e}") from e
        finally:
            self.buffers.release(buf)

    def shutdown(self, wait: bool = True) -> None:
        """wait=False cancels the stores not begun. The workers are joined and the executor let go
        of either way: its start barrier's semaphores are unlinked now, not left to exit handlers (a process
        that ends by a signal runs none: they were 'leaked semaphore objects')."""
        executor, self._executor = self._executor, None
        if executor is not None:
            executor.shutdown(wait=True, cancel_futures=not wait)
        self.buffers.close()


@contextlib.contextmanager
def interrupts_blocked():  # noqa: ANN201 - a context manager
    """SIGINT blocked on the calling thread for the block, so that a worker spawned in it starts
    with SIGINT blocked (a signal mask survives fork and exec) until _init_worker ignores it.

    A Ctrl-C at a terminal reaches every process of the foreground group: workers would die with a
    KeyboardInterrupt (tracebacks from a half-done import, a store cut short, a broken pool) while
    the parent, which owns the interrupt, lets the stores in flight finish and shuts the pool down."""
    if not hasattr(signal, "pthread_sigmask"):
        yield
        return
    old = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, old)


def _ignore_interrupts() -> None:
    """A worker leaves interrupts to its parent (see interrupts_blocked); a SIGINT pending since
    its spawn is discarded once ignored."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    if hasattr(signal, "pthread_sigmask"):
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})


# -- worker process ------------------------------------------------------------------------------
_STATE: dict[str, Any] = {}
_ATTACHED: collections.OrderedDict[str, shared_memory.SharedMemory] = collections.OrderedDict()
MAX_ATTACHED = 4
PARENT_POLL_S = 0.5  # how often a worker checks that its parent still runs


def _init_worker(spec: WorkerSpec, started: Any = None) -> None:
    from kvcodec.codecs.hevc.encode import Background

    _ignore_interrupts()
    os.environ["CUDA_VISIBLE_DEVICES"] = ""  # CPU only: no CUDA context (memory, NVENC probe) per worker
    if hasattr(os, "setpriority"):
        try:
            if os.getpriority(os.PRIO_PROCESS, 0) < spec.niceness:
                os.setpriority(os.PRIO_PROCESS, 0, spec.niceness)
        except OSError:  # pragma: no cover - sandboxes that forbid it
            pass
    torch.set_num_threads(1)  # chunk threads are the parallelism; no torch pool per thread
    if spec.cpus:
        pin_process(spec.cpus)
    parent = os.getppid()
    threading.Thread(target=_exit_with, args=(parent,), name="kvcodec-parent-watch", daemon=True).start()
    _STATE.update(spec=spec, codec=spec.codec(), background=Background(spec.threads, 0), started=started)
    try:
        _cache()
    except StoreError as e:  # a store that is down now fails this worker's stores, not the pool
        log.warning("encode worker %d cannot open its store yet (%s): it tries again on each store", os.getpid(), e)


def _cache() -> Any:
    """The worker's PrefixCache, its store opened on first use (and again after a failed open)."""
    from kvcodec.fetcher import PrefixCache
    from kvcodec.store import open_store

    cache = _STATE.get("cache")
    if cache is None:
        spec = _STATE["spec"]
        store = open_store(spec.store_url)
        cache = PrefixCache(
            store, spec.model_id, _STATE["codec"], "cpu", store_partial=spec.store_partial, namespace=spec.namespace
        )
        _STATE["cache"] = cache
    return cache


def pin_process(cpus: tuple[int, ...]) -> bool:
    """Run every thread of this process (and the threads it starts later) on `cpus` only; True
    when done, False where the OS has no CPU affinity or refuses it (then nothing changes)."""
    if not hasattr(os, "sched_setaffinity"):
        return False
    try:
        tids = [int(t) for t in os.listdir("/proc/self/task")]
    except OSError:  # no /proc: the calling thread (the threads it starts inherit it)
        tids = [0]
    try:
        for tid in tids:
            with contextlib.suppress(ProcessLookupError):  # a thread that ended meanwhile
                os.sched_setaffinity(tid, cpus)
    except OSError as e:
        log.info("cannot pin the encode worker to CPUs %s: %s", cpus, e)
        return False
    return True


def _exit_with(parent: int) -> None:
    """End this worker soon after the process that spawned it ends (killed, say): a pool's
    workers outlive a killed parent otherwise, holding its inherited pipes (stdout) open."""
    while os.getppid() == parent:
        time.sleep(PARENT_POLL_S)
    os._exit(0)


START_WAIT_S = 600.0  # how long a worker's start waits for the others'


def _worker_pid() -> int:
    """This worker's pid, once every worker of the pool has taken one such call (so that the
    pool's start calls reach each worker once, never one worker twice)."""
    barrier = _STATE.get("started")
    if barrier is not None:
        barrier.wait(START_WAIT_S)
    return os.getpid()


def _attach(name: str) -> shared_memory.SharedMemory:
    shm = _ATTACHED.pop(name, None) or shared_memory.SharedMemory(name=name)
    _ATTACHED[name] = shm
    while len(_ATTACHED) > MAX_ATTACHED:  # buffers the storer replaced by larger ones
        _, old = _ATTACHED.popitem(last=False)
        try:
            old.close()
        except BufferError:  # pragma: no cover - still viewed
            pass
    return shm


def _encode(ids: list[int], name: str, shape: tuple[int, ...], dtype: str) -> tuple[int, int]:
    from kvcodec.codecs.hevc.encode import background

    dt = getattr(torch, dtype)
    kv = torch.frombuffer(_attach(name).buf, dtype=dt, count=math.prod(shape)).view(shape)
    try:
        with background(_STATE["background"]):
            return int(_cache().put(ids, kv) or 0), os.getpid()
    except Exception as e:
        raise _crossing(e) from None
    finally:
        del kv


def _crossing(e: Exception) -> Exception:
    """`e` where it survives pickling (the storer reports it as it is), else an EncodeWorkerError
    naming it: an error the parent cannot rebuild must not break the pool."""
    try:
        pickle.loads(pickle.dumps(e))
        return e
    except Exception:  # noqa: BLE001
        return EncodeWorkerError(f"{type(e).__name__}: {e}")
