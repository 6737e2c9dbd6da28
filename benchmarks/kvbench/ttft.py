"""`kvcodec bench ttft`: time to first token vs link bandwidth, for full prefill and four ways of
reusing a stored prefix (raw fp16 KV, zstd, CacheGen-style, kvcodec).

TTFT of a reuse method = fetch + prefill of the request's new (suffix) tokens, where the fetch is
chunk-pipelined: with n chunks, transfer time X = bytes / bandwidth and decode time D,
fetch = max(X, D) + min(X, D) / n. Full prefill = one forward over prefix + suffix. Every input is
measured, and the record says where:

- bytes per method: each codec encodes a REAL KV cache (a real model over a real essay, fp16) and
  the ratio to fp16 is applied to the target model's fp16 KV size (layers x 2 x kv_heads x head_dim
  x 2 bytes per token): the target's KV is assumed to compress like the real small model's of the
  same family (llama-like <- smollm2-135m, qwen2 <- qwen2.5-coder-0.5b). For the small real
  models themselves nothing is scaled.
- decode speed per method: measured on this machine on the same real KV (CPU: zstd / CacheGen rANS
  / software HEVC; raw = a copy). On a GPU: raw = host-to-device copy, measured; kvcodec = the NVDEC
  pool restoring `--nvdec-gbit` of stored bytes per second (default from `kvcodec bench decode` on an
  H200); any rate can be set with --decode-rate METHOD=GB/s (of fp16 KV), as the committed GPU runs do.
- prefill times: real forward passes on this machine; for 7B/8B-class targets ("llama3-8b",
  "qwen2.5-7b") full-size architectures with RANDOM weights (timing only, never KV statistics).
"""

from __future__ import annotations

import statistics

import click

from kvbench.methods import LABELS as METHOD_LABELS
from kvbench.methods import method_codec
from kvbench.results import command_line, machine, result_path, utc_now, write_result
from kvbench.workloads import LARGE, build_model


def kv_statistics(kv_model: str, tokens: int, methods: list[str], resolution: tuple[int, int], text: str) -> dict:
    """Ratio to fp16 and CPU decode speed of each method on a real KV cache."""
    import torch

    from kvbench.baselines.measure import measure_codec, real_kv

    kv, desc = real_kv(kv_model, tokens, text)
    kv = kv.to(torch.float16).contiguous()
    out = {
        "model": kv_model,
        "text": text,
        "tokens": int(kv.shape[2]),
        "shape": list(kv.shape),
        "source": desc.get("source"),
        "fp16_bytes": kv.numel() * 2,
        "methods": {},
    }
    for m in methods:
        if m.startswith("kvcodec-"):
            from kvbench.baselines import get_codec

            # one stored resolution (what one fetch moves), not the sum of all of them
            codec = get_codec(m, resolutions=(resolution,))
            import time

            t0 = time.perf_counter()
            data = codec.encode(kv)
            enc = time.perf_counter() - t0
            dec = []
            for _ in range(2):
                t0 = time.perf_counter()
                codec.decode(data, device="cpu")
                dec.append(time.perf_counter() - t0)
            row = {"bytes": len(data), "encode_s": enc, "decode_s": min(dec), "resolution": list(resolution)}
        else:
            r = measure_codec(m, kv, "cpu", repeat=2)
            row = {"bytes": r["bytes"], "encode_s": r["encode_s"], "decode_s": r["decode_s"]}
        row["ratio_vs_fp16"] = out["fp16_bytes"] / row["bytes"]
        row["decode_GBps_fp16"] = out["fp16_bytes"] / row["decode_s"] / 1e9
        out["methods"][m] = row
        click.echo(
            f"  {kv_model} {m}: {row['ratio_vs_fp16']:.2f}x, decode {row['decode_GBps_fp16']:.3f} GB/s (cpu)", err=True
        )
    return out


def time_prefill(model, tokens: int, suffix: int, device: str, repeat: int) -> tuple[float, float]:  # noqa: ANN001
    """(full prefill of tokens+suffix, suffix prefill on top of a `tokens` cache), median seconds."""
    import statistics
    import time

    import torch

    vocab = model.config.vocab_size
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(100, min(vocab, 30000), (1, tokens + suffix), generator=g).to(device)

    def sync() -> None:
        if device.startswith("cuda"):
            torch.cuda.synchronize()

    full, part = [], []
    with torch.inference_mode():
        model(input_ids=ids[:, :64])  # warm-up
        for _ in range(repeat):
            sync()
            t0 = time.perf_counter()
            model(input_ids=ids, logits_to_keep=1)
            sync()
            full.append(time.perf_counter() - t0)
            out = model(input_ids=ids[:, :tokens], use_cache=True, logits_to_keep=1)
            cache = out.cache if hasattr(out, "cache") else out.past_key_values
            sync()
            t0 = time.perf_counter()
            model(input_ids=ids[:, tokens:], cache=cache, use_cache=True, logits_to_keep=1)
            sync()
            part.append(time.perf_counter() - t0)
            del out, cache
    return statistics.median(full), statistics.median(part)


def h2d_GBps(nbytes: int) -> float:
    import time

    import torch

    x = torch.empty(nbytes, dtype=torch.uint8).pin_memory()
    x.to("cuda")
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(3):
        x.to("cuda", non_blocking=True)
    torch.cuda.synchronize()
    return 3 * nbytes / (time.perf_counter() - t0) / 1e9


def fetch_time(
    nbytes: float, fp16_bytes: float, gbit: float, decode_GBps: float, chunks: int
) -> tuple[float, float, float]:
    x = nbytes * 8 / (gbit * 1e9)
    d = fp16_bytes / (decode_GBps * 1e9) if decode_GBps > 0 else 0.0
    return max(x, d) + min(x, d) / max(1, chunks), x, d


E2E_QUESTION = "\n\nQuestion: In one sentence, what is the text above about?\nAnswer:"


class _CapturedKV:
    """A prefix cache that stores nothing: it keeps the last KV an engine hands it to store."""

    def __init__(self, chunk_tokens: int) -> None:
        from kvcodec.config import CodecConfig

        self.config = CodecConfig(chunk_tokens=chunk_tokens)
        self.kv = None

    def lookup(self, token_ids) -> int:  # noqa: ANN001
        return 0

    def put(self, token_ids, kv) -> int:  # noqa: ANN001
        self.kv = kv
        return 0


def e2e(
    kv_model: str,
    tokens: int,
    new_tokens: int,
    bws: list[float],
    meths: list[str],
    resolution: tuple[int, int],
    text: str,
    device: str,
    pool=None,  # noqa: ANN001
    repeat: int = 1,
) -> list[dict]:
    """Measured end to end: the engine restores the real prefix KV over a token-bucket link and
    prefills the suffix; TTFT is the engine's (arrival -> first token), one request at a time.
    With an NVDEC `pool` (kvcodec.video.nvdec_pool.NvdecPool) kvcodec chunks are decoded and
    restored in its workers; otherwise the fetcher's own decoder (in-process NVDEC on a GPU)."""
    import tempfile

    from kvcodec.models import load_model
    from kvcodec.models.texts import load_text

    model, tok = load_model(kv_model)
    ids = tok(load_text(text, max_chars=tokens * 12), return_tensors="pt").input_ids[0][:tokens].tolist()
    # a real question after the document; greedy answers of every method are compared with full prefill's
    prompt = ids + tok(E2E_QUESTION, add_special_tokens=False)["input_ids"]
    rows = []
    with tempfile.TemporaryDirectory(prefix="kvcodec-ttft-") as tmp:
        run = E2ERun(model, tok, ids, prompt, new_tokens, device, pool, repeat)
        for m in meths:
            run.store(m, f"file://{tmp}/{m}", resolution)
        full, ref = run.full_prefill()
        for (
            m
        ) in meths:  # first use of a decoder (sessions, kernels, pool workers) is not what a server pays per request
            run.reuse(m, max(bws))
        for bw in bws:
            res = {"prefill": {"ttft_s": full, "bytes": 0, "restored": 0, "error": None, "ids": ref}}
            for m in meths:
                res[m] = method_result([run.reuse(m, bw) for _ in range(repeat)])
                click.echo(
                    f"  e2e {bw:g} Gbit/s {m}: {res[m]['ttft_s']:.3f} s ({res[m]['restored']} restored)", err=True
                )
            common = {
                "model": kv_model,
                "tokens": tokens,
                "bandwidth_gbit": bw,
                "mode": "measured end to end",
                "device": device,
                "suffix_tokens": len(prompt) - len(ids),
                "new_tokens": new_tokens,
            }
            rows += [e2e_row(common, m, r, res, ref) for m, r in res.items()]
    return rows


class E2ERun:
    """One model and prompt: the prefix KV stored once per method, then fetched through engines."""

    def __init__(
        self,
        model,
        tok,
        ids: list[int],
        prompt: list[int],
        new_tokens: int,
        device: str,
        pool,  # noqa: ANN001
        repeat: int,
    ) -> None:
        from kvcodec.models import model_id

        self.model, self.tok, self.ids, self.prompt = model, tok, ids, prompt
        self.new_tokens, self.device, self.pool, self.repeat = new_tokens, device, pool, repeat
        self.kv = engine_prefix_kv(model, tok, len(ids), prompt, device)
        self.model_id = model_id(model)
        self.stores: dict[str, tuple[str, object]] = {}

    def store(self, method: str, url: str, resolution: tuple[int, int]) -> None:
        """Store the prefix KV with the method's codec (the CPU encoder; a pool only decodes)."""
        import torch

        from kvcodec.config import CodecConfig
        from kvcodec.fetcher import PrefixCache
        from kvcodec.store import open_store

        cfg = CodecConfig(quant="int8", chunk_tokens=256, resolutions=(resolution,))
        pc = PrefixCache(open_store(url), self.model_id, method_codec(method, cfg), "cpu", policy="fixed:0")
        pc.put(self.ids, self.kv.to(torch.float16))
        pooled = self.pool is not None and method.startswith("kvcodec-")
        self.stores[method] = (url, method_codec(method, cfg, **({"pool": self.pool} if pooled else {})))
        click.echo(f"  e2e: stored {method}", err=True)

    def full_prefill(self) -> tuple[float, list[int]]:
        """(median TTFT of full prefill, its answer's token ids)."""
        from kvcodec.engine import Engine, StorePolicy

        with Engine(
            self.model, tokenizer=self.tok, reuse=False, store_policy=StorePolicy(enabled=False), device=self.device
        ) as eng:
            eng.generate(self.prompt[:64], max_new_tokens=1)
            runs = [
                eng.generate(self.prompt, max_new_tokens=self.new_tokens, ignore_eos=True)[0]
                for _ in range(self.repeat)
            ]
        full = statistics.median(o.ttft_s for o in runs)
        click.echo(f"  e2e: full prefill {full:.3f} s", err=True)
        return full, runs[0].token_ids

    def reuse(self, method: str, gbit: float):  # noqa: ANN201
        """One request that restores the prefix over a `gbit` link: the engine's output."""
        from kvbench.net import ThrottledStore
        from kvcodec.engine import Engine, StorePolicy
        from kvcodec.fetcher import PrefixCache
        from kvcodec.store import open_store

        url, codec = self.stores[method]
        workers = self.pool.workers if self.pool is not None else 1  # every method decodes with as many threads
        pc = PrefixCache(
            ThrottledStore(open_store(url), rate_gbit=gbit),
            self.model_id,
            codec,
            self.device,
            policy="fixed:0",
            decode_workers=workers,
        )
        with Engine(
            self.model, tokenizer=self.tok, prefix_cache=pc, store_policy=StorePolicy(enabled=False), device=self.device
        ) as eng:
            return eng.generate(self.prompt, max_new_tokens=self.new_tokens, ignore_eos=True)[0]


def engine_prefix_kv(model, tok, tokens: int, prompt: list[int], device: str):  # noqa: ANN001, ANN201
    """The KV this engine's own prefill computes for the prompt's first `tokens` tokens on this
    device: what a server would store."""
    from kvcodec.engine import Engine, StorePolicy

    capture = _CapturedKV(chunk_tokens=256)
    with Engine(
        model,
        tokenizer=tok,
        prefix_cache=capture,
        reuse=False,
        device=device,
        store_policy=StorePolicy(max_tokens=tokens, skip_if_restored=False),
    ) as eng:
        eng.generate(prompt, max_new_tokens=1)
        eng.storer.flush()
    if capture.kv is None or capture.kv.shape[2] != tokens:
        raise click.ClickException(f"the engine stored no KV for the {tokens}-token prefix")
    return capture.kv


GAP_FIELDS = ("restored_to_prefill_s", "prefill_to_first_token_s")


def _median(values: list) -> float | None:
    return statistics.median(values) if values and None not in values else None


def method_result(runs: list) -> dict:
    """Median TTFT, fetch time and the engine's split after the fetch (restored KV -> suffix
    prefill started -> first token) of repeated runs of one method; the first run's details."""
    o = runs[0]
    fetch = [r.fetch_s for r in runs]
    after = [r.ttft_s - r.fetch_s if r.fetch_s is not None else None for r in runs]
    return {
        "ttft_s": statistics.median(r.ttft_s for r in runs),
        "bytes": o.bytes_fetched,
        "restored": o.restored_tokens,
        "error": o.fetch_error,
        "ids": o.token_ids,
        "fetch_s": _median(fetch),
        "ttft_minus_fetch_s": _median(after),
        # engines before these time points existed report None
        **{f: _median([getattr(r, f, None) for r in runs]) for f in GAP_FIELDS},
    }


def e2e_row(common: dict, m: str, r: dict, res: dict, ref_ids: list[int]) -> dict:
    return {
        **common,
        "method": m,
        "ttft_s": r["ttft_s"],
        "speedup_vs_raw": res["raw"]["ttft_s"] / r["ttft_s"] if "raw" in res else None,
        "speedup_vs_cachegen": res["cachegen"]["ttft_s"] / r["ttft_s"] if "cachegen" in res else None,
        "speedup_vs_prefill": res["prefill"]["ttft_s"] / r["ttft_s"],
        "bytes": r["bytes"],
        "restored_tokens": r["restored"],
        "fetch_error": r["error"],
        "fetch_s": r.get("fetch_s"),
        "ttft_minus_fetch_s": r.get("ttft_minus_fetch_s"),
        **{f: r.get(f) for f in GAP_FIELDS},
        "answer_identical_to_prefill": r["ids"] == ref_ids,
        "token_agreement_with_prefill": sum(a == b for a, b in zip(r["ids"], ref_ids)) / max(1, len(ref_ids)),
    }


@click.command("ttft")
@click.option(
    "--targets",
    default=None,
    help="Models to time prefill for (comma list). Default: the KV models on CPU; "
    "llama3-8b,qwen2.5-7b (random weights, full size) on a GPU.",
)
@click.option(
    "--kv-models",
    default="smollm2-135m,qwen2.5-coder-0.5b",
    show_default=True,
    help="Real models whose KV statistics are measured.",
)
@click.option("--text", default="pg", show_default=True, help="Text for the real KV (kvcodec.models.texts).")
@click.option(
    "--tokens",
    "tokens_list",
    default="2048",
    show_default=True,
    help="Reused prefix length(s), comma list; KV statistics are measured at the first.",
)
@click.option("--suffix-tokens", default=32, show_default=True, type=int, help="New tokens after the prefix.")
@click.option("--bandwidths", default="1,2,5,10,20,40", show_default=True, help="Gbit/s, comma list.")
@click.option("--methods", default="raw,zstd-3,cachegen,kvcodec-int8", show_default=True)
@click.option("--resolution", default="512x512", show_default=True, help="Stored kvcodec resolution measured.")
@click.option(
    "--stats",
    "stats_file",
    type=click.Path(exists=True, dir_okay=False),
    default=None,
    help="Read KV statistics from an earlier record instead of measuring (the GPU machine has no GGUF loader).",
)
@click.option(
    "--nvdec-gbit",
    default=6.0,
    show_default=True,
    type=float,
    help="kvcodec restore rate on a GPU when no --decode-rate is given: Gbit/s of stored chunk bytes "
    "restored through the NVDEC pool (measured 6.8 for int8 and 5.6 for int4 in "
    "benchmarks/results/decode-h200-v3.md).",
)
@click.option("--decode-rate", multiple=True, help="METHOD=GB/s of fp16 KV: override a decode rate (e.g. cachegen=40).")
@click.option("--device", default=None, help="cpu or cuda (default: cuda if available).")
@click.option(
    "--repeat",
    default=3,
    show_default=True,
    type=int,
    help="Timed runs per point (median); --e2e: per method and bandwidth.",
)
@click.option("--threads", default=None, type=int, help="torch CPU threads (1 is faster on a loaded shared CPU).")
@click.option(
    "--e2e-new-tokens",
    default=16,
    show_default=True,
    type=int,
    help="--e2e: greedy answer tokens generated and compared with full prefill's.",
)
@click.option(
    "--e2e",
    "e2e_mode",
    is_flag=True,
    help="Measure TTFT end to end instead (real models only): the engine fetches the real "
    "prefix KV of each --kv-models model over a token-bucket link at each bandwidth.",
)
@click.option(
    "--nvdec-pool",
    default=0,
    show_default=True,
    type=int,
    help="--e2e on a GPU: decode and restore kvcodec chunks in an NVDEC pool of this many worker processes "
    "(0: the fetcher's in-process decoder).",
)
@click.option("--out", "out_path", default=None, help="JSON path (default benchmarks/results/ttft-<device>.json).")
def command(
    targets,
    kv_models,
    text,
    tokens_list,
    suffix_tokens,
    bandwidths,
    methods,
    resolution,
    stats_file,
    nvdec_gbit,
    decode_rate,
    device,
    repeat,
    out_path,
    threads,
    e2e_new_tokens,
    e2e_mode,
    nvdec_pool,
) -> None:  # noqa: ANN001
    """TTFT vs bandwidth: full prefill vs raw / zstd / CacheGen-style / kvcodec prefix reuse."""

    import torch

    if threads:
        torch.set_num_threads(threads)
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    gpu = device.startswith("cuda")
    bws = [float(b) for b in bandwidths.split(",")]
    meths = [m.strip() for m in methods.split(",") if m.strip()]
    w, h = (int(v) for v in resolution.lower().split("x"))
    overrides = {k: float(v) for k, v in (o.split("=", 1) for o in decode_rate)}
    token_counts = [int(t) for t in str(tokens_list).split(",") if t.strip()]
    if e2e_mode:
        return e2e_command(
            kv_models, token_counts, e2e_new_tokens, bws, meths, w, h, text, device, gpu, nvdec_pool, repeat, out_path
        )
    return modeled_command(
        targets,
        kv_models,
        text,
        token_counts,
        suffix_tokens,
        bws,
        meths,
        w,
        h,
        stats_file,
        overrides,
        nvdec_gbit,
        device,
        gpu,
        repeat,
        out_path,
    )


def e2e_command(
    kv_models: str,
    token_counts: list[int],
    e2e_new_tokens: int,
    bws: list[float],
    meths: list[str],
    w: int,
    h: int,
    text: str,
    device: str,
    gpu: bool,
    nvdec_pool: int,
    repeat: int,
    out_path,
) -> None:  # noqa: ANN001
    """--e2e: TTFT measured through the engine for every model, prefix length, bandwidth and method."""
    rows = []
    pool = None
    if nvdec_pool:
        if not gpu:
            raise click.ClickException("--nvdec-pool needs --device cuda")
        from kvcodec.video.nvdec_pool import NvdecPool

        pool = NvdecPool(workers=nvdec_pool)
    try:
        for km in kv_models.split(","):
            for n in token_counts:
                rows += e2e(km, n, e2e_new_tokens, bws, meths, (w, h), text, device, pool, repeat)
    finally:
        if pool is not None:
            pool.close()
    label = ("gpu" if gpu else "cpu") + "-e2e"
    rec = {
        "benchmark": "ttft",
        "mode": "measured end to end",
        "command": command_line("ttft"),
        "machine": machine(),
        "device": device,
        "label": label,
        "time": utc_now(),
        "nvdec_pool_workers": nvdec_pool or None,
        "notes": "engine TTFT (arrival -> first token), one request at a time, prefix KV restored through the "
        "fetcher over an in-process token-bucket link, median of --repeat runs after one warm-up fetch per "
        "method; the stored KV is the engine's own prefill of the prefix on this device; decoders run on "
        + device
        + (
            f" (kvcodec: an NVDEC pool of {nvdec_pool} worker processes; every method fetches with "
            f"{nvdec_pool} decode threads)"
            if nvdec_pool
            else ""
        )
        + ". 'same answer': "
        f"the {e2e_new_tokens} greedy answer tokens equal full prefill's, at every bandwidth",
        "rows": rows,
    }
    md = e2e_markdown(rec, kv_models.split(","), token_counts, bws, meths)
    path = write_result(result_path(out_path, f"ttft-{label}"), rec, md)
    click.echo("\n".join(md))
    click.echo(f"wrote {path}", err=True)


def e2e_markdown(
    rec: dict, models: list[str], token_counts: list[int], bws: list[float], meths: list[str]
) -> list[str]:
    """TTFT per model, prefix length and bandwidth (one column per method), and whether each method's
    answers equal full prefill's."""
    rows, cols = rec["rows"], ["prefill"] + meths
    md = [
        f"# TTFT vs bandwidth, measured end to end ({rec['label']})",
        "",
        f"`{rec['command']}`",
        "",
        rec["notes"],
        "",
        "| model | tokens | Gbit/s | " + " | ".join(METHOD_LABELS.get(m, m) for m in cols) + " |",
        "|---|---|---|" + "---|" * len(cols),
    ]
    for km in models:
        for n in token_counts:
            for bw in bws:
                sel = {r["method"]: r for r in rows if (r["model"], r["tokens"], r["bandwidth_gbit"]) == (km, n, bw)}
                md.append(f"| {km} | {n} | {bw:g} | " + " | ".join(f"{sel[m]['ttft_s']:.3f}" for m in cols) + " |")
        same = {
            m: all(r["answer_identical_to_prefill"] for r in rows if (r["model"], r["method"]) == (km, m))
            for m in meths
        }
        md.append(f"| {km} | same answer | | yes | " + " | ".join("yes" if same[m] else "NO" for m in meths) + " |")
    return md + gap_markdown(rows, meths)


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{1e3 * v:.1f}"


def gap_markdown(rows: list[dict], meths: list[str]) -> list[str]:
    """After the fetch, per request (ms): restored KV -> suffix prefill started -> first token, and
    TTFT minus fetch (which also holds the lookup before the fetch)."""
    md = [
        "",
        "After the fetch, in ms (median per point): restored KV -> suffix prefill started / prefill started -> "
        "first token / TTFT - fetch_s (also holds arrival -> fetch start: tokens check and lookup)",
        "",
        "| model | tokens | Gbit/s | method | restored -> prefill | prefill -> first token | TTFT - fetch |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if r["method"] in meths:
            md.append(
                f"| {r['model']} | {r['tokens']} | {r['bandwidth_gbit']:g} | {METHOD_LABELS.get(r['method'], r['method'])} | "
                f"{_ms(r.get('restored_to_prefill_s'))} | {_ms(r.get('prefill_to_first_token_s'))} | "
                f"{_ms(r.get('ttft_minus_fetch_s'))} |"
            )
    return md


def modeled_command(
    targets,
    kv_models: str,
    text: str,
    token_counts: list[int],
    suffix_tokens: int,
    bws: list[float],
    meths: list[str],
    w: int,
    h: int,
    stats_file,
    overrides: dict,
    nvdec_gbit: float,
    device: str,
    gpu: bool,
    repeat: int,
    out_path,
) -> None:  # noqa: ANN001
    """TTFT modeled from measured parts (see the module's docstring)."""
    import json

    tokens = token_counts[0]
    if stats_file:
        with open(stats_file) as f:
            stats = json.load(f)["kv_stats"]
    else:
        click.echo("measuring codecs on real KV caches (cpu) ...", err=True)
        stats = {m: kv_statistics(m, tokens, meths, (w, h), text) for m in kv_models.split(",")}
    tlist = targets.split(",") if targets else (["llama3-8b", "qwen2.5-7b"] if gpu else list(stats))
    rows, targets_info = [], {}
    for target in tlist:
        rows += target_rows(
            target,
            stats,
            token_counts,
            suffix_tokens,
            bws,
            meths,
            overrides,
            nvdec_gbit,
            device,
            gpu,
            repeat,
            targets_info,
        )
    label = "gpu" if gpu else "cpu"
    rec = {
        "benchmark": "ttft",
        "command": command_line("ttft"),
        "machine": machine(),
        "device": device,
        "label": label,
        "time": utc_now(),
        "model_of_ttft": "fetch = max(X, D) + min(X, D)/chunks (256-token chunks), X = bytes/bandwidth, D = decode; "
        "TTFT = fetch + suffix prefill; full prefill measured directly",
        "notes": (
            "prefill of llama3-8b/qwen2.5-7b: full-size architectures with random weights, timing only; bytes "
            "scaled from real KV of the small model of the same family by fp16 KV size"
            if gpu
            else "CPU run: small real models, their own real KV (no scaling); all decoders run on the CPU "
            "(kvcodec = software HEVC decode, which is what makes it slow here; NVDEC is the design point)"
        ),
        "kv_stats": stats,
        "targets": targets_info,
        "rows": rows,
    }
    md = modeled_markdown(rec)
    path = write_result(result_path(out_path, f"ttft-{label}"), rec, md)
    click.echo("\n".join(md))
    click.echo(f"wrote {path}", err=True)


def target_rows(
    target: str,
    stats: dict,
    token_counts: list[int],
    suffix_tokens: int,
    bws: list[float],
    meths: list[str],
    overrides: dict,
    nvdec_gbit: float,
    device: str,
    gpu: bool,
    repeat: int,
    targets_info: dict,
) -> list[dict]:
    """Modeled TTFT rows of one target model: its prefill timed here, fetch from the KV statistics."""
    import torch

    rows = []
    src = LARGE[target][2] if target in LARGE else target
    if src not in stats:
        raise click.ClickException(f"no KV statistics for {src} (needed by {target})")
    st = stats[src]
    click.echo(f"timing prefill of {target} on {device} ...", err=True)
    model, per_token, random = build_model(target, device)
    timings = {n: time_prefill(model, n, suffix_tokens, device, repeat) for n in token_counts}
    del model
    if gpu:
        torch.cuda.empty_cache()
    targets_info[target] = {
        "kv_stats_from": src,
        "random_weights": random,
        "kv_fp16_bytes_per_token": per_token,
        "bytes_scaled_from_real_kv": src != target,
        "by_tokens": {},
    }
    for n, (full_s, suffix_s) in timings.items():
        fp16 = per_token * n
        chunks = max(1, n // 256)
        rates = {m: decode_rate(m, st, fp16, gpu, nvdec_gbit, overrides) for m in meths}
        targets_info[target]["by_tokens"][str(n)] = {
            "prefill_s": full_s,
            "suffix_prefill_s": suffix_s,
            "decode_rates": rates,
        }
        click.echo(f"  prefill {n}+{suffix_tokens} tokens: {full_s:.3f} s; suffix only: {suffix_s:.3f} s", err=True)
        for bw in bws:
            res = {"prefill": {"ttft_s": full_s, "bytes": 0, "transfer_s": 0.0, "decode_s": 0.0}}
            for m in meths:
                nbytes = fp16 / st["methods"][m]["ratio_vs_fp16"]
                f, x, d = fetch_time(nbytes, fp16, bw, rates[m]["decode_GBps_fp16"], chunks)
                res[m] = {"ttft_s": f + suffix_s, "bytes": int(nbytes), "transfer_s": x, "decode_s": d}
            for m, r in res.items():
                rows.append(
                    {
                        "model": target,
                        "tokens": n,
                        "bandwidth_gbit": bw,
                        "method": m,
                        "ttft_s": r["ttft_s"],
                        "speedup_vs_raw": res["raw"]["ttft_s"] / r["ttft_s"] if "raw" in res else None,
                        "speedup_vs_cachegen": res["cachegen"]["ttft_s"] / r["ttft_s"] if "cachegen" in res else None,
                        "speedup_vs_prefill": full_s / r["ttft_s"],
                        "bytes": r["bytes"],
                        "transfer_s": r["transfer_s"],
                        "decode_s": r["decode_s"],
                        "device": "gpu" if gpu else "cpu",
                        "suffix_tokens": suffix_tokens,
                    }
                )
    return rows


def decode_rate(m: str, st: dict, fp16: int, gpu: bool, nvdec_gbit: float, overrides: dict) -> dict:
    """The decode rate (GB/s of fp16 KV) a modeled fetch of method `m` uses, and where it comes from."""
    if m in overrides:
        return {"decode_GBps_fp16": overrides[m], "source": "--decode-rate override"}
    if gpu and m == "raw":
        return {"decode_GBps_fp16": h2d_GBps(min(fp16, 1 << 30)), "source": "host-to-device copy (measured)"}
    if gpu and m.startswith("kvcodec"):
        coded = fp16 / st["methods"][m]["ratio_vs_fp16"]
        return {
            "decode_GBps_fp16": fp16 / (coded * 8 / (nvdec_gbit * 1e9)) / 1e9,
            "source": f"NVDEC at {nvdec_gbit:g} Gbit/s coded (--nvdec-gbit)",
        }
    return {
        "decode_GBps_fp16": st["methods"][m]["decode_GBps_fp16"],
        "source": "cpu (measured on the KV-statistics machine)",
    }


def modeled_markdown(rec: dict) -> list[str]:
    """The report of a modeled TTFT record: TTFT per method, then each kvcodec method's speedup
    over raw KV reuse, CacheGen-style reuse and full prefill."""
    rows = rec["rows"]
    meths = list(dict.fromkeys(r["method"] for r in rows if r["method"] != "prefill"))
    kvms = [m for m in meths if m.startswith("kvcodec")]
    targets = list(dict.fromkeys(r["model"] for r in rows))
    tokens = sorted({r["tokens"] for r in rows})
    bws = sorted({r["bandwidth_gbit"] for r in rows})
    speed_cols = [f"{k} vs {b}" for k in kvms for b in ("raw", "CacheGen", "prefill")]
    md = [
        f"# TTFT vs bandwidth ({rec['label']})",
        "",
        f"`{rec['command']}`",
        "",
        rec["notes"],
        "",
        "| model | tokens | Gbit/s | "
        + " | ".join(METHOD_LABELS.get(m, m) for m in ["prefill"] + meths)
        + "".join(f" | {c}" for c in speed_cols)
        + " |",
        "|---|---|---|" + "---|" * (len(meths) + 1 + len(speed_cols)),
    ]

    def x(v) -> str:
        return f"{v:.2f}x" if v else "-"

    for target in targets:
        for n in tokens:
            for bw in bws:
                sel = {
                    r["method"]: r
                    for r in rows
                    if r["model"] == target and r["tokens"] == n and r["bandwidth_gbit"] == bw
                }
                if not sel:
                    continue
                cells = [f"{sel[m]['ttft_s']:.3f}" for m in ["prefill"] + meths]
                for k in kvms:
                    cells += [
                        x(sel[k]["speedup_vs_raw"]),
                        x(sel[k]["speedup_vs_cachegen"]),
                        x(sel[k]["speedup_vs_prefill"]),
                    ]
                md.append(f"| {target} | {n} | {bw:g} | " + " | ".join(cells) + " |")
    return md
