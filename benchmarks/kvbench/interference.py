"""`kvcodec bench interference`: what prefix fetches do to the requests that do not reuse anything.

Background requests (short prompts, no reuse) arrive at a steady rate for `--duration` seconds;
in every condition but "alone", reuse requests (a long stored document + a question) arrive too
and fetch the document's KV over an emulated link. Conditions:

- alone: background requests only (the reference);
- kvcodec: fetch-aware scheduler, kvcodec streams decoded off the critical path (NVDEC on a GPU;
  on a CPU the software HEVC decoder shares the cores with the model, so it is NOT interference-free
  there);
- sm-decoder: fetch-aware scheduler, CacheGen-style streams decoded by a compute decoder (CUDA
  kernels on the SMs on a GPU, numpy on a CPU), i.e. a decoder that competes with the model;
- kvcodec-pool, kvcodec-pool:N (GPU): kvcodec streams decoded AND restored inside an NVDEC pool of
  N worker processes (default `--nvdec-pool`); the pool is started before the condition's arrivals
  and closed after them, so no idle pool sits beside the other conditions;
- blocking: kvcodec streams, but fetched on the engine thread (non-fetch-aware scheduler);
- raw: the same reuse requests fetch raw fp16 KV (the values kvcodec restores) with no decoder at
  all: what serving the reuse requests costs the background by itself, so that the decoders'
  own interference is the difference between a condition and raw.

The kvcodec conditions' document is stored with `--method` (the HEVC codec at `--quant` by default; any
kvbench method, e.g. `kvcodec-transform-5 --transform MODEL.kvt`: the transform codec, whose default coder
decodes on the host's threads); the pool conditions need the HEVC codec.

With `--rounds N` the condition list runs N times interleaved and the report gives each condition's
median, over rounds, of its p50 relative to the same round's alone: slow drift of the machine then
hits every condition alike instead of whichever ran last.

It reports the background requests' TTFT and TPOT (mean, p50, p90) and the reuse requests' TTFT
per condition, as JSON + markdown under benchmarks/results/.
"""

from __future__ import annotations

import dataclasses
import json
import os
import statistics
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import click

from kvbench.methods import method_codec, transform_ratio
from kvbench.results import command_line, machine, result_path, utc_now, write_result
from kvbench.transform_options import kvt_option
from kvbench.workloads import LARGE, build_model, tiled_kv

SIMPLE_CONDITIONS = ("alone", "kvcodec", "sm-decoder", "blocking", "raw")


@dataclasses.dataclass(frozen=True)
class Settings:
    """The command's options (see its --help)."""

    model_name: str
    text: str
    doc_tokens: int
    bg_rate: float
    bg_new_tokens: int
    reuse_rate: float
    reuse_new_tokens: int
    duration: float
    rounds: int
    warmup: float
    gbit: float
    quant: str
    method: str
    transform: Path | None
    sm_codec: str
    conditions: str
    device: str | None
    kv_file: str | None
    store_dir: str | None
    prepare_only: bool
    max_batch: int
    nvdec_pool: int
    out_path: str | None
    threads: int | None

    @property
    def random_model(self) -> bool:
        return self.model_name.startswith("random:")


@dataclasses.dataclass
class Workload:
    """The model, its tokenizer (None for random weights) and the stored document's token ids."""

    model: Any
    tok: Any
    model_id: str
    doc_ids: list[int]
    doc_text: str | None = None
    shape: tuple[int, int, int] | None = None  # random:<arch>: (layers, kv heads, head dim)


def _pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


def _summary(xs: list[float]) -> dict:
    return {"n": len(xs), "mean": sum(xs) / len(xs) if xs else None, "p50": _pct(xs, 0.5), "p90": _pct(xs, 0.9)}


@click.command("interference")
@click.option("--model", "model_name", default="smollm2-135m", show_default=True)
@click.option("--text", default="pg/worked", show_default=True, help="Stored document (kvcodec.models.texts).")
@click.option("--doc-tokens", default=1024, show_default=True, type=int)
@click.option("--bg-rate", default=1.0, show_default=True, type=float, help="Background requests per second.")
@click.option("--bg-new-tokens", default=16, show_default=True, type=int)
@click.option("--reuse-rate", default=0.25, show_default=True, type=float, help="Reuse requests per second.")
@click.option("--reuse-new-tokens", default=4, show_default=True, type=int)
@click.option("--duration", default=24.0, show_default=True, type=float, help="Seconds of arrivals per condition.")
@click.option(
    "--rounds",
    default=3,
    show_default=True,
    type=click.IntRange(min=1),
    help="Run the condition list this many times, interleaved; the report adds each condition's "
    "median over rounds relative to alone's.",
)
@click.option(
    "--warmup",
    default=5.0,
    show_default=True,
    type=float,
    help="Seconds of background arrivals run (and discarded) before the first condition.",
)
@click.option("--gbit", default=1.0, show_default=True, type=float, help="Emulated link (token bucket), Gbit/s.")
@click.option("--quant", default="int8", show_default=True, help="The quant of the method 'kvcodec'.")
@click.option(
    "--method",
    default="kvcodec",
    show_default=True,
    help="How the kvcodec conditions' document is stored (kvbench.methods): kvcodec (the HEVC codec at --quant), "
    "kvcodec-<quant>, or kvcodec-transform-<ratio>[-<coder>] (with --transform; no kvcodec-pool condition).",
)
@kvt_option
@click.option("--sm-codec", default="cachegen", show_default=True, help="Baseline codec for the sm-decoder condition.")
@click.option(
    "--conditions",
    default="alone,raw,kvcodec,sm-decoder,blocking",
    show_default=True,
    help="alone, raw (reuse requests, no decoder), kvcodec (one in-process decoder), kvcodec-pool or "
    "kvcodec-pool:N (GPU: NVDEC pool of N worker processes), sm-decoder, blocking.",
)
@click.option("--device", default=None)
@click.option(
    "--kv-file",
    default=None,
    type=click.Path(dir_okay=False),
    help="random:<arch> models: safetensors with a REAL small-model KV ('kv') to tile into the big shape.",
)
@click.option(
    "--store-dir",
    default=None,
    help="Keep the encoded stores here (reused when present: encode once, "
    "e.g. on a CPU machine with --prepare-only, then ship the folder).",
)
@click.option("--prepare-only", is_flag=True, help="Only encode and store the document's KV, then exit.")
@click.option("--max-batch", default=32, show_default=True, type=int)
@click.option(
    "--nvdec-pool",
    default=0,
    show_default=True,
    type=int,
    help="Worker processes of a plain kvcodec-pool condition's NVDEC pool (0: 7).",
)
@click.option("--threads", default=None, type=int, help="torch CPU threads (1 is faster on a loaded shared CPU).")
@click.option(
    "--out", "out_path", default=None, help="JSON path (default benchmarks/results/interference-<device>.json)."
)
def command(**options: Any) -> None:
    """Background TTFT/TPOT alone vs with kvcodec fetches vs an SM-based decoder vs a blocking scheduler.

    --model random:llama3-8b / random:qwen2.5-7b: full-size architecture with random weights (timing
    only, GPU), token ids instead of text, and the stored document KV tiled from --kv-file (real KV).
    """
    import torch

    s = Settings(**options)
    if s.kv_file and not s.random_model:  # it was ignored, whatever its shape: the model's own prefill was used
        raise click.BadParameter(
            "tiles real KV into a random:<arch> model's shape; a real model's document KV is its own prefill",
            param_hint="--kv-file",
        )
    if s.threads:
        torch.set_num_threads(s.threads)
    device = s.device or ("cuda" if torch.cuda.is_available() else "cpu")
    conds = check_conditions(s.conditions, device, s.nvdec_pool or 7)
    check_method(s, conds)
    with tempfile.TemporaryDirectory(prefix="kvcodec-interf-") as tmp:
        store_dir = s.store_dir or tmp
        w = load_workload(s, device)
        stored = prepare_stores(s, w, conds, device, store_dir)
        if s.prepare_only:
            return
        if s.random_model:
            click.echo(f"building {s.model_name} with random weights on {device} (timing only) ...", err=True)
            w.model, _, _ = build_model(s.model_name.split(":", 1)[1], device)
        results = run_rounds(s, conds, Conditions(s, w, device, store_dir))
    doc = record(s, w, device, conds, stored, results)
    path = write_result(result_path(s.out_path, f"interference-{doc['label']}"), doc, markdown(doc))
    click.echo(path.with_suffix(".md").read_text())
    click.echo(f"wrote {path}", err=True)


def codec_config(s: Settings):  # noqa: ANN201
    from kvcodec.config import CodecConfig

    return CodecConfig(quant=s.quant, chunk_tokens=256, resolutions=((512, 512),))


def check_conditions(conditions: str, device: str, nvdec_pool: int) -> list[str]:
    """The condition names, checked before minutes of preparation."""
    conds = [c.strip() for c in conditions.split(",") if c.strip()]
    for cond in conds:
        if cond.startswith("kvcodec-pool"):
            pool_workers(cond, nvdec_pool)
            if not device.startswith("cuda"):
                raise click.ClickException(f"{cond} needs a CUDA device (NVDEC)")
        elif cond not in SIMPLE_CONDITIONS:
            raise click.ClickException(
                f"unknown condition {cond!r}; known: {', '.join(SIMPLE_CONDITIONS)}, kvcodec-pool, kvcodec-pool:N"
            )
    return conds


def check_method(s: Settings, conds: list[str]) -> None:
    """--method, --sm-codec and --transform make their codecs (a usage error otherwise), before minutes
    of preparation; the NVDEC pool conditions decode the HEVC codec's chunks only."""
    from kvcodec.errors import KVCodecError

    try:
        if s.transform and transform_ratio(s.method) is None and transform_ratio(s.sm_codec) is None:
            raise click.BadParameter(
                f"--transform codes a kvcodec-transform-<ratio> method; --method is {s.method!r}, "
                f"--sm-codec {s.sm_codec!r}"
            )
        codec = store_codec(s, "kvcodec")
        if "sm-decoder" in conds:
            store_codec(s, "sm-decoder")
    except (KVCodecError, ValueError) as e:
        raise click.BadParameter(str(e), param_hint="--method / --sm-codec / --transform") from e
    if not codec.id.startswith("hevc") and any(c.startswith("kvcodec-pool") for c in conds):
        raise click.ClickException(f"the kvcodec-pool conditions decode the HEVC codec's chunks, not {s.method!r}'s")


def load_workload(s: Settings, device: str) -> Workload:
    """A real model and its tokenized document, or (random:<arch>) token ids and the KV shape
    only (the model is built after the stores are prepared: they may be prepared elsewhere)."""
    import torch

    if s.random_model:
        arch = s.model_name.split(":", 1)[1]
        if arch not in LARGE:
            raise click.ClickException(f"unknown architecture {arch!r}; known: {', '.join(LARGE)}")
        import transformers

        c = getattr(transformers, LARGE[arch][0])(**LARGE[arch][1])
        g = torch.Generator().manual_seed(0)
        ids = torch.randint(100, 30000, (s.doc_tokens,), generator=g).tolist()
        ids_file = os.path.join(s.store_dir or "", "doc_ids.json")
        if s.store_dir and os.path.exists(ids_file):
            with open(ids_file) as f:
                ids = json.load(f)  # the prepared stores' document
        shape = (c.num_hidden_layers, c.num_key_value_heads, c.hidden_size // c.num_attention_heads)
        return Workload(None, None, f"random-{arch}", ids, shape=shape)  # fixed id: stores encoded elsewhere
    from kvcodec.models import load_for_device, model_id
    from kvcodec.models.texts import load_text

    click.echo(f"loading {s.model_name} ...", err=True)
    model, tok = load_for_device(s.model_name, device)  # float16 on a GPU, RoPE frequencies kept float32
    text = load_text(s.text, max_chars=s.doc_tokens * 12)
    ids = tok(text, return_tensors="pt").input_ids[0][: s.doc_tokens].tolist()
    return Workload(model, tok, model_id(model), ids, doc_text=text)


def needed_stores(conds: list[str]) -> list[str]:
    wanted = {store_for(c) for c in conds} - {None}
    if "raw" in wanted:
        wanted.add("kvcodec")  # the raw store holds what kvcodec restores
    return [n for n in ("kvcodec", "sm-decoder", "raw") if n in wanted]


def store_codec(s: Settings, store: str, **hevc_options: Any):  # noqa: ANN201
    method = {"kvcodec": s.method, "sm-decoder": s.sm_codec, "raw": "raw"}[store]
    return method_codec(method, codec_config(s), transform=s.transform, **hevc_options)


def prepare_stores(s: Settings, w: Workload, conds: list[str], device: str, store_dir: str) -> dict[str, int]:
    """Encode and store the document's KV once per store the conditions fetch from (a store that
    already holds it is reused); returns the bytes stored per store."""
    from kvcodec.fetcher import PrefixCache
    from kvcodec.store import open_store

    stored, kv = {}, None
    for name in needed_stores(conds):
        base = open_store(f"file://{os.path.join(store_dir, name)}")
        pc = PrefixCache(base, w.model_id, store_codec(s, name), "cpu", policy="fixed:0")
        if pc.lookup(w.doc_ids) < (len(w.doc_ids) // 256) * 256:
            kv = kv if kv is not None else document_kv(s, w, device, store_dir, from_kvcodec=name == "raw")
            t0 = time.perf_counter()
            pc.put(w.doc_ids, kv)
            click.echo(f"  {name}: encoded and stored in {time.perf_counter() - t0:.1f} s", err=True)
        stored[name] = document_bytes(pc, w.doc_ids)
        click.echo(f"  {name}: {stored[name] / 1e6:.2f} MB stored", err=True)
    os.makedirs(store_dir, exist_ok=True)
    with open(os.path.join(store_dir, "doc_ids.json"), "w") as f:
        json.dump(w.doc_ids, f)
    return stored


def document_bytes(pc, ids: list[int]) -> int:  # noqa: ANN001 - a PrefixCache
    """Bytes `pc`'s codec stores for the document (every chunk's meta and blobs), however many other
    codecs' chunks the same store folder holds (a --store-dir reused with another --method or --quant)."""
    from kvcodec.fetcher import blob_key, meta_key
    from kvcodec.store.base import size_many

    keys = pc.keys(ids)
    names = [meta_key(k) for k in keys] + [blob_key(k, j) for k in keys for j in range(len(pc.codec.resolutions))]
    return sum(n or 0 for n in size_many(pc.store, names))


def document_kv(s: Settings, w: Workload, device: str, store_dir: str, from_kvcodec: bool):  # noqa: ANN201
    """The document's fp16 KV: for the raw store exactly what kvcodec restores (stores prepared
    elsewhere ship without KV), else tiled real KV (random:<arch>) or the model's own prefill."""
    import torch

    from kvcodec.fetcher import PrefixCache
    from kvcodec.store import open_store

    if from_kvcodec:
        src = PrefixCache(
            open_store(f"file://{os.path.join(store_dir, 'kvcodec')}"),
            w.model_id,
            store_codec(s, "kvcodec"),
            device,
            policy="fixed:0",
        )
        got = src.fetch(w.doc_ids, src.lookup(w.doc_ids))
        if got.error is None and got.tokens_restored:
            return got.kv[:, :, : got.tokens_restored].to("cpu", torch.float16)
    click.echo(f"computing the {s.doc_tokens}-token document's KV ...", err=True)
    if s.random_model:
        if not s.kv_file:
            raise click.ClickException("random:<arch> needs --kv-file (real KV to tile) or a prepared --store-dir")
        from kvcodec.kvspec.files import load_plain_kv

        return tiled_kv(load_plain_kv(s.kv_file)[0].to(torch.float16), *w.shape, s.doc_tokens)
    from kvcodec.integrations.hf import extract_kv

    ids, kv = extract_kv(w.model, w.tok, w.doc_text, max_tokens=s.doc_tokens)
    if ids.tolist() != w.doc_ids:
        raise click.ClickException("the model's prefill tokenized the document differently")
    return kv.to(torch.float16)


class Conditions:
    """Runs one condition: an engine (and the condition's prefix cache and NVDEC pool) for it
    alone, background and reuse arrivals on a fixed schedule, a summary of what they saw."""

    def __init__(self, s: Settings, w: Workload, device: str, store_dir: str) -> None:
        import torch

        self.s, self.w, self.device, self.store_dir = s, w, device, store_dir
        if w.tok is None:
            g = torch.Generator().manual_seed(1)
            self.questions = [torch.randint(100, 30000, (16,), generator=g).tolist() for _ in range(1000)]
            self.bg_prompts = [torch.randint(100, 30000, (64,), generator=g).tolist() for _ in range(1000)]
        else:
            self.questions = [
                w.tok(
                    f"\n\nQuestion {i}: what is said in this text about topic number {i}? Answer:",
                    add_special_tokens=False,
                )["input_ids"]
                for i in range(1000)
            ]
            self.bg_prompts = [f"Write a short note about the number {i}. The number {i} is" for i in range(1000)]

    def run(self, cond: str, duration: float) -> dict:
        from kvcodec.engine import Engine, StorePolicy

        pc, pool = self.prefix_cache(cond)
        before = live_processes()
        eng = Engine(
            self.w.model,
            tokenizer=self.w.tok,
            prefix_cache=pc,
            reuse=pc is not None,
            device=self.device,
            store_policy=StorePolicy(enabled=False),
            policy="blocking" if cond == "blocking" else "fetch-aware",
            max_batch=self.s.max_batch,
        )
        try:
            eng.generate([11, 12, 13, 14], max_new_tokens=2, reuse=False, store=False)
            eng.start()
            reqs, wall = self.drive(eng, self.arrivals(cond, duration))
        finally:
            eng.close()
            if pool is not None:
                pool.close()
        return summarize(cond, reqs, wall, before)

    def prefix_cache(self, cond: str):  # noqa: ANN201
        """(the condition's prefix cache over the shaped link or None, its NVDEC pool or None)."""
        from kvbench.net import ThrottledStore
        from kvcodec.fetcher import PrefixCache
        from kvcodec.store import open_store

        sub = store_for(cond)
        if sub is None:
            return None, None
        slow = ThrottledStore(open_store(f"file://{os.path.join(self.store_dir, sub)}"), rate_gbit=self.s.gbit)
        workers, pool = 1, None
        if cond.startswith("kvcodec-pool"):
            from kvcodec.video.nvdec_pool import NvdecPool

            workers = pool_workers(cond, self.s.nvdec_pool or 7)
            t0 = time.perf_counter()
            pool = NvdecPool(workers=workers)
            click.echo(f"  {cond}: NVDEC pool of {workers} started in {time.perf_counter() - t0:.1f} s", err=True)
        codec = store_codec(self.s, sub, **({"pool": pool} if pool is not None else {}))
        pc = PrefixCache(slow, self.w.model_id, codec, self.device, policy="fixed:0", decode_workers=workers)
        return pc, pool

    def arrivals(self, cond: str, duration: float) -> list[tuple[float, str, int]]:
        s = self.s
        out = [(i / s.bg_rate, "bg", i) for i in range(int(duration * s.bg_rate))]
        if cond != "alone":
            out += [(0.5 / s.reuse_rate + j / s.reuse_rate, "reuse", j) for j in range(int(duration * s.reuse_rate))]
        return sorted(out)

    def drive(self, eng, arrivals: list[tuple[float, str, int]]) -> tuple[list, float]:  # noqa: ANN001
        """Submit every arrival at its time (from a thread of its own); wait for all to finish."""
        from kvcodec.engine import SamplingParams

        s, reqs, t0 = self.s, [], time.perf_counter()

        def driver() -> None:
            for at, kind, i in arrivals:
                wait = t0 + at - time.perf_counter()
                if wait > 0:
                    time.sleep(wait)
                if kind == "bg":
                    r = eng.submit(
                        self.bg_prompts[i],
                        SamplingParams(max_new_tokens=s.bg_new_tokens, ignore_eos=True),
                        reuse=False,
                        store=False,
                    )
                else:
                    r = eng.submit(
                        self.w.doc_ids + self.questions[i],
                        SamplingParams(max_new_tokens=s.reuse_new_tokens, ignore_eos=True),
                        store=False,
                    )
                reqs.append((kind, r))

        th = threading.Thread(target=driver)
        th.start()
        th.join()
        for _, r in reqs:
            r.done.wait()
        return reqs, time.perf_counter() - t0


def summarize(cond: str, reqs: list, wall: float, before: dict) -> dict:
    bg = [r for k, r in reqs if k == "bg"]
    ru = [r for k, r in reqs if k == "reuse"]
    res = {
        "condition": cond,
        "wall_s": wall,
        "bg_ttft_s": _summary([r.ttft for r in bg]),
        "bg_tpot_s": _summary([r.tpot for r in bg if r.tpot is not None]),
        "reuse_ttft_s": _summary([r.ttft for r in ru]),
        "reuse_fetch_s": _summary([r.fetch_s for r in ru if r.fetch_s is not None]),
        "reuse_restored_tokens": _summary([float(r.restored_tokens) for r in ru]),
        "reuse_fetch_errors": sum(1 for r in ru if r.fetch_error),
        # what else ran beside the engine: a drift between alone rounds that follows these is a leak
        "python_threads_at_start": before["threads"],
        "child_processes_at_start": before["children"],
        "cuda_allocated_mb_at_start": before["cuda_allocated_mb"],
    }
    click.echo(
        f"  {cond}: bg TTFT p50 {res['bg_ttft_s']['p50']:.3f} s, bg TPOT p50 {res['bg_tpot_s']['p50'] * 1e3:.1f} ms"
        + (f", reuse TTFT p50 {res['reuse_ttft_s']['p50']:.2f} s" if ru else ""),
        err=True,
    )
    return res


def run_rounds(s: Settings, conds: list[str], runner: Conditions) -> list[dict]:
    """A warm-up, then the condition list `s.rounds` times, interleaved: slow drift of the
    machine hits every condition alike."""
    if s.warmup > 0:  # the first seconds of a fresh engine (allocator growth, kernel autotuning) are not "alone"
        click.echo(f"warm-up: {s.warmup:g} s of background arrivals, not recorded ...", err=True)
        runner.run("alone", s.warmup)
    results = []
    for rnd in range(s.rounds):
        for cond in conds:
            click.echo(f"round {rnd + 1}/{s.rounds}: condition {cond} ({s.duration:g} s of arrivals) ...", err=True)
            results.append({**runner.run(cond, s.duration), "round": rnd})
    return results


def record(s: Settings, w: Workload, device: str, conds: list[str], stored: dict, results: list[dict]) -> dict:
    label = "gpu" if device.startswith("cuda") else "cpu"
    return {
        "benchmark": "interference",
        "command": command_line("interference"),
        "machine": machine(),
        "device": device,
        "label": label,
        "time": utc_now(),
        "model": s.model_name,
        "random_weights": s.random_model,
        "kv_tiled_from": s.kv_file if s.random_model else None,
        "doc_tokens": len(w.doc_ids),
        "link_gbit": s.gbit,
        "bg_rate": s.bg_rate,
        "reuse_rate": s.reuse_rate,
        "bg_new_tokens": s.bg_new_tokens,
        "reuse_new_tokens": s.reuse_new_tokens,
        "duration_s": s.duration,
        "warmup_s": s.warmup,
        "rounds": s.rounds,
        "stored_bytes": stored,
        "method": s.method,
        "transform": os.path.basename(s.transform) if s.transform else None,
        "sm_codec": s.sm_codec,
        "nvdec_pool": {c: pool_workers(c, s.nvdec_pool or 7) for c in conds if c.startswith("kvcodec-pool")},
        "notes": (
            "GPU: kvcodec decodes on NVDEC, the sm-decoder on CUDA cores"
            if label == "gpu"
            else "CPU run: every decoder (HEVC and the sm-decoder stand-in) runs on the same CPU cores as the model, "
            "so only the scheduling effects (blocking vs fetch-aware) carry over to a GPU"
        ),
        "conditions": conds,
        "results": results,
    }


def markdown(doc: dict) -> list[str]:
    return [
        f"# Interference ({doc['label']}): {doc['model']}, {doc['doc_tokens']}-token stored document, "
        f"link {doc['link_gbit']:g} Gbit/s",
        "",
        f"`{doc['command']}`",
        "",
        stored_as(doc),
        "",
        doc["notes"],
        "",
        *rounds_table(doc["results"], doc["rounds"]),
        *medians_table(doc["results"], doc["conditions"], doc["rounds"]),
    ]


def stored_as(doc: dict) -> str:
    """How the document is stored for the kvcodec conditions and for the sm-decoder (records before
    --method: the HEVC codec at --quant)."""
    kvt = f" (.kvt {doc['transform']})" if doc.get("transform") else ""
    return f"The kvcodec conditions' document is stored as `{doc.get('method', 'kvcodec')}`{kvt}; the sm-decoder's as `{doc['sm_codec']}`."


def rounds_table(results: list[dict], rounds: int) -> list[str]:
    ref = results[0]

    def rel(r: dict, key: str) -> str:
        a, b = r[key]["p50"], ref[key]["p50"]
        return f"{a * 1e3:.1f} ({a / b:.2f}x)" if a is not None and b else "-"

    def num(v: float | None, scale: float = 1.0, fmt: str = ".2f") -> str:
        return format(v * scale, fmt) if v is not None else "-"

    md = [
        "| condition | bg TTFT p50 ms (vs first) | bg TTFT p90 ms | bg TPOT p50 ms (vs first) | bg TPOT p90 ms "
        "| reuse TTFT p50 s | reuse fetch p50 s |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in results:
        name = f"{r['condition']} (round {r['round'] + 1})" if rounds > 1 else r["condition"]
        md.append(
            f"| {name} | {rel(r, 'bg_ttft_s')} | {num(r['bg_ttft_s']['p90'], 1e3, '.1f')} | {rel(r, 'bg_tpot_s')} "
            f"| {num(r['bg_tpot_s']['p90'], 1e3, '.1f')} | {num(r['reuse_ttft_s']['p50'])} "
            f"| {num(r['reuse_fetch_s']['p50'])} |"
        )
    return md


def medians_table(results: list[dict], conds: list[str], rounds: int) -> list[str]:
    """Each condition's median over rounds of its p50 relative to the same round's alone (and raw)."""
    if rounds <= 1 or "alone" not in conds:
        return []
    refs = ["alone"] + (["raw"] if "raw" in conds else [])
    md = [
        "",
        f"Median over {rounds} interleaved rounds of each condition's p50, relative to the same round's "
        + " and ".join(refs)
        + (" (raw: the reuse requests' own cost, no decoder)" if "raw" in refs else "")
        + ":",
        "",
        "| condition | " + " | ".join(f"bg TTFT p50 vs {r} | bg TPOT p50 vs {r}" for r in refs) + " |",
        "|---|" + "---|---|" * len(refs),
    ]
    for cond in dict.fromkeys(conds):
        cells = []
        for ref_cond in refs:
            for key in ("bg_ttft_s", "bg_tpot_s"):
                ratios = [
                    r[key]["p50"] / a[key]["p50"]
                    for r, a in _paired_with(results, cond, ref_cond)
                    if r[key]["p50"] and a[key]["p50"]
                ]
                cells.append(f"{statistics.median(ratios):.3f}x" if ratios else "-")
        md.append(f"| {cond} | " + " | ".join(cells) + " |")
    return md


def store_for(condition: str) -> str | None:
    """The prepared store a condition's reuse requests fetch from (None: no reuse requests)."""
    if condition == "alone":
        return None
    return condition if condition in ("sm-decoder", "raw") else "kvcodec"


def pool_workers(condition: str, default: int) -> int:
    """Worker count of a 'kvcodec-pool' or 'kvcodec-pool:N' condition."""
    name, _, count = condition.partition(":")
    if name != "kvcodec-pool":
        raise click.ClickException(f"not a pool condition: {condition!r}")
    if not count:
        return default
    if not count.isdigit() or not 1 <= int(count) <= 32:
        raise click.ClickException(f"{condition!r}: the worker count after ':' must be 1..32")
    return int(count)


def live_processes() -> dict:
    """Threads of this process, its child processes and CUDA memory held, at this moment."""
    import multiprocessing
    import threading

    import torch

    return {
        "threads": threading.active_count(),
        "children": len(multiprocessing.active_children()),
        "cuda_allocated_mb": round(torch.cuda.memory_allocated() / 1e6, 1) if torch.cuda.is_available() else None,
    }


def _paired_with(results: list[dict], cond: str, ref_cond: str) -> list[tuple[dict, dict]]:
    """(condition's result, the same round's ref_cond result) for every round that has both."""
    ref = {r["round"]: r for r in results if r["condition"] == ref_cond}
    return [(r, ref[r["round"]]) for r in results if r["condition"] == cond and r["round"] in ref]
