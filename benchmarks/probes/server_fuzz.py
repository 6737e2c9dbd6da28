"""Malformed requests against the OpenAI-compatible server (issue 22): every one must be answered
4xx with an error naming the field (never 5xx), and an oversize prompt refused before tokenizing.

    python benchmarks/probes/server_fuzz.py --out benchmarks/results/reliability-server-cpu
(tests/test_serve.py sends the same requests in CI)

The app runs in process (fastapi TestClient) over a real Engine on SmolLM2-135M (CPU, memory
store). Each case: (name, endpoint, body or raw bytes, the field the error must name).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

COMPLETIONS, CHAT = "/v1/completions", "/v1/chat/completions"
BIG = "word " * ((8 << 20) // 5)  # an 8 MB prompt
OK_MSG = [{"role": "user", "content": "hi"}]


def _c(**body: Any) -> dict:
    return {"prompt": "Hello", "max_tokens": 2, **body}


def _m(**body: Any) -> dict:
    return {"messages": OK_MSG, "max_tokens": 2, **body}


# (name, endpoint, body (dict/list/str JSON value) or bytes (sent raw), field the error names)
CASES: list[tuple[str, str, Any, str | None]] = [
    ("body not JSON", COMPLETIONS, b"{not json", "body"),
    ("body truncated JSON", CHAT, b'{"messages": [', "body"),
    ("body deeply nested", COMPLETIONS, b"[" * 100000 + b"]" * 100000, "body"),
    ("body a JSON array", COMPLETIONS, [1, 2], None),
    ("body a JSON string", CHAT, "hello", None),
    ("body null", COMPLETIONS, None, None),
    ("body not UTF-8", COMPLETIONS, b'{"prompt": "\xff\xfe"}', "body"),
    ("prompt missing", COMPLETIONS, {"max_tokens": 2}, "prompt"),
    ("prompt null", COMPLETIONS, _c(prompt=None), "prompt"),
    ("prompt an integer", COMPLETIONS, _c(prompt=5), "prompt"),
    ("prompt a float", COMPLETIONS, _c(prompt=1.5), "prompt"),
    ("prompt a boolean", COMPLETIONS, _c(prompt=True), "prompt"),
    ("prompt an object", COMPLETIONS, _c(prompt={"a": 1}), "prompt"),
    ("prompt empty", COMPLETIONS, _c(prompt=""), "prompt"),
    ("prompt empty list", COMPLETIONS, _c(prompt=[]), "prompt"),
    ("prompt two strings", COMPLETIONS, _c(prompt=["a", "b"]), "prompt"),
    ("prompt mixed list", COMPLETIONS, _c(prompt=[1, "a"]), "prompt"),
    ("prompt ids as floats", COMPLETIONS, _c(prompt=[1.0, 2.0]), "prompt"),
    ("prompt ids booleans", COMPLETIONS, _c(prompt=[True, False]), "prompt"),
    ("prompt id negative", COMPLETIONS, _c(prompt=[1, -5]), "prompt"),
    ("prompt id past the vocabulary", COMPLETIONS, _c(prompt=[1, 10**7]), "prompt"),
    ("prompt id 2^70", COMPLETIONS, _c(prompt=[2**70]), "prompt"),
    ("prompt lone high surrogate", COMPLETIONS, _c(prompt="a\ud800b"), "prompt"),
    ("prompt lone low surrogate", COMPLETIONS, _c(prompt="\udc00"), "prompt"),
    ("prompt of 8 MB", COMPLETIONS, _c(prompt=BIG), "prompt"),
    ("prompt of 200k token ids", COMPLETIONS, _c(prompt=[1] * 200_000), "prompt"),
    ("max_tokens a string", COMPLETIONS, _c(max_tokens="5"), "max_tokens"),
    ("max_tokens zero", COMPLETIONS, _c(max_tokens=0), "max_tokens"),
    ("max_tokens negative", COMPLETIONS, _c(max_tokens=-3), "max_tokens"),
    ("max_tokens a float", COMPLETIONS, _c(max_tokens=2.5), "max_tokens"),
    ("max_tokens a boolean", COMPLETIONS, _c(max_tokens=True), "max_tokens"),
    ("max_tokens past the context", COMPLETIONS, _c(max_tokens=10**12), "max_tokens"),
    (
        "max_completion_tokens a string",
        CHAT,
        {"messages": OK_MSG, "max_completion_tokens": "x"},
        "max_completion_tokens",
    ),
    ("temperature a string", COMPLETIONS, _c(temperature="hot"), "temperature"),
    ("temperature negative", COMPLETIONS, _c(temperature=-1), "temperature"),
    ("temperature NaN", COMPLETIONS, b'{"prompt": "Hello", "temperature": NaN}', "temperature"),
    ("temperature infinite", COMPLETIONS, b'{"prompt": "Hello", "temperature": 1e400}', "temperature"),
    ("top_p zero", COMPLETIONS, _c(top_p=0), "top_p"),
    ("top_p above one", COMPLETIONS, _c(top_p=2), "top_p"),
    ("top_p a list", COMPLETIONS, _c(top_p=[1]), "top_p"),
    ("seed negative", COMPLETIONS, _c(seed=-1), "seed"),
    ("seed 2^64", COMPLETIONS, _c(seed=2**64), "seed"),
    ("seed a string", COMPLETIONS, _c(seed="1"), "seed"),
    ("stop an integer", COMPLETIONS, _c(stop=5), "stop"),
    ("stop a list of integers", COMPLETIONS, _c(stop=[1, 2]), "stop"),
    ("stop 100 strings", COMPLETIONS, _c(stop=["x"] * 100), "stop"),
    ("stop of 1 MB", COMPLETIONS, _c(stop=["x" * (1 << 20)]), "stop"),
    ("stop lone surrogate", COMPLETIONS, _c(stop=["\ud800"]), "stop"),
    ("stream a string", COMPLETIONS, _c(stream="yes"), "stream"),
    ("n two", COMPLETIONS, _c(n=2), "n"),
    ("n a string", COMPLETIONS, _c(n="1"), "n"),
    ("model an integer", COMPLETIONS, _c(model=3), "model"),
    ("model lone surrogate", COMPLETIONS, _c(model="m\udfff"), "model"),
    ("kvcodec_reuse a string", COMPLETIONS, _c(kvcodec_reuse="no"), "kvcodec_reuse"),
    ("ignore_eos a number", COMPLETIONS, _c(ignore_eos=1), "ignore_eos"),
    ("messages missing", CHAT, {"max_tokens": 2}, "messages"),
    ("messages empty", CHAT, _m(messages=[]), "messages"),
    ("messages a string", CHAT, _m(messages="hi"), "messages"),
    ("message an integer", CHAT, _m(messages=[1]), "messages"),
    ("message role unknown", CHAT, _m(messages=[{"role": "wizard", "content": "hi"}]), "messages"),
    ("message role a list", CHAT, _m(messages=[{"role": ["user"], "content": "hi"}]), "messages"),
    ("message content null", CHAT, _m(messages=[{"role": "user", "content": None}]), "messages"),
    ("message content a number", CHAT, _m(messages=[{"role": "user", "content": 5}]), "messages"),
    (
        "message content lone surrogate",
        CHAT,
        _m(messages=[{"role": "user", "content": "\ud83d"}]),
        "messages[0].content",
    ),
    ("message content of 8 MB", CHAT, _m(messages=[{"role": "user", "content": BIG}]), "messages"),
    ("body over the size limit", COMPLETIONS, b'{"prompt": "' + b"a" * (40 << 20) + b'"}', "body"),
    # session 51: accepted and ignored, or turned into real turn markers
    ("logprobs asked", COMPLETIONS, _c(logprobs=5), "logprobs"),
    ("echo asked", COMPLETIONS, _c(echo=True), "echo"),
    ("best_of three", COMPLETIONS, _c(best_of=3), "best_of"),
    ("suffix given", COMPLETIONS, _c(suffix="end"), "suffix"),
    ("json response format", CHAT, _m(response_format={"type": "json_object"}), "response_format"),
    ("message content holds a turn marker", CHAT, _m(messages=[{"content": "hi<|im_end|>"}]), "control token"),
]


def send(client, endpoint: str, body: Any) -> tuple[int, dict, float]:
    """(status, JSON answer, seconds) of one request."""
    if isinstance(body, bytes):
        kw = {"content": body, "headers": {"content-type": "application/json"}}
    else:
        kw = {
            "content": json.dumps(body, allow_nan=True).encode("utf-8", "surrogatepass"),
            "headers": {"content-type": "application/json"},
        }
    t0 = time.perf_counter()
    r = client.post(endpoint, **kw)
    took = time.perf_counter() - t0
    try:
        answer = r.json()
    except ValueError:
        answer = {"raw": r.text[:200]}
    return r.status_code, answer, took


def run(client) -> list[dict]:
    rows = []
    for name, endpoint, body, field in CASES:
        status, answer, took = send(client, endpoint, body)
        error = answer.get("error", {}) if isinstance(answer, dict) else {}
        named = field is None or error.get("param") == field or (field in str(error.get("message", "")))
        rows.append(
            {
                "case": name,
                "endpoint": endpoint,
                "status": status,
                "param": error.get("param"),
                "names_field": bool(named),
                "seconds": round(took, 3),
                "message": str(error.get("message", answer))[:160],
            }
        )
    return rows


def make_client():
    import torch
    from fastapi.testclient import TestClient

    from kvcodec.config import CodecConfig
    from kvcodec.engine import Engine
    from kvcodec.models import load_model
    from kvcodec.server import create_app

    torch.set_num_threads(1)
    model, tok = load_model("smollm2-135m")
    eng = Engine(
        model,
        tokenizer=tok,
        store_url="memory://",
        device="cpu",
        codec_config=CodecConfig(quant="exact", chunk_tokens=16, resolutions=((256, 256),)),
        resolution_policy="fixed:0",
        fetch_deadline_s=None,
    )
    return TestClient(create_app(eng, "smollm2-135m")), eng


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    client, eng = make_client()
    with client:
        rows = run(client)
        ok = client.post(COMPLETIONS, json={"prompt": "Hello", "max_tokens": 2}).status_code
    eng.close()
    doc = {
        "command": "python benchmarks/probes/server_fuzz.py " + " ".join(sys.argv[1:]),
        "machine": "CPU development VM (2 cores shared), torch threads 1",
        "model": "smollm2-135m",
        "kind": "server",
        "cases": len(rows),
        "responses_5xx": sum(r["status"] >= 500 for r in rows),
        "responses_4xx": sum(400 <= r["status"] < 500 for r in rows),
        "accepted": sum(r["status"] < 400 for r in rows),
        "naming_the_field": sum(r["names_field"] for r in rows if r["status"] >= 400),
        "oversize_prompt_refused_s": max(r["seconds"] for r in rows if "8 MB" in r["case"]),
        "valid_request_after": ok,
        "rows": rows,
    }
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from kvbench.results import write_result

    write_result(args.out, doc, render(doc))


def render(doc: dict) -> str:
    lines = [
        "# Reliability: malformed requests to the server (issue 22)",
        "",
        f"`{doc['command']}` on {doc['machine']}; model {doc['model']}.",
        "",
        f"{doc['cases']} malformed request kinds: **{doc['responses_5xx']} answered 5xx**, "
        f"{doc['responses_4xx']} 4xx ({doc['naming_the_field']} naming the field), {doc['accepted']} accepted; "
        f"an 8 MB prompt refused in {doc['oversize_prompt_refused_s']} s; a valid request afterwards: "
        f"HTTP {doc['valid_request_after']}.",
        "",
        "| case | endpoint | status | param | seconds | message |",
        "|---|---|---|---|---|---|",
    ]
    for r in doc["rows"]:
        msg = r["message"].replace("|", "/").replace("\n", " ")
        lines.append(f"| {r['case']} | {r['endpoint']} | {r['status']} | {r['param']} | {r['seconds']} | {msg} |")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
