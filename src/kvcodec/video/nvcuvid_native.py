"""The per-picture half of the nvcuvid backend in C: the parser's decode and display callbacks.

With Python callbacks every picture enters the interpreter twice (decode, display) and crosses the
interpreter lock a dozen times (ctypes calls, torch events, the frame copy), so seven decoder
threads queue on the lock instead of on NVDEC (benchmarks/results/fetch-h200-*.md profiles). Here
the two callbacks are C functions (this file's SOURCE, compiled at first use with the system C
compiler into the kvcodec cache directory, loaded with ctypes): each decoded picture is mapped,
copied straight into its stream's place in the caller's sample buffer and unmapped without the
interpreter, and the caller's thread takes the lock again only when cuvidParseVideoData returns.
The sequence callback is C too: it hands the parser the decode surfaces it was given for the last
format it saw, and calls the Python one (which makes or checks the NVDEC session) only for a format
it has not seen. The parser calls it at every stream's first sequence header after a flush, i.e. on
a feeder thread early in every fetch; in Python it waited there for the interpreter lock while the
fetch's thread ran its submits.

The GPU libraries are not linked: their functions are handed in as pointers (ctypes), so the
library builds anywhere a C compiler is. Without a compiler, or where the build fails,
`library()` returns None and the Python callbacks (nvcuvid.py) are used: they are the reference
the tests compare with.
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
from ctypes import c_int, c_longlong, c_ulonglong, c_void_p
from pathlib import Path

from kvcodec import native
from kvcodec.errors import BackendUnavailableError
from kvcodec.native import declare, function_pointer  # noqa: F401 - this module's API for its callers

log = logging.getLogger(__name__)

MAX_TARGETS = 64  # streams fed and not complete at once (a ring in the C state)
ENABLED = native.ENABLED  # False: the Python callbacks everywhere

SOURCE = r"""
#include <pthread.h>
#include <stddef.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

typedef int (*decode_fn)(void *, void *);
typedef int (*map_fn)(void *, int, unsigned long long *, unsigned int *, void *);
typedef int (*unmap_fn)(void *, unsigned long long);
typedef int (*copy_fn)(const void *, void *);
typedef int (*sync_fn)(void *);
typedef int (*sequence_fn)(void *, void *);

typedef struct {  /* CUDA_MEMCPY2D */
    size_t srcXInBytes, srcY; int srcMemoryType; const void *srcHost; unsigned long long srcDevice;
    void *srcArray; size_t srcPitch;
    size_t dstXInBytes, dstY; int dstMemoryType; void *dstHost; unsigned long long dstDevice;
    void *dstArray; size_t dstPitch;
    size_t WidthInBytes, Height;
} memcpy2d_t;

typedef struct {  /* CUVIDPARSERDISPINFO */
    int picture_index, progressive_frame, top_field_first, repeat_first_field;
    long long timestamp;
} dispinfo_t;

#define MAX_TARGETS 64

typedef struct {  /* kept in step with nvcuvid_native.State */
    void *decoder;
    void *procparams;
    void *stream;
    decode_fn decode; map_fn map; unmap_fn unmap; copy_fn copy; sync_fn sync;
    long long row_bytes, height, planes, shift;
    unsigned long long out[MAX_TARGETS];
    long long ordinal[MAX_TARGETS];
    long long frames[MAX_TARGETS];
    long long head, tail, done_in_head, completed, error, cuda_error, pictures;
    sequence_fn sequence;  /* the Python sequence callback: makes or checks the session for a format */
    long long format_bytes;  /* leading bytes of CUVIDEOFORMAT that name a format (at most 64) */
    long long surfaces;  /* what `sequence` returned for `format` (0: nothing to reuse) */
    long long sequence_calls, sequence_ns;  /* calls of `sequence`, and their time (with the wait for Python) */
    unsigned char format[64];
} state_t;

enum { OK = 0, CUDA_FAILED = 1, WRONG_STREAM = 2, NO_TARGET = 3 };

static long long now_ns(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (long long)ts.tv_sec * 1000000000LL + ts.tv_nsec;
}

int kv_sequence(void *user, void *fmt) {
    state_t *s = (state_t *)user;
    long long n = s->format_bytes;
    if (s->surfaces > 0 && n > 0 && n <= 64 && memcmp(s->format, fmt, (size_t)n) == 0) return (int)s->surfaces;
    long long t0 = now_ns();
    int r = s->sequence(user, fmt);
    s->sequence_ns += now_ns() - t0;
    s->sequence_calls++;
    s->surfaces = 0;
    if (r > 0 && n > 0 && n <= 64) { memcpy(s->format, fmt, (size_t)n); s->surfaces = r; }
    return r;
}

int kv_decode(void *user, void *pic) {
    state_t *s = (state_t *)user;
    if (s->error) return 0;
    int r = s->decode(s->decoder, pic);
    if (r) { s->error = CUDA_FAILED; s->cuda_error = r; return 0; }
    return 1;
}

static int copy_planes(state_t *s, unsigned long long src, unsigned int pitch, unsigned long long dst) {
    long long rows = (s->height + 1) & ~1LL;  /* NVDEC's planes start every align2(height) rows */
    memcpy2d_t c = {0};
    c.srcMemoryType = 2; c.dstMemoryType = 2;  /* CU_MEMORYTYPE_DEVICE */
    c.srcPitch = pitch; c.dstPitch = (size_t)s->row_bytes; c.WidthInBytes = (size_t)s->row_bytes;
    if (rows == s->height) {
        c.srcDevice = src; c.dstDevice = dst; c.Height = (size_t)(s->height * s->planes);
        return s->copy(&c, s->stream);
    }
    for (long long p = 0; p < s->planes; p++) {
        c.srcDevice = src + (unsigned long long)(p * rows * pitch);
        c.dstDevice = dst + (unsigned long long)(p * s->height * s->row_bytes);
        c.Height = (size_t)s->height;
        int r = s->copy(&c, s->stream);
        if (r) return r;
    }
    return 0;
}

int kv_display(void *user, dispinfo_t *info) {
    state_t *s = (state_t *)user;
    if (s->error) return 0;
    if (s->head == s->tail) { s->error = NO_TARGET; return 0; }
    long long k = s->head % MAX_TARGETS;
    if ((info->timestamp >> s->shift) != s->ordinal[k]) { s->error = WRONG_STREAM; return 0; }
    unsigned long long ptr = 0;
    unsigned int pitch = 0;
    int r = s->map(s->decoder, info->picture_index, &ptr, &pitch, s->procparams);
    if (r) { s->error = CUDA_FAILED; s->cuda_error = r; return 0; }
    unsigned long long frame = (unsigned long long)(s->row_bytes * s->height * s->planes);
    r = copy_planes(s, ptr, pitch, s->out[k] + (unsigned long long)s->done_in_head * frame);
    if (!r) r = s->sync(s->stream);  /* the surface is reused once unmapped */
    int u = s->unmap(s->decoder, ptr);
    if (r || u) { s->error = CUDA_FAILED; s->cuda_error = r ? r : u; return 0; }
    s->pictures++;
    if (++s->done_in_head == s->frames[k]) { s->head++; s->done_in_head = 0; s->completed++; }
    return 1;
}

/* The feeder: a thread of its own that hands the streams pushed by the caller to the parser, piece
   by piece, so NVDEC gets its next pictures while the caller's thread (Python) does its own work or
   waits for the interpreter lock. The parser's callbacks run on this thread. */

typedef int (*parse_fn)(void *, void *);
typedef int (*setctx_fn)(void *);

typedef struct {  /* CUVIDSOURCEDATAPACKET */
    unsigned long flags, payload_size; const unsigned char *payload; long long timestamp;
} packet_t;

typedef struct {
    state_t *s; void *parser; parse_fn parse; setctx_fn setctx; void *ctx;
    long long piece, submitted, fed;
    const unsigned char *ptr[MAX_TARGETS]; long long len[MAX_TARGETS]; long long ord[MAX_TARGETS];
    long long end_req, flushes;  /* flushes asked for, flushes done */
    int keep, stop, finished, parse_error, started;
    pthread_mutex_t mu; pthread_cond_t cv; pthread_t thread;
} feeder_t;

static void feeder_done(feeder_t *f, int parse_error) {
    pthread_mutex_lock(&f->mu);
    f->parse_error = parse_error; f->finished = 1;
    pthread_cond_broadcast(&f->cv);
    pthread_mutex_unlock(&f->mu);
}

static int feed(feeder_t *f, unsigned long flags, const unsigned char *p, long long n, long long stamp) {
    packet_t pk = {flags, (unsigned long)n, p, stamp};
    int r = f->parse(f->parser, &pk);
    pthread_mutex_lock(&f->mu);  /* pictures may have completed: wake the waiter */
    pthread_cond_broadcast(&f->cv);
    pthread_mutex_unlock(&f->mu);
    return r;
}

static void *feeder_main(void *arg) {
    feeder_t *f = (feeder_t *)arg;
    if (f->setctx && f->setctx(f->ctx)) { feeder_done(f, -1); return NULL; }
    for (;;) {
        pthread_mutex_lock(&f->mu);
        while (f->fed == f->submitted && f->end_req == f->flushes && !f->stop) pthread_cond_wait(&f->cv, &f->mu);
        if (f->stop) { pthread_mutex_unlock(&f->mu); feeder_done(f, 0); return NULL; }
        if (f->fed == f->submitted) {  /* end: flush the parser (the last pictures come out) */
            pthread_mutex_unlock(&f->mu);
            int r = feed(f, 0x01, NULL, 0, 0);
            if (r || f->s->error || !f->keep) { feeder_done(f, r); return NULL; }
            pthread_mutex_lock(&f->mu);  /* kept: the parser takes the next streams after its flush */
            f->flushes++;
            pthread_cond_broadcast(&f->cv);
            pthread_mutex_unlock(&f->mu);
            continue;
        }
        long long k = f->fed % MAX_TARGETS;
        const unsigned char *p = f->ptr[k];
        long long n = f->len[k], stamp = f->ord[k] << f->s->shift;
        pthread_mutex_unlock(&f->mu);
        for (long long off = 0; off < n; off += f->piece) {
            long long m = n - off < f->piece ? n - off : f->piece;
            int r = feed(f, 0x02, p + off, m, stamp);
            if (r || f->s->error) { feeder_done(f, r); return NULL; }
        }
        pthread_mutex_lock(&f->mu);
        f->fed++;
        pthread_cond_broadcast(&f->cv);
        pthread_mutex_unlock(&f->mu);
    }
}

void *kv_feeder_start(state_t *s, void *parser, void *parse, void *setctx, void *ctx, long long piece) {
    feeder_t *f = (feeder_t *)calloc(1, sizeof(feeder_t));
    if (!f) return NULL;
    f->s = s; f->parser = parser; f->parse = (parse_fn)parse; f->setctx = (setctx_fn)setctx; f->ctx = ctx;
    f->piece = piece > 0 ? piece : (1 << 18);
    pthread_mutex_init(&f->mu, NULL); pthread_cond_init(&f->cv, NULL);
    if (pthread_create(&f->thread, NULL, feeder_main, f)) {
        pthread_mutex_destroy(&f->mu); pthread_cond_destroy(&f->cv); free(f); return NULL;
    }
    f->started = 1;
    return f;
}

/* A stream to feed after those pushed before; -1 when MAX_TARGETS streams are not yet fed. */
int kv_feeder_submit(feeder_t *f, const unsigned char *p, long long n, long long ordinal) {
    pthread_mutex_lock(&f->mu);
    if (f->submitted - f->fed >= MAX_TARGETS || f->end_req > f->flushes) { pthread_mutex_unlock(&f->mu); return -1; }
    long long k = f->submitted % MAX_TARGETS;
    f->ptr[k] = p; f->len[k] = n; f->ord[k] = ordinal; f->submitted++;
    pthread_cond_broadcast(&f->cv);
    pthread_mutex_unlock(&f->mu);
    return 0;
}

/* No more streams: the parser is flushed once every stream pushed is fed (once per flush asked). */
void kv_feeder_end(feeder_t *f) {
    pthread_mutex_lock(&f->mu);
    if (f->end_req == f->flushes) f->end_req++;
    pthread_cond_broadcast(&f->cv);
    pthread_mutex_unlock(&f->mu);
}

/* The wall-clock time timeout_us from now, as pthread_cond_timedwait takes it. */
static struct timespec deadline_after(long long timeout_us) {
    struct timespec ts;
    clock_gettime(CLOCK_REALTIME, &ts);
    ts.tv_sec += timeout_us / 1000000; ts.tv_nsec += (timeout_us % 1000000) * 1000;
    if (ts.tv_nsec >= 1000000000) { ts.tv_sec++; ts.tv_nsec -= 1000000000; }
    return ts;
}

/* Wait (at most timeout_us) until `completed` streams are complete, `flushes` flushes are done or
   the feeder has finished; returns the streams complete, -1 once the feeder has finished. */
long long kv_feeder_wait_any(feeder_t *f, long long completed, long long flushes, long long timeout_us) {
    struct timespec ts = deadline_after(timeout_us);
    pthread_mutex_lock(&f->mu);
    while (f->s->completed < completed && !f->finished && !f->s->error && f->flushes < flushes)
        if (pthread_cond_timedwait(&f->cv, &f->mu, &ts)) break;
    long long done = f->finished ? -1 : f->s->completed;
    pthread_mutex_unlock(&f->mu);
    return done;
}

/* Wait (at most timeout_us) until `completed` streams are complete or the feeder has finished;
   returns the streams complete, -1 once the feeder has finished. */
long long kv_feeder_wait(feeder_t *f, long long completed, long long timeout_us) {
    return kv_feeder_wait_any(f, completed, 1LL << 62, timeout_us);
}

/* Wait (at most timeout_us) until at most `unfed` streams pushed are not yet fed (or the feeder has
   finished); returns the streams not yet fed, -1 once the feeder has finished. A stream's last
   pictures come out only once the parser has seen what follows it: a caller that waited for its
   completion before pushing more would wait for ever. */
long long kv_feeder_wait_fed(feeder_t *f, long long unfed, long long timeout_us) {
    struct timespec ts = deadline_after(timeout_us);
    pthread_mutex_lock(&f->mu);
    while (f->submitted - f->fed > unfed && !f->finished)
        if (pthread_cond_timedwait(&f->cv, &f->mu, &ts)) break;
    long long left = f->finished ? -1 : f->submitted - f->fed;
    pthread_mutex_unlock(&f->mu);
    return left;
}

/* Keep the thread and parser after each flush (call before the first kv_feeder_end): the parser
   takes more streams after its end-of-stream flush, and kv_feeder_flushed counts the flushes. */
void kv_feeder_keep(feeder_t *f) {
    pthread_mutex_lock(&f->mu);
    f->keep = 1;
    pthread_mutex_unlock(&f->mu);
}

/* Wait (at most timeout_us) until `flushes` flushes are done or the feeder has finished; returns
   the flushes done, -1 once the feeder has finished. */
long long kv_feeder_flushed(feeder_t *f, long long flushes, long long timeout_us) {
    struct timespec ts = deadline_after(timeout_us);
    pthread_mutex_lock(&f->mu);
    while (f->flushes < flushes && !f->finished)
        if (pthread_cond_timedwait(&f->cv, &f->mu, &ts)) break;
    long long done = f->finished ? -1 : f->flushes;
    pthread_mutex_unlock(&f->mu);
    return done;
}

/* Stop (unless already finished), join the thread, free; the parser's last error (0: none). */
int kv_feeder_close(feeder_t *f) {
    pthread_mutex_lock(&f->mu);
    f->stop = 1;
    pthread_cond_broadcast(&f->cv);
    pthread_mutex_unlock(&f->mu);
    pthread_join(f->thread, NULL);
    int r = f->parse_error;
    pthread_mutex_destroy(&f->mu); pthread_cond_destroy(&f->cv);
    free(f);
    return r;
}
"""


class State(ctypes.Structure):
    """The C state_t: the session, the CUDA calls and the ring of streams fed and not complete."""

    _fields_ = [
        ("decoder", c_void_p),
        ("procparams", c_void_p),
        ("stream", c_void_p),
        ("decode", c_void_p),
        ("map", c_void_p),
        ("unmap", c_void_p),
        ("copy", c_void_p),
        ("sync", c_void_p),
        ("row_bytes", c_longlong),
        ("height", c_longlong),
        ("planes", c_longlong),
        ("shift", c_longlong),
        ("out", c_ulonglong * MAX_TARGETS),
        ("ordinal", c_longlong * MAX_TARGETS),
        ("frames", c_longlong * MAX_TARGETS),
        ("head", c_longlong),
        ("tail", c_longlong),
        ("done_in_head", c_longlong),
        ("completed", c_longlong),
        ("error", c_longlong),
        ("cuda_error", c_longlong),
        ("pictures", c_longlong),
        ("sequence", c_void_p),
        ("format_bytes", c_longlong),
        ("surfaces", c_longlong),
        ("sequence_calls", c_longlong),
        ("sequence_ns", c_longlong),
        ("format", ctypes.c_ubyte * 64),
    ]

    def push(self, out_ptr: int, ordinal: int, frames: int) -> None:
        """A stream about to be fed: its pictures go to out_ptr, frame after frame."""
        if self.tail - self.head >= MAX_TARGETS:
            raise RuntimeError("more streams in flight than the native ring holds")
        k = self.tail % MAX_TARGETS
        self.out[k], self.ordinal[k], self.frames[k] = out_ptr, ordinal, frames
        self.tail += 1

    @property
    def pending(self) -> int:
        return self.tail - self.head


ERRORS = {
    1: "a CUDA call of the decode failed",
    2: "a picture came for another stream",
    3: "a picture beyond the streams",
}


# The C functions Python calls, name -> (restype, argtypes), as SOURCE defines them (a pointer is
# c_void_p). kv_sequence, kv_decode and kv_display are not called from Python: their addresses are
# the parser's callbacks (nvcuvid._NativeParser).
SIGNATURES: dict[str, tuple[type | None, list[type]]] = {
    "kv_feeder_start": (c_void_p, [c_void_p, c_void_p, c_void_p, c_void_p, c_void_p, c_longlong]),
    "kv_feeder_submit": (c_int, [c_void_p, c_void_p, c_longlong, c_longlong]),
    "kv_feeder_end": (None, [c_void_p]),
    "kv_feeder_keep": (None, [c_void_p]),
    "kv_feeder_wait": (c_longlong, [c_void_p, c_longlong, c_longlong]),
    "kv_feeder_wait_any": (c_longlong, [c_void_p, c_longlong, c_longlong, c_longlong]),
    "kv_feeder_wait_fed": (c_longlong, [c_void_p, c_longlong, c_longlong]),
    "kv_feeder_flushed": (c_longlong, [c_void_p, c_longlong, c_longlong]),
    "kv_feeder_close": (c_int, [c_void_p]),
}


def build(directory: Path | None = None) -> Path | None:
    """The compiled library (built once per SOURCE); None without a C compiler or if the build fails."""
    return native.build("nvcuvid_loop", SOURCE, directory)


@functools.cache
def library():  # noqa: ANN201 - the ctypes CDLL, or None
    """The loaded library with kv_decode and kv_display, or None (Python callbacks then)."""
    path = build()
    if path is None:
        return None
    try:
        lib = ctypes.CDLL(str(path))
    except OSError as e:
        log.warning("loading %s failed (%s): the nvcuvid callbacks stay in Python", path, e)
        return None
    return declare(lib, SIGNATURES)


def available() -> bool:
    """Whether decoders use the native callbacks (ENABLED, and the library builds and loads here)."""
    return ENABLED and library() is not None


def required():  # noqa: ANN201 - the ctypes CDLL
    """The loaded library where decoders use it (available()); BackendUnavailableError otherwise."""
    lib = library() if available() else None
    if lib is None:
        raise BackendUnavailableError("the native nvcuvid callbacks are off or not built here")
    return lib


FEEDER = os.environ.get("KVCODEC_FEEDER", "1") != "0"  # False: the parser fed on the caller's thread
FEED_DEPTH = 2  # streams pushed to a feeder and not yet fed (the engine's next stream is always there)
# True: a decoder keeps its driven run (parser, native state, feeder thread) open across fetches, the
# parser taking the next fetch's streams after its end-of-stream flush; False: opened per fetch.
KEEP = os.environ.get("KVCODEC_KEEP_RUNS", "1") != "0"


class Feeder:
    """A native thread that feeds the streams pushed onto it to `parser` (whose callbacks are the C
    ones, on `state`), piece by piece, so the engine does not wait for the caller's thread."""

    def __init__(self, lib, state: State, parser: int, parse: int, setctx: int, ctx: int, piece: int):
        self.lib, self.state = lib, state
        self.handle = lib.kv_feeder_start(ctypes.addressof(state), parser, parse, setctx, ctx, piece)
        if not self.handle:
            raise OSError("the native feeder thread did not start")
        self.finished = False

    def submit(self, address: int, length: int, ordinal: int) -> None:
        if self.lib.kv_feeder_submit(self.handle, address, length, ordinal) != 0:
            raise RuntimeError("more streams pushed than the feeder holds")

    def end(self) -> None:
        """No more streams: the parser is flushed after the last one."""
        self.lib.kv_feeder_end(self.handle)

    def keep(self) -> None:
        """The thread and parser stay after each flush (end): more streams may be pushed once it
        is done (flushed counts them). Call before the first end."""
        self.lib.kv_feeder_keep(self.handle)

    def flushed(self, flushes: int, timeout_s: float) -> int:
        """Flushes done once `flushes` are (or timeout_s passed); -1 once the feeder finished."""
        return self._timed(self.lib.kv_feeder_flushed, flushes, timeout_s=timeout_s)

    def wait(self, completed: int, timeout_s: float, flushes: int | None = None) -> int:
        """Streams complete once `completed` are, or (kept) `flushes` flushes are done, or timeout_s
        passed; -1 once the feeder finished (the flush done, or stopped by an error)."""
        if flushes is None:
            return self._timed(self.lib.kv_feeder_wait, completed, timeout_s=timeout_s)
        return self._timed(self.lib.kv_feeder_wait_any, completed, flushes, timeout_s=timeout_s)

    def wait_fed(self, unfed: int, timeout_s: float) -> int:
        """Streams pushed and not yet fed once at most `unfed` are (or timeout_s passed); -1 once
        the feeder finished."""
        return self._timed(self.lib.kv_feeder_wait_fed, unfed, timeout_s=timeout_s)

    def _timed(self, fn, *args: int, timeout_s: float) -> int:
        """One of the C waits, fn(handle, *args, timeout in microseconds); its -1 marks the feeder
        finished."""
        got = fn(self.handle, *args, int(timeout_s * 1e6))
        self.finished = got < 0
        return got

    def close(self) -> int:
        """Stop and join the thread; the parser's last error code (0: none)."""
        if not self.handle:
            return 0
        handle, self.handle = self.handle, None
        return self.lib.kv_feeder_close(handle)


DecodeFn = ctypes.CFUNCTYPE(c_int, c_void_p, c_void_p)
