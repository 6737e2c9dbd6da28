"""Driven chunk restore on CUDA: one thread stages a fetch's chunks on every NVDEC session.

A codec takes part through a small protocol, DrivenChunks (what `driven_of(codec)` returns):

    inspect(blob) -> ChunkInfo          the header alone (the fetch's binding check runs on it first:
                                         a blob of another prefix is dropped, whatever its shape)
    read(blob, target, split) -> Reading
                                        the blob parsed and checked against the target: the chunk's
                                         ChunkInfo and its videos (Piece: bytes, frame size, frames),
                                         cut into up to `split` pieces where its videos can be (the
                                         transform codec's frames that decode alone: a short fetch's
                                         few chunks then keep every engine busy)
    stage(reading, buffers, target)     the chunk's staged part, from each piece's decoded frames (a
                                         flat uint8 buffer per piece, frame after frame: consecutive
                                         parts of one allocation)
    stage_alone(reading, target, dec)   the same with the pieces decoded by `dec` (after its session
                                         failed: names the chunk at fault)
    finish(staged, targets)             the math for many staged chunks at once, into their targets
    prepare(reading) -> Reading         optional: the chunk's frame-independent host work (side
                                         streams uploaded, restorer made), done while NVDEC decodes
                                         its video, when the fetch's thread would otherwise wait
    prepare_host(reading) -> Reading    optional: a chunk without videos, its host work with no
                                         CUDA calls (zstd'd samples decompressed), run on a pool of
                                         host threads (host_pool) before stage; without it such
                                         a chunk is staged at once on the fetch's thread
    submit_host(reading) -> Future      optional: prepare_host's work started wherever it runs
                                         fastest (the transform codec's: zstd on native threads),
                                         a Future of the prepared Reading that cannot be cancelled
                                         once its work writes into buffers
    begin_host(blob) -> Begun | None    optional: submit_host's work begun for a blob as it arrives,
                                         on the thread that got it (the fetch's network stage), before
                                         the fetch's thread checks and reads it, with the chunk as read
                                         there; the same blob object submitted takes both over (None:
                                         not begun)
    adopt(reading, target) -> Reading   optional: a begun chunk's Reading checked against the target
                                         (what read() checks beyond begin_host); with it, a begun blob
                                         is not parsed again on the fetch's thread

The transform codec's adapter lives in codecs/transform/batch.py, the HEVC codec's in
codecs/hevc/driven.py. StageDriver runs the protocol: submit(tag, blob, target) reads and checks
the chunk here and pushes each of its videos at once to the native feeder thread of the least busy
session (nvcuvid._FedRun), which decodes its frames straight into the piece's buffer; poll() hands
back the chunks whose every piece is complete; submit_many() does so for every blob a fetch holds,
the chunks with videos first (a video chunk takes NVDEC ~4 ms, the host work of one without ~1 ms).
No Python thread per session: a fetch's per-chunk Python work runs on its restore thread (the one that
also launches the math), apart from what the network thread begins for each blob as it arrives
(begin_host); decode worker threads, one per session, queued for the interpreter lock behind each
other (benchmarks/results/fetch-h200-issue21.md).
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import os
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import CancelledError, Future, ThreadPoolExecutor
from concurrent.futures import wait as wait_futures
from typing import Protocol

import torch

from kvcodec.codecs.base import ChunkInfo, Target
from kvcodec.errors import ConfigError, FormatError, KVCodecError, untraced
from kvcodec.layout.search import usable_cores

DRIVEN = os.environ.get("KVCODEC_DRIVEN", "1") != "0"  # False: a fetch stages on decode worker threads
# threads decompressing chunks without videos (zstd releases the interpreter lock): half the cores, at most 8,
# leaving the rest to the serving engine; KVCODEC_HOST_THREADS sets another count, read when the process's
# pool starts (its first fetch of such chunks): benchmarks/results/host-threads-h100-s59.md
HOST_THREADS = max(1, min(8, usable_cores() // 2))
MOST_HOST_THREADS = 256  # a setting's largest (the native threads' count is a C int)
_host_pool: ThreadPoolExecutor | None = None
_host_pool_lock = threading.Lock()


def host_threads(setting: str | None = None) -> int:
    """The host pool's size: `setting` (KVCODEC_HOST_THREADS's value when None), else HOST_THREADS."""
    text = (os.environ.get("KVCODEC_HOST_THREADS", "") if setting is None else setting).strip()
    if not text:
        return HOST_THREADS
    if not (text.isascii() and text.isdigit()) or not 1 <= int(text) <= MOST_HOST_THREADS:
        raise ConfigError(f"KVCODEC_HOST_THREADS must be a whole number from 1 to {MOST_HOST_THREADS}, got {text!r}")
    return int(text)


def host_pool() -> ThreadPoolExecutor:
    """The process's pool for DrivenChunks.prepare_host, shared by every fetch, started on first use."""
    global _host_pool
    with _host_pool_lock:
        if _host_pool is None:
            _host_pool = ThreadPoolExecutor(host_threads(), thread_name_prefix="kvcodec-host")
        return _host_pool


PIECES_PER_SESSION = 4  # a fetch cuts its chunks' videos (where they can be) into about this many pieces per session


def split_for(chunks: int, sessions: int) -> int:
    """Pieces each chunk's videos are cut into, where they can be, in a fetch of `chunks` chunks on
    `sessions` NVDEC sessions: enough that a short fetch keeps every session busy with pieces of
    similar size; 1 once the chunks alone are that many (a piece costs the fetch's thread a push). Pure."""
    return max(1, -(-PIECES_PER_SESSION * sessions // max(1, chunks)))


def balanced_runs(sizes: Sequence[int], most: int) -> list[tuple[int, int]]:
    """`sizes` cut into at most `most` contiguous non-empty runs [a, b) whose largest sum is the
    smallest possible (the pieces of one video, each run decoded on a session: the largest decides
    when the chunk is out). Pure."""
    if not sizes:
        return []
    most = max(1, min(most, len(sizes)))

    def runs_within(cap: int) -> list[tuple[int, int]]:
        runs, start, total = [], 0, 0
        for i, size in enumerate(sizes):
            if total + size > cap and i > start:
                runs.append((start, i))
                start, total = i, 0
            total += size
        return [*runs, (start, len(sizes))]

    lo, hi = max(sizes), sum(sizes)
    while lo < hi:
        mid = (lo + hi) // 2
        if len(runs_within(mid)) <= most:
            hi = mid
        else:
            lo = mid + 1
    return runs_within(lo)


EAGER = True  # a driven fetch flushes every session right after the last blob (False: when it waits on one)
VIDEO_FIRST = True  # submit_many pushes the chunks with videos before it hands the others to host threads


@dataclasses.dataclass(frozen=True, eq=False)
class Piece:
    """One video of a chunk for NVDEC: its bytes, frame size and the frames its header announces."""

    video: object  # bytes-like
    width: int
    height: int
    frames: int

    @property
    def buffer_bytes(self) -> int:
        return self.frames * 3 * self.width * self.height


@dataclasses.dataclass(frozen=True, eq=False)
class Reading:
    """A chunk blob read and checked by its codec: what the fetch checks it against, its videos
    (none: the chunk is staged from its other streams) and the codec's own state of it."""

    info: ChunkInfo
    pieces: tuple[Piece, ...]
    state: object


@dataclasses.dataclass(frozen=True, eq=False)
class Begun:
    """A chunk's host work begun as its blob arrived (DrivenChunks.begin_host): a Future of the prepared
    Reading, and the chunk as read then (checked as read() checks it, but for its target)."""

    future: Future
    reading: Reading


class DrivenChunks(Protocol):
    """A codec's part in the driven restore (see the module's doc)."""

    def inspect(self, blob) -> ChunkInfo: ...

    def read(self, blob, target: Target, split: int = 1) -> Reading: ...

    def stage(self, reading: Reading, buffers: Sequence[torch.Tensor], target: Target) -> object: ...

    def stage_alone(self, reading: Reading, target: Target, decoder) -> object: ...

    def finish(self, staged: Sequence[object], targets: Sequence[Target]) -> None: ...


def driven_of(codec) -> DrivenChunks | None:
    """The codec's DrivenChunks: its own `driven_chunks()` where it has one, else the adapter of
    its type (TransformCodec, HevcCodec without a pool or a fixed decoder); None: not driven."""
    own = getattr(codec, "driven_chunks", None)
    if callable(own):
        return own()
    from kvcodec.codecs.hevc.codec import HevcCodec
    from kvcodec.codecs.transform.codec import TransformCodec

    if type(codec) is TransformCodec:
        from kvcodec.codecs.transform.batch import TransformDriven

        return TransformDriven(codec)
    if type(codec) is HevcCodec and codec.pool is None and codec.decoder is None:
        from kvcodec.codecs.hevc.driven import HevcDriven

        return HevcDriven(codec)
    return None


@contextlib.contextmanager
def stage_driver(
    codec, device, sessions: int, check: Callable | None = None, expected: int | None = None
) -> Iterator[StageDriver | None]:
    """A StageDriver over `sessions` NVDEC sessions borrowed for the block (for a fetch of `expected`
    chunks: StageDriver's split), or over none for a codec whose chunks hold no video (its
    `codes_video` False: every chunk on the host pool, no NVDEC needed); None where chunks cannot be
    driven that way (DRIVEN off, not a CUDA device, a codec without DrivenChunks, no native feeder,
    or a borrowed decoder that is not nvcuvid's)."""
    from kvcodec.video import nvcuvid_native

    device = torch.device(device)
    chunks = driven_of(codec) if DRIVEN and device.type == "cuda" else None
    videos = getattr(codec, "codes_video", True)
    if chunks is None or (videos and not (nvcuvid_native.FEEDER and nvcuvid_native.available())):
        yield None
        return
    from kvcodec.codecs.hevc.decode import idle_decoders

    with contextlib.ExitStack() as stack:
        count = max(1, sessions) if videos else 0
        decoders = [stack.enter_context(idle_decoders.borrow(device)) for _ in range(count)]
        if not all(callable(getattr(d, "fed_run", None)) and d.device == device for d in decoders):
            yield None
            return
        driver = StageDriver(chunks, decoders, check, expected)
        try:
            yield driver
        finally:
            driver.close()


class _Fed:
    """A chunk submitted and not yet handed back: its reading, target, piece buffers, the pieces
    still decoding (session of each), when it was submitted, and the decoder to decode it alone
    with once a session holding one of its pieces failed."""

    __slots__ = ("reading", "target", "buffers", "left", "t0", "alone", "alone_run", "prepared", "error", "submitting")

    def __init__(self, reading: Reading, target: Target, t0: float):
        self.reading, self.target, self.t0 = reading, target, t0
        self.buffers: list[torch.Tensor] = []
        self.left: dict[int, int] = {}  # piece -> session
        self.alone = None
        self.alone_run: int | None = None  # the failed run whose decoder it waits to be decoded alone with
        self.prepared = False
        self.error: KVCodecError | None = None  # its preparation's
        self.submitting = True  # staged only once every piece is pushed (a drain may complete one meanwhile)


class StageDriver:
    """Chunks staged on several NVDEC sessions from the calling thread alone (module doc).

    poll() hands back (tag, staged chunk or its KVCodecError, seconds its session spent on it);
    wait(tag) blocks until one more chunk of a session holding the tag's pieces completes. A
    piece's last pictures come out once its session has more stream or is flushed: wait(flush=True)
    flushes a session whose every stream is fed. After a session fails, each chunk it held is
    decoded on its own once its other pieces are done (which names the chunk at fault).
    finish(staged, targets): the codec's math (DrivenChunks.finish). `chunks`: a DrivenChunks, or a
    codec that has one (driven_of). `expected`: the chunks the fetch will submit, which sets how
    many pieces each chunk's videos are cut into (split_for; None: as stored)."""

    WAIT_S = 0.05

    def __init__(self, chunks, decoders: Sequence, check: Callable | None = None, expected: int | None = None):
        self.chunks = chunks if callable(getattr(chunks, "stage_alone", None)) else driven_of(chunks)
        if self.chunks is None:
            raise TypeError(f"{type(chunks).__name__} cannot be driven (no DrivenChunks)")
        self.check = check
        self.runs = [d.fed_run() for d in decoders]
        self.split = split_for(expected, len(self.runs)) if expected else 1
        self.fed: dict = {}  # tag -> _Fed
        self.done: list = []  # (tag, staged or error, decode seconds)
        self.free_at = [0.0] * len(self.runs)  # when each session finished its last piece
        self.load = [0] * len(self.runs)  # video bytes each session holds (NVDEC's time goes with them)
        self.prepare = getattr(self.chunks, "prepare", None)
        self.prepare_host = getattr(self.chunks, "prepare_host", None)
        self.submit_host = getattr(self.chunks, "submit_host", None)
        self.on_host: dict = {}  # tag -> (Future of prepare_host, reading, target, submitted): chunks without videos
        self.unprepared: collections.deque = collections.deque()  # tags whose pieces decode, not prepared
        self.reserved: collections.Counter = collections.Counter()  # failed run -> chunks to decode alone with it
        self.closing = False  # close(): chunks still in flight are dropped, not staged
        self.begin_host = getattr(self.chunks, "begin_host", None)
        self.adopt = getattr(self.chunks, "adopt", None)
        self.begun: dict[int, tuple[object, Begun, float]] = {}  # id(blob) -> (blob, its begin_host, begun at)
        self.begun_lock = threading.Lock()  # begin() runs on the fetch's network threads

    def begin(self, blob) -> None:
        """The host work of the chunk in `blob` begun where its codec can (DrivenChunks.begin_host), on
        the calling thread (the fetch's network stage, as each blob comes in): its zstd starts before
        this driver's thread gets to the blob. submit() of the same blob object takes it over; work
        never taken over is dropped (it holds its blob and buffer until it ends)."""
        if self.begin_host is None:
            return
        with self.begun_lock:
            if self.closing or id(blob) in self.begun:
                return
        t0 = time.monotonic()
        try:
            begun = self.begin_host(blob)
        except Exception:  # noqa: BLE001 - best effort: submit() reads the blob again and reports what is wrong
            return
        if begun is None:
            return
        with self.begun_lock:
            if not self.closing:
                self.begun[id(blob)] = (blob, begun, t0)

    def _begun_reading(self, blob) -> Reading | None:
        """The chunk as read where its host work was begun for this very blob object (left begun: a chunk
        the fetch's check refuses keeps it out of the restore); None where none was, or the codec adopts none."""
        if self.adopt is None:
            return None
        with self.begun_lock:
            begun = self.begun.get(id(blob))
        return None if begun is None else begun[1].reading

    def _claim(self, blob) -> tuple[Future, float] | None:
        """The host work begun for this very blob object and when it began, taken over; None where none was."""
        with self.begun_lock:
            begun = self.begun.pop(id(blob), None)
        return None if begun is None else (begun[1].future, begun[2])

    def submit(self, tag, blob, target: Target) -> None:
        self.submit_many([(tag, blob, target)])

    def submit_many(self, items: Sequence[tuple]) -> None:
        """submit() for each (tag, blob, target), the chunks with videos pushed to NVDEC first (where
        VIDEO_FIRST): a video chunk takes its session milliseconds, a chunk without one a host thread ~1 ms."""
        host = []
        for tag, blob, target in items:
            t0 = time.monotonic()
            reading = self._read(tag, blob, target)
            if reading is None:
                continue
            if reading.pieces and not self.runs:  # a video under a codec that codes none: no session holds it
                error = FormatError("the chunk holds a video; its codec codes none")
                self._hand_back(tag, _named(error, reading.info.index), 0.0)
            elif reading.pieces:
                self._push(tag, reading, target, t0)
            elif VIDEO_FIRST:
                host.append((tag, reading, target, t0, self._claim(blob)))
            else:
                self._host(tag, reading, target, t0, self._claim(blob))
        for job in host:
            self._host(*job)

    def _read(self, tag, blob, target: Target) -> Reading | None:
        """The chunk read and checked (as read where its host work was begun: not parsed again); None (its
        error handed back by poll) where it is refused."""
        begun = self._begun_reading(blob)
        try:
            if self.check is not None:  # what the blob says it is, before it is read against the target
                self.check(tag, self.chunks.inspect(blob) if begun is None else begun.info)
            return self.chunks.read(blob, target, self.split) if begun is None else self.adopt(begun, target)
        except KVCodecError as e:
            self._hand_back(tag, e, 0.0)
            return None

    def _host(self, tag, reading: Reading, target: Target, t0: float, begun: tuple | None = None) -> None:
        """A chunk without videos: its host work to the pool (or the work begun for its blob: its
        Future, and when it began, which its decode time counts from), or staged here where the codec has none."""
        if begun is not None:
            future, began_at = begun
            self.on_host[tag] = (future, reading, target, began_at)
            return
        if self.submit_host is not None:
            self.on_host[tag] = (self.submit_host(reading), reading, target, t0)
            return
        if self.prepare_host is not None:
            self.on_host[tag] = (host_pool().submit(self.prepare_host, reading), reading, target, t0)
            return
        try:
            self._hand_back(tag, self.chunks.stage(reading, [], target), 0.0)
        except KVCodecError as e:
            self._hand_back(tag, e, 0.0)

    def _push(self, tag, reading: Reading, target: Target, t0: float) -> None:
        """Each of the chunk's videos to the native feeder of the least busy session, decoded into
        its part of one buffer (the pieces' parts in order, so a chunk cut into pieces of one video
        has that video's frames in one piece of memory)."""
        entry = self.fed[tag] = _Fed(reading, target, t0)
        sizes = [piece.buffer_bytes for piece in reading.pieces]
        for p, piece in enumerate(reading.pieces):
            k = self._run_for(piece.width, piece.height)
            run = self.runs[k]
            if p == 0:
                with _on_stream(run.decoder, target.device):  # reused only after its (synchronous) copies
                    whole = torch.empty(sum(sizes), dtype=torch.uint8, device=target.device)
                entry.buffers = list(whole.split(sizes))
            buf = entry.buffers[p]
            entry.left[p] = k
            video = _video_array(piece.video)
            run.push((tag, p), video, run.next_ordinal(), piece.frames, buf.data_ptr())
            self.load[k] += video.size
        entry.submitting = False
        if not entry.left:  # every piece already out (a session drained to make room for the last)
            self._stage(tag, entry, time.monotonic() - t0)
        elif self.prepare is not None:
            self.unprepared.append(tag)

    def finish(self, staged: Sequence[object], targets: Sequence[Target]) -> None:
        self.chunks.finish(staged, targets)

    def poll(self) -> list[tuple]:
        """(tag, staged chunk or KVCodecError, decode seconds) of every chunk complete since the last call."""
        for k in range(len(self.runs)):
            self._collect(k)
        self._collect_host()
        out, self.done = self.done, []
        return out

    def has_done(self) -> bool:
        """Whether poll has chunks to hand back without collecting NVDEC sessions (refused chunks,
        chunks without videos)."""
        return bool(self.done) or any(job[0].done() for job in self.on_host.values())

    def pending(self, tag) -> bool:
        """Whether the chunk is submitted and not yet handed back by poll."""
        return tag in self.fed or tag in self.on_host

    def wait(self, tag, timeout_s: float, flush: bool) -> None:
        """Wait (at most timeout_s) for one more piece of a session holding one of `tag`'s pieces
        to complete, or for the host work of `tag` without videos; flush: first flush that session
        if its every stream is fed."""
        if tag in self.on_host:
            wait_futures([self.on_host[tag][0]], timeout_s)
            return
        entry = self.fed.get(tag)
        if entry is None or not entry.left or self.prepare_one():  # useful work instead of waiting
            return
        run = self.runs[next(iter(entry.left.values()))]
        if flush and run.stuck():
            run.begin_end()
        run.wait(timeout_s)

    def prepare_one(self) -> bool:
        """Prepare the oldest submitted chunk not yet prepared (DrivenChunks.prepare) while its
        pieces decode; whether there was one."""
        while self.unprepared:
            entry = self.fed.get(self.unprepared.popleft())
            if entry is not None and not entry.prepared:
                self._prepare(entry)
                return True
        return False

    def _prepare(self, entry: _Fed) -> None:
        entry.prepared = True
        try:
            entry.reading = self.prepare(entry.reading)
        except Exception as e:  # noqa: BLE001 - this chunk's failure (a GPU out of memory, say), reported as its error
            entry.error = untraced(_chunk_error(e, entry.reading.info.index))  # kept until staged: see _hand_back

    def _collect_host(self) -> None:
        """Chunks without videos whose host work is done, staged here (their uploads and math on
        this thread's stream), in the order submitted."""
        for tag in [t for t, job in self.on_host.items() if job[0].done()]:
            future, reading, target, t0 = self.on_host.pop(tag)
            self._hand_back(tag, self._staged_from_host(future, reading, target), time.monotonic() - t0)

    def _staged_from_host(self, future: Future, reading: Reading, target: Target) -> object:
        """The staged chunk of a finished prepare_host, or its error naming the chunk. The host work's error is
        taken, not raised here: raised, it would hold this frame, and the frame its future, a cycle that kept
        the chunk's target (the fetch's output) and buffers until the collector's next full pass."""
        error = CancelledError() if future.cancelled() else future.exception()
        if error is not None and not isinstance(error, Exception):
            raise error  # an interrupt, not the chunk's failure
        if error is not None:
            return _chunk_error(error, reading.info.index)
        try:
            return self.chunks.stage(future.result(), [], target)
        except Exception as e:  # noqa: BLE001 - this chunk's failure (a GPU out of memory, say)
            return _chunk_error(e, reading.info.index)

    def _hand_back(self, tag, staged: object, seconds: float) -> None:
        """A chunk's staged result, or its error without a traceback, for poll: the error's frames held this
        driver, the chunk's target and its buffers, a cycle kept until the collector's next full pass."""
        self.done.append((tag, untraced(staged) if isinstance(staged, BaseException) else staged, seconds))

    def end_all(self) -> None:
        """No more chunks are coming: every session is flushed once it has fed what it holds."""
        if not EAGER:
            return
        for run in self.runs:
            if run.pending:  # an idle run (kept open from the last fetch, no chunk of this one) stays so
                run.begin_end()

    def flush_stuck(self) -> None:
        """Flush every session whose every stream is fed (no more chunks are coming)."""
        for run in self.runs:
            if run.stuck():
                run.begin_end()

    def close(self) -> None:
        """Every session flushed (pieces still in flight are decoded to the end) and its run
        closed, or, a run its decoder keeps (nvcuvid_native.KEEP), left open and idle for the next
        fetch; a run that failed is closed with its session."""
        with self.begun_lock:  # work begun for blobs refused or never submitted is dropped
            self.closing = True
            self.begun.clear()
        for future, *_ in self.on_host.values():  # host work in flight ends unused: nothing more is restored
            future.cancel()
        wait_futures([job[0] for job in self.on_host.values()])
        self.on_host.clear()
        for k, run in enumerate(self.runs):
            try:
                self._drain(k)
            except Exception:  # noqa: BLE001 - the session is closed, not reused
                run.close(False)
                continue
            if not getattr(run, "keep", False):
                run.close(True)
        # the caller's callback and targets let go: a fetch holds this driver's finish, so keeping
        # its check closed a cycle that held the fetch's output until the garbage collector ran
        self.check = None
        self.fed.clear()
        self.done = []

    # -- sessions ----------------------------------------------------------------------------

    def _run_for(self, w: int, hh: int) -> int:
        """The session for the next piece: the one holding the fewest video bytes among those open
        for frames of w x hh (or not open); if none, one is emptied first."""
        from kvcodec.video.nvcuvid_native import MAX_TARGETS

        def other(run) -> bool:  # open for frames of another size
            return run.session is not None and (run.session.width, run.session.height) != (w, hh)

        def fits(run) -> bool:  # an idle run open for another size is opened again
            return not run.ending and run.pending < MAX_TARGETS and not (other(run) and run.busy)

        usable = [k for k in range(len(self.runs)) if not self.reserved[k]] or list(range(len(self.runs)))
        ok = [k for k in usable if fits(self.runs[k])]
        if not ok:
            k = min(usable, key=lambda j: self.runs[j].pending)
            self._drain(k)
            ok = [k]
        k = min(ok, key=lambda j: (self.load[j], other(self.runs[j])))
        run = self.runs[k]
        if run.session is None or other(run):
            run.open(w, hh)
        return k

    def _drain(self, k: int) -> None:
        """Flush session k if it holds streams and wait until it is done (its chunks to `done`):
        its run closed or, kept, idle."""
        run = self.runs[k]
        if not run.busy:
            return
        run.begin_end()
        while run.busy:
            self._collect(k)
            if run.busy:
                run.wait(self.WAIT_S)

    def _collect(self, k: int) -> None:
        run = self.runs[k]
        try:
            for tag, p in run.poll():
                self._piece_done(k, tag, p, None)
        except Exception as e:  # noqa: BLE001 - the session failed: its chunks are decoded one by one
            self._failed(k, e)

    def _piece_done(self, k: int, tag, p: int, alone) -> None:
        """Piece p of chunk `tag` is out of session k (decoded, or its session failed: `alone`,
        that session's decoder); the chunk is staged once its last piece is out."""
        entry = self.fed[tag]
        del entry.left[p]
        self.load[k] -= len(entry.reading.pieces[p].video)
        now = time.monotonic()
        busy, self.free_at[k] = now - max(entry.t0, self.free_at[k]), now
        if alone is not None and entry.alone is None:
            entry.alone = alone
            if entry.left:  # decoded alone with run k's decoder once its other pieces are out: k stays shut
                entry.alone_run = k
                self.reserved[k] += 1
        if entry.left or entry.submitting:
            return
        self._stage(tag, entry, busy)

    def _stage(self, tag, entry: _Fed, busy: float) -> None:
        """Every piece of the chunk is out: its staged chunk (or error naming it) to `done`."""
        del self.fed[tag]
        if entry.alone_run is not None:
            self.reserved[entry.alone_run] -= 1
        if self.closing:  # the fetch is over: nothing more is restored
            return
        if self.prepare is not None and not entry.prepared and entry.alone is None:
            self._prepare(entry)
        try:
            if entry.error is not None:
                raise entry.error
            if entry.alone is not None:
                staged = self.chunks.stage_alone(entry.reading, entry.target, entry.alone)
                busy = time.monotonic() - entry.t0
            else:
                staged = self.chunks.stage(entry.reading, entry.buffers, entry.target)
        except Exception as e:  # noqa: BLE001 - not the session's failure: this chunk's (a GPU out of memory, say)
            staged = _chunk_error(e, entry.reading.info.index)
        self._hand_back(tag, staged, busy)

    def _failed(self, k: int, error: Exception) -> None:
        run = self.runs[k]
        keys = list(run.keys)
        run.close(False)
        if getattr(run, "keep", False):  # its decoder dropped it: reopened here, it is closed by close()
            run.keep = False
        if not keys:  # no chunk's fault (the session itself failed)
            self.load[k] = 0
            raise error
        for tag, p in keys:
            self._piece_done(k, tag, p, run.decoder)
        self.load[k] = 0


def _chunk_error(error: BaseException, index: int) -> KVCodecError:
    """A chunk's failure as the KVCodecError naming it (any other error its cause)."""
    if isinstance(error, KVCodecError):
        return _named(error, index)
    named = _named(KVCodecError(f"{type(error).__name__}: {error}"), index)
    named.__cause__ = error
    return named


def _named(error: KVCodecError, index: int) -> KVCodecError:
    """`error` naming its chunk (same type, the original as its cause) where it does not yet (a
    video decoder's own errors name no chunk)."""
    if f"chunk {index}" in str(error):
        return error
    named = type(error)(f"chunk {index}: {error}")
    named.__cause__ = error
    return named


def _on_stream(decoder, device) -> contextlib.AbstractContextManager:
    """The decoder's stream as the current one where the buffer is on CUDA (the copies run there)."""
    stream = getattr(decoder, "stream", None)
    return (
        torch.cuda.stream(stream)
        if stream is not None and torch.device(device).type == "cuda"
        else contextlib.nullcontext()
    )


def _video_array(video):  # noqa: ANN202 - a numpy uint8 array over the stream's bytes
    from kvcodec.video.nvcuvid import _as_buffer

    return _as_buffer(video)
