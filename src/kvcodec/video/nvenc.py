"""NVENC backend: lossless HEVC 4:4:4 8-bit encode on the GPU's hardware encoder (PyNvVideoCodec).

UNTESTED ON REAL HARDWARE: this project's GPU machines are H200s, which have no NVENC (opening an
encode session fails with NV_ENC_ERR_UNSUPPORTED_DEVICE), so `is_available()` is False there and
the registry falls back to x265 on the CPU. The code follows PyNvVideoCodec's documented encoder
API (CreateEncoder / Encode / EndEncode, HEVC, "lossless" tuning, YUV444 input) and is meant for
GPUs with an NVENC that supports 4:4:4 lossless HEVC (L4, L40, A10, RTX class). Run
tests/test_nvenc.py on such a GPU before relying on it: it checks bit-exact round trips.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Iterable

import numpy as np

from kvcodec.errors import BackendUnavailableError, ConfigError, CorruptStreamError

log = logging.getLogger(__name__)

# Encoder settings for mathematically lossless HEVC: the "lossless" tuning (NVENC's lossless preset
# configuration: constant QP 0 with transquant bypass), no B-frames (decode order = display order,
# as the NVDEC path assumes), one intra frame then P-frames, parameter sets repeated with each IDR.
# Only option names PyNvVideoCodec's encoder parser knows are used.
LOSSLESS_PARAMS = {
    "codec": "hevc",
    "preset": "P1",
    "tuning_info": "lossless",
    "bf": "0",
    "gop": "-1",
    "idrperiod": "-1",
    "repeatspspps": "1",
}


# x265 speed presets (what CodecConfig.x265_preset names) -> NVENC presets P1 (fastest) .. P7.
X265_TO_NVENC_PRESET = {
    "ultrafast": "P1",
    "superfast": "P2",
    "veryfast": "P3",
    "faster": "P3",
    "fast": "P4",
    "medium": "P4",
    "slow": "P5",
    "slower": "P6",
    "veryslow": "P7",
    "placebo": "P7",
}
NVENC_PRESETS = tuple(f"P{i}" for i in range(1, 8))


def nvenc_preset(preset: str) -> str:
    """The NVENC preset for an x265 preset name, or an NVENC preset name itself."""
    if preset.upper() in NVENC_PRESETS:
        return preset.upper()
    try:
        return X265_TO_NVENC_PRESET[preset]
    except KeyError:
        raise ConfigError(f"unknown encoder preset {preset!r}: use an x265 preset or P1..P7") from None


def _nvc():
    try:
        import PyNvVideoCodec as nvc  # noqa: N813 - the package's own spelling
    except Exception as e:
        raise BackendUnavailableError(f"PyNvVideoCodec is not usable here: {e}") from e
    return nvc


def _packets_bytes(packets) -> bytes:
    """Encode()/EndEncode() return a list of dicts with 'data' (2.x) or a bytearray (1.x)."""
    if packets is None:
        return b""
    if isinstance(packets, (bytes, bytearray, memoryview)):
        return bytes(packets)
    out = bytearray()
    for p in packets:
        out += bytes(p["data"]) if isinstance(p, dict) else bytes(p)
    return bytes(out)


_PROBE_SCRIPT = r"""
import sys
import PyNvVideoCodec as nvc
from kvcodec.video.nvenc import LOSSLESS_PARAMS
gpu = int(sys.argv[1])
try:
    caps = dict(nvc.GetEncoderCaps(gpuid=gpu, codec="hevc") or {})
except TypeError:
    caps = dict(nvc.GetEncoderCaps(codec="hevc") or {})
for key in ("support_lossless_encode", "support_yuv444_encode"):
    if key in caps and not int(caps[key]):
        print("NVENC lacks " + key); sys.exit(1)
enc = nvc.CreateEncoder(256, 256, "YUV444", True, gpu_id=gpu, **LOSSLESS_PARAMS)
print("ok")
"""


@functools.cache
def _probe(gpu_id: int) -> tuple[bool, str]:
    """(available, reason): the encoder caps allow lossless 4:4:4 HEVC and a small encode session
    opens. Probed in a child process: a failed session open (NV_ENC_ERR_UNSUPPORTED_DEVICE on
    GPUs without NVENC, such as the H100/H200) can leave a stray CUDA context current on the
    calling thread, which would then break NVDEC and torch in this process."""
    import os
    import subprocess
    import sys

    try:
        import torch

        if not torch.cuda.is_available():
            return False, "no CUDA device"
        import importlib.util

        if importlib.util.find_spec("PyNvVideoCodec") is None:
            return False, "PyNvVideoCodec is not installed"
        r = subprocess.run(
            [sys.executable, "-c", _PROBE_SCRIPT, str(gpu_id)],
            capture_output=True,
            text=True,
            timeout=120,
            env={**os.environ, "PYTHONPATH": os.pathsep.join(p for p in sys.path if p)},
        )
        if r.returncode == 0 and r.stdout.strip().endswith("ok"):
            return True, "ok"
        tail = (r.stdout + r.stderr).strip().splitlines()
        return False, tail[-1] if tail else f"probe exited with {r.returncode}"
    except Exception as e:
        return False, f"{type(e).__name__}: {e}"


class NvencEncoder:
    """Lossless HEVC on NVENC. Frames: (3, height, width) uint8 planes, fed from host memory."""

    name = "nvenc"

    def __init__(self, gpu_id: int | None = None, preset: str = "P1", **params):
        preset = nvenc_preset(preset)  # callers name x265 presets ("ultrafast"); NVENC takes P1..P7
        params.pop("tuning", None)  # x265 parameters (FAST_TUNING): nothing NVENC takes
        import torch

        if not torch.cuda.is_available():
            raise BackendUnavailableError("NVENC needs a CUDA GPU")
        self.gpu_id = torch.cuda.current_device() if gpu_id is None else int(gpu_id)
        ok, reason = _probe(self.gpu_id)
        if not ok:
            raise BackendUnavailableError(f"NVENC lossless HEVC is not available: {reason}")
        self.params = {**LOSSLESS_PARAMS, "preset": preset, **{k: str(v) for k, v in params.items()}}

    @classmethod
    def is_available(cls) -> bool:
        try:
            import torch

            return torch.cuda.is_available() and _probe(torch.cuda.current_device())[0]
        except Exception:
            return False

    def encode(self, frames: Iterable[np.ndarray], width: int, height: int) -> bytes:
        nvc = _nvc()
        if width % 2 or height % 2:
            raise ValueError("NVENC needs even frame dimensions")
        try:
            enc = nvc.CreateEncoder(width, height, "YUV444", True, gpu_id=self.gpu_id, **self.params)
        except Exception as e:
            raise BackendUnavailableError(f"cannot open an NVENC session: {e}") from e
        out = bytearray()
        n = 0
        for i, planes in enumerate(frames):
            if planes.shape != (3, height, width) or planes.dtype != np.uint8:
                raise ValueError(f"frame {i}: expected (3, {height}, {width}) uint8, got {planes.shape} {planes.dtype}")
            # YUV444 planar host buffer: the Y, U, V planes one after the other, exactly (3, H, W)
            buf = np.ascontiguousarray(planes).reshape(-1)
            out += _packets_bytes(_session_call(_encode_frame, nvc, enc, buf, i))
            n += 1
        out += _packets_bytes(_session_call(enc.EndEncode))
        if n and not out:
            raise CorruptStreamError("NVENC returned no bitstream")
        return bytes(out)


def _encode_frame(nvc, enc, buf, i):
    try:
        pic = nvc.NV_ENC_PIC_PARAMS()
        pic.inputTimeStamp = i
        return enc.Encode(buf, pic)
    except TypeError:
        return enc.Encode(buf)


def _session_call(fn, *args):
    """A call into the NVENC session; its failure is the backend's (so the registry's fallback
    encoder moves on to x265), not the data's."""
    try:
        return fn(*args)
    except Exception as e:
        raise BackendUnavailableError(f"NVENC encode failed: {type(e).__name__}: {e}") from e
