"""restore_chunks (codecs/transform/batch.py): many transform chunks decoded on worker sessions that
stream their chunks through one parser each, the math in waves on the caller's thread.

On the CPU the sessions are threads with FFmpeg decoders (the orchestration is the same as on
NvcuvidThreads); a decoder with decode_each that attributes pictures to streams as NVDEC's path does
(nvcuvid.attribute) checks the streamed path, its fallback after a stream fails, and the errors.
GPU coverage: tests/test_transform_gpu.py, tests/test_nvcuvid.py.
"""

from __future__ import annotations

import collections
import ctypes
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import test_transform_gpu as gpu_tests  # the synthetic transform and KV those tests code
from kvcodec.codecs.transform.batch import restore_chunks
from kvcodec.codecs.transform.codec import TransformCodec
from kvcodec.errors import CorruptStreamError, FormatError, KVCodecError
from kvcodec.video.nvcuvid import STAMP_SHIFT, attribute
from kvcodec.video.registry import get_decoder

kvt = gpu_tests.kvt  # the module-scoped fixture


class StreamingCpuDecoder:
    """FFmpeg per stream, handed out like NvcuvidDecoder.decode_each (keys from nvcuvid.attribute);
    extra: {stream ordinal: frames added} fakes a stream that holds more pictures than announced."""

    display_delay = 1  # restore_chunks pauses after display_delay + 1 streams (decode_each's None item)

    def __init__(self, extra=None):
        self.cpu, self.extra, self.fed = get_decoder("cpu"), extra or {}, 0

    def decode(self, video, w, h):
        return self.cpu.decode(video, w, h)

    def decode_each(self, items):
        expected = collections.deque()
        for ordinal, item in enumerate(items):
            if item is None:
                yield None, None
                continue
            key, video, w, h, frames = item
            self.fed += 1
            expected.append([key, frames, ordinal])
            got = list(self.cpu.decode(video, w, h))
            for k, frame in enumerate(got + got[:1] * self.extra.get(ordinal, 0)):
                yield attribute(expected, (ordinal << STAMP_SHIFT) + 400000 * k), frame  # as NVDEC stamps them
        if expected:
            raise CorruptStreamError("fewer frames than announced")


class CpuSessions:
    """Stands where NvcuvidThreads does for restore_chunks: run_sessions on worker threads, the
    decoders shared out among `drivers` of them."""

    def __init__(self, decoders):
        self.decoders = decoders
        self.pool = ThreadPoolExecutor(len(decoders))

    def run_sessions(self, work, drivers=None):
        n = drivers or len(self.decoders)
        return [self.pool.submit(work, self.decoders[k::n]) for k in range(n)]


def _case(kvt, tokens=400, res=(64, 64), **kw):
    kw = {"coder": "hevc", "resolutions": (res,), **kw}
    c = TransformCodec(kvt[0], chunk_tokens=64, target_ratio=4.0, **kw)
    c._restorer.batched = True
    kv = gpu_tests.synthetic_kv(tokens, 21)
    chunks = c.encode_chunks(kv)
    ref = TransformCodec(kvt[0], chunk_tokens=64, target_ratio=4.0, **kw)
    ref._restorer.batched = False
    return c, kv, chunks, gpu_tests.restore_all(ref, chunks, kv.shape)


def _outs(kv, chunks):
    out = torch.full_like(kv, float("nan"))
    return out, [out[:, :, ch.start_token : ch.start_token + ch.tokens] for ch in chunks]


@pytest.mark.parametrize("wave,drivers", [(0, None), (1, 1), (3, 2), (16, None)])
@pytest.mark.parametrize("streaming", [True, False])
def test_sessions_restore_every_chunk_as_the_reference(kvt, wave, drivers, streaming):
    c, kv, chunks, want = _case(kvt)
    out, outs = _outs(kv, chunks)
    decoders = [StreamingCpuDecoder() if streaming else get_decoder("cpu") for _ in range(3)]
    sessions = CpuSessions(decoders)
    restore_chunks(c, [ch.blobs[0] for ch in chunks], outs, threads=sessions, wave=wave, drivers=drivers)
    assert gpu_tests.within_an_ulp(out, want)
    if streaming:
        assert sum(d.fed for d in decoders) == len(chunks)  # every chunk streamed once, none re-decoded


def test_a_stream_with_an_extra_picture_is_decoded_again_on_its_own(kvt):
    c, kv, chunks, want = _case(kvt)
    out, outs = _outs(kv, chunks)
    dec = StreamingCpuDecoder(extra={2: 1})  # its third stream hands back one picture too many
    restore_chunks(
        c, [ch.blobs[0] for ch in chunks], outs, threads=CpuSessions([dec, StreamingCpuDecoder()]), drivers=1
    )
    assert gpu_tests.within_an_ulp(out, want)  # the chunks after it were streamed again, the rest kept


def test_a_damaged_chunk_raises_after_the_others_are_restored(kvt):
    c, kv, chunks, want = _case(kvt)
    blobs = [bytearray(ch.blobs[0]) for ch in chunks]
    blobs[3][len(blobs[3]) // 2] ^= 0xFF
    out, outs = _outs(kv, chunks)
    with pytest.raises(KVCodecError):
        restore_chunks(c, [bytes(b) for b in blobs], outs, threads=CpuSessions([StreamingCpuDecoder()] * 2))
    bad = slice(chunks[3].start_token, chunks[3].start_token + chunks[3].tokens)
    keep = torch.ones(kv.shape[2], dtype=torch.bool)
    keep[bad] = False
    assert gpu_tests.within_an_ulp(out[:, :, keep], want[:, :, keep])


def test_a_damaged_chunks_error_holds_nothing_of_the_call_once_dropped(kvt, monkeypatch):
    """The error restore_chunks raises keeps its traceback, but nothing of the call stays in a cycle
    with it: a chunk's error held the worker's frames, which held the call's run, which held the
    error, until the collector's next full pass (with the chunks' blobs and targets)."""
    import gc
    import traceback
    import weakref

    from kvcodec.codecs.transform import batch

    runs = []

    class Tracked(batch._Run):
        def __init__(self, *args):
            super().__init__(*args)
            runs.append(weakref.ref(self))

    monkeypatch.setattr(batch, "_Run", Tracked)
    c, kv, chunks, _ = _case(kvt)
    blobs = [bytearray(ch.blobs[0]) for ch in chunks]
    for i in (3, 5):  # two errors: the one not raised must not keep the run either
        blobs[i][len(blobs[i]) // 2] ^= 0xFF
    _, outs = _outs(kv, chunks)
    raised = []
    gc.collect()
    gc.disable()
    try:
        try:
            restore_chunks(c, [bytes(b) for b in blobs], outs, threads=CpuSessions([StreamingCpuDecoder()] * 2))
        except KVCodecError as e:
            raised.append({frame.f_code.co_name for frame, _ in traceback.walk_tb(e.__traceback__)})
        assert raised and "_videos" in raised[0]  # the worker's frames are kept in the traceback
        assert len(runs) == 1 and runs[0]() is None
    finally:
        gc.enable()


@pytest.mark.parametrize("coder", ["zstd", "mixed"])
def test_zstd_chunks_go_through_the_same_call(kvt, coder):
    """zstd chunks alone, or between video chunks (mixed): restored in one call as the reference."""
    c = TransformCodec(kvt[0], chunk_tokens=64, target_ratio=4.0, coder=coder, resolutions=((64, 64),))
    kv = gpu_tests.synthetic_kv(200, 22)
    chunks = c.encode_chunks(kv)
    want = gpu_tests.restore_all(c, chunks, kv.shape)
    out, outs = _outs(kv, chunks)
    restore_chunks(c, [ch.blobs[0] for ch in chunks], outs, threads=CpuSessions([StreamingCpuDecoder()] * 2))
    assert gpu_tests.within_an_ulp(out, want)  # batched math vs the CPU's per-group reference


@settings(max_examples=60, deadline=None)
@given(frames=st.lists(st.integers(1, 3), min_size=1, max_size=6), data=st.data())
def test_attribute_names_each_picture_s_stream_and_refuses_a_miscount(frames, data):
    expected = collections.deque([f"k{i}", n, i] for i, n in enumerate(frames))
    stamps = [(i << STAMP_SHIFT) + 400000 * k for i, n in enumerate(frames) for k in range(n)]
    assert [attribute(expected, s) for s in stamps] == [f"k{s >> STAMP_SHIFT}" for s in stamps]
    assert not expected
    # one stream's count off by one: some picture lands where another stream is due, or one is left
    wrong = data.draw(st.integers(0, len(frames) - 1))
    delta = data.draw(st.sampled_from([-1, 1])) if frames[wrong] > 1 else 1
    real = [(i << STAMP_SHIFT) + k for i, n in enumerate(frames) for k in range(n + (delta if i == wrong else 0))]
    expected = collections.deque([f"k{i}", n, i] for i, n in enumerate(frames))
    with pytest.raises(CorruptStreamError):
        for s in real:
            attribute(expected, s)
        if expected:
            raise CorruptStreamError("left")


def test_a_worker_that_fails_before_it_begins_raises_instead_of_hanging(kvt):
    class OneFails(CpuSessions):
        def run_sessions(self, work, drivers=None):
            def fail():
                raise RuntimeError("no NVDEC session")

            return [*super().run_sessions(work, drivers), self.pool.submit(fail)]

    c, kv, chunks, want = _case(kvt, tokens=200)
    out, outs = _outs(kv, chunks)
    with pytest.raises(RuntimeError, match="no NVDEC session"):
        restore_chunks(c, [ch.blobs[0] for ch in chunks], outs, threads=OneFails([StreamingCpuDecoder()] * 2))
    assert gpu_tests.within_an_ulp(out, want)  # the other workers restored every chunk


def test_a_session_that_fails_on_its_own_stops_its_worker_and_the_call_raises(kvt):
    class Broken(StreamingCpuDecoder):
        def decode_each(self, items):
            raise RuntimeError("NVDEC session lost")
            yield  # a generator, as decode_each is

    c, kv, chunks, want = _case(kvt, tokens=200)
    out, outs = _outs(kv, chunks)
    with pytest.raises(RuntimeError, match="session lost"):
        restore_chunks(c, [ch.blobs[0] for ch in chunks], outs, threads=CpuSessions([Broken(), StreamingCpuDecoder()]))
    assert gpu_tests.within_an_ulp(out, want)  # the healthy session restored every chunk


@pytest.mark.parametrize("coder", ["hevc", "mixed"])
def test_stage_stream_stages_every_chunk_and_names_the_refused_and_the_damaged(kvt, coder):
    """The fetch pipeline's streamed first half: every chunk staged as it completes, a chunk that
    its check refuses and a chunk whose stream holds an extra picture reported as that chunk's own
    (mixed: zstd chunks staged between the streamed ones)."""
    from kvcodec.codecs.transform.batch import stage_stream
    from kvcodec.errors import FormatError

    c, kv, chunks, want = _case(kvt, coder=coder)
    out, outs = _outs(kv, chunks)

    def check(tag, info):
        assert info.index == tag and info.start_token == chunks[tag].start_token
        if tag == 4:
            raise FormatError("refused by its check")

    # chunk 2's stream holds a picture too many: the third stream fed (mixed: the second; odd chunks are zstd)
    decoder = StreamingCpuDecoder(extra={2 if coder == "hevc" else 1: 1})
    items = [(i, ch.blobs[0], outs[i]) for i, ch in enumerate(chunks)]
    got = dict(stage_stream(c, iter(items), "cpu", check, decoder=decoder))
    assert sorted(got) == list(range(len(chunks))) and isinstance(got[4], FormatError)
    ok = [i for i in got if i != 4]
    assert all(not isinstance(got[i], KVCodecError) for i in ok)  # re-decoded on its own, the extra picture gone
    c.finish([got[i] for i in ok], [outs[i] for i in ok])
    for i in ok:
        assert gpu_tests.within_an_ulp(
            outs[i], want[:, :, chunks[i].start_token : chunks[i].start_token + chunks[i].tokens]
        )


def test_sink_tokens_go_up_in_one_piece_each_to_its_chunk(monkeypatch):
    """finish uploads every staged chunk's host sink tokens at once (transform_decode._sinks_on):
    each chunk gets its own values and shape back, chunks without sink tokens get None. (No GPU
    here: the upload is a copy, standing for the host-to-device one.)"""
    from kvcodec.codecs.transform import decode as transform_decode

    a = torch.arange(2 * 2 * 4 * 3 * 2, dtype=torch.float16).view(2, 2, 4, 3, 2)
    b = -torch.arange(2 * 2 * 1 * 3 * 2, dtype=torch.float16).view(2, 2, 1, 3, 2)
    assert transform_decode._sinks_on([a, None, b], torch.device("cpu"))[0] is a  # already there: as is
    uploads = []
    monkeypatch.setattr(
        transform_decode.transform_kernels, "upload", lambda t, device: uploads.append(t.numel()) or t.clone()
    )
    out = transform_decode._sinks_on([a, None, b], torch.device("meta"))
    assert uploads == [a.numel() + b.numel()]  # one upload
    assert out[1] is None and torch.equal(out[0], a) and torch.equal(out[2], b)


class FakeRun:
    """Stands where nvcuvid._FedRun does for StageDriver (no GPU here): a pushed stream is decoded
    with FFmpeg straight into its buffer, and, as NVDEC's parser holds a stream's last picture, it
    completes only once another stream was pushed after it or the flush was asked for. fail: the
    key of a stream whose session fails (every stream it holds is then decoded on its own)."""

    def __init__(self, decoder, fail=None, keep=False):
        self.decoder, self.fail, self.keep = decoder, fail, keep
        self.session = self.feeder = None
        self.keys, self.held, self.ending, self.pushed, self.streams = collections.deque(), [], False, 0, []
        self.opened = self.flushed = 0

    pending = property(lambda self: len(self.keys))
    busy = property(lambda self: bool(self.keys) or self.ending)

    def open(self, w, h):
        self.session, self.feeder, self.ending, self.pushed = SimpleNamespace(width=w, height=h), object(), False, 0
        self.opened += 1

    def next_ordinal(self):
        self.pushed += 1
        return self.pushed - 1

    def push(self, key, buf, ordinal, frames, out_ptr):
        w, h = self.session.width, self.session.height
        got = list(self.decoder.cpu.decode(buf.tobytes(), w, h))
        assert len(got) == frames
        for k, frame in enumerate(got):
            ctypes.memmove(out_ptr + k * frame.numel(), frame.contiguous().data_ptr(), frame.numel())
        self.keys.append(key)
        self.streams.append(key)

    def stuck(self):
        return self.feeder is not None and not self.ending and bool(self.keys)

    def begin_end(self):
        if self.feeder is not None and not self.ending:
            self.ending = True
            self.flushed += 1

    def poll(self):
        if self.feeder is None:
            return
        if self.fail in self.keys:
            raise CorruptStreamError("the session failed")
        while len(self.keys) > (0 if self.ending else 1):
            yield self.keys.popleft()
        if self.ending and self.keep:  # kept: open and idle after the flush
            self.ending = False
        elif self.ending:
            self.close(True)

    def wait(self, timeout_s):
        pass

    def close(self, finished):
        self.session = self.feeder = None
        self.keys.clear()
        self.ending = False


class FakeDecoder:
    def __init__(self, fail=None, keep=False):
        self.cpu, self.fail, self.decoded_alone = get_decoder("cpu"), fail, 0
        self.run = FakeRun(self, fail, keep)

    def fed_run(self):
        return self.run

    def decode(self, video, w, h):  # a chunk decoded on its own after its session failed
        self.decoded_alone += 1
        return self.cpu.decode(video, w, h)


def _drive(driver, c, chunks, outs, flush) -> dict:
    for i, ch in enumerate(chunks):
        driver.submit(i, ch.blobs[0], outs[i])
    got: dict = {}
    while len(got) < len(chunks):
        got.update((tag, part) for tag, part, _ in driver.poll())
        flush()
    return got


@pytest.mark.parametrize("sessions,fail", [(1, None), (3, (4, 0))])  # a session holds (chunk, piece) keys
def test_stage_driver_stages_every_chunk_from_one_thread(kvt, sessions, fail):
    """driven.StageDriver (the fetch's default on CUDA): chunks submitted from one thread to
    several sessions, each chunk's frames straight into its buffer; a chunk refused by its check is
    that chunk's error; after a session fails, each chunk it held is decoded on its own."""
    from kvcodec.codecs.driven import StageDriver
    from kvcodec.errors import FormatError

    c, kv, chunks, want = _case(kvt)
    out, outs = _outs(kv, chunks)

    def check(tag, info):
        if tag == 2:
            raise FormatError("refused by its check")

    decoders = [FakeDecoder(fail) for _ in range(sessions)]
    driver = StageDriver(c, decoders, check)
    got = _drive(driver, c, chunks, outs, driver.end_all if sessions == 1 else driver.flush_stuck)
    driver.close()
    assert sorted(got) == list(range(len(chunks))) and isinstance(got[2], FormatError)
    ok = [i for i in got if i != 2]
    c.finish([got[i] for i in ok], [outs[i] for i in ok])
    for i in ok:
        assert gpu_tests.within_an_ulp(
            outs[i], want[:, :, chunks[i].start_token : chunks[i].start_token + chunks[i].tokens]
        )
    assert sorted(k for d in decoders for k in d.run.streams) == sorted(
        (i, 0) for i in ok
    )  # every chunk but the refused one streamed once
    held = [d.run.streams for d in decoders if fail in d.run.streams]  # the session that failed
    assert sum(d.decoded_alone for d in decoders) == (len(held[0]) if fail is not None else 0)
    assert all(d.run.feeder is None for d in decoders)  # closed


@pytest.mark.parametrize("video_first", [True, False])
def test_submit_many_pushes_the_videos_before_the_host_work_and_restores_the_same(kvt, monkeypatch, video_first):
    """StageDriver.submit_many (what a fetch hands the blobs it holds to): the chunks with videos go
    to their sessions first, those without to the host pool after (driven.VIDEO_FIRST; else in the
    order given); every chunk restores as the reference either way."""
    from kvcodec.codecs import driven
    from kvcodec.codecs.driven import StageDriver

    c, kv, chunks, want = _case(kvt, coder="mixed")
    out, outs = _outs(kv, chunks)
    monkeypatch.setattr(driven, "VIDEO_FIRST", video_first)
    order = []
    driver = StageDriver(c, [FakeDecoder(None) for _ in range(2)])
    push, host = driver._push, driver._host
    monkeypatch.setattr(driver, "_push", lambda tag, *a: (order.append(("video", tag)), push(tag, *a)))
    monkeypatch.setattr(driver, "_host", lambda tag, *a: (order.append(("host", tag)), host(tag, *a)))
    driver.submit_many([(i, ch.blobs[0], outs[i]) for i, ch in enumerate(chunks)])
    kinds = [k for k, _ in order]
    assert sorted(t for _, t in order) == list(range(len(chunks))) and {"video", "host"} <= set(kinds)
    if video_first:
        assert kinds == sorted(kinds, key=lambda k: k == "host")  # every video before any host work
    else:
        assert [t for _, t in order] == list(range(len(chunks)))
    got: dict = {}
    for i in range(len(chunks)):
        while driver.pending(i):
            driver.end_all()
            driver.wait(i, 30.0, flush=True)
            got.update((tag, part) for tag, part, _ in driver.poll())
    got.update((tag, part) for tag, part, _ in driver.poll())
    driver.close()
    assert sorted(got) == list(range(len(chunks)))
    c.finish([got[i] for i in sorted(got)], [outs[i] for i in sorted(got)])
    assert gpu_tests.within_an_ulp(out, want)


def test_stage_driver_leaves_kept_runs_open_for_the_next_fetch(kvt):
    """Runs their decoders keep (nvcuvid_native.KEEP) are flushed when their chunks are in, left
    open and idle by close, and the next driver's chunks go through them without opening them
    again; a run with no chunk of a fetch is never flushed."""
    from kvcodec.codecs.driven import StageDriver

    c, kv, chunks, want = _case(kvt)
    decoders = [FakeDecoder(keep=True) for _ in range(len(chunks) + 1)]  # one session has no chunk
    for _ in range(2):
        out, outs = _outs(kv, chunks)
        driver = StageDriver(c, decoders)
        got = _drive(driver, c, chunks, outs, driver.end_all)
        driver.close()
        c.finish([got[i] for i in range(len(chunks))], outs)
        assert gpu_tests.within_an_ulp(out, want)
    runs = [d.run for d in decoders]
    assert all(r.feeder is not None and not r.busy for r in runs if r.opened)  # open, idle
    assert sorted(r.opened for r in runs) == [0] + [1] * len(chunks)  # opened once, by the first fetch
    assert sorted(r.flushed for r in runs) == [0] + [2] * len(chunks)  # once per fetch, the idle one never


def test_stage_driver_decompresses_zstd_chunks_on_host_threads(kvt):
    """Chunks without videos (zstd-coded samples) go to the host pool (TransformDriven.prepare_host)
    and restore as the per-group reference does."""
    from kvcodec.codecs.driven import StageDriver

    c = TransformCodec(kvt[0], chunk_tokens=64, target_ratio=4.0, coder="zstd")
    kv = gpu_tests.synthetic_kv(200, 22)
    chunks = c.encode_chunks(kv)
    want = gpu_tests.restore_all(c, chunks, kv.shape)
    out, outs = _outs(kv, chunks)
    driver = StageDriver(c, [FakeDecoder()])
    for i, ch in enumerate(chunks):
        driver.submit(i, ch.blobs[0], outs[i])
    assert all(i in driver.on_host for i in range(len(chunks)))
    got: dict = {}
    for i in range(len(chunks)):
        while driver.pending(i):
            driver.wait(i, 30.0, flush=False)  # until its host work is done: no race with the pool
            got.update((tag, part) for tag, part, _ in driver.poll())
    driver.close()
    c.finish([got[i] for i in range(len(chunks))], outs)
    assert gpu_tests.within_an_ulp(out, want)


def test_stage_driver_checksums_zstd_samples_on_the_host_thread(kvt):
    """A driven read leaves the samples' checksum to the host thread: a corrupted one is that
    chunk's ChecksumError there, and the other chunks restore."""
    from kvcodec.codecs.driven import StageDriver
    from kvcodec.errors import ChecksumError

    c = TransformCodec(kvt[0], chunk_tokens=64, target_ratio=4.0, coder="zstd")
    kv = gpu_tests.synthetic_kv(200, 22)
    chunks = c.encode_chunks(kv)
    want = gpu_tests.restore_all(c, chunks, kv.shape)
    out, outs = _outs(kv, chunks)
    bad = bytearray(chunks[1].blobs[0])
    assert c._read_entries(bytes(bad))[1][-1].name == "samples"
    bad[-50] ^= 0x10  # inside the samples, the last stream
    driver = StageDriver(c, [FakeDecoder()])
    for i, ch in enumerate(chunks):
        driver.submit(i, bytes(bad) if i == 1 else ch.blobs[0], outs[i])
    assert 1 in driver.on_host  # read without its samples' checksum
    got: dict = {}
    for i in range(len(chunks)):
        while driver.pending(i):
            driver.wait(i, 30.0, flush=False)
            got.update((tag, part) for tag, part, _ in driver.poll())
    driver.close()
    assert isinstance(got[1], ChecksumError) and "transform chunk 1" in str(got[1])
    good = [i for i in range(len(chunks)) if i != 1]
    c.finish([got[i] for i in good], [outs[i] for i in good])
    for i in good:
        span = slice(chunks[i].start_token, chunks[i].start_token + chunks[i].tokens)
        assert gpu_tests.within_an_ulp(out[:, :, span], want[:, :, span])


@pytest.mark.parametrize("expected", [1, 64])
def test_a_short_fetch_decodes_each_video_in_pieces_on_several_sessions(kvt, expected):
    """StageDriver for a fetch of `expected` chunks: a short one cuts each chunk's video into runs of
    its frames (each frame a picture that decodes alone) pushed to several sessions, into
    consecutive parts of one buffer; a long one pushes each video whole. Every chunk restores as
    the reference either way."""
    from kvcodec.codecs.driven import StageDriver, balanced_runs, split_for

    c, kv, chunks, want = _case(kvt, res=(16, 32))
    out, outs = _outs(kv, chunks)
    frames = [c.header(ch.blobs[0])["frames"] for ch in chunks]
    assert min(frames) > 1 and all(len(c.header(ch.blobs[0])["pieces"]) == f for ch, f in zip(chunks, frames))
    decoders = [FakeDecoder(None) for _ in range(3)]
    driver = StageDriver(c, decoders, expected=expected)
    got = _drive(driver, c, chunks, outs, driver.end_all)
    driver.close()
    c.finish([got[i] for i in range(len(chunks))], outs)
    assert gpu_tests.within_an_ulp(out, want)
    split = split_for(expected, len(decoders))
    pieces = [len(balanced_runs(c.header(ch.blobs[0])["pieces"], split)) for ch in chunks]
    assert sorted(k for d in decoders for k in d.run.streams) == sorted(
        (i, p) for i, n in enumerate(pieces) for p in range(n)
    )
    assert (max(pieces) > 1) == (expected == 1)


def test_pieces_that_do_not_cut_the_video_at_its_frames_are_refused(kvt):
    """A header whose pieces add up but do not start where the video's frames do (a consistent
    edit) is refused where a fetch would cut the video by them, never decoded into the wrong
    frames; pieces that do not add up to the video are refused by any decode."""
    from kvcodec.codecs.transform.batch import TransformDriven
    from kvcodec.codecs.transform.codec import CHUNK_MAGIC
    from kvcodec.container.format import read_object, write_object
    from kvcodec.errors import FormatError

    c, kv, chunks, _ = _case(kvt, tokens=64, res=(16, 32))
    h, payload = read_object(chunks[0].blobs[0], CHUNK_MAGIC, "tc")
    sizes = h["pieces"]
    assert len(sizes) > 1
    target = torch.empty_like(kv)

    def forged(pieces):
        return write_object(CHUNK_MAGIC, {**h, "pieces": pieces}, [bytes(payload)])

    TransformDriven(c).read(forged(sizes), target, split=len(sizes))  # as written: read
    shifted = forged([sizes[0] - 7, sizes[1] + 7, *sizes[2:]])
    with pytest.raises(CorruptStreamError, match="piece 1"):
        TransformDriven(c).read(shifted, target, split=len(sizes))
    assert gpu_tests.within_an_ulp(c.decode_chunk(shifted, target), c.decode_chunk(chunks[0].blobs[0], target))
    for bad in ([sizes[0] + 1, *sizes[1:]], sizes[:-1]):
        with pytest.raises(FormatError, match="pieces"):
            c.decode_chunk(forged(bad), target)


def test_a_codec_without_videos_is_driven_without_nvdec_sessions(kvt):
    """A zstd transform codec (the default) is driven on CUDA with no NVDEC session borrowed (none
    needed, none required: a GPU without NVDEC or libnvcuvid still takes the driven path); its chunks
    restore from the host pool as the reference does, and a video chunk reaching such a driver is
    that chunk's FormatError, not a crash of the fetch."""
    from kvcodec.codecs.driven import StageDriver, stage_driver

    c = TransformCodec(kvt[0], chunk_tokens=64, target_ratio=4.0)
    assert not c.codes_video and TransformCodec(kvt[0], coder="mixed").codes_video
    with stage_driver(c, "cuda", 7) as driver:  # no CUDA work until a chunk is submitted
        assert driver is not None and driver.runs == []
    kv = gpu_tests.synthetic_kv(200, 22)
    chunks = c.encode_chunks(kv)
    want = gpu_tests.restore_all(c, chunks, kv.shape)
    out, outs = _outs(kv, chunks)
    driver = StageDriver(c, [])
    for i, ch in enumerate(chunks):
        driver.submit(i, ch.blobs[0], outs[i])
    got: dict = {}
    for i in range(len(chunks)):
        while driver.pending(i):
            driver.wait(i, 30.0, flush=False)
            got.update((tag, part) for tag, part, _ in driver.poll())
    c.finish([got[i] for i in range(len(chunks))], outs)
    assert gpu_tests.within_an_ulp(out, want)
    mixed = TransformCodec(kvt[0], chunk_tokens=64, target_ratio=4.0, coder="mixed", resolutions=((64, 64),))
    video = mixed.encode_chunks(kv)[0]
    assert mixed.header(video.blobs[0])["coder"] == "hevc"
    driver.submit(0, video.blobs[0], outs[0])
    (tag, error, _), *_ = driver.poll()
    driver.close()
    assert tag == 0 and isinstance(error, FormatError) and "codes none" in str(error)


def _zstd_case(kvt):
    """A zstd-coded transform (its level's plan built, as a fetch's first chunks build it) and its chunks."""
    from kvcodec.codecs import zstd_native
    from kvcodec.codecs.driven import host_threads

    if zstd_native.threads(host_threads) is None:
        pytest.skip("no native zstd threads here (no C compiler or no libzstd)")
    c = TransformCodec(kvt[0], chunk_tokens=64, target_ratio=4.0, coder="zstd")
    kv = gpu_tests.synthetic_kv(200, 22)
    chunks = c.encode_chunks(kv)
    return c, kv, chunks, gpu_tests.restore_all(c, chunks, kv.shape)


def _collect(driver, n: int) -> dict:
    got: dict = {}
    for i in range(n):
        while driver.pending(i):
            driver.wait(i, 30.0, flush=False)  # until its host work is done: no race with the threads
            got.update((tag, part) for tag, part, _ in driver.poll())
    return got


def _counted_submits(monkeypatch) -> list:
    """Every stream handed to the native zstd threads, from here on."""
    from kvcodec.codecs import zstd_native

    seen, submit = [], zstd_native.ZstdThreads.submit

    def counted(self, data, *a, **k):
        seen.append(data)
        return submit(self, data, *a, **k)

    monkeypatch.setattr(zstd_native.ZstdThreads, "submit", counted)
    return seen


def test_host_work_begun_as_blobs_arrive_is_taken_over_and_restores_the_same(kvt, monkeypatch):
    """StageDriver.begin (a fetch's network stage calls it with each blob): the chunk's zstd starts
    there, and submit() of the same blob takes that work over instead of decompressing it again."""
    from kvcodec.codecs.driven import StageDriver

    c, kv, chunks, want = _zstd_case(kvt)
    out, outs = _outs(kv, chunks)
    seen = _counted_submits(monkeypatch)
    driver = StageDriver(c, [FakeDecoder()])
    for ch in chunks:
        driver.begin(ch.blobs[0])
    assert len(driver.begun) == len(seen) == len(chunks)
    driver.submit_many([(i, ch.blobs[0], outs[i]) for i, ch in enumerate(chunks)])
    assert not driver.begun and len(seen) == len(chunks)  # every chunk decompressed once
    got = _collect(driver, len(chunks))
    driver.close()
    c.finish([got[i] for i in range(len(chunks))], outs)
    assert gpu_tests.within_an_ulp(out, want)


def test_a_begun_blob_is_not_parsed_again_and_its_target_is_still_checked(kvt, monkeypatch):
    """submit() of a begun blob takes over the chunk as begin_host read it (adopt: no second parse on the
    fetch's thread), and still refuses a target the chunk does not fit, as read() does."""
    from kvcodec.codecs.driven import StageDriver
    from kvcodec.errors import ShapeError

    c, kv, chunks, want = _zstd_case(kvt)
    out, outs = _outs(kv, chunks)
    checked = []  # a fetch's binding check runs on what the blob says it is: here, as begin_host read it
    driver = StageDriver(c, [FakeDecoder()], lambda tag, info: checked.append((tag, info)))
    for ch in chunks:
        driver.begin(ch.blobs[0])
    parsed = []
    read_entries = c._read_entries
    monkeypatch.setattr(c, "_read_entries", lambda *a, **k: parsed.append(a) or read_entries(*a, **k))
    wrong = torch.empty((1, 2, chunks[0].tokens, 1, 1), dtype=out.dtype)
    driver.submit_many([(i, ch.blobs[0], wrong if i == 0 else outs[i]) for i, ch in enumerate(chunks)])
    assert not parsed
    assert checked == [(i, c.inspect_chunk(ch.blobs[0])) for i, ch in enumerate(chunks)]
    got = _collect(driver, len(chunks))
    driver.close()
    assert isinstance(got[0], ShapeError)
    c.finish([got[i] for i in range(1, len(chunks))], outs[1:])
    for ch in chunks[1:]:
        span = slice(ch.start_token, ch.start_token + ch.tokens)
        assert gpu_tests.within_an_ulp(out[:, :, span], want[:, :, span])


def test_begun_work_is_not_taken_over_by_another_blob_and_close_drops_what_is_left(kvt, monkeypatch):
    """A blob refused by the fetch's check keeps its begun work out of the restore, and a copy of a begun
    blob (another object) is read and decompressed on its own; close() drops the work left (each job holds
    its blob and buffer until it ends) and nothing begins after it, nor twice for one blob."""
    from kvcodec.codecs.driven import StageDriver
    from kvcodec.errors import FetchError

    c, kv, chunks, want = _zstd_case(kvt)
    out, outs = _outs(kv, chunks)
    seen = _counted_submits(monkeypatch)

    def check(tag, info):
        if tag == 1:
            raise FetchError("chunk 1 is bound to another prefix")

    driver = StageDriver(c, [FakeDecoder()], check)
    for ch in chunks:
        driver.begin(ch.blobs[0])
    driver.begin(chunks[0].blobs[0])  # again: the work begun stays the one
    assert len(seen) == len(chunks)
    copy = bytes(bytearray(chunks[2].blobs[0]))
    driver.submit_many([(i, copy if i == 2 else ch.blobs[0], outs[i]) for i, ch in enumerate(chunks)])
    assert len(seen) == len(chunks) + 1  # the copy's own
    assert set(driver.begun) == {id(chunks[1].blobs[0]), id(chunks[2].blobs[0])}
    left = [begun.future for _, begun, _ in driver.begun.values()]
    got = _collect(driver, len(chunks))
    driver.close()
    assert not driver.begun
    driver.begin(chunks[0].blobs[0])  # after close: nothing begins
    assert not driver.begun and len(seen) == len(chunks) + 1
    assert all(f.result() is not None for f in left)  # dropped, not cut short
    assert isinstance(got[1], FetchError)
    good = [i for i in range(len(chunks)) if i != 1]
    c.finish([got[i] for i in good], [outs[i] for i in good])
    for i in good:
        span = slice(chunks[i].start_token, chunks[i].start_token + chunks[i].tokens)
        assert gpu_tests.within_an_ulp(out[:, :, span], want[:, :, span])


def test_nothing_begins_for_a_damaged_blob_or_an_unplanned_level_and_a_bad_checksum_names_its_chunk(kvt):
    """begin_host leaves what it cannot read to read() (which refuses it on the fetch's thread), builds
    no plan off that thread, and a begun chunk whose samples fail their checksum is that chunk's error."""
    from kvcodec.codecs.driven import StageDriver
    from kvcodec.codecs.transform.batch import TransformDriven
    from kvcodec.errors import ChecksumError, FormatError

    c, kv, chunks, _ = _zstd_case(kvt)
    fresh = TransformCodec(kvt[0], chunk_tokens=64, target_ratio=4.0, coder="zstd")
    assert TransformDriven(fresh).begin_host(chunks[0].blobs[0]) is None  # its level's plan is not built here
    damaged = bytearray(chunks[0].blobs[0])
    damaged[:4] = b"XXXX"
    assert TransformDriven(c).begin_host(bytes(damaged)) is None
    bad = bytearray(chunks[1].blobs[0])
    bad[-50] ^= 0x10  # inside the samples, the last stream
    bad = bytes(bad)
    out, outs = _outs(kv, chunks)
    driver = StageDriver(c, [FakeDecoder()])
    driver.begin(bad)
    driver.begin(bytes(damaged))
    assert list(driver.begun) == [id(bad)]
    driver.submit_many([(0, bytes(damaged), outs[0]), (1, bad, outs[1])])
    got = _collect(driver, 2)
    driver.close()
    assert isinstance(got[0], FormatError)
    assert isinstance(got[1], ChecksumError) and "transform chunk 1" in str(got[1])


def test_a_video_chunk_begins_nothing_and_its_video_is_not_checksummed_for_it(kvt, monkeypatch):
    """begin_host reads the header alone before it decides: a chunk whose samples are a video (NVDEC's
    work, checksummed where it is read) costs the network thread no pass over its bytes."""
    from kvcodec.codecs import zstd_native
    from kvcodec.codecs.driven import host_threads
    from kvcodec.codecs.transform.batch import TransformDriven
    from kvcodec.container import format as container_format

    if zstd_native.threads(host_threads) is None:
        pytest.skip("no native zstd threads here (no C compiler or no libzstd)")
    c, _, chunks, _ = _case(kvt)
    c._restorer._plan_of(c.header(chunks[0].blobs[0]))
    summed = []
    crc = container_format.crc32
    monkeypatch.setattr(container_format, "crc32", lambda data, *a: summed.append(len(data)) or crc(data, *a))
    video = next(e.length for e in c._read_entries(chunks[0].blobs[0])[1] if e.name == "video")
    summed.clear()
    assert TransformDriven(c).begin_host(chunks[0].blobs[0]) is None
    assert video > 1000 and video not in summed  # its header's checksum only


def test_a_begun_chunks_decode_time_counts_from_when_its_work_began(kvt, monkeypatch):
    """The seconds poll() hands back for a chunk whose work began on the network stage (what the fetch's
    decode profile and stats learn from) run from that start, not from its submit."""
    from types import SimpleNamespace

    from kvcodec.codecs import driven
    from kvcodec.codecs.driven import StageDriver

    c, kv, chunks, _ = _zstd_case(kvt)
    _, outs = _outs(kv, chunks)
    clock = [100.0]
    monkeypatch.setattr(driven, "time", SimpleNamespace(monotonic=lambda: clock[0]))
    driver = StageDriver(c, [FakeDecoder()])
    driver.begin(chunks[0].blobs[0])
    clock[0] = 150.0
    driver.submit(0, chunks[0].blobs[0], outs[0])
    clock[0] = 175.0
    driver.on_host[0][0].result(timeout=60)
    (tag, _, seconds), *_ = driver.poll()
    driver.close()
    assert tag == 0 and seconds == 75.0


def test_nothing_begins_for_a_chunk_whose_side_streams_fail_their_checksums(kvt):
    """begin_host checks every stream but the samples (their checksum is the native job's) as read() does:
    a chunk whose escapes or sink tokens were damaged begins nothing, and read() refuses it."""
    from kvcodec.codecs.transform.batch import TransformDriven
    from kvcodec.errors import ChecksumError

    c, kv, chunks, _ = _zstd_case(kvt)
    blob = chunks[0].blobs[0]
    entries = c._read_entries(blob)[1]
    side = [e for e in entries if e.name != "samples" and e.length]
    assert side  # the first chunk keeps its first tokens exact: a sink stream
    _, outs = _outs(kv, chunks)
    for entry in side:
        at = len(blob) - sum(e.length for e in entries[entries.index(entry) :])
        bad = bytearray(blob)
        bad[at] ^= 0x01
        assert TransformDriven(c).begin_host(bytes(bad)) is None, entry.name
        with pytest.raises(ChecksumError, match=entry.name):
            TransformDriven(c).read(bytes(bad), outs[0])
