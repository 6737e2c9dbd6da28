"""HEVC codec, encode side: KV chunks -> integers or byte planes -> tiled frames -> lossless HEVC.

KV (layers, 2, tokens, kv_heads, head_dim)
-> chunks of config.chunk_tokens tokens
-> integers (min-max quantization) or ordered byte planes (exact), centered per channel
-> top `video_bits` bits in frames laid out by a searched LayoutPlan (one per resolution),
   the low bits as packed planes
-> one self-contained chunk blob per (chunk, resolution)
"""

from __future__ import annotations

import collections
import contextlib
import contextvars
import dataclasses
import functools
import json
import logging
import os
import sys
import threading
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch
import zstandard

from kvcodec.codecs.base import EncodedChunk, check_keys, chunk_key, collect_chunks
from kvcodec.codecs.zstd_streams import zstd_frames
from kvcodec.config import CodecConfig
from kvcodec.container import plain, split
from kvcodec.container.format import CHUNK_MAGIC, ChunkHeader, StreamEntry, crc32, parse_chunk, write_object
from kvcodec.container.split import layer_ranges
from kvcodec.dtypes import DTYPE_NAMES
from kvcodec.errors import ConfigError, ShapeError
from kvcodec.layout.search import (
    VIDEO_BITS_CANDIDATES,
    choose_plan,
    choose_sample_coding,
    encode_workers,
    once,
    recall,
    remember,
)
from kvcodec.layout.tiling import PAD_SAMPLE, LayoutPlan, frame_blocks, pack_frame, pixel_positions
from kvcodec.quant import bitsplit, centering
from kvcodec.quant import exact as exact_q
from kvcodec.quant import integer as int_q
from kvcodec.video import x265_cpu
from kvcodec.video.registry import get_encoder

log = logging.getLogger(__name__)

SIDE_ZSTD_LEVEL = 12  # 19 saved 0.1% of a chunk for 30 ms of its encode (kvcodec bench encode)
BYTES_ZSTD_LEVEL = 3
LOW_ZSTD_LEVEL = 1  # low bit planes are near-random: zstd only removes planes a unit does not use
SAMPLES_ZSTD_LEVEL = 1  # as small as 3-19 on int8/int4/exact samples of SmolLM2 and Qwen2.5 KV, 100x faster than 19


X265_TUNING = x265_cpu.FAST_TUNING  # the HEVC codec's x265 parameters (a benchmark may set the earlier "")


@dataclasses.dataclass(frozen=True)
class Background:
    """Encoding as background work (the engine's storer): at most `workers` chunk threads, each at
    `nice` more OS niceness than the process (0: the same priority)."""

    workers: int = 1
    nice: int = 0

    def __post_init__(self) -> None:
        if isinstance(self.workers, bool) or not isinstance(self.workers, int) or self.workers < 1:
            raise ConfigError(f"background encode workers must be an integer >= 1; got {self.workers!r}")
        if isinstance(self.nice, bool) or not isinstance(self.nice, int) or not 0 <= self.nice <= 19:
            raise ConfigError(f"background encode nice must be an integer in 0..19; got {self.nice!r}")


_BACKGROUND: contextvars.ContextVar[Background | None] = contextvars.ContextVar("kvcodec_background", default=None)


@contextlib.contextmanager
def background(settings: Background) -> Iterator[Background]:
    """Encodes started by this thread inside the block run as `settings` say (this thread too is
    lowered to its priority): the engine's storer, so that storing never takes cores from serving."""
    lower_priority(settings.nice)
    token = _BACKGROUND.set(settings)
    try:
        yield settings
    finally:
        _BACKGROUND.reset(token)


def background_settings() -> Background | None:
    """The Background settings of this thread's encodes (None: foreground, every core)."""
    return _BACKGROUND.get()


def lower_priority(nice: int) -> bool:
    """Run the calling thread at `nice` more OS niceness than the process's main thread (Linux:
    niceness is per thread; threads it starts later inherit it). Never raises the priority, and
    is quietly a no-op where the OS does not allow it or has no per-thread niceness; True when
    the thread now runs at that niceness."""
    if nice <= 0 or not sys.platform.startswith("linux"):
        return False
    try:
        tid = threading.get_native_id()
        target = min(19, os.getpriority(os.PRIO_PROCESS, os.getpid()) + nice)
        if os.getpriority(os.PRIO_PROCESS, tid) < target:
            os.setpriority(os.PRIO_PROCESS, tid, target)
        return os.getpriority(os.PRIO_PROCESS, tid) >= target
    except (AttributeError, OSError):  # pragma: no cover - sandboxes that forbid it
        return False


def default_encoder(config: CodecConfig):  # noqa: ANN201 - a VideoEncoder
    """The video encoder HEVC chunks are coded with: NVENC where the GPU has one, else x265 at
    config.x265_preset with X265_TUNING."""
    return get_encoder(preset=config.x265_preset, tuning=X265_TUNING)


def check_kv(kv: torch.Tensor, config: CodecConfig | None = None) -> None:
    if not isinstance(kv, torch.Tensor):
        raise ShapeError(f"KV must be a torch.Tensor, got {type(kv).__name__}")
    if kv.is_meta:
        raise ShapeError("KV is a meta tensor: it holds no values to encode")
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
    if config is not None and not config.is_exact and not all_finite(kv):
        raise ShapeError("KV holds NaN or infinity; integer quantization needs finite values (use quant='exact')")


def all_finite(x: torch.Tensor) -> bool:
    """Whether x holds no NaN or infinity: its minimum and maximum are finite (a NaN anywhere
    makes both NaN). One reduction: 40x faster than isfinite(x).all() on a CPU chunk of fp16 KV."""
    lo, hi = torch.aminmax(x)
    return bool(torch.isfinite(lo) & torch.isfinite(hi))


def _on_encode_device(kv: torch.Tensor) -> torch.Tensor:
    """KV on a CUDA device stays there: quantization, centering, the bit split and frame packing
    run on the GPU (the same integers as on the CPU) and only the 8-bit frames and side streams
    cross to the host (half of fp16's bytes, and the CPU cores are left to x265); elsewhere the CPU."""
    kv = kv.detach()
    return kv if kv.device.type == "cuda" else kv.to("cpu")


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


def unit_bits(layer_bits: Sequence[int], layers: int, kv_heads: int) -> torch.Tensor:
    """Significant bits of each unit's samples, (units,) int64 (8 for exact mode's top bytes)."""
    bits = torch.tensor(list(layer_bits) if layer_bits else [8] * layers, dtype=torch.int64)
    return bits.repeat_interleave(2 * kv_heads)


def _unit_modulus(layer_bits: Sequence[int], layers: int, kv_heads: int) -> torch.Tensor:
    return 2 ** unit_bits(layer_bits, layers, kv_heads)


def _side_stream(name: str, raw: bytes) -> tuple[StreamEntry, bytes]:
    """A side stream (quantization parameters, channel centers) as zstd and its entry."""
    data = _zstd(raw, SIDE_ZSTD_LEVEL)
    return StreamEntry(name, "zstd", len(data), crc32(data)), data


def _centered(symbols: torch.Tensor, modulus: torch.Tensor) -> tuple[torch.Tensor, StreamEntry, bytes]:
    centers = centering.channel_centers(symbols, modulus)
    return centering.center(symbols, centers, modulus), *_side_stream("center", centers.cpu().numpy().tobytes())


def _symbols(x: torch.Tensor, config: CodecConfig) -> _ChunkSymbols:
    L, H = x.shape[0], x.shape[3]
    if config.is_exact:
        planes = exact_q.split_bytes(x.contiguous())
        side, payloads = [], []
        for i, plane in enumerate(planes[1:], start=1):
            raw = plane.cpu().numpy().tobytes()
            packed = _zstd(raw, BYTES_ZSTD_LEVEL)
            codec, data = ("zstd", packed) if len(packed) < len(raw) else ("raw", raw)
            side.append(StreamEntry(f"bytes{i}", codec, len(data), crc32(data)))
            payloads.append(data)
        samples, entry, data = _centered(_units(planes[0]), _unit_modulus((), L, H))
        return _ChunkSymbols(samples, [entry, *side], [data, *payloads], "", unit_bits((), L, H))
    bits = _bits(config, x.shape[0])
    offset, step = int_q.minmax_params(x, bits)
    q = int_q.quantize(x, offset, step, bits)
    params = torch.stack([offset, step]).contiguous()
    side_entry, data = _side_stream("side", params.cpu().numpy().tobytes())
    samples, entry, centers = _centered(_units(q), _unit_modulus(bits.tolist(), L, H))
    side = [side_entry, entry]
    return _ChunkSymbols(samples, side, [data, centers], DTYPE_NAMES[params.dtype], unit_bits(bits.tolist(), L, H))


def _split_low_bits(symbols: _ChunkSymbols, video_bits: int) -> tuple[torch.Tensor, bytes | None]:
    """The samples the video codes (top video_bits bits) and the packed low bit planes (None: none)."""
    counts = bitsplit.low_bit_counts(symbols.unit_bits, video_bits)
    if bitsplit.plane_count(counts) == 0:
        return symbols.samples, None
    high, low = bitsplit.split(symbols.samples, counts)
    return high, bitsplit.pack_low(low, counts).cpu().numpy().tobytes()


def _low_stream(raw: bytes | None) -> tuple[list[StreamEntry], list[bytes]]:
    """The low bit planes' stream: zstd where it is smaller, else raw (none without planes)."""
    if raw is None:
        return [], []
    packed = _zstd(raw, LOW_ZSTD_LEVEL)
    codec, data = ("zstd", packed) if len(packed) < len(raw) else ("raw", raw)
    return [StreamEntry("low", codec, len(data), crc32(data))], [data]


@dataclasses.dataclass(frozen=True)
class CodingPlan:
    """Decisions made once per (model shape, config) by trial encodes on the first chunk: the
    layout per resolution, the bits per sample in the video, and how the samples are coded
    ("hevc": video for NVDEC; "zstd": zstd, restored on the host's cores)."""

    layouts: tuple[LayoutPlan, ...]  # one per resolution, config.resolutions order
    video_bits: int
    sample_coder: str = "hevc"

    def to_dict(self) -> dict:
        layouts = [p.to_dict() for p in self.layouts]
        return {"layouts": layouts, "video_bits": self.video_bits, "sample_coder": self.sample_coder}

    @classmethod
    def from_dict(cls, d: dict) -> CodingPlan:
        coder = d.get("sample_coder", "hevc")
        if coder not in ("hevc", "zstd"):
            raise ValueError(f"unknown sample coder {coder!r}")
        return cls(tuple(LayoutPlan.from_dict(p) for p in d["layouts"]), int(d["video_bits"]), coder)


def _code_samples(frames, samples, plan: CodingPlan, layout: LayoutPlan, encoder, zstd_cache) -> tuple[str, str, bytes]:
    """The sample planes as ("video", "hevc", bitstream) or ("samples", "zstd", bytes), as the
    plan decided (the zstd bytes are the same for every resolution: made once per chunk)."""
    if plan.sample_coder == "hevc":
        return "video", "hevc", encoder.encode(frames, layout.width, layout.height)
    if "z" not in zstd_cache:
        zstd_cache["z"] = zstd_samples(samples)
    return "samples", "zstd", zstd_cache["z"]


def zstd_samples(samples: torch.Tensor) -> bytes:
    """A chunk's samples (units, tokens, dim) uint8, zstd-coded (zstd_streams.zstd_frames: one
    frame and its seek table by default)."""
    return zstd_frames(samples.cpu().numpy().tobytes(), SAMPLES_ZSTD_LEVEL)


def plan_coding(kv: torch.Tensor, config: CodecConfig, encoder=None) -> CodingPlan:
    """The video bits and one layout per resolution, searched on the first chunk of `kv`: once
    per (KV shape and dtype, config, encoder settings), then recalled (kvcodec.layout.search keeps
    decisions for the process and on disk)."""
    check_kv(kv, config)
    return _plan(kv, config, encoder or default_encoder(config))


def _plan(kv: torch.Tensor, config: CodecConfig, encoder) -> CodingPlan:
    """plan_coding for KV already checked."""
    L, _, _, H, D = kv.shape
    plan_key = (json.dumps(config.to_dict(), sort_keys=True), L, H, D, DTYPE_NAMES[kv.dtype])
    with once("coding_plan", plan_key, encoder):  # documents encoding at once share one decision
        known = recall("coding_plan", plan_key, encoder)
        if isinstance(known, dict):
            try:
                plan = CodingPlan.from_dict(known)
                if len(plan.layouts) == len(config.resolutions):
                    return plan
            except (KeyError, TypeError, ValueError, ConfigError) as e:
                log.warning("ignoring a malformed cached coding plan: %s", e)
        plan = _search_plan(kv, config, encoder)
        remember("coding_plan", plan_key, encoder, plan.to_dict())
        return plan


def _search_plan(kv: torch.Tensor, config: CodecConfig, encoder) -> CodingPlan:
    first = _on_encode_device(kv[:, :, : config.chunk_tokens])
    symbols = _symbols(first, config)
    key = (config.quant, DTYPE_NAMES[kv.dtype], config.layer_bits)
    coder, video_bits = _sample_coding(symbols, config, encoder, key)
    samples, _ = _split_low_bits(symbols, video_bits)
    key = (*key, video_bits)
    search = config.search_layout and coder == "hevc"  # zstd'd samples are not laid out in frames
    layouts = tuple(
        choose_plan(res, samples, config.chunk_tokens, encoder, key=key, search=search) for res in config.resolutions
    )
    return CodingPlan(layouts, video_bits, coder)


def _sample_coding(symbols: _ChunkSymbols, config: CodecConfig, encoder, key: tuple) -> tuple[str, int]:
    """(sample coder, video bits) of a plan: as configured, or where "auto", the fewest bytes on
    the first chunk (kvcodec.layout.search.choose_sample_coding)."""
    units, _, dim = symbols.samples.shape
    if not bitsplit.can_split(units, dim):
        if config.video_bits not in ("auto", bitsplit.FULL):
            log.info(
                "%d units x %d channels do not fill whole bytes of a bit plane: every bit in the video", units, dim
            )
        candidates = (bitsplit.FULL,)
    elif config.video_bits == "auto":
        candidates = VIDEO_BITS_CANDIDATES if config.sample_coder != "zstd" else (bitsplit.FULL,)
    else:
        candidates = (int(config.video_bits),)
    if config.sample_coder != "auto" and len(candidates) == 1:  # zstd always has one: every bit, or as given
        return config.sample_coder, candidates[0]
    zstd_bytes = (lambda x: len(zstd_samples(x))) if config.sample_coder == "auto" else None
    return choose_sample_coding(
        config.resolutions[0],
        symbols.samples,
        symbols.unit_bits,
        config.chunk_tokens,
        encoder,
        key=key,
        video_bits=candidates,
        zstd_bytes=zstd_bytes,
    )


def encode_chunks(
    kv: torch.Tensor,
    config: CodecConfig = CodecConfig(),
    *,
    encoder=None,
    plan: CodingPlan | None = None,
    on_chunk: Callable[[EncodedChunk], None] | None = None,
    first_chunk_index: int = 0,
    keys: Sequence[str] | None = None,
) -> list[EncodedChunk]:
    """Encode `kv` chunk by chunk; every chunk is stored at every resolution of `config`.

    `first_chunk_index` numbers chunks when `kv` continues an earlier prefix (its first token is
    `first_chunk_index * config.chunk_tokens`). With `keys`, chunk n's header carries keys[n] (the
    prefix key it is stored under). `on_chunk` is called as each chunk is done."""
    check_kv(kv, config)
    kv = _on_encode_device(kv)
    n_chunks = -(-kv.shape[2] // config.chunk_tokens)
    check_keys(keys, n_chunks)
    encoder = encoder or default_encoder(config)
    groups = layer_ranges(kv.shape[0], config.streams_per_chunk)
    starts = list(range(0, kv.shape[2], config.chunk_tokens))
    # chunks in parallel, each on one encoder thread (the bitstream does not depend on the count),
    # where the encoder can make single-threaded copies of itself (x265; not a GPU session)
    parallel = callable(getattr(encoder, "with_threads", None))
    bg = background_settings()
    workers = min(encode_workers(), len(starts), bg.workers if bg else len(starts)) if parallel else 1
    # in the background every chunk is coded by one thread, never by x265's pool of every core
    chunk_encoder = encoder.with_threads(1) if parallel and (workers > 1 or bg) else encoder
    prepare = None
    if len(groups) > 1:
        encode_one = _split_encoder(kv, config, encoder, groups, chunk_encoder)
    else:
        plan = plan or _plan(kv, config, encoder)
        encode_one = functools.partial(_encode_chunk, config=config, plan=plan, encoder=chunk_encoder)
        if stage_on_caller(kv, workers):
            batch = stage_batch(kv, config.chunk_tokens, workers)
            prepare = batched(functools.partial(_prepare_from, kv, starts, batch=batch, config=config, plan=plan))

    def one(n: int, prepared: _Prepared | None = None) -> EncodedChunk:
        start = starts[n]
        return encode_one(
            kv[:, :, start : start + config.chunk_tokens],
            index=first_chunk_index + n,
            start_token=first_chunk_index * config.chunk_tokens + start,
            key=chunk_key(keys, n),
            **({"prepared": prepared} if prepared is not None else {}),
        )

    return collect_chunks(in_order(one, len(starts), workers, prepare), on_chunk)


def stage_on_caller(kv: torch.Tensor, workers: int) -> bool:
    """Whether chunks are prepared (quantized, packed, their frames brought to the host) on the
    calling thread, in order, with only the video encode on the `workers` chunk threads: for KV on
    a GPU, whose kernels and copies from every chunk thread would queue on the one stream and wait
    for the interpreter lock beside the encodes (on the CPU the preparation is work the threads share)."""
    return kv.is_cuda and workers > 1


# KV a batch of staged chunks takes (its working copies on the GPU, beside a serving model: a few times that).
# Small chunks gain (their kernels are launch-bound); a chunk of a 7-8B model (33 MB) is bandwidth-bound alone.
STAGE_BATCH_BYTES = 64 << 20


def stage_batch(kv: torch.Tensor, chunk_tokens: int, workers: int) -> int:
    """Chunks a staged encode prepares at once: one for each chunk thread (so that every thread has
    a chunk after one batch), within STAGE_BATCH_BYTES of KV."""
    chunk_bytes = kv[:, :, :chunk_tokens].numel() * kv.element_size()
    return max(1, min(workers, STAGE_BATCH_BYTES // chunk_bytes))


def batched(prepare_from: Callable[[int], dict[int, Any]]) -> Callable[[int], Any]:
    """prepare(n) for in_order from prepare_from(n), which prepares chunk n and perhaps some after it
    at once ({index: prepared}): a GPU runs one chunk's kernels in the time of their launches and
    waits; 16 chunks one by one kept the last chunk thread idle for a third of the encode."""
    ready: dict[int, Any] = {}

    def prepare(n: int) -> Any:  # noqa: ANN401
        if n not in ready:
            ready.update(prepare_from(n))
        return ready.pop(n)

    return prepare


def _prepare_from(kv, starts, n: int, *, batch: int, config, plan) -> dict[int, _Prepared]:  # noqa: ANN001
    """Chunk n and the whole chunks after it, at most `batch`, prepared at once ({index: _Prepared});
    a partial last chunk, a batch of one or KV the batch cannot take is prepared alone."""
    t = config.chunk_tokens
    whole = [i for i in range(n, min(n + batch, len(starts))) if starts[i] + t <= kv.shape[2]]
    if len(whole) > 1:
        done = _prepare_batch(kv[:, :, starts[n] : starts[whole[-1]] + t], len(whole), config=config, plan=plan)
        if done is not None:
            return dict(zip(whole, done))
    return {n: _prepare_chunk(kv[:, :, starts[n] : starts[n] + t], config=config, plan=plan)}


def in_order(
    fn: Callable[..., EncodedChunk], n: int, workers: int, prepare: Callable[[int], Any] | None = None
) -> Iterator[EncodedChunk]:
    """fn(0), ..., fn(n - 1) in order, computed by `workers` threads (x265, zstd and torch release
    the interpreter lock while they work). At most 2 * workers chunks are in flight, so a long KV
    never holds all its frames at once; an error stops the submission of further chunks.
    With `prepare`, chunk i is fn(i, prepare(i)), prepare running on the calling thread in order
    (a GPU's quantization and packing: on one thread its kernels and copies are not queued behind
    those of every other chunk thread on the one stream) while the threads run fn (the x265 encode).
    Under `background` settings at most their worker count, each thread at their priority; the
    threads run their CUDA work on the caller's current stream (not the device's default one)."""
    bg = background_settings()
    if bg is not None:
        workers = min(workers, bg.workers)
    if workers <= 1:
        yield from (fn(i) if prepare is None else fn(i, prepare(i)) for i in range(n))
        return
    init = functools.partial(_encode_thread, bg.nice if bg else 0, _caller_stream())
    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="kvcodec-encode", initializer=init) as pool:
        pending: collections.deque[Future] = collections.deque()
        try:
            for i in range(n):
                pending.append(pool.submit(fn, i) if prepare is None else pool.submit(fn, i, prepare(i)))
                while pending and (len(pending) >= 2 * workers or pending[0].done()):
                    yield pending.popleft().result()
            while pending:
                yield pending.popleft().result()
        finally:
            for f in pending:
                f.cancel()


def _caller_stream():  # noqa: ANN202 - a torch.cuda.Stream or None
    """The calling thread's current CUDA stream where CUDA is in use and it is not the default."""
    if not torch.cuda.is_available() or not torch.cuda.is_initialized():
        return None
    stream = torch.cuda.current_stream()
    return None if stream == torch.cuda.default_stream(stream.device) else stream


def _encode_thread(nice: int, stream) -> None:  # noqa: ANN001
    """Start of an encode thread: the caller's priority and CUDA stream."""
    lower_priority(nice)
    if stream is not None:
        torch.cuda.set_stream(stream)


def _split_encoder(
    kv: torch.Tensor, config: CodecConfig, encoder, groups, chunk_encoder=None
) -> Callable[..., EncodedChunk]:
    """A chunk encoder writing split chunk blobs (kvcodec.container.split): each layer group of
    `groups` coded as a chunk of its own (its own coding plan, searched on its layers), the parts
    joined per resolution. Plain fallback applies to the whole chunk, never to one part."""
    part_configs = [
        dataclasses.replace(config, layer_bits=config.layer_bits[a:b], streams_per_chunk=1, plain_fallback=False)
        for a, b in groups
    ]
    plans = [_plan(kv[a:b], c, encoder) for (a, b), c in zip(groups, part_configs)]
    chunk_encoder = chunk_encoder or encoder

    def encode_one(x, *, index: int, start_token: int, key: str | None) -> EncodedChunk:
        parts = [
            _encode_chunk(
                x[a:b], config=c, plan=p, encoder=chunk_encoder, index=index, start_token=start_token, key=key
            )
            for (a, b), c, p in zip(groups, part_configs, plans)
        ]
        blobs = []
        for r in range(len(config.resolutions)):
            part_blobs = [p.blobs[r] for p in parts]
            blob = split.write_split(part_blobs, [parse_chunk(b)[0] for b in part_blobs])
            if config.plain_fallback:
                blob = plain.keep_smaller(
                    blob, x, chunk_index=index, start_token=start_token, resolution=config.resolutions[r], key=key
                )
            blobs.append(blob)
        coders = ",".join(dict.fromkeys(c for p in parts for c in p.encoder.split(",") if c))
        return EncodedChunk(index, start_token, x.shape[2], config.resolutions, tuple(blobs), encoder=coders)

    return encode_one


def _to_host(frames: list[torch.Tensor]) -> list:
    """Packed frames (3, height, width) as host arrays: from a GPU in one copy (one wait on the
    encoding thread's stream instead of one per frame)."""
    if frames and frames[0].is_cuda:
        return list(torch.stack(frames).cpu().numpy())
    return [f.cpu().numpy() for f in frames]


@dataclasses.dataclass(frozen=True)
class _Prepared:
    """A chunk ready for video coding: its symbols, low bit planes and host frames per layout."""

    symbols: _ChunkSymbols
    samples: torch.Tensor
    low_planes: bytes | None  # packed, before zstd (on the chunk thread: it releases the interpreter lock)
    frames: tuple[list, ...]  # host frames of each layout of the plan


def _prepare_chunk(x, *, config, plan) -> _Prepared:
    """Quantization, centring, the bit split and frame packing of one chunk (on x's device), the
    frames brought to the host: everything before the video encode."""
    symbols = _symbols(x, config)
    samples, low_planes = _split_low_bits(symbols, plan.video_bits)
    frames = tuple(
        _to_host([pack_frame(b, layout) for _, _, b in frame_blocks(samples, layout)]) if _video(plan) else []
        for layout in plan.layouts
    )
    return _Prepared(symbols, samples, low_planes, frames)


def _video(plan: CodingPlan) -> bool:
    """Whether the plan codes samples as video (else their frames are never made)."""
    return plan.sample_coder == "hevc"


def _prepare_batch(x: torch.Tensor, chunks: int, *, config, plan) -> list[_Prepared] | None:  # noqa: ANN001
    """_prepare_chunk of `chunks` whole chunks at once (x: their tokens), with the same bytes as one
    by one: every step works per (chunk, layer, channel) or per unit, so the chunks ride along in
    the layer and unit dimensions, and their frames, planes and parameters come to the host in one
    copy each. None where the per-chunk path must decide: exact mode, or values beyond fp16 range
    (whose chunks take fp32 parameters, the others fp16)."""
    if config.is_exact:
        return None
    L, _, T, H, D = x.shape
    t = T // chunks
    stacked = x.reshape(L, 2, chunks, t, H, D).permute(2, 0, 1, 3, 4, 5).reshape(chunks * L, 2, t, H, D)
    bits = _bits(config, L)
    offset, step = int_q.minmax_params(stacked, bits.repeat(chunks))
    if offset.dtype != torch.float16:
        return None
    units = _units(int_q.quantize(stacked, offset, step, bits.repeat(chunks)))  # (chunks * U, t, D)
    modulus = _unit_modulus(bits.tolist(), L, H).repeat(chunks)
    centers = centering.channel_centers(units, modulus)
    centered = centering.center(units, centers, modulus)
    per_unit_bits = unit_bits(bits.tolist(), L, H)
    counts = bitsplit.low_bit_counts(per_unit_bits, plan.video_bits)
    planes = bitsplit.plane_count(counts)
    high, low = bitsplit.split(centered, counts.repeat(chunks)) if planes else (centered, None)
    params = torch.stack([offset, step]).view(2, chunks, L, 2, H, D).permute(1, 0, 2, 3, 4, 5)
    video_layouts = plan.layouts if _video(plan) else ()
    device = [params, centers.view(chunks, -1), *(_batch_frames(high, chunks, layout) for layout in video_layouts)]
    host_params, host_centers, *frames = host_arrays(
        [*device, _batch_low_planes(low, chunks, planes)] if planes else device
    )
    host_low = frames.pop() if planes else None
    units_per_chunk = units.shape[0] // chunks
    out = []
    for k in range(chunks):
        (side_entry, side_data), (center_entry, center_data) = (
            _side_stream("side", host_params[k].tobytes()),
            _side_stream("center", host_centers[k].tobytes()),
        )
        side = [side_entry, center_entry]
        rows = slice(k * units_per_chunk, (k + 1) * units_per_chunk)
        symbols = _ChunkSymbols(
            centered[rows], side, [side_data, center_data], DTYPE_NAMES[params.dtype], per_unit_bits
        )
        low_planes = host_low[k].tobytes() if planes else None
        chunk_frames = tuple(list(f[k]) for f in frames) if _video(plan) else tuple([] for _ in plan.layouts)
        out.append(_Prepared(symbols, high[rows], low_planes, chunk_frames))
    return out


def _batch_low_planes(low: torch.Tensor, chunks: int, planes: int) -> torch.Tensor:
    """bitsplit.pack_low of each chunk's rows of `low` (chunks * U, t, D), as (chunks, planes, bytes)."""
    _, t, d = low.shape
    flat = low.view(chunks, -1, t, d).permute(0, 2, 1, 3).reshape(-1)  # token-major within each chunk
    packed = bitsplit.pack_planes_torch(flat, planes)  # (planes, chunks * bytes): chunk-major columns
    return packed.view(planes, chunks, -1).permute(1, 0, 2).contiguous()


def _batch_frames(samples: torch.Tensor, chunks: int, layout: LayoutPlan) -> torch.Tensor:
    """The frames of each chunk's rows of `samples` (chunks * U, t, D) as frame_blocks and pack_frame
    make them: (chunks, frames, 3, height, width) uint8 on samples' device."""
    _, t, d = samples.shape
    per_frame = layout.tokens_per_frame
    n_frames = -(-t // per_frame)
    blocks = samples.new_full((chunks, samples.shape[0] // chunks, n_frames * per_frame, d), PAD_SAMPLE)
    blocks[:, :, :t] = samples.view(chunks, -1, t, d)
    blocks = blocks.view(chunks, -1, n_frames, per_frame, d).permute(0, 2, 1, 3, 4).reshape(chunks * n_frames, -1)
    frames = samples.new_zeros((chunks * n_frames, 3 * layout.height * layout.width))
    frames[:, pixel_positions(layout, samples.device)] = blocks
    return frames.view(chunks, n_frames, 3, layout.height, layout.width)


def host_arrays(tensors: list[torch.Tensor]) -> list[Any]:
    """Tensors on the host as numpy arrays: from a GPU through pinned memory, one wait for all (pageable
    copies ran at ~1.6 GB/s: 24 of a 16-chunk batch's 26 ms on the H200)."""
    if not tensors or not tensors[0].is_cuda:
        return [t.contiguous().numpy() for t in tensors]
    host = [torch.empty(t.shape, dtype=t.dtype, pin_memory=True) for t in tensors]
    for h, t in zip(host, tensors):
        h.copy_(t, non_blocking=True)
    torch.cuda.current_stream(tensors[0].device).synchronize()
    return [h.numpy() for h in host]


def _encode_chunk(x, *, config, plan, encoder, index, start_token, key, prepared=None) -> EncodedChunk:
    """One chunk at every resolution of `plan` (`prepared`: its _prepare_chunk, made elsewhere)."""
    L, _, T, H, D = x.shape
    p = prepared or _prepare_chunk(x, config=config, plan=plan)
    symbols = p.symbols
    low_streams, low_payloads = _low_stream(p.low_planes)
    zstd_cache = {}  # resolution-independent, computed at most once per chunk
    blobs, coders = [], []
    for layout, frames in zip(plan.layouts, p.frames):
        name, codec, video = _code_samples(frames, p.samples, plan, layout, encoder, zstd_cache)
        coders.append(getattr(encoder, "name", "hevc") if codec == "hevc" else codec)
        streams = (*symbols.side, *low_streams, StreamEntry(name, codec, len(video), crc32(video)))
        header = ChunkHeader(
            layers=L,
            kv_heads=H,
            head_dim=D,
            dtype=DTYPE_NAMES[x.dtype],
            chunk_index=index,
            start_token=start_token,
            tokens=T,
            quant=config.quant,
            layer_bits=tuple(int(b) for b in _bits(config, L)) if not config.is_exact else (),
            param_dtype=symbols.param_dtype,
            resolution=(layout.width, layout.height),
            layout=layout.to_dict(),
            frames=-(-T // layout.tokens_per_frame),
            streams=streams,
            video_bits=plan.video_bits,
            key=key,
        )
        coded = write_object(CHUNK_MAGIC, header.to_json(), [*symbols.side_payloads, *low_payloads, video])
        blobs.append(
            plain.keep_smaller(
                coded, x, chunk_index=index, start_token=start_token, resolution=header.resolution, key=key
            )
            if config.plain_fallback
            else coded
        )
    return EncodedChunk(
        index, start_token, T, config.resolutions, tuple(blobs), encoder=",".join(dict.fromkeys(coders))
    )
