"""Capability detection: which video backends run here, and the best one for a device.

Backends register by name with a priority; callers ask for a decoder for a device ("cpu", "cuda")
or an encoder, and get the highest-priority available one. Adding a backend means adding one entry
to _DECODERS or _ENCODERS, nothing else.
"""

from __future__ import annotations

import functools
import importlib
import logging
from dataclasses import dataclass

import torch

from kvcodec.errors import BackendUnavailableError

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class BackendEntry:
    name: str
    target: str  # "module:ClassName"
    device_type: str  # where frames are produced (decoders) or "cpu"/"cuda" (where encoding runs)
    priority: int  # higher wins

    def load(self):
        module, cls = self.target.split(":")
        return getattr(importlib.import_module(module), cls)


_DECODERS = (
    BackendEntry("nvdec", "kvcodec.video.nvdec:NvdecDecoder", "cuda", 100),
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


def get_decoder(device: str | torch.device = "cpu", name: str | None = None, **kwargs):
    """The best available decoder producing frames on `device` (NVDEC for cuda, FFmpeg for cpu)."""
    device_type = torch.device(device).type
    return _pick(_DECODERS, name, None if name else device_type)(**kwargs)


def get_encoder(name: str | None = None, **kwargs):
    """The best available lossless HEVC encoder (NVENC where the GPU has one, else x265)."""
    return _pick(_ENCODERS, name, None)(**kwargs)
