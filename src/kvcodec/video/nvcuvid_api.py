"""ctypes view of the NVIDIA driver's video decoder library (libnvcuvid.so.1) and the few CUDA
driver calls the nvcuvid backend needs.

Structure layouts follow the Video Codec SDK headers (cuviddec.h, nvcuvid.h) for 64-bit Linux
(`unsigned long` is 8 bytes); tests pin their sizes. Every foreign call goes through ctypes, which
releases the GIL for its duration, so decoder threads of one process wait on NVDEC in parallel.
"""

from __future__ import annotations

import ctypes
import functools
from ctypes import POINTER, c_int, c_longlong, c_short, c_uint, c_ulong, c_ulonglong, c_ushort, c_void_p

from kvcodec.errors import BackendUnavailableError

# cudaVideoCodec, cudaVideoChromaFormat, cudaVideoSurfaceFormat, cudaVideoCreateFlags
CODEC_HEVC = 8
CHROMA_420 = 1
CHROMA_444 = 3
SURFACE_NV12 = 0
SURFACE_P016 = 1
SURFACE_YUV444 = 2
SURFACE_YUV444_16BIT = 3
CREATE_PREFER_CUVID = 0x04
# CUvideopacketflags
PKT_ENDOFSTREAM = 0x01
PKT_TIMESTAMP = 0x02
PKT_ENDOFPICTURE = 0x08
# CUDA driver
CU_STREAM_NON_BLOCKING = 0x1
CU_MEMORYTYPE_DEVICE = 2


class _Rect(ctypes.Structure):
    _fields_ = [("left", c_short), ("top", c_short), ("right", c_short), ("bottom", c_short)]


class _IntRect(ctypes.Structure):
    _fields_ = [("left", c_int), ("top", c_int), ("right", c_int), ("bottom", c_int)]


class DecodeCaps(ctypes.Structure):
    """CUVIDDECODECAPS."""

    _fields_ = [
        ("eCodecType", c_int),
        ("eChromaFormat", c_int),
        ("nBitDepthMinus8", c_uint),
        ("reserved1", c_uint * 3),
        ("bIsSupported", ctypes.c_ubyte),
        ("nNumNVDECs", ctypes.c_ubyte),
        ("nOutputFormatMask", c_ushort),
        ("nMaxWidth", c_uint),
        ("nMaxHeight", c_uint),
        ("nMaxMBCount", c_uint),
        ("nMinWidth", c_ushort),
        ("nMinHeight", c_ushort),
        ("bIsHistogramSupported", ctypes.c_ubyte),
        ("nCounterBitDepth", ctypes.c_ubyte),
        ("nMaxHistogramBins", c_ushort),
        ("reserved3", c_uint * 10),
    ]


class DecodeCreateInfo(ctypes.Structure):
    """CUVIDDECODECREATEINFO."""

    _fields_ = [
        ("ulWidth", c_ulong),
        ("ulHeight", c_ulong),
        ("ulNumDecodeSurfaces", c_ulong),
        ("CodecType", c_int),
        ("ChromaFormat", c_int),
        ("ulCreationFlags", c_ulong),
        ("bitDepthMinus8", c_ulong),
        ("ulIntraDecodeOnly", c_ulong),
        ("ulMaxWidth", c_ulong),
        ("ulMaxHeight", c_ulong),
        ("Reserved1", c_ulong),
        ("display_area", _Rect),
        ("OutputFormat", c_int),
        ("DeinterlaceMode", c_int),
        ("ulTargetWidth", c_ulong),
        ("ulTargetHeight", c_ulong),
        ("ulNumOutputSurfaces", c_ulong),
        ("vidLock", c_void_p),
        ("target_rect", _Rect),
        ("enableHistogram", c_ulong),
        ("Reserved2", c_ulong * 4),
    ]


class ProcParams(ctypes.Structure):
    """CUVIDPROCPARAMS (cuvidMapVideoFrame64)."""

    _fields_ = [
        ("progressive_frame", c_int),
        ("second_field", c_int),
        ("top_field_first", c_int),
        ("unpaired_field", c_int),
        ("reserved_flags", c_uint),
        ("reserved_zero", c_uint),
        ("raw_input_dptr", c_ulonglong),
        ("raw_input_pitch", c_uint),
        ("raw_input_format", c_uint),
        ("raw_output_dptr", c_ulonglong),
        ("raw_output_pitch", c_uint),
        ("Reserved1", c_uint),
        ("output_stream", c_void_p),
        ("Reserved", c_uint * 46),
        ("histogram_dptr", c_void_p),
        ("Reserved2", c_void_p * 1),
    ]


class VideoFormat(ctypes.Structure):
    """CUVIDEOFORMAT (the parser's sequence callback)."""

    _fields_ = [
        ("codec", c_int),
        ("frame_rate_num", c_uint),
        ("frame_rate_den", c_uint),
        ("progressive_sequence", ctypes.c_ubyte),
        ("bit_depth_luma_minus8", ctypes.c_ubyte),
        ("bit_depth_chroma_minus8", ctypes.c_ubyte),
        ("min_num_decode_surfaces", ctypes.c_ubyte),
        ("coded_width", c_uint),
        ("coded_height", c_uint),
        ("display_area", _IntRect),
        ("chroma_format", c_int),
        ("bitrate", c_uint),
        ("display_aspect_x", c_int),
        ("display_aspect_y", c_int),
        ("video_signal_description", ctypes.c_ubyte * 4),
        ("seqhdr_data_length", c_uint),
    ]


class ParserDispInfo(ctypes.Structure):
    """CUVIDPARSERDISPINFO."""

    _fields_ = [
        ("picture_index", c_int),
        ("progressive_frame", c_int),
        ("top_field_first", c_int),
        ("repeat_first_field", c_int),
        ("timestamp", c_longlong),
    ]


class SourceDataPacket(ctypes.Structure):
    """CUVIDSOURCEDATAPACKET."""

    _fields_ = [("flags", c_ulong), ("payload_size", c_ulong), ("payload", c_void_p), ("timestamp", c_longlong)]


SequenceCallback = ctypes.CFUNCTYPE(c_int, c_void_p, POINTER(VideoFormat))
DecodeCallback = ctypes.CFUNCTYPE(c_int, c_void_p, c_void_p)  # CUVIDPICPARAMS*, passed through untouched
DisplayCallback = ctypes.CFUNCTYPE(c_int, c_void_p, POINTER(ParserDispInfo))


class ParserParams(ctypes.Structure):
    """CUVIDPARSERPARAMS."""

    _fields_ = [
        ("CodecType", c_int),
        ("ulMaxNumDecodeSurfaces", c_uint),
        ("ulClockRate", c_uint),
        ("ulErrorThreshold", c_uint),
        ("ulMaxDisplayDelay", c_uint),
        ("bAnnexb_uReserved", c_uint),  # bAnnexb:1, uReserved:31
        ("uReserved1", c_uint * 4),
        ("pUserData", c_void_p),
        ("pfnSequenceCallback", SequenceCallback),
        ("pfnDecodePicture", DecodeCallback),
        ("pfnDisplayPicture", DisplayCallback),
        ("pfnGetOperatingPoint", c_void_p),
        ("pfnGetSEIMsg", c_void_p),
        ("pvReserved2", c_void_p * 5),
        ("pExtVideoInfo", c_void_p),
    ]


class Memcpy2D(ctypes.Structure):
    """CUDA_MEMCPY2D."""

    _fields_ = [
        ("srcXInBytes", ctypes.c_size_t),
        ("srcY", ctypes.c_size_t),
        ("srcMemoryType", c_int),
        ("srcHost", c_void_p),
        ("srcDevice", c_ulonglong),
        ("srcArray", c_void_p),
        ("srcPitch", ctypes.c_size_t),
        ("dstXInBytes", ctypes.c_size_t),
        ("dstY", ctypes.c_size_t),
        ("dstMemoryType", c_int),
        ("dstHost", c_void_p),
        ("dstDevice", c_ulonglong),
        ("dstArray", c_void_p),
        ("dstPitch", ctypes.c_size_t),
        ("WidthInBytes", ctypes.c_size_t),
        ("Height", ctypes.c_size_t),
    ]


_P = POINTER
_SIGNATURES = {
    "cuvidGetDecoderCaps": [_P(DecodeCaps)],
    "cuvidCreateDecoder": [_P(c_void_p), _P(DecodeCreateInfo)],
    "cuvidDestroyDecoder": [c_void_p],
    "cuvidDecodePicture": [c_void_p, c_void_p],
    "cuvidMapVideoFrame64": [c_void_p, c_int, _P(c_ulonglong), _P(c_uint), _P(ProcParams)],
    "cuvidUnmapVideoFrame64": [c_void_p, c_ulonglong],
    "cuvidCreateVideoParser": [_P(c_void_p), _P(ParserParams)],
    "cuvidParseVideoData": [c_void_p, _P(SourceDataPacket)],
    "cuvidDestroyVideoParser": [c_void_p],
    "cuvidCtxLockCreate": [_P(c_void_p), c_void_p],
    "cuvidCtxLockDestroy": [c_void_p],
}
_CUDA_SIGNATURES = {
    "cuInit": [c_uint],
    "cuDeviceGet": [_P(c_int), c_int],
    "cuDevicePrimaryCtxRetain": [_P(c_void_p), c_int],
    "cuCtxSetCurrent": [c_void_p],
    "cuCtxGetCurrent": [_P(c_void_p)],
    "cuMemcpy2DAsync_v2": [_P(Memcpy2D), c_void_p],
    "cuStreamSynchronize": [c_void_p],
}


class _Lib:
    """A shared library's functions with argument types set; each returns a CUresult."""

    def __init__(self, name: str, signatures: dict):
        try:
            lib = ctypes.CDLL(name)
        except OSError as e:
            raise BackendUnavailableError(f"{name} is not loadable here: {e}") from e
        for fn, args in signatures.items():
            try:
                f = getattr(lib, fn)
            except AttributeError as e:
                raise BackendUnavailableError(f"{name} lacks {fn}") from e
            f.argtypes = args
            f.restype = c_int
            setattr(self, fn.removesuffix("_v2"), f)


@functools.cache
def nvcuvid() -> _Lib:
    return _Lib("libnvcuvid.so.1", _SIGNATURES)


@functools.cache
def cuda() -> _Lib:
    return _Lib("libcuda.so.1", _CUDA_SIGNATURES)


def check(result: int, what: str, error=RuntimeError) -> None:
    """Raise `error` naming the call when a CUresult is not CUDA_SUCCESS."""
    if result != 0:
        raise error(f"{what} failed with CUDA error {result}")


@functools.cache
def primary_context(index: int) -> int:
    """The handle of device `index`'s primary context: the context torch (and the model) uses."""
    lib = cuda()
    dev = c_int()
    ctx = c_void_p()
    check(lib.cuInit(0), "cuInit", BackendUnavailableError)
    check(lib.cuDeviceGet(ctypes.byref(dev), index), f"cuDeviceGet({index})", BackendUnavailableError)
    check(lib.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev), "cuDevicePrimaryCtxRetain", BackendUnavailableError)
    return int(ctx.value or 0)


def make_current(ctx: int) -> None:
    """Make `ctx` the calling thread's current context (threads start with none)."""
    current = c_void_p()
    cuda().cuCtxGetCurrent(ctypes.byref(current))
    if (current.value or 0) != ctx:
        check(cuda().cuCtxSetCurrent(c_void_p(ctx)), "cuCtxSetCurrent")


def hevc_caps(chroma: int = CHROMA_444, bit_depth: int = 8) -> DecodeCaps:
    """NVDEC's HEVC capabilities for a chroma format and bit depth (needs a current context)."""
    caps = DecodeCaps(eCodecType=CODEC_HEVC, eChromaFormat=chroma, nBitDepthMinus8=bit_depth - 8)
    check(nvcuvid().cuvidGetDecoderCaps(ctypes.byref(caps)), "cuvidGetDecoderCaps", BackendUnavailableError)
    return caps


def copy_rows(dst_ptr: int, dst_pitch: int, src_ptr: int, src_pitch: int, width: int, rows: int, stream: int) -> None:
    """Pitched device-to-device copy of `rows` rows of `width` bytes on `stream` (a copy engine)."""
    desc = Memcpy2D(
        srcMemoryType=CU_MEMORYTYPE_DEVICE,
        srcDevice=src_ptr,
        srcPitch=src_pitch,
        dstMemoryType=CU_MEMORYTYPE_DEVICE,
        dstDevice=dst_ptr,
        dstPitch=dst_pitch,
        WidthInBytes=width,
        Height=rows,
    )
    check(cuda().cuMemcpy2DAsync(ctypes.byref(desc), c_void_p(stream)), "cuMemcpy2DAsync")
