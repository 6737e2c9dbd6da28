"""HEVC codec, decode side: chunk blob -> frames, one at a time, from the best decoder for the
device -> de-tiled, merged with the low bit planes, uncentered and dequantized straight into the
caller's target (a dense slice or a PagedKV)."""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import threading
from collections.abc import Iterable

import numpy as np
import torch

from kvcodec.codecs.base import Target
from kvcodec.codecs.hevc.encode import unit_bits
from kvcodec.codecs.zstd_streams import unzstd_into
from kvcodec.container import split
from kvcodec.container.format import PLAIN, ChunkHeader, StreamEntry, object_version, parse_chunk, split_streams
from kvcodec.container.plain import plain_values
from kvcodec.container.split import SplitHeader
from kvcodec.dtypes import dtype_of
from kvcodec.errors import CorruptStreamError, FormatError, ShapeError
from kvcodec.layout.tiling import LayoutPlan, gather_index
from kvcodec.quant import bitsplit
from kvcodec.quant import exact as exact_q
from kvcodec.restore import ChunkTerms, restorer_for
from kvcodec.restore.paged import PagedChunk, PagedKV
from kvcodec.video.registry import get_decoder


def inspect_chunk_blob(blob: bytes | memoryview) -> ChunkHeader | SplitHeader:
    """Parse and verify a chunk blob's header (not its streams); a split chunk's header names
    the whole chunk (its parts' headers: `part_headers`)."""
    if split.is_split(blob):
        return split.parse_split_header(blob)[0]
    return parse_chunk(blob)[0]


def part_headers(blob: bytes | memoryview) -> list[ChunkHeader]:
    """The chunk headers a blob holds: its own, or each part's of a split chunk."""
    if split.is_split(blob):
        return [h for h, _ in split.parse_split(blob)[1]]
    return [parse_chunk(blob)[0]]


def describe_chunk(blob: bytes | memoryview) -> dict:
    """One chunk blob's summary (codecs/describe.py), split or not, every stream checksummed."""
    from kvcodec.codecs.describe import chunk_summary

    is_split = split.is_split(blob)
    pieces = [b for _, b in split.parse_split(blob)[1]] if is_split else [blob]
    headers = []
    for piece in pieces:
        h, payload = parse_chunk(piece)
        split_streams(payload, h.streams, f"chunk {h.chunk_index}")
        headers.append(h)
    first = headers[0]
    layers = sum(h.layers for h in headers)
    streams: dict[str, int] = {}
    for s in (s for h in headers for s in h.streams):
        streams[s.name] = streams.get(s.name, 0) + s.length
    return chunk_summary(
        blob,
        first.resolution,
        2 * layers * 2 * first.tokens * first.kv_heads * first.head_dim,
        format=split.FORMAT_NAME if is_split else "kvcodec-chunk",
        version=split.parse_split_header(blob)[0].version if is_split else object_version(blob),
        codec="hevc",
        dtype=first.dtype,
        layers=layers,
        kv_heads=first.kv_heads,
        head_dim=first.head_dim,
        tokens=first.tokens,
        chunk_index=first.chunk_index,
        start_token=first.start_token,
        key=first.key,
        quant=first.quant,
        streams=streams,
        parts=[
            {"layers": h.layers, "layout": h.layout, "frames": h.frames, "video_bits": h.video_bits} for h in headers
        ],
    )


def chunk_parts(blob: bytes | memoryview, out: Target) -> list[tuple[memoryview | bytes, Target]]:
    """(part blob, its target) for each independently decodable stream of a chunk blob: the blob
    and `out` itself, or each part of a split chunk with its layers of `out` (a view of a dense
    target, or a PagedKV over those layers' pages). The parts' headers are checked here."""
    if not split.is_split(blob):
        return [(blob, out)]
    h, parts = split.parse_split(blob)
    dtype = dtype_of(h.dtype, "chunk blob dtype")
    if isinstance(out, PagedKV):
        out.check(h.shape, dtype, h.start_token)
        return [(b, PagedKV(out.pages[a:e], out.block_table)) for (a, e), (_, b) in zip(h.layer_ranges(), parts)]
    if tuple(out.shape) != h.shape or out.dtype != dtype:
        raise ShapeError(f"output tensor is {tuple(out.shape)} {out.dtype}; chunk holds {h.shape} {dtype}")
    return [(b, out[a:e]) for (a, e), (_, b) in zip(h.layer_ranges(), parts)]


_ALIGN = 64  # each stream's place in a chunk's upload buffer starts on this many bytes


def _fill(data, coded: bool, name: str, wrong: str, buf: np.ndarray) -> None:
    """Decompress (`coded`) or copy `data` into `buf`, which it must fill exactly."""
    got = unzstd_into(data, buf, name) if coded else _copy_into(data, buf)
    if got != buf.size:
        raise CorruptStreamError(wrong.format(got=got))


def _copy_into(data, buf: np.ndarray) -> int:
    """Copy `data` into `buf` when the sizes agree (numpy copies without the GIL); data's size."""
    if len(data) == buf.size:
        buf[:] = np.frombuffer(data, dtype=np.uint8)
    return len(data)


@dataclasses.dataclass(frozen=True, eq=False)
class HostStreams:
    """A chunk's streams as its restore reads them (decompressed, the shift made from the centers),
    in ONE host buffer, pinned for CUDA: uploaded in one copy. Made without CUDA work, so on any
    thread (a driven fetch decompresses the samples of chunks not coded as video on a pool)."""

    host: torch.Tensor
    spans: dict[str, tuple[int, int]]  # name -> (offset, size)


def _fill_host(fills: dict, pinned: bool) -> HostStreams:
    """{name: (size, fill(buf))} -> every stream decompressed or copied once, into its place in one
    host buffer. One buffer and one copy per chunk, not per stream: on the H200 each pinned
    allocation and upload cost about 1 ms of a decoder thread's time beside busy NVDEC threads
    (benchmarks/results/decode-h200-split-streams.md)."""
    spans, total = {}, 0
    for name, (size, _) in fills.items():
        spans[name] = (total, size)
        total += -(-size // _ALIGN) * _ALIGN
    host = torch.empty(total, dtype=torch.uint8, pin_memory=pinned)
    buf = host.numpy()
    for name, (size, fill) in fills.items():
        offset = spans[name][0]
        fill(buf[offset : offset + size])
    return HostStreams(host, spans)


def _to_device(streams: HostStreams, device: torch.device) -> dict[str, torch.Tensor]:
    """{name: flat uint8 tensor on `device`}: for CUDA one asynchronous copy on the current stream (a
    decoder thread never waits for its stream's earlier work; the pinned allocator keeps the buffer
    until the copy ran)."""
    flat = streams.host.to(device, non_blocking=True) if device.type == "cuda" else streams.host
    return {name: flat[offset : offset + size] for name, (offset, size) in streams.spans.items()}


def host_streams(h: ChunkHeader, streams, pinned: bool) -> HostStreams:
    """A coded chunk's HostStreams (pinned: for a CUDA restore), made on the calling thread."""
    _check_video_bits(h)
    planes, _, _, half = _unit_terms(h.layer_bits, h.layers, h.kv_heads, h.video_bits, "cpu")
    return _fill_host(_stream_fills(h, streams, planes, half), pinned)


def _check_video_bits(h: ChunkHeader) -> None:
    if not 1 <= h.video_bits <= 8:
        raise FormatError(f"chunk blob has video_bits={h.video_bits}, outside 1..8")


def shift_from_centers(centers: np.ndarray, half: np.ndarray) -> np.ndarray:
    """centering.uncenter_terms' shift on the host: (centers - modulus // 2) mod 256 as uint8,
    centers (units, dim) uint8, half (units,) = modulus // 2."""
    return ((centers.astype(np.int16) - half.astype(np.int16)[:, None]) % 256).astype(np.uint8)


def _fill_shift(data, half: np.ndarray, dim: int, buf: np.ndarray) -> None:
    centers = np.empty(buf.size, dtype=np.uint8)
    _fill(data, True, "center", "channel centers have the wrong size for the announced shape", centers)
    buf[:] = shift_from_centers(centers.reshape(-1, dim), half).reshape(-1)


@functools.lru_cache(maxsize=256)
def _unit_terms(layer_bits: tuple[int, ...], layers: int, kv_heads: int, video_bits: int, device: str):
    """(low bit planes, per-unit low bit counts, per-unit uint8 mask (units, 1, 1), per-unit
    modulus // 2 on the host) of a header's shape, the tensors on `device`, made once per shape:
    a CUDA upload is waited for here, so any stream may read them."""
    ubits = unit_bits(layer_bits, layers, kv_heads)
    counts = bitsplit.low_bit_counts(ubits, video_bits)
    modulus = 2**ubits
    # int32: the fused restorer's type, so that it casts nothing per chunk
    on_device = counts.to(device, torch.int32), (modulus - 1).to(torch.uint8).view(-1, 1, 1).to(device)
    if torch.device(device).type == "cuda":
        torch.cuda.current_stream(device).synchronize()
    return bitsplit.plane_count(counts), *on_device, (modulus // 2).numpy()


def _low_entry(h: ChunkHeader, streams, planes: int) -> StreamEntry | None:
    """The chunk's low bit stream (None when every bit is in the video), checked against its header."""
    if "low" not in streams:
        if planes:
            raise FormatError(f"chunk codes {h.video_bits} video bits but has no low bit stream")
        return None
    if not planes or not bitsplit.can_split(h.layers * 2 * h.kv_heads, h.head_dim):
        raise FormatError(f"chunk has a low bit stream it cannot use (video_bits={h.video_bits})")
    return next(s for s in h.streams if s.name == "low")


def _stream_fills(h: ChunkHeader, streams, planes: int, half: np.ndarray) -> dict:
    """{name: (size, fill)} of every side stream a chunk's restore reads: quantization parameters
    ("side"), exact mode's low byte planes, the low bit planes, and the per-channel shift made
    from the centers."""
    units = h.layers * 2 * h.kv_heads
    fills = {}
    if h.quant != "exact":
        n = 2 * units * h.head_dim * dtype_of(h.param_dtype, "chunk blob parameter dtype").itemsize
        wrong = "quantization parameters have the wrong size for the announced shape"
        fills["side"] = (n, functools.partial(_fill, streams["side"], True, "side", wrong))
    entries = [s for s in h.streams if s.name.startswith("bytes")]
    low = _low_entry(h, streams, planes)
    sizes = [units * h.tokens * h.head_dim] * len(entries)
    if low is not None:
        entries.append(low)
        sizes.append(planes * h.tokens * units * h.head_dim // 8)
    for s, n in zip(entries, sizes):
        wrong = f"stream {s.name!r} holds {{got}} bytes, expected {n}"
        fills[s.name] = (n, functools.partial(_fill, streams[s.name], s.codec == "zstd", s.name, wrong))
    fills["shift"] = (units * h.head_dim, functools.partial(_fill_shift, streams["center"], half, h.head_dim))
    if "video" not in streams:  # the samples themselves, zstd-coded (uploaded with the rest: one copy)
        entry = next(s for s in h.streams if s.name == "samples")
        n, wrong = units * h.tokens * h.head_dim, "sample stream has the wrong size for the announced shape"
        fills["samples"] = (n, functools.partial(_fill, streams["samples"], entry.codec == "zstd", "samples", wrong))
    return fills


def _chunk_terms(
    h: ChunkHeader, plan: LayoutPlan, streams, dtype: torch.dtype, device, host: HostStreams | None = None
) -> ChunkTerms:
    """The chunk's ChunkTerms on `device`, from its streams (`host`: already decompressed)."""
    _check_video_bits(h)
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    planes, counts, mask, half = _unit_terms(h.layer_bits, h.layers, h.kv_heads, h.video_bits, str(device))
    units = h.layers * 2 * h.kv_heads
    host = host or _fill_host(_stream_fills(h, streams, planes, half), device.type == "cuda")
    on_device = _to_device(host, device)
    common = dict(
        plan=plan,
        layers=h.layers,
        kv_heads=h.kv_heads,
        head_dim=h.head_dim,
        tokens=h.tokens,
        dtype=dtype,
        positions=gather_index(plan, device),
        shift=on_device["shift"].view(units, 1, h.head_dim),
        mask=mask,
        low_counts=counts,
        low_planes=on_device["low"].view(planes, -1) if "low" in on_device else None,
        samples=on_device["samples"].view(units, h.tokens, h.head_dim) if "samples" in on_device else None,
    )
    if h.quant == "exact":
        byte_planes = [on_device[s.name].view(h.shape) for s in h.streams if s.name.startswith("bytes")]
        if len(byte_planes) != exact_q.bytes_per_value(dtype) - 1:
            raise FormatError(f"exact chunk carries {len(byte_planes)} low byte planes for {h.dtype}")
        return ChunkTerms(**common, byte_planes=tuple(byte_planes))
    params = on_device["side"].view(dtype_of(h.param_dtype, "chunk blob parameter dtype"))
    params = params.view(2, h.layers, 2, h.kv_heads, h.head_dim)
    return ChunkTerms(**common, offset=params[0], step=params[1])


def decode_chunk_blob(
    blob: bytes | memoryview,
    device: str | torch.device = "cpu",
    out: Target | None = None,
    decoder=None,
    restore: str = "auto",
) -> Target:
    """Decode one chunk blob into a (layers, 2, tokens, kv_heads, head_dim) tensor on `device`,
    restoring frame by frame. With `out` (for example a slice of a preallocated KV cache) the
    values are written there and `out` is returned; `out` may also be a PagedKV (blocks of a paged
    cache and the sequence's block table): the chunk then fills its tokens' slots, from its
    header's start_token. `restore` picks the frame restorer ("auto": the fused GPU kernel where
    it applies; "torch"; "triton"). A split chunk's parts are restored one after the other
    (an NvdecPool or NvcuvidThreads restores them in parallel: HevcCodec(pool=...))."""
    if split.is_split(blob):
        h = split.parse_split_header(blob)[0]
        out, _ = _target(h, dtype_of(h.dtype, "chunk blob dtype"), device, out)
        for part, target in chunk_parts(blob, out):
            decode_chunk_blob(part, out=target, decoder=decoder, restore=restore)
        return out
    h, payload = parse_chunk(blob)
    streams = split_streams(payload, h.streams, f"chunk {h.chunk_index}")
    return restore_part(h, streams, device, out, decoder, restore)


def restore_part(
    h: ChunkHeader,
    streams,
    device,
    out: Target | None,
    decoder=None,
    restore: str = "auto",
    host: HostStreams | None = None,
) -> Target:
    """One (part) chunk of checked streams into `out` (allocated on `device` when None), frame by
    frame from `decoder` (borrowed where None and the chunk has a video); a plain chunk copied.
    `host`: its streams already decompressed (host_streams)."""
    if h.quant == PLAIN:
        return _restore_plain(h, streams, device, out)
    out, device, plan = checked_part(h, streams, device, out)
    restorer = part_restorer(h, plan, streams, device, restore, host)
    if "video" not in streams:  # no frames: one pass over the uploaded samples
        return _restore_samples(h, restorer, out)
    if decoder is None:
        with idle_decoders.borrow(device) as lent:
            return _restore_frames(h, plan, streams, lent, restorer, device, out)
    return _restore_frames(h, plan, streams, decoder, restorer, device, out)


def checked_part(h: ChunkHeader, streams, device, out: Target | None) -> tuple[Target, torch.device, LayoutPlan]:
    """A coded (not plain) chunk's checks before its restore: the streams it needs, the target
    (allocated on `device` when None) and its layout: (target, device restoring into it, layout)."""
    required = {"center"} | ({"side"} if h.quant != "exact" else set())
    if not required <= streams.keys() or not ({"video", "samples"} & streams.keys()):
        raise FormatError(f"chunk blob lacks streams (has {sorted(streams)})")
    out, device = _target(h, dtype_of(h.dtype, "chunk blob dtype"), device, out)
    return out, device, _layout(h)


def part_restorer(h: ChunkHeader, plan: LayoutPlan, streams, device, restore: str = "auto", host=None):  # noqa: ANN201
    """The FrameRestorer of a checked chunk: its side streams decompressed (unless `host` holds
    them) and uploaded to `device` (on the current stream), the restorer `restore` picks ("auto":
    the fused kernel where it applies)."""
    terms = _chunk_terms(h, plan, streams, dtype_of(h.dtype, "chunk blob dtype"), device, host)
    return restorer_for(terms, prefer=restore)


def _restore_plain(h: ChunkHeader, streams, device, out: Target | None) -> Target:
    """A chunk stored plain (too small to code): its values copied into the target."""
    values = plain_values(h, streams)
    out, device = _target(h, values.dtype, device, out)
    if isinstance(out, PagedKV):
        blocks, within = out.slots(h.start_token, h.tokens)
        out.pages[:, :, blocks, within] = values.to(device)
    else:
        out.copy_(values)
    return out


def _target(
    h: ChunkHeader | SplitHeader, dtype: torch.dtype, device, out: Target | None
) -> tuple[Target, torch.device]:
    """The checked output (allocated on `device` when None) and the device restoring into it."""
    if isinstance(out, PagedKV):
        out.check(h.shape, dtype, h.start_token)
        return out, out.pages.device
    if out is None:
        device = torch.device(device)
        return torch.empty(h.shape, dtype=dtype, device=device), device
    if tuple(out.shape) != h.shape or out.dtype != dtype:
        raise ShapeError(f"output tensor is {tuple(out.shape)} {out.dtype}; chunk holds {h.shape} {dtype}")
    return out, out.device


def _layout(h: ChunkHeader) -> LayoutPlan:
    try:
        plan = LayoutPlan.from_dict(h.layout)
    except Exception as e:  # any malformed layout dict is a format error
        raise FormatError(f"chunk blob has an invalid layout: {e}") from e
    if plan.units != h.layers * 2 * h.kv_heads or plan.dim != h.head_dim or (plan.width, plan.height) != h.resolution:
        raise FormatError("chunk blob layout does not match its shape")
    return plan


def _restore_samples(h: ChunkHeader, restorer, out: Target) -> Target:
    """A chunk coded as zstd'd samples, not video: restored from its uploaded samples in one pass
    (one launch of the fused kernel where it applies)."""
    target = PagedChunk(out, h.start_token) if isinstance(out, PagedKV) else out
    restorer.restore_block(restorer.terms.samples, 0, h.tokens, target)
    return out


def _restore_frames(h: ChunkHeader, plan: LayoutPlan, streams, decoder, restorer, device, out):
    target = PagedChunk(out, h.start_token) if isinstance(out, PagedKV) else out
    frames = 0
    tpf = plan.tokens_per_frame
    for frame in decoder.decode(streams["video"], plan.width, plan.height):
        start = frames * tpf
        frames += 1
        if start >= h.tokens:
            raise CorruptStreamError(f"video stream has more frames than the {h.frames} announced")
        restorer.restore(frame.to(device, non_blocking=True), start, min(tpf, h.tokens - start), target)
    if frames != h.frames:
        raise CorruptStreamError(f"video stream decoded to {frames} frames, header announces {h.frames}")
    return out


class _IdleDecoders:
    """Decoders not in use, per device, lent to decode calls that bring none. Opening an NVDEC
    session costs more than decoding a chunk, and a session must not serve two threads at once:
    a call borrows one (or opens one when all are busy) and gives it back when done, so a
    process holds as many sessions as it ever decoded concurrently, whatever its threads."""

    def __init__(self) -> None:
        self._idle: dict[torch.device, list] = {}
        self._lock = threading.Lock()

    @contextlib.contextmanager
    def borrow(self, device: str | torch.device):
        device = torch.device(device)
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        with self._lock:
            free = self._idle.setdefault(device, [])
            decoder = free.pop() if free else None
        if decoder is None:
            decoder = get_decoder(device, fallback=True)
        try:
            yield decoder
        finally:
            with self._lock:
                self._idle[device].append(decoder)

    def close_idle(self) -> int:
        """Close every idle decoder (an NVDEC session frees its GPU memory) and let go of it;
        decoders lent out stay theirs. Returns how many were let go."""
        with self._lock:
            decoders = [d for free in self._idle.values() for d in free]
            for free in self._idle.values():
                free.clear()
        for decoder in decoders:
            close = getattr(decoder, "close", None)  # the CPU decoders hold nothing to close
            if close is not None:
                close()
        return len(decoders)


idle_decoders = _IdleDecoders()


def decoder_name(device: str | torch.device) -> str:
    """The name of the video decoder a decode on `device` uses (e.g. "ffmpeg-cpu" where a CUDA
    device has no NVDEC)."""
    with idle_decoders.borrow(device) as lent:
        return lent.name


HOST_ZSTD_DECODER = "zstd-host"


def sample_decoders(coders: Iterable[str], device: str | torch.device, video: str | None = None) -> str:
    """The decoders that chunks whose samples are coded by `coders` ("zstd", "hevc") use on
    `device`, joined by "+": zstd-host for zstd'd samples, for video `video` or else the video
    decoder a decode on `device` borrows."""
    names = (HOST_ZSTD_DECODER if c == "zstd" else video or decoder_name(device) for c in dict.fromkeys(coders))
    return "+".join(names)
