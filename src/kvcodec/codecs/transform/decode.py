"""The transform codec's restore path: a chunk's verified header and streams -> samples (NVDEC on
a CUDA target, FFmpeg on the CPU, or zstd) -> integers -> dequantize -> inverse transform ->
RoPE re-applied -> the caller's dense slice or PagedKV.

On the CPU: one GEMM per (layer group, K|V) (the reference path). On CUDA: the batched path of
restore.transform_kernels (a few kernels per chunk, or per batch of chunks: transform_batch.restore_chunks
decodes many chunks on NvcuvidThreads' sessions, then restores them in one pass)."""

from __future__ import annotations

import dataclasses
import functools
import itertools
import threading
from collections.abc import Callable

import torch
import zstandard

from kvcodec.codecs.base import Target, holds_range
from kvcodec.codecs.zstd_streams import unzstd_into
from kvcodec.dtypes import DTYPE_NAMES, DTYPES
from kvcodec.errors import CorruptStreamError, ShapeError
from kvcodec.restore import transform_kernels, transform_triton
from kvcodec.restore.paged import PagedKV
from kvcodec.transform import frames, inverse, quantize
from kvcodec.transform.calibration import KINDS, Calibration
from kvcodec.transform.rope import apply_rope

MAX_PLANS = 4  # batched plans kept per restorer (levels: a target ratio's on a grid, rate.on_grid, a few a model)
# coordinate plans remembered per restorer (the codec's own, shared: host memory only); a level forgotten here is
# not begun as its blob arrives (known_sample_count), so a fetch of more levels than this would lose that overlap
MAX_COORD_PLANS = 64


def unzstd(data, name: str, size: int) -> bytes:
    try:
        raw = zstandard.ZstdDecompressor().decompress(bytes(data), max_output_size=max(size, 1))
    except zstandard.ZstdError as e:
        raise CorruptStreamError(f"stream {name!r} does not decompress: {e}") from e
    if len(raw) != size:
        raise CorruptStreamError(f"stream {name!r} holds {len(raw)} bytes, expected {size}")
    return raw


class TransformRestorer:
    """Restores verified transform chunks; `plan(theta, key_weight)` gives the coordinate plan
    a chunk was coded with (the codec's, cached)."""

    def __init__(self, cal: Calibration, plan: Callable, batched: bool | None = None):
        self.cal, self.plan = cal, plan
        self.batched = batched  # None: the batched restore (restore.transform_kernels) on CUDA only
        self._device_bases: dict[tuple, list] = {}  # (theta, key_weight, device): _decode_bases
        self._batched_plans: dict[tuple, transform_kernels.BatchedPlan] = {}
        self._stacked: dict[torch.device, transform_kernels.DeviceCalibration] = {}  # what plans are made from
        self._rope_tables: dict[torch.device, transform_kernels.RopeTables] = {}
        self._coord_plans: dict[tuple[float, float], object] = {}  # plan(theta, key_weight), read without a lock
        self._lock = threading.Lock()  # plans and tables are built once, by whichever thread asks first
        self._coord_lock = threading.Lock()

    def _plan_of(self, h: dict):  # noqa: ANN202 - the codec's CoordPlan
        """The coordinate plan of a verified header (the codec's plan, memoized here: a fetch asks
        for it a few times per chunk on every decode thread)."""
        key = (float(h["theta"]), float(h["key_weight"]))
        plan = self._coord_plans.get(key)
        if plan is None:
            plan = self.plan(*key)
            with self._coord_lock:  # written under it, read without it
                while len(self._coord_plans) >= MAX_COORD_PLANS:
                    self._coord_plans.pop(next(iter(self._coord_plans)))
                self._coord_plans[key] = plan
        return plan

    def known_sample_count(self, h: dict) -> int | None:
        """sample_count where the header's coordinate plan is built already, else None (nothing built)."""
        plan = self._coord_plans.get((float(h["theta"]), float(h["key_weight"])))
        return None if plan is None else plan.steps.numel() * h["tokens"]

    def _decode_bases(self, h: dict, device: torch.device) -> list:
        """Per block (group, kind): its mean and its coded columns scaled by their steps, rounded
        as every restore path rounds them (transform.inverse.decode_bases), on `device`."""
        key = (float(h["theta"]), float(h["key_weight"]), device)
        with self._lock:
            if key not in self._device_bases:
                while len(self._device_bases) >= MAX_PLANS:
                    self._device_bases.pop(next(iter(self._device_bases)))
                p = self._plan_of(h)
                blocks = inverse.decode_bases(self.cal, p.counts, p.steps)
                self._device_bases[key] = [(b.mean.to(device), b.basis.to(device)) for b in blocks]
            return self._device_bases[key]

    def _samples(self, h: dict, streams: dict, count: int, device: torch.device, decoder=None) -> torch.Tensor:
        if h["coder"] == "zstd":  # one frame, or frames with a seek table (read in parallel)
            return transform_kernels.upload(host_samples(streams, count), device)
        w, hh = h["resolution"]
        if h["frames"] != frames.frame_count(count, w, hh):
            raise CorruptStreamError("transform chunk announces the wrong number of frames")
        video = streams["video"]  # the blob's own bytes (a memoryview, as the hevc codec hands its decoders)
        if decoder is not None:
            return _decoded(decoder, video, h["frames"], count, w, hh, device)
        from kvcodec.codecs.hevc.decode import idle_decoders  # sessions lent per call: one thread each

        with idle_decoders.borrow(device) as lent:
            return _decoded(lent, video, h["frames"], count, w, hh, device)

    def decode(self, h: dict, streams: dict, out: Target, decoder=None) -> Target:
        """Restore a verified chunk into `out`; `decoder`: the video decoder to use (one lent by
        NvcuvidThreads, say) instead of one borrowed for the call."""
        check_target(h, out)
        t, dtype, device = h["tokens"], DTYPES[h["dtype"]], out.device
        batched = self.batched if self.batched is not None else device.type == "cuda"
        if batched:
            return self._decode_batched(h, streams, out, device, decoder)
        x = self._restore(h, streams, device, decoder)
        if h["sink"]:
            x[:, :, : h["sink"]] = self._sink(h, streams, device).to(torch.float32)
        if isinstance(out, PagedKV):
            blocks, within = out.slots(h["start_token"], t)
            out.pages[:, :, blocks, within] = transform_kernels.clamp_to_range_(x, dtype).to(dtype)
        else:
            out.copy_(transform_kernels.clamp_to_range_(x, out.dtype))
        return out

    @staticmethod
    def _sink(h: dict, streams: dict, device: torch.device) -> torch.Tensor:
        """The chunk's fp16 sink tokens (L, 2, sink, H, D) on `device`."""
        L, H, D = h["shape"]
        raw = unzstd(streams["sink"], "sink", h["sink"] * L * 2 * H * D * 2)
        sink = torch.frombuffer(bytearray(raw), dtype=torch.float16).view(L, 2, h["sink"], H, D)
        return transform_kernels.upload(sink, device)

    def _restore(self, h: dict, streams: dict, device: torch.device, decoder=None) -> torch.Tensor:
        """Dequantize, inverse transform (one GEMM per group and kind), re-apply RoPE: float32 KV."""
        plan = self._plan_of(h)
        C, t = plan.steps.numel(), h["tokens"]
        samples = self._samples(h, streams, C * t, device, decoder).view(C, t)
        idx, values = quantize.unpack_escapes(unzstd(streams["escapes"], "escapes", 4 + 8 * int(h["escapes"])))
        q = quantize.from_samples(samples, idx, values)[plan.inverse.to(device)]  # concatenated order
        scale = quantize.token_scales(t, h["fine_tokens"], h["fine_bits"]) if h["fine_tokens"] else None
        coeffs = quantize.dequantize(q.T, plan.steps, token_scale=scale, sigmas=plan.sigmas, recon=h["recon"])
        units = (coeffs / plan.steps.to(device)).T.contiguous()  # in steps: the decode bases carry them
        x = inverse.inverse(self.cal, self._decode_bases(h, device), units, tuple(h["shape"]))
        if self.cal.rope is not None:
            positions = torch.arange(h["start_token"], h["start_token"] + t, device=device)
            x[:, 0] = apply_rope(x[:, 0], positions, self.cal.rope)
        return x

    # ------------------------------------------------------------------ batched (GPU) restore

    def _batched_plan(self, h: dict, device: torch.device) -> transform_kernels.BatchedPlan:
        device = transform_kernels.indexed(device)  # "cuda" and "cuda:0" share plans and tables
        key = (float(h["theta"]), float(h["key_weight"]), device)
        with self._lock:
            if key in self._batched_plans:
                self._batched_plans[key] = self._batched_plans.pop(key)  # most recently used last
            else:
                while len(self._batched_plans) >= MAX_PLANS:  # each holds a padded basis on the device
                    self._batched_plans.pop(next(iter(self._batched_plans)))
                p = self.plan(key[0], key[1])
                if device not in self._stacked:
                    self._stacked[device] = transform_kernels.device_calibration(self.cal, device)
                self._batched_plans[key] = transform_kernels.build_plan(
                    self.cal, p.counts, p.steps, p.inverse, device, sigmas=p.sigmas, stacked=self._stacked[device]
                )
            if self.cal.rope is not None and device not in self._rope_tables:
                self._rope_tables[device] = transform_kernels.RopeTables(self.cal.rope, device)
            return self._batched_plans[key]

    def rope_tables(self, device: torch.device) -> transform_kernels.RopeTables | None:
        """The RoPE tables the batched restore keeps on `device` (None: no plan built there yet, or no RoPE)."""
        return self._rope_tables.get(transform_kernels.indexed(device))

    def _decode_batched(self, h: dict, streams: dict, out: Target, device: torch.device, decoder) -> Target:
        """The same restore in about ten kernels (restore.transform_kernels), no host waits."""
        self.finish([self.decode_samples(h, streams, device, decoder)], [out])
        return out

    @functools.cached_property
    def most_rows(self) -> int:
        """Coordinates a chunk codes per token at most: every column the calibration keeps."""
        return sum(self.cal.basis(g, k).variances.numel() for g in range(len(self.cal.groups)) for k in KINDS)

    def sample_count(self, h: dict) -> int:
        """Samples a verified chunk codes (coded coordinates x tokens)."""
        return self._plan_of(h).steps.numel() * h["tokens"]

    def decode_samples(
        self, h: dict, streams: dict, device: torch.device, decoder=None, samples=None, side=None
    ) -> Decoded:
        """A chunk's first half of the batched restore: its samples on `device` (NVDEC or zstd;
        `samples`: already decoded, a flat uint8 buffer that starts with them), escapes and sink
        tokens (`side`: host_side's, made already); finish() does the math, for many chunks at once."""
        C = self._plan_of(h).steps.numel()
        escapes, sink = side if side is not None else self.host_side(h, streams)
        if samples is None:
            samples = self._samples(h, streams, C * h["tokens"], device, decoder)
        samples = samples[: C * h["tokens"]].view(C, h["tokens"])
        return Decoded(h, samples, escapes, sink)

    def host_side(self, h: dict, streams: dict) -> tuple:
        """A chunk's escapes and sink tokens on the host (finish uploads them, all chunks' at once):
        decode_samples' work that needs no device, for a host thread to do ahead."""
        escapes = quantize.unpack_escapes(unzstd(streams["escapes"], "escapes", 4 + 8 * int(h["escapes"])))
        return escapes, self._sink(h, streams, torch.device("cpu")) if h["sink"] else None

    def finish(self, chunks: list[Decoded], outs: list[Target]) -> None:
        """The math of the batched restore for decoded chunks, each into its target: one pass
        per group of chunks that share a plan and a length (usually all of them)."""
        groups: dict[tuple, list[int]] = {}
        for i, (c, out) in enumerate(zip(chunks, outs, strict=True)):
            check_target(c.h, out)
            key = (float(c.h["theta"]), float(c.h["key_weight"]), c.h["tokens"], out.device, c.h["dtype"], c.h["recon"])
            groups.setdefault(key, []).append(i)
        for members in groups.values():
            self._finish_group([chunks[i] for i in members], [outs[i] for i in members])

    def warm_up(self, device: torch.device, dtype: torch.dtype) -> None:
        """Restore chunks of zeros (with and without finer-tail token scales, with and without sink
        tokens, of each length in transform_triton.WARM_TOKENS) into `dtype` on a CUDA `device`, so
        that the fused kernels are compiled (or loaded from Triton's cache) now, not during the first
        fetch; at a level that codes only the few widest coordinates."""
        if device.type != "cuda":
            return
        widest = max(float(self.cal.basis(g, k).variances.max()) for g in range(len(self.cal.groups)) for k in KINDS)
        h = {"theta": widest / 2, "key_weight": 1.0, "dtype": DTYPE_NAMES[dtype], "recon": "centre"}
        h |= {"shape": (self.cal.layers, self.cal.kv_heads, self.cal.head_dim), "start_token": 0, "sink": 0}
        for tokens in transform_triton.WARM_TOKENS:
            self._warm_up_chunks({**h, "tokens": tokens}, device, dtype)
        torch.cuda.synchronize(device)

    def _warm_up_chunks(self, h: dict, device: torch.device, dtype: torch.dtype) -> None:
        count, tokens = self._plan_of(h).steps.numel(), h["tokens"]
        L, H, D = h["shape"]
        for (fine_tokens, fine_bits), sink in itertools.product(((0, 0), (tokens, 1)), (0, 1)):
            zeros = torch.full((count, tokens), quantize.OFFSET, dtype=torch.uint8, device=device)
            none = (torch.zeros(0, dtype=torch.int64), torch.zeros(0, dtype=torch.int32))
            kept = torch.zeros((L, 2, sink, H, D), dtype=torch.float16) if sink else None
            chunk = Decoded({**h, "fine_tokens": fine_tokens, "fine_bits": fine_bits, "sink": sink}, zeros, none, kept)
            self.finish([chunk], [torch.empty((L, 2, tokens, H, D), dtype=dtype, device=device)])

    def _finish_group(self, chunks: list[Decoded], outs: list[Target]) -> None:
        h0 = chunks[0].h
        L, H, D = h0["shape"]
        t, dtype, device = h0["tokens"], DTYPES[h0["dtype"]], outs[0].device
        bp = self._batched_plan(h0, device)
        if device.type == "cuda":  # decoded on worker streams, read on this one: not reused before that
            stream = torch.cuda.current_stream(device)
            bp.used_on(stream)
            for c in chunks:
                if c.samples.device.type == "cuda":
                    c.samples.record_stream(stream)
        sinks = _sinks_on([c.sink for c in chunks], device)
        starts = [c.h["start_token"] for c in chunks]
        scales = None
        if any(c.h["fine_tokens"] for c in chunks):  # per-token step multipliers (N, t)
            per = [quantize.token_scales(t, c.h["fine_tokens"], c.h["fine_bits"]) for c in chunks]
            scales = transform_kernels.upload(torch.stack(per), device)
        denses = [
            out if isinstance(out, torch.Tensor) else torch.empty((L, 2, t, H, D), dtype=dtype, device=device)
            for out in outs
        ]
        transform_kernels.restore_into(
            bp,
            [c.samples for c in chunks],
            [c.escapes for c in chunks],
            (L, H, D),
            self.rope_tables(device),
            starts,
            denses,
            recon=h0["recon"],
            token_scales=scales,
            sinks=sinks,
        )
        for c, out, dense in zip(chunks, outs, denses):
            if isinstance(out, PagedKV):
                blocks, within = out.slots(c.h["start_token"], t)
                out.pages[:, :, blocks, within] = dense


def _sinks_on(sinks: list, device: torch.device) -> list:
    """The chunks' sink tokens (host tensors or None) on `device`: one upload for all of them."""
    host = [s for s in sinks if s is not None and s.device != device]
    if not host:
        return sinks
    flat = transform_kernels.upload(torch.cat([s.reshape(-1) for s in host]), device)
    out, off = [], 0
    for s in sinks:
        if s is None or s.device == device:
            out.append(s)
            continue
        out.append(flat[off : off + s.numel()].view(s.shape))
        off += s.numel()
    return out


@dataclasses.dataclass(frozen=True, eq=False)
class Decoded:
    """A chunk between the two halves of the batched restore (TransformRestorer.decode_samples)."""

    h: dict
    samples: torch.Tensor  # (C, tokens) uint8 on the target's device, layout order
    escapes: tuple[torch.Tensor, torch.Tensor]  # host: flat indices, true integers
    sink: torch.Tensor | None  # (L, 2, sink, H, D) float16 (on the host from decode_samples; finish uploads)


def frame_buffer(frames_announced: int, width: int, height: int, device) -> torch.Tensor:
    """A flat uint8 buffer for a video's frames, decoded frame after frame straight into it."""
    return torch.empty(frames_announced * 3 * width * height, dtype=torch.uint8, device=device)


def _decoded(decoder, video, frames_announced: int, count: int, w: int, hh: int, device) -> torch.Tensor:
    """The first `count` samples of a chunk's video on `device`: straight into one buffer where the
    decoder decodes into buffers with native callbacks (NvcuvidDecoder.decode_each_into), else
    frame by frame (frames.from_frames)."""
    native = getattr(decoder, "native", None)
    if native is not None and native() and torch.device(device) == getattr(decoder, "device", None):
        buf = frame_buffer(frames_announced, w, hh, device)
        for _ in decoder.decode_each_into([(0, video, w, hh, frames_announced, buf.data_ptr())]):
            pass
        return buf[:count]
    return frames.from_frames(decoder.decode(video, w, hh), count, w, hh, device)


# the float dtypes a restore writes into a tensor target whatever the chunk's stored dtype: the
# inverse transform computes in float32 and rounds once, into the target's dtype (a bfloat16
# engine's cache takes float16-stored chunks with no staging tensor and no second rounding)
TARGET_DTYPES = tuple(DTYPES.values())


def check_target(h: dict, out: Target) -> None:
    """ShapeError unless `out` is a target for the chunk of header `h`: a tensor of its shape in
    one of TARGET_DTYPES that holds the stored dtype's range, or a PagedKV in its stored dtype."""
    L, H, D = h["shape"]
    shape, dtype = (L, 2, h["tokens"], H, D), DTYPES[h["dtype"]]
    if isinstance(out, PagedKV):
        out.check(shape, dtype, h["start_token"])
        return
    fits = isinstance(out, torch.Tensor) and out.dtype in TARGET_DTYPES and holds_range(dtype, out.dtype)
    if not fits or tuple(out.shape) != shape:
        allowed = ", ".join(str(t) for t in TARGET_DTYPES if holds_range(dtype, t))
        raise ShapeError(f"output must be a {shape} tensor of {allowed} (stored: {dtype}) or a PagedKV")


def host_samples(streams: dict, count: int, into: torch.Tensor | None = None) -> torch.Tensor:
    """A zstd-coded chunk's `count` samples decompressed into a host tensor (`into`: the (count,)
    uint8 tensor to fill, e.g. pinned for an upload)."""
    host = torch.empty(count, dtype=torch.uint8) if into is None else into
    if (got := unzstd_into(streams["samples"], host.numpy(), "samples")) != count:
        raise CorruptStreamError(f"stream 'samples' holds {got} bytes, expected {count}")
    return host
