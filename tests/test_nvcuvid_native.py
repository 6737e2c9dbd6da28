"""The native nvcuvid callbacks (video/nvcuvid_native.py): the C library builds with the system
compiler (skipped without one) and its display callback puts each picture of each stream in its
place, refusing pictures of another stream or beyond the streams fed. Here the CUDA driver calls
are stand-ins written in Python (this machine has no GPU); on a GPU, tests/test_nvcuvid.py compares
the native decode with the Python callbacks' frame for frame."""

from __future__ import annotations

import ctypes
import shutil
import threading

import pytest

from kvcodec.video import nvcuvid_native as native

pytestmark = pytest.mark.skipif(shutil.which("cc") is None and shutil.which("gcc") is None, reason="no C compiler")

MAP = ctypes.CFUNCTYPE(
    ctypes.c_int,
    ctypes.c_void_p,
    ctypes.c_int,
    ctypes.POINTER(ctypes.c_ulonglong),
    ctypes.POINTER(ctypes.c_uint),
    ctypes.c_void_p,
)
UNMAP = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_ulonglong)
COPY = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p)
SYNC = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p)


class Memcpy2D(ctypes.Structure):
    _fields_ = [
        ("srcXInBytes", ctypes.c_size_t),
        ("srcY", ctypes.c_size_t),
        ("srcMemoryType", ctypes.c_int),
        ("srcHost", ctypes.c_void_p),
        ("srcDevice", ctypes.c_ulonglong),
        ("srcArray", ctypes.c_void_p),
        ("srcPitch", ctypes.c_size_t),
        ("dstXInBytes", ctypes.c_size_t),
        ("dstY", ctypes.c_size_t),
        ("dstMemoryType", ctypes.c_int),
        ("dstHost", ctypes.c_void_p),
        ("dstDevice", ctypes.c_ulonglong),
        ("dstArray", ctypes.c_void_p),
        ("dstPitch", ctypes.c_size_t),
        ("WidthInBytes", ctypes.c_size_t),
        ("Height", ctypes.c_size_t),
    ]


class DispInfo(ctypes.Structure):
    _fields_ = [("picture_index", ctypes.c_int), ("pf", ctypes.c_int * 3), ("timestamp", ctypes.c_longlong)]


class Driver:
    """Stand-ins for cuvidDecodePicture, cuvidMapVideoFrame64, cuvidUnmapVideoFrame64,
    cuMemcpy2DAsync and cuStreamSynchronize that record what the C code asks for."""

    PITCH = 1024

    def __init__(self, fail_map: bool = False):
        self.copies, self.maps, self.unmaps, self.syncs, self.fail_map = [], [], [], 0, fail_map
        self.fns = (
            native.DecodeFn(lambda dec, pic: 0),
            MAP(self._map),
            UNMAP(self._unmap),
            COPY(self._copy),
            SYNC(self._sync),
        )

    def _map(self, dec, index, ptr, pitch, params):
        if self.fail_map:
            return 700
        ptr[0], pitch[0] = 0x100000 * (index + 1), self.PITCH
        self.maps.append(index)
        return 0

    def _unmap(self, dec, ptr):
        self.unmaps.append(ptr)
        return 0

    def _copy(self, desc, stream):
        c = Memcpy2D.from_address(desc)
        self.copies.append((c.srcDevice, c.srcPitch, c.dstDevice, c.dstPitch, c.WidthInBytes, c.Height))
        return 0

    def _sync(self, stream):
        self.syncs += 1
        return 0

    def state(self, width: int, height: int) -> native.State:
        addr = [native.function_pointer(f) for f in self.fns]
        return native.State(
            decoder=1, stream=2, decode=addr[0], map=addr[1], unmap=addr[2], copy=addr[3], sync=addr[4],
            row_bytes=width, height=height, planes=3, shift=32,
        )  # fmt: skip


def display(lib, state, index: int, ordinal: int, k: int = 0) -> int:
    info = DispInfo(picture_index=index, timestamp=(ordinal << 32) + 400000 * k)
    return lib.kv_display(ctypes.byref(state), ctypes.byref(info))


@pytest.fixture(scope="module")
def lib(tmp_path_factory):
    path = native.build(tmp_path_factory.mktemp("native"))
    assert path is not None and path.exists()
    lib = ctypes.CDLL(str(path))
    lib.kv_display.restype = lib.kv_decode.restype = ctypes.c_int
    return lib


def test_each_picture_goes_to_its_stream_buffer_frame_after_frame(lib):
    drv = Driver()
    s = drv.state(256, 144)  # even height: the three planes are one copy of 3 x 144 rows
    frame = 256 * 144 * 3
    s.push(0xA000000, 0, 2)
    s.push(0xB000000, 1, 1)
    assert [display(lib, s, i, o, k) for i, o, k in ((3, 0, 0), (4, 0, 1), (5, 1, 0))] == [1, 1, 1]
    assert (s.completed, s.pending, s.error, s.pictures) == (2, 0, 0, 3)
    dst = [c[2] for c in drv.copies]
    assert dst == [0xA000000, 0xA000000 + frame, 0xB000000]
    assert all(c[1] == Driver.PITCH and c[3] == 256 and c[4] == 256 and c[5] == 3 * 144 for c in drv.copies)
    assert drv.maps == [3, 4, 5] and drv.syncs == 3 and len(drv.unmaps) == 3


def _sequence(lib, state, fmt) -> int:
    lib.kv_sequence.restype = ctypes.c_int
    return lib.kv_sequence(ctypes.byref(state), ctypes.byref(fmt))


@pytest.mark.parametrize("python_says", [3, 0])
def test_the_sequence_callback_asks_python_once_per_format(lib, python_says):
    """kv_sequence hands the parser what the Python callback returned for the last format it saw,
    without calling it again (a fetch's feeder thread would wait for the interpreter lock); a new
    format (another size, say), a refusal (0: never reused) or a cleared `surfaces` goes to Python."""
    from kvcodec.video import nvcuvid
    from kvcodec.video import nvcuvid_api as api

    calls = []

    def on_sequence(user, fmt_p) -> int:
        area = fmt_p.contents.display_area
        calls.append((area.right, area.bottom))
        return python_says

    python = api.SequenceCallback(on_sequence)
    s = Driver().state(512, 512)
    s.sequence, s.format_bytes = native.function_pointer(python), nvcuvid.FORMAT_BYTES
    fmt = api.VideoFormat(coded_width=512, coded_height=512, chroma_format=3, min_num_decode_surfaces=2)
    fmt.display_area.right = fmt.display_area.bottom = 512
    fmt.bitrate = 7  # past the format's bytes: a stream's bit rate names no new format
    assert [_sequence(lib, s, fmt) for _ in range(3)] == [python_says] * 3
    assert calls == [(512, 512)] * (1 if python_says else 3)
    fmt.bitrate = 9
    assert _sequence(lib, s, fmt) == python_says
    fmt.display_area.right = 256
    assert _sequence(lib, s, fmt) == python_says
    s.surfaces = 0  # the decoder is new (nvcuvid._FedRun.push): Python checks it again
    assert _sequence(lib, s, fmt) == python_says
    expected = [(512, 512), (256, 512), (256, 512)] if python_says else [(512, 512)] * 4 + [(256, 512)] * 2
    assert calls == expected and s.sequence_calls == len(expected) and s.sequence_ns > 0


def test_odd_heights_copy_each_plane_from_its_aligned_start(lib):
    drv = Driver()
    s = drv.state(160, 145)
    s.push(0xC000000, 0, 1)
    assert display(lib, s, 0, 0) == 1
    src0 = 0x100000
    assert [(c[0] - src0, c[2] - 0xC000000, c[5]) for c in drv.copies] == [
        (k * 146 * Driver.PITCH, k * 145 * 160, 145) for k in range(3)
    ]


def test_pictures_of_another_stream_or_beyond_the_streams_are_refused(lib):
    drv = Driver()
    s = drv.state(256, 144)
    assert display(lib, s, 0, 0) == 0 and s.error == 3  # nothing fed
    s = drv.state(256, 144)
    s.push(0xA000000, 7, 1)
    assert display(lib, s, 0, 8) == 0 and s.error == 2 and s.completed == 0  # stream 8's picture while 7 is due
    assert display(lib, s, 0, 7) == 0  # an error stops every later picture
    s = Driver(fail_map=True).state(256, 144)
    s.push(0xA000000, 0, 1)
    assert display(lib, s, 0, 0) == 0 and (s.error, s.cuda_error) == (1, 700)


def test_the_ring_refuses_more_streams_than_it_holds():
    s = native.State()
    for k in range(native.MAX_TARGETS):
        s.push(k, k, 1)
    with pytest.raises(RuntimeError):
        s.push(0, 0, 1)


PARSE = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p)


class Packet(ctypes.Structure):  # CUVIDSOURCEDATAPACKET
    _fields_ = [
        ("flags", ctypes.c_ulong),
        ("size", ctypes.c_ulong),
        ("payload", ctypes.c_void_p),
        ("ts", ctypes.c_longlong),
    ]


class Parser:
    """A stand-in for cuvidParseVideoData, called on the feeder's thread: it records each packet
    and, once a stream's last byte has come, displays that stream's pictures (kv_display), as
    NVDEC's parser does once it has seen a stream's end. fail_at: the packet it refuses. While
    `gate` is clear, each packet waits for it: the feeder thread is held where the test needs it."""

    def __init__(self, lib, state, sizes: dict, frames: dict, fail_at: int | None = None):
        self.lib, self.state, self.sizes, self.frames, self.fail_at = lib, state, sizes, frames, fail_at
        self.packets, self.seen = [], {}
        self.gate = threading.Event()
        self.gate.set()
        self.fn = PARSE(self._parse)

    def _parse(self, parser, packet):
        if not self.gate.wait(timeout=60):
            return 8
        p = Packet.from_address(packet)
        self.packets.append((p.flags, p.size, p.ts))
        if self.fail_at is not None and len(self.packets) > self.fail_at:
            return 9
        if p.flags & 1:
            return 0
        ordinal = p.ts >> 32
        self.seen[ordinal] = self.seen.get(ordinal, 0) + p.size
        if self.seen[ordinal] == self.sizes[ordinal]:
            for k in range(self.frames[ordinal]):
                display(self.lib, self.state, k, ordinal, k)
        return 0


@pytest.fixture(scope="module")
def flib(tmp_path_factory):
    path = native.build(tmp_path_factory.mktemp("feeder"))
    lib = ctypes.CDLL(str(path))
    lib.kv_display.restype = ctypes.c_int
    return native.declare(lib, native.SIGNATURES)  # the module's own signatures, as library() sets them


def _feeder(flib, sizes, frames, piece, fail_at=None):
    drv = Driver()
    s = drv.state(256, 144)
    parser = Parser(flib, s, sizes, frames, fail_at)
    f = native.Feeder(flib, s, 1, native.function_pointer(parser.fn), 0, 0, piece)
    return drv, s, parser, f


def test_the_feeder_thread_feeds_each_stream_in_pieces_then_flushes(flib):
    sizes, frames = {0: 1000, 1: 300, 2: 1}, {0: 2, 1: 1, 2: 3}
    data = [ctypes.create_string_buffer(n) for n in sizes.values()]
    drv, s, parser, f = _feeder(flib, sizes, frames, piece=256)
    for k, buf in enumerate(data):
        s.push(0xA000000 * (k + 1), k, frames[k])
        f.submit(ctypes.addressof(buf), sizes[k], k)
    deadline = 0
    while f.wait(3, 1.0) >= 0 and s.completed < 3 and deadline < 20:
        deadline += 1
    assert s.completed == 3 and not f.finished  # complete, the flush not asked for yet
    f.end()
    while f.wait(1 << 62, 1.0) >= 0:
        pass
    assert f.finished and f.close() == 0
    stamps = [(flags, size, ts >> 32) for flags, size, ts in parser.packets]
    assert stamps == [(2, 256, 0), (2, 256, 0), (2, 256, 0), (2, 232, 0), (2, 256, 1), (2, 44, 1), (2, 1, 2), (1, 0, 0)]
    assert (s.pictures, s.error) == (6, 0) and len(drv.copies) == 6


def test_a_kept_feeder_takes_more_streams_after_each_flush(flib):
    """kv_feeder_keep: the thread and parser stay after a flush; streams pushed after it are fed
    and flushed again; a wait for the flush ends when it is done."""
    sizes, frames = {0: 300, 1: 10, 2: 600}, {0: 2, 1: 1, 2: 1}
    data = [ctypes.create_string_buffer(n) for n in sizes.values()]
    drv, s, parser, f = _feeder(flib, sizes, frames, piece=256)
    f.keep()
    for round_, streams in enumerate(([0, 1], [2])):
        parser.gate.clear()  # nothing is fed, so nothing flushed, until both ends are asked for
        for k in streams:
            s.push(0xA000000 * (k + 1), k, frames[k])
            f.submit(ctypes.addressof(data[k]), sizes[k], k)
        f.end()
        f.end()  # asked twice before it is done: one flush
        parser.gate.set()
        for _ in range(40):
            if f.wait(1 << 62, 0.5, flushes=round_ + 1) < 0 or f.flushed(round_ + 1, 0) == round_ + 1:
                break
        assert f.flushed(round_ + 1, 1.0) == round_ + 1 and not f.finished
    assert s.completed == 3 and s.pictures == 4 and s.error == 0
    assert [flags for flags, _, _ in parser.packets].count(1) == 2  # one end-of-stream packet per flush
    assert f.wait(4, 0.01, flushes=3) == 3  # nothing more: the wait times out, the feeder lives on
    assert f.close() == 0


def test_a_parse_error_stops_the_feeder_and_close_reports_it(flib):
    sizes, frames = {0: 600, 1: 600}, {0: 1, 1: 1}
    data = [ctypes.create_string_buffer(600) for _ in range(2)]
    _, s, parser, f = _feeder(flib, sizes, frames, piece=256, fail_at=2)
    for k, buf in enumerate(data):
        s.push(0xA000000, k, 1)
        f.submit(ctypes.addressof(buf), 600, k)
    for _ in range(20):
        if f.wait(2, 1.0) < 0:
            break
    assert f.finished and s.completed == 0
    assert f.close() == 9 and len(parser.packets) == 3  # nothing fed after the refused piece
    assert f.close() == 0  # closed once


def test_closing_a_feeder_waiting_for_streams_stops_its_thread(flib):
    _, s, _, f = _feeder(flib, {}, {}, piece=256)
    assert f.wait(1, 0.01) == 0  # nothing pushed: the wait times out
    assert f.close() == 0


class LaggingParser:
    """A stand-in for NVDEC's parser as decode_each_fed drives it: a stream's pictures come out
    only once `lag` later streams have started (or the end was fed), as the real parser holds a
    picture until it has seen what follows it."""

    def __init__(self, lib, frames: dict, lag: int, fail_stream: int | None = None):
        self.lib, self.frames, self.lag, self.fail_stream = lib, frames, lag, fail_stream
        self.state, self.started, self.shown, self.flags = None, [], 0, []
        self.fn = PARSE(self._parse)

    def _parse(self, parser, packet):
        p = Packet.from_address(packet)
        self.flags.append(p.flags)
        if p.flags & 1:
            upto = len(self.started)
        else:
            ordinal = p.ts >> 32
            if ordinal == self.fail_stream:
                return 7
            if not self.started or self.started[-1] != ordinal:
                self.started.append(ordinal)
            upto = len(self.started) - self.lag
        while self.shown < upto:
            ordinal = self.started[self.shown]
            for k in range(self.frames[ordinal]):
                display(self.lib, self.state, k, ordinal, k)
            self.shown += 1
        return 0


def _stand_ins(monkeypatch, frames: dict, lag: int, fail_stream=None):
    """A decoder whose parser, driver calls and session are stand-ins (no GPU here), and its parser."""
    from types import SimpleNamespace

    from kvcodec.video import nvcuvid
    from kvcodec.video import nvcuvid_api as api

    parser = LaggingParser(native.library(), frames, lag, fail_stream)
    drv = Driver()
    setctx = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p)(lambda ctx: 0)

    class Session:
        width, height, error, layout, handle, made = 256, 144, None, ("YUV444", 256, 432), ctypes.c_void_p(1), 1

    class NativeParser:
        def __init__(self, session, delay, lib, state):
            self.handle = ctypes.c_void_p(1)
            parser.state = state

        def close(self):
            pass

    monkeypatch.setattr(nvcuvid, "_NativeParser", NativeParser)
    monkeypatch.setattr(api, "nvcuvid", lambda: SimpleNamespace(cuvidParseVideoData=parser.fn))
    monkeypatch.setattr(api, "cuda", lambda: SimpleNamespace(cuCtxSetCurrent=setctx))
    monkeypatch.setattr(api, "make_current", lambda ctx: None)
    decoder = SimpleNamespace(
        ctx=0, stream=SimpleNamespace(cuda_stream=0), display_delay=1, PIECE_BYTES=256, setctx=setctx,
        _session=lambda w, h: Session(), _native_state=lambda lib, s, pp: drv.state(256, 144),
        close=lambda size=None: None,
    )  # fmt: skip
    return decoder, parser


def _fed(monkeypatch, n: int, frames: int, depth: int, lag: int, fail_stream=None) -> list:
    """decode_each_fed's keys over n streams of `frames` pictures, on the stand-ins (no GPU here)."""
    import numpy as np

    from kvcodec.video import nvcuvid

    decoder, _ = _stand_ins(monkeypatch, dict.fromkeys(range(n), frames), lag, fail_stream)
    data = [np.zeros(600, np.uint8) for _ in range(n)]
    items = ((k, data[k], 256, 144, frames, 0xA000000 * (k + 1)) for k in range(n))
    return list(nvcuvid.NvcuvidDecoder.decode_each_fed(decoder, items, depth))


@pytest.mark.parametrize("lag", [1, 2])
def test_a_kept_run_takes_more_streams_after_each_flush(monkeypatch, lag):
    """A kept _FedRun (what NvcuvidDecoder.fed_run hands out by default): after a flush its
    parser and feeder stay open, idle, and the next caller's streams complete through them."""
    import numpy as np

    from kvcodec.video import nvcuvid

    decoder, parser = _stand_ins(monkeypatch, dict.fromkeys(range(5), 2), lag)
    run = nvcuvid._FedRun(decoder, native.library(), keep=True)
    run.open(256, 144)
    feeder, data, keys = run.feeder, [np.zeros(600, np.uint8) for _ in range(5)], []
    for streams in ([0, 1, 2], [3, 4]):
        for k in streams:
            run.push(k, data[k], run.next_ordinal(), 2, 0xA000000 * (k + 1))
        run.begin_end()
        for _ in range(400):
            keys += list(run.poll())
            if not run.busy:
                break
            run.wait(0.05)
        assert not run.busy and run.feeder is feeder and not feeder.finished  # idle, still open
    assert keys == [0, 1, 2, 3, 4]
    assert [flags & 1 for flags in parser.flags].count(1) == 2  # one end-of-stream packet per flush
    run.close(True)
    assert run.feeder is None


@pytest.mark.parametrize(("n", "frames", "depth", "lag"), [(5, 2, 2, 1), (5, 1, 2, 2), (6, 2, 1, 3), (70, 1, 2, 2)])
def test_fed_streams_complete_whatever_the_parser_holds_back(monkeypatch, n, frames, depth, lag):
    """decode_each_fed never waits for a stream to complete before feeding what completes it
    (a parser holding `lag` streams back, more streams than the native ring holds)."""
    assert _fed(monkeypatch, n, frames, depth, lag) == list(range(n))


def test_fed_streams_report_the_parsers_refusal(monkeypatch):
    from kvcodec.errors import CorruptStreamError

    with pytest.raises(CorruptStreamError, match="could not parse"):
        _fed(monkeypatch, 5, 2, 2, 1, fail_stream=3)
