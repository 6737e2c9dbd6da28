"""Storing while serving (issue 24, target 2): the engine `kvcodec serve` runs, under a stream of new
prompts, with storing on and off in the same process; TTFT of each request, and from the engine's
/metrics: prefixes and tokens stored, stores dropped (bounded backlog), store lag.

Each mode gets its own new prompts (none was seen or stored before), submitted at a fixed rate
from a thread (as a server's requests arrive), each generating a few tokens. The KV stored per
second is counted as fp16 bytes (2 per value) over the stream's duration, as `bench encode` does.

Each mode has one engine (and its encode workers) for all its runs, warmed up with one store before the
first; the runs alternate as --modes and --repeat order them (off,on --repeat 4: four pairs).

Modes (--modes, in order, the whole list --repeat times): off (storing off), on (the engine's
default storing: encode worker processes at lower priority, the serving process only copies the KV
to shared memory), threads (the background storer's encode threads inside the serving process),
legacy (storing as before issue 24's fix: an encode thread per core at the engine's priority),
on:W:N[:P] (W encode threads at nice N in P worker processes; default: split_workers's split) or
threads:W:N (the same on threads); a mode's /pin, /nopin set StorePolicy.pin (on/nopin: the
default before pinning came). Modes /pause, /nopause (encoders stopped during prefills) were
measured at 37c070b (serve-store-h200-v2) and removed with the option.
--encode-workers / --nice set "on" and "threads" to other values than the defaults.
--random-weights: --model is a folder holding a config and a tokenizer (no weights needed): the model of that
shape with random weights, for timing where the weights cannot travel.
--blocks B: in storing modes the requests take turns, B storing then B not storing (Engine.submit's
`store`), on the same engine: the TTFT of the requests after a storing one against those after a
non-storing one, paired in time (the engine, GPU and machine drift alike for both).
The result files are written again after each run (a call cut short keeps the runs done).

Where a request's wait (arrival to its prefill's start) goes: submit (arrival to `Engine.submit`
returning on the submitting thread: tokenizer, checks, prefix lookup), queue (from there to the
prefill's start on the engine's thread: its wake-up, scheduling and the request's cache allocation),
admit (`ModelRunner.begin_prefill` alone: the cache allocation); engine store (`KVStorer.submit`
on the engine's thread after a first token); device allocations (CUDA caching-allocator segments
made during the run: cudaMalloc calls). --gil-probe adds a thread that sleeps 1 ms in a loop: how
late it runs again beyond the time the OS kept it waiting for a CPU (/proc schedstat) is time
waiting for the interpreter lock (and wake-up); its mean and the count of waits over 1 ms.

    python benchmarks/probes/serve_store.py --model DIR --docs docs.jsonl --requests 80 --rate 8 \
        --store file:///tmp/serve-store --out results/serve-store-h200.json
    python benchmarks/probes/serve_store.py --model smollm2-135m --max-tokens 512 --requests 12 \
        --rate 0.5 --modes off,legacy,on --repeat 2 --out results/serve-store-cpu.json   # essays
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


def _p50(values: list[float], digits: int = 4) -> float | None:
    return round(statistics.median(values), digits) if values else None


def _pct(values: list[float], q: float) -> float:
    s = sorted(values)
    return s[min(len(s) - 1, int(q * len(s)))]


def _cores() -> int:
    from kvcodec.layout.search import usable_cores

    return usable_cores()


FLAGS = {
    "nopin": {"pin": False},
    "pin": {"pin": True},
}


def policy_of(mode: str, args: argparse.Namespace):  # noqa: ANN201
    """The StorePolicy of a mode name (see the module doc): its base, then its /flags."""
    import dataclasses

    base, *flags = mode.split("/")
    unknown = [f for f in flags if f not in FLAGS]
    if unknown:
        sys.exit(f"unknown mode flag(s) {unknown} in {mode!r}: {sorted(FLAGS)}")
    policy = _base_policy(base, args)
    for f in flags:
        policy = dataclasses.replace(policy, **FLAGS[f])
    return policy


def _base_policy(mode: str, args: argparse.Namespace):  # noqa: ANN202
    from kvcodec.engine.storer import StorePolicy

    if mode == "off":
        return StorePolicy(enabled=False)
    if mode == "legacy":
        return StorePolicy(encode_workers=_cores(), nice=0, encode_in="threads")
    where = {"on": "processes", "threads": "threads"}
    if mode in where:
        given = {"encode_workers": args.encode_workers, "nice": args.nice}
        return StorePolicy(**{k: v for k, v in given.items() if v is not None}, encode_in=where[mode])
    if mode.split(":")[0] in where and mode.count(":") in (2, 3):
        kind, w, n, *p = mode.split(":")
        procs = int(p[0]) if p else None
        return StorePolicy(encode_workers=int(w), nice=int(n), encode_in=where[kind], encode_processes=procs)
    sys.exit(f"unknown mode {mode!r}: off, on, threads, legacy, on:WORKERS:NICE[:PROCESSES] or threads:WORKERS:NICE")


def open_engine(model, tokenizer, warm_prompt: str, args: argparse.Namespace, mode: str, tag: str):  # noqa: ANN001, ANN201
    """The engine of a mode, warmed up with one store (kernels, plan cache, encode workers up): a
    mode's engine serves every run of that mode, as a server's engine and workers live on."""
    from kvcodec.engine import Engine

    url = f"{args.store.rstrip('/')}-{tag}"
    engine = Engine(model, tokenizer=tokenizer, store_url=url, store_policy=policy_of(mode, args))
    engine.generate(warm_prompt, max_new_tokens=args.new_tokens)
    engine.storer.flush()
    return engine


def run_mode(engine, prompts: list[str], args: argparse.Namespace, mode: str) -> dict:  # noqa: ANN001
    """One stream of new `prompts` at --rate through `engine` (started, then stopped, its stores flushed)."""
    import resource

    store = engine.storer.policy.enabled
    model = engine.model
    before = _metrics(engine)
    encode_in = engine.storer.encode_in  # where the warm-up store was encoded
    processes = engine.storer.processes.processes if engine.storer.processes is not None else 0
    timers = Timers(engine)
    gil = GilProbe() if args.gil_probe else None
    engine.start()
    reqs, returned, gap = [], [], 1.0 / args.rate
    segments0 = _device_segments()
    use0, t0 = resource.getrusage(resource.RUSAGE_SELF), time.perf_counter()
    flags = _store_flags(len(prompts), args.blocks if store else 0)
    for i, p in enumerate(prompts):  # arrivals at a fixed rate
        time.sleep(max(0.0, t0 + i * gap - time.perf_counter()))
        reqs.append(engine.submit(p, _params(args), store=flags[i]))
        returned.append(time.perf_counter())
    for r in reqs:
        r.done.wait()
    served = time.perf_counter() - t0
    use1 = resource.getrusage(resource.RUSAGE_SELF)
    segments = _device_segments() - segments0
    timers.remove()
    gil_late = gil.stop() if gil is not None else {}
    at_end = _metrics(engine)
    t1 = time.perf_counter()
    engine.storer.flush()
    drained = time.perf_counter() - t1
    after = _metrics(engine)
    engine.stop()
    ttft = [r.ttft for r in reqs if r.ttft is not None]
    busy, idle_ttft = _overlaps(reqs)
    layers, kv_heads, head_dim = _kv_dims(model)
    per_token = layers * 2 * kv_heads * head_dim * 2
    stored_tokens = at_end["kvcodec_stored_tokens_total"] - before["kvcodec_stored_tokens_total"]
    lag_n = after["kvcodec_store_lag_seconds_count"] - before["kvcodec_store_lag_seconds_count"]
    lag_sum = after["kvcodec_store_lag_seconds_sum"] - before["kvcodec_store_lag_seconds_sum"]
    settings = getattr(engine.storer, "settings", None)
    return {
        "mode": mode,
        "storing": store,
        "encode_workers": getattr(settings, "workers", None) if store else None,
        "nice": getattr(settings, "nice", None) if store else None,
        "encode_in": encode_in if store else None,
        "encode_processes": processes if store else None,
        "pin": engine.storer.policy.pin if store else None,
        "worker_cpus": _worker_cpus(engine.storer.processes),
        "requests": len(reqs),
        "prompt_tokens_mean": round(statistics.mean(r.prompt_len for r in reqs), 1),
        "served_s": round(served, 3),
        "ttft_p50_s": round(statistics.median(ttft), 4),
        "ttft_p90_s": round(_pct(ttft, 0.9), 4),
        "ttft_mean_s": round(statistics.mean(ttft), 4),
        "wait_p50_s": _p50([r.prefill_start_time - r.arrival_time for r in reqs if r.prefill_start_time], 6),
        "prefill_p50_s": _p50([r.prefill_to_first_token_s for r in reqs if r.prefill_to_first_token_s is not None]),
        "submit_p50_s": _p50([t - r.arrival_time for r, t in zip(reqs, returned)], 6),
        "queue_p50_s": _p50([r.prefill_start_time - t for r, t in zip(reqs, returned) if r.prefill_start_time], 6),
        "admit_p50_s": _p50(timers.admit, 6),
        "engine_store_p50_s": _p50(timers.store, 6),
        "engine_store_max_s": round(max(timers.store), 6) if timers.store else None,
        "device_allocs": segments,
        **gil_late,
        "arrived_busy": busy,
        "ttft_p50_idle_s": round(statistics.median(idle_ttft), 4) if idle_ttft else None,
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
        "server_cpu_s": round(use1.ru_utime + use1.ru_stime - use0.ru_utime - use0.ru_stime, 3),
        "server_involuntary_switches": use1.ru_nivcsw - use0.ru_nivcsw,
        **_blocks(reqs, flags, args.blocks if store else 0),
    }


def _store_flags(n: int, block: int) -> list[bool]:
    """Each request's store flag: all True, or (--blocks B) B storing then B not storing, in turn."""
    return [True] * n if block <= 0 else [(i // block) % 2 == 0 for i in range(n)]


def _blocks(reqs: list, flags: list[bool], block: int) -> dict:
    """--blocks: TTFT and prefill of the requests that follow a storing request in a storing block
    against those that follow a non-storing one (each block's first request left out: the one
    before it was of the other kind), and the ratio of the medians with its per-block-pair spread."""
    if block <= 0:
        return {}
    groups: dict[bool, list] = {True: [], False: []}
    pairs: dict[int, tuple[list, list]] = {}  # a storing turn and the non-storing one after it
    for i, (r, flag) in enumerate(zip(reqs, flags)):
        if i % block and r.ttft is not None:
            groups[flag].append(r)
            pairs.setdefault(i // (2 * block), ([], []))[0 if flag else 1].append(r.ttft)

    def p50(rs: list, key: str) -> float | None:
        values = [getattr(r, key) for r in rs if getattr(r, key) is not None]
        return round(statistics.median(values), 5) if values else None

    on, off = p50(groups[True], "ttft"), p50(groups[False], "ttft")
    each = [round(statistics.median(a) / statistics.median(b), 3) for a, b in pairs.values() if a and b]
    ttfts = {k: [round(r.ttft, 5) for r in groups[k]] for k in (True, False)}
    return {
        "blocks": block,
        "block_requests": {"storing": len(groups[True]), "not_storing": len(groups[False])},
        "block_ttft_p50_s": {"storing": on, "not_storing": off},
        "block_prefill_p50_s": {
            "storing": p50(groups[True], "prefill_to_first_token_s"),
            "not_storing": p50(groups[False], "prefill_to_first_token_s"),
        },
        "block_ttft_ratio": round(on / off, 3) if on and off else None,
        "block_ttft_ratio_90ci": _median_ratio_ci(ttfts[True], ttfts[False]),
        "block_pair_ratios": each,
        "block_ttfts_s": {"storing": ttfts[True], "not_storing": ttfts[False]},
    }


def _median_ratio_ci(a: list[float], b: list[float], rounds: int = 2000) -> list[float] | None:
    """A bootstrap 90% interval of median(a) / median(b) (fixed seed: the same runs give the same interval)."""
    import random

    if not a or not b:
        return None
    rng = random.Random(0)
    ratios = sorted(
        statistics.median(rng.choices(a, k=len(a))) / statistics.median(rng.choices(b, k=len(b))) for _ in range(rounds)
    )
    return [round(ratios[int(0.05 * rounds)], 3), round(ratios[int(0.95 * rounds) - 1], 3)]


class Timers:
    """Wall time of the engine's begin_prefill (the request's cache allocation) and of its
    KVStorer.submit calls (the store hand-off on the engine's thread), while installed."""

    def __init__(self, engine) -> None:  # noqa: ANN001
        self.admit: list[float] = []
        self.store: list[float] = []
        self._patched = [(engine.runner, "begin_prefill"), (engine.storer, "submit")]
        engine.runner.begin_prefill = self._timed(engine.runner.begin_prefill, self.admit)
        engine.storer.submit = self._timed(engine.storer.submit, self.store)

    @staticmethod
    def _timed(fn, into: list[float]):  # noqa: ANN001, ANN205
        def timed(*a, **k):  # noqa: ANN002, ANN003, ANN202
            t = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                into.append(time.perf_counter() - t)

        return timed

    def remove(self) -> None:
        for obj, name in self._patched:
            vars(obj).pop(name, None)


class GilProbe:
    """A thread sleeping 1 ms in a loop: how late it runs again, less the time the OS kept it
    waiting for a CPU (Linux /proc schedstat), is time waiting for the interpreter lock."""

    def __init__(self) -> None:
        import threading

        self.late: list[float] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="gil-probe", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        import threading

        path = f"/proc/self/task/{threading.get_native_id()}/schedstat"
        while not self._stop.is_set():
            q0 = _runqueue_ns(path)
            t0 = time.perf_counter()
            time.sleep(0.001)
            late = time.perf_counter() - t0 - 0.001
            self.late.append(late - (_runqueue_ns(path) - q0) / 1e9)

    def stop(self) -> dict:
        self._stop.set()
        self._thread.join()
        late = self.late or [0.0]
        return {
            "gil_wait_mean_ms": round(1e3 * statistics.mean(late), 4),
            "gil_waits_over_1ms": sum(x > 0.001 for x in late),
            "gil_wait_over_1ms_s": round(sum(x for x in late if x > 0.001), 4),
        }


def _runqueue_ns(path: str) -> int:
    try:
        with open(path) as f:
            return int(f.read().split()[1])
    except (OSError, IndexError, ValueError):  # no schedstat: lateness counted whole
        return 0


def _device_segments() -> int:
    """CUDA caching-allocator segments made so far (cudaMalloc calls); 0 without CUDA."""
    import torch

    if not torch.cuda.is_available():
        return 0
    return int(torch.cuda.memory_stats().get("segment.all.allocated", 0))


def _worker_cpus(pool) -> str | None:  # noqa: ANN001
    """The CPUs the encode worker processes may run on, as the kernel says (e.g. "4-15")."""
    import os

    if pool is None or not hasattr(os, "sched_getaffinity"):
        return None
    cpus = set()
    for pid in pool.pids():
        try:
            cpus |= os.sched_getaffinity(pid)
        except OSError:
            pass
    return f"{min(cpus)}-{max(cpus)} ({len(cpus)})" if cpus else None


def _overlaps(reqs: list) -> tuple[int, list[float]]:
    """(requests that arrived before an earlier one finished, TTFTs of the others): a request that
    arrives while another decodes is prefilled in chunks between decode steps
    (EngineConfig.prefill_chunk_tokens), a slower regime a stream can stay in."""
    busy, idle, last_end = 0, [], float("-inf")
    for r in reqs:
        if r.arrival_time < last_end:
            busy += 1
        elif r.ttft is not None:
            idle.append(r.ttft)
        last_end = max(last_end, r.finish_time or float("inf"))
    return busy, idle


def _params(args: argparse.Namespace):  # noqa: ANN202
    from kvcodec.engine.sequence import SamplingParams

    return SamplingParams(max_new_tokens=args.new_tokens, temperature=0.0)


def _kv_dims(model) -> tuple[int, int, int]:  # noqa: ANN001
    from kvcodec.models.registry import kv_shape

    return kv_shape(model)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True, help="registered name, model folder or GGUF file")
    ap.add_argument(
        "--docs", default=None, help="JSONL of prompts (field text); default: windows of the Paul Graham essays"
    )
    ap.add_argument("--modes", default="off,on", help="storing modes, in order: off, on, legacy, on:W:N")
    ap.add_argument("--repeat", type=int, default=1, help="run the list of modes this many times")
    ap.add_argument(
        "--warmup",
        type=int,
        default=0,
        help="first serve this many of the first mode's prompts, storing off, unrecorded",
    )
    ap.add_argument("--encode-workers", type=int, default=None, help="mode on: encode threads [cores less a quarter]")
    ap.add_argument("--nice", type=int, default=None, help="mode on: storer niceness above the engine's [10]")
    ap.add_argument("--requests", type=int, default=80, help="requests per mode")
    ap.add_argument("--rate", type=float, default=8.0, help="requests per second")
    ap.add_argument("--new-tokens", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=2048, help="prompt tokens kept")
    ap.add_argument("--store", default="file:///tmp/kvcodec-serve-store", help="store URL prefix (-on / -off)")
    ap.add_argument("--out", required=True)
    ap.add_argument("--notes", default="", help="text added to the result (how it was run, the machine)")
    ap.add_argument("--gil-probe", action="store_true", help="measure waits for the interpreter lock (a 1 ms thread)")
    ap.add_argument(
        "--random-weights",
        action="store_true",
        help="--model is a folder with a config and tokenizer: its shape with random weights (seed 0; timing only)",
    )
    ap.add_argument(
        "--blocks",
        type=int,
        default=0,
        help="storing modes: requests in turns of B storing and B not storing on the same engine (a paired measure)",
    )
    args = ap.parse_args()
    if args.blocks == 1 or args.blocks < 0:
        ap.error("--blocks takes 0 (off) or a turn of at least 2 requests (each turn's first is left out)")
    from kvcodec.ingest.run import load_for_ingest

    model, tokenizer, device = random_model(args.model) if args.random_weights else load_for_ingest(args.model)
    modes = [m for m in args.modes.split(",") if m] * args.repeat
    kinds = list(dict.fromkeys(modes))
    n = args.requests
    need = n * len(modes) + len(kinds) + args.warmup
    texts = _texts(args, tokenizer, need)
    if len(texts) < need:
        sys.exit(f"need {need} documents, {args.docs} has {len(texts)}")
    texts = iter(texts)

    def prompt(t: str) -> str:  # at most --max-tokens tokens
        return tokenizer.decode(tokenizer(t)["input_ids"][: args.max_tokens])

    tag = {m: m.replace(":", "_").replace("/", "-") for m in kinds}
    engines = {m: open_engine(model, tokenizer, prompt(next(texts)), args, m, tag[m]) for m in kinds}
    if args.warmup:  # a fresh process and GPU serve their first stream slower (cold off baselines)
        off = engines.get("off") or open_engine(model, tokenizer, prompt(next(texts)), args, "off", "warmup")
        warm = run_mode(off, [prompt(next(texts)) for _ in range(args.warmup)], args, "off")
        print(f"warm-up (off, not recorded): TTFT p50 {warm['ttft_p50_s']}")
    runs = []
    for mode in modes:
        runs.append(run_mode(engines[mode], [prompt(next(texts)) for _ in range(n)], args, mode))
        r = runs[-1]
        print(
            f"{mode}: TTFT p50 {r['ttft_p50_s']} p90 {r['ttft_p90_s']} busy {r['arrived_busy']} stored "
            f"{r['stored_prefixes_during']} dropped {r['dropped']:.0f} failed {r['store_errors']:.0f}, server cpu "
            f"{r['server_cpu_s']} s, {r['server_involuntary_switches']} preempted"
        )
        if len(runs) < len(modes):
            report(args, runs, device, final=False)
    for engine in engines.values():
        engine.close()
    report(args, runs, device, final=True)


def random_model(folder: str):  # noqa: ANN201 - (model, tokenizer, device)
    """A model of `folder`'s config with random weights (seed 0: the same every run; float16 on a GPU,
    float32 on the CPU) and its tokenizer, on the engine's default device: the shape of a model
    whose weights do not travel to the machine that times it (TTFT does not depend on the weights)."""
    import torch
    import transformers

    from kvcodec.engine.runner import default_device

    device = default_device()
    torch.manual_seed(0)
    config = transformers.AutoConfig.from_pretrained(folder)
    dtype = torch.float16 if device.type == "cuda" else torch.float32
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype).to(device).eval()
    return model, transformers.AutoTokenizer.from_pretrained(folder), device


def report(args: argparse.Namespace, runs: list[dict], device, final: bool) -> None:  # noqa: ANN001, FBT001
    """Write the result files of the runs so far (again after each run; final: all of them)."""
    doc = {
        "command": "python benchmarks/probes/serve_store.py " + " ".join(sys.argv[1:]),
        "model": Path(args.model).name,
        "device": str(device),
        "gpu": _gpu(),
        "cores": _cores(),
        "rate_per_s": args.rate,
        "runs": runs,
        **_ratios(runs),
        "complete": final,
        "notes": args.notes,
    }
    lines = [
        f"# Storing while serving: {doc['model']} on {doc['gpu'] or doc['device']}",
        "",
        f"`{doc['command']}`",
        "",
        f"{args.requests} new prompts per run at {args.rate:g}/s, {args.new_tokens} tokens each; the engine of "
        "`kvcodec serve` in one process, one engine per mode (started once, warmed up with one store: its encode "
        "workers live through all its runs), runs in the order below, each with its own new prompts.",
        "",
        "| storing | in | workers/nice | prompt tokens | TTFT p50 s | p90 s | wait p50 s | prefill p50 s | arrived busy | "
        "p50 idle s | stored/s | stored MB/s fp16 | dropped | lag mean s | backlog at end | drain s |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    split = [
        "",
        "| storing | wait p50 ms | submit p50 ms | queue p50 ms | admit p50 ms | engine store p50 / max ms | "
        "device allocs | GIL wait mean ms | GIL waits > 1 ms (s) |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in runs:
        wn = f"{r['encode_workers']}/{r['nice']}" if r["storing"] else "-"
        where = f"{r['encode_in']} ({r['encode_processes']})" if r["encode_processes"] else r["encode_in"] or "-"
        if r.get("worker_cpus"):
            where += f" on CPUs {r['worker_cpus']}"
        lines.append(
            f"| {r['mode']} | {where} | {wn} | {r['prompt_tokens_mean']:.0f} | {r['ttft_p50_s']:.4f} | "
            f"{r['ttft_p90_s']:.4f} | {r.get('wait_p50_s') or '-'} | {r.get('prefill_p50_s') or '-'} | {r['arrived_busy']} | {r['ttft_p50_idle_s'] or '-'} | {r['stored_per_s']:.2f} | "
            f"{r['stored_mb_per_s_fp16']:.1f} | {r['dropped']:.0f} | "
            f"{r['lag_mean_s'] if r['lag_mean_s'] is not None else '-'} | {r['backlog_at_end']:.0f} | {r['drain_s']:.2f} |"
        )
        split.append(_split_row(r))
    lines += split
    failed = sum(r["store_errors"] for r in runs)
    if failed:  # the stores did not happen: the runs measure something else than storing
        lines += [
            "",
            f"**{failed:.0f} stores failed** (kvcodec_store_errors_total): these runs do not measure storing.",
        ]
    blocks = [r for r in runs if r.get("blocks")]
    if blocks:
        lines += [
            "",
            f"Interleaved on one engine (--blocks {args.blocks}): turns of {args.blocks} requests storing and "
            f"{args.blocks} not storing; each turn's first request left out (the one before it was of the other kind).",
            "",
            "| run | requests storing / not | TTFT p50 storing / not s | ratio (90% interval) | per pair of turns "
            "(median) | prefill p50 storing / not s |",
            "|---|---|---|---|---|---|",
        ]
        for k, r in enumerate(blocks):
            n, t, pf = r["block_requests"], r["block_ttft_p50_s"], r["block_prefill_p50_s"]
            each = r["block_pair_ratios"]
            spread = f"{min(each):.2f}-{max(each):.2f} ({statistics.median(each):.3f})" if each else "-"
            lines.append(
                f"| {k + 1} ({r['mode']}) | {n['storing']} / {n['not_storing']} | {t['storing']} / {t['not_storing']} | "
                f"**{r['block_ttft_ratio']}** ({'-'.join(map(str, r['block_ttft_ratio_90ci'] or []))}) | {spread} | "
                f"{pf['storing']} / {pf['not_storing']} |"
            )
        a = [t for r in blocks for t in r["block_ttfts_s"]["storing"]]
        b = [t for r in blocks for t in r["block_ttfts_s"]["not_storing"]]
        ci = _median_ratio_ci(a, b)
        lines += [
            f"| all | {len(a)} / {len(b)} | {statistics.median(a):.5f} / {statistics.median(b):.5f} | "
            f"**{statistics.median(a) / statistics.median(b):.3f}** ({'-'.join(map(str, ci or []))}) | | |"
        ]
    lines += ["", "| mode | TTFT p50 vs off (each, then median) | p90 vs off (median) |", "|---|---|---|"]
    for mode, r in doc["vs_off"].items():
        each = ", ".join(f"{x:.2f}" for x in r["p50_each"])
        lines.append(f"| {mode} | {each} -> **{r['p50_median']:.2f}** | {r['p90_median']:.2f} |")
    lines += [
        "",
        "Ratios: each run's TTFT over the nearest earlier off run's (the same repeat). stored/s and MB/s: prefixes stored "
        "while the stream ran (kvcodec_stored_prefixes_total / tokens), over its duration; dropped: "
        "kvcodec_stores_dropped_total (the bounded backlog); lag: kvcodec_store_lag_seconds (prefill to stored). "
        "arrived busy: requests that arrived before an earlier one had finished (their prompt is prefilled in chunks "
        "between decode steps); p50 idle: TTFT p50 of the others. wait: arrival (before tokenizing) to the prefill's start; prefill: its start to the first token.",
    ]
    if not final:
        lines += ["", f"**Incomplete**: {len(runs)} runs of {len(args.modes.split(',')) * args.repeat} so far."]
    from kvbench.results import machine

    m = machine()
    lines += ["", f"Machine: {m.get('cpu')}, {m.get('cpu_count')} cores, load {m.get('load_avg_1m')} at the end."]
    if args.notes:
        lines += ["", args.notes]
    path = write_result(args.out, {**doc, "machine": m}, lines)
    if final:
        print("\n".join(lines[6:]))
        print("wrote", path)


def _split_row(r: dict) -> str:
    """The wait split of a run (milliseconds) as a table row; '-' where not measured."""

    def ms(key: str) -> str:
        v = r.get(key)
        return "-" if v is None else f"{1e3 * v:.2f}"

    gil = "-" if "gil_wait_mean_ms" not in r else f"{r['gil_wait_mean_ms']:.3f}"
    over = "-" if "gil_waits_over_1ms" not in r else f"{r['gil_waits_over_1ms']} ({r['gil_wait_over_1ms_s']:.3f})"
    return (
        f"| {r['mode']} | {ms('wait_p50_s')} | {ms('submit_p50_s')} | {ms('queue_p50_s')} | {ms('admit_p50_s')} | "
        f"{ms('engine_store_p50_s')} / {ms('engine_store_max_s')} | {r.get('device_allocs', '-')} | {gil} | {over} |"
    )


def _texts(args: argparse.Namespace, tokenizer, count: int) -> list[str]:  # noqa: ANN001
    if args.docs:
        return [json.loads(line)["text"] for line in Path(args.docs).read_text().splitlines() if line.strip()]
    from kvcodec.models.texts import load_text

    ids = tokenizer(load_text("pg"))["input_ids"]
    step = args.max_tokens + 1
    return [tokenizer.decode(ids[i * step : (i + 1) * step]) for i in range(min(count, len(ids) // step))]


def _ratios(runs: list[dict]) -> dict:
    """Per storing mode: TTFT p50/p90 over the last off run before it (ratios, not seconds)."""
    out: dict[str, dict] = {}
    base = None
    for r in runs:
        if not r["storing"]:
            base = r
            continue
        if base is None:
            continue
        d = out.setdefault(r["mode"], {"p50_each": [], "p90_each": []})
        d["p50_each"].append(round(r["ttft_p50_s"] / base["ttft_p50_s"], 3))
        d["p90_each"].append(round(r["ttft_p90_s"] / base["ttft_p90_s"], 3))
    for d in out.values():
        d["p50_median"] = statistics.median(d["p50_each"])
        d["p90_median"] = statistics.median(d["p90_each"])
    return {"vs_off": out}


def _gpu() -> str | None:
    import torch

    return torch.cuda.get_device_name(0) if torch.cuda.is_available() else None


if __name__ == "__main__":
    main()
