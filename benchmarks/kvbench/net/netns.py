"""A kernel-shaped link: a network namespace joined to the host by a veth pair, its rate set by
`tc` (tbf qdisc on both ends), so a store server run inside the namespace is reached over a real
TCP path of the chosen bandwidth.

Needs root (CAP_NET_ADMIN), the `ip` and `tc` tools (iproute2) and the kernel's tbf qdisc.
`NetnsLink.available()` says whether all of that works here. Delay: applied with `netem` when the
kernel has it; otherwise the link has no added delay and `describe()` says so. A JitterTrace
changes the rate over time from a background thread (`tc qdisc change`).
"""

from __future__ import annotations

import itertools
import logging
import os
import shutil
import subprocess
import threading
import time

from kvbench.net.trace import JitterTrace
from kvcodec.errors import ConfigError, StoreError

log = logging.getLogger(__name__)


def _run(argv: list[str], check: bool = True) -> subprocess.CompletedProcess:
    p = subprocess.run(argv, capture_output=True, text=True)
    if check and p.returncode != 0:
        raise StoreError(f"{' '.join(argv)} failed ({p.returncode}): {p.stderr.strip()}")
    return p


_COUNTER = itertools.count()


def _free_octet() -> int:
    """A third octet N such that 10.231.N.0/30 is not in use on the host (parallel links)."""
    import random

    used = _run(["ip", "-o", "-4", "addr", "show"], check=False).stdout
    free = [n for n in range(1, 254) if f"10.231.{n}." not in used]
    if not free:
        raise StoreError("no free 10.231.N.0/30 subnet for a shaped link")
    return random.choice(free)


class NetnsLink:
    """Namespace `name` at `ns_ip`, host end at `host_ip`, both directions shaped to the rate.

    Use as a context manager; `close()` deletes the namespace and the veth pair.
    """

    kind = "tc-netns"

    def __init__(
        self,
        rate_gbit: float | None = None,
        *,
        trace: JitterTrace | None = None,
        delay_ms: float = 0.0,
        subnet: int | None = None,
        mtu: int = 65000,
    ) -> None:
        if trace is None:
            if not rate_gbit or rate_gbit <= 0:
                raise ConfigError("NetnsLink needs rate_gbit > 0 or a trace")
            trace = JitterTrace.constant(rate_gbit)
        self.trace = trace
        self.delay_ms = float(delay_ms)
        self.mtu = int(mtu)  # jumbo veth MTU: far fewer packets per byte on a small CPU
        tag = f"{os.getpid() % 100000}x{next(_COUNTER) % 1000}"
        self.name = f"kvc{tag}"
        self.veth_host = f"kvh{tag}"[:15]
        self.veth_ns = f"kvn{tag}"[:15]
        octet = subnet if subnet is not None else _free_octet()
        self.host_ip = f"10.231.{octet}.1"
        self.ns_ip = f"10.231.{octet}.2"
        self.netem = False
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._up = False

    @staticmethod
    def available() -> tuple[bool, str]:
        """(usable, reason): tries a throwaway namespace + veth + tbf."""
        if os.geteuid() != 0:
            return False, "not root"
        for tool in ("ip", "tc"):
            if shutil.which(tool) is None:
                return False, f"`{tool}` not found (apt-get install iproute2)"
        probe = NetnsLink(1.0)
        try:
            probe.open()
            return True, "ok"
        except StoreError as e:
            return False, str(e)
        finally:
            probe.close()

    # -- setup -------------------------------------------------------------------------------
    def _qdisc_args(self, rate_gbit: float) -> list[str]:
        rate_bytes = rate_gbit * 1e9 / 8
        burst = int(max(4 * 65536, rate_bytes * 0.001))  # >= 1 ms of traffic, >= 4 jumbo packets
        return ["tbf", "rate", f"{rate_gbit * 1e3:.3f}mbit", "burst", str(burst), "latency", "100ms"]

    def _tc(self, verb: str, rate_gbit: float) -> None:
        _run(
            [
                "ip",
                "netns",
                "exec",
                self.name,
                "tc",
                "qdisc",
                verb,
                "dev",
                self.veth_ns,
                "root",
                *self._qdisc_args(rate_gbit),
            ]
        )
        _run(["tc", "qdisc", verb, "dev", self.veth_host, "root", *self._qdisc_args(rate_gbit)])

    def open(self) -> NetnsLink:
        ns = ["ip", "netns", "exec", self.name]
        try:
            _run(["ip", "netns", "add", self.name])
            self._up = True
            _run(["ip", "link", "add", self.veth_host, "type", "veth", "peer", "name", self.veth_ns])
            _run(["ip", "link", "set", self.veth_ns, "netns", self.name])
            _run(["ip", "addr", "add", f"{self.host_ip}/30", "dev", self.veth_host])
            _run(["ip", "link", "set", self.veth_host, "mtu", str(self.mtu), "up"])
            _run(ns + ["ip", "addr", "add", f"{self.ns_ip}/30", "dev", self.veth_ns])
            _run(ns + ["ip", "link", "set", self.veth_ns, "mtu", str(self.mtu), "up"])
            _run(ns + ["ip", "link", "set", "lo", "up"])
            self._tc("add", self.trace.rate_at(0.0))
            if self.delay_ms > 0:
                # netem as the child of tbf would need a classful setup; try a plain root netem
                # on the host side (the request direction) and report whether it worked.
                p = _run(
                    [
                        "tc",
                        "qdisc",
                        "add",
                        "dev",
                        self.veth_host,
                        "parent",
                        "root",
                        "handle",
                        "2:",
                        "netem",
                        "delay",
                        f"{self.delay_ms}ms",
                    ],
                    check=False,
                )
                self.netem = p.returncode == 0
                if not self.netem:
                    log.warning("netem not available (%s): link has no added delay", p.stderr.strip())
        except BaseException:
            self.close()
            raise
        if len(self.trace.segments) > 1:
            self.play(self.trace)
        return self

    def play(self, trace: JitterTrace) -> None:
        """Follow `trace` from now on (a background thread runs `tc qdisc change` at each
        segment boundary) until `stop_play()` or `set_rate()`."""
        self.stop_play()
        self.trace = trace
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._play, args=(self._stop,), name=f"{self.name}-trace", daemon=True)
        self._thread.start()

    def stop_play(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=2)
            self._thread = None

    def _play(self, stop: threading.Event) -> None:
        t0 = time.monotonic()
        while not stop.is_set():
            t = time.monotonic() - t0
            rate = self.trace.rate_at(t)
            try:
                self._tc("change", rate)
            except StoreError as e:
                log.warning("trace rate change failed: %s", e)
            # sleep to the next segment boundary
            off = t % self.trace.period_s
            acc = 0.0
            for d, _ in self.trace.segments:
                acc += d
                if acc > off:
                    break
            stop.wait(max(0.001, acc - off))

    def set_rate(self, rate_gbit: float) -> None:
        """A constant rate from now on (stops a playing trace)."""
        self.stop_play()
        self.trace = JitterTrace.constant(rate_gbit)
        self._tc("change", rate_gbit)

    def exec_argv(self, argv: list[str]) -> list[str]:
        """`argv` wrapped to run inside the namespace."""
        return ["ip", "netns", "exec", self.name, *argv]

    def close(self) -> None:
        self.stop_play()
        if self._up:
            _run(["ip", "netns", "del", self.name], check=False)
            self._up = False
        _run(["ip", "link", "del", self.veth_host], check=False)

    def describe(self) -> dict:
        return {
            "link": self.kind,
            "trace": self.trace.name,
            "mean_gbit": self.trace.mean_gbit,
            "delay_ms": self.delay_ms if self.netem else 0.0,
            "qdisc": "tbf",
            "netem": self.netem,
        }

    def __enter__(self) -> NetnsLink:
        return self.open()

    def __exit__(self, *exc) -> None:
        self.close()
