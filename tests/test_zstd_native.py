"""The native zstd threads (codecs/zstd_native.py) against their reference, zstd_streams.unzstd_into
on Python threads: the same bytes for every stream the reference reads, a refusal (CorruptStreamError
naming the stream) wherever the reference refuses, many streams at once, Futures that cannot be
cancelled while the threads write, and the transform codec's driven host work the same both ways.
No timing: every wait is on a Future."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from concurrent.futures import Future

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcodec.codecs import zstd_native
from kvcodec.codecs import zstd_streams as zs
from kvcodec.container.format import crc32
from kvcodec.errors import ChecksumError, CorruptStreamError

DATA = st.binary(max_size=6000) | st.builds(lambda n, b: bytes([b]) * n, st.integers(0, 9000), st.integers(0, 255))
FRAME_BYTES = st.integers(1, 3000)


@pytest.fixture(scope="module")
def pool():
    threads = zstd_native.start(3)
    if threads is None:
        pytest.skip("no C compiler or no libzstd here: the Python threads serve (the reference)")
    yield threads
    threads.stop()


def _noisy(n: int, seed: int = 0) -> bytes:
    rng = np.random.default_rng(seed)
    return rng.normal(128, 12, n).clip(0, 255).astype(np.uint8).tobytes()


def _reference(stream: bytes, size: int) -> bytes | None:
    """What a Python host thread gets (transform.decode.host_samples): the bytes, or None where it refuses."""
    out = np.zeros(size, dtype=np.uint8)
    try:
        got = zs.unzstd_into(stream, out, "samples")
    except CorruptStreamError:
        return None
    return out.tobytes() if got == size else None


def _native(pool, stream: bytes, size: int) -> bytes | None:
    out = np.zeros(size, dtype=np.uint8)
    try:
        pool.submit(stream, out, "samples").result(timeout=60)
    except CorruptStreamError as e:
        assert "'samples'" in str(e)
        return None
    return out.tobytes()


def _same(pool, stream: bytes, size: int) -> None:
    assert _native(pool, stream, size) == _reference(stream, size)


def _frames_4_and_5_bad(stream: bytes) -> bytes:
    """`stream` with a seek table whose entries say frame 4 holds a byte more than it does, frame 5 one less."""
    table = zs.read_seek_table(stream, "s")
    entries = list(table.frames)
    (c4, d4), (c5, d5) = entries[4], entries[5]
    entries[4], entries[5] = (c4, d4 + 1), (c5, d5 - 1)
    return stream[: table.compressed] + zs.seek_table_bytes(zs.SeekTable(tuple(entries)))


def _pool_library() -> tuple:
    """(the native threads' C library, libzstd), for a test's own ZstdThreads; a skip without them."""
    import ctypes

    lib_path = zstd_native.native.build("zstd_pool", zstd_native.SOURCE) if zstd_native.native.ENABLED else None
    zstd = zstd_native.system_zstd()
    if lib_path is None or zstd is None:
        pytest.skip("no native zstd threads here")
    return zstd_native.native.declare(ctypes.CDLL(str(lib_path)), zstd_native.SIGNATURES), zstd


class _HeldCrc:
    """Native threads whose CRC-32 (zlib's) holds the first stream it checks until released: the
    threads' states made certain without waiting on the clock."""

    def __init__(self, count: int):
        import ctypes
        import threading
        import zlib

        self.lib, zstd = _pool_library()
        self.entered, self.release, self.stopping = threading.Event(), threading.Event(), threading.Event()

        @ctypes.CFUNCTYPE(ctypes.c_ulong, ctypes.c_ulong, ctypes.c_void_p, ctypes.c_uint)
        def held_crc(crc, at, size):
            if not at:
                return 0
            if not self.entered.is_set():
                self.entered.set()
                self.release.wait(60)
            return zlib.crc32(ctypes.string_at(at, size), crc)

        self._crc = held_crc
        self.threads = zstd_native.ZstdThreads(self.lib, zstd, (held_crc, False), count)
        self.threads.lib = self  # stop() through kv_zpool_stop below, the rest through __getattr__

    def __getattr__(self, name):  # noqa: ANN204
        return getattr(self.lib, name)

    def kv_zpool_stop(self, handle):  # noqa: ANN001, ANN202
        self.stopping.set()
        return self.lib.kv_zpool_stop(handle)

    def hold(self, data: bytes) -> Future:
        """A stream submitted with its checksum, its thread held in the CRC (once this returns)."""
        stream = zs.zstd_frames(data, 1)
        future = self.threads.submit(stream, np.zeros(len(data), dtype=np.uint8), "s", checksum=(crc32(stream), None))
        assert self.entered.wait(60)
        return future


@given(DATA, FRAME_BYTES)
@settings(max_examples=60, deadline=None)
def test_frames_decompress_to_the_bytes_the_reference_reads(pool, data, frame_bytes):
    stream = zs.zstd_frames(data, 1, frame_bytes)
    assert _native(pool, stream, len(data)) == data == _reference(stream, len(data))


@given(DATA, st.integers(1, 19))
@settings(max_examples=30, deadline=None)
def test_a_stream_of_one_frame_reads_and_is_refused_as_the_reference_reads_and_refuses_it(pool, data, level):
    import zstandard

    stream = zstandard.ZstdCompressor(level=level).compress(data)
    assert _native(pool, stream, len(data)) == data
    for size in (len(data) + 3, len(data) - 1):  # a frame that holds fewer or more bytes than the buffer
        if size >= 0:
            assert _native(pool, stream, size) is None is _reference(stream, size)


@given(DATA, FRAME_BYTES, st.sampled_from([-5, -1, 1, 7]))
@settings(max_examples=40, deadline=None)
def test_a_buffer_of_another_size_is_refused_as_the_reference_refuses_it(pool, data, frame_bytes, delta):
    stream = zs.zstd_frames(data, 1, frame_bytes)
    size = len(data) + delta
    if size < 0:
        return
    assert _native(pool, stream, size) is None
    _same(pool, stream, size)


@given(DATA.filter(len), FRAME_BYTES, st.data())
@settings(max_examples=60, deadline=None)
def test_every_truncation_is_refused_as_the_reference_refuses_it(pool, data, frame_bytes, draw):
    stream = zs.zstd_frames(data, 1, frame_bytes)
    k = draw.draw(st.integers(0, len(stream) - 1))
    _same(pool, stream[:k], len(data))


@given(DATA.filter(len), FRAME_BYTES, st.data())
@settings(max_examples=60, deadline=None)
def test_a_damaged_seek_table_reads_as_the_reference_reads_it(pool, data, frame_bytes, draw):
    stream = bytearray(zs.zstd_frames(data, 1, frame_bytes))
    table = zs.read_seek_table(stream, "s")
    at = draw.draw(st.integers(len(stream) - table.size, len(stream) - 1))
    stream[at] ^= draw.draw(st.integers(1, 255))
    _same(pool, bytes(stream), len(data))


def test_frames_moved_between_entries_and_a_damaged_frame_are_refused(pool):
    data = _noisy(5000)
    stream = zs.zstd_frames(data, 1, 1000)
    table = zs.read_seek_table(stream, "s")
    (c0, d0), (c1, d1), *rest = table.frames
    forged = stream[: table.compressed] + zs.seek_table_bytes(zs.SeekTable(((c0 + 1, d0), (c1 - 1, d1), *rest)))
    assert _native(pool, forged, len(data)) is None is _reference(forged, len(data))
    damaged = bytearray(stream)
    damaged[c0 : c0 + 4] = b"\0\0\0\0"  # the second frame's magic
    assert _native(pool, bytes(damaged), len(data)) is None


def _error_of(read) -> str:  # noqa: ANN001
    with pytest.raises(CorruptStreamError) as e:
        read()
    return str(e.value)


def test_of_two_bad_frames_read_at_once_the_first_is_named_as_the_reference_names_it(pool):
    data = _noisy(40 * 500, seed=3)
    stream = zs.zstd_frames(data, 1, 500)
    forged = _frames_4_and_5_bad(stream)
    reference = _error_of(lambda: zs.unzstd_into(forged, np.zeros(len(data), dtype=np.uint8), "samples"))
    assert "frame 4 " in reference
    for _ in range(50):  # where frames 4 and 5 fail on two threads at once, in either order: frame 4 is named
        out = np.zeros(len(data), dtype=np.uint8)
        assert _error_of(lambda out=out: pool.submit(forged, out, "samples").result(timeout=60)) == reference
    whole = [np.zeros(len(data), dtype=np.uint8) for _ in range(6)]
    futures = [pool.submit(stream, out, "samples") for out in whole]
    for f in futures:
        f.result(timeout=60)
    assert all(out.tobytes() == data for out in whole)


@pytest.mark.parametrize("count", [1, 2])
def test_streams_queued_behind_a_held_one_read_as_the_reference_reads_each_of_them(count):
    """Streams queued while one thread is held in a CRC: each thread reads a stream of its own in order,
    and a thread with none may help another's. Sound, damaged and truncated streams each fill their
    buffer or are refused with the reference's words."""
    held = _HeldCrc(count)
    pool = held.threads
    try:
        first = held.hold(_noisy(1000))
        data = _noisy(40 * 500, seed=5)
        stream = zs.zstd_frames(data, 1, 500)
        forged = _frames_4_and_5_bad(stream)
        damaged = bytearray(stream)
        damaged[zs.read_seek_table(stream, "s").frames[7][0] // 2] ^= (
            0xFF  # a byte inside frame 0 or 1's compressed bytes
        )
        streams = [stream, forged, bytes(damaged), stream[:-1]] * 6
        outs = [np.zeros(len(data), dtype=np.uint8) for _ in streams]
        futures = [pool.submit(s, out, "samples") for s, out in zip(streams, outs)]
    finally:
        held.release.set()
    try:
        for s, out, future in zip(streams, outs, futures):
            try:
                future.result(timeout=60)
                got = out.tobytes()
            except CorruptStreamError:
                got = None
            assert got == _reference(s, len(data))
        named = _error_of(lambda: zs.unzstd_into(forged, np.zeros(len(data), dtype=np.uint8), "samples"))
        assert "frame 4 " in named
        assert all(_error_of(lambda f=f: f.result(timeout=60)) == named for f in futures[1::4])
        assert first.result(timeout=60) is None
    finally:
        pool.stop()


def test_of_two_bad_frames_the_first_is_named_when_the_second_fails_first_on_another_thread():
    """Two threads on one stream whose frames 4 and 5 are bad: the thread that takes frame 4 is held
    (its zstd call waits) until frame 5 has failed on the other thread; frame 4 is still the one named,
    as the Python reference names it."""
    import ctypes
    import threading

    lib, zstd = _pool_library()
    crc = zstd_native._crc32()
    if crc is None:
        pytest.skip("no CRC-32 of ISA-L or zlib here")
    data = _noisy(40 * 500, seed=3)
    forged = _frames_4_and_5_bad(zs.zstd_frames(data, 1, 500))
    out = np.zeros(len(data), dtype=np.uint8)
    frame4, frame5 = out.ctypes.data + 4 * 500, out.ctypes.data + 4 * 500 + 501  # frame 4's entry says 501 bytes
    fifth_failed = threading.Event()
    real = zstd.ZSTD_decompressDCtx

    @ctypes.CFUNCTYPE(
        ctypes.c_size_t, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p, ctypes.c_size_t
    )
    def decompress(dctx, dst, dst_len, src, src_len):
        if dst == frame4:
            fifth_failed.wait(60)
        got = real(dctx, dst, dst_len, src, src_len)
        if dst == frame5:
            fifth_failed.set()
        return got

    class _Zstd:  # libzstd, its decompression held as above
        ZSTD_decompressDCtx = decompress

        def __getattr__(self, name):  # noqa: ANN204
            return getattr(zstd, name)

    threads = zstd_native.ZstdThreads(lib, _Zstd(), crc, 2)
    try:
        reference = _error_of(lambda: zs.unzstd_into(forged, np.zeros(len(data), dtype=np.uint8), "samples"))
        assert "frame 4 " in reference
        assert _error_of(lambda: threads.submit(forged, out, "samples").result(timeout=60)) == reference
        assert fifth_failed.is_set()
    finally:
        fifth_failed.set()
        threads.stop()


@pytest.mark.parametrize("with_checksum", [False, True])
def test_a_stream_of_no_frames_fills_an_empty_buffer_as_the_reference_reads_it(pool, with_checksum):
    empty_table = zs.seek_table_bytes(zs.SeekTable(()))
    skippable = zs.SKIPPABLE_MAGIC.to_bytes(4, "little") + (3).to_bytes(4, "little") + b"abc"
    only_skippable = skippable + zs.seek_table_bytes(zs.SeekTable(((len(skippable), 0),)))
    for stream in (empty_table, only_skippable):
        assert _reference(stream, 0) == b""
        for crc in (crc32(stream), crc32(stream) ^ 1) if with_checksum else (None,):
            checksum = None if crc is None else (crc, lambda: ChecksumError("bad"))
            future = pool.submit(stream, np.zeros(0, dtype=np.uint8), "samples", checksum=checksum)
            if crc is None or crc == crc32(stream):
                assert future.result(timeout=60) is None
            else:
                with pytest.raises(ChecksumError):
                    future.result(timeout=60)


def test_many_streams_at_once_each_fill_their_own_buffer(pool):
    datas = [_noisy(1000 + 997 * k, seed=k) for k in range(40)]
    outs = [np.zeros(len(d), dtype=np.uint8) for d in datas]
    futures = [
        pool.submit(zs.zstd_frames(d, 1, 1 + 300 * (k % 4)), out, "samples", lambda k=k: k)
        for k, (d, out) in enumerate(zip(datas, outs))
    ]
    assert [f.result(timeout=60) for f in futures] == list(range(40))
    assert all(out.tobytes() == d for out, d in zip(outs, datas))


def test_an_output_the_threads_cannot_write_straight_into_is_refused(pool):
    stream = zs.zstd_frames(_noisy(1000), 1)
    strided, wide, read_only = (
        np.zeros(2000, np.uint8)[::2],
        np.zeros(500, np.uint16),
        np.frombuffer(bytes(1000), np.uint8),
    )
    for out in (strided, wide, read_only):
        with pytest.raises(ValueError, match="contiguous uint8"):
            pool.submit(stream, out, "samples")


def test_a_submitted_stream_cannot_be_cancelled_and_then_failing_is_its_error(pool):
    data = _noisy(50_000)
    out = np.zeros(len(data), dtype=np.uint8)
    future = pool.submit(zs.zstd_frames(data, 1), out, "samples")
    assert not future.cancel()  # the threads may be writing into `out`
    future.result(timeout=60)

    def then():
        raise ValueError("then failed")

    with pytest.raises(ValueError, match="then failed"):
        pool.submit(zs.zstd_frames(data, 1), out, "samples", then).result(timeout=60)


def test_a_stream_whose_checksum_fails_is_not_decompressed_and_gets_the_callers_error(pool):
    from kvcodec.container.format import crc32

    data = _noisy(30_000)
    stream = zs.zstd_frames(data, 1, 7000)
    out = np.zeros(len(data), dtype=np.uint8)
    pool.submit(stream, out, "samples", checksum=(crc32(stream), lambda: ChecksumError("never"))).result(timeout=60)
    assert out.tobytes() == data
    out[:] = 0
    wrong = (crc32(stream) ^ 1, lambda: ChecksumError("stream 'samples' fails its checksum"))
    with pytest.raises(ChecksumError, match="fails its checksum"):
        pool.submit(stream, out, "samples", checksum=wrong).result(timeout=60)
    assert not out.any()  # nothing decompressed


@pytest.mark.parametrize("crc", ["isal", "zlib"])
def test_both_crc_functions_agree_with_the_containers_checksum(monkeypatch, crc):
    """ISA-L's crc32_gzip_refl (the default) and zlib's crc32 (without the isal package) agree with
    the container's checksum."""
    from kvcodec.container.format import crc32

    if crc == "zlib":
        zlib = zstd_native._system_library("z", ("libz.so.1",), zstd_native.ZLIB_SIGNATURES)
        if zlib is None:
            pytest.skip("no zlib library here")
        monkeypatch.setattr(zstd_native, "_crc32", lambda: (zlib.crc32, False))
    threads = zstd_native.start(2)
    if threads is None:
        pytest.skip("no native zstd threads here")
    assert threads.crc[1] == (crc == "isal")
    data = _noisy(300_000)
    stream = zs.zstd_frames(data, 1)
    try:
        out = np.zeros(len(data), dtype=np.uint8)
        threads.submit(stream, out, "s", checksum=(crc32(stream), lambda: ChecksumError("no"))).result(60)
        assert out.tobytes() == data
        with pytest.raises(ChecksumError):
            threads.submit(stream, out, "s", checksum=(crc32(stream) ^ 4, lambda: ChecksumError("bad"))).result(60)
    finally:
        threads.stop()


def test_damage_that_breaks_the_frames_is_the_checksums_error_as_on_the_python_path(pool):
    from kvcodec.container.format import crc32

    data = _noisy(30_000)
    stream = zs.zstd_frames(data, 1, 7000)
    checksum = (crc32(stream), lambda: ChecksumError("stream 'samples' fails its checksum"))
    for at in (-3, -10, 2):  # the seek table's footer and an entry, a frame's magic
        damaged = bytearray(stream)
        damaged[at] ^= 0x5A
        with pytest.raises(ChecksumError):
            pool.submit(bytes(damaged), np.zeros(len(data), dtype=np.uint8), "samples", checksum=checksum).result(60)
    with pytest.raises(CorruptStreamError):  # without a checksum: the stream's own error
        pool.submit(bytes(damaged), np.zeros(len(data), dtype=np.uint8), "samples").result(60)


def test_a_forked_child_starts_its_own_threads_and_exits():
    """The parent's threads are not the child's: the child decompresses on threads of its own and
    exits without waiting for the parent's (it hung in the exit handler before)."""
    script = textwrap.dedent(
        """
        import os, sys
        import numpy as np
        from kvcodec.codecs import zstd_native, zstd_streams

        def roundtrip():
            data = bytes(range(256)) * 64
            out = np.zeros(len(data), dtype=np.uint8)
            zstd_native.threads(lambda: 2).submit(zstd_streams.zstd_frames(data, 1), out, "s").result(60)
            assert out.tobytes() == data

        if zstd_native.threads(lambda: 2) is None:
            print("none"); sys.exit(0)
        roundtrip()
        pid = os.fork()
        if pid == 0:
            roundtrip()
            sys.exit(0)
        _, status = os.waitpid(pid, 0)
        print("child", os.waitstatus_to_exitcode(status))
        """
    )
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    if run.stdout.strip() == "none":
        pytest.skip("no native zstd threads here")
    assert run.stdout.strip() == "child 0"


def _own_threads() -> zstd_native.ZstdThreads:
    """Two native threads of the test's own (it stops them)."""
    threads = zstd_native.start(2)
    if threads is None:
        pytest.skip("no native zstd threads here")
    return threads


def test_a_stopped_pool_refuses_new_work_after_finishing_what_it_had():
    threads = _own_threads()
    data = _noisy(20_000)
    out = np.zeros(len(data), dtype=np.uint8)
    queued = [threads.submit(zs.zstd_frames(data, 1), out, "samples") for _ in range(8)]
    framed = zs.zstd_frames(data, 1, 700)
    outs = [np.zeros(len(data), dtype=np.uint8) for _ in range(8)]
    checked = [  # checksums checked first, every other one failing, their frames on both threads after
        threads.submit(framed, o, "samples", checksum=(crc32(framed) ^ (k % 2), lambda: ChecksumError("bad")))
        for k, o in enumerate(outs)
    ]
    threads.stop()
    threads._collector.join(60)  # stop() waits 5 s for it; a loaded machine gets longer here
    assert not threads._collector.is_alive()  # woken by the stop, not by a clock
    assert all(f.done() for f in queued + checked) and out.tobytes() == data  # drained before the threads ended
    assert [f.exception() is None for f in checked] == [True, False] * 4
    assert all(o.tobytes() == data for o in outs[::2]) and not any(o.any() for o in outs[1::2])
    with pytest.raises(RuntimeError, match="stopped"):
        threads.submit(zs.zstd_frames(data, 1), out, "samples")


def test_an_idle_pools_collecting_thread_ends_with_the_stop():
    """The thread that settles finished jobs waits for the next one without a clock; stop() wakes it."""
    threads = _own_threads()
    data = _noisy(5000)
    out = np.zeros(len(data), dtype=np.uint8)
    threads.submit(zs.zstd_frames(data, 1), out, "samples").result(timeout=60)
    threads.stop()
    threads._collector.join(60)  # stop() waits 5 s for it; a loaded machine gets longer here
    assert not threads._collector.is_alive()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="time.perf_counter reads CLOCK_MONOTONIC on Linux")
def test_each_job_keeps_when_a_thread_took_it_and_when_it_ended_on_the_perf_counter_clock(pool, monkeypatch):
    """The job's own span (what fetch_phases shows as Z.job) lies within its submit and its settling, in order."""
    import time

    spans = []
    settle = zstd_native._settle
    monkeypatch.setattr(
        zstd_native, "_settle", lambda p, z: spans.append((p.job.began_ns, p.job.ended_ns)) or settle(p, z)
    )
    data = _noisy(20000)
    for checksum in (False, True):
        stream = zs.zstd_frames(data, 1, 4096)
        check = (crc32(stream), None) if checksum else None
        t0 = time.perf_counter()
        pool.submit(stream, np.zeros(len(data), dtype=np.uint8), "s", checksum=check).result(timeout=60)
        t1 = time.perf_counter()
        began, ended = spans[-1]
        assert t0 <= began / 1e9 <= ended / 1e9 <= t1


def test_without_native_code_there_are_no_native_threads(monkeypatch):
    monkeypatch.setattr(zstd_native.native, "ENABLED", False)
    assert zstd_native.start(2) is None


def test_the_transform_codecs_host_work_is_the_same_natively_and_on_the_python_pool(synthetic_kvt, monkeypatch):
    """TransformDriven.submit_host (native threads) against prepare_host (the Python pool's work):
    the same samples; a corrupted samples stream is that chunk's ChecksumError either way; without
    native threads submit_host runs prepare_host on the pool."""
    from kvcodec.codecs.transform import codec as transform_codec
    from kvcodec.codecs.transform.batch import TransformDriven
    from kvcodec.codecs.transform.codec import TransformCodec

    if zstd_native.threads(lambda: 2) is None:
        pytest.skip("no native zstd threads here")
    from synthetic import synthetic_kv

    codec = TransformCodec(synthetic_kvt, chunk_tokens=64, target_ratio=4.0, coder="zstd")
    monkeypatch.setattr(transform_codec, "SAMPLES_FRAME_BYTES", 500)  # several frames a chunk: read in parallel
    kv = synthetic_kv(150, 7)
    driven = TransformDriven(codec)
    seen_sink = False
    for chunk in codec.encode_chunks(kv):
        target = torch.empty((*kv.shape[:2], chunk.tokens, *kv.shape[3:]), dtype=torch.float16)
        reading = driven.read(chunk.blobs[0], target)
        assert len(zs.read_seek_table(reading.state[1]["samples"], "s").frames) > 1
        native_state, pooled_state = (
            driven.submit_host(reading).result(timeout=60).state,
            driven.prepare_host(reading).state,
        )
        natively = native_state[3]
        assert torch.equal(natively, pooled_state[3])
        (idx, values), sink = native_state[4]
        (pooled_idx, pooled_values), pooled_sink = pooled_state[4]  # escapes and sink tokens, read ahead
        assert torch.equal(idx, pooled_idx) and torch.equal(values, pooled_values)
        assert (sink is None and pooled_sink is None) or torch.equal(sink, pooled_sink)
        seen_sink = seen_sink or sink is not None
        bad = bytearray(chunk.blobs[0])
        bad[-40] ^= 0xFF  # in the samples stream, the last of the chunk's streams
        with pytest.raises(ChecksumError, match="samples"):
            driven.submit_host(driven.read(bytes(bad), target)).result(timeout=60)
    assert seen_sink  # the first chunk keeps its first tokens exact
    monkeypatch.setattr(codec._restorer, "sample_count", lambda h: 1 / 0)
    failed = driven.submit_host(reading)  # the chunk's error, not raised on the fetch's thread
    with pytest.raises(ZeroDivisionError):
        failed.result(timeout=60)
    monkeypatch.undo()
    monkeypatch.setattr(zstd_native, "threads", lambda count: None)
    pooled = driven.submit_host(reading).result(timeout=60).state[3]
    assert torch.equal(pooled, natively)


def test_a_stop_while_a_checksum_is_being_checked_finishes_that_stream_then_ends_every_thread():
    """stop() called while one thread is inside a stream's CRC (held there) and the other waits for
    work, having finished the stream queued behind it: the checked stream is still decompressed, and
    its end wakes the waiting thread to end too. The CRC is released once stop() has entered the
    native code."""
    import threading

    held = _HeldCrc(2)
    data = _noisy(20_000)
    try:
        first = held.hold(data)
        other_out = np.zeros(len(data), dtype=np.uint8)
        # done once the other thread, under the pool's lock, found no more work and waits for some
        assert held.threads.submit(zs.zstd_frames(data, 1, 3000), other_out, "s").result(timeout=60) is None
        stopper = threading.Thread(target=held.threads.stop, daemon=True)  # a hung stop() fails the test
        stopper.start()
        assert held.stopping.wait(60)
    finally:
        held.release.set()
    stopper.join(60)
    assert not stopper.is_alive()  # both threads ended
    assert first.result(timeout=60) is None and other_out.tobytes() == data
