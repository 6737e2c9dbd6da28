"""GroupedDriven: the grouped codec's part in the driven restore (codecs/driven.py's DrivenChunks).

A grouped chunk's parts are driven by their groups' codecs' own DrivenChunks: read() checks the chunk as
GroupedCodec.decode_chunk does and reads each part by its group's adapter against the group's target (the
chunk's videos are its parts' pieces, in group order); the host work of a chunk without videos runs per
part, wherever each adapter runs it (the transform codec's zstd on native threads), begun per part as the
blob arrives; finish restores each group of every ready chunk by one finish of its adapter (the transform's
batched kernels). A part that cannot restore straight into its group's target (it holds more positions
than the target keeps, or another dtype than the codec restores into) is decoded whole at stage, on the
fetch's thread, and copied by the finish; a plain (single-group) blob is staged by GroupedCodec.stage.
"""

from __future__ import annotations

import dataclasses
import threading
from collections.abc import Iterator, Mapping, Sequence
from concurrent.futures import CancelledError, Future

import torch

from kvcodec.codecs.base import Target
from kvcodec.codecs.driven import Begun, DrivenChunks, Reading, driven_of, host_pool
from kvcodec.codecs.grouped import (
    GroupedCodec,
    GroupedStaged,
    Part,
    _decoded_whole,
    _direct,
    _parse,
    finish_grouped,
    is_grouped,
    split_parts,
)
from kvcodec.errors import KVCodecError, ShapeError
from kvcodec.kvspec import GroupedKV


@dataclasses.dataclass(frozen=True)
class _Chunk:
    """A grouped chunk as read: its parts by group (Part, bytes) and the group parts read by their adapters
    (group -> that adapter's Reading; a group absent here restores whole at stage, if the target holds it)."""

    parts: Mapping[int, tuple[Part, memoryview]]
    subs: Mapping[int, Reading]


@dataclasses.dataclass(frozen=True)
class _Plain:
    """A plain (single-group) blob: GroupedCodec.stage restores it."""

    blob: object


def grouped_driven(codec: GroupedCodec) -> GroupedDriven | None:
    """The codec's DrivenChunks where every group's codec has one; None: not driven."""
    codecs = {id(c): c for c in codec.codecs}
    adapters = {k: driven_of(c) for k, c in codecs.items()}
    if any(a is None for a in adapters.values()):
        return None
    return GroupedDriven(codec, adapters)


class GroupedDriven:
    """A GroupedCodec's DrivenChunks (see the module doc) over its groups' codecs' adapters (by id of codec)."""

    def __init__(self, codec: GroupedCodec, adapters: Mapping[int, DrivenChunks]):
        self.codec, self.adapters = codec, dict(adapters)
        if any(callable(getattr(a, h, None)) for a in self.adapters.values() for h in ("prepare", "prepare_host")):
            self.prepare = self._prepare  # StageDriver prepares a video chunk while NVDEC decodes only if asked

    def _adapter(self, info, g: int) -> DrivenChunks:  # noqa: ANN001 - a GroupedChunkInfo
        return self.adapters[id(self.codec.codec_for(info.spec.groups[g]))]

    def inspect(self, blob):  # noqa: ANN001, ANN201 - bytes-like, a ChunkInfo
        return self.codec.inspect_chunk(blob)

    def read(self, blob, target: GroupedKV, split: int = 1) -> Reading:  # noqa: ANN001 - bytes-like
        """The chunk checked against `target` as decode_chunk checks it; each part restoring straight into its
        group's target read by its adapter (up to `split` pieces each)."""
        if not is_grouped(blob):
            return Reading(self.codec.inspect_chunk(blob), (), _Plain(blob))
        info, parts = self.codec._parts(blob, target)
        subs, pieces = {}, []
        for g, data in self._direct_parts(info, parts, target):
            subs[g] = self._adapter(info, g).read(data, target.tensors[g], split)
            pieces += subs[g].pieces
        return Reading(info, tuple(pieces), _Chunk(parts, subs))

    def _direct_parts(self, info, parts: Mapping, target: GroupedKV) -> Iterator[tuple[int, memoryview]]:  # noqa: ANN001
        """(group, its part's bytes) of each part that restores straight into its group's target, every part
        checked as decode_chunk checks it (checksum, bound key, positions) on the way."""
        for g, group in enumerate(target.spec.groups):
            checked = self.codec._checked_part(g, group, parts.get(g), target, info)
            if checked is not None and _direct(checked[0], checked[2], target, g, info):
                yield g, checked[1]

    def stage(self, reading: Reading, buffers: Sequence[torch.Tensor], target: GroupedKV) -> object:
        return self._staged(reading, target, buffers=buffers)

    def stage_alone(self, reading: Reading, target: GroupedKV, decoder) -> object:  # noqa: ANN001
        return self._staged(reading, target, decoder=decoder)

    def _staged(self, reading: Reading, target: GroupedKV, buffers=None, decoder=None) -> GroupedStaged:  # noqa: ANN001
        """Each group's part staged by its adapter (its pieces' decoded `buffers`, or decoded by `decoder` alone),
        the parts that cannot restore straight into their group's target decoded whole here."""
        if isinstance(reading.state, _Plain):
            return self.codec.stage(reading.state.blob, target)
        info, chunk = reading.info, reading.state
        staged, copies, used = [], [], 0
        for g in range(len(target.spec.groups)):
            if target.stop == target.starts[g]:
                continue  # the target holds nothing of this group here
            part, sub = chunk.parts[g], chunk.subs.get(g)
            codec = self.codec.codec_for(info.spec.groups[g])
            if sub is None or not _direct(codec, part[0], target, g, info):
                copies.append((target.tensors[g], _decoded_whole(codec, part[1], part[0], target, g, info)))
                continue
            adapter, out = self.adapters[id(codec)], target.tensors[g]
            n = len(sub.pieces)
            if decoder is not None and n:
                staged.append((g, adapter, adapter.stage_alone(sub, out, decoder), out))
            else:
                staged.append((g, adapter, adapter.stage(sub, (buffers or ())[used : used + n], out), out))
            used += n
        return GroupedStaged(tuple(staged), tuple(copies))

    def finish(self, staged: Sequence[GroupedStaged], targets: Sequence[Target]) -> None:
        finish_grouped(staged)

    # -- host work of chunks without videos ------------------------------------------------------------
    def _prepare(self, reading: Reading) -> Reading:
        """A video chunk's frame-independent host work, done while NVDEC decodes its frames (DrivenChunks.prepare):
        each video part's by its adapter's prepare, each part without a video by its adapter's prepare_host (its
        zstd'd samples decompressed, else done on this thread at stage)."""
        if isinstance(reading.state, _Plain):
            return reading
        subs = {}
        for g, sub in reading.state.subs.items():
            step = getattr(self._adapter(reading.info, g), "prepare" if sub.pieces else "prepare_host", None)
            subs[g] = sub if step is None else step(sub)
        return dataclasses.replace(reading, state=dataclasses.replace(reading.state, subs=subs))

    def submit_host(self, reading: Reading) -> Future:
        """Each part's host work submitted where its adapter runs it fastest: a Future of the prepared Reading."""
        if isinstance(reading.state, _Plain) or not reading.state.subs:
            done: Future = Future()
            done.set_result(reading)
            return done
        futures = {g: self._submitted(reading.info, g, sub) for g, sub in reading.state.subs.items()}
        return _joined(reading, futures)

    def _submitted(self, info, g: int, sub: Reading) -> Future:  # noqa: ANN001 - a GroupedChunkInfo
        adapter = self._adapter(info, g)
        submit = getattr(adapter, "submit_host", None)
        if submit is not None:
            return submit(sub)
        prepare = getattr(adapter, "prepare_host", None)
        if prepare is not None:
            return host_pool().submit(prepare, sub)
        done: Future = Future()
        done.set_result(sub)
        return done

    def begin_host(self, blob) -> Begun | None:  # noqa: ANN001 - bytes-like
        """Each part's host work begun as the blob arrives, where every part's adapter begins its own (the
        parts' checksums and the target's checks wait for adopt); None where not begun."""
        if not is_grouped(blob):
            return None
        try:
            info, payload = _parse(blob)
        except KVCodecError:
            return None
        parts, begun = split_parts(info, payload), {}
        adapters = {g: self._adapter(info, g) for g in parts}
        if not parts or not all(callable(getattr(a, "begin_host", None)) for a in adapters.values()):
            return None
        for g, (_, data) in parts.items():
            one = adapters[g].begin_host(data)
            if one is None:
                return None  # the parts begun already end unused (a level whose plan is not built yet, a video)
            begun[g] = one
        reading = Reading(info, (), _Chunk(parts, {g: b.reading for g, b in begun.items()}))
        return Begun(_joined(reading, {g: b.future for g, b in begun.items()}), reading)

    def adopt(self, reading: Reading, target: GroupedKV) -> Reading:
        """A begun chunk checked against its target: every check read() makes (the parts' checksums and keys
        included), each part staged straight into its group's target adopted by its adapter."""
        if not isinstance(target, GroupedKV):
            raise ShapeError(f"a grouped chunk restores into a GroupedKV; got {type(target).__name__}")
        info, chunk = reading.info, reading.state
        self.codec._check_target(info, target)
        for g, _ in self._direct_parts(info, chunk.parts, target):
            # its checks only: stage takes the part as its begun work prepared it (the joined Future's)
            self._adapter(info, g).adopt(chunk.subs[g], target.tensors[g])
        return reading


def _joined(reading: Reading, futures: Mapping[int, Future]) -> Future:
    """A Future of `reading` with each group's part replaced by its Future's prepared Reading, or of the first
    error among them; it runs from the start, so it cannot be cancelled while the parts write into buffers."""
    joined: Future = Future()
    joined.set_running_or_notify_cancel()
    if not futures:
        joined.set_result(reading)
        return joined
    lock, waiting = threading.Lock(), dict(futures)

    def one_done(_: Future) -> None:
        with lock:
            if not all(f.done() for f in waiting.values()):
                return
            done = dict(waiting)
            waiting.clear()  # the parts' callbacks held this closure, it the parts: a cycle kept their buffers
        if not done:
            return  # the last part's callback already joined them
        for f in done.values():
            error = CancelledError() if f.cancelled() else f.exception()
            if error is not None:
                joined.set_exception(error)
                return
        subs = {g: f.result() for g, f in done.items()}
        joined.set_result(dataclasses.replace(reading, state=dataclasses.replace(reading.state, subs=subs)))

    for f in futures.values():
        f.add_done_callback(one_done)
    return joined
