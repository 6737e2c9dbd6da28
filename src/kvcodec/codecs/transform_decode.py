"""The transform codec's restore path: a chunk's verified header and streams -> samples (NVDEC on
a CUDA target, FFmpeg on the CPU, or zstd) -> integers -> dequantize -> one GEMM per
(layer group, K|V) -> RoPE re-applied -> the caller's dense slice or PagedKV."""

from __future__ import annotations

from collections.abc import Callable

import torch
import zstandard

from kvcodec.codecs.base import Target
from kvcodec.errors import CorruptStreamError, ShapeError
from kvcodec.restore.paged import PagedKV
from kvcodec.transform import frames, quantize
from kvcodec.transform.calibration import KINDS, Calibration
from kvcodec.transform.rope import apply_rope

DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}


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

    def __init__(self, cal: Calibration, plan: Callable):
        self.cal, self.plan = cal, plan
        self._device_bases: dict[torch.device, list] = {}

    def _bases_on(self, device: torch.device) -> list:
        if device not in self._device_bases:
            self._device_bases[device] = [
                (self.cal.basis(g, k).mean.to(device), self.cal.basis(g, k).basis.to(device))
                for g in range(len(self.cal.groups))
                for k in KINDS
            ]
        return self._device_bases[device]

    def _samples(self, h: dict, streams: dict, count: int, device: torch.device) -> torch.Tensor:
        if h["coder"] == "zstd":
            raw = unzstd(streams["samples"], "samples", count)
            return torch.frombuffer(bytearray(raw), dtype=torch.uint8).to(device)
        from kvcodec.codecs.hevc_decode import idle_decoders  # sessions lent per call: one thread each

        w, hh = h["resolution"]
        if h["frames"] != frames.frame_count(count, w, hh):
            raise CorruptStreamError("transform chunk announces the wrong number of frames")
        with idle_decoders.borrow(device) as decoder:
            return frames.from_frames(decoder.decode(bytes(streams["video"]), w, hh), count, w, hh, device)

    def decode(self, h: dict, streams: dict, out: Target) -> Target:
        L, H, D = h["shape"]
        t, dtype = h["tokens"], DTYPES[h["dtype"]]
        shape = (L, 2, t, H, D)
        if isinstance(out, PagedKV):
            out.check(shape, dtype, h["start_token"])
        elif not isinstance(out, torch.Tensor) or tuple(out.shape) != shape or out.dtype != dtype:
            raise ShapeError(f"output must be a {shape} {dtype} tensor or a PagedKV")
        device = out.device
        x = self._restore(h, streams, device)
        if h["sink"]:
            raw = unzstd(streams["sink"], "sink", h["sink"] * L * 2 * H * D * 2)
            sink = torch.frombuffer(bytearray(raw), dtype=torch.float16).view(L, 2, h["sink"], H, D)
            x[:, :, : h["sink"]] = sink.to(device, torch.float32)
        if isinstance(out, PagedKV):
            blocks, within = out.slots(h["start_token"], t)
            out.pages[:, :, blocks, within] = x.to(dtype)
        else:
            out.copy_(x)
        return out

    def _restore(self, h: dict, streams: dict, device: torch.device) -> torch.Tensor:
        """Dequantize, inverse transform (one GEMM per group and kind), re-apply RoPE: float32 KV."""
        plan = self.plan(float(h["theta"]), float(h["key_weight"]))
        C, t = plan.steps.numel(), h["tokens"]
        samples = self._samples(h, streams, C * t, device).view(C, t)
        idx, values = quantize.unpack_escapes(unzstd(streams["escapes"], "escapes", 4 + 8 * int(h["escapes"])))
        q = quantize.from_samples(samples, idx, values)
        coeffs = q[plan.inverse.to(device)].to(torch.float32) * plan.steps.to(device)[:, None]  # concatenated order
        L, H, D = h["shape"]
        x = torch.empty((L, 2, t, H, D), dtype=torch.float32, device=device)
        off = 0
        for j, (mean, basis) in enumerate(self._bases_on(device)):
            layers, n = self.cal.groups[j // 2], plan.counts[j]
            xg = torch.addmm(mean[:, None], basis[:, :n], coeffs[off : off + n]) if n else mean[:, None].expand(-1, t)
            x[list(layers), j % 2] = xg.T.reshape(t, len(layers), H, D).permute(1, 0, 2, 3)
            off += n
        if self.cal.rope is not None:
            positions = torch.arange(h["start_token"], h["start_token"] + t, device=device)
            x[:, 0] = apply_rope(x[:, 0], positions, self.cal.rope)
        return x
