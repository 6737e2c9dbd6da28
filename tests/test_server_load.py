"""A real `kvcodec serve` (SmolLM2, file:// store, CPU, 127.0.0.1) under a bounded burst of valid
and invalid requests: each valid request gets the answer it gets alone, each invalid one a 4xx
with a message, /health stays ok; a vanished client's request is cancelled; SIGTERM of a busy
server stops it within seconds."""

from __future__ import annotations

import concurrent.futures
import json
import signal
import socket
import time

import pytest

from serve_process import start_serve

httpx = pytest.importorskip("httpx")

pytestmark = pytest.mark.slow

DOC = (
    "The lighthouse keeper, Mara, kept a logbook of every ship. On Monday the Albatross passed at dawn; "
    "on Tuesday the Heron anchored for repairs; on Wednesday fog hid the bay. "
)
VALID = [
    {"prompt": DOC + "Question: Which ship anchored for repairs? Answer:", "max_tokens": 6},
    {"prompt": DOC + "Question: What hid the bay on Wednesday? Answer:", "max_tokens": 6},
    {"prompt": "The capital of France is", "max_tokens": 6},
    {"messages": [{"role": "user", "content": "Name a colour."}], "max_tokens": 6},
]
INVALID = [
    ("/v1/completions", {"prompt": "Hi", "temperature": 1.0, "top_p": 0}),
    ("/v1/completions", {"prompt": [1, 2, 10**9]}),
    ("/v1/completions", {"prompt": [1, 2, -5]}),
    ("/v1/completions", {"prompt": "Hi", "stop": 5}),
    ("/v1/completions", {"prompt": "Hi", "temperature": -1}),
    ("/v1/completions", {"prompt": "Hi", "max_tokens": 0}),
    ("/v1/completions", {"prompt": "Hi", "max_tokens": "ten"}),
    ("/v1/completions", {"prompt": "Hi", "max_tokens": 10**9}),
    ("/v1/completions", {"prompt": [7] * 9000}),  # beyond SmolLM2's context of 8192 tokens
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": 123}]}),
    ("/v1/chat/completions", {"messages": [1]}),
    ("/v1/chat/completions", {"messages": "hello"}),
    ("/v1/completions", "not an object"),
]


@pytest.fixture(scope="module")
def server(tmp_path_factory, smollm2):  # smollm2: converts the weights once, before the server starts
    store = tmp_path_factory.mktemp("store")
    args = ["--model", "smollm2-135m", "--store", f"file://{store}", "--device", "cpu"]
    proc, base = start_serve(*args, "--quant", "exact", "--chunk-tokens", "32", "--max-batch", "4")
    yield proc, base
    if proc.poll() is None:
        proc.kill()
        proc.wait()


def _post(base: str, body: object, path: str | None = None) -> httpx.Response:
    path = path or ("/v1/chat/completions" if isinstance(body, dict) and "messages" in body else "/v1/completions")
    return httpx.post(base + path, content=json.dumps(body), headers={"content-type": "application/json"}, timeout=120)


def _answer(r: httpx.Response) -> str:
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    return choice["message"]["content"] if "message" in choice else choice["text"]


def test_burst_of_valid_and_invalid_requests(server):
    _, base = server
    alone = [_answer(_post(base, body)) for body in VALID]
    jobs = [(None, b) for b in VALID * 2] + INVALID
    with concurrent.futures.ThreadPoolExecutor(len(jobs)) as pool:
        futs = [pool.submit(_post, base, body, path) for path, body in jobs]
        results = [f.result() for f in futs]
    for (path, body), r in zip(jobs, results):
        if path is None:
            assert _answer(r) == alone[VALID.index(body)], body
        else:
            assert 400 <= r.status_code < 500, (body if len(str(body)) < 200 else path, r.status_code, r.text[:300])
            msg = r.json()["error"]["message"]
            assert isinstance(msg, str) and msg
    health = httpx.get(base + "/health", timeout=10)
    assert health.status_code == 200 and health.json()["status"] == "ok"
    metrics = httpx.get(base + "/metrics", timeout=10).text
    assert 'kvcodec_requests_total{finish_reason="error"}' not in metrics


def _metric(base: str, sample: str) -> float:
    for ln in httpx.get(base + "/metrics", timeout=10).text.splitlines():
        if ln.startswith(sample + " "):
            return float(ln.split()[-1])
    return 0.0


def _aborted(base: str) -> float:
    return _metric(base, 'kvcodec_requests_total{finish_reason="abort"}')


def _wait_until(condition, what: str, seconds: float = 60) -> None:  # noqa: ANN001 - condition: () -> bool
    """Poll `condition` until it holds (generous for a loaded CI machine; returns as soon as it does)."""
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, f"{what}: not within {seconds} s"
        time.sleep(0.05)


def test_vanished_client_request_is_cancelled(server):
    _, base = server
    before = _aborted(base)
    body = json.dumps({"prompt": "Count slowly:", "max_tokens": 4000, "ignore_eos": True}).encode()
    port = int(base.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port)) as s:
        s.sendall(
            b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            + f"Content-Length: {len(body)}\r\n\r\n".encode()
            + body
        )
        generated = _metric(base, "kvcodec_generated_tokens_total")
        _wait_until(lambda: _metric(base, "kvcodec_generated_tokens_total") > generated, "the request generating")
    _wait_until(lambda: _aborted(base) > before, "the request aborted")
    assert _aborted(base) == before + 1
    assert httpx.get(base + "/health", timeout=10).status_code == 200


def test_sigterm_of_a_busy_server_stops_it_within_seconds(server):
    proc, base = server
    pool = concurrent.futures.ThreadPoolExecutor(2)
    for _ in range(2):
        pool.submit(_post, base, {"prompt": "Tell a long story:", "max_tokens": 4000, "ignore_eos": True})
    time.sleep(2.0)
    assert proc.poll() is None
    t0 = time.monotonic()
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=20)
    finally:
        pool.shutdown(wait=False, cancel_futures=True)
    out = proc.stdout.read()
    assert time.monotonic() - t0 < 10, out[-2000:]
    # the encode workers' start barrier outlived the process (uvicorn ends it by the signal, no exit handlers)
    assert "leaked semaphore" not in out, out[-2000:]


def test_the_default_temporary_store_is_deleted_when_the_server_stops(tmp_path, smollm2):
    """Without --store, serve stores into a temporary directory of its own: gone once it stops."""
    proc, base = start_serve(
        "--model", "smollm2-135m", "--device", "cpu", "--quant", "exact", env={"TMPDIR": str(tmp_path)}
    )
    try:
        made = list(tmp_path.glob("kvcodec-store-*"))
        assert len(made) == 1 and made[0].is_dir()
        assert _answer(_post(base, {"prompt": "The store keeps", "max_tokens": 2}))  # something stored
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert not list(tmp_path.glob("kvcodec-store-*")), proc.stdout.read()[-2000:]
