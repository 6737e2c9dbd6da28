"""A real `kvcodec serve` process for the tests: on a free port of 127.0.0.1, one torch thread,
its output (stdout and stderr) on proc.stdout, returned once /health answers 200."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

import pytest

START_S = 180.0  # the model's first load converts its weights


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_serve(*args: str, env: dict[str, str] | None = None) -> tuple[subprocess.Popen, str]:
    """(the process, its base URL) of `kvcodec serve ARGS --port PORT` (env: more environment variables);
    the test fails with the server's last output where it exits or is not healthy within START_S."""
    port = free_port()
    cmd = [sys.executable, "-m", "kvcodec.cli.main", "serve", *args, "--port", str(port)]
    env = {**os.environ, "OMP_NUM_THREADS": "1", **(env or {})}
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    base = f"http://127.0.0.1:{port}"
    _wait_healthy(proc, base)
    return proc, base


def _wait_healthy(proc: subprocess.Popen, base: str) -> None:
    import httpx

    deadline = time.monotonic() + START_S
    while time.monotonic() < deadline and proc.poll() is None:
        try:
            if httpx.get(base + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            time.sleep(0.5)
    proc.kill()
    pytest.fail(f"server did not start: {proc.communicate()[0][-3000:]}")
