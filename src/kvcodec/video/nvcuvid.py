"""NVDEC through the driver's libnvcuvid, called with ctypes, in the caller's own CUDA context.

A second NVDEC backend that needs nothing but the driver: no PyNvVideoCodec. Every foreign call goes
through ctypes, which releases the GIL, and every session lives in torch's primary context (the
model's), so N threads of the serving process drive N sessions on N engines without a context per
worker (the process pool's GPU time-slicing and 600 MB per worker). On the H200, 7 threads decode
913 frames/s against PyNvVideoCodec 2.2.4's 762 (whose threads also scale in one process), at a
1% cost to a concurrent matmul (benchmarks/results/decode-h200-nvcuvid.md).

One `NvcuvidDecoder` holds one NVDEC session per frame size (reused across streams; a fresh
parser per stream) and a CUDA stream of its own. The parser's display callback maps each decoded
picture, copies it with cuMemcpy2DAsync into a small ring of output slots, and unmaps it (as the
Video Codec SDK's sample decoder does); frames are handed out as torch tensor views of the slots.
Use one decoder per thread (`kvcodec.video.nvcuvid_threads` runs N of them).
"""

from __future__ import annotations

import collections
import ctypes
import logging
from collections.abc import Iterable, Iterator

import numpy as np
import torch

from kvcodec.errors import BackendUnavailableError, CorruptStreamError
from kvcodec.video import nvcuvid_api as api
from kvcodec.video.streams import restore_stream

log = logging.getLogger(__name__)

_SURFACES = {  # (chroma format, wide samples) -> (surface format, name, rows per luma row)
    (api.CHROMA_444, False): (api.SURFACE_YUV444, "YUV444", 3.0),
    (api.CHROMA_444, True): (api.SURFACE_YUV444_16BIT, "YUV444_16BIT", 3.0),
    (api.CHROMA_420, False): (api.SURFACE_NV12, "NV12", 1.5),
    (api.CHROMA_420, True): (api.SURFACE_P016, "P016", 1.5),
}


def surface_layout(chroma: int, bit_depth: int, width: int, height: int) -> tuple[int, str, int, int]:
    """(surface format, its name, bytes per row, rows) of a decoded picture copied out densely."""
    key = (chroma, bit_depth > 8)
    if key not in _SURFACES:
        raise CorruptStreamError(f"HEVC chroma format {chroma} at {bit_depth} bits is not decodable here")
    fmt, name, rows_per_row = _SURFACES[key]
    return fmt, name, width * (2 if bit_depth > 8 else 1), int(height * rows_per_row)


def feed_plan(size: int, piece: int) -> list[tuple[int, int]]:
    """(offset, length) of the pieces a stream of `size` bytes is handed to the parser in."""
    if piece < 1:
        raise ValueError("piece must be >= 1 byte")
    return [(off, min(piece, size - off)) for off in range(0, size, piece)]


def plane_copies(name: str, height: int, src_pitch: int) -> list[tuple[int, int, int]]:
    """(source byte offset, destination row, rows) of each copy that moves a mapped surface's
    planes into a dense buffer. NVDEC's planes start every align2(height) rows of the surface."""
    rows = (height + 1) & ~1
    if name.startswith("YUV444"):
        if rows == height:
            return [(0, 0, 3 * height)]
        return [(k * rows * src_pitch, k * height, height) for k in range(3)]
    return [(0, 0, height), (rows * src_pitch, height, height // 2)]


# A packet's timestamp is its stream's ordinal << STAMP_SHIFT: the parser stamps a picture that
# starts in a packet already stamped with that stamp plus a frame duration (400000 at its default
# clock), so the ordinal is read back from the high bits.
STAMP_SHIFT = 32
# CUVIDEOFORMAT's leading bytes up to its chroma format (codec, frame rate, bit depths, surfaces,
# sizes, display area): a sequence header with the same ones needs no new session (kv_sequence)
FORMAT_BYTES = api.VideoFormat.chroma_format.offset + ctypes.sizeof(ctypes.c_int)
DISPLAY_DELAY = 1  # NvcuvidDecoder's default: pictures the parser queues before handing one out


def attribute(expected: collections.deque, timestamp: int) -> object:
    """The key of the stream a decoded picture belongs to. expected: [key, frames still due,
    ordinal] per stream fed and not yet complete, in feed order; frames None: one stream, unchecked."""
    if not expected:
        raise CorruptStreamError("NVDEC returned a picture beyond the frames the streams announce")
    head = expected[0]
    if head[1] is None:
        return head[0]
    if timestamp >> STAMP_SHIFT != head[2]:
        raise CorruptStreamError(
            f"a picture of stream {timestamp >> STAMP_SHIFT} came where stream {head[2]} was due: a stream "
            "holds more or fewer frames than its chunk announces"
        )
    head[1] -= 1
    if head[1] == 0:
        expected.popleft()
    return head[0]


def _as_buffer(bitstream) -> np.ndarray:
    buf = np.frombuffer(bitstream, dtype=np.uint8) if not isinstance(bitstream, np.ndarray) else bitstream
    if buf.dtype != np.uint8 or buf.ndim != 1 or not buf.flags.c_contiguous:
        raise ValueError("bitstream must be bytes or a contiguous 1-d uint8 array")
    return buf


def _into_item(item: tuple) -> tuple:
    """A (key, bitstream, width, height, frames announced, buffer address) item of decode_each_into
    and decode_each_fed, its bitstream as a uint8 array; ValueError for a stream of no frames."""
    key, bitstream, width, height, frames, out_ptr = item
    if frames < 1:
        raise ValueError("a stream decoded into a buffer announces at least one frame")
    return key, _as_buffer(bitstream), width, height, frames, out_ptr


class _Session:
    """An NVDEC decoder for one frame size in context `ctx`; pictures land in a ring of slots."""

    def __init__(
        self, ctx: int, device: torch.device, stream: torch.cuda.Stream, width: int, height: int, display_delay: int
    ):
        self.ctx, self.device, self.stream = ctx, device, stream
        self.width, self.height, self.display_delay = width, height, display_delay
        self.handle = ctypes.c_void_p()
        self.lock = ctypes.c_void_p()
        self.format: tuple | None = None  # (chroma, bit depth, surfaces) the decoder was made for
        self.made = 0  # decoders made so far (a native state that reuses a format's surfaces checks it)
        self.layout: tuple | None = None
        self.slots: list[torch.Tensor] = []
        self.released: list[torch.cuda.Event | None] = []
        self.ready: list[tuple[int, int]] = []  # (slot, timestamp) of pictures not yet handed out, in display order
        self.shown = 0
        self.error: BaseException | None = None
        api.check(
            api.nvcuvid().cuvidCtxLockCreate(ctypes.byref(self.lock), ctypes.c_void_p(ctx)),
            "cuvidCtxLockCreate",
            BackendUnavailableError,
        )

    # -- parser callbacks (run inside cuvidParseVideoData, on the decoding thread) --------------

    def on_sequence(self, _user, fmt_p) -> int:
        try:
            fmt = fmt_p.contents
            area = fmt.display_area
            if (area.right - area.left, area.bottom - area.top) != (self.width, self.height):
                raise CorruptStreamError(
                    f"stream decodes to {area.right - area.left}x{area.bottom - area.top} "
                    f"frames, expected {self.width}x{self.height}"
                )
            depth = 8 + fmt.bit_depth_luma_minus8
            surfaces = max(int(fmt.min_num_decode_surfaces), 1) + self.display_delay
            self._ensure_decoder(fmt, depth, surfaces)
            return self.format[2]
        except BaseException as e:  # noqa: BLE001 - handed back to the decoding thread
            self.error = e
            return 0

    def on_decode(self, _user, pic_params) -> int:
        if self.error is not None:
            return 0
        return 1 if api.nvcuvid().cuvidDecodePicture(self.handle, pic_params) == 0 else self._fail("cuvidDecodePicture")

    def on_display(self, _user, info_p) -> int:
        try:
            info = info_p.contents
            self._copy_out(info.picture_index, info.timestamp)
            return 1
        except BaseException as e:  # noqa: BLE001
            self.error = e
            return 0

    def _fail(self, what: str) -> int:
        self.error = CorruptStreamError(f"{what} failed: NVDEC could not decode the stream")
        return 0

    # -- decoder and output ---------------------------------------------------------------------

    def _ensure_decoder(self, fmt, depth: int, surfaces: int) -> None:
        if self.format is not None and self.format[:2] == (fmt.chroma_format, depth) and self.format[2] >= surfaces:
            return
        self.destroy_decoder()
        out_fmt, name, row_bytes, rows = surface_layout(fmt.chroma_format, depth, self.width, self.height)
        info = api.DecodeCreateInfo(
            ulWidth=fmt.coded_width,
            ulHeight=fmt.coded_height,
            ulNumDecodeSurfaces=surfaces,
            CodecType=api.CODEC_HEVC,
            ChromaFormat=fmt.chroma_format,
            ulCreationFlags=api.CREATE_PREFER_CUVID,
            bitDepthMinus8=depth - 8,
            ulMaxWidth=fmt.coded_width,
            ulMaxHeight=fmt.coded_height,
            OutputFormat=out_fmt,
            DeinterlaceMode=0,
            ulTargetWidth=self.width,
            ulTargetHeight=self.height,
            ulNumOutputSurfaces=1,
            vidLock=self.lock,
        )
        info.display_area.left, info.display_area.top = fmt.display_area.left, fmt.display_area.top
        info.display_area.right, info.display_area.bottom = fmt.display_area.right, fmt.display_area.bottom
        api.check(
            api.nvcuvid().cuvidCreateDecoder(ctypes.byref(self.handle), ctypes.byref(info)),
            "cuvidCreateDecoder",
            BackendUnavailableError,
        )
        self.format = (fmt.chroma_format, depth, surfaces)
        self.layout = (name, row_bytes, rows)
        self.made += 1
        ring = self.display_delay + 1  # grows when one piece of stream completes several pictures
        self.slots = [torch.empty((rows, row_bytes), dtype=torch.uint8, device=self.device) for _ in range(ring)]
        self.released = [None] * ring

    def _copy_out(self, picture_index: int, timestamp: int) -> None:
        lib = api.nvcuvid()
        slot = self._free_slot()
        if self.released[slot] is not None:
            self.stream.wait_event(self.released[slot])
        ptr, pitch = ctypes.c_ulonglong(), ctypes.c_uint()
        params = api.ProcParams(progressive_frame=1, output_stream=self.stream.cuda_stream)
        api.check(
            lib.cuvidMapVideoFrame64(
                self.handle, picture_index, ctypes.byref(ptr), ctypes.byref(pitch), ctypes.byref(params)
            ),
            "cuvidMapVideoFrame64",
            CorruptStreamError,
        )
        try:
            name, row_bytes, _ = self.layout
            dst = self.slots[slot]
            for offset, row, rows in plane_copies(name, self.height, pitch.value):
                api.copy_rows(
                    dst.data_ptr() + row * row_bytes,
                    row_bytes,
                    ptr.value + offset,
                    pitch.value,
                    row_bytes,
                    rows,
                    self.stream.cuda_stream,
                )
            api.check(api.cuda().cuStreamSynchronize(ctypes.c_void_p(self.stream.cuda_stream)), "cuStreamSynchronize")
        finally:
            api.check(lib.cuvidUnmapVideoFrame64(self.handle, ptr.value), "cuvidUnmapVideoFrame64")
        self.ready.append((slot, timestamp))
        self.shown += 1

    def _free_slot(self) -> int:
        """A slot no picture waiting to be handed out occupies (handed-out ones are rewritten only
        after the consumer's work on them, see release)."""
        slot = self.shown % len(self.slots)
        if any(slot == waiting for waiting, _ in self.ready):
            self.slots.append(torch.empty_like(self.slots[0]))
            self.released.append(None)
            slot = len(self.slots) - 1
        return slot

    def release(self, slot: int, consumer: torch.cuda.Stream) -> None:
        """The consumer is done queueing work on `slot`: it may be rewritten after that work."""
        event = self.released[slot] or torch.cuda.Event()
        event.record(consumer)
        self.released[slot] = event

    def destroy_decoder(self) -> None:
        if self.handle.value:
            api.make_current(self.ctx)
            api.nvcuvid().cuvidDestroyDecoder(self.handle)
            self.handle = ctypes.c_void_p()
        self.format = None

    def close(self) -> None:
        self.destroy_decoder()
        if self.lock.value:
            api.nvcuvid().cuvidCtxLockDestroy(self.lock)
            self.lock = ctypes.c_void_p()


class _Parser:
    """A fresh HEVC parser feeding `session` for one stream (parsers are cheap, host-only)."""

    def __init__(self, session: _Session, display_delay: int):
        self.callbacks = (
            api.SequenceCallback(session.on_sequence),
            api.DecodeCallback(session.on_decode),
            api.DisplayCallback(session.on_display),
        )  # kept alive as long as the parser
        self._create(display_delay)

    def _create(self, display_delay: int, user_data: int | None = None) -> None:
        """The driver's parser over self.callbacks (their user pointer: `user_data`)."""
        params = api.ParserParams(
            CodecType=api.CODEC_HEVC, ulMaxNumDecodeSurfaces=1, ulErrorThreshold=0, ulMaxDisplayDelay=display_delay
        )
        if user_data is not None:
            params.pUserData = user_data
        params.pfnSequenceCallback, params.pfnDecodePicture, params.pfnDisplayPicture = self.callbacks
        self.handle = ctypes.c_void_p()
        api.check(
            api.nvcuvid().cuvidCreateVideoParser(ctypes.byref(self.handle), ctypes.byref(params)),
            "cuvidCreateVideoParser",
            BackendUnavailableError,
        )

    def feed(self, address: int, length: int, flags: int, timestamp: int = 0) -> int:
        packet = api.SourceDataPacket(flags=flags, payload_size=length, payload=address or None, timestamp=timestamp)
        return api.nvcuvid().cuvidParseVideoData(self.handle, ctypes.byref(packet))

    def close(self) -> None:
        if self.handle.value:
            api.nvcuvid().cuvidDestroyVideoParser(self.handle)
            self.handle = ctypes.c_void_p()


class _NativeParser(_Parser):
    """A fresh HEVC parser whose decode and display callbacks are the C ones of nvcuvid_native:
    pictures go straight into the sample buffers pushed onto `state` (one per stream fed)."""

    def __init__(self, session: _Session, display_delay: int, lib, state):
        from kvcodec.video import nvcuvid_native as native

        def on_sequence(user, fmt_p) -> int:
            surfaces = session.on_sequence(user, fmt_p)
            state.decoder = session.handle.value  # the session the C callbacks decode on
            return surfaces

        self.python_sequence = api.SequenceCallback(on_sequence)  # kept alive as long as the parser
        state.sequence = native.function_pointer(self.python_sequence)
        state.format_bytes = FORMAT_BYTES
        self.callbacks = (
            api.SequenceCallback(native.function_pointer(lib.kv_sequence)),
            api.DecodeCallback(native.function_pointer(lib.kv_decode)),
            api.DisplayCallback(native.function_pointer(lib.kv_display)),
        )
        self._create(display_delay, ctypes.addressof(state))


class NvcuvidDecoder:
    """HEVC on NVDEC through libnvcuvid (ctypes), in torch's context: frames are (3, H, W) uint8
    CUDA tensors. One decoder serves one thread at a time; run one per thread to use all engines.

    display_delay: pictures the parser keeps queued before handing one out (0: each picture is
        copied out as soon as it is decoded; more: the next picture's decode overlaps the copy).
    copy: yield a fresh tensor per frame. By default the frame is a view of an output slot, valid
        until the next frame is requested: the slot is rewritten only after the GPU work the
        consumer queued on its current stream before asking (what a frame-by-frame restore needs).
    """

    name = "nvcuvid"
    device_type = "cuda"
    MAX_SESSIONS = 3  # one per stored resolution: opening a session costs more than a chunk's decode
    # The stream goes to the parser in pieces, not access units: NVDEC's parser finds picture
    # boundaries in C with the GIL released (a start-code scan in Python costs ~2.5 ms per MB of
    # lossless stream, whose many zero bytes defeat bytes.find). Pictures come out as the pieces
    # after them arrive; the last ones at end of stream.
    PIECE_BYTES = 1 << 18

    def __init__(
        self, device: str | torch.device | int | None = None, display_delay: int | None = None, copy: bool = False
    ):
        if not torch.cuda.is_available():
            raise BackendUnavailableError("no CUDA device")
        dev = torch.device("cuda", device) if isinstance(device, int) else torch.device(device or "cuda")
        if dev.type != "cuda":
            raise BackendUnavailableError(f"NVDEC produces frames on cuda, not {dev}")
        self.device = torch.device("cuda", dev.index if dev.index is not None else torch.cuda.current_device())
        display_delay = DISPLAY_DELAY if display_delay is None else display_delay
        if display_delay < 0:
            raise ValueError("display_delay must be >= 0")
        self.display_delay = display_delay
        self.copy = copy
        torch.cuda.init()
        self.ctx = api.primary_context(self.device.index)
        self._stream = restore_stream(self.device)
        self._sessions: dict[tuple[int, int], _Session] = {}
        self._kept: _FedRun | None = None  # fed_run's, kept open across callers (nvcuvid_native.KEEP)
        self.sessions_created = 0

    @classmethod
    def is_available(cls) -> bool:
        try:
            if not torch.cuda.is_available():
                return False
            torch.cuda.init()
            api.make_current(api.primary_context(torch.cuda.current_device()))
            return bool(api.hevc_caps(api.CHROMA_444, 8).bIsSupported)
        except Exception as e:  # noqa: BLE001 - any failure means the backend is not usable here
            log.debug("nvcuvid unavailable: %s", e)
            return False

    @property
    def stream(self) -> torch.cuda.Stream:
        """The CUDA stream the decoder copies its output on."""
        return self._stream

    def _session(self, width: int, height: int) -> _Session:
        size = (width, height)
        if size in self._sessions:
            self._sessions[size] = self._sessions.pop(size)
            return self._sessions[size]
        while len(self._sessions) >= self.MAX_SESSIONS:
            self.close(next(iter(self._sessions)))
        self._sessions[size] = _Session(self.ctx, self.device, self._stream, width, height, self.display_delay)
        self.sessions_created += 1
        return self._sessions[size]

    def close(self, size: tuple[int, int] | None = None) -> None:
        """Destroy the session for frames of `size` (all sessions when None), and the kept run
        (fed_run) on it."""
        run = getattr(self, "_kept", None)
        if run is not None and run.session is not None and size in (None, (run.session.width, run.session.height)):
            self._kept = None
            run.close(True)
        for key in list(self._sessions) if size is None else [size]:
            session = self._sessions.pop(key, None)
            if session is not None:
                session.close()

    def __del__(self):  # pragma: no cover - interpreter shutdown order varies
        try:
            self.close()
        except Exception:  # noqa: BLE001
            pass

    def decode_surfaces(self, bitstream, width: int, height: int) -> Iterator[tuple[torch.Tensor, str]]:
        """Yield (surface, format name) per frame: a dense (rows, row bytes) uint8 buffer holding the
        picture's planes (see nvdec.surface_to_planes), ready on the consumer's current stream."""
        for _, surface, name, _ in self._surfaces_each([(None, bitstream, width, height, None)]):
            yield surface, name

    def decode_each(self, items: Iterable[tuple]) -> Iterator[tuple[object, torch.Tensor]]:
        """(key, frame) for every frame of many streams fed to one parser back to back. items:
        (key, bitstream, width, height, frames announced), pulled one at a time as the parser wants
        the next stream; frames come out stream by stream, each frame a view as in decode().

        A stream per decode() call waits for its last frame (end-of-stream flush) before the next
        stream starts: with one-frame streams the engine idles during each stream's host work. Here
        the next stream's first picture is queued on NVDEC while the previous one's last frame is
        copied out. Each stream must start with its parameter sets and an IDR picture (x265's do).
        Every packet carries its stream's ordinal in its timestamp; a picture that comes back under
        another stream's ordinal, or a stream with more or fewer frames than announced, raises
        CorruptStreamError (a stream's frames are confirmed once a later stream's frame, or the
        end, has come). A change of frame size flushes the parser and opens the size's session.
        An item None yields (None, None) at once: a caller driving several decoders from one thread
        feeds each its first streams (display_delay + 1 of them queue pictures without waiting for
        any) before it waits on one."""
        for key, surface, fmt, (width, height) in self._surfaces_each(items):
            if surface is None:
                yield None, None
                continue
            if fmt != "YUV444":
                raise CorruptStreamError(f"NVDEC output is {fmt}; kvcodec streams are 4:4:4 8-bit (YUV444)")
            yield key, surface.view(3, height, width)

    def _surfaces_each(self, items: Iterable[tuple]) -> Iterator[tuple[object, torch.Tensor, str, tuple]]:
        api.make_current(self.ctx)
        session = parser = None
        expected: collections.deque = collections.deque()  # [key, frames still due (None: unchecked), ordinal]
        held: collections.deque = collections.deque(maxlen=self.display_delay + 2)  # buffers of the streams in flight
        finished = False
        try:
            for ordinal, item in enumerate(items):
                if item is None:  # a pause the caller asked for: nothing fed, control handed back
                    yield None, None, None, (0, 0)
                    continue
                key, bitstream, width, height, frames = item
                buf = _as_buffer(bitstream)
                if frames is not None and frames < 1:
                    raise ValueError("a stream fed to decode_each announces at least one frame")
                held.append(buf)
                if session is None or (session.width, session.height) != (width, height):
                    if parser is not None:
                        yield from self._end_stream(session, parser, expected)
                        parser.close()
                    session = self._session(width, height)
                    session.error, session.ready = None, []
                    parser = _Parser(session, self.display_delay)
                expected.append([key, frames, ordinal])
                flags, stamp = (0, 0) if frames is None else (api.PKT_TIMESTAMP, ordinal << STAMP_SHIFT)
                for off, n in feed_plan(buf.size, self.PIECE_BYTES):
                    yield from self._feed(session, parser, (buf.ctypes.data + off, n, flags, stamp), expected)
            if parser is not None:
                yield from self._end_stream(session, parser, expected)
            finished = True
        finally:
            if parser is not None:
                parser.close()
            if not finished and session is not None:
                self.close((session.width, session.height))  # a session left mid-stream is not reused

    def _end_stream(self, session: _Session, parser: _Parser, expected: collections.deque) -> Iterator[tuple]:
        yield from self._feed(session, parser, (0, 0, api.PKT_ENDOFSTREAM, 0), expected)
        if expected and expected[0][1] is not None:
            raise CorruptStreamError(f"stream {expected[0][2]} decoded to fewer frames than its chunk announces")
        expected.clear()

    def _feed(self, session: _Session, parser: _Parser, packet: tuple, expected: collections.deque) -> Iterator[tuple]:
        result = parser.feed(*packet)
        if session.error is not None:
            raise session.error
        if result != 0:
            raise CorruptStreamError(f"NVDEC could not parse the stream (CUDA error {result})")
        name = session.layout[0] if session.layout else ""
        while session.ready:
            slot, timestamp = session.ready.pop(0)
            yield attribute(expected, timestamp), session.slots[slot], name, (session.width, session.height)
            session.release(slot, torch.cuda.current_stream(self.device))

    @staticmethod
    def native() -> bool:
        """Whether decode_each_into runs its per-picture work in C (nvcuvid_native builds here)."""
        from kvcodec.video import nvcuvid_native

        return nvcuvid_native.available()

    def decode_each_into(self, items: Iterable[tuple]) -> Iterator[object]:
        """The key of each stream whose frames are all in place, in feed order. items: (key,
        bitstream, width, height, frames announced, device address of a buffer of frames x 3 x
        height x width bytes), pulled as the parser wants the next stream (as decode_each). The
        decode and display callbacks are C (nvcuvid_native): every picture is copied straight
        into its stream's buffer, frame after frame, by the C code, which checks that it belongs
        to the stream due (CorruptStreamError otherwise, or for a stream with more or fewer
        frames than announced). A buffer is complete when its key is yielded (the copies ran on
        this decoder's stream and were waited for). Needs nvcuvid_native.library()."""
        from kvcodec.video import nvcuvid_native as native

        lib = native.required()
        api.make_current(self.ctx)
        session = parser = state = None
        keys: collections.deque = collections.deque()
        procparams = api.ProcParams(progressive_frame=1, output_stream=self._stream.cuda_stream)
        held: collections.deque = collections.deque(maxlen=native.MAX_TARGETS)
        finished = False
        try:
            for ordinal, item in enumerate(items):
                key, buf, width, height, frames, out_ptr = _into_item(item)
                held.append(buf)
                if session is None or (session.width, session.height) != (width, height):
                    if parser is not None:
                        yield from self._native_end(state, parser, session, keys)
                        parser.close()
                    session = self._session(width, height)
                    session.error = None
                    state = self._native_state(lib, session, procparams)
                    parser = _NativeParser(session, self.display_delay, lib, state)
                state.push(out_ptr, ordinal, frames)
                keys.append(key)
                for off, n in feed_plan(buf.size, self.PIECE_BYTES):
                    packet = (buf.ctypes.data + off, n, api.PKT_TIMESTAMP, ordinal << STAMP_SHIFT)
                    yield from self._native_feed(state, parser, session, keys, packet)
            if parser is not None:
                yield from self._native_end(state, parser, session, keys)
            finished = True
        finally:
            if parser is not None:
                parser.close()
            if not finished and session is not None:
                self.close((session.width, session.height))

    def decode_each_fed(self, items: Iterable[tuple], depth: int | None = None) -> Iterator[object]:
        """decode_each_into with the parser fed by a native thread (nvcuvid_native.Feeder): each
        stream pulled from `items` is pushed to it, and the next item pulled at once while fewer
        than `depth` (default nvcuvid_native.FEED_DEPTH) streams pushed are not yet fed, so the
        engine decodes while this thread does its own work (or waits for the interpreter lock).
        Same items, keys and errors as decode_each_into."""
        from kvcodec.video import nvcuvid_native as native

        lib = native.required()
        depth = max(1, min(depth or native.FEED_DEPTH, native.MAX_TARGETS))
        api.make_current(self.ctx)
        run = _FedRun(self, lib)
        finished = False
        try:
            for ordinal, item in enumerate(items):
                key, buf, width, height, frames, out_ptr = _into_item(item)
                if run.session is None or (run.session.width, run.session.height) != (width, height):
                    yield from run.end()
                    run.open(width, height)
                yield from run.room(depth)
                run.push(key, buf, ordinal, frames, out_ptr)
                yield from run.ready()
            yield from run.end()
            finished = True
        finally:
            run.close(finished)

    def fed_run(self) -> _FedRun:
        """A run of streams on this decoder whose parser a native thread feeds, driven without
        blocking (open, push, poll, stuck, begin_end, wait, close): what one thread driving the
        sessions of several decoders uses (transform_batch.StageDriver). Needs the native feeder.
        With nvcuvid_native.KEEP the decoder keeps its run: one left idle (flushed) by the last
        caller is handed out again still open, its parser and feeder thread ready (opening them
        cost ~0.7 ms per session of each fetch); closed with the decoder or its session."""
        from kvcodec.video import nvcuvid_native as native

        lib = native.required()
        api.make_current(self.ctx)
        if not native.KEEP:
            return _FedRun(self, lib)
        run = getattr(self, "_kept", None)
        if run is None or run.busy or run.lib is not lib:
            if run is not None:
                run.close(not run.busy)
            run = self._kept = _FedRun(self, lib, keep=True)
        return run

    def _native_state(self, lib, session: _Session, procparams):  # noqa: ANN202 - an nvcuvid_native.State
        from kvcodec.video import nvcuvid_native as native

        nv, cu = api.nvcuvid(), api.cuda()
        state = native.State(
            decoder=session.handle.value,
            procparams=ctypes.addressof(procparams),
            stream=self._stream.cuda_stream,
            decode=native.function_pointer(nv.cuvidDecodePicture),
            map=native.function_pointer(nv.cuvidMapVideoFrame64),
            unmap=native.function_pointer(nv.cuvidUnmapVideoFrame64),
            copy=native.function_pointer(cu.cuMemcpy2DAsync),
            sync=native.function_pointer(cu.cuStreamSynchronize),
            row_bytes=session.width,
            height=session.height,
            planes=3,
            shift=STAMP_SHIFT,
        )
        state._keep = procparams  # the C code reads it through the pointer
        return state

    def _native_feed(self, state, parser, session: _Session, keys, packet: tuple) -> Iterator[object]:
        from kvcodec.video import nvcuvid_native as native

        result = parser.feed(*packet)
        if session.error is not None:
            raise session.error
        if session.layout is not None and session.layout[0] != "YUV444":
            raise CorruptStreamError(f"NVDEC output is {session.layout[0]}; kvcodec streams are 4:4:4 8-bit (YUV444)")
        if state.error:
            what = native.ERRORS.get(int(state.error), "the native decode failed")
            raise CorruptStreamError(f"{what} (CUDA error {int(state.cuda_error)})")
        if result != 0:
            raise CorruptStreamError(f"NVDEC could not parse the stream (CUDA error {result})")
        while len(keys) > state.pending:
            yield keys.popleft()

    def _native_end(self, state, parser, session: _Session, keys) -> Iterator[object]:
        yield from self._native_feed(state, parser, session, keys, (0, 0, api.PKT_ENDOFSTREAM, 0))
        if keys:
            raise CorruptStreamError("a stream decoded to fewer frames than its chunk announces")

    def decode(self, bitstream, width: int, height: int) -> Iterator[torch.Tensor]:
        """Yield each frame as a (3, height, width) uint8 tensor on this decoder's device."""
        count = 0
        for surface, fmt in self.decode_surfaces(bitstream, width, height):
            if fmt != "YUV444":
                raise CorruptStreamError(f"NVDEC output is {fmt}; kvcodec streams are 4:4:4 8-bit (YUV444)")
            frame = surface.view(3, height, width)
            count += 1
            yield frame.clone() if self.copy else frame
        if count == 0:
            raise CorruptStreamError("NVDEC decoded no frame from the stream")


class _FedRun:
    """One decode_each_fed call (or a driver's run of streams): the session, parser, native state
    and feeder of the frame size being decoded, and the keys of the streams pushed and not
    complete. keep: the feeder thread and parser stay after a flush and take the next streams
    (the decoder keeps the run across fetches: NvcuvidDecoder.fed_run)."""

    WAIT_S = 0.5  # a blocking wait re-checks the feeder this often

    def __init__(self, decoder: NvcuvidDecoder, lib, keep: bool = False):
        self.decoder, self.lib, self.keep = decoder, lib, keep
        self.session = self.parser = self.state = self.feeder = None
        self.keys: collections.deque = collections.deque()
        self.held: collections.deque = collections.deque()  # buffers pushed and not complete
        self.ending, self.pushed = False, 0  # the flush asked for; streams pushed on this parser
        self.flushes = 0  # flushes asked of a kept feeder
        self.made: int | None = None  # Session.made when the state was last given its decoder
        self.procparams = api.ProcParams(progressive_frame=1, output_stream=decoder.stream.cuda_stream)

    def open(self, width: int, height: int) -> None:
        from kvcodec.video import nvcuvid_native as native

        api.make_current(self.decoder.ctx)  # a driving thread may have run another device's work since
        if self.session is not None:  # a kept run open for another size (or its session closed)
            self.close(True)
        self.session = self.decoder._session(width, height)
        self.session.error = None
        self.ending, self.pushed, self.flushes, self.made = False, 0, 0, None
        self.state = self.decoder._native_state(self.lib, self.session, self.procparams)
        self.parser = _NativeParser(self.session, self.decoder.display_delay, self.lib, self.state)
        nv, cu = api.nvcuvid(), api.cuda()
        self.feeder = native.Feeder(
            self.lib,
            self.state,
            self.parser.handle.value,
            native.function_pointer(nv.cuvidParseVideoData),
            native.function_pointer(cu.cuCtxSetCurrent),
            self.decoder.ctx,
            self.decoder.PIECE_BYTES,
        )
        if self.keep:
            self.feeder.keep()

    def is_open(self, width: int, height: int) -> bool:
        """Open on a live session for frames of width x height (a kept run may be on another's)."""
        s = self.session
        return (
            s is not None
            and (s.width, s.height) == (width, height)
            and self.decoder._sessions.get((width, height)) is s
        )

    @property
    def busy(self) -> bool:
        """Streams pushed and not complete, or a flush asked for and not done."""
        return bool(self.keys) or self.ending

    def push(self, key, buf: np.ndarray, ordinal: int, frames: int, out_ptr: int) -> None:
        handle, made = self.session.handle.value, self.session.made
        if self.keep and not self.keys and handle and made != self.made:  # idle kept run: its decoder is new
            self.state.decoder, self.made = handle, made
            self.state.surfaces = 0  # the next sequence header goes to Python (on_sequence) again
        self.state.push(out_ptr, ordinal, frames)
        self.keys.append(key)
        self.held.append(buf)
        self.feeder.submit(buf.ctypes.data, buf.size, ordinal)

    def room(self, depth: int) -> Iterator[object]:
        """Wait until fewer than `depth` streams pushed are not yet fed and the native ring has a
        free target (the keys of the streams that complete meanwhile)."""
        from kvcodec.video import nvcuvid_native as native

        if self.feeder is None:
            return
        while self.feeder.wait_fed(depth - 1, self.WAIT_S) > depth - 1 or len(self.keys) >= native.MAX_TARGETS:
            if len(self.keys) >= native.MAX_TARGETS:  # every target fed: the oldest completes
                self.feeder.wait(int(self.state.completed) + 1, self.WAIT_S)
            yield from self.ready()
        yield from self.ready()

    def ready(self) -> Iterator[object]:
        """The keys of the streams complete now."""
        if self.feeder.finished:  # stopped before the end was asked for: the parser failed
            self._check(self.feeder.close())
            raise CorruptStreamError("NVDEC's parser stopped before the streams were complete")
        yield from self._ready()

    def end(self) -> Iterator[object]:
        """Flush the parser after the streams pushed; their keys as they complete; then close."""
        self.begin_end()
        while self.feeder is not None:
            yield from self.poll()
            if self.feeder is not None:
                self.feeder.wait(1 << 62, self.WAIT_S)

    # -- driven without blocking (one thread drives the runs of several decoders) ----------------

    @property
    def pending(self) -> int:
        """Streams pushed and not yet complete."""
        return len(self.keys)

    def next_ordinal(self) -> int:
        """The ordinal of the next stream pushed on this parser."""
        self.pushed += 1
        return self.pushed - 1

    def stuck(self) -> bool:
        """Every stream pushed is fed and some are not complete: the parser holds their last
        pictures until more stream comes or it is flushed (begin_end)."""
        return self.feeder is not None and not self.ending and bool(self.keys) and self.feeder.wait_fed(0, 0) == 0

    def begin_end(self) -> None:
        """Ask for the flush after the streams pushed (poll closes the run once it is done, or,
        kept, leaves it open and idle)."""
        if self.feeder is not None and not self.ending:
            self.feeder.end()
            self.ending = True
            self.flushes += 1

    def poll(self) -> Iterator[object]:
        """The keys of the streams complete now, without waiting; once a flush asked for is done,
        the run is closed (CorruptStreamError for a stream left with fewer frames)."""
        if self.feeder is None:
            return
        if not self.ending:
            yield from self.ready()
            return
        if self.keep:
            yield from self._poll_kept()
            return
        if self.feeder.wait(0, 0) >= 0:  # the flush is not done yet
            yield from self._ready()
            return
        self._check(self.feeder.close())
        yield from self._ready()
        if self.keys:
            raise CorruptStreamError("a stream decoded to fewer frames than its chunk announces")
        self.parser.close()
        self.session = self.parser = self.state = self.feeder = None
        self.ending = False

    def _poll_kept(self) -> Iterator[object]:
        """poll of a kept run that is ending: once the flush is done, the run stays open, idle."""
        done = self.feeder.flushed(self.flushes, 0)
        if done < 0:  # the kept feeder stopped: its parser failed
            self._check(self.feeder.close())
            raise CorruptStreamError("NVDEC's parser stopped before the streams were complete")
        yield from self._ready()
        if done < self.flushes:
            return
        if self.keys:
            raise CorruptStreamError("a stream decoded to fewer frames than its chunk announces")
        self.ending = False

    def wait(self, timeout_s: float) -> None:
        """Wait (at most timeout_s) for one more stream to complete, the flush asked for to be
        done or the feeder to finish."""
        if self.feeder is not None:
            flushes = self.flushes + (0 if self.ending else 1)  # kept: a flush done ends the wait too
            self.feeder.wait(int(self.state.completed) + 1, timeout_s, flushes if self.keep else None)

    def _ready(self) -> Iterator[object]:
        self._check()
        while len(self.keys) > self.state.pending:
            self.held.popleft()
            yield self.keys.popleft()

    def _check(self, parse_error: int = 0) -> None:
        from kvcodec.video import nvcuvid_native as native

        if self.session.error is not None:
            raise self.session.error
        if self.session.layout is not None and self.session.layout[0] != "YUV444":
            raise CorruptStreamError(
                f"NVDEC output is {self.session.layout[0]}; kvcodec streams are 4:4:4 8-bit (YUV444)"
            )
        if self.state.error:
            what = native.ERRORS.get(int(self.state.error), "the native decode failed")
            raise CorruptStreamError(f"{what} (CUDA error {int(self.state.cuda_error)})")
        if parse_error:
            raise CorruptStreamError(f"NVDEC could not parse the stream (CUDA error {parse_error})")

    def close(self, finished: bool) -> None:
        """Stop the feeder, close the parser (and, unless `finished`, the session: one left
        mid-stream is not reused); the run can be opened again."""
        if self.feeder is not None:
            self.feeder.close()
        if self.parser is not None:
            self.parser.close()
        if not finished and self.session is not None:
            self.decoder.close((self.session.width, self.session.height))
        self.session = self.parser = self.state = self.feeder = None
        self.keys.clear()
        self.held.clear()
        self.ending = False
