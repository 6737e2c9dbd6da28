"""How much a background store slows a Python-bound serving thread (issue 24, target 2): the main
thread runs small torch ops in a loop (a small model's kernel launches are Python-bound: each op
needs the interpreter lock), timed while nothing else runs, then while a store encodes KV
continuously on another thread under given Background settings (workers, nice). Reports the
loop's time over the idle loop's (ratios, interleaved repeats).

    python benchmarks/probes/store_gil.py --settings 1:0,1:10 --repeat 5 --out results/store-gil-cpu.json
"""

from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time

import torch

from kvbench.results import write_result


def loop(iters: int) -> float:
    a = torch.randn(64, 64)
    t0 = time.perf_counter()
    for _ in range(iters):
        a = torch.tanh(a @ a * 0.01 + 1.0)
    return time.perf_counter() - t0


def encode_forever(stop: threading.Event, workers: int, nice: int, kv: torch.Tensor, config) -> None:  # noqa: ANN001
    from kvcodec.codecs.hevc.encode import Background, background, encode_chunks

    with background(Background(workers, nice)):
        while not stop.is_set():
            encode_chunks(kv, config)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--settings", default="1:0,1:10", help="background WORKERS:NICE[:SWITCH_MS] list (SWITCH_MS: switch interval)"
    )
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--iters", type=int, default=3000)
    ap.add_argument("--tokens", type=int, default=512, help="KV tokens per encode (SmolLM2-135M's shape)")
    ap.add_argument("--switch-interval", type=float, default=None, help="sys.setswitchinterval for the run [5 ms]")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    from kvcodec import CodecConfig
    from kvcodec.codecs.hevc.encode import encode_chunks

    torch.set_num_threads(1)
    if args.switch_interval:
        sys.setswitchinterval(args.switch_interval)
    kv = (torch.randn(30, 2, args.tokens, 3, 64) * 2).half()  # SmolLM2-135M: 30 layers, 3 KV heads, dim 64
    config = CodecConfig()
    encode_chunks(kv, config)  # coding plan searched once, outside the timing
    default_si = sys.getswitchinterval()
    settings = [(s, *(s.split(":") + [""])[:3]) for s in args.settings.split(",")]
    ratios: dict[str, list[float]] = {s[0]: [] for s in settings}
    idle_s = []
    for _ in range(args.repeat):
        sys.setswitchinterval(default_si)
        idle = loop(args.iters)
        idle_s.append(idle)
        for name, w, n, si in settings:  # each repeat: every setting, over the same idle loop
            w, n = int(w), int(n)
            sys.setswitchinterval(float(si) / 1000 if si else default_si)
            stop = threading.Event()
            t = threading.Thread(target=encode_forever, args=(stop, w, n, kv, config))
            t.start()
            time.sleep(0.5)  # the encoder running
            busy = loop(args.iters)
            stop.set()
            t.join()
            ratios[name].append(round(busy / idle, 3))
    sys.setswitchinterval(default_si)
    doc = {
        "command": "python benchmarks/probes/store_gil.py " + " ".join(sys.argv[1:]),
        "iters": args.iters,
        "switch_interval_s": sys.getswitchinterval(),
        "kv_tokens": args.tokens,
        "idle_loop_s_median": round(statistics.median(idle_s), 4),
        "slowdown": {k: {"each": v, "median": statistics.median(v)} for k, v in ratios.items()},
    }
    lines = [
        "# A Python-bound loop beside a background store (encode threads at WORKERS:NICE)",
        "",
        f"`{doc['command']}`",
        "",
        f"Interpreter switch interval {sys.getswitchinterval() * 1000:g} ms; the loop's torch ops on 1 thread; KV "
        f"{args.tokens} tokens of SmolLM2-135M's shape (random), the default codec (HEVC int8).",
        "",
        "| background workers:nice[:switch ms] | loop time / idle loop time (each -> median) |",
        "|---|---|",
    ]
    for k, v in doc["slowdown"].items():
        lines.append(f"| {k} | {', '.join(f'{x:.2f}' for x in v['each'])} -> **{v['median']:.2f}** |")
    print("\n".join(lines))
    print("wrote", write_result(args.out, doc, lines))


if __name__ == "__main__":
    main()
