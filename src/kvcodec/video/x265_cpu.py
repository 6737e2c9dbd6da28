"""CPU backends through PyAV: libx265 lossless encode and FFmpeg's native hevc decode, in memory."""

from __future__ import annotations

import fractions
import os
from collections.abc import Iterable, Iterator

import numpy as np
import torch

from kvcodec.errors import BackendUnavailableError, CorruptStreamError

PIX_FMT = "yuv444p"


def _av():
    try:
        import av
    except ImportError as e:  # pragma: no cover - av is a hard dependency
        raise BackendUnavailableError("PyAV (the `av` package) is not installed") from e
    return av


# x265 settings beyond the preset. info=0 leaves out the SEI that names the encoder's options
# (thread counts among them): without it the bitstream is the same for any number of threads,
# and a little smaller. FAST_TUNING, what the HEVC codec uses, was chosen by measured speed
# against size on real KV (kvcodec bench encode; benchmarks/results/encode-*.md): 16x16 CTUs and
# RD level 1 encode several times faster than ultrafast's 32x32 / RD 2 for under 1% more bytes.
# The transform codec's streams gain nothing from it (same speed, 0.9% larger), so the generic
# default is info=0 alone.
FAST_TUNING = "ctu=16:rd=1:info=0"
default_tuning = "info=0"  # what X265Encoder() uses; a benchmark may set "" to time the earlier default


class X265Encoder:
    """Lossless HEVC through libx265 (bundled with PyAV).

    tuning: x265 parameters added to the lossless ones (None: `default_tuning`; FAST_TUNING for
    the HEVC codec; "" gives the preset alone, the earlier default). threads: x265's thread pool size (with tuning's info=0 the
    bitstream does not depend on it); chunk-parallel encodes use 1 per chunk."""

    name = "x265"

    def __init__(
        self,
        preset: str = "ultrafast",
        threads: int | None = None,
        extra_params: str = "",
        tuning: str | None = None,
    ):
        self.preset = preset
        self.threads = threads or min(os.cpu_count() or 1, 16)
        self.extra_params = extra_params
        self.tuning = default_tuning if tuning is None else tuning

    @property
    def settings(self) -> str:
        """What the bitstream depends on (not the thread count): a cache key for decisions made
        by trial encodes."""
        return ":".join(p for p in (f"x265/{self.preset}", self.tuning, self.extra_params) if p)

    def with_threads(self, threads: int) -> X265Encoder:
        """This encoder with another thread pool size (same bitstream)."""
        return X265Encoder(self.preset, threads, self.extra_params, self.tuning)

    @classmethod
    def is_available(cls) -> bool:
        try:
            av = _av()
            av.codec.Codec("libx265", "w")
            return True
        except Exception:
            return False

    def encode(self, frames: Iterable[np.ndarray], width: int, height: int) -> bytes:
        return b"".join(self._packets(frames, width, height, "keyint=-1"))

    def encode_intra(self, frames: Iterable[np.ndarray], width: int, height: int) -> list[bytes]:
        """Each frame as a stream of its own (parameter sets and one IDR picture), in order: each
        decodes alone, and together, joined, they are one stream of all the frames."""
        return self._packets(frames, width, height, "keyint=1:repeat-headers=1")

    def _packets(self, frames: Iterable[np.ndarray], width: int, height: int, gop: str) -> list[bytes]:
        """One packet (access unit) per frame, in order."""
        av = _av()
        ctx = av.CodecContext.create("libx265", "w")
        ctx.width, ctx.height, ctx.pix_fmt = width, height, PIX_FMT
        ctx.time_base = fractions.Fraction(1, 25)
        # hash=1: an MD5 of every decoded picture in an SEI message, which the CPU decoder
        # verifies: a damaged stream must not decode to memory the decoder never wrote
        params = f"lossless=1:log-level=none:bframes=0:{gop}:hash=1:pools={self.threads}"
        for extra in (self.tuning, self.extra_params):
            if extra:
                params += ":" + extra
        ctx.options = {"preset": self.preset, "x265-params": params}
        out: list[bytes] = []
        for i, planes in enumerate(frames):
            if planes.shape != (3, height, width) or planes.dtype != np.uint8:
                raise ValueError(f"frame {i}: expected (3, {height}, {width}) uint8, got {planes.shape} {planes.dtype}")
            frame = av.VideoFrame(width, height, PIX_FMT)
            for p in range(3):
                _fill_plane(frame.planes[p], planes[p])
            frame.pts = i
            out += [bytes(packet) for packet in ctx.encode(frame)]
        out += [bytes(packet) for packet in ctx.encode(None)]
        return out


def _fill_plane(plane, data: np.ndarray) -> None:
    h, w = data.shape
    if plane.line_size == w:
        plane.update(np.ascontiguousarray(data))
    else:
        buf = np.zeros((h, plane.line_size), dtype=np.uint8)
        buf[:, :w] = data
        plane.update(buf)


class FFmpegHevcDecoder:
    """FFmpeg's native hevc decoder on the CPU (bit-exact for lossless 4:4:4 8-bit)."""

    name = "ffmpeg-cpu"
    device_type = "cpu"

    def __init__(self, threads: int = 0):
        self.threads = threads

    @classmethod
    def is_available(cls) -> bool:
        try:
            _av().codec.Codec("hevc", "r")
            return True
        except Exception:
            return False

    def decode(self, bitstream: bytes, width: int, height: int) -> Iterator[torch.Tensor]:
        av = _av()
        ctx = av.CodecContext.create("hevc", "r")
        ctx.options = {"err_detect": "crccheck+explode"}  # verify picture hashes, stop at any error
        if self.threads:
            ctx.thread_count = self.threads
        try:
            for packet in ctx.parse(bitstream):
                for frame in ctx.decode(packet):
                    yield _frame_to_tensor(frame, width, height)
            for packet in ctx.parse(None):
                for frame in ctx.decode(packet):
                    yield _frame_to_tensor(frame, width, height)
            for frame in ctx.decode(None):
                yield _frame_to_tensor(frame, width, height)
        except av.error.FFmpegError as e:
            raise CorruptStreamError(f"HEVC stream does not decode: {e}") from e


def _frame_to_tensor(frame, width: int, height: int) -> torch.Tensor:
    if frame.width != width or frame.height != height or frame.format.name != PIX_FMT:
        raise CorruptStreamError(
            f"decoded frame is {frame.width}x{frame.height} {frame.format.name}, expected {width}x{height} {PIX_FMT}"
        )
    out = np.empty((3, height, width), dtype=np.uint8)
    for p in range(3):
        plane = frame.planes[p]
        out[p] = np.frombuffer(plane, dtype=np.uint8).reshape(height, plane.line_size)[:, :width]
    return torch.from_numpy(out)
