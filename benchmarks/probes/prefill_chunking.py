"""Probe: what does cutting a prefill into pieces cost? (why the engine cuts prompts only while
other requests are decoding).

One real model prefills the same prompt in one forward and in pieces of --piece tokens (each piece
attends to the cache of the earlier ones), interleaved for --rounds rounds; the medians and the
ratio go to a JSON + markdown result. Run from the checkout root:

    python benchmarks/probes/prefill_chunking.py --tokens 1024 --piece 256 --out benchmarks/results/prefill-chunking-cpu
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch

from kvbench.results import write_result
from kvcodec.integrations.hf import forward_ids
from kvcodec.models import load_model
from kvcodec.models.texts import load_text


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--text", default="pg/worked")
    ap.add_argument("--tokens", type=int, default=1024)
    ap.add_argument("--piece", type=int, default=256)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    model, tok = load_model(a.model)
    ids = torch.tensor(tok(load_text(a.text), add_special_tokens=False)["input_ids"][: a.tokens])
    forward_ids(model, ids[:64])  # warm-up
    times: dict[str, list[float]] = {"one forward": [], f"pieces of {a.piece}": []}
    for _ in range(a.rounds):
        for name, piece in zip(times, (None, a.piece)):
            t0 = time.perf_counter()
            forward_ids(model, ids, chunk_tokens=piece)
            times[name].append(time.perf_counter() - t0)
    med = {k: statistics.median(v) for k, v in times.items()}
    ratio = med[f"pieces of {a.piece}"] / med["one forward"]
    doc = {
        "command": " ".join(["python", "benchmarks/probes/prefill_chunking.py", *sys.argv[1:]]),
        "model": a.model,
        "tokens": int(ids.numel()),
        "piece": a.piece,
        "rounds": a.rounds,
        "seconds": times,
        "median_s": med,
        "pieces_over_one_forward": ratio,
    }
    md = [
        f"# Prefill in one forward vs in pieces of {a.piece} ({a.model}, {ids.numel()} tokens)",
        "",
        f"`{doc['command']}`",
        "",
        "| prefill | median s | rounds (s) |",
        "|---|---|---|",
        *(f"| {k} | {med[k]:.2f} | {', '.join(f'{x:.2f}' for x in v)} |" for k, v in times.items()),
        "",
        f"Pieces take {ratio:.2f}x the time of one forward. The development CPU is shared: see the",
        "JSON's machine.load_avg_1m; the rounds are interleaved so that load hits both alike.",
    ]
    print(write_result(a.out, doc, md))


if __name__ == "__main__":
    main()
