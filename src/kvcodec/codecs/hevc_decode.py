"""HEVC codec, decode side: chunk blob -> frames, one at a time, from the best decoder for the
device -> de-tiled, merged with the low bit planes, uncentered and dequantized straight into the
caller's target (a dense slice or a PagedKV)."""

from __future__ import annotations

import contextlib
import functools
import threading

import numpy as np
import torch
import zstandard

from kvcodec.codecs.base import Target
from kvcodec.codecs.hevc_encode import unit_bits
from kvcodec.container import split
from kvcodec.container.format import PLAIN, ChunkHeader, StreamEntry, parse_chunk, split_streams
from kvcodec.container.plain import plain_values
from kvcodec.container.split import SplitHeader
from kvcodec.dtypes import dtype_of
from kvcodec.errors import CorruptStreamError, FormatError, ShapeError
from kvcodec.layout.tiling import LayoutPlan, frame_blocks, gather_index, pack_frame
from kvcodec.quant import bitsplit, centering
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


def _side_params(h: ChunkHeader, streams, device) -> tuple[torch.Tensor, torch.Tensor]:
    dtype = dtype_of(h.param_dtype, "chunk blob parameter dtype")
    n = 2 * h.layers * 2 * h.kv_heads * h.head_dim * dtype.itemsize
    wrong = "quantization parameters have the wrong size for the announced shape"
    params = _stream_tensor(streams["side"], True, n, device, "side", wrong).view(dtype)
    params = params.view(2, h.layers, 2, h.kv_heads, h.head_dim)
    return params[0], params[1]


def _centers(h: ChunkHeader, streams, device) -> torch.Tensor:
    units = h.layers * 2 * h.kv_heads
    wrong = "channel centers have the wrong size for the announced shape"
    return _stream_tensor(streams["center"], True, units * h.head_dim, device, "center", wrong).view(units, h.head_dim)


def _byte_stream(entry: StreamEntry, streams, size: int, device) -> torch.Tensor:
    """A zstd- or raw-coded stream of exactly `size` bytes, as a flat uint8 tensor on `device`."""
    wrong = f"stream {entry.name!r} holds {{got}} bytes, expected {size}"
    return _stream_tensor(streams[entry.name], entry.codec == "zstd", size, device, entry.name, wrong)


def _stream_tensor(data, coded: bool, size: int, device, name: str, wrong: str) -> torch.Tensor:
    """A zstd-coded (`coded`) or raw stream that must hold exactly `size` bytes, as a flat uint8
    tensor on `device`. The bytes are decompressed or copied once, into a fresh host buffer; for
    CUDA that buffer is pinned and uploaded asynchronously on the current stream, so a decoder
    thread never waits for its stream's earlier work (a pageable copy would), and the pinned
    allocator keeps the buffer until the copy has run."""
    device = torch.device(device)
    host = torch.empty(size, dtype=torch.uint8, pin_memory=device.type == "cuda")
    got = _unzstd_into(data, host.numpy(), name) if coded else _copy_into(data, host.numpy())
    if got != size:
        raise CorruptStreamError(wrong.format(got=got))
    return host.to(device, non_blocking=True) if device.type == "cuda" else host


def _copy_into(data, buf: np.ndarray) -> int:
    """Copy `data` into `buf` when the sizes agree (numpy copies without the GIL); data's size."""
    if len(data) == buf.size:
        buf[:] = np.frombuffer(data, dtype=np.uint8)
    return len(data)


@functools.lru_cache(maxsize=256)
def _unit_terms(layer_bits: tuple[int, ...], layers: int, kv_heads: int, video_bits: int, device: str):
    """(low bit planes, per-unit low bit counts, per-unit modulus) of a header's shape, the tensors
    on `device`, made once per shape: a CUDA upload is waited for here, so any stream may read them."""
    ubits = unit_bits(layer_bits, layers, kv_heads)
    counts = bitsplit.low_bit_counts(ubits, video_bits)
    on_device = counts.to(device), (2**ubits).to(device)
    if torch.device(device).type == "cuda":
        torch.cuda.current_stream(device).synchronize()
    return bitsplit.plane_count(counts), *on_device


_zstd = threading.local()  # a decompression context per thread: making one per stream costs more than small streams


def _unzstd_into(data, buf: np.ndarray, name: str) -> int:
    """Decompress `data` into `buf`; the decompressed size (buf.size + 1 when there is more)."""
    dctx = getattr(_zstd, "dctx", None)
    if dctx is None:
        dctx = _zstd.dctx = zstandard.ZstdDecompressor()
    view, got = memoryview(buf).cast("B"), 0
    try:
        with dctx.stream_reader(data) as reader:
            while got < buf.size:
                n = reader.readinto(view[got:])
                if not n:
                    return got
                got += n
            return got + len(reader.read(1))
    except zstandard.ZstdError as e:
        raise CorruptStreamError(f"stream {name!r} does not decompress: {e}") from e


def _exact_byte_planes(h: ChunkHeader, streams, device) -> list[torch.Tensor]:
    n = h.layers * 2 * h.tokens * h.kv_heads * h.head_dim
    return [_byte_stream(s, streams, n, device).view(h.shape) for s in h.streams if s.name.startswith("bytes")]


def _low_bit_planes(h: ChunkHeader, streams, planes: int, device) -> torch.Tensor | None:
    if "low" not in streams:
        if planes:
            raise FormatError(f"chunk codes {h.video_bits} video bits but has no low bit stream")
        return None
    units = h.layers * 2 * h.kv_heads
    if not planes or not bitsplit.can_split(units, h.head_dim):
        raise FormatError(f"chunk has a low bit stream it cannot use (video_bits={h.video_bits})")
    entry = next(s for s in h.streams if s.name == "low")
    return _byte_stream(entry, streams, planes * h.tokens * units * h.head_dim // 8, device).view(planes, -1)


def _chunk_terms(h: ChunkHeader, plan: LayoutPlan, streams, dtype: torch.dtype, device) -> ChunkTerms:
    if not 1 <= h.video_bits <= 8:
        raise FormatError(f"chunk blob has video_bits={h.video_bits}, outside 1..8")
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    planes, counts, modulus = _unit_terms(h.layer_bits, h.layers, h.kv_heads, h.video_bits, str(device))
    shift, mask = centering.uncenter_terms(_centers(h, streams, device), modulus)
    common = dict(
        plan=plan,
        layers=h.layers,
        kv_heads=h.kv_heads,
        head_dim=h.head_dim,
        tokens=h.tokens,
        dtype=dtype,
        positions=gather_index(plan, device),
        shift=shift,
        mask=mask,
        low_counts=counts,
        low_planes=_low_bit_planes(h, streams, planes, device),
    )
    if h.quant == "exact":
        byte_planes = _exact_byte_planes(h, streams, device)
        if len(byte_planes) != exact_q.bytes_per_value(dtype) - 1:
            raise FormatError(f"exact chunk carries {len(byte_planes)} low byte planes for {h.dtype}")
        return ChunkTerms(**common, byte_planes=tuple(byte_planes))
    offset, step = _side_params(h, streams, device)
    return ChunkTerms(**common, offset=offset, step=step)


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
    if h.quant == PLAIN:
        return _restore_plain(h, streams, device, out)
    required = {"center"} | ({"side"} if h.quant != "exact" else set())
    if not required <= streams.keys() or not ({"video", "samples"} & streams.keys()):
        raise FormatError(f"chunk blob lacks streams (has {sorted(streams)})")
    dtype = dtype_of(h.dtype, "chunk blob dtype")
    out, device = _target(h, dtype, device, out)
    plan = _layout(h)
    terms = _chunk_terms(h, plan, streams, dtype, device)
    restorer = restorer_for(terms, prefer=restore)
    if decoder is None:
        with idle_decoders.borrow(device) as lent:
            return _restore_frames(h, plan, streams, lent, restorer, device, out)
    return _restore_frames(h, plan, streams, decoder, restorer, device, out)


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


def _restore_frames(h: ChunkHeader, plan: LayoutPlan, streams, decoder, restorer, device, out):
    target = PagedChunk(out, h.start_token) if isinstance(out, PagedKV) else out
    frames = 0
    tpf = plan.tokens_per_frame
    for frame in _frames(h, plan, streams, decoder):
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


idle_decoders = _IdleDecoders()


def _frames(h: ChunkHeader, plan: LayoutPlan, streams, decoder):
    """Decoded frames, one at a time: from the HEVC stream, or rebuilt from zstd-coded samples."""
    if "video" in streams:
        yield from decoder.decode(streams["video"], plan.width, plan.height)
        return
    units = h.layers * 2 * h.kv_heads
    wrong = "sample stream has the wrong size for the announced shape"
    samples = _stream_tensor(streams["samples"], True, units * h.tokens * h.head_dim, "cpu", "samples", wrong)
    samples = samples.view(units, h.tokens, h.head_dim)
    for _, _, block in frame_blocks(samples, plan):
        yield pack_frame(block, plan)


def decoder_name(device: str | torch.device) -> str:
    """The name of the video decoder a decode on `device` uses (e.g. "ffmpeg-cpu" where a CUDA
    device has no NVDEC)."""
    with idle_decoders.borrow(device) as lent:
        return lent.name
