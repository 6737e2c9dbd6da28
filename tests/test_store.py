"""KVStore conformance for the embedded backends (file://, memory://) and the URL registry."""

from __future__ import annotations

import os
import threading
import time

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvcodec.errors import ConfigError, StoreError
from kvcodec.store import BaseStore, open_store, register_store, store_schemes


@pytest.fixture(params=["file", "memory"])
def store(request, tmp_path):
    url = f"file://{tmp_path / 'st'}" if request.param == "file" else "memory://"
    with open_store(url) as st:
        yield st


def conformance(st) -> None:
    """Behaviour every backend must have (shared with the Redis tests)."""
    assert st.get("a/b") is None
    assert st.size("a/b") is None
    st.put("a/b", b"hello world")
    assert st.get("a/b") == b"hello world"
    assert st.size("a/b") == 11
    st.put("a/b", b"replaced")  # overwrite
    assert st.get("a/b") == b"replaced"
    st.put_many({"a/c": b"", "z/1": bytes(range(256)) * 10})
    assert st.get("a/c") == b""
    assert st.exists_many(["a/b", "nope", "a/c", "z/1"]) == [True, False, True, True]
    assert st.size_many(["z/1", "nope", "a/c", "a/b"]) == [2560, None, 0, 8] and st.size_many([]) == []
    assert st.exists("z/1") and not st.exists("z/2")
    assert st.get_many(["z/1", "q", "a/b"]) == [bytes(range(256)) * 10, None, b"replaced"]
    assert st.get_range("z/1", 250, 260) == bytes(range(250, 256)) + bytes(range(4))
    assert st.get_range("a/b", 3, 100) == b"laced"
    assert b"".join(st.iter_get("z/1", piece_bytes=1000)) == bytes(range(256)) * 10
    with pytest.raises(StoreError):
        st.get_range("missing", 0, 4)
    with pytest.raises(StoreError):
        list(st.iter_get("missing"))
    assert sorted(st.list("a/")) == ["a/b", "a/c"]
    assert sorted(st.list()) == ["a/b", "a/c", "z/1"]
    assert st.delete("a/b") is True
    assert st.delete("a/b") is False
    assert st.get("a/b") is None
    st.put_many({"d/1": b"1", "d/2": b"2"})
    assert st.delete_many(["d/1", "d/2", "d/3"]) == 2
    assert st.exists_many(["d/1", "d/2"]) == [False, False]
    with pytest.raises(ConfigError):
        st.put("bad key with spaces", b"x")


def test_conformance(store):
    conformance(store)


def test_bare_path_means_file(tmp_path):
    with open_store(str(tmp_path / "s")) as st:
        st.put("k", b"v")
    with open_store(f"file://{tmp_path / 's'}") as st:
        assert st.get("k") == b"v"  # persisted on disk
    # a "#" or "?" in a bare path was URL syntax: "hp#1" and "hp#2" were one store, "hp"
    for i, name in enumerate(("hp#1", "hp#2", "q?x=1", "pct%41")):
        with open_store(str(tmp_path / name)) as st:
            assert st.get("k") is None
            st.put("k", bytes([i]))
        assert (tmp_path / name / "objects").is_dir()


def test_a_mistyped_url_is_refused_not_taken_for_a_folder(tmp_path, monkeypatch):
    """A bare path means a local folder: "file:/var/kv", "rediss//h" or "redis:6379" made one here and
    stored into it, a mistake seen only when no KV came back."""
    monkeypatch.chdir(tmp_path)
    for url in ("file:/var/kv", "rediss//cache:6380", "redis:6379", "memory:"):
        with pytest.raises(ConfigError, match="mistyped"):
            open_store(url)
    assert list(tmp_path.iterdir()) == []
    with open_store("./redis//h") as st, open_store("a:b/c") as other:  # written as folders, they are folders
        st.put("k", b"v") and other.put("k", b"v")
    assert (tmp_path / "redis" / "h").is_dir() and (tmp_path / "a:b" / "c").is_dir()


def test_memory_named_space_is_shared():
    a, b = open_store("memory://shared-space-test"), open_store("memory://shared-space-test")
    a.put("k", b"1")
    assert b.get("k") == b"1"
    assert open_store("memory://").get("k") is None


def test_unknown_scheme_and_registry():
    with pytest.raises(ConfigError, match="unknown store scheme"):
        open_store("nosuch://x")

    class Echo(BaseStore):
        def __init__(self, url):
            self.url = url

    register_store("echo-test", lambda url, **kw: Echo(url))
    assert "echo-test" in store_schemes()
    assert open_store("echo-test://h").url == "echo-test://h"


@pytest.mark.parametrize("url", ["redis://127.0.0.1:6379/abc", "redis://u:secret@127.0.0.1:6379/x1", "rediss://h/1a"])
def test_a_redis_database_that_is_no_number_is_refused_before_connecting(url):
    # redis-py read "/abc" as database 0: the store opened on another database than the one named
    with pytest.raises(ConfigError, match="the database is a number") as e:
        open_store(url)
    assert "secret" not in str(e.value)


def test_closed_memory_store_raises():
    st = open_store("memory://")
    st.close()
    with pytest.raises(StoreError):
        st.get("k")


def test_file_writes_are_atomic(tmp_path):
    """Readers racing a writer that replaces a 4 MiB object see one whole version or nothing."""
    st = open_store(f"file://{tmp_path}")
    versions = [bytes([i]) * (4 << 20) for i in range(4)]
    stop = threading.Event()
    bad: list[int] = []

    def writer():
        i = 0
        while not stop.is_set():
            st.put("obj", versions[i % 4])
            i += 1

    def reader():
        while not stop.is_set():
            v = st.get("obj")
            if v is not None and v not in versions:
                bad.append(len(v))

    ts = [threading.Thread(target=writer), threading.Thread(target=reader)]
    for t in ts:
        t.start()
    threading.Event().wait(1.0)
    stop.set()
    for t in ts:
        t.join()
    assert not bad
    assert os.listdir(tmp_path / "tmp") == []  # no temp file left behind


def test_file_store_objects_get_the_mode_a_plain_open_gives(tmp_path):
    """A store directory shared by users or hosts (a server reading what an ingest job wrote)
    needs its objects readable as any other file the user writes: not mkstemp's 0600."""
    (tmp_path / "plain").write_bytes(b"x")
    st = open_store(f"file://{tmp_path / 'store'}")
    st.put("obj", b"value")
    objects = [p for p in (tmp_path / "store" / "objects").rglob("*") if p.is_file()]
    assert len(objects) == 1
    assert objects[0].stat().st_mode & 0o777 == (tmp_path / "plain").stat().st_mode & 0o777


def test_file_store_fsync_option(tmp_path):
    st = open_store(f"file://{tmp_path}?fsync=1")
    assert st.fsync
    st.put("k", b"v")
    assert st.get("k") == b"v"


def test_file_store_error_carries_url(tmp_path):
    blocker = tmp_path / "notadir"
    blocker.write_text("x")
    with pytest.raises(StoreError) as ei:
        open_store(f"file://{blocker}/sub")
    assert "notadir" in str(ei.value) and ei.value.__cause__ is not None


# ---------------------------------------------------------------------------- capacity (file)


def _fill(st, keys, size=300):
    for k in keys:
        st.put(k, k.encode() * (size // len(k)))
        time.sleep(0.02)  # distinct mtimes even on coarse-clock filesystems


def test_file_store_evicts_least_recently_used_past_its_capacity(tmp_path):
    with open_store(f"file://{tmp_path / 's'}?capacity=1000") as st:
        assert st.capacity == 1000
        _fill(st, ["k1", "k2", "k3"])
        assert st.get("k1") is not None  # k1 is now the most recently used
        time.sleep(0.02)
        _fill(st, ["k4"])
        assert st.exists_many(["k1", "k2", "k3", "k4"]) == [True, False, True, True]
        assert st.used_bytes() <= 1000
        _fill(st, [f"m{i}" for i in range(10)])
        assert st.used_bytes() <= 1000
        assert st.exists("m9")  # the object just written is never the one evicted


def test_file_store_capacity_counts_what_is_already_on_disk(tmp_path):
    with open_store(f"file://{tmp_path / 's'}") as st:
        _fill(st, ["a1", "a2", "a3", "a4"])
    with open_store(f"file://{tmp_path / 's'}", capacity_bytes="1k") as st:
        _fill(st, ["b1"])
        assert st.used_bytes() <= 1024
        assert not st.exists("a1") and st.exists("b1")


def test_file_store_refuses_an_object_larger_than_its_capacity(tmp_path):
    with (
        open_store(f"file://{tmp_path / 's'}", capacity_bytes=10) as st,
        pytest.raises(StoreError, match="exceeds the capacity"),
    ):
        st.put("big", b"x" * 11)


@pytest.mark.parametrize("text, value", [("512", 512), ("64M", 64 << 20), ("1.5GiB", 3 << 29), ("2kb", 2048), (7, 7)])
def test_parse_size(text, value):
    from kvcodec.store.file import parse_size

    assert parse_size(text) == value


@pytest.mark.parametrize("bad", ["", "-1", "0", "12X", "1e9"])
def test_parse_size_refuses_nonsense(bad):
    from kvcodec.store.file import parse_size

    with pytest.raises(ConfigError):
        parse_size(bad)


# ---------------------------------------------------------------------------- deadlines


class _StalledStore(BaseStore):
    """A backend that stops answering (a fault a file or memory store cannot be made to show;
    the Redis tests pause a real server instead)."""

    url = "stalled://"

    def __init__(self):
        self.release = threading.Event()

    def get(self, key):
        self.release.wait(60)
        return b"late"

    def exists_many(self, keys):
        self.release.wait(60)
        return [True] * len(keys)

    def put(self, key, value):
        self.release.wait(60)

    def delete(self, key):
        return False


def test_deadline_store_returns_by_the_deadline_when_the_backend_stalls():
    from kvcodec.store import DeadlineStore

    inner = _StalledStore()
    try:
        t = time.monotonic()
        st = DeadlineStore(inner, t + 0.3)
        with pytest.raises(StoreError, match="deadline"):
            st.get("k")
        assert time.monotonic() - t < 30  # at the deadline, not when the stalled call ends (60 s)
        with pytest.raises(StoreError, match="deadline passed"):
            st.exists_many(["k"])  # already past: not even started
    finally:
        inner.release.set()


def test_a_call_abandoned_at_its_deadline_does_not_hold_the_process_at_exit():
    """A store call that never returns (a server paused, no socket timeout) is abandoned at the
    deadline; the process still exits (a ThreadPoolExecutor's thread would be joined, forever)."""
    import subprocess
    import sys

    script = (
        "import threading, concurrent.futures\n"
        "from kvcodec.store.deadline import run_within\n"
        "try:\n"
        "    run_within(0.05, threading.Event().wait)\n"
        "except concurrent.futures.TimeoutError:\n"
        "    print('abandoned')\n"
    )
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.strip() == "abandoned", done.stderr


def test_call_threads_run_calls_side_by_side_and_pass_errors_back():
    from kvcodec.store.deadline import CallThreads

    threads = CallThreads(4)
    meet = threading.Barrier(4, timeout=60)  # four calls in flight at once, or BrokenBarrierError
    results = sorted(f.result(60) for f in [threads.submit(meet.wait) for _ in range(4)])
    assert results == [0, 1, 2, 3]
    with pytest.raises(KeyError, match="gone"):
        threads.submit({}.__getitem__, "gone").result(60)
    assert threads.submit(sum, [1, 2]).result(60) == 3


def test_a_file_store_whose_folder_is_gone_refuses_puts_until_it_is_back(tmp_path):
    """The folder is not made again: where it was a mount point, the puts would fill the disk under it."""
    import shutil

    st = open_store(f"file://{tmp_path / 'store'}")
    st.put("a", b"1")
    shutil.rmtree(tmp_path / "store")
    with pytest.raises(StoreError):
        st.put("b", b"2")
    assert not (tmp_path / "store").exists()
    (tmp_path / "store").mkdir()
    st.put("b", b"2")
    assert st.get("b") == b"2" and st.get("a") is None


def test_deadline_store_passes_calls_through(store):
    from kvcodec.store import DeadlineStore

    conformance(DeadlineStore(store, time.monotonic() + 30))
    conformance(DeadlineStore(store, None))


def test_memory_store_evicts_least_recently_used_past_its_capacity():
    with open_store("memory://?capacity=1000") as st:
        for k in ("k1", "k2", "k3"):
            st.put(k, b"x" * 300)
        assert st.get("k1") is not None
        st.put("k4", b"y" * 300)
        assert st.exists_many(["k1", "k2", "k3", "k4"]) == [True, False, True, True]
        st.put_many({f"m{i}": b"z" * 300 for i in range(3)})
        assert st.used_bytes() <= 1000 and st.exists_many(["m0", "m1", "m2"]) == [True] * 3
        with pytest.raises(StoreError, match="exceeds the capacity"):
            st.put("big", b"x" * 1001)
    with pytest.raises(ConfigError):
        open_store("memory://", fsync=True)


KEY_CHARS = "abcXYZ019._:/+=@-"
keys = st.text(alphabet=KEY_CHARS, min_size=1, max_size=512)


@given(keys, keys)
def test_file_store_object_paths_invert_fit_any_file_system_and_never_collide(a, b):
    from kvcodec.store.file import NAME_MAX, key_of_parts, object_parts

    parts = object_parts(a)
    assert key_of_parts(parts) == a
    assert all(0 < len(p.encode()) <= NAME_MAX and p not in (".", "..") for p in parts)
    if a != b:
        assert object_parts(a) != object_parts(b)


def test_file_store_holds_every_key_the_key_rules_allow(tmp_path):
    # 256+ escaped characters failed with ENAMETOOLONG (an LMCache key of a long model path), "."
    # wrote a file over a fan folder (1/256 of all keys failed after it), ".." named the objects folder
    fs = open_store(f"file://{tmp_path / 's'}")
    ks = [".", "..", "a" * 512, "/" * 100, "lmcache/" + "m" * 240 + "/0/0", "x" * 200 + ".."]
    for i, k in enumerate(ks):
        fs.put(k, bytes([i]) * (i + 1))
    for i, k in enumerate(ks):
        assert fs.get(k) == bytes([i]) * (i + 1) and fs.size(k) == i + 1 and fs.exists_many([k]) == [True]
    assert sorted(fs.list()) == sorted(ks)
    assert fs.get("k271") is None
    fs.put("k271", b"ok")  # a key of "."'s fan folder
    assert fs.get("k271") == b"ok" and fs.delete("..") and fs.get("..") is None and fs.get(".") == bytes([0])


def test_opening_a_file_store_deletes_none_of_its_tmp_folders_files_but_its_own_dead_puts(tmp_path):
    # every entry older than an hour in ROOT/tmp was deleted: file:/// cleaned the system's /tmp
    root = tmp_path / "root"
    (root / "tmp").mkdir(parents=True)
    theirs, dead = root / "tmp" / "thesis.txt", root / "tmp" / "put-abc123"
    for p in (theirs, dead):
        p.write_bytes(b"x")
        os.utime(p, (time.time() - 7200, time.time() - 7200))
    open_store(f"file://{root}")
    assert theirs.exists() and not dead.exists()


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no FIFOs here")
def test_file_store_refuses_a_fifo_at_an_object_path_without_blocking_and_a_put_replaces_it(tmp_path):
    store = open_store(f"file://{tmp_path}")
    store.put("k", b"v")
    path = store._path("k")
    path.unlink()
    os.mkfifo(path)  # no writer: a blocking open for reading would wait for one for good
    errors = []

    def read_both():
        for read in (lambda: store.get("k"), lambda: store.get_range("k", 0, 1)):
            try:
                read()
            except StoreError as e:
                errors.append(str(e))

    reader = threading.Thread(target=read_both, daemon=True)
    reader.start()
    reader.join(timeout=60)  # the bound only turns a regression (a reader blocked for good) into a failure
    assert not reader.is_alive(), "a read of the FIFO blocked"
    assert len(errors) == 2 and all("not a regular file" in e and "put the key again" in e for e in errors)
    assert store.exists_many(["k"]) == [False] and store.size("k") is None
    assert list(store.list()) == [] and store.used_bytes() == 0  # what the reads say: no object there
    store.put("k", b"healed")
    assert store.get("k") == b"healed" and store.get_range("k", 1, 3) == b"ea"


def test_file_store_refuses_a_folder_at_an_object_path_by_name(tmp_path):
    store = open_store(f"file://{tmp_path}")
    store._path("k").mkdir(parents=True)
    with pytest.raises(StoreError, match="not a regular file"):
        store.get("k")
    assert store.size("k") is None
    store.put("k", b"v")  # an empty folder there is nobody's object: the put replaces it
    assert store.get("k") == b"v"
    (store._path("j") / "x").mkdir(parents=True)  # one that holds something is left alone
    with pytest.raises(StoreError, match="put 'j'"):
        store.put("j", b"v")
    assert (store._path("j") / "x").is_dir()


def test_the_write_probe_of_a_full_file_store_evicts_nothing(tmp_path):
    """serve's start-up probe (probe_write) writes no object: a store over its capacity keeps every
    object, and a store that takes writes gives no refusal."""
    from kvcodec.cli.serve import write_refusal

    full = open_store(f"file://{tmp_path / 's'}")
    for i in range(10):
        full.put(f"k{i}", b"x" * 1000)
    st = open_store(f"file://{tmp_path / 's'}?capacity=5000")
    assert write_refusal(st, 30.0) is None
    assert sorted(st.list()) == sorted(f"k{i}" for i in range(10))
    assert list((tmp_path / "s" / "tmp").iterdir()) == []


def test_a_store_whose_probe_fails_with_its_own_exception_is_a_refusal():
    from kvcodec.cli.serve import write_refusal

    class Plugin:  # a plugin's store, not a BaseStore: the generic probe, its own exception
        url = "plugin://x"

        def put(self, key, value):
            raise PermissionError("read-only mount")

        def delete(self, key):
            return False

    assert write_refusal(Plugin(), 30.0) == "PermissionError: read-only mount"


def test_a_long_keys_folders_go_with_its_object_and_a_racing_put_makes_them_again(tmp_path):
    """A key longer than a file name is stored in folders of its own (object_parts); deleting or
    evicting its object removes them, and a put racing the delete of the same key never fails."""
    import threading

    st = open_store(f"file://{tmp_path / 's'}")
    keys = [f"ns/{c}" + "/x" * 120 for c in "abc"]  # escaped ("/" is %2F): longer than a file name
    for k in keys:
        st.put(k, b"v")
    assert any(p.is_dir() for fan in (tmp_path / "s" / "objects").iterdir() for p in fan.iterdir())
    for k in keys:
        assert st.delete(k)
    assert [p for fan in (tmp_path / "s" / "objects").iterdir() for p in fan.iterdir()] == []

    errors = []

    def loop(op):
        try:
            for _ in range(300):
                op(keys[0])
        except Exception as e:  # noqa: BLE001 - reported by the assert below
            errors.append(e)

    threads = [threading.Thread(target=loop, args=(op,)) for op in (lambda k: st.put(k, b"w"), st.delete)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []
    st.put(keys[0], b"w")
    assert st.get(keys[0]) == b"w" and list(st.list("ns/")) == [keys[0]]


def test_a_store_too_slow_for_the_probe_is_not_called_read_only(capsys):
    from kvcodec.cli.serve import write_refusal

    inner = _StalledStore()
    try:
        assert write_refusal(inner, 0.2) is None  # the probe timed out: storing stays on, with a warning
    finally:
        inner.release.set()
    assert "did not answer a probe write" in capsys.readouterr().err


class SizesOnePerKey:
    """A plugin's store with size() but no size_many: the fetcher's batched size query serves it too."""

    url = "plugin://"

    def __init__(self):
        self.objects = {"a": b"xyz", "b": b""}

    def size(self, key):
        return len(self.objects[key]) if key in self.objects else None


def test_size_many_serves_a_store_without_it_directly_and_by_deadline():
    from kvcodec.store import DeadlineStore
    from kvcodec.store.base import size_many

    plugin = SizesOnePerKey()
    assert size_many(plugin, ["a", "nope", "b"]) == [3, None, 0]
    assert DeadlineStore(plugin, time.monotonic() + 60).size_many(["b", "a"]) == [0, 3]
