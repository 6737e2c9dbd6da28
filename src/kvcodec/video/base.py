"""Protocols every video backend implements.

A bitstream is a raw HEVC Annex-B elementary stream (no container), lossless (x265 `lossless=1`),
4:4:4 8-bit: each frame is three planes of `height x width` uint8 samples.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Protocol, runtime_checkable

import numpy as np
import torch


@runtime_checkable
class VideoEncoder(Protocol):
    name: str

    @classmethod
    def is_available(cls) -> bool:
        """True when this backend can run on this machine (libraries and hardware present)."""

    def encode(self, frames: Iterable[np.ndarray], width: int, height: int) -> bytes:
        """Encode frames of shape (3, height, width) uint8, losslessly, into one bitstream.

        An encoder may also have encode_intra(frames, width, height) -> list[bytes]: each frame a
        stream of its own that decodes alone (the transform codec's pieces), joined one stream."""


@runtime_checkable
class VideoDecoder(Protocol):
    name: str
    device_type: str  # "cpu" or "cuda": where decoded frames live

    @classmethod
    def is_available(cls) -> bool:
        """True when this backend can run on this machine (libraries and hardware present)."""

    def decode(self, bitstream: bytes, width: int, height: int) -> Iterator[torch.Tensor]:
        """Yield the frames of `bitstream` one at a time, each a (3, height, width) uint8 tensor on
        this backend's device. Raises CorruptStreamError when the stream does not decode to
        frames of that size."""
