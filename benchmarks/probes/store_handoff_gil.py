"""Does the store hand-off keep a serving thread waiting for the interpreter lock? (issue 24, target 2)

The main thread plays the engine: a Python-bound loop of small torch ops (each op releases and takes
back the interpreter lock, as a GPU engine's kernel launches do), timed in rounds. Between rounds it
hands the KV of a new prompt to a KVStorer (`submit`, as the engine does after a first token) at
--rate, with the engine's default storing (encode worker processes; the serving process's storer
threads gather and copy the KV into shared memory and wait for the worker). Rounds alternate in
blocks: storing (stores in flight) and idle (the backlog drained, no store running).

Each round's wall time is split with the thread's own clocks (Linux /proc schedstat):
cpu (the thread ran), runqueue (runnable, kept off a CPU by the OS) and the rest: waits for the
interpreter lock (the loop makes no other waits). Reported as storing over idle in the same run.
On a machine of few cores the storer's copies (on the CPU when the KV is there) and the encode
workers take CPUs: that shows as runqueue and cpu time, apart from the lock waits.

    python benchmarks/probes/store_handoff_gil.py --tokens 2048 --rate 8 --blocks 6 --out results/NAME.json
"""

from __future__ import annotations

import argparse
import random
import shutil
import statistics
import tempfile
import threading
import time

import torch

from kvbench.results import write_result


def _schedstat() -> tuple[int, int]:
    """(ns on a CPU, ns runnable but waiting for one) of the calling thread; (0, 0) without /proc."""
    try:
        with open(f"/proc/self/task/{threading.get_native_id()}/schedstat") as f:
            run, wait = f.read().split()[:2]
        return int(run), int(wait)
    except (OSError, ValueError):
        return 0, 0


def rounds(n: int, iters: int, device: torch.device, between=None) -> list[tuple[float, float, float]]:  # noqa: ANN001
    """n timed rounds of the loop: (wall, cpu, runqueue) seconds each; between() runs before each."""
    a = torch.randn(64, 64, device=device)
    out = []
    for _ in range(n):
        if between is not None:
            between()
        run0, q0 = _schedstat()
        t0 = time.perf_counter()
        for _ in range(iters):
            a = torch.tanh(a @ a * 0.01 + 1.0)
        if device.type == "cuda":
            torch.cuda.current_stream().synchronize()
        wall = time.perf_counter() - t0
        run1, q1 = _schedstat()
        out.append((wall, (run1 - run0) / 1e9, (q1 - q0) / 1e9))
    return out


class Prompts:
    """New prompts' token ids and a Qwen2.5-0.5B-shaped cache (24 layers, 2 KV heads x 64) per prompt."""

    def __init__(self, tokens: int, device: torch.device, caches: int = 8) -> None:
        shape = (1, 2, tokens, 64)
        self.tokens = tokens
        self.caches = [
            [(torch.randn(shape, device=device).half(), torch.randn(shape, device=device).half()) for _ in range(24)]
            for _ in range(caches)
        ]
        self.i = 0

    def next(self) -> tuple[list[int], list]:
        self.i += 1
        return [random.randrange(150000) for _ in range(self.tokens)], self.caches[self.i % len(self.caches)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=2048, help="prompt tokens per store")
    ap.add_argument("--rate", type=float, default=8.0, help="stores handed over per second while storing")
    ap.add_argument("--blocks", type=int, default=6, help="storing / idle blocks, alternating")
    ap.add_argument("--block-s", type=float, default=3.0, help="seconds of rounds per block")
    ap.add_argument("--iters", type=int, default=200, help="loop iterations per round")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    from kvcodec.codecs.hevc.codec import HevcCodec
    from kvcodec.config import CodecConfig
    from kvcodec.engine.storer import KVStorer, StorePolicy
    from kvcodec.fetcher import PrefixCache
    from kvcodec.store import open_store

    device = torch.device(args.device)
    torch.set_num_threads(1)  # no intra-op pool: the loop's thread waits for nothing but the lock
    folder = tempfile.mkdtemp(prefix="store-handoff-")
    url = f"file://{folder}"
    cache = PrefixCache(open_store(url), "qwen2.5-shaped", HevcCodec(CodecConfig()), "cpu")
    storer = KVStorer(cache, StorePolicy(), 256, store_url=url)
    storer.start()
    prompts = Prompts(args.tokens, device)
    storer.submit(*prompts.next())  # the first store: coding decisions, shared buffers
    storer.flush()
    rounds(20, args.iters, device)  # warm-up
    one = statistics.median(w for w, _, _ in rounds(10, args.iters, device))
    per_block = max(3, int(args.block_s / one))
    hand_off: list[tuple[float, float]] = []
    gap, due = 1.0 / args.rate, [0.0]

    def feed() -> None:  # hand over a store when one is due, as the engine does after a prefill
        now = time.perf_counter()
        if now >= due[0]:
            due[0] = max(due[0] + gap, now - gap)
            ids, layers = prompts.next()
            t, c = time.perf_counter(), time.thread_time()
            storer.submit(ids, layers)
            hand_off.append((time.perf_counter() - t, time.thread_time() - c))

    data: dict[str, list] = {"storing": [], "idle": []}
    dropped0, stored0 = storer.dropped, storer.stored_prefixes
    t_storing = 0.0
    for b in range(args.blocks * 2):
        if b % 2 == 0:
            due[0] = time.perf_counter()
            t0 = time.perf_counter()
            data["storing"] += rounds(per_block, args.iters, device, feed)
            t_storing += time.perf_counter() - t0
        else:
            storer.flush()
            data["idle"] += rounds(per_block, args.iters, device)
    storer.flush()
    storer.shutdown()
    shutil.rmtree(folder, ignore_errors=True)
    doc = _summary(args, data, hand_off, one, per_block)
    doc.update(
        stored=storer.stored_prefixes - stored0,
        dropped=storer.dropped - dropped0,
        stored_per_s=round((storer.stored_prefixes - stored0) / t_storing, 2),
        encode_in=storer.encode_in,
    )
    write_result(args.out, doc, _lines(doc))
    print("\n".join(_lines(doc)))


def _summary(args: argparse.Namespace, data: dict, hand_off: list, one: float, per_block: int) -> dict:
    out = {
        "command": "python benchmarks/probes/store_handoff_gil.py "
        f"--tokens {args.tokens} --rate {args.rate:g} --blocks {args.blocks} --block-s {args.block_s:g} "
        f"--iters {args.iters} --device {args.device}",
        "device": args.device,
        "round_s": round(one, 5),
        "rounds_per_block": per_block,
        "hand_off_ms": {
            "p50": round(1e3 * statistics.median(w for w, _ in hand_off), 3) if hand_off else None,
            "max": round(1e3 * max(w for w, _ in hand_off), 3) if hand_off else None,
            "cpu_p50": round(1e3 * statistics.median(c for _, c in hand_off), 3) if hand_off else None,
            "n": len(hand_off),
        },
    }
    for mode, rs in data.items():
        lock = [max(0.0, w - c - q) for w, c, q in rs]
        out[mode] = {
            "rounds": len(rs),
            "wall_p50_ms": round(1e3 * statistics.median(w for w, _, _ in rs), 3),
            "wall_mean_ms": round(1e3 * statistics.mean(w for w, _, _ in rs), 3),
            "cpu_mean_ms": round(1e3 * statistics.mean(c for _, c, _ in rs), 3),
            "runqueue_mean_ms": round(1e3 * statistics.mean(q for _, _, q in rs), 3),
            "lock_wait_mean_ms": round(1e3 * statistics.mean(lock), 3),
            "lock_wait_max_ms": round(1e3 * max(lock), 3),
        }
    s, i = out["storing"], out["idle"]
    out["storing_over_idle"] = {
        k: round(s[k] / i[k], 3) if i[k] else None for k in ("wall_p50_ms", "wall_mean_ms", "cpu_mean_ms")
    }
    out["lock_wait_added_ms_per_round"] = round(s["lock_wait_mean_ms"] - i["lock_wait_mean_ms"], 3)
    return out


def _lines(doc: dict) -> list[str]:
    s, i, r = doc["storing"], doc["idle"], doc["storing_over_idle"]
    return [
        f"# Store hand-off and the interpreter lock ({doc['device']})",
        "",
        f"`{doc['command']}`",
        "",
        f"Rounds of a Python-bound torch loop ({doc['round_s'] * 1e3:.2f} ms each idle), "
        f"{doc['rounds_per_block']} per block, blocks alternating storing / idle; "
        f"{doc['stored']} stores encoded ({doc['stored_per_s']}/s while storing), {doc['dropped']} dropped, "
        f"encoded in {doc['encode_in']}; hand-off (KVStorer.submit on the loop's thread) p50 "
        f"{doc['hand_off_ms']['p50']} ms (its thread's cpu p50 {doc['hand_off_ms']['cpu_p50']} ms), max "
        f"{doc['hand_off_ms']['max']} ms.",
        "",
        "| rounds | wall p50 ms | wall mean ms | cpu mean ms | runqueue mean ms | lock wait mean ms | lock wait max ms |",
        "|---|---|---|---|---|---|---|",
        *(
            f"| {m} ({d['rounds']}) | {d['wall_p50_ms']} | {d['wall_mean_ms']} | {d['cpu_mean_ms']} | "
            f"{d['runqueue_mean_ms']} | {d['lock_wait_mean_ms']} | {d['lock_wait_max_ms']} |"
            for m, d in (("storing", s), ("idle", i))
        ),
        "",
        f"Storing over idle: wall p50 {r['wall_p50_ms']}, mean {r['wall_mean_ms']}, cpu {r['cpu_mean_ms']}; "
        f"lock wait added per round {doc['lock_wait_added_ms_per_round']} ms. Lock wait: wall less cpu less "
        "runqueue (the thread's /proc schedstat).",
    ]


if __name__ == "__main__":
    main()
