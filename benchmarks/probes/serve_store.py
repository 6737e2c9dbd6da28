"""Storing while serving (issue 24, target 2): the engine `kvcodec serve` runs, under a stream of new
prompts, with storing on and off in the same process; TTFT of each request, and from the engine's
/metrics: prefixes and tokens stored, stores dropped (bounded backlog), store lag.

Each mode gets its own new prompts (none was seen or stored before), submitted at a fixed rate
from a thread (as a server's requests arrive), each generating a few tokens. The KV stored per
second is counted as fp16 bytes (2 per value) over the stream's duration, as `bench encode` does.

    python benchmarks/probes/serve_store.py --model DIR --docs docs.jsonl --requests 80 --rate 8 \
        --store file:///tmp/serve-store --out results/serve-store-h200.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

from kvbench.results import write_result

METRICS = (
    "kvcodec_stored_prefixes_total",
    "kvcodec_stored_tokens_total",
    "kvcodec_stored_chunks_total",
    "kvcodec_stores_dropped_total",
    "kvcodec_store_errors_total",
    "kvcodec_store_backlog",
    "kvcodec_store_lag_seconds_sum",
    "kvcodec_store_lag_seconds_count",
)


def _metrics(engine) -> dict[str, float]:  # noqa: ANN001
    out = {}
    for line in engine.metrics.render().decode().splitlines():
        name, _, value = line.partition(" ")
        if name in METRICS:
            out[name] = float(value)
    return out


def _pct(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, int(q * len(s)))]


def run_mode(model, tokenizer, prompts: list[str], args: argparse.Namespace, store: bool) -> dict:  # noqa: ANN001
    from kvcodec.engine import Engine
    from kvcodec.engine.storer import StorePolicy

    url = f"{args.store.rstrip('/')}-{'on' if store else 'off'}"
    engine = Engine(model, tokenizer=tokenizer, store_url=url, store_policy=StorePolicy(enabled=store))
    engine.generate(prompts[0], max_new_tokens=args.new_tokens)  # warm-up (kernels, plan cache)
    engine.storer.flush()
    before = _metrics(engine)
    engine.start()
    reqs, gap = [], 1.0 / args.rate
    t0 = time.perf_counter()
    for i, p in enumerate(prompts[1:]):  # arrivals at a fixed rate
        time.sleep(max(0.0, t0 + i * gap - time.perf_counter()))
        reqs.append(engine.submit(p, _params(args)))
    for r in reqs:
        r.done.wait()
    served = time.perf_counter() - t0
    at_end = _metrics(engine)
    t1 = time.perf_counter()
    engine.storer.flush()
    drained = time.perf_counter() - t1
    after = _metrics(engine)
    engine.close()
    ttft = [r.ttft for r in reqs if r.ttft is not None]
    layers, kv_heads, head_dim = _kv_dims(model)
    per_token = layers * 2 * kv_heads * head_dim * 2
    stored_tokens = at_end["kvcodec_stored_tokens_total"] - before["kvcodec_stored_tokens_total"]
    lag_n = after["kvcodec_store_lag_seconds_count"] - before["kvcodec_store_lag_seconds_count"]
    lag_sum = after["kvcodec_store_lag_seconds_sum"] - before["kvcodec_store_lag_seconds_sum"]
    return {
        "storing": store,
        "requests": len(reqs),
        "prompt_tokens_mean": round(statistics.mean(r.prompt_len for r in reqs), 1),
        "served_s": round(served, 3),
        "ttft_p50_s": round(statistics.median(ttft), 4),
        "ttft_p90_s": round(_pct(ttft, 0.9), 4),
        "ttft_mean_s": round(statistics.mean(ttft), 4),
        "stored_prefixes_during": at_end["kvcodec_stored_prefixes_total"] - before["kvcodec_stored_prefixes_total"],
        "stored_prefixes_total": after["kvcodec_stored_prefixes_total"] - before["kvcodec_stored_prefixes_total"],
        "stored_per_s": round(
            (at_end["kvcodec_stored_prefixes_total"] - before["kvcodec_stored_prefixes_total"]) / served, 2
        ),
        "stored_mb_per_s_fp16": round(stored_tokens * per_token / served / 1e6, 1),
        "dropped": after["kvcodec_stores_dropped_total"] - before["kvcodec_stores_dropped_total"],
        "store_errors": after["kvcodec_store_errors_total"] - before["kvcodec_store_errors_total"],
        "backlog_at_end": at_end["kvcodec_store_backlog"],
        "drain_s": round(drained, 3),
        "lag_mean_s": round(lag_sum / lag_n, 3) if lag_n else None,
    }


def _params(args: argparse.Namespace):  # noqa: ANN202
    from kvcodec.engine.sequence import SamplingParams

    return SamplingParams(max_new_tokens=args.new_tokens, temperature=0.0)


def _kv_dims(model) -> tuple[int, int, int]:  # noqa: ANN001
    from kvcodec.models.registry import kv_shape

    return kv_shape(model)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True, help="registered name or model folder")
    ap.add_argument("--docs", required=True, help="JSONL of prompts (field text)")
    ap.add_argument("--requests", type=int, default=80, help="requests per mode")
    ap.add_argument("--rate", type=float, default=8.0, help="requests per second")
    ap.add_argument("--new-tokens", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=2048, help="prompt tokens kept")
    ap.add_argument("--store", default="file:///tmp/kvcodec-serve-store", help="store URL prefix (-on / -off)")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    from kvcodec.ingest.run import load_for_ingest

    model, tokenizer, device = load_for_ingest(args.model)
    texts = [json.loads(line)["text"] for line in Path(args.docs).read_text().splitlines() if line.strip()]
    n = args.requests + 1
    if len(texts) < 2 * n:
        sys.exit(f"need {2 * n} documents, {args.docs} has {len(texts)}")

    def prompt(t: str) -> str:  # at most --max-tokens tokens
        return tokenizer.decode(tokenizer(t)["input_ids"][: args.max_tokens])

    runs = [
        run_mode(model, tokenizer, [prompt(t) for t in texts[:n]], args, store=False),
        run_mode(model, tokenizer, [prompt(t) for t in texts[n : 2 * n]], args, store=True),
    ]
    off, on = runs
    doc = {
        "command": "python benchmarks/probes/serve_store.py " + " ".join(sys.argv[1:]),
        "model": Path(args.model).name,
        "device": str(device),
        "gpu": _gpu(),
        "rate_per_s": args.rate,
        "runs": runs,
        "ttft_p50_on_vs_off": round(on["ttft_p50_s"] / off["ttft_p50_s"] - 1, 4),
    }
    lines = [
        f"# Storing while serving: {doc['model']} on {doc['gpu'] or doc['device']}",
        "",
        f"`{doc['command']}`",
        "",
        f"{args.requests} new prompts per mode at {args.rate:g}/s, {args.new_tokens} tokens each; the engine of "
        "`kvcodec serve` in one process, storing off then on (each mode its own new prompts).",
        "",
        "| storing | prompt tokens | TTFT p50 s | p90 s | stored/s | stored MB/s fp16 | dropped | lag mean s | "
        "backlog at end | drain s |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in runs:
        lines.append(
            f"| {'on' if r['storing'] else 'off'} | {r['prompt_tokens_mean']:.0f} | {r['ttft_p50_s']:.4f} | "
            f"{r['ttft_p90_s']:.4f} | {r['stored_per_s']:.2f} | {r['stored_mb_per_s_fp16']:.1f} | {r['dropped']:.0f} | "
            f"{r['lag_mean_s'] if r['lag_mean_s'] is not None else '-'} | {r['backlog_at_end']:.0f} | {r['drain_s']:.2f} |"
        )
    lines += [
        "",
        f"p50 TTFT with storing on vs off: {doc['ttft_p50_on_vs_off']:+.1%}. stored/s and MB/s: prefixes stored "
        "while the stream ran (kvcodec_stored_prefixes_total / tokens), over its duration; dropped: "
        "kvcodec_stores_dropped_total (the bounded backlog); lag: kvcodec_store_lag_seconds (prefill to stored).",
    ]
    path = write_result(args.out, doc, lines)
    print("\n".join(lines[6:]))
    print("wrote", path)


def _gpu() -> str | None:
    import torch

    return torch.cuda.get_device_name(0) if torch.cuda.is_available() else None


if __name__ == "__main__":
    main()
