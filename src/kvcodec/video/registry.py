"""Capability detection: which video backends run here, and the best one for a device.

Backends register by name with a priority; callers ask for a decoder for a device ("cpu", "cuda")
or an encoder, and get the highest-priority available one. Adding a backend means adding one entry
to _DECODERS or _ENCODERS, nothing else. A CUDA device without a GPU decoder gets the CPU decoder
(frames are then moved to the device); an encoder whose session fails (NVENC on a GPU that
announces one but cannot open it) hands the encode to the next available encoder.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np
import torch

from kvcodec.errors import BackendUnavailableError
from kvcodec.plugins import load_object

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class BackendEntry:
    name: str
    target: str  # "module:ClassName"
    device_type: str  # where frames are produced (decoders) or "cpu"/"cuda" (where encoding runs)
    priority: int  # higher wins

    def load(self):
        return load_object(self.target)


_DECODERS = (
    # The driver's libnvcuvid first: restored 1.85 vs 1.55 GB/s (decode-h200-nvcuvid.md) and fetched
    # transform-coded KV at 2.28 vs 1.51 GB/s (transform-fetch-h200.md) against PyNvVideoCodec on 7 threads.
    BackendEntry("nvcuvid", "kvcodec.video.nvcuvid:NvcuvidDecoder", "cuda", 110),
    BackendEntry("nvdec", "kvcodec.video.nvdec:NvdecDecoder", "cuda", 100),  # PyNvVideoCodec
    BackendEntry("ffmpeg-cpu", "kvcodec.video.x265_cpu:FFmpegHevcDecoder", "cpu", 10),
)
_ENCODERS = (
    BackendEntry("nvenc", "kvcodec.video.nvenc:NvencEncoder", "cuda", 100),
    BackendEntry("x265", "kvcodec.video.x265_cpu:X265Encoder", "cpu", 10),
)


@functools.cache
def _is_available(entry: BackendEntry) -> bool:
    try:
        return bool(entry.load().is_available())
    except Exception as e:  # a backend whose module cannot even import is unavailable
        log.debug("video backend %s unavailable: %s", entry.name, e)
        return False


def available_backends() -> dict[str, list[str]]:
    return {
        "decoders": [e.name for e in _DECODERS if _is_available(e)],
        "encoders": [e.name for e in _ENCODERS if _is_available(e)],
    }


def _pick(entries, name: str | None, device_type: str | None):
    candidates = sorted(entries, key=lambda e: -e.priority)
    if name is not None:
        candidates = [e for e in candidates if e.name == name]
        if not candidates:
            raise BackendUnavailableError(f"no video backend named {name!r}")
    if device_type is not None:
        candidates = [e for e in candidates if e.device_type == device_type]
    for entry in candidates:
        if _is_available(entry):
            return entry.load()
    what = name or f"for device {device_type}"
    raise BackendUnavailableError(f"no available video backend {what}")


def get_decoder(device: str | torch.device = "cpu", name: str | None = None, *, fallback: bool = True, **kwargs):
    """The best available decoder for `device` (NVDEC for cuda, FFmpeg for cpu). With `fallback`,
    a CUDA device without an available GPU decoder gets the CPU decoder (as the README says)."""
    device_type = torch.device(device).type
    if device_type == "cuda":
        kwargs.setdefault("device", device)  # cuda:1 from a thread whose current device is 0 stays on 1
    try:
        return _pick(_DECODERS, name, None if name else device_type)(**kwargs)
    except BackendUnavailableError as e:
        if name is not None or not fallback or device_type == "cpu":
            raise
        log.warning("no GPU video decoder for %s (%s): decoding on the CPU", device, e)
        return _pick(_DECODERS, None, "cpu")()


def get_encoder(name: str | None = None, **kwargs):
    """The best available lossless HEVC encoder (NVENC where the GPU has one, else x265). Without
    a `name`, an encode whose session fails falls back to the next encoder (FallbackEncoder);
    its `name` says which one ran last."""
    if name is not None:
        return _pick(_ENCODERS, name, None)(**kwargs)
    entries = [e for e in sorted(_ENCODERS, key=lambda e: -e.priority) if _is_available(e)]
    if not entries:
        raise BackendUnavailableError("no available video encoder")
    if len(entries) == 1:
        return entries[0].load()(**kwargs)
    return FallbackEncoder(entries, kwargs)


class FallbackEncoder:
    """Encoders in priority order: the first one is used until an encode fails with
    BackendUnavailableError (a session that does not open), then the next one, for good."""

    def __init__(self, entries: list[BackendEntry], kwargs: dict) -> None:
        self._entries = list(entries)
        self._kwargs = kwargs
        self._current = None
        self.name = entries[0].name

    def _encoder(self):
        while self._current is None:
            entry = self._entries[0]
            try:
                self._current = entry.load()(**self._kwargs)
            except BackendUnavailableError as e:
                self._drop(entry, e)
        return self._current

    def _drop(self, entry: BackendEntry, error: Exception) -> None:
        if len(self._entries) == 1:
            raise BackendUnavailableError(f"no video encoder could run; the last, {entry.name}, failed: {error}")
        self._entries.pop(0)
        self._current = None
        self.name = self._entries[0].name
        log.warning("video encoder %s failed (%s); encoding with %s", entry.name, error, self.name)

    def encode(self, frames: Iterable[np.ndarray], width: int, height: int) -> bytes:
        frames = frames if isinstance(frames, (list, tuple)) else list(frames)
        while True:
            encoder = self._encoder()
            try:
                return encoder.encode(frames, width, height)
            except BackendUnavailableError as e:
                self._drop(self._entries[0], e)
