"""NVDEC backend: HEVC decode on the GPU's hardware video decoders, frames kept on the GPU.

Built on PyNvVideoCodec's core `Decoder` (CreateDecoder + PacketData): the raw Annex-B stream is
split into access units on the host (start-code scan, no copy), each access unit is handed to NVDEC
by pointer, and every decoded surface is turned into a torch tensor through DLPack / the CUDA array
interface (no host copy) and converted on the GPU to the (3, H, W) uint8 frame of the protocol.

One `NvdecDecoder` owns an NVDEC session per frame size (up to three, reused across streams). One
session uses one engine at a time; to use all of a GPU's engines decode several streams in parallel
through `kvcodec.video.nvdec_pool.NvdecPool` (one decoder per worker process: threads inside one
process do not scale).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Iterator

import numpy as np
import torch

from kvcodec.errors import BackendUnavailableError, CorruptStreamError
from kvcodec.video.nvcuvid_api import make_current, primary_context
from kvcodec.video.streams import restore_stream

log = logging.getLogger(__name__)

# HEVC NAL unit types that open a new access unit when they precede its first slice
# (VPS, SPS, PPS, AUD, prefix SEI, reserved 41..44, unspecified 48..55).
_AU_PREFIX_NALS = frozenset((32, 33, 34, 35, 39, 41, 42, 43, 44, *range(48, 56)))


def split_access_units(bitstream) -> list[tuple[int, int]]:
    """(offset, length) of each access unit of a raw HEVC Annex-B stream, in stream order.

    An access unit starts at the first parameter-set / AUD / prefix-SEI NAL before a slice whose
    first_slice_segment_in_pic_flag is set, or at that slice itself. Start codes cannot occur
    inside NAL payloads (emulation prevention), so a byte search finds every NAL.
    """
    data = bytes(bitstream) if not isinstance(bitstream, (bytes, bytearray, memoryview)) else bitstream
    if isinstance(data, memoryview):
        data = data.tobytes()
    n = len(data)
    au_starts: list[int] = []
    pending: int | None = None
    i = data.find(b"\x00\x00\x01")
    while i >= 0:
        begin = i - 1 if i > 0 and data[i - 1] == 0 else i  # keep 4-byte start codes whole
        if i + 5 >= n:
            break
        nal_type = (data[i + 3] >> 1) & 0x3F
        if nal_type < 32:  # VCL
            if data[i + 5] & 0x80:  # first_slice_segment_in_pic_flag
                au_starts.append(begin if pending is None else pending)
                pending = None
        elif nal_type in _AU_PREFIX_NALS and pending is None:
            pending = begin
        i = data.find(b"\x00\x00\x01", i + 3)
    if not au_starts:
        raise CorruptStreamError("no HEVC picture (slice NAL unit) found in the bitstream")
    au_starts[0] = 0
    ends = au_starts[1:] + [n]
    return [(s, e - s) for s, e in zip(au_starts, ends)]


def _nvc():
    try:
        import PyNvVideoCodec as nvc  # noqa: N813 - the package's own spelling
    except Exception as e:  # ImportError, or RuntimeError when the driver's codec libraries are absent
        raise BackendUnavailableError(f"PyNvVideoCodec is not usable here: {e}") from e
    return nvc


@functools.cache
def _decoder_caps(nvc, index: int) -> dict:
    """NVDEC's capabilities for HEVC 4:4:4 8-bit on device `index` (GetDecoderCaps)."""
    chroma = nvc.cudaVideoChromaFormat
    c444 = next(getattr(chroma, n) for n in dir(chroma) if n.lstrip("_") == "444" or n.endswith("444"))
    caps = nvc.GetDecoderCaps(gpuid=index, codec=nvc.cudaVideoCodec.HEVC, chromaformat=c444, bitdepth=8)
    caps = dict(caps) if isinstance(caps, dict) else {"supported": bool(caps)}
    if "supported" not in caps:
        for k in ("is_supported", "bIsSupported", "IsSupported"):
            if k in caps:
                caps["supported"] = bool(caps[k])
    return caps


class _CudaBuffer:
    """A raw device pointer as a flat uint8 array (CUDA array interface), for torch.as_tensor."""

    def __init__(self, ptr: int, nbytes: int):
        self.__cuda_array_interface__ = {
            "shape": (nbytes,),
            "typestr": "|u1",
            "data": (int(ptr), False),
            "version": 3,
            "strides": None,
        }


def _surface_tensor(frame, device: torch.device) -> torch.Tensor:
    """The decoded surface as a device tensor sharing its memory (DLPack, else the raw pointer)."""
    try:
        return torch.from_dlpack(frame)
    except Exception:
        pass
    nbytes = int(frame.framesize())
    return torch.as_tensor(_CudaBuffer(frame.GetPtrToPlane(0), nbytes), device=device)


def _fmt_name(frame) -> str:
    fmt = frame.format if hasattr(frame, "format") else frame.GetPixelFormat()
    return str(getattr(fmt, "name", fmt)).split(".")[-1].upper()


def _as_rows(surface: torch.Tensor, width: int) -> torch.Tensor:
    """The surface as a 2-d (rows, >= width) tensor of samples, keeping its pitch (no copy)."""
    t = surface
    if t.dim() == 3:  # (planes, rows, cols)
        t = t.reshape(-1, t.shape[-1]) if t.is_contiguous() else t.flatten(0, 1)
    if t.dim() == 1:
        if t.numel() % width:
            raise CorruptStreamError(f"surface of {t.numel()} samples is not a whole number of rows of {width}")
        t = t.view(-1, width)
    if t.dim() != 2 or t.shape[1] < width:
        raise CorruptStreamError(f"surface of shape {tuple(surface.shape)} does not hold rows of width {width}")
    return t


def surface_to_planes(surface: torch.Tensor, fmt: str, width: int, height: int) -> list[torch.Tensor]:
    """Split a decoded NVDEC surface into its planes, as views (no copy).

    fmt: the surface format name: "YUV444" (3 planes of HxW uint8), "YUV444_16BIT" (same, in 16-bit
    containers), "NV12" (Y HxW, then interleaved UV (H/2)x(W/2)x2, uint8), "P016" (NV12 layout in
    16-bit containers). 16-bit surfaces come back as int16 views holding the MSB-aligned samples
    (use `msb_aligned_to_int` for the sample values).
    """
    fmt = fmt.upper()
    wide = "16" in fmt or fmt.startswith("P01")
    t = surface
    if wide and t.dtype == torch.uint8:
        if t.shape[-1] % 2:
            raise CorruptStreamError(f"{fmt} surface has an odd number of bytes per row")
        t = t.contiguous().view(torch.int16) if not t.is_contiguous() else t.view(torch.int16)
    elif not wide and t.dtype != torch.uint8:
        raise CorruptStreamError(f"{fmt} surface has dtype {t.dtype}, expected uint8")
    rows = _as_rows(t, width)
    if fmt.startswith("YUV444"):
        if rows.shape[0] % 3 or rows.shape[0] // 3 < height:
            raise CorruptStreamError(f"{fmt} surface of {rows.shape[0]} rows is not 3 planes of {height} rows")
        r = rows.shape[0] // 3
        return [rows[k * r : k * r + height, :width] for k in range(3)]
    if fmt in ("NV12", "P016", "P010"):
        if rows.shape[0] < height + height // 2:
            raise CorruptStreamError(f"{fmt} surface of {rows.shape[0]} rows is too small for height {height}")
        y = rows[:height, :width]
        uv = rows[height : height + height // 2, :width]
        return [y, uv[:, 0::2], uv[:, 1::2]]
    raise CorruptStreamError(f"unsupported NVDEC surface format {fmt}")


def msb_aligned_to_int(plane: torch.Tensor, bit_depth: int) -> torch.Tensor:
    """Sample values of a 16-bit NVDEC plane (samples in the high bits of each uint16)."""
    return (plane.to(torch.int32) & 0xFFFF) >> (16 - bit_depth)


class NvdecDecoder:
    """HEVC on NVDEC through PyNvVideoCodec; frames come out as (3, H, W) uint8 CUDA tensors.

    device: the CUDA device (default: the current one).
    latency: "low" hands each access unit to NVDEC with end-of-picture set and gets its frame back
        at once (staging: one frame plus the decoder's surfaces); "native" lets NVDEC queue up to
        four pictures ahead (more overlap, a few more frames staged).
    copy: yield a fresh tensor per frame (safe to keep). By default (copy=False) the frame is a
        view of the decoder's output buffer, valid until the next frame is requested: GPU work the
        consumer queued on its current stream before asking for the next frame is ordered before
        the decoder writes that buffer again (what the codec's frame-by-frame restore needs; no copy).
    """

    name = "nvdec"
    device_type = "cuda"

    def __init__(self, device: str | torch.device | int | None = None, latency: str = "low", copy: bool = False):
        if not torch.cuda.is_available():
            raise BackendUnavailableError("no CUDA device")
        dev = torch.device("cuda", torch.cuda.current_device()) if device is None else torch.device(device)
        if isinstance(device, int):
            dev = torch.device("cuda", device)
        if dev.type != "cuda":
            raise BackendUnavailableError(f"NVDEC produces frames on cuda, not {dev}")
        self.device = torch.device("cuda", dev.index if dev.index is not None else torch.cuda.current_device())
        if latency not in ("low", "native"):
            raise ValueError("latency must be 'low' or 'native'")
        self.latency = latency
        self.copy = copy
        self._sessions: dict[tuple[int, int], object] = {}  # frame size -> NVDEC session, most recent last
        self._stream: torch.cuda.Stream | None = None
        self.sessions_created = 0

    @classmethod
    def is_available(cls) -> bool:
        try:
            if not torch.cuda.is_available():
                return False
            nvc = _nvc()
            return bool(_decoder_caps(nvc, torch.cuda.current_device()).get("supported", True))
        except Exception as e:
            log.debug("NVDEC unavailable: %s", e)
            return False

    # -- session ---------------------------------------------------------------------------------

    MAX_SESSIONS = 3  # one per stored resolution: reopening a session costs 0.1-0.3 s

    def _session(self, width: int, height: int):
        size = (width, height)
        if size in self._sessions:
            self._sessions[size] = self._sessions.pop(size)
            return self._sessions[size]
        while len(self._sessions) >= self.MAX_SESSIONS:
            self._sessions.pop(next(iter(self._sessions)))
        nvc = _nvc()
        idx = self.device.index
        with torch.cuda.device(idx):
            if self._stream is None:
                self._stream = restore_stream(idx)
            latency = nvc.DisplayDecodeLatencyType.LOW if self.latency == "low" else nvc.DisplayDecodeLatencyType.NATIVE
            ctx = primary_context(idx)
            # torch's primary context must be the thread's current one (a library that failed to
            # open a session elsewhere may have left its own context current)
            make_current(ctx)
            try:
                dec = nvc.CreateDecoder(
                    gpuid=idx,
                    codec=nvc.cudaVideoCodec.HEVC,
                    cudacontext=ctx,
                    cudastream=self._stream.cuda_stream,
                    usedevicememory=True,
                    maxwidth=width,
                    maxheight=height,
                    latency=latency,
                )
            except Exception as e:
                raise BackendUnavailableError(f"cannot open an NVDEC session: {e}") from e
        self._sessions[size] = dec
        self.sessions_created += 1
        return dec

    def close(self, size: tuple[int, int] | None = None) -> None:
        """Drop the session for frames of `size` (all sessions when None)."""
        if size is None:
            self._sessions.clear()
        else:
            self._sessions.pop(size, None)

    # -- decoding --------------------------------------------------------------------------------

    def decode_surfaces(self, bitstream, width: int, height: int) -> Iterator[tuple[torch.Tensor, str]]:
        """Yield (surface, format name) for each frame: the decoder's own output buffer, valid
        until the next item is requested, on this decoder's CUDA stream (see `stream`)."""
        nvc = _nvc()
        buf = np.frombuffer(bitstream, dtype=np.uint8) if not isinstance(bitstream, np.ndarray) else bitstream
        if buf.dtype != np.uint8 or buf.ndim != 1 or not buf.flags.c_contiguous:
            raise ValueError("bitstream must be bytes or a contiguous 1-d uint8 array")
        units = split_access_units(memoryview(buf))
        dec = self._session(width, height)
        base = buf.ctypes.data
        eop = nvc.VideoPacketFlag.ENDOFPICTURE if self.latency == "low" else None
        finished = False
        checked = False
        try:
            packets = []
            for offset, length in units:
                pkt = nvc.PacketData()
                pkt.bsl_data = base + offset
                pkt.bsl = length
                if eop is not None:
                    pkt.decode_flag = eop
                packets.append(pkt)
            eos = nvc.PacketData()
            eos.bsl_data = 0
            eos.bsl = 0
            eos.decode_flag = nvc.VideoPacketFlag.ENDOFSTREAM
            packets.append(eos)
            for pkt in packets:
                for frame in dec.Decode(pkt):
                    if not checked:
                        self._check_size(dec, width, height)
                        checked = True
                    yield _surface_tensor(frame, self.device), _fmt_name(frame)
            finished = True
        except (CorruptStreamError, GeneratorExit):
            raise
        except Exception as e:
            raise CorruptStreamError(f"NVDEC could not decode the stream: {e}") from e
        finally:
            if not finished:
                self.close((width, height))  # a session left mid-stream is not reused

    @staticmethod
    def _check_size(dec, width: int, height: int) -> None:
        try:
            w, h = int(dec.GetWidth()), int(dec.GetHeight())
        except Exception:  # pragma: no cover - accessor missing in some PyNvVideoCodec builds
            return
        if (w, h) != (width, height):
            raise CorruptStreamError(f"stream decodes to {w}x{h} frames, expected {width}x{height}")

    @property
    def stream(self) -> torch.cuda.Stream | None:
        """The CUDA stream the decoder writes its output buffers on."""
        return self._stream

    def decode(self, bitstream, width: int, height: int) -> Iterator[torch.Tensor]:
        """Yield each frame as a (3, height, width) uint8 tensor on this decoder's device."""
        count = 0
        for surface, fmt in self.decode_surfaces(bitstream, width, height):
            if fmt not in ("YUV444",):
                raise CorruptStreamError(f"NVDEC output is {fmt}; kvcodec streams are 4:4:4 8-bit (YUV444)")
            frame = _yuv444_frame(surface, width, height)
            cur = torch.cuda.current_stream(self.device)
            cur.wait_stream(self._stream)
            if self.copy:
                frame = frame.clone()
            count += 1
            yield frame
            # the next Decode overwrites the buffer only after what the consumer queued meanwhile
            self._stream.wait_stream(torch.cuda.current_stream(self.device))
        if count == 0:
            raise CorruptStreamError("NVDEC decoded no frame from the stream")


def _yuv444_frame(surface: torch.Tensor, width: int, height: int) -> torch.Tensor:
    """(3, height, width) uint8 view of an 8-bit YUV444 planar surface (pitch and padding kept)."""
    y, u, v = surface_to_planes(surface, "YUV444", width, height)
    return y.as_strided((3, height, width), (u.data_ptr() - y.data_ptr(), y.stride(0), y.stride(1)))
