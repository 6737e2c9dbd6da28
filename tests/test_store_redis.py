"""RedisStore against a REAL redis-server process (started per test on a free port in a temp dir)."""

from __future__ import annotations

import time

import pytest

from kvbench.net.redis_server import RedisServer, redis_server_binary
from kvcodec.errors import StoreError
from kvcodec.store import open_store
from test_store import conformance

pytestmark = [
    pytest.mark.redis,
    pytest.mark.skipif(
        redis_server_binary() is None, reason="redis-server binary not installed (apt-get install redis-server)"
    ),
]


def test_conformance(redis_server):
    with open_store(redis_server.url) as st:
        conformance(st)


def test_namespace_isolates_keys(redis_server):
    a = open_store(redis_server.url, namespace="a:")
    b = open_store(redis_server.url, namespace="b:")
    a.put("k", b"1")
    assert b.get("k") is None
    b.put("k", b"2")
    assert a.get("k") == b"1" and sorted(a.list()) == ["k"]


def test_large_value_and_batches(redis_server):
    st = open_store(redis_server.url)
    big = bytes(range(256)) * (32 << 10)  # 8 MiB
    st.put("big", big)
    assert st.get("big") == big
    keys = [f"k{i}" for i in range(1200)]  # more than one pipelined batch
    st.put_many({k: k.encode() for k in keys[::2]})
    assert st.exists_many(keys) == [i % 2 == 0 for i in range(1200)]
    assert st.get_many(keys[:4]) == [b"k0", None, b"k2", None]
    assert st.size_many(keys) == [len(k) if i % 2 == 0 else None for i, k in enumerate(keys)]


def test_restart_persistence_graceful(redis_server):
    st = open_store(redis_server.url)
    st.put("persist", b"x" * 1000)
    redis_server.stop()  # SIGTERM: AOF flushed, RDB written
    redis_server.start()
    st2 = open_store(redis_server.url)
    assert st2.get("persist") == b"x" * 1000


def test_restart_persistence_after_crash(redis_server):
    """appendonly yes + appendfsync everysec: a write survives SIGKILL once the server has written it
    to its append-only file (the OS holds it then; everysec may put that write off while an fsync runs)."""
    import redis

    raw = redis.Redis.from_url(redis_server.url)
    before = raw.info("persistence")["aof_current_size"]
    st = open_store(redis_server.url)
    st.put("crash-safe", b"y" * 1000)
    for _ in range(1200):  # a condition, not a clock: at most 60 s on a loaded machine
        info = raw.info("persistence")
        if info["aof_buffer_length"] == 0 and info["aof_current_size"] > before:
            break
        time.sleep(0.05)
    raw.close()
    redis_server.kill()
    redis_server.start()
    assert open_store(redis_server.url).get("crash-safe") == b"y" * 1000


def test_server_down_raises_store_error_fast(redis_server):
    st = open_store(redis_server.url, socket_timeout=1.0, socket_connect_timeout=1.0)
    st.put("k", b"v")
    redis_server.kill()
    t = time.monotonic()
    with pytest.raises(StoreError) as ei:
        st.get("k")
    assert time.monotonic() - t < 5.0
    assert str(redis_server.port) in str(ei.value)
    with pytest.raises(StoreError):
        st.exists_many(["k"])


def test_open_on_dead_port_raises(tmp_path):
    from kvbench.net.redis_server import free_port

    t = time.monotonic()
    with pytest.raises(StoreError, match="connect"):
        open_store(f"redis://127.0.0.1:{free_port()}/0", socket_connect_timeout=0.5)
    assert time.monotonic() - t < 5.0


def test_password_passed_through(tmp_path):
    srv = RedisServer(tmp_path / "pw", appendonly=False, extra_args=("--requirepass", "s3cret")).start()
    try:
        with pytest.raises(StoreError) as ei:
            open_store(srv.url)
        assert "s3cret" not in str(ei.value)
        st = open_store(srv.url, password="s3cret")
        st.put("k", b"v")
        url = srv.url.replace("redis://", "redis://:s3cret@")
        assert open_store(url).get("k") == b"v"
        bad = url.replace("s3cret", "wrong")
        with pytest.raises(StoreError) as ei:
            open_store(bad)
        assert "wrong" not in str(ei.value)  # password redacted in the message
    finally:
        srv.kill()


def test_server_timeout_is_configurable(redis_server):
    """A server that accepts but never answers (paused with SIGSTOP) -> StoreError after the timeout."""
    import signal

    st = open_store(redis_server.url, socket_timeout=0.5, retries=0)
    st.put("k", b"v")
    redis_server.proc.send_signal(signal.SIGSTOP)
    try:
        t = time.monotonic()
        with pytest.raises(StoreError, match="Timeout"):
            st.get("k")
        assert 0.4 < time.monotonic() - t < 3.0
    finally:
        redis_server.proc.send_signal(signal.SIGCONT)


def test_redis_cluster(tmp_path):
    """redis+cluster:// against a real 3-node Redis Cluster (keys spread over hash slots)."""
    import shutil
    import subprocess

    if shutil.which("redis-cli") is None:
        pytest.skip("redis-cli not installed")
    from kvbench.net.redis_server import free_port

    nodes = [
        RedisServer(
            tmp_path / f"n{i}",
            appendonly=False,
            port=free_port(cluster=True),
            extra_args=(
                "--cluster-enabled",
                "yes",
                "--cluster-config-file",
                "nodes.conf",
                "--cluster-node-timeout",
                "2000",
            ),
        )
        for i in range(3)
    ]
    try:
        for n in nodes:
            n.start()
        subprocess.run(
            [
                "redis-cli",
                "--cluster",
                "create",
                *[f"127.0.0.1:{n.port}" for n in nodes],
                "--cluster-replicas",
                "0",
                "--cluster-yes",
            ],
            check=True,
            capture_output=True,
            timeout=30,
        )
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline:
            info = subprocess.run(
                ["redis-cli", "-p", str(nodes[0].port), "cluster", "info"], capture_output=True, text=True
            ).stdout
            if "cluster_state:ok" in info:
                break
            time.sleep(0.1)
        else:
            pytest.fail("cluster did not come up")
        st = open_store(f"redis+cluster://127.0.0.1:{nodes[0].port}")
        assert st.cluster
        conformance(st)
        keys = [f"c{i}/meta" for i in range(50)]
        st.put_many({k: k.encode() for k in keys[::2]})
        assert st.exists_many(keys) == [i % 2 == 0 for i in range(50)]
        assert st.get_many(keys[:3]) == [b"c0/meta", None, b"c2/meta"]
        st.close()
    finally:
        for n in nodes:
            n.kill()


def test_tls_rediss(tmp_path):
    """rediss:// against a TLS-only redis-server, CA passed through as ssl_ca_certs."""
    import shutil
    import subprocess

    if shutil.which("openssl") is None:
        pytest.skip("openssl not installed")
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(
        [
            "openssl",
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-keyout",
            str(key),
            "-out",
            str(cert),
            "-days",
            "1",
            "-subj",
            "/CN=127.0.0.1",
            "-addext",
            "subjectAltName=IP:127.0.0.1",
        ],
        check=True,
        capture_output=True,
    )
    srv = RedisServer(tmp_path / "tls", appendonly=False, tls=(str(cert), str(key), str(cert)))
    try:
        srv.start()
    except StoreError as e:
        pytest.skip(f"this redis-server has no TLS support: {e}")
    try:
        assert srv.url.startswith("rediss://")
        st = open_store(srv.url, ssl_ca_certs=str(cert))
        st.put("k", b"secret bytes")
        assert st.get("k") == b"secret bytes"
        with pytest.raises(StoreError):  # plain redis:// to a TLS port fails cleanly
            open_store(srv.url.replace("rediss://", "redis://"), socket_timeout=1.0, socket_connect_timeout=1.0)
        with pytest.raises(StoreError):  # an unknown CA is refused
            open_store(srv.url)
    finally:
        srv.kill()


def test_a_paused_server_costs_one_timeout_and_a_deadline_bounds_every_call(redis_server):
    """The issue: with Redis paused (SIGSTOP), a lookup took 10.1 s and fetch(deadline_s=0.5) too."""
    import signal

    from kvcodec.store import DeadlineStore

    st = open_store(redis_server.url)  # defaults
    slow = open_store(redis_server.url, socket_timeout=5.0)  # the default retries, a longer timeout
    patient = open_store(redis_server.url, socket_timeout=30.0)
    st.put("k", b"v")
    redis_server.proc.send_signal(signal.SIGSTOP)
    try:
        t = time.monotonic()
        with pytest.raises(StoreError):
            slow.exists_many(["k"])  # a lookup: one socket timeout (5 s), not retried (10 s)
        assert time.monotonic() - t < 9
        t = time.monotonic()
        bounded = DeadlineStore(patient, t + 0.3)
        for call in (lambda: bounded.get("k"), lambda: bounded.get_many(["k"]), lambda: bounded.exists_many(["k"])):
            with pytest.raises(StoreError):
                call()
        assert time.monotonic() - t < 15  # three deadlines, not three 30 s socket timeouts
    finally:
        redis_server.proc.send_signal(signal.SIGCONT)
    assert st.get("k") == b"v"  # the store works again once the server does
    slow.close()
    patient.close()


def test_a_store_that_refuses_writes_warns_serve_and_stops_ingest_before_the_model_loads(
    redis_server, tmp_path, capsys, monkeypatch
):
    """A read-only Redis user (an ACL without write commands): `serve` starts with a warning and
    storing off (its prefixes can still be fetched), `ingest` refuses to start; a user that may
    write but not delete takes writes (the probe object it keeps is logged); a writable store passes
    both, and the probe leaves nothing behind."""
    import click
    import redis
    from click.testing import CliRunner

    import kvcodec.ingest.run
    from kvcodec.cli.main import cli
    from kvcodec.cli.serve import check_store

    raw = redis.Redis.from_url(redis_server.url)
    if tuple(int(x) for x in raw.info()["redis_version"].split(".")[:2]) < (6, 2):
        pytest.skip("Redis ACL selectors (&*) need Redis 6.2")
    raw.execute_command("ACL", "SETUSER", "reader", "on", ">s3cret", "~*", "&*", "+@all", "-@write")
    raw.execute_command("ACL", "SETUSER", "keeper", "on", ">s3cret", "~*", "&*", "+@all", "-del", "-unlink")
    url = redis_server.url.replace("redis://", "redis://reader:s3cret@")
    assert "NoPermission" in check_store(url, writes="warn")
    err = capsys.readouterr().err
    assert "refuses writes" in err and "storing is off" in err and "s3cret" not in err, err
    with pytest.raises(click.BadParameter, match="refuses writes"):
        check_store(url, writes="require")
    assert check_store(redis_server.url.replace("redis://", "redis://keeper:s3cret@"), writes="require") is None
    assert len(raw.keys("*kvcodec-write-probe*")) == 1  # the keeper's probe: it may not delete
    raw.delete(*raw.keys("*kvcodec-write-probe*"))
    assert check_store(redis_server.url, writes="require") is None
    assert "refuses" not in capsys.readouterr().err
    assert raw.keys("*kvcodec-write-probe*") == []

    def load(*a, **k):  # noqa: ANN002, ANN003, ANN202
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(kvcodec.ingest.run, "load_for_ingest", load)
    docs = tmp_path / "docs.txt"
    docs.write_text("one prompt\n")
    r = CliRunner().invoke(cli, ["ingest", str(docs), "--model", "smollm2-135m", "--store", url])
    assert r.exit_code == 2 and "refuses writes" in r.output and "Traceback" not in r.output, r.output
    raw.close()
