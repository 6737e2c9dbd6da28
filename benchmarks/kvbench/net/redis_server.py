"""Start and stop a real `redis-server` process (for tests and benchmarks), optionally inside a
network namespace (see kvbench.net.netns) so its traffic crosses a shaped veth link."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

from kvcodec.errors import StoreError


def redis_server_binary() -> str | None:
    return shutil.which("redis-server")


def _bindable(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((host, port))
            return True
        except OSError:
            return False


def free_port(host: str = "127.0.0.1", cluster: bool = False) -> int:
    """A free TCP port; with `cluster`, one <= 55535 whose +10000 bus port is free too."""
    if not cluster:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind((host, 0))
            return s.getsockname()[1]
    import random

    for _ in range(200):
        p = random.randrange(20000, 45000)
        if _bindable(host, p) and _bindable(host, p + 10000):
            return p
    raise StoreError("no free port pair for a cluster node")


class RedisServer:
    """A redis-server on `port` with its data (AOF + RDB) in `data_dir`.

    appendonly: AOF persistence (`appendfsync everysec`), so objects survive a restart (and
        a crash, minus at most about one second of writes). RDB snapshots are on as well
        (`save 60 1`) and written at shutdown.
    netns: run inside this network namespace (`ip netns exec NS redis-server ...`).
    """

    def __init__(
        self,
        data_dir: str | os.PathLike,
        *,
        port: int | None = None,
        bind: str = "127.0.0.1",
        appendonly: bool = True,
        netns: str | None = None,
        maxmemory: str | None = None,
        extra_args: tuple[str, ...] = (),
        tls: tuple[str, str, str] | None = None,
    ) -> None:
        binary = redis_server_binary()
        if binary is None:
            raise StoreError("redis-server binary not found (install the redis-server package)")
        self.binary = binary
        self.data_dir = Path(data_dir)
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self.bind = bind
        self.port = port or free_port("127.0.0.1" if netns is None else "0.0.0.0")
        self.appendonly = appendonly
        self.netns = netns
        self.maxmemory = maxmemory
        self.extra_args = tuple(extra_args)
        self.tls = tuple(str(x) for x in tls) if tls else None  # (cert, key, ca): TLS only
        self.proc: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"{'rediss' if self.tls else 'redis'}://{self.bind}:{self.port}/0"

    def _argv(self) -> list[str]:
        argv = [
            self.binary,
            "--port",
            str(self.port),
            "--bind",
            self.bind,
            "--dir",
            str(self.data_dir),
            "--dbfilename",
            "dump.rdb",
            "--appendonly",
            "yes" if self.appendonly else "no",
            "--appendfsync",
            "everysec",
            "--save",
            "60 1",
            "--protected-mode",
            "no",
            "--daemonize",
            "no",
            "--logfile",
            str(self.data_dir / "redis.log"),
            "--proto-max-bulk-len",
            "1gb",
        ]
        if self.maxmemory:
            argv += ["--maxmemory", self.maxmemory, "--maxmemory-policy", "noeviction"]
        if self.tls:
            cert, key, ca = self.tls
            argv[argv.index("--port") + 1] = "0"
            argv += [
                "--tls-port",
                str(self.port),
                "--tls-cert-file",
                cert,
                "--tls-key-file",
                key,
                "--tls-ca-cert-file",
                ca,
                "--tls-auth-clients",
                "no",
            ]
        argv += list(self.extra_args)
        if self.netns:
            argv = ["ip", "netns", "exec", self.netns] + argv
        return argv

    def start(self, timeout_s: float = 10.0) -> RedisServer:
        if self.proc is not None and self.proc.poll() is None:
            return self
        self.proc = subprocess.Popen(self._argv(), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                err = self.proc.stderr.read().decode(errors="replace") if self.proc.stderr else ""
                log = self.data_dir / "redis.log"
                tail = log.read_text(errors="replace")[-2000:] if log.exists() else ""
                raise StoreError(f"redis-server exited with {self.proc.returncode}: {err}{tail}")
            if self._ping():
                return self
            time.sleep(0.02)
        self.kill()
        raise StoreError(f"redis-server did not answer on {self.bind}:{self.port} within {timeout_s}s")

    def _ping(self) -> bool:
        try:
            with socket.create_connection((self.bind, self.port), timeout=0.5) as raw:
                s = raw
                if self.tls:
                    import ssl

                    ctx = ssl.create_default_context(cafile=self.tls[2])
                    ctx.check_hostname = False
                    s = ctx.wrap_socket(raw)
                s.sendall(b"PING\r\n")
                reply = s.recv(16)
                return reply.startswith(b"+PONG") or reply.startswith(b"-NOAUTH")
        except OSError:
            return False

    def stop(self, timeout_s: float = 10.0) -> None:
        """Graceful stop (SIGTERM: redis flushes the AOF and writes its RDB)."""
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        self.proc = None

    def kill(self) -> None:
        """Abrupt death (SIGKILL), as in a crash."""
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()
        self.proc = None

    def __enter__(self) -> RedisServer:
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
