"""The HEVC codec's part in the driven restore (codecs/driven.py): what a fetch on CUDA uses.

read: the blob checked as HevcCodec.inspect_chunk and decode_chunk check it, each part's streams
verified (a split chunk has one part per layer range, each with its own video: each is a piece,
decoded on whichever session is least busy). prepare (while the videos decode) or stage: each
part's side streams uploaded and its restorer made (on the fetch's stream); a part without a video
(zstd samples) or a plain chunk is restored into its target at stage, its streams decompressed
ahead by prepare_host on a host thread. finish: each part's frames restored from its decoded buffer into
its target, one launch per part for all its frames where the fused kernel applies.
stage_alone: after a session failed, every part decoded frame by frame with that session's decoder
(as the worker path does)."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch

from kvcodec.codecs.base import ChunkInfo, Target
from kvcodec.codecs.driven import Piece, Reading
from kvcodec.codecs.hevc.decode import checked_part, chunk_parts, host_streams, part_restorer, restore_part
from kvcodec.container.format import PLAIN, ChunkHeader, StreamEntry, parse_chunk, split_streams, verify_streams
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
