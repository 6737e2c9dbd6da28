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

With `--rounds N` the condition list runs N times interleaved and the report gives each condition's
median, over rounds, of its p50 relative to the same round's alone: slow drift of the machine then
hits every condition alike instead of whichever ran last.

It reports the background requests' TTFT and TPOT (mean, p50, p90) and the reuse requests' TTFT
per condition, as JSON + markdown under benchmarks/results/.
"""

from __future__ import annotations

import statistics

import click

SIMPLE_CONDITIONS = ("alone", "kvcodec", "sm-decoder", "blocking", "raw")


class BaselineChunkCodec:
    """A kvbench.baselines codec behind the chunk-codec interface PrefixCache uses."""

    def __init__(self, name: str) -> None:
        from kvbench.baselines import get_codec

        self.name = name
        self.codec = get_codec(name)
        self.CODEC_ID = f"baseline-v1:{name}"

    def encode_chunks(self, kv, config, *, first_chunk_index: int = 0, **_):  # noqa: ANN001, ANN201
        import types

        ct = int(config.chunk_tokens)
        out = []
        for n, start in enumerate(range(0, kv.shape[2], ct)):
            x = kv[:, :, start : start + ct].contiguous()
            data = bytes(self.codec.encode(x))
            out.append(types.SimpleNamespace(index=first_chunk_index + n, start_token=first_chunk_index * ct + start,
                                             tokens=x.shape[2], blobs=tuple(data for _ in config.resolutions)))
        return out

    def decode_chunk_blob(self, blob, device="cpu", out=None):  # noqa: ANN001, ANN201
        x = self.codec.decode(bytes(blob), device=device)
        if out is not None:
            out.copy_(x)
            return out
        return x

    def inspect_chunk_blob(self, blob) -> dict:  # noqa: ANN001
        return {"codec": self.name, "bytes": len(blob)}


def tiled_kv(real, layers: int, heads: int, head_dim: int, tokens: int):  # noqa: ANN001, ANN201
    """A KV tensor of a larger shape filled with REAL values of a small model's KV `real`
    (L0, 2, T0, H0, D0): out[l, k, t, h, d] = real[l % L0, k, (t + shift) % T0, (h + d // D0) % H0, d % D0]
    with a token shift per (layer, head, dim block) copy, so that no two channels are identical. Used where the model
    itself has random weights (timing runs): random-weight KV would not compress like real KV."""
    import torch

    L0, _, T0, H0, D0 = real.shape
    out = torch.empty((layers, 2, tokens, heads, head_dim), dtype=real.dtype)
    for l in range(layers):
        for h in range(heads):
            for b in range(0, head_dim, D0):
                w = min(D0, head_dim - b)
                shift = (97 * h + 13 * l + 31 * (b // D0)) % T0
                ti = (torch.arange(tokens) + shift) % T0
                out[l, :, :, h, b : b + w] = real[l % L0][:, ti][:, :, (h + b // D0) % H0, :w]
    return out


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
@click.option("--rounds", default=3, show_default=True, type=click.IntRange(min=1),
              help="Run the condition list this many times, interleaved; the report adds each condition's "
                   "median over rounds relative to alone's.")
@click.option("--warmup", default=5.0, show_default=True, type=float,
              help="Seconds of background arrivals run (and discarded) before the first condition.")
@click.option("--gbit", default=1.0, show_default=True, type=float, help="Emulated link (token bucket), Gbit/s.")
@click.option("--quant", default="int8", show_default=True)
@click.option("--sm-codec", default="cachegen", show_default=True, help="Baseline codec for the sm-decoder condition.")
@click.option("--conditions", default="alone,raw,kvcodec,sm-decoder,blocking", show_default=True,
              help="alone, raw (reuse requests, no decoder), kvcodec (one in-process decoder), kvcodec-pool or "
                   "kvcodec-pool:N (GPU: NVDEC pool of N worker processes), sm-decoder, blocking.")
@click.option("--device", default=None)
@click.option("--kv-file", default=None, type=click.Path(dir_okay=False),
              help="random:<arch> models: safetensors with a REAL small-model KV ('kv') to tile into the big shape.")
@click.option("--store-dir", default=None, help="Keep the encoded stores here (reused when present: encode once, "
              "e.g. on a CPU machine with --prepare-only, then ship the folder).")
@click.option("--prepare-only", is_flag=True, help="Only encode and store the document's KV, then exit.")
@click.option("--max-batch", default=32, show_default=True, type=int)
@click.option("--nvdec-pool", default=0, show_default=True, type=int,
              help="Worker processes of a plain kvcodec-pool condition's NVDEC pool (0: 7).")
@click.option("--threads", default=None, type=int, help="torch CPU threads (1 is faster on a loaded shared CPU).")
@click.option("--out", "out_path", default=None, help="JSON path (default benchmarks/results/interference-<device>.json).")
def command(model_name, text, doc_tokens, bg_rate, bg_new_tokens, reuse_rate, reuse_new_tokens, duration, rounds, warmup, gbit,
            quant, sm_codec, conditions, device, kv_file, store_dir, prepare_only, max_batch, nvdec_pool, out_path, threads) -> None:  # noqa: ANN001
    """Background TTFT/TPOT alone vs with kvcodec fetches vs an SM-based decoder vs a blocking scheduler.

    --model random:llama3-8b / random:qwen2.5-7b: full-size architecture with random weights (timing
    only, GPU), token ids instead of text, and the stored document KV tiled from --kv-file (real KV).
    """
    import json
    import os
    import tempfile
    import threading
    import time

    import torch

    from kvbench.net import ThrottledStore
    from kvbench.ttft import command_line, machine
    from kvcodec.config import CodecConfig
    from kvcodec.engine import Engine, SamplingParams, StorePolicy
    from kvcodec.fetcher import PrefixCache
    from kvcodec.models import load_model, model_id
    from kvcodec.models.texts import load_text
    from kvcodec.store import open_store

    if threads:
        torch.set_num_threads(threads)
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    conds = [c.strip() for c in conditions.split(",") if c.strip()]
    nvdec_pool = nvdec_pool or 7
    for cond in conds:  # bad names fail here, before minutes of preparation
        if cond.startswith("kvcodec-pool"):
            pool_workers(cond, nvdec_pool)
            if not device.startswith("cuda"):
                raise click.ClickException(f"{cond} needs a CUDA device (NVDEC)")
        elif cond not in SIMPLE_CONDITIONS:
            raise click.ClickException(f"unknown condition {cond!r}; known: {', '.join(SIMPLE_CONDITIONS)}, "
                                       "kvcodec-pool, kvcodec-pool:N")
    random_model = model_name.startswith("random:")
    cfg = CodecConfig(quant=quant, chunk_tokens=256, resolutions=((512, 512),))
    tmp = None
    if store_dir is None:
        tmp = tempfile.TemporaryDirectory(prefix="kvcodec-interf-")
        store_dir = tmp.name
    g = torch.Generator().manual_seed(0)
    model = tok = None
    if random_model:
        from kvbench.ttft import LARGE

        arch = model_name.split(":", 1)[1]
        if arch not in LARGE:
            raise click.ClickException(f"unknown architecture {arch!r}; known: {', '.join(LARGE)}")
        import transformers

        c = getattr(transformers, LARGE[arch][0])(**LARGE[arch][1])
        layers, heads = c.num_hidden_layers, c.num_key_value_heads
        head_dim = c.hidden_size // c.num_attention_heads
        mid = f"random-{arch}"  # fixed id: the stores are encoded where the model is never built
        doc_ids = torch.randint(100, 30000, (doc_tokens,), generator=g).tolist()
    else:
        from kvcodec.integrations.hf import extract_kv

        click.echo(f"loading {model_name} ...", err=True)
        model, tok = load_model(model_name)
        model = model.to(device=device, dtype=torch.float32 if device == "cpu" else torch.float16)
        mid = model_id(model)
        doc_text = load_text(text, max_chars=doc_tokens * 12)
        doc_ids = tok(doc_text, return_tensors="pt").input_ids[0][:doc_tokens].tolist()
    wanted = {store_for(c) for c in conds} - {None}
    if "raw" in wanted:
        wanted.add("kvcodec")  # the raw store holds what kvcodec restores
    need = [n for n in ("kvcodec", "sm-decoder", "raw") if n in wanted]
    from kvcodec.fetcher.rawcodec import RawCodec

    codecs = {"kvcodec": None, "sm-decoder": BaselineChunkCodec(sm_codec) if "sm-decoder" in need else None,
              "raw": RawCodec(("raw",))}
    stored_bytes = {}
    ids_file = os.path.join(store_dir, "doc_ids.json")
    kv = None
    if random_model and os.path.exists(ids_file):
        with open(ids_file) as f:
            doc_ids = json.load(f)  # the prepared stores' document
    for name in need:
        base = open_store(f"file://{os.path.join(store_dir, name)}")
        pc = PrefixCache(base, mid, cfg, "cpu", policy="fixed:0", codec=codecs[name])
        if pc.lookup(doc_ids) < (len(doc_ids) // 256) * 256:
            if kv is None and name == "raw":  # exactly what kvcodec restores (stores prepared elsewhere ship without KV)
                src = PrefixCache(open_store(f"file://{os.path.join(store_dir, 'kvcodec')}"), mid, cfg, device,
                                  policy="fixed:0")
                got = src.fetch(doc_ids, src.lookup(doc_ids))
                if got.error is None and got.tokens_restored:
                    kv = got.kv[:, :, :got.tokens_restored].to("cpu", torch.float16)
            if kv is None:
                click.echo(f"computing the {doc_tokens}-token document's KV ...", err=True)
                if random_model:
                    if not kv_file:
                        raise click.ClickException("random:<arch> needs --kv-file (real KV to tile) or a prepared --store-dir")
                    from safetensors.torch import load_file

                    kv = tiled_kv(load_file(kv_file)["kv"].to(torch.float16), layers, heads, head_dim, doc_tokens)
                else:
                    ids, kv = extract_kv(model, tok, doc_text, max_tokens=doc_tokens)
                    assert ids.tolist() == doc_ids
                    kv = kv.to(torch.float16)
            t0 = time.perf_counter()
            pc.put(doc_ids, kv)
            click.echo(f"  {name}: encoded and stored in {time.perf_counter() - t0:.1f} s", err=True)
        stored_bytes[name] = sum(base.size(k) or 0 for k in base.list())
        click.echo(f"  {name}: {stored_bytes[name] / 1e6:.2f} MB stored", err=True)
    os.makedirs(store_dir, exist_ok=True)
    with open(ids_file, "w") as f:
        json.dump(doc_ids, f)
    if prepare_only:
        return
    if random_model:
        from kvbench.ttft import build_model

        click.echo(f"building {arch} with random weights on {device} (timing only) ...", err=True)
        model, _, _ = build_model(arch, device)

    if random_model:
        questions = [torch.randint(100, 30000, (16,), generator=g).tolist() for _ in range(1000)]
        bg_prompts = [torch.randint(100, 30000, (64,), generator=g).tolist() for _ in range(1000)]
    else:
        questions = [tok(f"\n\nQuestion {i}: what is said in this text about topic number {i}? Answer:",
                         add_special_tokens=False)["input_ids"] for i in range(1000)]
        bg_prompts = [f"Write a short note about the number {i}. The number {i} is" for i in range(1000)]

    def run_condition(cond: str, duration: float = duration) -> dict:
        sub = store_for(cond)
        pc = pool = None
        if sub is not None:
            slow = ThrottledStore(open_store(f"file://{os.path.join(store_dir, sub)}"), rate_gbit=gbit)
            codec, workers = codecs[sub], 1
            if cond.startswith("kvcodec-pool"):
                from kvcodec.video.nvdec_pool import NvdecPool, PoolCodec

                workers = pool_workers(cond, nvdec_pool)
                t_pool = time.perf_counter()
                pool = NvdecPool(workers=workers)
                click.echo(f"  {cond}: NVDEC pool of {workers} started in {time.perf_counter() - t_pool:.1f} s", err=True)
                codec = PoolCodec(pool)
            pc = PrefixCache(slow, mid, cfg, device, policy="fixed:0", codec=codec, decode_workers=workers)
        processes_before = live_processes()
        eng = Engine(model, tokenizer=tok, prefix_cache=pc, reuse=pc is not None, device=device,
                     store_policy=StorePolicy(enabled=False), policy="blocking" if cond == "blocking" else "fetch-aware",
                     max_batch=max_batch)
        eng.generate([11, 12, 13, 14], max_new_tokens=2, reuse=False, store=False)
        eng.start()
        arrivals = [(i / bg_rate, "bg", i) for i in range(int(duration * bg_rate))]
        if cond != "alone":
            arrivals += [(0.5 / reuse_rate + j / reuse_rate, "reuse", j) for j in range(int(duration * reuse_rate))]
        arrivals.sort()
        reqs: list = []
        t0 = time.perf_counter()

        def driver() -> None:
            for at, kind, i in arrivals:
                wait = t0 + at - time.perf_counter()
                if wait > 0:
                    time.sleep(wait)
                if kind == "bg":
                    r = eng.submit(bg_prompts[i], SamplingParams(max_new_tokens=bg_new_tokens, ignore_eos=True),
                                   reuse=False, store=False)
                else:
                    r = eng.submit(doc_ids + questions[i],
                                   SamplingParams(max_new_tokens=reuse_new_tokens, ignore_eos=True), store=False)
                reqs.append((kind, r))

        th = threading.Thread(target=driver)
        th.start()
        th.join()
        for _, r in reqs:
            r.done.wait()
        wall = time.perf_counter() - t0
        eng.close()
        if pool is not None:
            pool.close()
        bg = [r for k, r in reqs if k == "bg"]
        ru = [r for k, r in reqs if k == "reuse"]
        res = {
            "condition": cond, "wall_s": wall,
            "bg_ttft_s": _summary([r.ttft for r in bg]),
            "bg_tpot_s": _summary([r.tpot for r in bg if r.tpot is not None]),
            "reuse_ttft_s": _summary([r.ttft for r in ru]),
            "reuse_fetch_s": _summary([r.fetch_s for r in ru if r.fetch_s is not None]),
            "reuse_restored_tokens": _summary([float(r.restored_tokens) for r in ru]),
            "reuse_fetch_errors": sum(1 for r in ru if r.fetch_error),
            # what else ran beside the engine: a drift between alone rounds that follows these is a leak
            "python_threads_at_start": processes_before["threads"],
            "child_processes_at_start": processes_before["children"],
            "cuda_allocated_mb_at_start": processes_before["cuda_allocated_mb"],
        }
        click.echo(f"  {cond}: bg TTFT p50 {res['bg_ttft_s']['p50']:.3f} s, bg TPOT p50 {res['bg_tpot_s']['p50'] * 1e3:.1f} ms"
                   + (f", reuse TTFT p50 {res['reuse_ttft_s']['p50']:.2f} s" if ru else ""), err=True)
        return res

    if warmup > 0:  # the first seconds of a fresh engine (allocator growth, kernel autotuning) are not "alone"
        click.echo(f"warm-up: {warmup:g} s of background arrivals, not recorded ...", err=True)
        run_condition("alone", warmup)
    results = []
    for rnd in range(rounds):  # interleaved rounds: slow drift of the machine hits every condition alike
        for cond in conds:
            click.echo(f"round {rnd + 1}/{rounds}: condition {cond} ({duration:g} s of arrivals) ...", err=True)
            results.append({**run_condition(cond), "round": rnd})
    if tmp is not None:
        tmp.cleanup()
    label = "gpu" if device.startswith("cuda") else "cpu"
    rec = {
        "benchmark": "interference", "command": command_line(), "machine": machine(), "device": device, "label": label,
        "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "model": model_name, "random_weights": random_model, "kv_tiled_from": kv_file if random_model else None,
        "doc_tokens": len(doc_ids), "link_gbit": gbit, "bg_rate": bg_rate, "reuse_rate": reuse_rate,
        "bg_new_tokens": bg_new_tokens, "reuse_new_tokens": reuse_new_tokens, "duration_s": duration, "warmup_s": warmup, "rounds": rounds,
        "stored_bytes": stored_bytes, "sm_codec": sm_codec,
        "nvdec_pool": {c: pool_workers(c, nvdec_pool) for c in conds if c.startswith("kvcodec-pool")},
        "notes": ("GPU: kvcodec decodes on NVDEC, the sm-decoder on CUDA cores" if label == "gpu" else
                  "CPU run: every decoder (HEVC and the sm-decoder stand-in) runs on the same CPU cores as the model, "
                  "so only the scheduling effects (blocking vs fetch-aware) carry over to a GPU"),
        "results": results,
    }
    out_path = out_path or os.path.join("benchmarks", "results", f"interference-{label}.json")
    os.makedirs(os.path.dirname(out_path) or ".", exist_ok=True)
    with open(out_path, "w") as f:
        json.dump(rec, f, indent=2)
    ref = results[0]

    def rel(r: dict, key: str) -> str:
        a, b = r[key]["p50"], ref[key]["p50"]
        return f"{a * 1e3:.1f} ({a / b:.2f}x)" if a is not None and b else "-"

    md = [f"# Interference ({label}): {model_name}, {len(doc_ids)}-token stored document, link {gbit:g} Gbit/s", "",
          f"`{rec['command']}`", "", rec["notes"], "",
          "| condition | bg TTFT p50 ms (vs first) | bg TTFT p90 ms | bg TPOT p50 ms (vs first) | bg TPOT p90 ms | reuse TTFT p50 s | reuse fetch p50 s |",
          "|---|---|---|---|---|---|---|"]
    for r in results:
        p90t = r["bg_ttft_s"]["p90"]
        p90p = r["bg_tpot_s"]["p90"]
        rt = r["reuse_ttft_s"]["p50"]
        rf = r["reuse_fetch_s"]["p50"]
        name = f"{r['condition']} (round {r['round'] + 1})" if rounds > 1 else r["condition"]
        md.append(f"| {name} | {rel(r, 'bg_ttft_s')} | {p90t * 1e3 if p90t else 0:.1f} | {rel(r, 'bg_tpot_s')} | "
                  f"{p90p * 1e3 if p90p else 0:.1f} | {f'{rt:.2f}' if rt is not None else '-'} | {f'{rf:.2f}' if rf is not None else '-'} |")
    if rounds > 1 and "alone" in conds:
        refs = ["alone"] + (["raw"] if "raw" in conds else [])
        md += ["", f"Median over {rounds} interleaved rounds of each condition's p50, relative to the same round's "
               + " and ".join(refs) + (" (raw: the reuse requests' own cost, no decoder)" if "raw" in refs else "") + ":", "",
               "| condition | " + " | ".join(f"bg TTFT p50 vs {r} | bg TPOT p50 vs {r}" for r in refs) + " |",
               "|---|" + "---|---|" * len(refs)]
        for cond in dict.fromkeys(conds):
            cells = []
            for ref_cond in refs:
                for key in ("bg_ttft_s", "bg_tpot_s"):
                    ratios = [r[key]["p50"] / a[key]["p50"] for r, a in _paired_with(results, cond, ref_cond)
                              if r[key]["p50"] and a[key]["p50"]]
                    cells.append(f"{statistics.median(ratios):.3f}x" if ratios else "-")
            md.append(f"| {cond} | " + " | ".join(cells) + " |")
    with open(out_path.replace(".json", ".md"), "w") as f:
        f.write("\n".join(md) + "\n")
    click.echo("\n".join(md))
    click.echo(f"wrote {out_path}", err=True)


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

    return {"threads": threading.active_count(), "children": len(multiprocessing.active_children()),
            "cuda_allocated_mb": round(torch.cuda.memory_allocated() / 1e6, 1) if torch.cuda.is_available() else None}


def _paired_with(results: list[dict], cond: str, ref_cond: str) -> list[tuple[dict, dict]]:
    """(condition's result, the same round's ref_cond result) for every round that has both."""
    ref = {r["round"]: r for r in results if r["condition"] == ref_cond}
    return [(r, ref[r["round"]]) for r in results if r["condition"] == cond and r["round"] in ref]
