"""The HEVC codec's part in the driven restore (codecs/driven.py): what a fetch on CUDA uses.

read: the blob checked as HevcCodec.inspect_chunk and decode_chunk check it, each part's streams
verified (a split chunk has one part per layer range, each with its own video: each is a piece,
decoded on whichever session is least busy). prepare (while the videos decode) or stage: each
part's side streams uploaded and its restorer made (on the fetch's stream); a part without a video
(zstd samples) or a plain chunk is restored into its target at stage, its streams decompressed
ahead by submit_host (the samples on the native zstd threads, else prepare_host on a host
thread). finish: each part's frames restored from its decoded buffer into its target, one launch
per part for all its frames where the fused kernel applies.
stage_alone: after a session failed, every part decoded frame by frame with that session's decoder
(as the worker path does)."""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Sequence
from concurrent.futures import Future

import torch

from kvcodec.codecs import zstd_native
from kvcodec.codecs.base import ChunkInfo, Target
from kvcodec.codecs.driven import Piece, Reading, finished, host_pool, host_threads
from kvcodec.codecs.hevc.decode import (
    checked_part,
    chunk_parts,
    fill_host,
    host_streams,
    part_restorer,
    planned_host_streams,
    restore_part,
)
from kvcodec.container.format import (
    PLAIN,
    ChunkHeader,
    StreamEntry,
    checksum_error,
    parse_chunk,
    split_streams,
    verify_streams,
)
from kvcodec.layout.tiling import LayoutPlan
from kvcodec.restore import restore_frames
from kvcodec.restore.paged import PagedChunk, PagedKV


@dataclasses.dataclass(frozen=True, eq=False)
class _Part:
    """One part of a read chunk (the chunk itself when not split): header, verified streams, its
    target, and for a coded part its layout."""

    h: ChunkHeader
    streams: dict
    target: Target
    plan: LayoutPlan | None = None
    restorer: object = None  # made ahead by prepare (its side streams uploaded)
    host: object = None  # a part without a video: its streams decompressed ahead by prepare_host
    unverified: tuple[StreamEntry, ...] = ()  # streams whose checksum is checked where they are read

    @property
    def samples(self) -> bool:
        return self.plan is not None and "samples" in self.streams

    @property
    def video(self) -> bool:
        return self.plan is not None and "video" in self.streams


@dataclasses.dataclass(frozen=True, eq=False)
class _Staged:
    """A chunk staged for finish: (restorer, frames (F, 3, H, W) uint8 on the device, tokens,
    the restorer's target) per part decoded into a buffer."""

    parts: tuple[tuple, ...]


class HevcDriven:
    """HevcCodec's DrivenChunks (codecs/driven.py)."""

    def __init__(self, codec):
        self.codec = codec

    def inspect(self, blob) -> ChunkInfo:
        return self.codec.inspect_chunk(blob)

    def read(self, blob, target: Target, split: int = 1) -> Reading:
        """The chunk's parts (its streams of layer groups are its pieces already: `split` is not used)."""
        info = self.codec.inspect_chunk(blob)  # quant, frame size and bit widths of this codec
        parts = tuple(_read_part(b, t) for b, t in chunk_parts(blob, target))
        pieces = tuple(Piece(p.streams["video"], p.plan.width, p.plan.height, p.h.frames) for p in parts if p.video)
        return Reading(info, pieces, parts)

    def prepare(self, reading: Reading) -> Reading:
        """Each coded part's restorer made (side streams decompressed and uploaded) before its frames are out."""
        parts = tuple(dataclasses.replace(p, restorer=self._restorer(p)) if p.video else p for p in reading.state)
        return dataclasses.replace(reading, state=parts)

    def prepare_host(self, reading: Reading) -> Reading:
        """The host work of a chunk without videos (zstd'd samples), on any thread: each such part's
        streams decompressed into a pinned buffer, uploaded and restored at stage."""
        parts = tuple(
            dataclasses.replace(p, host=host_streams(p.h, _verified(p), _device(p.target).type == "cuda"))
            if p.samples
            else p
            for p in reading.state
        )
        return dataclasses.replace(reading, state=parts)

    def submit_host(self, reading: Reading) -> Future:
        """prepare_host's work with each part's zstd'd samples checksummed and decompressed on the native
        threads (codecs/zstd_native.py: no interpreter lock), its side streams on the thread that collects
        them; else prepare_host on the host pool. A Future of the prepared Reading, or of the error that
        refused the chunk (the first of its parts', in order)."""
        threads = zstd_native.threads(host_threads)
        if threads is None or not all(_native_samples(p) for p in reading.state if p.samples):
            return host_pool().submit(self.prepare_host, reading)
        parts = [_submit_part(threads, p) if p.samples else finished(p) for p in reading.state]
        return _all_of(parts, lambda done: dataclasses.replace(reading, state=tuple(done)))

    def stage(self, reading: Reading, buffers: Sequence[torch.Tensor], target: Target) -> _Staged:
        staged, buffers = [], iter(buffers)
        for p in reading.state:
            if not p.video:
                streams = p.streams if p.host is not None else _verified(p)
                restore_part(p.h, streams, _device(p.target), p.target, restore=self.codec.restore, host=p.host)
                continue
            restorer = p.restorer if p.restorer is not None else self._restorer(p)
            frames = next(buffers).view(p.h.frames, 3, p.plan.height, p.plan.width)
            staged.append((restorer, frames, p.h.tokens, _frame_target(p)))
        return _Staged(tuple(staged))

    def _restorer(self, p: _Part):  # noqa: ANN202 - a FrameRestorer
        return part_restorer(p.h, p.plan, p.streams, _device(p.target), self.codec.restore)

    def stage_alone(self, reading: Reading, target: Target, decoder) -> _Staged:
        for p in reading.state:
            restore_part(p.h, p.streams, _device(p.target), p.target, decoder if p.video else None, self.codec.restore)
        return _Staged(())

    def finish(self, staged: Sequence[_Staged], targets: Sequence[Target]) -> None:
        stream = None
        for chunk in staged:
            for restorer, frames, tokens, out in chunk.parts:
                if stream is None and frames.is_cuda:
                    stream = torch.cuda.current_stream(frames.device)
                if stream is not None:  # decoded on a session's stream: not reused before this one reads it
                    frames.record_stream(stream)
                restore_frames(restorer, frames, tokens, out)


def _read_part(blob, target: Target) -> _Part:
    """A part blob's header and streams, checked against its target as restore_part checks; every
    stream verified but the zstd'd samples of a part without a video (verified where they are
    decompressed: on a host thread, off the fetch's one thread)."""
    h, payload = parse_chunk(blob)
    later = tuple(s for s in h.streams if s.name == "samples") if h.quant != PLAIN else ()
    streams = split_streams(payload, h.streams, _what(h), frozenset(s.name for s in later))
    if h.quant == PLAIN:
        return _Part(h, streams, target)
    target, _, plan = checked_part(h, streams, _device(target), target)  # (parse_chunk checked its frame count)
    return _Part(h, streams, target, plan, unverified=later)


def _native_samples(p: _Part) -> bool:
    """Whether the native threads can read the part's samples: zstd'd, their checksum the one left for later."""
    return [(e.name, e.codec) for e in p.unverified] == [("samples", "zstd")]


def _submit_part(threads, p: _Part) -> Future:  # noqa: ANN001 - a ZstdThreads
    """A Future of the part with its host streams: the samples on the native threads, then the rest; or
    of the error that stopped it being submitted (a pinned buffer that could not be had, say)."""
    try:
        return _submitted(threads, p)
    except Exception as e:  # noqa: BLE001 - the part's error, after any earlier part's
        return finished(e, failed=True)


def _submitted(threads, p: _Part) -> Future:  # noqa: ANN001 - a ZstdThreads
    host, fills = planned_host_streams(p.h, p.streams, _device(p.target).type == "cuda")
    offset, size = host.spans["samples"]
    (entry,) = p.unverified
    return threads.submit(
        p.streams["samples"],
        host.host.numpy()[offset : offset + size],
        "samples",
        lambda: dataclasses.replace(p, host=fill_host(host, fills, frozenset({"samples"}))),
        (entry.crc32, lambda: checksum_error(entry, _what(p.h))),
    )


def _all_of(futures: list[Future], then) -> Future:  # noqa: ANN001 - then: list of results -> result
    """A Future of then(each one's result, in order) once all are done; of the first one's error, in
    order, where any failed."""
    out: Future = Future()
    out.set_running_or_notify_cancel()  # not cancellable: the native threads write into its parts' buffers
    if not futures:
        out.set_result(then([]))
        return out
    left = [len(futures)]
    lock = threading.Lock()

    def one_done(_: Future) -> None:
        with lock:
            left[0] -= 1
            if left[0]:
                return
        try:
            out.set_result(then([f.result() for f in futures]))
        except Exception as e:  # noqa: BLE001 - the chunk's error, for whoever waits on it
            out.set_exception(e)

    for f in futures:
        f.add_done_callback(one_done)
    return out


def _what(h: ChunkHeader) -> str:
    return f"chunk {h.chunk_index}"


def _verified(p: _Part) -> dict:
    """The part's streams, those whose checksum was left for later verified now."""
    verify_streams(p.streams, p.unverified, _what(p.h))
    return p.streams


def _device(target: Target) -> torch.device:
    return target.pages.device if isinstance(target, PagedKV) else target.device


def _frame_target(p: _Part):  # noqa: ANN202 - what a FrameRestorer writes into
    return PagedChunk(p.target, p.h.start_token) if isinstance(p.target, PagedKV) else p.target
