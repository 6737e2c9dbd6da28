"""Many transform-coded chunks at once on NvcuvidThreads: NVDEC decodes on the sessions of one
CUDA context, the math (transform_decode.TransformRestorer.finish) runs batched over the chunks.

Each session's worker thread pulls chunks itself and streams their videos through one parser
back to back (NvcuvidDecoder.decode_each), so the engine decodes the next chunk's picture while
the last one is copied out and its host work (header, CRC, escapes) runs; the caller's thread
meanwhile runs the math in waves over the chunks decoded so far, on its own stream.

TransformDriven: the transform codec's part in the driven restore (codecs/driven.py, what a fetch on
CUDA uses): no Python thread per session: one thread reads the chunks, pushes each video to the native
feeder of the session holding the fewest video bytes and takes the chunks the feeders complete."""

from __future__ import annotations

import collections
import dataclasses
import itertools
import queue
import threading
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import Future

import torch

from kvcodec.codecs import zstd_native
from kvcodec.codecs.base import ChunkInfo, Target
from kvcodec.codecs.driven import Begun, Piece, Reading, balanced_runs, host_pool, host_threads
from kvcodec.codecs.transform.decode import check_target, frame_buffer, host_samples
from kvcodec.container.format import checksum_error, verify_streams
from kvcodec.errors import CorruptStreamError, KVCodecError, wait_all
from kvcodec.transform.frames import frame_count

_END = object()
DEFAULT_WAVE = 16  # chunks per pass of the math: launch-bound below ~8, no faster per chunk above 16


def threads_decode_into(codec) -> Callable:
    """The `decode_into` NvcuvidThreads.restore_blobs takes, for a TransformCodec: each chunk
    restored with the NVDEC session the worker thread was lent.

        with NvcuvidThreads(7) as dec:
            dec.restore_blobs(blobs, outs, decode_into=threads_decode_into(codec))
    """

    def decode_into(blob, out, decoder, restore: str = "auto") -> None:
        codec.decode_chunk(blob, out, decoder=decoder)

    return decode_into


def chunk_info(h: dict) -> ChunkInfo:
    """The ChunkInfo of a verified transform chunk header (what TransformCodec.inspect_chunk returns)."""
    L, H, D = h["shape"]
    return ChunkInfo(h["index"], h["start_token"], h["tokens"], L, H, D, h["dtype"], h["codec"], h.get("key"))


def stage_stream(codec, items: Iterable[tuple], device, check: Callable | None = None, decoder=None) -> Iterator[tuple]:
    """(tag, staged chunk or the KVCodecError it failed with) for every (tag, blob, target) of
    `items`, as each completes: the chunks' videos go back to back through one parser on one NVDEC
    session borrowed for the call (NvcuvidDecoder.decode_each), so the engine decodes the next
    chunk while this thread does the last one's host work (the fetch pipeline's decode workers run
    this; TransformCodec.finish does the math). `items` is pulled when the parser wants the next
    stream; when it ends, the parser is flushed and the last chunks complete. check(tag, info):
    called with each chunk's ChunkInfo before its video is fed; what it raises is that chunk's
    error. After a stream fails, each chunk fed and not complete is decoded on its own (which
    names the chunk at fault) and streaming goes on with the items left. decoder: the video decoder
    to use instead of one borrowed for the call."""
    r, items = codec._restorer, iter(items)
    done: collections.deque = collections.deque()  # results found while feeding (refused or zstd chunks)
    fed: dict = {}  # tag -> (header, streams, target, sample buffer or None) of chunks fed and not complete

    def videos(into: bool) -> Iterator[tuple]:
        for tag, blob, target in items:
            try:
                h, streams = codec._read(blob)
                check_target(h, target)
                if check is not None:
                    check(tag, chunk_info(h))
                if h["coder"] == "zstd":
                    done.append((tag, r.decode_samples(h, streams, target.device, None)))
                    continue
                w, hh = h["resolution"]
                if h["frames"] != frame_count(r.sample_count(h), w, hh):
                    raise CorruptStreamError("transform chunk announces the wrong number of frames")
            except KVCodecError as e:
                done.append((tag, e))
                continue
            buf = frame_buffer(h["frames"], w, hh, target.device) if into else None
            fed[tag] = (h, streams, target, buf)
            if into:
                yield tag, streams["video"], w, hh, h["frames"], buf.data_ptr()
            else:
                yield tag, streams["video"], w, hh, h["frames"]

    if decoder is None:
        from kvcodec.codecs.hevc.decode import idle_decoders

        with idle_decoders.borrow(device) as lent:
            yield from _stream(r, lent, videos, fed, done, _native(lent, device))
    else:
        yield from _stream(r, decoder, videos, fed, done, _native(decoder, device))


def _native(decoder, device) -> bool:
    """Whether `decoder` decodes into buffers with native callbacks for targets on `device`."""
    native = getattr(decoder, "native", None)
    return native is not None and native() and torch.device(device) == getattr(decoder, "device", None)


def _stream(r, decoder, videos: Callable, fed: dict, done: collections.deque, native: bool) -> Iterator[tuple]:
    """stage_stream's loop on one decoder (see there): native, each chunk's frames decoded straight
    into its buffer (NvcuvidDecoder.decode_each_into); else frame by frame through decode_each."""
    while True:
        stream = _decode_into(decoder)(videos(True)) if native else _decode_each(decoder, videos(False))
        try:
            yield from _native_chunks(r, stream, fed, done) if native else _routed_chunks(r, stream, fed, done)
            yield from _drain(done)
            return
        except Exception:  # noqa: BLE001 - attributed to its chunk below
            stream.close()
            if not fed:  # no chunk's fault (the session itself failed)
                raise
            yield from _drain(done)
            for tag, (h, streams, target, _) in list(fed.items()):
                del fed[tag]
                try:
                    yield tag, r.decode_samples(h, streams, target.device, decoder)
                except KVCodecError as e:
                    yield tag, e


def _decode_into(decoder) -> Callable:
    """The decoder's decode-into-buffers loop: its parser fed by a native thread where it can
    (NvcuvidDecoder.decode_each_fed, nvcuvid_native.FEEDER), else on this thread (decode_each_into)."""
    from kvcodec.video import nvcuvid_native

    fed = getattr(decoder, "decode_each_fed", None)
    return fed if fed is not None and nvcuvid_native.FEEDER else decoder.decode_each_into


def _native_chunks(r, keys: Iterator, fed: dict, done: collections.deque) -> Iterator[tuple]:
    for tag in keys:
        yield from _drain(done)
        h, streams, target, buf = fed.pop(tag)
        yield tag, r.decode_samples(h, streams, target.device, samples=buf)


def _routed_chunks(r, frames: Iterator, fed: dict, done: collections.deque) -> Iterator[tuple]:
    router = _Router(frames)
    for tag in router.chunks():
        yield from _drain(done)
        h, streams, target, _ = fed[tag]
        staged = r.decode_samples(h, streams, target.device, router)
        del fed[tag]
        yield tag, staged


def _drain(done: collections.deque) -> Iterator[tuple]:
    while done:
        yield done.popleft()


def restore_chunks(
    codec, blobs: Sequence, outs: Sequence[Target], threads=None, wave: int = DEFAULT_WAVE, drivers: int | None = None
) -> None:
    """Many transform chunks into their targets. threads: an NvcuvidThreads whose sessions decode
    the chunks in parallel while this thread runs the math on its current stream in passes of
    `wave` chunks or more as they come (0: one pass once every chunk is decoded); drivers: host
    threads driving the sessions, each several in turn (default one per session); None: decoded
    one after another on this thread, then one pass. Returns once the work is queued on the
    current stream; a chunk that fails raises its error once the others are restored."""
    if len(blobs) != len(outs):
        raise ValueError("restore_chunks needs one output per blob")
    run = _Run(codec, blobs, outs)
    try:
        if threads is None:
            run.session(None)
            run.collect(1, 0)
        else:
            futures = threads.run_sessions(run.session, drivers)
            run.collect(len(futures), wave, futures)
            wait_all(futures)  # a worker's own failure (every chunk's error is in run.errors)
        if run.errors:
            first = run.errors.pop(min(run.errors))
            try:
                raise first
            finally:
                first = None
    finally:
        run.errors.clear()  # each error's traceback holds the workers' frames, which hold this run
        run = None  # and whatever is raised holds this frame


class _Run:
    """One restore_chunks call: the chunks still to decode, those decoded, the errors."""

    def __init__(self, codec, blobs: Sequence, outs: Sequence[Target]):
        self.codec, self.r, self.blobs, self.outs = codec, codec._restorer, blobs, outs
        self._next, self._lock = iter(range(len(blobs))), threading.Lock()
        self.done: queue.Queue = queue.Queue()  # (index, Decoded, event) per chunk; None per finished worker
        self.errors: dict[int, BaseException] = {}

    # -- worker threads ------------------------------------------------------------------------

    def session(self, decoders) -> None:
        """Decode chunks until none is left: with `decoders` (sessions this thread drives in turn,
        a chunk at a time each), or None (a decoder borrowed per chunk)."""
        try:
            if decoders is None:
                for i, h, streams in self._videos({}, yield_video=False):
                    self._one(i, h, streams, None)
                return
            steps = [self._stream_chunks(d) for d in decoders]
            while steps:
                steps = [s for s in steps if next(s, _END) is not _END]
        finally:
            self.done.put(None)

    def _stream_chunks(self, decoder) -> Iterator[None]:
        """Chunks through decoder.decode_each until none is left, one step per chunk. After a
        stream fails, each chunk fed and not yet complete is decoded on its own (which names the
        chunk that fails) and streaming goes on with the chunks left."""
        while True:
            fed: dict[int, tuple] = {}  # fed and not complete: index -> (header, streams)
            frames = _decode_each(decoder, self._videos(fed, prime=getattr(decoder, "display_delay", 0) + 1))
            try:
                router = _Router(frames)
                for i in router.chunks():
                    if i is None:  # the session's first streams are queued: on to the next session
                        yield
                        continue
                    h, streams = fed[i]
                    decoded = self.r.decode_samples(h, streams, self.outs[i].device, router)
                    del fed[i]
                    self._done(i, decoded)
                    yield
                return
            except Exception:  # noqa: BLE001 - attributed to its chunk below
                frames.close()
                if not fed:  # no chunk's fault (the session itself failed): this worker stops
                    raise
                for i, (h, streams) in fed.items():
                    self._one(i, h, streams, decoder)

    def _videos(self, fed: dict, yield_video: bool = True, prime: int = 0) -> Iterator[tuple]:
        """The remaining chunks, pulled one at a time (the workers share them), each read and
        checked; chunks without a video (zstd samples) are decoded here and not yielded. After the
        first `prime` videos, one None (decode_each's pause)."""
        while (i := self._take()) is not None:
            if len(fed) == prime and prime:
                prime = 0
                yield None
            try:
                h, streams = self.codec._read(self.blobs[i])
                check_target(h, self.outs[i])
                if h["coder"] == "zstd":
                    self._done(i, self.r.decode_samples(h, streams, self.outs[i].device, None))
                    continue
            except Exception as e:  # noqa: BLE001 - raised once the others are restored
                self.errors[i] = e
                continue
            if not yield_video:
                yield i, h, streams
                continue
            fed[i] = (h, streams)
            w, hh = h["resolution"]
            yield i, streams["video"], w, hh, h["frames"]

    def _take(self) -> int | None:
        with self._lock:
            return next(self._next, None)

    def _one(self, i: int, h: dict, streams: dict, decoder) -> None:
        try:
            self._done(i, self.r.decode_samples(h, streams, self.outs[i].device, decoder))
        except Exception as e:  # noqa: BLE001
            self.errors[i] = e

    def _done(self, i: int, decoded) -> None:
        event = None
        if self.outs[i].device.type == "cuda":  # decoded on this worker's stream
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(self.outs[i].device))
        self.done.put((i, decoded, event))

    # -- the caller's thread -------------------------------------------------------------------

    def collect(self, workers: int, wave: int, futures: Sequence = ()) -> None:
        """The math over the decoded chunks, in passes of `wave` or more (0: one pass at the end),
        until every worker has said it is done (or its future has ended without saying so)."""
        batch: list[tuple[int, object]] = []
        while workers:
            items = self._wait(futures)
            if items is None:
                break
            for item in items:
                if item is None:
                    workers -= 1
                    continue
                i, decoded, event = item
                if event is not None:
                    torch.cuda.current_stream(self.outs[i].device).wait_event(event)
                batch.append((i, decoded))
            if batch and ((wave and len(batch) >= wave) or not workers):
                self._finish(batch)
                batch = []
        if batch:
            self._finish(batch)

    def _wait(self, futures: Sequence) -> list | None:
        """What the workers have handed over since the last call (waiting for something); None
        once every future has ended and nothing is left (a worker that failed before it began)."""
        while True:
            try:
                items = [self.done.get(timeout=0.5 if futures else None)]
                break
            except queue.Empty:
                if all(f.done() for f in futures) and self.done.empty():
                    return None
        while not self.done.empty():
            items.append(self.done.get_nowait())
        return items

    def _finish(self, batch: list[tuple[int, object]]) -> None:
        try:
            self.r.finish([d for _, d in batch], [self.outs[i] for i, _ in batch])
        except Exception:  # noqa: BLE001 - one by one, to name the chunk that fails
            for i, d in batch:
                try:
                    self.r.finish([d], [self.outs[i]])
                except Exception as e:  # noqa: BLE001
                    self.errors[i] = e


class _Router:
    """The (key, frame) sequence of decode_each handed out one chunk at a time: a video decoder
    whose decode() yields the frames of the chunk that comes next (TransformRestorer.decode_samples
    takes it as its decoder). A chunk's frames end when the next chunk's first frame (or the end)
    has come, which is what confirms them."""

    def __init__(self, frames: Iterator[tuple]):
        self._frames = frames
        self._head = next(frames, None)

    def chunks(self) -> Iterator:
        """The key of each chunk whose frames come next; None for decode_each's pause."""
        while self._head is not None:
            key = self._head[0]
            yield key
            if key is None:
                self._head = next(self._frames, None)
            elif self._head is not None and self._head[0] == key:
                raise CorruptStreamError(f"the frames of chunk {key} were not all restored")

    def decode(self, bitstream, width: int, height: int) -> Iterator[torch.Tensor]:
        key = self._head[0]
        while self._head is not None and self._head[0] == key:
            yield self._head[1]
            self._head = next(self._frames, None)


def _decode_each(decoder, items: Iterator[tuple]) -> Iterator[tuple]:
    """(key, frame) of every (key, bitstream, width, height, frames) item: one parser for all of
    them where the decoder can (NvcuvidDecoder.decode_each), else one decode() per stream."""
    if hasattr(decoder, "decode_each"):
        return decoder.decode_each(items)
    return (pair for item in items for pair in ([(None, None)] if item is None else _frames_of(decoder, item)))


def _frames_of(decoder, item: tuple) -> Iterator[tuple]:
    key, video, w, h, _ = item
    return ((key, frame) for frame in decoder.decode(video, w, h))


_LATER = frozenset({"samples"})  # a driven read leaves the zstd'd samples' checksum to the thread decompressing them


def _verify(h: dict, streams: dict, later: tuple) -> None:
    """The checksums a driven read left for later."""
    verify_streams(streams, later, _what(h))


def _what(h: dict) -> str:
    return f"transform chunk {h['index']}"


class TransformDriven:
    """The transform codec's DrivenChunks (codecs/driven.py), over its existing methods: a chunk's
    one video (none for zstd-coded samples) decoded into a buffer that decode_samples takes as
    its samples; finish is the codec's batched math."""

    def __init__(self, codec):
        self.codec = codec

    def inspect(self, blob) -> ChunkInfo:
        return self.codec.inspect_chunk(blob)

    def read(self, blob, target: Target, split: int = 1) -> Reading:
        """The chunk checked; its video as up to `split` pieces where its frames decode alone (the
        header's pieces, joined into runs of similar bytes: NVDEC's time goes with them)."""
        h, entries, streams = self.codec._read_entries(blob, _LATER)  # samples: checksummed where decompressed
        later = tuple(e for e in entries if e.name in _LATER)
        check_target(h, target)
        pieces = ()
        if h["coder"] != "zstd":
            w, hh = h["resolution"]
            if h["frames"] != frame_count(self.codec._restorer.sample_count(h), w, hh):
                raise CorruptStreamError("transform chunk announces the wrong number of frames")
            pieces = _pieces(streams["video"], w, hh, h["frames"], h["pieces"], split)
        return Reading(chunk_info(h), pieces, (h, streams, later))

    def prepare_host(self, reading: Reading) -> Reading:
        """A zstd-coded chunk's samples decompressed into pinned memory, its escapes and sink tokens
        read (on a host thread: no CUDA work)."""
        h, streams, later = reading.state
        _verify(h, streams, later)
        count = self.codec._restorer.sample_count(h)
        return self._prepared(reading, host_samples(streams, count, self._staging(count)))

    def _prepared(self, reading: Reading, host: torch.Tensor) -> Reading:
        """The read chunk with its decompressed samples, escapes and sink tokens (checksums done)."""
        h, streams, _ = reading.state
        return dataclasses.replace(reading, state=(h, streams, (), host, self.codec._restorer.host_side(h, streams)))

    def submit_host(self, reading: Reading) -> Future:
        """prepare_host's work on the native zstd threads (codecs/zstd_native.py: the samples'
        checksum and zstd there, none of it under the interpreter lock; the escapes and sink tokens
        on the thread that collects them), else on the host pool: a Future of the prepared Reading,
        or of the error that refused the chunk (raised nowhere else)."""
        threads = zstd_native.threads(host_threads)
        h, streams, later = reading.state
        if threads is None or [e.name for e in later] != ["samples"]:
            return host_pool().submit(self.prepare_host, reading)
        return self._native_job(threads, reading)

    def begin_host(self, blob) -> Begun | None:
        """submit_host's work for a zstd-coded chunk begun before its target is known (DrivenChunks.begin_host),
        on the native threads only and at a level whose coordinate plan is built (none is built off the
        fetch's thread), with the chunk as read here. None where not begun: a blob it cannot read is left for
        read() to refuse."""
        try:
            h, entries, streams = self.codec._read_entries(blob, self.codec.STREAM_NAMES)  # nothing checksummed yet
            count = self.codec._restorer.known_sample_count(h)
            if h["coder"] != "zstd" or count is None:
                return None
            verify_streams(streams, [e for e in entries if e.name not in _LATER], _what(h))  # as read() does
        except KVCodecError:
            return None
        later = tuple(e for e in entries if e.name in _LATER)
        threads = zstd_native.threads(host_threads)  # started by then: the fetch's thread built the plan
        if threads is None or [e.name for e in later] != ["samples"]:
            return None
        reading = Reading(chunk_info(h), (), (h, streams, later))
        return Begun(self._native_job(threads, reading, count), reading)

    def adopt(self, reading: Reading, target: Target) -> Reading:
        """A begun chunk's Reading checked against its target: all read() checks that begin_host has not."""
        check_target(reading.state[0], target)
        return reading

    def _native_job(self, threads, reading: Reading, count: int | None = None) -> Future:  # noqa: ANN001 - a ZstdThreads
        """The chunk's samples (`count`, else its plan's) checksummed and decompressed on the native threads into
        pinned staging: a Future of the prepared Reading, or of the error (a pinned buffer that could not be had, say)."""
        try:
            h, streams, (entry,) = reading.state
            host = self._staging(self.codec._restorer.sample_count(h) if count is None else count)
            checksum = (entry.crc32, lambda: checksum_error(entry, _what(h)))
            return threads.submit(
                streams["samples"], host.numpy(), "samples", lambda: self._prepared(reading, host), checksum
            )
        except Exception as e:  # noqa: BLE001 - the chunk's error, raised nowhere else
            failed: Future = Future()
            failed.set_exception(e)
            return failed

    def _staging(self, count: int) -> torch.Tensor:
        """(count,) uint8 for a chunk's samples; on a CUDA machine the front of a pinned block of the
        codec's one staging size (pinned_block_bytes), so that every chunk takes its block from one
        size class of torch's pinned cache whatever its level or length (reserve_staging fills it)."""
        if not torch.cuda.is_available():
            return torch.empty(count, dtype=torch.uint8)
        return torch.empty(max(count, self.codec.pinned_block_bytes()), dtype=torch.uint8, pin_memory=True)[:count]

    def stage(self, reading: Reading, buffers: Sequence[torch.Tensor], target: Target):  # noqa: ANN201 - Decoded
        h, streams, later, *prepared = reading.state
        _verify(h, streams, later)
        if buffers:
            return self.codec._restorer.decode_samples(h, streams, target.device, samples=_joined(buffers))
        if not prepared:
            return self.codec._restorer.decode_samples(h, streams, target.device)
        host, side = prepared
        samples = host.to(target.device, non_blocking=True)
        return self.codec._restorer.decode_samples(h, streams, target.device, samples=samples, side=side)

    def stage_alone(self, reading: Reading, target: Target, decoder):  # noqa: ANN201 - Decoded
        h, streams, later, *_ = reading.state
        _verify(h, streams, later)
        return self.codec._restorer.decode_samples(h, streams, target.device, decoder)

    def finish(self, staged: Sequence, targets: Sequence[Target]) -> None:
        self.codec.finish(staged, targets)


def _pieces(video, width: int, height: int, frames: int, sizes: Sequence[int], split: int) -> tuple[Piece, ...]:
    """The video as up to `split` pieces: runs of its frames that decode alone (`sizes`: the
    header's byte length of each; none: the video is one stream)."""
    if split <= 1 or len(sizes) <= 1:
        return (Piece(video, width, height, frames),)
    view, ends, pieces = memoryview(video), list(itertools.accumulate(sizes, initial=0)), []
    for a, b in balanced_runs(sizes, split):
        if not _starts_a_stream(view[ends[a] : ends[a] + 6]):
            raise CorruptStreamError(
                f"transform chunk's video piece {a} does not start a stream (its pieces are wrong)"
            )
        pieces.append(Piece(view[ends[a] : ends[b]], width, height, b - a))
    return tuple(pieces)


_VPS = b"\x40\x01"  # the NAL unit header of a video parameter set (type 32, layer 0, temporal id 1)


def _starts_a_stream(head: memoryview) -> bool:
    """Whether bytes start with an Annex-B start code and a video parameter set: where each of a
    video's pieces begins (a piece cut anywhere else would decode another frame in its place)."""
    b = bytes(head)
    return b.startswith(b"\x00\x00\x01" + _VPS) or b.startswith(b"\x00\x00\x00\x01" + _VPS)


def _joined(buffers: Sequence[torch.Tensor]) -> torch.Tensor:
    """The pieces' buffers as one: the span they cover where they are consecutive parts of one
    allocation (as StageDriver makes them), else a copy."""
    first = buffers[0]
    if len(buffers) == 1:
        return first
    total, at = sum(b.numel() for b in buffers), first.data_ptr()
    for b in buffers:
        if b.data_ptr() != at or b.untyped_storage().data_ptr() != first.untyped_storage().data_ptr():
            return torch.cat(list(buffers))
        at += b.numel()
    return first.as_strided((total,), (1,), first.storage_offset())
