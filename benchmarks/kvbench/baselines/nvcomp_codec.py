"""Lossless GPU compressors from NVIDIA nvCOMP (`nvidia-nvcomp-cu13`, module `nvidia.nvcomp`):
ANS (rANS entropy coder on bytes), Bitcomp (NVIDIA's bit-packing of integers/floats) and GDeflate
(DEFLATE laid out for GPU decode). Both directions run on the GPU; `is_available()` is False
without CUDA or without the package, so these entries drop out of `available_codecs()` on a CPU
machine. The payload is nvCOMP's own native bitstream (its header included).
"""

from __future__ import annotations

import functools

import numpy as np
import torch

from kvbench.baselines.base import BITS_VIEW, check_kv, pack, unpack
from kvcodec.errors import BackendUnavailableError, CorruptStreamError

_WORD_TYPES = {1: "|u1", 2: "<u2", 4: "<u4"}


@functools.cache
def _nvcomp():
    if not torch.cuda.is_available():
        raise BackendUnavailableError("nvCOMP codecs need a CUDA GPU")
    try:
        from nvidia import nvcomp
    except Exception as e:  # missing package or a library that does not load
        raise BackendUnavailableError(f"nvidia.nvcomp does not import: {e}") from e
    return nvcomp


def _shuffle(b: torch.Tensor, itemsize: int) -> torch.Tensor:
    return b.reshape(-1, itemsize).T.contiguous().reshape(-1)


def _unshuffle(b: torch.Tensor, itemsize: int) -> torch.Tensor:
    return b.reshape(itemsize, -1).T.contiguous().reshape(-1)


class NvcompCodec:
    lossless = True

    def __init__(self, name: str, algorithm: str, shuffle: bool = False, typed: bool = False, **options) -> None:
        """algorithm: nvCOMP's name ("ANS", "Bitcomp", "GDeflate", ...). typed: tell nvCOMP the
        element width (data_type u2/u4) instead of bytes. options: passed to nvcomp.Codec."""
        self.name = name
        self.algorithm = algorithm
        self.shuffle = shuffle
        self.typed = typed
        self.options = options

    @staticmethod
    def is_available() -> bool:
        try:
            _nvcomp()
        except BackendUnavailableError:
            return False
        return True

    def _codec(self, itemsize: int):
        nvcomp = _nvcomp()
        opts = dict(self.options)
        if self.typed and not self.shuffle:
            opts["data_type"] = _WORD_TYPES[itemsize]
        return nvcomp.Codec(algorithm=self.algorithm, **opts)

    @staticmethod
    def _device(device) -> torch.device:
        dev = torch.device(device)
        return dev if dev.type == "cuda" else torch.device("cuda", torch.cuda.current_device())

    def encode(self, kv: torch.Tensor) -> bytes:
        check_kv(kv)
        nvcomp = _nvcomp()
        dev = self._device(kv.device)
        bits = kv.detach().contiguous().to(dev).view(BITS_VIEW[kv.dtype])
        itemsize = kv.element_size()
        if self.shuffle:
            src = _shuffle(bits.view(torch.uint8).reshape(-1), itemsize)
        elif self.typed:
            src = bits.reshape(-1)
        else:
            src = bits.view(torch.uint8).reshape(-1)
        comp = self._codec(itemsize).encode(nvcomp.as_array(src))
        host = np.asarray(comp.cpu()).view(np.uint8).reshape(-1)
        return pack(self.name, kv, host.tobytes())

    def decode(self, data: bytes, device: str | torch.device = "cpu") -> torch.Tensor:
        header, payload = unpack(data, self.name)
        nvcomp = _nvcomp()
        dev = self._device(device)
        comp = torch.frombuffer(bytearray(payload), dtype=torch.uint8).to(dev)
        try:
            out = self._codec(header.itemsize).decode(nvcomp.as_array(comp))
            raw = torch.as_tensor(out, device=dev).view(torch.uint8).reshape(-1)
            torch.cuda.synchronize(dev)
        except (RuntimeError, ValueError) as e:
            raise CorruptStreamError(f"nvCOMP {self.algorithm} stream does not decode: {e}") from e
        if raw.numel() != header.numel * header.itemsize:
            raise CorruptStreamError(
                f"nvCOMP decoded {raw.numel()} bytes, header announces {header.numel * header.itemsize}"
            )
        if self.shuffle:
            raw = _unshuffle(raw, header.itemsize)
        kv = raw.view(BITS_VIEW[header.dtype]).view(header.dtype).reshape(header.shape)
        target = torch.device(device)
        return kv if target.type == "cuda" else kv.to(target)
