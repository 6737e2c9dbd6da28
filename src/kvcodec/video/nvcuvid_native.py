"""The per-picture half of the nvcuvid backend in C: the parser's decode and display callbacks.

With Python callbacks every picture enters the interpreter twice (decode, display) and crosses the
interpreter lock a dozen times (ctypes calls, torch events, the frame copy), so seven decoder
threads queue on the lock instead of on NVDEC (benchmarks/results/fetch-h200-*.md profiles). Here
the two callbacks are C functions (this file's SOURCE, compiled at first use with the system C
compiler into the kvcodec cache directory, loaded with ctypes): each decoded picture is mapped,
copied straight into its stream's place in the caller's sample buffer and unmapped without the
interpreter, and the caller's thread takes the lock again only when cuvidParseVideoData returns.
The sequence callback (opening the NVDEC session) stays in Python: it runs once per stream.

The GPU libraries are not linked: their functions are handed in as pointers (ctypes), so the
library builds anywhere a C compiler is. Without a compiler, or where the build fails,
`library()` returns None and the Python callbacks (nvcuvid.py) are used: they are the reference
the tests compare with.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from ctypes import c_int, c_longlong, c_ulonglong, c_void_p
from pathlib import Path

log = logging.getLogger(__name__)

MAX_TARGETS = 64  # streams fed and not complete at once (a ring in the C state)
ENABLED = os.environ.get("KVCODEC_NATIVE", "1") != "0"  # False: the Python callbacks everywhere

SOURCE = r"""
#include <stddef.h>

typedef int (*decode_fn)(void *, void *);
typedef int (*map_fn)(void *, int, unsigned long long *, unsigned int *, void *);
typedef int (*unmap_fn)(void *, unsigned long long);
typedef int (*copy_fn)(const void *, void *);
typedef int (*sync_fn)(void *);

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
} state_t;

enum { OK = 0, CUDA_FAILED = 1, WRONG_STREAM = 2, NO_TARGET = 3 };

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


def _cache_dir() -> Path:
    d = os.environ.get("KVCODEC_CACHE_DIR")
    return (Path(d) if d else Path.home() / ".cache" / "kvcodec") / "native"


def build(directory: Path | None = None) -> Path | None:
    """The compiled library (built once per SOURCE); None without a C compiler or if the build fails."""
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        log.info("no C compiler: the nvcuvid callbacks stay in Python")
        return None
    directory = directory or _cache_dir()
    path = directory / f"nvcuvid_loop-{hashlib.sha256(SOURCE.encode()).hexdigest()[:16]}.so"
    if path.exists():
        return path
    try:
        directory.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=directory) as tmp:
            src, lib = Path(tmp) / "loop.c", Path(tmp) / "loop.so"
            src.write_text(SOURCE)
            subprocess.run([cc, "-O2", "-shared", "-fPIC", "-o", str(lib), str(src)], check=True, capture_output=True)
            os.replace(lib, path)  # atomic: a concurrent build wins or loses whole
    except (OSError, subprocess.CalledProcessError) as e:
        log.warning("building the native nvcuvid callbacks failed (%s): they stay in Python", e)
        return None
    return path


@functools.cache
def library():  # noqa: ANN201 - the ctypes CDLL, or None
    """The loaded library with kv_decode and kv_display, or None (Python callbacks then)."""
    path = build()
    if path is None:
        return None
    try:
        return ctypes.CDLL(str(path))
    except OSError as e:
        log.warning("loading %s failed (%s): the nvcuvid callbacks stay in Python", path, e)
        return None


def available() -> bool:
    """Whether decoders use the native callbacks (ENABLED, and the library builds and loads here)."""
    return ENABLED and library() is not None


def function_pointer(fn) -> int:
    """The address of a ctypes foreign function (handed to the C code)."""
    return ctypes.cast(fn, c_void_p).value


DecodeFn = ctypes.CFUNCTYPE(c_int, c_void_p, c_void_p)
