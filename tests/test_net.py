"""Shaped links: bandwidth traces, the token-bucket store wrapper, the netns + tc link."""

from __future__ import annotations

import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvbench.net import JitterTrace
from kvbench.net.throttle import ThrottledStore, TokenBucketLink
from kvcodec.errors import ConfigError
from kvcodec.store import open_store


@settings(max_examples=100, deadline=None)
@given(
    st.lists(st.tuples(st.floats(0.001, 1.0), st.floats(0.01, 50.0)), min_size=1, max_size=6),
    st.floats(0, 10),
    st.integers(0, 10**8),
)
def test_trace_transfer_end_matches_integral(segs, start, nbytes):
    tr = JitterTrace(tuple(segs))
    end = tr.transfer_end(start, nbytes)
    assert end >= start
    # integrate the rate numerically over [start, end]: it must carry exactly nbytes
    bits, step = 0.0, (end - start) / 2000 if end > start else 0
    if step:
        for i in range(2000):
            bits += tr.rate_at(start + (i + 0.5) * step) * 1e9 * step
        assert bits == pytest.approx(nbytes * 8, rel=0.05, abs=2e9 * step * 50)


def test_trace_constant_and_random_walk_mean():
    assert JitterTrace.constant(4).transfer_end(0.0, 500_000_000) == pytest.approx(1.0)
    tr = JitterTrace.random_walk(8.0, cv=0.6, n=100, seed=3)
    assert tr.mean_gbit == pytest.approx(8.0)
    rates = [r for _, r in tr.segments]
    assert max(rates) / min(rates) > 2  # it does jitter
    assert JitterTrace.from_json(tr.to_json()) == tr
    with pytest.raises(ConfigError):
        JitterTrace(((1.0, 0.0),))


def test_throttled_store_rate():
    inner = open_store("memory://")
    inner.put("x", b"\0" * 2_000_000)
    st = ThrottledStore(inner, rate_gbit=0.4)  # 50 MB/s -> 40 ms per get
    t = time.monotonic()
    for _ in range(3):
        assert len(st.get("x")) == 2_000_000
    dt = time.monotonic() - t
    assert 0.115 < dt < 0.25
    assert st.link.bytes_total == 6_000_000


def test_throttled_store_is_one_shared_link_across_threads():
    import threading

    inner = open_store("memory://")
    inner.put("x", b"\0" * 1_000_000)
    st = ThrottledStore(inner, rate_gbit=0.4)  # 20 ms per get
    ts = [threading.Thread(target=st.get, args=("x",)) for _ in range(4)]
    t = time.monotonic()
    for th in ts:
        th.start()
    for th in ts:
        th.join()
    assert time.monotonic() - t > 0.075  # 4 gets serialised on one link, not in parallel


def test_throttle_url():
    st = open_store("throttle://2?inner=memory%3A%2F%2Fthr-url-test&delay_ms=1")
    assert isinstance(st, ThrottledStore) and st.link.trace.mean_gbit == 2.0
    st.put("k", b"v")
    assert open_store("memory://thr-url-test").get("k") == b"v"
    with pytest.raises(ConfigError):
        open_store("throttle://2")


def test_token_bucket_follows_trace():
    tr = JitterTrace(((0.05, 0.08), (0.05, 0.8)))  # 10 MB/s for 50 ms, then 100 MB/s
    link = TokenBucketLink(tr)
    start = link._t0  # trace time 0: the booking is arithmetic on the trace, no clock is read
    assert link.reserve(500_000, issued_at=start) - start == pytest.approx(0.05)  # 0.5 MB at 10 MB/s
    assert link.reserve(1_000_000, issued_at=start) - start == pytest.approx(0.06)  # queued, 1 MB at 100 MB/s
    link.transfer(100_000)  # the link is busy until trace time 0.06, then 1 ms at 100 MB/s
    assert time.monotonic() >= start + 0.061


# -------------------------------------------------------------------------- kernel-shaped link


def _netns_ok():
    try:
        from kvbench.net.netns import NetnsLink

        return NetnsLink.available()
    except Exception as e:  # noqa: BLE001
        return False, str(e)


@pytest.mark.redis
def test_netns_link_limits_redis_throughput(tmp_path):
    ok, why = _netns_ok()
    if not ok:
        pytest.skip(f"netns + tc not usable here: {why}")
    from kvbench.net.netns import NetnsLink
    from kvbench.net.redis_server import RedisServer, redis_server_binary

    if redis_server_binary() is None:
        pytest.skip("redis-server binary not installed")
    with NetnsLink(0.2) as link:  # 25 MB/s
        srv = RedisServer(tmp_path / "r", bind=link.ns_ip, netns=link.name, appendonly=False).start()
        try:
            st = open_store(srv.url)
            st.put("x", b"\1" * 2_500_000)
            t = time.monotonic()
            assert len(st.get("x")) == 2_500_000
            dt = time.monotonic() - t
            assert dt > 0.08  # 2.5 MB at 25 MB/s = 0.1 s; unshaped loopback takes ~1 ms
            link.set_rate(2.0)
            t = time.monotonic()
            st.get("x")
            assert time.monotonic() - t < dt
            assert link.describe()["link"] == "tc-netns"
        finally:
            srv.kill()


def test_netns_link_plays_a_trace():
    ok, why = _netns_ok()
    if not ok:
        pytest.skip(f"netns + tc not usable here: {why}")
    import subprocess

    from kvbench.net.netns import NetnsLink

    with NetnsLink(1.0) as link:
        link.play(JitterTrace(((0.15, 0.05), (0.15, 5.0))))
        seen = set()
        t = time.monotonic()
        while time.monotonic() - t < 2.0 and not {"50Mbit", "5Gbit"} <= seen:
            out = subprocess.run(["tc", "qdisc", "show", "dev", link.veth_host], capture_output=True, text=True).stdout
            seen.add("50Mbit" if "rate 50Mbit" in out else "5Gbit" if "rate 5Gbit" in out else out.strip())
            time.sleep(0.02)
        link.set_rate(1.0)  # stops the trace
        assert {"50Mbit", "5Gbit"} <= seen, seen
