"""Stores encoded in worker processes (issue 24, target 2): the serving process copies the KV into
shared memory and a spawned worker, below the engine's priority, encodes and writes the same bytes
a foreground put writes; the storer falls back to its threads where processes cannot be used or
fail to start. Real processes, real x265, real file:// stores; the one injected fault (a codec
that cannot be built in a worker) is a real exception raised in the worker."""

from __future__ import annotations

import dataclasses
import functools
import os
import sys
import threading
from multiprocessing import shared_memory
from pathlib import Path

import pytest
import torch

from kvcodec import CodecConfig
from kvcodec.codecs.hevc.codec import HevcCodec
from kvcodec.codecs.raw import RawCodec
from kvcodec.engine import encode_pool
from kvcodec.engine.encode_pool import BufferPool, portable_codec, split_workers
from kvcodec.engine.storer import KVStorer, StorePolicy, default_store_workers
from kvcodec.errors import ConfigError, ShapeError
from kvcodec.fetcher import PrefixCache
from kvcodec.fetcher.keys import blob_key, meta_key
from kvcodec.layout.search import encode_workers, usable_cores
from kvcodec.store import open_store

CONFIG = CodecConfig(quant="int8", chunk_tokens=16, resolutions=((144, 144),), video_bits=8)


def kv_of(tokens: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(2, 2, tokens, 2, 32, generator=g).half()


def layers_of(kv: torch.Tensor) -> list:
    """The (k, v) per layer of a transformers cache ([1, heads, tokens, dim]) holding `kv`."""
    return [(kv[i, 0].permute(1, 0, 2)[None], kv[i, 1].permute(1, 0, 2)[None]) for i in range(kv.shape[0])]


def stored_bytes(cache: PrefixCache, ids: list[int]) -> list[bytes]:
    keys = cache.keys(ids)
    return [cache.store.get(meta_key(k)) for k in keys] + [cache.store.get(blob_key(k, 0)) for k in keys]


def file_cache(tmp_path, codec, name: str = "store") -> tuple[str, PrefixCache]:
    url = f"file://{tmp_path / name}"
    return url, PrefixCache(open_store(url), "m", codec, "cpu")


def test_a_store_is_encoded_in_a_worker_process_below_the_engine_with_the_same_bytes(tmp_path):
    ids, kv = list(range(48)), kv_of(48)
    fore = PrefixCache(open_store("memory://"), "m", HevcCodec(CONFIG), "cpu")
    assert fore.put(ids, kv) == 3
    url, cache = file_cache(tmp_path, HevcCodec(CONFIG))
    storer = KVStorer(cache, StorePolicy(encode_workers=2, nice=5), CONFIG.chunk_tokens, store_url=url)
    try:
        assert storer.encode_in == "processes" and storer.processes.spec.threads == 2
        stored = storer.submit(ids, layers_of(kv))
        storer.flush()  # the store, and the start of every worker the first store spawned
        assert stored.done() and stored.result() == 3
        assert len(storer._started) == storer.processes.processes and all(f.done() for f in storer._started)
        pids = {f.result() for f in storer._started}
        assert storer.encoder_pids and storer.encoder_pids <= pids and os.getpid() not in pids
        if sys.platform.startswith("linux"):
            base = os.getpriority(os.PRIO_PROCESS, os.getpid())
            assert {os.getpriority(os.PRIO_PROCESS, p) for p in pids} == {min(19, base + 5)}
            # the storer's hand-off threads (copy, send, wait) stay at the engine's priority
            handoff = [t for t in threading.enumerate() if t.name.startswith("kvcodec-store_")]
            assert handoff and {os.getpriority(os.PRIO_PROCESS, t.native_id) for t in handoff} == {base}
        assert storer.stored_prefixes == 1 and storer.encode_in == "processes"
        bad = kv_of(16, 3)
        bad[0, 0, 5] = float("nan")  # int8 cannot code it: the worker's encode refuses it
        with pytest.raises(ShapeError, match="NaN"):
            storer.submit(list(range(500, 516)), layers_of(bad)).result(timeout=120)
        assert storer.encode_in == "processes"  # one store failed; the workers go on
    finally:
        storer.shutdown()
    assert stored_bytes(cache, ids) == stored_bytes(fore, ids) and all(stored_bytes(fore, ids))


@pytest.mark.parametrize("name", ["transform", "transform-ans"])
def test_a_transform_coded_store_crosses_to_a_worker_and_writes_the_same_bytes(tmp_path, name):
    from kvcodec.codecs.transform.codec import TransformCodec
    from kvcodec.codecs.transform_ans.codec import TransformAnsCodec
    from kvcodec.transform import calibrate

    cls = {"transform": TransformCodec, "transform-ans": TransformAnsCodec}[name]
    cal = calibrate([kv_of(256, 1), kv_of(256, 2)], None, info={"model": "test"})
    codec = cls(cal, kvt_hash="ab" * 32, chunk_tokens=16, **({"lanes": 8} if name == "transform-ans" else {}))
    ids, kv = list(range(48)), kv_of(48)
    fore = PrefixCache(open_store("memory://"), "m", codec, "cpu")
    assert fore.put(ids, kv) == 3
    url, cache = file_cache(tmp_path, codec)
    storer = KVStorer(cache, StorePolicy(encode_workers=1), 16, store_url=url)
    try:
        assert storer.encode_in == "processes"
        assert storer.submit(ids, layers_of(kv)).result(timeout=300) == 3
        assert storer.encoder_pids and os.getpid() not in storer.encoder_pids
    finally:
        storer.shutdown()
    assert stored_bytes(cache, ids) == stored_bytes(fore, ids) and all(stored_bytes(fore, ids))


@dataclasses.dataclass(frozen=True)
class ParentOnlyRaw(RawCodec):
    """A raw codec whose worker-side factory fails in any process but the test's."""


def _built_in(pid: int, codec: RawCodec) -> RawCodec:
    if os.getpid() != pid:
        raise RuntimeError("this codec cannot be built in a worker process")
    return codec


def test_processes_that_cannot_start_leave_the_store_to_the_storers_threads(tmp_path, monkeypatch):
    name = f"{ParentOnlyRaw.__module__}.{ParentOnlyRaw.__qualname__}"
    monkeypatch.setitem(encode_pool.PORTABLE_CODECS, name, lambda c: functools.partial(_built_in, os.getpid(), c))
    url, cache = file_cache(tmp_path, ParentOnlyRaw(chunk_tokens=4))
    storer = KVStorer(cache, StorePolicy(encode_workers=1), 4, store_url=url)
    try:
        assert storer.encode_in == "processes"
        ids = list(range(12))
        assert storer.submit(ids, layers_of(kv_of(12))).result(timeout=300) == 3  # written on a thread
        assert storer.encode_in == "threads" and not storer.encoder_pids
        assert cache.lookup(ids) == 12 and storer.stored_prefixes == 1
        assert storer.submit(list(range(100, 108)), layers_of(kv_of(8, 1))).result(timeout=60) == 2
    finally:
        storer.shutdown()


def test_a_store_down_when_the_workers_start_fails_those_stores_and_the_workers_stay(tmp_path):
    """A real redis-server, stopped after the engine opened its store and before the encode
    workers started: each store fails with the store's error (not a broken pool), and once the
    server is back on its port the same workers store."""
    from kvbench.net.redis_server import RedisServer
    from kvcodec.errors import StoreError

    srv = RedisServer(tmp_path / "redis", appendonly=True).start()
    try:
        cache = PrefixCache(open_store(srv.url), "m", RawCodec(chunk_tokens=4), "cpu")
        srv.stop()
        storer = KVStorer(cache, StorePolicy(encode_workers=1), 4, store_url=srv.url)
        try:
            for n in range(2):  # the second store asks the same worker to open the store again
                with pytest.raises(StoreError):
                    storer.submit(list(range(10 * n, 10 * n + 8)), layers_of(kv_of(8, n))).result(timeout=300)
                assert storer.encode_in == "processes"
            assert not storer.processes._decided.is_set()  # the coding decisions wait for a store that runs
            srv = RedisServer(tmp_path / "redis", port=srv.port, appendonly=True).start()
            ids = list(range(100, 112))
            assert storer.submit(ids, layers_of(kv_of(12))).result(timeout=300) == 3
            assert storer.encode_in == "processes" and len(storer.encoder_pids) == 1
            assert storer.processes._decided.is_set()
            assert os.getpid() not in storer.encoder_pids and cache.lookup(ids) == 12
        finally:
            storer.shutdown()
    finally:
        srv.kill()


def test_stores_stay_on_threads_where_processes_cannot_be_used(tmp_path):
    kv = kv_of(8)
    memory = PrefixCache(open_store("memory://"), "m", RawCodec(chunk_tokens=4), "cpu")
    url, on_disk = file_cache(tmp_path, RawCodec(chunk_tokens=4))

    @dataclasses.dataclass(frozen=True)
    class Local(RawCodec):  # a class no other process can import
        pass

    _, local = file_cache(tmp_path, Local(chunk_tokens=4), "local")
    cases = [
        (memory, "memory://", StorePolicy()),  # another process cannot see it
        (on_disk, None, StorePolicy()),  # no URL to open it by
        (on_disk, url, StorePolicy(encode_in="threads")),  # asked for
        (local, f"file://{tmp_path / 'local'}", StorePolicy()),  # the codec cannot cross
    ]
    for cache, store_url, policy in cases:
        storer = KVStorer(cache, policy, 4, store_url=store_url)
        try:
            assert storer.encode_in == "threads" and storer.processes is None
            assert storer.submit(list(range(8)), layers_of(kv)).result(timeout=60) in (0, 2)
        finally:
            storer.shutdown()
    assert portable_codec(Local(chunk_tokens=4)) is None and portable_codec(HevcCodec(CONFIG)) is not None


def test_workers_split_into_processes_whose_threads_take_a_stores_chunks_in_whole_rounds(monkeypatch):
    # 8 chunks a store: 3 x 4 stores 1.5 per chunk time, where 2 x 7 (14 threads) stored 1
    assert split_workers(12) == (3, 4) and split_workers(14) == (7, 2) and split_workers(16) == (2, 8)
    assert split_workers(16, chunks=4) == (4, 4) and split_workers(12, chunks=16) == (3, 4)
    assert split_workers(1) == (1, 1) and split_workers(3) == (1, 3)  # at least 2 threads a process
    assert split_workers(64) == (8, 8)  # at most MAX_PROCESSES
    assert split_workers(16, 4) == (4, 4) and split_workers(3, 8) == (3, 1)  # processes given
    for workers in range(1, 40):
        for chunks in (1, 3, 8, 16):
            procs, threads = split_workers(workers, chunks=chunks)
            assert 1 <= procs * threads <= workers and procs <= 8
    monkeypatch.delenv("KVCODEC_ENCODE_WORKERS", raising=False)
    assert encode_workers() == usable_cores() == len(os.sched_getaffinity(0))
    assert default_store_workers() == max(1, usable_cores() - max(1, usable_cores() // 4))


@pytest.mark.parametrize("field, bad", [("encode_in", "gpu"), ("encode_processes", 0), ("encode_processes", 1.5)])
def test_store_policy_process_fields_are_validated(field, bad):
    with pytest.raises(ConfigError):
        StorePolicy(**{field: bad})


def test_shared_buffers_are_reused_grown_within_the_limit_and_unlinked():
    pool = BufferPool(limit=1)
    first = pool.acquire(100)
    assert first.nbytes == encode_pool.BUFFER_ALIGN
    pool.release(first)
    assert pool.acquire(200) is first  # fits: reused
    pool.release(first)
    bigger = pool.acquire(encode_pool.BUFFER_ALIGN + 1)  # too small: replaced (the limit is 1)
    assert bigger is not first and bigger.nbytes == 2 * encode_pool.BUFFER_ALIGN
    with pytest.raises(FileNotFoundError):
        shared_memory.SharedMemory(name=first.name)
    view = bigger.view((4, 8), torch.float16)
    view.copy_(torch.arange(32, dtype=torch.float16).view(4, 8))
    other = shared_memory.SharedMemory(name=bigger.name)  # what a worker sees
    seen = torch.frombuffer(other.buf, dtype=torch.float16, count=32).view(4, 8).clone()
    other.close()
    assert torch.equal(seen, view)
    del view
    pool.release(bigger)
    pool.close()
    with pytest.raises(FileNotFoundError):
        shared_memory.SharedMemory(name=bigger.name)
    ready = BufferPool(limit=3)
    held = ready.acquire(10)
    assert ready.reserve(encode_pool.BUFFER_ALIGN + 1) == 2 and ready.reserve(10) == 0  # up to the limit
    made = [ready.acquire(encode_pool.BUFFER_ALIGN + 1) for _ in range(2)]  # the reserved ones: none made
    assert all(b.nbytes == 2 * encode_pool.BUFFER_ALIGN for b in made) and ready._count == 3
    for b in [held, *made]:
        ready.release(b)
    ready.close()
    late = BufferPool(limit=2)
    in_use = late.acquire(10)
    late.close()  # while a store holds a buffer: freed when it comes back
    late.release(in_use)
    with pytest.raises(FileNotFoundError):
        shared_memory.SharedMemory(name=in_use.name)


def test_serve_store_encode_options_reach_the_store_policy(monkeypatch):
    from click.testing import CliRunner

    import kvcodec.engine
    import kvcodec.server
    from kvcodec.cli.main import cli

    seen = []
    monkeypatch.setattr(kvcodec.engine, "Engine", lambda model, **kw: seen.append(kw["store_policy"]) or object())
    monkeypatch.setattr(kvcodec.server, "serve", lambda *a, **k: None)
    base = ["serve", "--store", "memory://", "--device", "cpu"]
    runner = CliRunner()
    assert runner.invoke(cli, base).exit_code == 0
    assert seen[-1].encode_in == "processes" and seen[-1].encode_processes is None  # the default
    extra = ["--store-encode-in", "threads", "--store-encode-workers", "3", "--store-encode-processes", "2"]
    assert runner.invoke(cli, [*base, *extra]).exit_code == 0
    assert (seen[-1].encode_in, seen[-1].encode_workers, seen[-1].encode_processes) == ("threads", 3, 2)
    assert runner.invoke(cli, [*base, "--store-encode-in", "gpu"]).exit_code == 2


def test_the_engine_stores_through_worker_processes_by_default_and_says_so_in_metrics(smollm2, tmp_path):
    from kvcodec.engine import Engine

    model, tok = smollm2
    codec = HevcCodec(CodecConfig(quant="int8", chunk_tokens=16, video_bits=8))
    with Engine(model, tokenizer=tok, store_url=f"file://{tmp_path}", device="cpu", codec=codec) as eng:
        text = "The miller kept a canoe tied to a post by the river, and a lamp in the mill's window. " * 2
        eng.generate(text, max_new_tokens=1, wait_for_store=True)
        metrics = eng.metrics.render().decode()
        assert eng.storer.encode_in == "processes" and eng.storer.encoder_pids
        ids = eng.encode(text)
        assert eng.prefix_cache.lookup(ids) == len(ids)  # every chunk, the partial last one too
    assert "kvcodec_store_encode_processes 1.0" in metrics and "kvcodec_stored_prefixes_total 1.0" in metrics
    assert "kvcodec_store_errors_total 0.0" in metrics


WORKER_HOST = """
import sys
from kvcodec.codecs.raw import RawCodec
from kvcodec.engine.storer import KVStorer, StorePolicy
from kvcodec.fetcher import PrefixCache
from kvcodec.store import open_store
import torch
url = sys.argv[1]
cache = PrefixCache(open_store(url), "m", RawCodec(chunk_tokens=4), "cpu")
storer = KVStorer(cache, StorePolicy(encode_workers=1), 4, store_url=url)
kv = torch.zeros(1, 1, 8, 2)
assert storer.submit(list(range(8)), [(kv, kv)]).result(timeout=300) == 2
print(*storer.encoder_pids, flush=True)
sys.stdin.read()  # until killed
"""


def test_encode_workers_end_when_the_serving_process_is_killed(tmp_path):
    import subprocess

    cmd = [sys.executable, "-c", WORKER_HOST, f"file://{tmp_path}"]
    proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        worker = int(proc.stdout.readline())
        assert worker != proc.pid
    finally:
        proc.kill()
    # the worker inherited the killed process's stdout: the pipe ends only when the worker has ended too
    out, _ = proc.communicate(timeout=120)
    assert out == ""


def _ignored_signals(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("SigIgn:"):
            return int(line.split()[1], 16)
    raise AssertionError(f"no SigIgn line for {pid}")


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="reads signal dispositions from /proc")
def test_encode_workers_leave_a_ctrl_c_to_their_parent(tmp_path):
    """A Ctrl-C reaches every process of the terminal's group: the workers ignore it (the parent
    finishes the stores in flight and shuts them down), so they neither die mid-store nor print
    KeyboardInterrupt tracebacks, and the pool keeps encoding."""
    import signal

    from kvcodec.engine.encode_pool import EncodePool, interrupts_blocked, worker_spec

    with interrupts_blocked():
        assert signal.SIGINT in signal.pthread_sigmask(signal.SIG_BLOCK, [])
    assert signal.SIGINT not in signal.pthread_sigmask(signal.SIG_BLOCK, [])
    url = f"file://{tmp_path}"
    cache = PrefixCache(open_store(url), "m", RawCodec(chunk_tokens=4), "cpu")
    pool = EncodePool(worker_spec(cache, url, 1, 0), 2)
    try:
        pids = sorted(f.result(timeout=300) for f in pool.start())
        for pid in pids:
            assert _ignored_signals(pid) & (1 << (signal.SIGINT - 1)), "SIGINT not ignored by a worker"
            os.kill(pid, signal.SIGINT)
        written, pid = pool.put(list(range(8)), torch.ones(1, 2, 8, 1, 2))
        assert written == 2 and pid in pids and sorted(pool.pids()) == pids
    finally:
        pool.shutdown()
