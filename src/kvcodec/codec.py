"""KV cache <-> lossless HEVC containers: the codec's encode and decode paths.

encode:  KV (layers, 2, tokens, kv_heads, head_dim)
         -> chunks of config.chunk_tokens tokens
         -> integers (min-max quantization) or ordered byte planes (exact)
         -> frames laid out by a searched LayoutPlan, one per resolution
         -> lossless HEVC per (chunk, resolution) = one self-contained chunk blob
decode:  chunk blob -> frames, one at a time, from the best decoder for the device
         -> de-tiled and dequantized straight into the output KV tensor
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import threading
from collections.abc import Callable, Sequence

import numpy as np
import torch
import zstandard

from kvcodec.config import CodecConfig
from kvcodec.container.format import (
    CHUNK_MAGIC,
    FILE_MAGIC,
    BlobEntry,
    ChunkHeader,
    FileHeader,
    StreamEntry,
    crc32,
    object_version,
    read_object,
    split_streams,
    write_object,
)
from kvcodec.errors import (
    ChecksumError,
    CorruptStreamError,
    FormatError,
    ShapeError,
    TruncatedError,
)
from kvcodec.layout.search import choose_plan, choose_video_bits
from kvcodec.layout.tiling import LayoutPlan, frame_blocks, gather_index, pack_frame
from kvcodec.quant import bitsplit, centering
from kvcodec.quant import exact as exact_q
from kvcodec.quant import integer as int_q
from kvcodec.restore import ChunkTerms, restorer_for
from kvcodec.restore.paged import PagedChunk, PagedKV
from kvcodec.video.registry import get_decoder, get_encoder

log = logging.getLogger(__name__)

DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}
DTYPE_NAMES = {v: k for k, v in DTYPES.items()}
SIDE_ZSTD_LEVEL = 19
BYTES_ZSTD_LEVEL = 3
LOW_ZSTD_LEVEL = 1  # low bit planes are near-random: zstd only removes planes a unit does not use
SAMPLES_ZSTD_LEVEL = 19


@dataclasses.dataclass(frozen=True)
class EncodedChunk:
    """One chunk of tokens, as one self-contained blob per resolution (config.resolutions order)."""

    index: int
    start_token: int
    tokens: int
    resolutions: tuple[tuple[int, int], ...]
    blobs: tuple[bytes, ...]

    def blob_for(self, resolution: tuple[int, int]) -> bytes:
        return self.blobs[self.resolutions.index(tuple(resolution))]


# ---------------------------------------------------------------------------------------- encode


def check_kv(kv: torch.Tensor, config: CodecConfig | None = None) -> None:
    if not isinstance(kv, torch.Tensor):
        raise ShapeError(f"KV must be a torch.Tensor, got {type(kv).__name__}")
    if kv.dim() != 5 or kv.shape[1] != 2:
        raise ShapeError(
            f"KV must have shape (layers, 2, tokens, kv_heads, head_dim) with 2 = K/V; got {tuple(kv.shape)}"
        )
    if kv.dtype not in DTYPE_NAMES:
        raise ShapeError(f"KV dtype must be float16, bfloat16 or float32; got {kv.dtype}")
    if min(kv.shape) == 0:
        raise ShapeError(f"KV has an empty dimension: {tuple(kv.shape)}")
    if config is not None and config.layer_bits and len(config.layer_bits) != kv.shape[0]:
        raise ShapeError(f"config.layer_bits has {len(config.layer_bits)} entries, KV has {kv.shape[0]} layers")
    if config is not None and not config.is_exact and not torch.isfinite(kv).all():
        raise ShapeError("KV holds NaN or infinity; integer quantization needs finite values (use quant='exact')")


def _units(x: torch.Tensor) -> torch.Tensor:
    """(layers, 2, tokens, heads, dim) -> (layers*2*heads, tokens, dim)."""
    L, _, T, H, D = x.shape
    return x.permute(0, 1, 3, 2, 4).reshape(L * 2 * H, T, D)


def _bits(config: CodecConfig, layers: int) -> torch.Tensor:
    return torch.tensor([config.bits_for_layer(i) for i in range(layers)], dtype=torch.int64)


def _zstd(data: bytes, level: int) -> bytes:
    return zstandard.ZstdCompressor(level=level).compress(data)


@dataclasses.dataclass(frozen=True)
class _ChunkSymbols:
    """What a chunk becomes before video coding: the 8-bit samples and the side streams."""

    samples: torch.Tensor  # (units, tokens, dim) uint8, centered
    side: list[StreamEntry]
    side_payloads: list[bytes]
    param_dtype: str
    unit_bits: torch.Tensor  # (units,) significant bits of each unit's samples


def _unit_bits(layer_bits: Sequence[int], layers: int, kv_heads: int) -> torch.Tensor:
    """Significant bits of each unit's samples, (units,) int64 (8 for exact mode's top bytes)."""
    bits = torch.tensor(list(layer_bits) if layer_bits else [8] * layers, dtype=torch.int64)
    return bits.repeat_interleave(2 * kv_heads)


def _unit_modulus(layer_bits: Sequence[int], layers: int, kv_heads: int) -> torch.Tensor:
    return 2 ** _unit_bits(layer_bits, layers, kv_heads)


def _centered(symbols: torch.Tensor, modulus: torch.Tensor) -> tuple[torch.Tensor, StreamEntry, bytes]:
    centers = centering.channel_centers(symbols, modulus)
    data = _zstd(centers.numpy().tobytes(), SIDE_ZSTD_LEVEL)
    return centering.center(symbols, centers, modulus), StreamEntry("center", "zstd", len(data), crc32(data)), data


def _symbols(x: torch.Tensor, config: CodecConfig) -> _ChunkSymbols:
    L, H = x.shape[0], x.shape[3]
    if config.is_exact:
        planes = exact_q.split_bytes(x.contiguous())
        side, payloads = [], []
        for i, plane in enumerate(planes[1:], start=1):
            raw = plane.numpy().tobytes()
            packed = _zstd(raw, BYTES_ZSTD_LEVEL)
            codec, data = ("zstd", packed) if len(packed) < len(raw) else ("raw", raw)
            side.append(StreamEntry(f"bytes{i}", codec, len(data), crc32(data)))
            payloads.append(data)
        samples, entry, data = _centered(_units(planes[0]), _unit_modulus((), L, H))
        return _ChunkSymbols(samples, [entry, *side], [data, *payloads], "", _unit_bits((), L, H))
    bits = _bits(config, x.shape[0])
    offset, step = int_q.minmax_params(x, bits)
    q = int_q.quantize(x, offset, step, bits)
    params = torch.stack([offset, step]).contiguous()
    data = _zstd(params.numpy().tobytes(), SIDE_ZSTD_LEVEL)
    samples, entry, centers = _centered(_units(q), _unit_modulus(bits.tolist(), L, H))
    side = [StreamEntry("side", "zstd", len(data), crc32(data)), entry]
    return _ChunkSymbols(samples, side, [data, centers], DTYPE_NAMES[params.dtype], _unit_bits(bits.tolist(), L, H))


def _split_low_bits(symbols: _ChunkSymbols, video_bits: int) -> tuple[torch.Tensor, list[StreamEntry], list[bytes]]:
    """The samples the video codes (top video_bits bits) and the low bit planes as a stream."""
    counts = bitsplit.low_bit_counts(symbols.unit_bits, video_bits)
    if bitsplit.plane_count(counts) == 0:
        return symbols.samples, [], []
    high, low = bitsplit.split(symbols.samples, counts)
    raw = bitsplit.pack_low(low, counts).numpy().tobytes()
    packed = _zstd(raw, LOW_ZSTD_LEVEL)
    codec, data = ("zstd", packed) if len(packed) < len(raw) else ("raw", raw)
    return high, [StreamEntry("low", codec, len(data), crc32(data))], [data]


@dataclasses.dataclass(frozen=True)
class CodingPlan:
    """Decisions made once per (model shape, config) by trial encodes on the first chunk."""

    layouts: tuple[LayoutPlan, ...]  # one per resolution, config.resolutions order
    video_bits: int


def _code_samples(frames, samples, plan, config, encoder, zstd_cache) -> tuple[str, str, bytes]:
    """The sample planes as ("video", "hevc", bitstream) or ("samples", "zstd", bytes), as
    config.sample_coder asks; "auto" keeps the smaller."""
    options = []
    if config.sample_coder in ("hevc", "auto"):
        options.append(("video", "hevc", encoder.encode(frames, plan.width, plan.height)))
    if config.sample_coder in ("zstd", "auto"):
        if "z" not in zstd_cache:
            zstd_cache["z"] = _zstd(samples.numpy().tobytes(), SAMPLES_ZSTD_LEVEL)
        options.append(("samples", "zstd", zstd_cache["z"]))
    return min(options, key=lambda o: len(o[2]))


def plan_coding(kv: torch.Tensor, config: CodecConfig, encoder=None) -> CodingPlan:
    """The video bits and one layout per resolution, searched on the first chunk of `kv`
    (cached per process)."""
    check_kv(kv, config)
    encoder = encoder or get_encoder(preset=config.x265_preset)
    first = kv[:, :, : config.chunk_tokens].detach().to("cpu")
    symbols = _symbols(first, config)
    key = (config.quant, DTYPE_NAMES[kv.dtype], config.layer_bits)
    units, _, dim = symbols.samples.shape
    if not bitsplit.can_split(units, dim):
        if config.video_bits not in ("auto", bitsplit.FULL):
            log.info("%d units x %d channels do not fill whole bytes of a bit plane: every bit in the video", units, dim)
        video_bits = bitsplit.FULL
    elif config.video_bits == "auto":
        video_bits = choose_video_bits(
            config.resolutions[0], symbols.samples, symbols.unit_bits, config.chunk_tokens, encoder, key=key
        )
    else:
        video_bits = int(config.video_bits)
    samples, _, _ = _split_low_bits(symbols, video_bits)
    key = (*key, video_bits)
    layouts = tuple(
        choose_plan(res, samples, config.chunk_tokens, encoder, key=key, search=config.search_layout)
        for res in config.resolutions
    )
    return CodingPlan(layouts, video_bits)


def encode_chunks(
    kv: torch.Tensor,
    config: CodecConfig = CodecConfig(),
    *,
    encoder=None,
    plan: CodingPlan | None = None,
    on_chunk: Callable[[EncodedChunk], None] | None = None,
    first_chunk_index: int = 0,
) -> list[EncodedChunk]:
    """Encode `kv` chunk by chunk; every chunk is stored at every resolution of `config`.

    `first_chunk_index` numbers chunks when `kv` continues an earlier prefix (its first token is
    `first_chunk_index * config.chunk_tokens`). `on_chunk` is called as each chunk is done."""
    check_kv(kv, config)
    kv = kv.detach().to("cpu")
    encoder = encoder or get_encoder(preset=config.x265_preset)
    plan = plan or plan_coding(kv, config, encoder)
    L, _, T, H, D = kv.shape
    out = []
    for n, start in enumerate(range(0, T, config.chunk_tokens)):
        x = kv[:, :, start : start + config.chunk_tokens]
        symbols = _symbols(x, config)
        samples, low_streams, low_payloads = _split_low_bits(symbols, plan.video_bits)
        zstd_samples = {}  # resolution-independent, computed at most once per chunk
        blobs = []
        for layout in plan.layouts:
            frames = [pack_frame(b, layout).numpy() for _, _, b in frame_blocks(samples, layout)]
            name, codec, video = _code_samples(frames, samples, layout, config, encoder, zstd_samples)
            streams = (*symbols.side, *low_streams, StreamEntry(name, codec, len(video), crc32(video)))
            header = ChunkHeader(
                layers=L,
                kv_heads=H,
                head_dim=D,
                dtype=DTYPE_NAMES[kv.dtype],
                chunk_index=first_chunk_index + n,
                start_token=(first_chunk_index * config.chunk_tokens) + start,
                tokens=x.shape[2],
                quant=config.quant,
                layer_bits=tuple(int(b) for b in _bits(config, L)) if not config.is_exact else (),
                param_dtype=symbols.param_dtype,
                resolution=(layout.width, layout.height),
                layout=layout.to_dict(),
                frames=len(frames),
                streams=streams,
                video_bits=plan.video_bits,
            )
            blobs.append(write_object(CHUNK_MAGIC, header.to_json(), [*symbols.side_payloads, *low_payloads, video]))
        chunk = EncodedChunk(first_chunk_index + n, header.start_token, x.shape[2], config.resolutions, tuple(blobs))
        out.append(chunk)
        if on_chunk:
            on_chunk(chunk)
    return out


def encode(
    kv: torch.Tensor,
    config: CodecConfig = CodecConfig(),
    *,
    encoder=None,
    on_chunk: Callable[[EncodedChunk], None] | None = None,
) -> bytes:
    """Encode a KV tensor (layers, 2, tokens, kv_heads, head_dim) into a kvcodec file (.kvc)."""
    chunks = encode_chunks(kv, config, encoder=encoder, on_chunk=on_chunk)
    entries, payloads, offset = [], [], 0
    for c in chunks:
        for res, blob in zip(c.resolutions, c.blobs):
            entries.append(BlobEntry(c.index, tuple(res), offset, len(blob), crc32(blob)))
            payloads.append(blob)
            offset += len(blob)
    L, _, T, H, D = kv.shape
    header = FileHeader(
        layers=L,
        kv_heads=H,
        head_dim=D,
        dtype=DTYPE_NAMES[kv.dtype],
        tokens=T,
        config=config.to_dict(),
        chunk_tokens=tuple(c.tokens for c in chunks),
        blobs=tuple(entries),
    )
    return write_object(FILE_MAGIC, header.to_json(), payloads)


# ---------------------------------------------------------------------------------------- decode


def inspect_chunk_blob(blob: bytes | memoryview) -> ChunkHeader:
    """Parse and verify a chunk blob's header (not its streams)."""
    header, _ = read_object(blob, CHUNK_MAGIC, "kvcodec chunk blob")
    return ChunkHeader.from_json(header)


def read_file_header(data: bytes | memoryview) -> tuple[FileHeader, memoryview]:
    header, payload = read_object(data, FILE_MAGIC, "kvcodec file")
    fh = FileHeader.from_json(header)
    need = max((b.offset + b.length for b in fh.blobs), default=0)
    if len(payload) < need:
        raise TruncatedError(f"kvcodec file truncated: payload has {len(payload)} of {need} bytes")
    return fh, payload


def _side_params(h: ChunkHeader, streams, device) -> tuple[torch.Tensor, torch.Tensor]:
    dtype = DTYPES.get(h.param_dtype)
    if dtype is None:
        raise FormatError(f"chunk blob has unknown parameter dtype {h.param_dtype!r}")
    raw = _unzstd(streams["side"], "side")
    n = h.layers * 2 * h.kv_heads * h.head_dim
    if len(raw) != 2 * n * torch.tensor([], dtype=dtype).element_size():
        raise CorruptStreamError("quantization parameters have the wrong size for the announced shape")
    params = torch.frombuffer(bytearray(raw), dtype=dtype).view(2, h.layers, 2, h.kv_heads, h.head_dim)
    return params[0].to(device), params[1].to(device)


def _centers(h: ChunkHeader, streams, device) -> torch.Tensor:
    raw = _unzstd(streams["center"], "center")
    units = h.layers * 2 * h.kv_heads
    if len(raw) != units * h.head_dim:
        raise CorruptStreamError("channel centers have the wrong size for the announced shape")
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(units, h.head_dim).to(device)


def _unzstd(data, name: str, size: int | None = None) -> bytes:
    try:
        return zstandard.ZstdDecompressor().decompress(bytes(data), max_output_size=size or (1 << 31))
    except zstandard.ZstdError as e:
        raise CorruptStreamError(f"stream {name!r} does not decompress: {e}") from e


def _byte_stream(entry: StreamEntry, streams, size: int, device) -> torch.Tensor:
    """A zstd- or raw-coded stream of exactly `size` bytes, as a flat uint8 tensor on `device`."""
    raw = _unzstd(streams[entry.name], entry.name, size) if entry.codec == "zstd" else bytes(streams[entry.name])
    if len(raw) != size:
        raise CorruptStreamError(f"stream {entry.name!r} holds {len(raw)} bytes, expected {size}")
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8).to(device)


def _exact_byte_planes(h: ChunkHeader, streams, device) -> list[torch.Tensor]:
    n = h.layers * 2 * h.tokens * h.kv_heads * h.head_dim
    return [_byte_stream(s, streams, n, device).view(h.shape) for s in h.streams if s.name.startswith("bytes")]


def _low_bit_planes(h: ChunkHeader, streams, counts: torch.Tensor, device) -> torch.Tensor | None:
    planes = bitsplit.plane_count(counts)
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
    unit_bits = _unit_bits(h.layer_bits, h.layers, h.kv_heads)
    counts = bitsplit.low_bit_counts(unit_bits, h.video_bits)
    shift, mask = centering.uncenter_terms(_centers(h, streams, device), (2**unit_bits).to(device))
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
        low_counts=counts.to(device),
        low_planes=_low_bit_planes(h, streams, counts, device),
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
    out: torch.Tensor | PagedKV | None = None,
    decoder=None,
    restore: str = "auto",
) -> torch.Tensor | PagedKV:
    """Decode one chunk blob into a (layers, 2, tokens, kv_heads, head_dim) tensor on `device`,
    restoring frame by frame. With `out` (for example a slice of a preallocated KV cache) the
    values are written there and `out` is returned; `out` may also be a PagedKV (blocks of a paged
    cache and the sequence's block table): the chunk then fills its tokens' slots, from its
    header's start_token. `restore` picks the frame restorer ("auto": the fused GPU kernel where
    it applies; "torch"; "triton")."""
    header, payload = read_object(blob, CHUNK_MAGIC, "kvcodec chunk blob")
    h = ChunkHeader.from_json(header)
    streams = split_streams(payload, h.streams, f"chunk {h.chunk_index}")
    required = {"center"} | ({"side"} if h.quant != "exact" else set())
    if not required <= streams.keys() or not ({"video", "samples"} & streams.keys()):
        raise FormatError(f"chunk blob lacks streams (has {sorted(streams)})")
    dtype = DTYPES.get(h.dtype)
    if dtype is None:
        raise FormatError(f"chunk blob has unknown dtype {h.dtype!r}")
    if isinstance(out, PagedKV):
        out.check(h.shape, dtype, h.start_token)
        device = out.pages.device
    else:
        device = torch.device(device) if out is None else out.device
        if out is None:
            out = torch.empty(h.shape, dtype=dtype, device=device)
        elif tuple(out.shape) != h.shape or out.dtype != dtype:
            raise ShapeError(f"output tensor is {tuple(out.shape)} {out.dtype}; chunk holds {h.shape} {dtype}")
    try:
        plan = LayoutPlan.from_dict(h.layout)
    except (TypeError, ValueError, Exception) as e:
        raise FormatError(f"chunk blob has an invalid layout: {e}") from e
    if plan.units != h.layers * 2 * h.kv_heads or plan.dim != h.head_dim or (plan.width, plan.height) != h.resolution:
        raise FormatError("chunk blob layout does not match its shape")
    terms = _chunk_terms(h, plan, streams, dtype, device)
    restorer = restorer_for(terms, prefer=restore)
    if decoder is None:
        with _idle_decoders.borrow(device) as lent:
            return _restore_frames(h, plan, streams, lent, restorer, device, out)
    return _restore_frames(h, plan, streams, decoder, restorer, device, out)


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
            decoder = get_decoder(device)
        try:
            yield decoder
        finally:
            with self._lock:
                self._idle[device].append(decoder)


_idle_decoders = _IdleDecoders()


def _frames(h: ChunkHeader, plan: LayoutPlan, streams, decoder):
    """Decoded frames, one at a time: from the HEVC stream, or rebuilt from zstd-coded samples."""
    if "video" in streams:
        yield from decoder.decode(bytes(streams["video"]), plan.width, plan.height)
        return
    units = h.layers * 2 * h.kv_heads
    raw = _unzstd(streams["samples"], "samples", units * h.tokens * h.head_dim)
    if len(raw) != units * h.tokens * h.head_dim:
        raise CorruptStreamError("sample stream has the wrong size for the announced shape")
    samples = torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(units, h.tokens, h.head_dim)
    for _, _, block in frame_blocks(samples, plan):
        yield pack_frame(block, plan)


def file_chunks(
    data: bytes | memoryview,
    device: str | torch.device = "cpu",
    *,
    resolution: tuple[int, int] | None = None,
    out: torch.Tensor | PagedKV | None = None,
) -> tuple[torch.Tensor | PagedKV, list[tuple[memoryview, torch.Tensor | PagedKV]]]:
    """Parse and verify a kvcodec file for decoding: returns the output KV tensor (allocated on
    `device` unless `out` is given) and, per chunk, its blob at `resolution` (default: the largest)
    with the slice of the output it restores into (a PagedKV output is every chunk's target: each
    chunk finds its tokens' blocks from its own start_token). Decoders, serial or parallel, start here."""
    fh, payload = read_file_header(data)
    dtype = DTYPES.get(fh.dtype)
    if dtype is None:
        raise FormatError(f"kvcodec file has unknown dtype {fh.dtype!r}")
    if resolution is None:
        resolution = max(fh.resolutions, key=lambda r: r[0] * r[1])
    if isinstance(out, PagedKV):
        out.check(fh.shape, dtype, 0)
    elif out is None:
        out = torch.empty(fh.shape, dtype=dtype, device=torch.device(device))
    elif tuple(out.shape) != fh.shape or out.dtype != dtype:
        raise ShapeError(f"output tensor is {tuple(out.shape)} {out.dtype}; file holds {fh.shape} {dtype}")
    jobs, start = [], 0
    for index, tokens in enumerate(fh.chunk_tokens):
        entry = fh.blob(index, resolution)
        blob = payload[entry.offset : entry.offset + entry.length]
        if crc32(blob) != entry.crc32:
            raise ChecksumError(f"chunk {index} at {resolution[0]}x{resolution[1]} fails its checksum")
        jobs.append((blob, out if isinstance(out, PagedKV) else out[:, :, start : start + tokens]))
        start += tokens
    return out, jobs


def decode(
    data: bytes | memoryview,
    device: str | torch.device = "cpu",
    *,
    resolution: tuple[int, int] | None = None,
    out: torch.Tensor | PagedKV | None = None,
    decoder=None,
    restore: str = "auto",
) -> torch.Tensor | PagedKV:
    """Decode a kvcodec file into a KV tensor of its original shape and dtype on `device`
    (NVDEC for CUDA devices where available, restoring frame by frame; `out` and `restore` as in
    decode_chunk_blob)."""
    out, jobs = file_chunks(data, device, resolution=resolution, out=out)
    with contextlib.nullcontext(decoder) if decoder is not None else _idle_decoders.borrow(out.device) as dec:
        for blob, target in jobs:
            decode_chunk_blob(blob, out=target, decoder=dec, restore=restore)
    return out


def inspect(data: bytes | memoryview) -> dict:
    """Summary of a kvcodec file: header, per-resolution bytes and ratio vs fp16."""
    fh, payload = read_file_header(data)
    fp16_bytes = 2 * int(np.prod(fh.shape))
    per_res = {}
    for res in fh.resolutions:
        blobs = [b for b in fh.blobs if b.resolution == tuple(res)]
        total = sum(b.length for b in blobs)
        first = inspect_chunk_blob(payload[blobs[0].offset : blobs[0].offset + blobs[0].length])
        streams: dict[str, int] = {}
        for b in blobs:
            for s in inspect_chunk_blob(payload[b.offset : b.offset + b.length]).streams:
                streams[s.name] = streams.get(s.name, 0) + s.length
        per_res[f"{res[0]}x{res[1]}"] = {
            "bytes": total,
            "ratio_vs_fp16": fp16_bytes / total,
            "streams": streams,
            "layout": first.layout,
            "frames_per_chunk": first.frames,
            "video_bits": first.video_bits,
        }
    return {
        "format_version": object_version(data),
        "shape": list(fh.shape),
        "dtype": fh.dtype,
        "tokens": fh.tokens,
        "chunks": len(fh.chunk_tokens),
        "config": fh.config,
        "file_bytes": len(data),
        "fp16_bytes": fp16_bytes,
        "resolutions": per_res,
    }
