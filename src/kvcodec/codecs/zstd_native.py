"""zstd streams decompressed on native threads: a fetch's host work without the interpreter lock.

A driven fetch decompresses its zstd-coded chunks' samples on host threads. On Python threads each
chunk crosses the interpreter lock several times (the pool's queue, the checks, the buffer, the
decompressor's loop), and with eight chunks at once the threads start one after another: a 2048-token
Qwen2.5 fetch on an H100 machine began its eighth chunk's zstd 1 ms after its first, and in another fetch
three threads took two chunks each while three stayed idle
(benchmarks/results/fetch-h100-s60-phases-qwen.md). Here the chunk's frames are found and checked on the
caller's thread (zstd_streams.frame_spans), then decompressed by C threads (SOURCE, compiled at first
use: kvcodec.native) straight into the caller's buffer, calling the system's libzstd through pointers
handed over by ctypes: the jobs in the order submitted. A thread reads a stream's frames in order until
they are all handed out; a free thread starts a stream no thread reads, else helps the oldest one with
frames left. kvcodec writes one frame a chunk: 512 KiB frames, each on whichever thread was free, cost a
bf16 matmul beside a 32k fetch 1.4-3.7 more points, why not measured
(benchmarks/results/fetch-h100-s62-frames.md); threads stay with a stream of their own since. Helper threads
that read only other streams' frames, at a fetch's end, fetched 2048 tokens no faster
(benchmarks/results/fetch-h100-s74-helpers.md).
One Python thread turns each finished job into its Future's result. Where the caller asks, the stream's
checksum (the container's CRC-32: ISA-L's, the isal package's, else zlib's) is checked by one thread
before any of its frames is handed out.

Where it cannot run (KVCODEC_NATIVE=0, no C compiler, no libzstd, no CRC-32 of ISA-L or zlib),
`threads()` is None and the caller keeps zstd_streams.unzstd_into on its Python pool: the reference the
tests compare with.
"""

from __future__ import annotations

import atexit
import ctypes
import ctypes.util
import dataclasses
import logging
import os
import threading
from collections.abc import Callable
from concurrent.futures import Future
from ctypes import c_int, c_longlong, c_size_t, c_void_p

import numpy as np

from kvcodec import native
from kvcodec.codecs.zstd_streams import frame_spans
from kvcodec.container.format import crc32
from kvcodec.errors import CorruptStreamError, KVCodecError

log = logging.getLogger(__name__)

SOURCE = r"""
#include <errno.h>
#include <pthread.h>
#include <stdlib.h>
#include <time.h>

typedef void *(*create_fn)(void);
typedef size_t (*decompress_fn)(void *, void *, size_t, const void *, size_t);
typedef unsigned (*is_error_fn)(size_t);
typedef size_t (*free_fn)(void *);
typedef unsigned (*isal_crc_fn)(unsigned, const unsigned char *, unsigned long long);  /* crc32_gzip_refl */
typedef unsigned long (*zlib_crc_fn)(unsigned long, const unsigned char *, unsigned);

typedef struct { const void *src; size_t src_len; void *dst; size_t dst_len; } frame;

/* status: 0 every frame filled its output exactly; 1 frame `at` failed (value: zstd's error
   code); 2 frame `at` held `value` bytes; 3 no decompression context for frame `at` (out of memory); 4 the
   stream's CRC-32 (zlib's polynomial and convention) is not `crc` (nothing decompressed).
   Jobs are queued in order; once a job's checksum (where asked) has passed, its frames are handed
   out in order, one at a time. A thread stays with its job until the job's frames are all handed
   out; a free thread checks or starts a job that no thread reads, else helps the oldest job with
   frames left (streams queued before threads come free each get one of their own; a fetch's last
   streams get every free thread). Of several failing frames, `at` is the first: the one reading them in order
   finds. */
typedef struct job {
    struct job *next;
    const frame *frames;
    int count, status, at;
    size_t value;
    const unsigned char *stream;
    size_t stream_len;
    unsigned crc;
    int check;
    int taken, left, checked;  /* the pool's: frames handed out, frames not done, 0/1/2 unchecked/checking/passed */
    long long began_ns, ended_ns;  /* CLOCK_MONOTONIC (Python's time.perf_counter) when a thread took it, when it ended */
} job;

typedef struct {
    pthread_mutex_t mu;
    pthread_cond_t work, done;
    job *head, *tail, *done_head, *done_tail;
    int stop, joined, started;
    pthread_t *threads;
    create_fn create; decompress_fn decompress; is_error_fn is_error; free_fn release;
    void *crc; int crc_isal;  /* ISA-L's crc32_gzip_refl (about 15x zlib's), else zlib's crc32 */
} pool;

static void push(job **head, job **tail, job *j) {
    j->next = NULL;
    if (*tail) (*tail)->next = j; else *head = j;
    *tail = j;
}

static job *pop(job **head, job **tail) {
    job *j = *head;
    if (j) { *head = j->next; if (!*head) *tail = NULL; }
    return j;
}

static unsigned crc_of(pool *p, const unsigned char *at, size_t len) {
    if (p->crc_isal) return ((isal_crc_fn)p->crc)(0, at, len);
    zlib_crc_fn crc32 = (zlib_crc_fn)p->crc;
    unsigned long crc = crc32(0, NULL, 0);
    for (size_t step; len; at += step, len -= step) {
        step = len < (1u << 30) ? len : (1u << 30);
        crc = crc32(crc, at, (unsigned)step);
    }
    return (unsigned)(crc & 0xFFFFFFFFul);
}

static long long now_ns(void) {
    struct timespec t;
    clock_gettime(CLOCK_MONOTONIC, &t);
    return t.tv_sec * 1000000000LL + t.tv_nsec;
}

static void began(job *j) {  /* under the lock */
    if (!j->began_ns) j->began_ns = now_ns();
}

static void finished(pool *p, job *j) {  /* under the lock */
    j->ended_ns = now_ns();
    push(&p->done_head, &p->done_tail, j);
    pthread_cond_signal(&p->done);
}

static void unqueue(pool *p, job *j) {  /* under the lock */
    job *prev = NULL;
    for (job *at = p->head; at != j; at = at->next) prev = at;
    if (prev) prev->next = j->next; else p->head = j->next;
    if (p->tail == j) p->tail = prev;
    if (!p->head && p->stop) pthread_cond_broadcast(&p->work);  /* stopping: the waiting threads end */
}

/* The work a free thread takes: the first job with an unchecked checksum or with no frame handed out,
   else the first job with frames left (a job being checked is passed over). A queued job with frames
   handed out has a thread reading on: the one that took its last frame keeps it while it has more. */
static job *work_of(pool *p) {
    job *help = NULL;
    for (job *j = p->head; j; j = j->next) {
        if (j->check && j->checked == 1) continue;
        if ((j->check && !j->checked) || !j->taken) return j;
        if (!help) help = j;
    }
    return help;
}

/* The job's checksum (entered and left under the lock, released meanwhile): the job if it passed and
   has frames, for this thread to read on; else NULL, the job finished. */
static job *check(pool *p, job *j) {
    j->checked = 1;
    began(j);
    pthread_mutex_unlock(&p->mu);
    int ok = crc_of(p, j->stream, j->stream_len) == j->crc;
    pthread_mutex_lock(&p->mu);
    if (!ok || !j->count) {
        if (!ok) j->status = 4;
        unqueue(p, j);
        finished(p, j);
        return NULL;
    }
    j->checked = 2;  /* the others are woken to help with the rest */
    if (j->count > 1) pthread_cond_broadcast(&p->work);
    return j;
}

/* The job's next frame (entered and left under the lock): the job if it has frames left to hand
   out, for this thread to read on; else NULL (it may be finished). */
static job *run_frame(pool *p, void **dctx, job *j) {
    int i = j->taken++, status = 0, skip = j->status != 0;  /* a frame after one that failed: not read */
    began(j);
    size_t value = 0;
    if (j->taken == j->count) unqueue(p, j);
    pthread_mutex_unlock(&p->mu);
    if (!*dctx) *dctx = p->create();  /* a context that could not be had is asked for again */
    if (!skip) {
        const frame *f = &j->frames[i];
        size_t got = *dctx ? p->decompress(*dctx, f->dst, f->dst_len, f->src, f->src_len) : 0;
        if (!*dctx) status = 3;
        else if (p->is_error(got) || got != f->dst_len) { status = p->is_error(got) ? 1 : 2; value = got; }
    }
    pthread_mutex_lock(&p->mu);
    if (status && (!j->status || i < j->at)) { j->status = status; j->at = i; j->value = value; }
    int more = j->taken < j->count;
    if (--j->left == 0) finished(p, j);
    return more ? j : NULL;
}

static void *worker(void *arg) {
    pool *p = arg;
    void *dctx = p->create();
    pthread_mutex_lock(&p->mu);
    for (job *mine = NULL;;) {  /* mine: the job this thread reads on */
        job *j = mine ? mine : work_of(p);
        if (!j) {
            if (p->stop && !p->head) break;
            pthread_cond_wait(&p->work, &p->mu);
            continue;
        }
        mine = j->check && !j->checked ? check(p, j) : run_frame(p, &dctx, j);
    }
    pthread_mutex_unlock(&p->mu);
    if (dctx) p->release(dctx);
    return NULL;
}

void *kv_zpool_start(int threads, void *create, void *decompress, void *is_error, void *release, void *crc, int crc_isal) {
    pool *p = calloc(1, sizeof(pool));
    if (!p || threads < 1) { free(p); return NULL; }
    p->threads = calloc((size_t)threads, sizeof(pthread_t));
    if (!p->threads) { free(p); return NULL; }
    pthread_mutex_init(&p->mu, NULL);
    pthread_cond_init(&p->work, NULL);
    pthread_cond_init(&p->done, NULL);
    p->create = (create_fn)create; p->decompress = (decompress_fn)decompress;
    p->is_error = (is_error_fn)is_error; p->release = (free_fn)release; p->crc = crc; p->crc_isal = crc_isal;
    for (int i = 0; i < threads && pthread_create(&p->threads[i], NULL, worker, p) == 0; i++) p->started++;
    if (!p->started) { free(p->threads); free(p); return NULL; }
    return p;
}

int kv_zpool_threads(void *handle) { return ((pool *)handle)->started; }

void kv_zpool_submit(void *handle, job *j) {
    pool *p = handle;
    j->status = 0; j->at = 0; j->taken = 0; j->left = j->count; j->checked = 0; j->began_ns = j->ended_ns = 0;
    pthread_mutex_lock(&p->mu);
    if (!j->check && !j->count) finished(p, j);
    else {
        push(&p->head, &p->tail, j);
        if (j->check || j->count == 1) pthread_cond_signal(&p->work); else pthread_cond_broadcast(&p->work);
    }
    pthread_mutex_unlock(&p->mu);
}

/* The next finished job, or NULL once timeout_us passed (or the pool is stopped and drained). */
job *kv_zpool_next_done(void *handle, long long timeout_us) {
    pool *p = handle;
    struct timespec until;
    clock_gettime(CLOCK_REALTIME, &until);
    until.tv_sec += timeout_us / 1000000;
    until.tv_nsec += (timeout_us % 1000000) * 1000;
    if (until.tv_nsec >= 1000000000L) { until.tv_sec += 1; until.tv_nsec -= 1000000000L; }
    pthread_mutex_lock(&p->mu);
    while (!p->done_head && !p->joined)
        if (pthread_cond_timedwait(&p->done, &p->mu, &until) == ETIMEDOUT) break;
    job *j = pop(&p->done_head, &p->done_tail);
    pthread_mutex_unlock(&p->mu);
    return j;
}

/* Queued jobs run to the end, then the threads exit and are joined. */
void kv_zpool_stop(void *handle) {
    pool *p = handle;
    pthread_mutex_lock(&p->mu);
    p->stop = 1;
    pthread_cond_broadcast(&p->work);
    pthread_mutex_unlock(&p->mu);
    for (int i = 0; i < p->started; i++) pthread_join(p->threads[i], NULL);
    pthread_mutex_lock(&p->mu);
    p->joined = 1;
    pthread_cond_broadcast(&p->done);
    pthread_mutex_unlock(&p->mu);
}
"""

SIGNATURES: dict[str, tuple[type | None, list[type]]] = {
    "kv_zpool_start": (c_void_p, [c_int, c_void_p, c_void_p, c_void_p, c_void_p, c_void_p, c_int]),
    "kv_zpool_threads": (c_int, [c_void_p]),
    "kv_zpool_submit": (None, [c_void_p, c_void_p]),
    "kv_zpool_next_done": (c_void_p, [c_void_p, c_longlong]),
    "kv_zpool_stop": (None, [c_void_p]),
}
ZSTD_SIGNATURES: dict[str, tuple[type | None, list[type]]] = {
    "ZSTD_createDCtx": (c_void_p, []),
    "ZSTD_decompressDCtx": (c_size_t, [c_void_p, c_void_p, c_size_t, c_void_p, c_size_t]),
    "ZSTD_isError": (ctypes.c_uint, [c_size_t]),
    "ZSTD_freeDCtx": (c_size_t, [c_void_p]),
    "ZSTD_getErrorName": (ctypes.c_char_p, [c_size_t]),
}
ZLIB_SIGNATURES: dict[str, tuple[type | None, list[type]]] = {
    "crc32": (ctypes.c_ulong, [ctypes.c_ulong, c_void_p, ctypes.c_uint]),
}
ISAL_SIGNATURES: dict[str, tuple[type | None, list[type]]] = {
    "crc32_gzip_refl": (ctypes.c_uint32, [ctypes.c_uint32, c_void_p, ctypes.c_uint64]),
}
OK, FAILED, SIZE, NO_CONTEXT, CHECKSUM = 0, 1, 2, 3, 4
# The collecting thread's longest wait: it wakes for each finished job and at stop (kv_zpool_stop wakes it once
# the threads are joined), not on a clock, so an idle process's thread sleeps.
_COLLECT_WAIT_US = 3_600_000_000


class _Frame(ctypes.Structure):
    _fields_ = [("src", c_void_p), ("src_len", c_size_t), ("dst", c_void_p), ("dst_len", c_size_t)]


class _Job(ctypes.Structure):
    _fields_ = [
        ("next", c_void_p),
        ("frames", c_void_p),
        ("count", c_int),
        ("status", c_int),
        ("at", c_int),
        ("value", c_size_t),
        ("stream", c_void_p),
        ("stream_len", c_size_t),
        ("crc", ctypes.c_uint),
        ("check", c_int),
        ("taken", c_int),
        ("left", c_int),
        ("checked", c_int),
        ("began_ns", c_longlong),
        ("ended_ns", c_longlong),
    ]


@dataclasses.dataclass(eq=False)
class _Pending:
    """A submitted job and everything the C threads read or write, alive until it is done."""

    job: _Job
    frames: ctypes.Array
    source: np.ndarray
    out: np.ndarray
    spans: list
    name: str
    future: Future
    then: Callable[[], object] | None
    bad_checksum: Callable[[], Exception] | None


class ZstdThreads:
    """Native threads decompressing zstd streams into caller buffers; submit() returns a Future."""

    def __init__(self, lib, zstd, crc: tuple, threads: int):
        """crc: (a ctypes CRC-32 function, whether it is ISA-L's crc32_gzip_refl rather than zlib's crc32)."""
        self.lib, self.zstd, self.crc = lib, zstd, crc
        fns = [zstd.ZSTD_createDCtx, zstd.ZSTD_decompressDCtx, zstd.ZSTD_isError, zstd.ZSTD_freeDCtx, crc[0]]
        self.handle = lib.kv_zpool_start(threads, *(native.function_pointer(f) for f in fns), int(crc[1]))
        if not self.handle:
            raise OSError("the native zstd threads did not start")
        self.threads = lib.kv_zpool_threads(self.handle)
        self.pid = os.getpid()  # a forked child has none of these threads
        self._live: dict[int, _Pending] = {}
        self._lock = threading.Lock()
        self._stopped = False
        self._collector = threading.Thread(target=self._collect, name="kvcodec-zstd-done", daemon=True)
        self._collector.start()

    def submit(
        self,
        data,
        out: np.ndarray,
        name: str,
        then: Callable[[], object] | None = None,
        checksum: tuple[int, Callable[[], Exception]] | None = None,
    ) -> Future:
        """Decompress `data` (a stream as unzstd_into reads it) into `out` (a contiguous uint8 array
        that it must fill exactly): a Future of then() (None without it), or of the CorruptStreamError
        that says why the stream does not hold out.nbytes bytes. checksum: (the stream's CRC-32, the
        error where its bytes have another): checked first, nothing decompressed on a mismatch. The
        Future cannot be cancelled: the threads write into `out` until it is done."""
        if out.dtype != np.uint8 or not out.flags.c_contiguous or not out.flags.writeable:
            raise ValueError(f"the output must be a writable contiguous uint8 array, got {out.dtype} {out.flags}")
        future: Future = Future()
        future.set_running_or_notify_cancel()
        try:
            spans = frame_spans(data, out.nbytes, name)
        except KVCodecError as e:  # damage in transit is the checksum's error, as where it is checked first
            damaged = checksum is not None and crc32(memoryview(data).cast("B")) != checksum[0]
            future.set_exception(checksum[1]() if damaged else e)
            return future
        source = np.frombuffer(data, dtype=np.uint8)  # the stream's address, read-only bytes included
        frames = (_Frame * max(1, len(spans)))()
        for k, (_, s) in enumerate(spans):
            frames[k] = _Frame(
                source.ctypes.data + s.start, s.end - s.start, out.ctypes.data + s.out_start, s.out_end - s.out_start
            )
        crc, bad_checksum = checksum if checksum is not None else (0, None)
        job = _Job(None, ctypes.addressof(frames), len(spans), OK, 0, 0, source.ctypes.data, source.size, crc)
        job.check = checksum is not None
        pending = _Pending(job, frames, source, out, spans, name, future, then, bad_checksum)
        with self._lock:  # submitted before a stop() joins the threads, or refused
            if self._stopped:
                raise RuntimeError("the native zstd threads are stopped")
            self._live[ctypes.addressof(job)] = pending
            self.lib.kv_zpool_submit(self.handle, ctypes.addressof(job))
        return future

    def stop(self) -> None:
        """Let the queued jobs finish, then end the threads (at exit: nothing writes into freed memory)."""
        if os.getpid() != self.pid:
            return
        with self._lock:
            if self._stopped:
                return
            self._stopped = True
        self.lib.kv_zpool_stop(self.handle)
        self._collector.join(timeout=5.0)

    def _collect(self) -> None:
        while True:
            address = self.lib.kv_zpool_next_done(self.handle, _COLLECT_WAIT_US)
            if address is None:
                with self._lock:
                    if self._stopped and not self._live:
                        return
                continue
            with self._lock:
                pending = self._live.pop(address)
            _settle(pending, self.zstd)


def _settle(p: _Pending, zstd) -> None:
    """The job's Future: then()'s result, or the error the job ended with."""
    if p.job.status != OK:
        p.future.set_exception(_error(p, zstd))
        return
    try:
        p.future.set_result(p.then() if p.then is not None else None)
    except Exception as e:  # noqa: BLE001 - then()'s failure is the job's
        p.future.set_exception(e)


def _error(p: _Pending, zstd) -> Exception:
    """The job's failure in the words of unzstd_into and host_samples for the same stream."""
    job, name = p.job, p.name
    if job.status == CHECKSUM:
        return p.bad_checksum()
    if job.status == NO_CONTEXT:
        return CorruptStreamError(f"stream {name!r}: no zstd decompression context (out of memory)")
    index, span = p.spans[job.at]
    want = span.out_end - span.out_start
    one_frame = len(p.spans) == 1 and span.start == 0 and span.end == p.source.size
    if job.status == FAILED:
        reason = zstd.ZSTD_getErrorName(job.value).decode(errors="replace")
        if one_frame and "too small" in reason:  # the frame holds more than the stream's output
            return CorruptStreamError(f"stream {name!r} holds more than {want} bytes, expected {want}")
        return CorruptStreamError(f"stream {name!r} does not decompress: {reason}")
    if one_frame:
        return CorruptStreamError(f"stream {name!r} holds {job.value} bytes, expected {want}")
    return CorruptStreamError(f"stream {name!r}: frame {index} holds {job.value} bytes, its table entry {want}")


def _system_library(name: str, candidates: tuple[str, ...], signatures: dict):  # noqa: ANN202 - a CDLL or None
    for candidate in (ctypes.util.find_library(name), *candidates):
        if not candidate:
            continue
        try:
            return native.declare(ctypes.CDLL(candidate), signatures)
        except (OSError, AttributeError):
            continue
    return None


def system_zstd():  # noqa: ANN201 - a CDLL or None
    """The system's libzstd, its functions declared; None where there is none."""
    return _system_library("zstd", ("libzstd.so.1", "libzstd.dylib"), ZSTD_SIGNATURES)


def _crc32() -> tuple | None:
    """(CRC-32 function, is ISA-L's): ISA-L's from the isal package's extension (the container's
    checksum, about 15x zlib's on a chunk's streams), else the system zlib's; None without either."""
    try:
        from isal import isal_zlib

        return native.declare(ctypes.CDLL(isal_zlib.__file__), ISAL_SIGNATURES).crc32_gzip_refl, True
    except (ImportError, OSError, AttributeError):
        zlib = _system_library("z", ("libz.so.1", "libz.dylib"), ZLIB_SIGNATURES)
        return None if zlib is None else (zlib.crc32, False)


def start(count: int) -> ZstdThreads | None:
    """`count` native zstd threads, or None where they cannot run here (a reason logged)."""
    if not native.ENABLED:
        return None
    zstd = system_zstd()
    crc = _crc32()
    if zstd is None or crc is None:
        log.info("no libzstd or no CRC-32 (ISA-L, zlib): zstd streams are decompressed on Python threads")
        return None
    path = native.build("zstd_pool", SOURCE)
    if path is None:
        return None
    try:
        return ZstdThreads(native.declare(ctypes.CDLL(str(path)), SIGNATURES), zstd, crc, count)
    except OSError as e:
        log.warning("the native zstd threads did not start (%s): zstd stays on Python threads", e)
        return None


_threads: ZstdThreads | None = None
_tried = False
_lock = threading.Lock()


def threads(count: Callable[[], int]) -> ZstdThreads | None:
    """The process's native zstd threads (count() of them), started on first use and stopped at
    exit; None where they cannot run here (tried once)."""
    global _threads, _tried
    with _lock:
        if not _tried:
            n = count()  # a bad setting raises here, every time it is asked
            _tried = True
            _threads = start(n)
            if _threads is not None:
                atexit.register(_threads.stop)
        return _threads


def _forget_in_child() -> None:
    """A forked child has none of its parent's threads: it starts its own on first use."""
    global _threads, _tried, _lock
    if _threads is not None:
        atexit.unregister(_threads.stop)
    _threads, _tried, _lock = None, False, threading.Lock()


os.register_at_fork(after_in_child=_forget_in_child)
