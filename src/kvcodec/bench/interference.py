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
- blocking: kvcodec streams, but fetched on the engine thread (non-fetch-aware scheduler).

It reports the background requests' TTFT and TPOT (mean, p50, p90) and the reuse requests' TTFT
per condition, as JSON + markdown under benchmarks/results/.
"""

from __future__ import annotations

import click


class BaselineChunkCodec:
    """A kvcodec.baselines codec behind the chunk-codec interface PrefixCache uses."""

    def __init__(self, name: str) -> None:
        from kvcodec.baselines import get_codec

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
@click.option("--gbit", default=1.0, show_default=True, type=float, help="Emulated link (token bucket), Gbit/s.")
@click.option("--quant", default="int8", show_default=True)
@click.option("--sm-codec", default="cachegen", show_default=True, help="Baseline codec for the sm-decoder condition.")
@click.option("--conditions", default="alone,kvcodec,sm-decoder,blocking", show_default=True)
@click.option("--device", default=None)
@click.option("--out", "out_path", default=None, help="JSON path (default benchmarks/results/interference-<device>.json).")
def command(model_name, text, doc_tokens, bg_rate, bg_new_tokens, reuse_rate, reuse_new_tokens, duration, gbit,
            quant, sm_codec, conditions, device, out_path) -> None:  # noqa: ANN001
    """Background TTFT/TPOT alone vs with kvcodec fetches vs an SM-based decoder vs a blocking scheduler."""
    import json
    import os
    import tempfile
    import threading
    import time

    import torch

    from kvcodec.bench.ttft import command_line, machine
    from kvcodec.config import CodecConfig
    from kvcodec.engine import Engine, SamplingParams, StorePolicy
    from kvcodec.fetcher import PrefixCache
    from kvcodec.integrations.hf import extract_kv
    from kvcodec.models import load_model, model_id
    from kvcodec.models.texts import load_text
    from kvcodec.net import ThrottledStore
    from kvcodec.store import open_store

    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    conds = [c.strip() for c in conditions.split(",") if c.strip()]
    click.echo(f"loading {model_name} ...", err=True)
    model, tok = load_model(model_name)
    model = model.to(device=device, dtype=torch.float32 if device == "cpu" else torch.float16)
    mid = model_id(model)
    cfg = CodecConfig(quant=quant, chunk_tokens=256, resolutions=((512, 512),))
    tmp = tempfile.TemporaryDirectory(prefix="kvcodec-interf-")

    click.echo(f"prefill of the {doc_tokens}-token document and storing its KV (kvcodec, {sm_codec}) ...", err=True)
    doc_ids, kv = extract_kv(model, tok, load_text(text, max_chars=doc_tokens * 12), max_tokens=doc_tokens)
    doc_ids = doc_ids.tolist()
    kv = kv.to(torch.float16)
    codecs = {"kvcodec": None, "sm-decoder": BaselineChunkCodec(sm_codec)}
    stored_bytes = {}
    for name, codec in codecs.items():
        if name not in conds and not (name == "kvcodec" and "blocking" in conds):
            continue
        base = open_store(f"file://{os.path.join(tmp.name, name)}")
        pc = PrefixCache(base, mid, cfg, "cpu", policy="fixed:0", codec=codec)
        t0 = time.perf_counter()
        pc.put(doc_ids, kv)
        stored_bytes[name] = sum(base.size(k) or 0 for k in base.list())
        click.echo(f"  {name}: {stored_bytes[name] / 1e6:.2f} MB stored in {time.perf_counter() - t0:.1f} s", err=True)

    questions = [f"\n\nQuestion {i}: what is said in this text about topic number {i}? Answer:" for i in range(1000)]
    bg_prompts = [f"Write a short note about the number {i}. The number {i} is" for i in range(1000)]

    def run_condition(cond: str) -> dict:
        store_dir = "sm-decoder" if cond == "sm-decoder" else "kvcodec"
        pc = None
        if cond != "alone":
            slow = ThrottledStore(open_store(f"file://{os.path.join(tmp.name, store_dir)}"), rate_gbit=gbit)
            pc = PrefixCache(slow, mid, cfg, device, policy="fixed:0", codec=codecs[store_dir])
        eng = Engine(model, tokenizer=tok, prefix_cache=pc, reuse=pc is not None, device=device,
                     store_policy=StorePolicy(enabled=False), policy="blocking" if cond == "blocking" else "fetch-aware",
                     max_batch=32)
        eng.generate("Warm up the model.", max_new_tokens=2, reuse=False, store=False)
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
                    r = eng.submit(doc_ids + tok(questions[i], add_special_tokens=False)["input_ids"],
                                   SamplingParams(max_new_tokens=reuse_new_tokens, ignore_eos=True), store=False)
                reqs.append((kind, r))

        th = threading.Thread(target=driver)
        th.start()
        th.join()
        for _, r in reqs:
            r.done.wait()
        wall = time.perf_counter() - t0
        eng.close()
        bg = [r for k, r in reqs if k == "bg"]
        ru = [r for k, r in reqs if k == "reuse"]
        res = {
            "condition": cond, "wall_s": wall,
            "bg_ttft_s": _summary([r.ttft for r in bg]),
            "bg_tpot_s": _summary([r.tpot for r in bg if r.tpot is not None]),
            "reuse_ttft_s": _summary([r.ttft for r in ru]),
            "reuse_fetch_s": _summary([r.fetch_end - r.fetch_start for r in ru if r.fetch_end and r.fetch_start]),
            "reuse_restored_tokens": _summary([float(r.restored_tokens) for r in ru]),
            "reuse_fetch_errors": sum(1 for r in ru if r.fetch_error),
        }
        click.echo(f"  {cond}: bg TTFT p50 {res['bg_ttft_s']['p50']:.3f} s, bg TPOT p50 {res['bg_tpot_s']['p50'] * 1e3:.1f} ms"
                   + (f", reuse TTFT p50 {res['reuse_ttft_s']['p50']:.2f} s" if ru else ""), err=True)
        return res

    results = []
    for cond in conds:
        click.echo(f"condition {cond} ({duration:g} s of arrivals) ...", err=True)
        results.append(run_condition(cond))
    tmp.cleanup()
    label = "gpu" if device.startswith("cuda") else "cpu"
    rec = {
        "benchmark": "interference", "command": command_line(), "machine": machine(), "device": device, "label": label,
        "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "model": model_name, "doc_tokens": len(doc_ids), "link_gbit": gbit, "bg_rate": bg_rate, "reuse_rate": reuse_rate,
        "bg_new_tokens": bg_new_tokens, "reuse_new_tokens": reuse_new_tokens, "duration_s": duration,
        "stored_bytes": stored_bytes, "sm_codec": sm_codec,
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
        md.append(f"| {r['condition']} | {rel(r, 'bg_ttft_s')} | {p90t * 1e3 if p90t else 0:.1f} | {rel(r, 'bg_tpot_s')} | "
                  f"{p90p * 1e3 if p90p else 0:.1f} | {f'{rt:.2f}' if rt is not None else '-'} | {f'{rf:.2f}' if rf is not None else '-'} |")
    with open(out_path.replace(".json", ".md"), "w") as f:
        f.write("\n".join(md) + "\n")
    click.echo("\n".join(md))
    click.echo(f"wrote {out_path}", err=True)
