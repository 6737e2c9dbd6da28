"""TransformCodec: KV chunks coded as decorrelated, bit-allocated coefficients.

encode: keys with RoPE removed -> per (layer group, K|V): y = basis^T (x - mean) -> one
        distortion level theta for the file (from a target ratio, measured on the data, or a
        modelled bits/value) -> integers round(y / step), 0-bit coordinates dropped -> 8-bit
        samples + escapes -> lossless HEVC frames or zstd, chunk by chunk (the coder)
decode: frames (NVDEC on a CUDA target, FFmpeg on the CPU) -> integers -> dequantize -> one
        GEMM per (group, K|V) -> RoPE re-applied -> the caller's dense slice or PagedKV.
The first `sink_tokens` positions of a prefix are kept as fp16 (attention sinks are outliers);
the last `fine_tokens` tokens of the KV being encoded (those right before whatever a later request
appends) are coded with a step 2^fine_bits times finer; coefficients are restored at the bin
centre or at the bin's centroid under a Laplacian (`recon`, quantize.recon_offset).
Every chunk names the sha256 of the .kvt it was coded with; another transform refuses it.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import threading
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
import torch
import zstandard

from kvcodec.codecs.base import ChunkCodec, ChunkInfo, EncodedChunk, Target, check_keys, collect_chunks
from kvcodec.codecs.grouped import GroupedCodec
from kvcodec.codecs.hevc.decode import sample_decoders
from kvcodec.codecs.hevc.encode import batched, host_arrays, in_order, stage_batch, stage_on_caller
from kvcodec.codecs.transform.decode import TARGET_DTYPES, TransformRestorer, check_target
from kvcodec.codecs.transform.header import (
    MIXED_TURN,
    SETTING_CODERS,
    STREAM_NAMES,
    check_header,
    check_named,
    chunk_coder,
    finer_tail,
    sink_count,
)
from kvcodec.codecs.transform.level import SampleRate
from kvcodec.codecs.zstd_streams import MAX_FRAME_BYTES, zstd_frames
from kvcodec.config import real_number, video_frame_sizes, whole_number
from kvcodec.container.format import crc32, read_parsed, split_streams, write_object
from kvcodec.dtypes import DTYPES
from kvcodec.errors import ConfigError, FormatError, ShapeError
from kvcodec.kvspec import GroupSpec
from kvcodec.layout.search import encode_workers
from kvcodec.plugins import check_arguments
from kvcodec.transform import alloc, frames, quantize, rate
from kvcodec.transform.calibration import (
    KINDS,
    Calibration,
    all_variances,
    group_matrix,
    keys_without_rope,
    refuse_beyond_half,
)
from kvcodec.transform.kvt import load_kvt
from kvcodec.video import x265_cpu

CHUNK_MAGIC = b"KVTC"
TRANSFORM_VERSION = 3  # 2: fine_tokens, fine_bits, recon in the header (version 1 chunks: 0, 0, "centre"); 3: pieces
READABLE_VERSIONS = (1, 2, 3)
CODERS = SETTING_CODERS  # hevc, zstd, or mixed (chunk by chunk: header.chunk_coder)
# zstd's chunks decode on the host's threads, which restored Llama-3-8B-shaped KV 1.4-1.9x faster than
# mixed at 5x and 0.86-1.5x at 8x (2k-32k tokens, two calls), Qwen2.5's 0.87-1.53x at 2k-4k tokens: mixed
# waits on NVDEC for half its chunks (benchmarks/results/ttft-h200-s53-coders-llama-*.md,
# fetch-h200-s52-qwen-coders.md, fetch-h200-s53-phases-qwen.md); its encode needs no video encoder
DEFAULT_CODER = "zstd"
VIDEO_CODERS = ("hevc", "mixed")  # the settings that code some chunks as video
PRESETS = {"accurate": 5.0, "compact": 8.0}  # target ratios; measured accuracy in docs/TRANSFORM.md
# zstd level of the samples (and side streams): level 1 encodes ~100x faster than 19 (~500 vs 4 MB/s
# a thread, x265 ~10-18) for 0-9% more bytes on SmolLM2's and Qwen2.5's samples at 5x and 8x
# (benchmarks/results/transform-zstd-level-cpu-*.md); a mixed encode is then 1.7x faster than HEVC alone
# (encode-gpu-h200-qwen-8k-mixed)
ZSTD_LEVEL = 1
# zstd frames of a chunk's samples: one, whole (MAX_FRAME_BYTES). 512 KiB frames cost the same bytes; read on
# every free native thread they fetched Qwen2.5's 2048 tokens 1.13-1.23x faster, but a bf16 matmul beside a 32k
# Llama-shaped fetch lost 1.4-3.7 more points, for no faster restore (H200, fetch-h100-s62-frames.md). With each
# native thread on a stream of its own (codecs/zstd_native.py) they gained nothing at 2048 tokens and still cost
# that matmul more in every pair of runs, 1.1-12.1 points (H100, benchmarks/results/fetch-h100-s63-frames-own-stream.md);
# with 8 more native threads reading other chunks' frames they were 0.75-1.11x as fast (fetch-h100-s74-helpers.md).
SAMPLES_FRAME_BYTES = MAX_FRAME_BYTES
MAX_PLANS = 64  # coordinate plans kept per codec (one per distortion level seen)
GEMM_BLOCK = 32  # coefficients are computed in whole blocks of this many coordinates (then cut)
# x265 parameters beyond the lossless ones: those of the HEVC codec, 2.3x faster than the earlier
# "info=0" for 0.7% more bytes on SmolLM2 coefficients (kvcodec bench encode; a benchmark may set "")
X265_TUNING = x265_cpu.FAST_TUNING


@dataclasses.dataclass(frozen=True, eq=False)
class CoordPlan:
    """Which coefficients are coded at level theta and how: counts[j] leading coordinates of
    the j-th (group, kind) block, their steps, and the layout order (widest first)."""

    counts: tuple[int, ...]
    steps: torch.Tensor  # (C,) float32, concatenated (group, kind) order
    sigmas: torch.Tensor  # (C,) float32 calibrated deviation of each coded coordinate
    order: torch.Tensor  # (C,) layout position -> concatenated index
    inverse: torch.Tensor  # (C,) concatenated index -> layout position


def coord_plan(cal: Calibration, theta: float, key_weight: float) -> CoordPlan:
    counts, steps, widths, sigmas = [], [], [], []
    for g in range(len(cal.groups)):
        for kind in KINDS:
            var = cal.basis(g, kind).variances.to(torch.float64)
            w = torch.full_like(var, key_weight if kind == "k" else 1.0)
            s = alloc.steps_for(var, theta, w)
            n = int((s > 0).sum())
            counts.append(n)
            steps.append(s[:n])
            sigmas.append(var[:n].clamp_min(0).sqrt())
            widths.append(var[:n] / s[:n] ** 2)
    steps_t = torch.cat(steps).float()
    order = torch.argsort(torch.cat(widths), descending=True, stable=True)
    return CoordPlan(tuple(counts), steps_t, torch.cat(sigmas).float(), order, torch.argsort(order))


_WATER_LEVELS: dict[tuple[str, float, float], float] = {}  # (kvt hash, bits per value, key weight) -> theta


@dataclasses.dataclass(frozen=True, eq=False)
class DevicePlan:
    """A CoordPlan's encode-side tensors on one device: the coded columns among all dims, their
    steps and the layout order."""

    plan: CoordPlan
    columns: torch.Tensor
    steps: torch.Tensor
    order: torch.Tensor


def _zstd(data: bytes) -> bytes:
    return zstandard.ZstdCompressor(level=ZSTD_LEVEL).compress(data)


def _samples(q: torch.Tensor) -> tuple[torch.Tensor, np.ndarray, np.ndarray]:
    """quantize.to_samples on q's device: the uint8 samples stay there, the (rare) escapes come to
    the host."""
    lo, hi = -quantize.OFFSET, 255 - quantize.OFFSET  # the integers a sample holds (q is int32: no widening)
    idx = torch.nonzero(((q < lo) | (q > hi)).reshape(-1)).reshape(-1)
    values = q.reshape(-1)[idx].to(torch.int32)
    samples = (q.clamp(lo, hi) + quantize.OFFSET).to(torch.uint8)
    return samples, idx.cpu().numpy().astype(np.int64), values.cpu().numpy()


# One frame a chunk holds on Qwen2.5's KV (256 tokens at 5x, ~1.5 MB of samples): half the frames of 512x512, so
# half the driver's per-frame conversion kernels on the SMs. Beside a bf16 matmul a fetch cost it 3.3-4.4% against
# 6.9-7.1% at 512x512, idle as fast or faster; on Llama-8B-sized chunks as fast or 5% faster, bytes within 0.02%
# (benchmarks/results/fetch-h200-s43-frame-size.md).
FRAME_SIZES: tuple[tuple[int, int], ...] = ((1024, 1024),)


class TransformCodec:
    """A ChunkCodec over a calibration (.kvt). Size, first that is given: theta (an explicit
    distortion level), target_ratio (file size vs fp16, measured on the data being encoded) or
    bits_per_value (modelled from the calibration's variances; default 2). fine_tokens /
    fine_bits: the last fine_tokens tokens of the KV being encoded get a step 2^fine_bits times
    finer (inside the same size; 0 turns it off); recon: "centre" (default) or "laplace"
    (bin centroids: lower squared error, but a higher KL divergence on real models); coder: how the
    samples are coded: "zstd" (default: every chunk, decoded on the host's threads), "hevc" (every
    chunk as video for NVDEC: the host's and SMs' least work per byte) or "mixed" (even chunks as
    video, odd ones zstd, so a fetch keeps NVDEC and the host's cores busy at once)."""

    STREAM_NAMES = frozenset(STREAM_NAMES)  # every stream a chunk blob may hold
    target_dtypes = TARGET_DTYPES  # restores straight into tensors of these (codecs.base.target_dtypes)

    def __init__(
        self,
        transform: str | Path | Calibration,
        *,
        kvt_hash: str | None = None,
        target_ratio: float | None = None,
        preset: str | None = None,
        bits_per_value: float | None = None,
        theta: float | None = None,
        key_weight: float = 1.0,
        sink_tokens: int = 4,
        fine_tokens: int = 16,  # defaults measured in benchmarks/results/rd-precision-cpu.md
        fine_bits: int = 2,
        recon: str = "centre",
        coder: str = DEFAULT_CODER,
        chunk_tokens: int = 256,
        resolutions: Sequence[tuple[int, int]] = FRAME_SIZES,
    ):
        if isinstance(transform, Calibration):
            if not kvt_hash:
                raise ConfigError("a Calibration object needs its kvt_hash (the sha256 of its .kvt bytes)")
            self.cal, self.kvt_hash = transform, kvt_hash
        else:
            self.cal, self.kvt_hash = load_kvt(transform)
        if preset is not None:
            if preset not in PRESETS:
                raise ConfigError(f"preset must be one of {sorted(PRESETS)}; got {preset!r}")
            if target_ratio is not None:
                raise ConfigError(
                    f"preset {preset!r} is a target ratio ({PRESETS[preset]:g}x): give it or target_ratio"
                )
            target_ratio = PRESETS[preset]
        if coder not in CODERS:
            raise ConfigError(f"coder must be one of {CODERS}; got {coder!r}")
        target_ratio, bits_per_value, theta = (
            None if v is None else real_number(v, name)
            for v, name in ((target_ratio, "target_ratio"), (bits_per_value, "bits_per_value"), (theta, "theta"))
        )
        key_weight = real_number(key_weight, "key_weight")
        chunk_tokens, sink_tokens = whole_number(chunk_tokens, "chunk_tokens"), whole_number(sink_tokens, "sink_tokens")
        fine_tokens, fine_bits = whole_number(fine_tokens, "fine_tokens"), whole_number(fine_bits, "fine_bits")
        if target_ratio is not None and not target_ratio > 1:
            raise ConfigError(f"target ratio must be > 1; got {target_ratio}")
        if chunk_tokens < 1 or sink_tokens < 0 or not key_weight > 0:
            raise ConfigError("chunk_tokens must be >= 1, sink_tokens >= 0 and key_weight > 0")
        if fine_tokens < 0 or not 0 <= fine_bits <= quantize.MAX_FINE_BITS or recon not in quantize.RECONS:
            raise ConfigError(
                f"fine_tokens must be >= 0, fine_bits in 0..{quantize.MAX_FINE_BITS} and recon one of "
                f"{quantize.RECONS}; got {fine_tokens}, {fine_bits}, {recon!r}"
            )
        self.fine_tokens, self.fine_bits = finer_tail(fine_tokens, fine_bits)
        self.recon = recon
        self.target_ratio, self.key_weight, self.sink_tokens = target_ratio, float(key_weight), sink_tokens
        if theta is not None and not theta > 0:
            raise ConfigError(f"theta (distortion level) must be > 0; got {theta}")
        self.theta = theta
        self.bits_per_value = bits_per_value if bits_per_value is not None else (None if target_ratio else 2.0)
        self.coder, self.chunk_tokens = coder, chunk_tokens
        self.resolutions = video_frame_sizes(resolutions, least=16)  # make_transform_codec takes NVDEC's only
        size = f"t{theta!r}" if theta else f"r{target_ratio:g}" if target_ratio else f"b{self.bits_per_value:g}"
        self.id = (
            f"transform{TRANSFORM_VERSION}-{self.kvt_hash[:16]}-{coder}-{size}-kw{key_weight:g}"
            f"-s{sink_tokens}-c{chunk_tokens}-f{self.fine_tokens}x{self.fine_bits}-{recon}"
            f"-{'+'.join(f'{w}x{h}' for w, h in self.resolutions)}"  # blob r{j} is the j-th frame size
        )
        self._plans: dict[tuple[float, float], CoordPlan] = {}
        self._device_plans: dict[tuple[float, float, str], DevicePlan] = {}
        self._device_bases: dict[str, list[tuple[torch.Tensor, torch.Tensor]]] = {}
        self._lock = threading.Lock()  # encode chunks and decoders on threads share the plan caches
        self._restorer = TransformRestorer(self.cal, self.plan)

    @property
    def codes_video(self) -> bool:
        """Whether some of this codec's chunks hold a video (a fetch of them needs NVDEC sessions)."""
        return self.coder in VIDEO_CODERS

    def decoder_name(self, device: str | torch.device) -> str:
        """The decoders a decode on `device` uses: zstd-host for zstd'd samples, the video decoder for video."""
        return sample_decoders(MIXED_TURN if self.coder == "mixed" else (self.coder,), device)

    # ------------------------------------------------------------------------------ encode

    def plan(self, theta: float, key_weight: float | None = None) -> CoordPlan:
        key = (theta, self.key_weight if key_weight is None else key_weight)
        with self._lock:  # threads of one encode or of a fetch share this cache
            if key in self._plans:
                self._plans[key] = self._plans.pop(key)  # most recently used last
            else:
                while len(self._plans) >= MAX_PLANS:  # chunks name their own level: a stream must not grow this
                    self._plans.pop(next(iter(self._plans)))
                self._plans[key] = coord_plan(self.cal, *key)
            return self._plans[key]

    def device_plan(self, theta: float, device: torch.device) -> DevicePlan:
        """The plan of level theta (this codec's key weight) with its tensors on `device`."""
        plan = self.plan(theta)
        key = (theta, self.key_weight, str(device))
        with self._lock:
            if key not in self._device_plans:
                if len(self._device_plans) >= MAX_PLANS:
                    self._device_plans.clear()
                self._device_plans[key] = DevicePlan(
                    plan, self._columns(plan).to(device), plan.steps.to(device), plan.order.to(device)
                )
            return self._device_plans[key]

    def _bases_on(self, device: torch.device) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """(mean, analysis^T) of every (group, kind), concatenated order, on `device`: the transposed
        analysis is kept contiguous, so the leading rows of a level's coded coordinates are one block
        (a GEMM over a column slice of the analysis ran slower than over all of it)."""
        with self._lock:
            if str(device) not in self._device_bases:
                self._device_bases[str(device)] = [
                    (b.mean.to(device), b.analysis.to(device).T.contiguous())
                    for b in (self.cal.basis(g, kind) for g in range(len(self.cal.groups)) for kind in KINDS)
                ]
            return self._device_bases[str(device)]

    def coefficients(self, kv: torch.Tensor, first_position: int, counts: Sequence[int] | None = None) -> torch.Tensor:
        """(tokens, dims) float32 coefficients, concatenated (group, kind) order, on kv's device: all
        dims, or with `counts` (a CoordPlan's) the leading counts[j] of the j-th (group, kind) only,
        the coded ones: the products of the coordinates a level drops are never computed."""
        x = keys_without_rope(kv, first_position, self.cal.rope)
        bases = iter(self._bases_on(x.device))
        parts = []
        for layers in self.cal.groups:
            for ki in range(len(KINDS)):
                mean, rows = next(bases)
                n = rows.shape[0] if counts is None else counts[len(parts)]
                # a GEMM of an odd width ran as slow as the full one (CPU BLAS): whole blocks of 32
                y = (group_matrix(x, layers, ki) - mean) @ rows[: -(-n // GEMM_BLOCK) * GEMM_BLOCK].T
                parts.append(y[:, :n])
        return torch.cat(parts, dim=1)

    def _columns(self, plan: CoordPlan) -> torch.Tensor:
        """Indices of the coded columns among all dims, concatenated order."""
        cols, off = [], 0
        for j, n in enumerate(plan.counts):
            cols.append(torch.arange(off, off + n))
            off += len(self.cal.groups[j // 2]) * self.cal.layer_dim
        return torch.cat(cols)

    def _symbols(self, y: torch.Tensor, theta: float, first_position: int, fine: int = 0) -> torch.Tensor:
        """Integers (tokens, coded coords), concatenated order; sink tokens zeroed (they travel as fp16);
        the last `fine` tokens with the finer step. y: every coefficient (`coefficients`), or only
        those level theta codes (`coefficients` with its plan's counts: as many columns as it codes)."""
        dp = self.device_plan(theta, y.device)
        coded = y if y.shape[1] == dp.columns.numel() else y.index_select(1, dp.columns)
        sink = max(0, min(self.sink_tokens - first_position, coded.shape[0]))
        scale = quantize.token_scales(coded.shape[0], fine, self.fine_bits).to(y.device)
        scaled = quantize.scaled(coded, dp.steps, scale)
        if not bool((scaled[sink:].abs() < 2**31).all()):  # NaN compares False too
            raise FormatError(
                "the transform maps this KV to coefficients beyond the integer range (NaN, infinite or huge): "
                "is the .kvt damaged, or calibrated for another model?"
            )
        q = quantize.rounded(scaled)
        q[:sink] = 0
        return q

    def _level(self, y: torch.Tensor | None, kv: torch.Tensor, first_position: int) -> float:
        """theta: given, from bits_per_value (modelled), or meeting target_ratio on this data
        (_ratio_level; y: every coefficient of kv, or None to transform the sampled chunks only)."""
        if self.theta is not None:
            return self.theta
        var = all_variances(self.cal).to(torch.float64)
        w = self._weights()
        if self.target_ratio is None:
            key = (self.kvt_hash, self.bits_per_value, self.key_weight)
            if key not in _WATER_LEVELS:  # depends on the calibration alone: once per process
                _WATER_LEVELS[key] = alloc.water_level(var, self.bits_per_value, w)
            return _WATER_LEVELS[key]
        return self._ratio_level(y, kv, first_position, var, w)

    def _ratio_level(self, y, kv, first_position, var, w) -> float:  # noqa: ANN001
        """The level meeting target_ratio on this data (_searched_level), moved to the nearest level
        of rate.on_grid's grid: prefixes share levels, so a restorer's decode plans serve many."""
        target, top = self._target_bits(kv, first_position), float((var * w).max())
        if kv.shape[2] <= self.sink_tokens - first_position:  # every token a sink, kept exact: no coordinate coded
            return top * 0.999
        if target <= 0:  # the fp16 sink tokens alone exceed the budget (a KV of a few tokens): the other tokens
            target = 16.0 * kv.numel() / self.target_ratio / kv.shape[2]  # at the level the ratio gives without sinks
        theta = self._searched_level(target, y, kv, first_position, var, w)
        snapped = rate.on_grid(theta)
        return snapped if top * rate.MIN_LEVEL <= snapped < top else theta

    def _target_bits(self, kv: torch.Tensor, first_position: int) -> float:
        """Bits per token target_ratio leaves the coded coordinates (the fp16 sink tokens paid)."""
        return (16.0 * kv.numel() / self.target_ratio - self._overhead_bits(kv, first_position)) / kv.shape[2]

    def _searched_level(self, target, y, kv, first_position, var, w) -> float:  # noqa: ANN001
        """The level whose coded bits per token meet `target` (> 0): a search (rate.LevelSearch) on the
        entropy of a sample of chunks (SampleRate), from the modelled level; the target corrected once
        by the coder's real bytes on the sampled chunks."""
        top = float((var * w).max())
        sample = SampleRate(self, y, kv, first_position)
        # the first guess depends on this data alone (never on what this process coded before): the
        # same KV codes to the same bytes in any process, thread or order (ingest on Ray, worker processes)
        guess = alloc.water_level(
            var, target * kv.shape[2] / kv.numel(), w, iters=40, extra_bits=alloc.QUANTIZER_EXTRA_BITS
        )
        search = rate.LevelSearch(sample.bits_per_token, top * rate.MIN_LEVEL, top)
        theta = search.solve(target, guess)  # on the entropy; refined below
        factor = sample.coded_bits_per_token(theta) / max(sample.bits_per_token(theta, fine=False), 1e-9)
        return search.solve(target / max(factor, 1e-3), theta)  # from the first search's points

    def _weights(self) -> torch.Tensor:
        ws = []
        for g in range(len(self.cal.groups)):
            for kind in KINDS:
                d = len(self.cal.groups[g]) * self.cal.layer_dim
                ws.append(torch.full((d,), self.key_weight if kind == "k" else 1.0, dtype=torch.float64))
        return torch.cat(ws)

    def _overhead_bits(self, kv: torch.Tensor, first_position: int) -> float:
        sink = max(0, min(self.sink_tokens - first_position, kv.shape[2]))
        per_token = kv.numel() // kv.shape[2]
        return 8.0 * sink * per_token * 2

    def _payload_bytes(self, y, kv, theta, first_position) -> float:
        """Bytes of one chunk blob (header included), its fp16 sink tokens left out; for the mixed
        coder the mean of its two coders' (each codes half the chunks), whichever its index gives it."""
        res, encoder = self.frame_sizes(theta)[0], self._encoder()
        samples, side, escapes = self._samples_and_side(y, kv, theta, first_position, 0)  # once for both coders
        sizes = []
        for coder in MIXED_TURN if self.coder == "mixed" else (self.chunk_coder(first_position),):
            pending = self._pending(samples, dict(side), escapes, 0, res, coder)
            streams, counts = self._coded(*pending, res, encoder)
            blob = self._write(streams, counts, kv, theta, first_position, 0, res, None)
            sizes.append(len(blob) - len(streams.get("sink", b"")))
        return sum(sizes) / len(sizes)

    def frame_sizes(self, theta: float) -> tuple[tuple[int, int], ...]:
        """The frame size chunks coded at level theta use for each of the codec's resolutions (the
        largest frames it may use): frames.frame_size of a whole chunk's samples, so that a chunk
        fills several frames where they can shrink (every chunk of one level has the same size)."""
        samples = self.plan(theta).steps.numel() * self.chunk_tokens
        return tuple(frames.frame_size(samples, res) for res in self.resolutions)

    def chunk_coder(self, start_token: int) -> str:
        """The sample coder ("hevc" or "zstd") of the chunk starting at token `start_token`."""
        return chunk_coder(self.coder, start_token // self.chunk_tokens)

    def _encoder(self, threads: int | None = None):  # noqa: ANN202 - a VideoEncoder
        """The video encoder (x265 ultrafast, or NVENC where the GPU has one); `threads`: a
        single-threaded copy for one of several chunk threads, where the encoder can make one."""
        if not self.codes_video:
            return None
        from kvcodec.video.registry import get_encoder

        encoder = get_encoder(preset="ultrafast", tuning=X265_TUNING)
        return (
            encoder.with_threads(threads) if threads and callable(getattr(encoder, "with_threads", None)) else encoder
        )

    def _prepare(
        self, y, kv, theta, first_position, fine, coder=None, sizes=None
    ) -> tuple[tuple[dict, dict, object], ...]:
        """Everything before the samples are coded, per resolution of the codec: the side streams, the
        header counts (the chunk's coder among them: `coder`, else its index's) and what _coded codes:
        the host frames (hevc) or the samples' bytes (zstd). The chunk is quantized once for all of them.
        y and kv on one device (the GPU's KV is quantized there; only samples come to the host).
        sizes: frame_sizes(theta), where the caller has worked them out for all its chunks."""
        samples, streams, escapes = self._samples_and_side(y, kv, theta, first_position, fine)
        coder = coder or self.chunk_coder(first_position)
        sizes = sizes or self.frame_sizes(theta)
        return tuple(self._pending(samples, streams, escapes, fine, res, coder) for res in sizes)

    def _pending(self, samples, streams, escapes, fine, resolution, coder) -> tuple[dict, dict, object]:  # noqa: ANN001
        """One resolution's entry of _prepare from a chunk's samples and side streams, for `coder`."""
        counts = {"coder": coder, "frames": 0, "escapes": escapes, "fine_tokens": fine}
        if coder == "hevc":
            host_frames = [f.cpu().numpy() for f in frames.to_frames(samples, *resolution)]
            return streams, {**counts, "frames": len(host_frames)}, host_frames
        return streams, counts, samples.cpu().numpy().tobytes()

    @staticmethod
    def _coded(streams, counts, pending, resolution, encoder) -> tuple[dict[str, bytes], dict]:
        """The chunk's streams with its samples coded (on the chunk's thread: x265 and zstd run in
        parallel). Video: each frame a picture that decodes alone (its byte lengths the header's
        pieces) where the encoder can code so (encode_intra), else one stream (pieces [])."""
        if counts["coder"] != "hevc":
            samples = zstd_frames(pending, ZSTD_LEVEL, SAMPLES_FRAME_BYTES)
            return {**streams, "samples": samples}, {**counts, "pieces": []}
        if callable(getattr(encoder, "encode_intra", None)):
            pieces = encoder.encode_intra(pending, *resolution)
            # the header's pieces are one per frame: packets cut otherwise (a separate header
            # packet, say) are still one valid stream together, written as such
            lengths = [len(p) for p in pieces] if len(pieces) == counts["frames"] else []
            return {**streams, "video": b"".join(pieces)}, {**counts, "pieces": lengths}
        return {**streams, "video": encoder.encode(pending, *resolution)}, {**counts, "pieces": []}

    def _samples_and_side(self, y, kv, theta, first_position, fine) -> tuple[torch.Tensor, dict[str, bytes], int]:
        """A chunk's uint8 samples in layout order (on y's device), its side streams (escapes, and
        the fp16 sink tokens where it has some) and its escape count: what every sample coder codes."""
        q = self._symbols(y, theta, first_position, fine)
        samples, idx, values = _samples(q.index_select(1, self.device_plan(theta, q.device).order).T.contiguous())
        streams = {"escapes": _zstd(quantize.pack_escapes(idx, values))}
        sink = max(0, min(self.sink_tokens - first_position, kv.shape[2]))
        if sink:
            streams["sink"] = _zstd(kv[:, :, :sink].to(torch.float16).cpu().contiguous().numpy().tobytes())
        return samples, streams, int(idx.size)

    def encode_chunks(
        self,
        kv: torch.Tensor,
        *,
        first_chunk_index: int = 0,
        keys: Sequence[str] | None = None,
        on_chunk: Callable[[EncodedChunk], None] | None = None,
    ) -> list[EncodedChunk]:
        kv = self._check_kv(kv)
        first = first_chunk_index * self.chunk_tokens
        theta = self._level(None, kv, first)  # a target ratio: measured on a sample of chunks
        y = self.coefficients(kv, first, self.plan(theta).counts)  # only the coordinates it codes
        T = kv.shape[2]
        count = -(-T // self.chunk_tokens)
        check_keys(keys, count)
        self.device_plan(theta, y.device)  # made once, before the chunk threads share it
        sizes = self.frame_sizes(theta)
        # chunks in parallel, each on a single-threaded encoder (x265's bitstream does not depend
        # on its thread count), in order; a GPU encoder (no with_threads) codes one chunk at a time
        workers, encoder = min(encode_workers(), count), self._encoder()
        if encoder is not None and not callable(getattr(encoder, "with_threads", None)):
            workers = 1
        elif workers > 1:
            encoder = self._encoder(1)

        def span(n: int) -> tuple[int, int, int]:
            s = n * self.chunk_tokens
            e = min(T, s + self.chunk_tokens)
            fine = max(0, e - max(s, T - self.fine_tokens)) if self.fine_bits else 0  # the KV's last tokens
            return s, e, fine

        def prepare(n: int) -> tuple:
            s, e, fine = span(n)
            return self._prepare(y[s:e], kv[:, :, s:e], theta, first + s, fine, sizes=sizes)

        def one(n: int, prepared: tuple | None = None) -> EncodedChunk:
            s, e, fine = span(n)
            key = keys[n] if keys is not None else None
            if prepared is None:
                prepared = prepare(n)
            blobs = tuple(
                self._write(
                    *self._coded(*p, res, encoder), kv[:, :, s:e], theta, first + s, first_chunk_index + n, res, key
                )
                for p, res in zip(prepared, sizes)
            )
            return EncodedChunk(first_chunk_index + n, first + s, e - s, self.resolutions, blobs)

        def prepare_from(n: int, batch: int) -> dict[int, tuple]:
            """Chunk n and the plain whole chunks after it (no sink or fine tokens), at most `batch`, at once."""
            plain = [i for i in range(n, min(n + batch, count)) if self._batchable(*span(i), first)]
            run = plain[: next((j for j, i in enumerate(plain) if i != n + j), len(plain))]
            if len(run) < 2:
                return {n: prepare(n)}
            s, e = span(n)[0], span(run[-1])[1]
            return dict(zip(run, self._prepare_batch(y[s:e], theta, first + s, len(run))))

        staged = None
        if stage_on_caller(kv, workers):  # on a GPU: made on this thread, in batches
            staged = batched(functools.partial(prepare_from, batch=stage_batch(kv, self.chunk_tokens, workers)))
        return collect_chunks(in_order(one, count, workers, staged), on_chunk)

    def _batchable(self, s: int, e: int, fine: int, first: int) -> bool:
        """Whether the chunk of tokens [s, e) can be prepared in a batch: whole, no sink, no fine tokens, coded
        with this codec's coders."""
        return e - s == self.chunk_tokens and fine == 0 and first + s >= self.sink_tokens and self.coder in CODERS

    def _prepare_batch(self, y, theta, first_position, chunks) -> list[tuple]:  # noqa: ANN001
        """_prepare of `chunks` whole chunks at every resolution at once (y: their coefficients; no
        sink or fine tokens), one tuple of (streams, counts, host frames or samples) per resolution for
        each chunk: the same bytes as one by one, the integers made for all, escapes, frames and samples
        brought to the host in one copy each."""
        q = self._symbols(y, theta, first_position, 0)
        ordered = q.index_select(1, self.device_plan(theta, q.device).order).view(chunks, self.chunk_tokens, -1)
        ordered = ordered.transpose(1, 2).contiguous().view(chunks, -1)  # each chunk's (coords, tokens) in order
        lo, hi = -quantize.OFFSET, 255 - quantize.OFFSET
        where = torch.nonzero((ordered < lo) | (ordered > hi))  # (chunk, index) rows, in order
        values = ordered[where[:, 0], where[:, 1]].to(torch.int32)
        samples = (ordered.clamp(lo, hi) + quantize.OFFSET).to(torch.uint8)
        coders = [self.chunk_coder(first_position + k * self.chunk_tokens) for k in range(chunks)]
        rows = {c: [k for k in range(chunks) if coders[k] == c] for c in MIXED_TURN}
        picked = {c: _rows_of(samples, r) for c, r in rows.items()}
        frames_by_res = [self._batch_frames(picked["hevc"], res) for res in self.frame_sizes(theta)]
        where, values, plain, *host = host_arrays([where, values, picked["zstd"], *frames_by_res])
        row = {k: j for r in rows.values() for j, k in enumerate(r)}  # chunk -> its row among its coder's
        out = []
        for k in range(chunks):
            mine = where[:, 0] == k
            idx = where[mine, 1].astype(np.int64)
            streams = {"escapes": _zstd(quantize.pack_escapes(idx, values[mine]))}
            counts = {"coder": coders[k], "frames": 0, "escapes": int(idx.size), "fine_tokens": 0}
            if coders[k] == "zstd":
                out.append(tuple((dict(streams), counts, plain[row[k]].tobytes()) for _ in self.resolutions))
            else:
                out.append(tuple((dict(streams), {**counts, "frames": len(f[row[k]])}, list(f[row[k]])) for f in host))
        return out

    @staticmethod
    def _batch_frames(samples: torch.Tensor, resolution: tuple[int, int]) -> torch.Tensor:
        """frames.to_frames of each row of samples (chunks, values): (chunks, frames, 3, h, w) on their device."""
        width, height = resolution
        per = 3 * width * height
        n = frames.frame_count(samples.shape[1], width, height)
        padded = samples.new_full((samples.shape[0], n * per), frames.PAD)
        padded[:, : samples.shape[1]] = samples
        return padded.view(samples.shape[0], n, 3, height, width)

    def _write(self, streams, counts, kv, theta, start, index, resolution, key) -> bytes:
        names = [n for n in ("escapes", "sink", "video", "samples") if n in streams]
        entries = [[n, "hevc" if n == "video" else "zstd", len(streams[n]), crc32(streams[n])] for n in names]
        L, _, t, H, D = kv.shape
        header = {
            "transform_version": TRANSFORM_VERSION,
            "kvt": self.kvt_hash,
            "codec": self.id,
            "index": index,
            "start_token": start,
            "tokens": t,
            "shape": [L, H, D],
            "dtype": str(kv.dtype).replace("torch.", ""),
            "theta": theta,
            "key_weight": self.key_weight,
            "sink": sink_count(self.sink_tokens, start, t),
            "fine_bits": self.fine_bits,
            "recon": self.recon,
            "resolution": list(resolution),
            **counts,
            "streams": entries,
            "key": key,
        }
        return write_object(CHUNK_MAGIC, header, [streams[n] for n in names])

    def _check_kv(self, kv: torch.Tensor) -> torch.Tensor:
        if not isinstance(kv, torch.Tensor) or kv.dim() != 5 or kv.shape[1] != 2:
            raise ShapeError("KV must be a (layers, 2, tokens, kv_heads, head_dim) tensor")
        if kv.dtype not in DTYPES.values() or kv.shape[2] == 0 or kv.is_meta:
            raise ShapeError(f"KV must be non-empty float16/bfloat16/float32; got {kv.dtype} {tuple(kv.shape)}")
        self.cal.check_shape(kv.shape)
        kv = kv.detach()
        kv = kv if kv.device.type == "cuda" else kv.to("cpu")  # a GPU's KV is transformed and quantized there
        lo, hi = (float(v) for v in torch.aminmax(kv))  # one pass: finite, and within float16's range
        if not (math.isfinite(lo) and math.isfinite(hi)):
            raise ShapeError("KV holds NaN or infinity; the transform codec needs finite values")
        refuse_beyond_half(max(-lo, hi), "KV")  # its sink tokens are kept as float16, its .kvt's means are within it
        return kv

    # ------------------------------------------------------------------------------ decode

    def _read(self, blob, deferred: frozenset[str] = frozenset()) -> tuple[dict, dict]:
        """The verified header and streams of a chunk blob (those named in `deferred` not checksummed)."""
        h, _, streams = self._read_entries(blob, deferred)
        return h, streams

    def _read_entries(self, blob, deferred: frozenset[str] = frozenset()) -> tuple[dict, tuple, dict]:
        """(header, stream entries, streams) of a chunk blob, the streams named in `deferred` not
        checksummed (the caller verifies them against their entries before reading them)."""
        # every field typed and in range (transform_header.py); the checks of a header read before are remembered
        (h, entries), payload = read_parsed(blob, CHUNK_MAGIC, "transform-coded chunk", check_header)
        h = dict(h)  # the remembered header stays as read
        if h["kvt"] != self.kvt_hash:
            raise ConfigError(
                f"chunk was coded with transform {h['kvt'][:16]}, this codec holds {self.kvt_hash[:16]}: "
                "decode it with the .kvt it was encoded with"
            )
        L, H, D = h["shape"]
        self.cal.check_shape((L, 2, h["tokens"], H, D))
        if h["escapes"] > h["tokens"] * L * 2 * H * D:
            raise FormatError(f"transform chunk announces {h['escapes']} escapes, more than it has samples")
        check_named(h)  # its settings, those its codec names
        return h, entries, split_streams(payload, entries, f"transform chunk {h['index']}", deferred)

    def header(self, blob: bytes | memoryview) -> dict:
        """A chunk's verified header (theta, escapes, frames, streams, ...)."""
        return self._read(blob)[0]

    def inspect_chunk(self, blob: bytes | memoryview) -> ChunkInfo:
        """The chunk's checked header and stream lengths; the streams' checksums are the decode's
        (one pass over a chunk's bytes per fetch: a driven fetch inspects and then reads each blob)."""
        h, _ = self._read(blob, self.STREAM_NAMES)
        L, H, D = h["shape"]
        return ChunkInfo(h["index"], h["start_token"], h["tokens"], L, H, D, h["dtype"], h["codec"], h.get("key"))

    def decode_chunk(self, blob: bytes | memoryview, out: Target, decoder=None) -> Target:
        """decoder: a video decoder to use (NvcuvidThreads lends one) instead of one borrowed per call."""
        h, streams = self._read(blob)
        return self._restorer.decode(h, streams, out, decoder)

    # ------------------------------------------------------------ staged decode (base.StagedDecode)

    def stage(self, blob: bytes | memoryview, out: Target):  # noqa: ANN201 - a transform_decode.Decoded
        """The first half of a batched restore: the chunk's samples on out's device (NVDEC on CUDA),
        escapes and sink tokens; `finish` does the math for many staged chunks at once."""
        h, streams = self._read(blob)
        check_target(h, out)
        return self._restorer.decode_samples(h, streams, out.device)

    def finish(self, staged: Sequence, outs: Sequence[Target]) -> None:
        """The second half: the inverse transform of every staged chunk into its target."""
        self._restorer.finish(list(staged), list(outs))

    def warm_up(self, device: torch.device | str, dtype: torch.dtype = torch.float16) -> None:
        """Compile the restore's GPU kernels for outputs of `dtype` now (no-op off CUDA), so that the
        first fetch a server runs does not wait for Triton (codecs.base.WarmUp), nor for the native zstd
        threads' build and start (a driven fetch's zstd'd chunks: codecs/zstd_native.py)."""
        self._restorer.warm_up(torch.device(device), dtype)
        if torch.device(device).type == "cuda" and self.coder != "hevc":
            from kvcodec.codecs import driven, zstd_native

            zstd_native.threads(driven.host_threads)

    def pinned_block_bytes(self) -> int:
        """The pinned block a driven CUDA fetch decompresses each chunk's zstd'd samples into
        (codecs.base.PinnedStaging): every coordinate the calibration keeps over a whole chunk;
        0 for the HEVC coder, whose samples NVDEC writes on the device."""
        return 0 if self.coder == "hevc" else self._restorer.most_rows * self.chunk_tokens

    def stage_stream(self, items, device, check=None):  # noqa: ANN001, ANN201 - see transform_batch.stage_stream
        """The first half for a stream of (tag, blob, target) on one NVDEC session, chunks back to back."""
        from kvcodec.codecs.transform.batch import stage_stream

        return stage_stream(self, items, device, check)


def open_transform(transform: str | Path, **options):  # noqa: ANN201 - a TransformCodec or a GroupedCodec
    """The codec of a .kvt file: a TransformCodec for a one-group (uniform) cache, or a GroupedCodec
    whose every layer group (sliding window, full, MLA latent / RoPE key) is coded by the transform
    calibrated for it (transform.grouped_kvt). Grouped chunks are coded one by one, so their parts get
    no finer tail unless `fine_tokens` says so."""
    from kvcodec.transform.grouped_kvt import grouped_from_bytes, is_grouped_kvt

    try:
        data = Path(transform).read_bytes()
    except OSError as e:
        raise ConfigError(f"transform file {transform}: {e.strerror or e}") from e
    if not is_grouped_kvt(data):
        return TransformCodec(transform, **options)
    spec, parts, _ = grouped_from_bytes(data)
    options.setdefault("fine_tokens", 0)
    codecs = {name: TransformCodec(cal, kvt_hash=digest, **options) for name, (cal, digest) in parts.items()}
    return GroupedTransformCodec(codecs[spec.groups[0].name], codecs)


class GroupedTransformCodec(GroupedCodec):
    """A GroupedCodec whose every group has its own calibrated transform: a group the .kvt was not
    calibrated for (another model's cache) is refused instead of coded with another group's basis."""

    def codec_for(self, group: GroupSpec) -> ChunkCodec:
        codec = self.per_group.get(group.name)
        if codec is None:
            raise ShapeError(
                f"the grouped .kvt has transforms for {sorted(self.per_group)}, not for KV group {group.name} "
                "(calibrated for another model?)"
            )
        return codec


def make_transform_codec(transform: str | Path | Calibration, *, target_quality: str | None = None, **options):  # noqa: ANN201
    """The registered "transform" codec: a TransformCodec, or for a grouped .kvt (several KV layer
    groups) a GroupedCodec of one transform per group. target_quality ("top1=0.99", "ppl=0.5"): the
    highest ratio whose held-out quality at calibration met it (transform.quality); a target_ratio
    beyond the measured safe ratio logs a warning."""
    import logging

    from kvcodec.transform.quality import ratio_for, ratio_warning

    if options.get("resolutions") is not None:  # frames for NVDEC: the smaller ones x265 makes restore on CPUs only
        options["resolutions"] = video_frame_sizes(options["resolutions"])
    check_arguments(TransformCodec, "codec 'transform'", transform, **options)
    if isinstance(transform, Calibration):
        if target_quality is not None:
            raise ConfigError("target_quality needs a .kvt file (its quality report)")
        return TransformCodec(transform, **options)
    report = kvt_info(transform).get("quality")
    if report and (warning := coder_warning(report, options.get("coder", DEFAULT_CODER))):
        logging.getLogger(__name__).warning(warning)
    if options.get("target_ratio") is not None:
        options["target_ratio"] = real_number(options["target_ratio"], "target_ratio")
    if target_quality is not None:
        if options.get("target_ratio") is not None or options.get("preset") is not None:
            raise ConfigError("give target_quality or target_ratio / preset, not both")
        options["target_ratio"] = ratio_for(report, target_quality)
    elif options.get("target_ratio") is not None and (warning := ratio_warning(report, options["target_ratio"])):
        logging.getLogger(__name__).warning(warning.removeprefix("warning: "))
    return open_transform(transform, **options)


def coder_warning(report: dict, coder: str) -> str | None:
    """What to say where a .kvt's quality report measured chunks of another sample coder than `coder`
    (a .kvt of before session 53 measured mixed chunks): the coders are lossless, but each one's
    bytes set the level that meets a ratio, so the report's qualities are this coder's only nearly. Pure."""
    measured = report.get("coder")
    if not measured or measured == coder:
        return None
    return (
        f"the .kvt's quality report measured {measured}-coded chunks; this codec codes {coder}: at a ratio "
        f"their levels differ a little (docs/TRANSFORM.md, sample coders); calibrate again for its own report"
    )


def kvt_info(transform: str | Path) -> dict:
    """The descriptive info of a .kvt (plain or grouped): model, sources, quality report, fallbacks."""
    from kvcodec.transform.grouped_kvt import grouped_from_bytes, is_grouped_kvt
    from kvcodec.transform.kvt import from_bytes

    try:
        data = Path(transform).read_bytes()
    except OSError as e:
        raise ConfigError(f"transform file {transform}: {e.strerror or e}") from e
    return grouped_from_bytes(data)[2] if is_grouped_kvt(data) else dict(from_bytes(data).info)


def _rows_of(samples: torch.Tensor, rows: list[int]) -> torch.Tensor:
    """samples[rows] (rows ascending): samples itself where they are every row (one coder codes
    every chunk of the batch), no copy."""
    if len(rows) == samples.shape[0]:
        return samples
    return samples.index_select(0, torch.tensor(rows, dtype=torch.long, device=samples.device))
