"""Alternative NVDEC path: FFmpeg's CUDA hwaccel through PyAV, frames kept on the GPU (DLPack).

Measured against `kvcodec.video.nvdec.NvdecDecoder` (PyNvVideoCodec) by `kvcodec bench decode`;
the registry uses NvdecDecoder. This one needs no package beyond PyAV, whose wheel bundles FFmpeg
with the nvdec hwaccel (the driver's libnvcuvid is loaded at run time).
"""

from __future__ import annotations

from collections.abc import Iterator

import torch

from kvcodec.errors import BackendUnavailableError, CorruptStreamError


class PyAVNvdecDecoder:
    name = "nvdec-pyav"
    device_type = "cuda"

    def __init__(self, device: str | torch.device | int | None = None):
        if not torch.cuda.is_available():
            raise BackendUnavailableError("no CUDA device")
        dev = torch.device("cuda", device) if isinstance(device, int) else torch.device(device or "cuda")
        self.device = torch.device("cuda", dev.index if dev.index is not None else torch.cuda.current_device())

    @classmethod
    def is_available(cls) -> bool:
        try:
            from av.codec.hwaccel import HWAccel, hwdevices_available  # noqa: F401

            return torch.cuda.is_available() and "cuda" in hwdevices_available()
        except Exception:
            return False

    def _context(self):
        import av
        from av.codec.hwaccel import HWAccel

        from kvcodec.video.nvcuvid_api import make_current, primary_context

        torch.cuda.set_device(self.device)
        torch.empty(1, device=self.device)
        # FFmpeg's "current_ctx" takes the driver's current context: make it torch's primary one
        make_current(primary_context(self.device.index))
        hw = HWAccel(
            device_type="cuda",
            device=str(self.device.index),
            allow_software_fallback=False,
            # use torch's (current, primary) context so DLPack pointers are valid in torch
            options={"current_ctx": "1"},
            is_hw_owned=True,
        )
        return av.CodecContext.create("hevc", "r", hwaccel=hw)

    def decode(self, bitstream, width: int, height: int) -> Iterator[torch.Tensor]:
        import av

        try:
            ctx = self._context()
        except Exception as e:
            raise BackendUnavailableError(f"FFmpeg CUDA hwaccel unavailable: {e}") from e
        count = 0
        try:
            packets = list(ctx.parse(bytes(bitstream))) + list(ctx.parse(None))
            for packet in packets + [None]:
                for frame in ctx.decode(packet):
                    count += 1
                    yield self._frame(frame, width, height)
        except av.error.FFmpegError as e:
            raise CorruptStreamError(f"HEVC stream does not decode on the CUDA hwaccel: {e}") from e
        if count == 0:
            raise CorruptStreamError("no frame decoded")

    def _frame(self, frame, width: int, height: int) -> torch.Tensor:
        if frame.width != width or frame.height != height:
            raise CorruptStreamError(f"decoded frame is {frame.width}x{frame.height}, expected {width}x{height}")
        sw = getattr(frame, "sw_format", None)
        swname = getattr(sw, "name", str(sw))
        if frame.format.name != "cuda":
            raise CorruptStreamError(f"frame came back as {frame.format.name}, not a CUDA frame (software fallback?)")
        if swname != "yuv444p":
            raise CorruptStreamError(f"CUDA frame holds {swname}; kvcodec streams are yuv444p")
        out = torch.empty((3, height, width), dtype=torch.uint8, device=self.device)
        torch.cuda.synchronize(self.device)  # PyAV exports without stream ordering: the frame must be complete
        for p in range(3):
            plane = torch.from_dlpack(frame.planes[p].__dlpack__(stream=None))
            if plane.dim() == 1:
                plane = plane.view(-1, plane.numel() // height)
            out[p].copy_(plane[:height, :width])
        return out
