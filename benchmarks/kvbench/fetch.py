"""`kvcodec bench fetch`: time to restore a stored prefix of real KV over a shaped link.

For each link rate (and a jitter trace) and each policy (fixed resolutions, adaptive, and raw fp16
KV through the same store and pipeline), fetch the prefix from a real redis-server and record:
fetch_s, bytes, stage busy times, a per-chunk timeline, and

    bound_s = max(bytes / bandwidth, decode_s) + min(bytes / bandwidth, decode_s) / chunks

(the slower stage for the whole prefix, plus one chunk of the other stage to fill/drain the
pipeline: the least a two-stage pipeline of equal chunks can take), time_over_bound = fetch_s /
bound_s. decode_s is the measured decode busy time of that run, bandwidth the nominal (mean) rate.

Link: "tc-netns" (redis-server in a network namespace behind a veth pair shaped by tc tbf) when
permitted, else "token-bucket" (an in-process shaper around a loopback redis-server). Each record
says which. Results: benchmarks/results/fetch-<machine>-<time>.json and .md.
"""

from __future__ import annotations

import json
import logging
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

import click

log = logging.getLogger(__name__)


def _machine() -> dict:
    from kvcodec.fetcher.profile import device_model

    d = {"cpu": device_model("cpu"), "cpu_count": os.cpu_count(), "python": platform.python_version()}
    try:
        d["load_avg_1m"] = os.getloadavg()[0]  # other users of a shared machine skew CPU timings
    except OSError:
        pass
    try:
        import torch

        d["torch"] = torch.__version__
        if torch.cuda.is_available():
            d["gpu"] = torch.cuda.get_device_name(0)
    except ImportError:
        pass
    return d


def _load_kv(model: str, kv_path: str | None, text: str, tokens: int):
    """(token_ids, kv fp16) from a safetensors file ("kv" [+ "token_ids"]) or a real model prefill
    (cached as safetensors in the cache dir)."""
    import torch
    from safetensors.torch import load_file, save_file

    from kvcodec.fetcher.profile import cache_dir

    if kv_path is None:
        cached = cache_dir() / "bench-kv" / f"{model}-{text.replace('/', '_')}-{tokens}.safetensors"
        if not cached.exists():
            from kvcodec.integrations.hf import extract_kv
            from kvcodec.models.registry import load_model
            from kvcodec.models.texts import load_text

            t = time.perf_counter()
            m, tok = load_model(model)
            ids, kv = extract_kv(m, tok, load_text(text, max_chars=tokens * 8), max_tokens=tokens)
            log.info("prefill of %d tokens took %.1fs", ids.numel(), time.perf_counter() - t)
            cached.parent.mkdir(parents=True, exist_ok=True)
            save_file({"kv": kv.to(torch.float16).contiguous(), "token_ids": ids.contiguous()}, str(cached))
        kv_path = str(cached)
        source = f"{model} prefill of text {text!r}"
    else:
        source = f"file {Path(kv_path).name}"
    d = load_file(kv_path)
    kv = d["kv"].to(torch.float16)[:, :, :tokens].contiguous()
    ids = d.get("token_ids")
    ids = ids[: kv.shape[2]] if ids is not None else torch.arange(kv.shape[2])
    return ids, kv, source


class _Link:
    """The shaped path to a redis-server: tc-netns or token-bucket, with a uniform interface."""

    def __init__(self, kind: str, tmp: Path, store: str = "redis") -> None:
        from kvbench.net.redis_server import RedisServer

        self.kind = kind
        self.netns = None
        self.server = None
        if store == "memory":  # in-process store behind the token bucket: no server, no client cap
            from kvcodec.store import open_store

            self.base = open_store(f"memory://bench-fetch-{id(self)}")
            self.store = self.base
            self.describe = {"link": kind, "rate": "unshaped", "store": "memory"}
            return
        if kind == "tc-netns":
            from kvbench.net.netns import NetnsLink

            self.netns = NetnsLink(100.0).open()
            self.server = RedisServer(tmp / "redis", bind=self.netns.ns_ip, netns=self.netns.name,
                                      appendonly=False).start()
        else:
            self.server = RedisServer(tmp / "redis", appendonly=False).start()
        from kvcodec.store import open_store

        self.base = open_store(self.server.url, socket_timeout=30.0, socket_read_size=1 << 20)
        self.store = self.base
        self.describe: dict = {"link": kind, "rate": "unshaped"}

    def shape(self, trace) -> None:
        from kvbench.net.throttle import ThrottledStore

        if self.netns is not None:
            if len(trace.segments) == 1:
                self.netns.set_rate(trace.segments[0][1])
            else:
                self.netns.play(trace)
            self.store = self.base
            self.describe = self.netns.describe()
        else:
            self.store = ThrottledStore(self.base, jitter_trace=trace)
            self.describe = self.store.link.describe()

    def unshape(self) -> None:
        if self.netns is not None:
            self.netns.set_rate(100.0)
        self.store = self.base

    def close(self) -> None:
        self.base.close()
        if self.server is not None:
            self.server.kill()
        if self.netns is not None:
            self.netns.close()


def _goodput(store, key: str, nbytes: int, repeats: int = 3) -> float:
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        store.get(key)
        best = min(best, time.perf_counter() - t)
    return nbytes * 8 / best / 1e9


@click.command("fetch")
@click.option("--model", default="smollm2-135m", show_default=True, help="Registry model whose prefill KV is fetched.")
@click.option("--kv", "kv_path", default=None, help="Use a saved safetensors KV ('kv' [+ 'token_ids']) instead.")
@click.option("--text", default="pg", show_default=True, help="Text (kvcodec.models.texts name) to prefill.")
@click.option("--tokens", "prefix_tokens", default=1024, show_default=True)
@click.option("--chunk-tokens", default=256, show_default=True)
@click.option("--quant", default="int8", show_default=True)
@click.option("--resolutions", default="256x256,512x512,1024x1024", show_default=True)
@click.option("--rates", default="1,2,4,8,16,25,40", show_default=True, help="Link rates, Gbit/s.")
@click.option("--jitter-mean", default=4.0, show_default=True, help="Mean Gbit/s of the jitter trace (0: none).")
@click.option("--jitter-cv", default=0.6, show_default=True)
@click.option("--jitter-segment-ms", default=50.0, show_default=True)
@click.option("--policies", default="fixed:0,fixed:1,fixed:2,adaptive,raw-fp16", show_default=True)
@click.option("--link", "link_kind", type=click.Choice(["auto", "tc-netns", "token-bucket"]), default="auto",
              show_default=True)
@click.option("--repeats", default=3, show_default=True)
@click.option("--device", default="cpu", show_default=True)
@click.option("--max-inflight", default=4, show_default=True)
@click.option("--decode-workers", default=1, show_default=True)
@click.option("--net-workers", default=1, show_default=True, help="Concurrent gets per fetch.")
@click.option("--torch-threads", default=1, show_default=True,
              help="torch intra-op threads on the CPU (0: leave torch's default). More than 1 on a "
                   "small shared CPU makes decode several times slower.")
@click.option("--store", "store_kind", type=click.Choice(["redis", "memory"]), default="redis", show_default=True,
              help="redis: a real redis-server process; memory: an in-process store (token-bucket link only; "
                   "for machines without redis-server, and rates a single Redis client cannot reach).")
@click.option("--nvdec-pool", "pool_workers", default=0, show_default=True,
              help="On CUDA: restore in an NVDEC pool of this many worker processes (kvcodec.video.nvdec_pool."
                   "PoolCodec; use --decode-workers of the same number). 0: the codec's own decoder.")
@click.option("--out-dir", default="benchmarks/results", show_default=True)
def command(model, kv_path, text, prefix_tokens, chunk_tokens, quant, resolutions, rates, jitter_mean,
            jitter_cv, jitter_segment_ms, policies, link_kind, repeats, device, max_inflight,
            decode_workers, net_workers, torch_threads, store_kind, pool_workers, out_dir):
    """Time restoring a stored prefix over a shaped link: fixed vs adaptive resolution vs raw fp16."""
    import torch

    from kvbench.net.trace import JitterTrace
    from kvcodec.config import CodecConfig
    from kvcodec.fetcher import PrefixCache
    from kvcodec.fetcher.keys import blob_key
    from kvcodec.fetcher.rawcodec import RawCodec

    if torch_threads > 0:
        torch.set_num_threads(torch_threads)
    args = sys.argv[1:]
    if "fetch" in args:  # the CLI path; under a test runner argv is the runner's
        cmdline = "kvcodec " + " ".join(args)
    else:
        ctx = click.get_current_context()
        cmdline = "kvcodec bench fetch " + " ".join(
            f"--{k.replace('_', '-')} {v}" for k, v in ctx.params.items() if v is not None)
    res = tuple(tuple(int(v) for v in r.split("x")) for r in resolutions.split(","))
    cfg = CodecConfig(quant=quant, chunk_tokens=chunk_tokens, resolutions=res)
    raw_cfg = CodecConfig(quant="exact", chunk_tokens=chunk_tokens, resolutions=(res[0],))
    rate_list = [float(r) for r in rates.split(",") if r]
    traces = [JitterTrace.constant(r) for r in rate_list]
    if jitter_mean > 0:
        n_seg = max(20, int(20.0 / (jitter_segment_ms / 1e3)) // 10)
        traces.append(JitterTrace.random_walk(jitter_mean, cv=jitter_cv, segment_s=jitter_segment_ms / 1e3,
                                              n=n_seg, seed=1))
    pols = [p for p in policies.split(",") if p]

    if store_kind == "memory":
        if link_kind == "tc-netns":
            raise click.BadParameter("--store memory has no network path: use --link token-bucket")
        link_kind = "token-bucket"
    if link_kind == "auto":
        from kvbench.net.netns import NetnsLink

        ok, why = NetnsLink.available()
        link_kind = "tc-netns" if ok else "token-bucket"
        if not ok:
            click.echo(f"tc-netns link unavailable ({why}); using the token bucket", err=True)

    ids, kv, source = _load_kv(model, kv_path, text, prefix_tokens)
    T = kv.shape[2]
    L, _, _, H, D = kv.shape
    click.echo(f"KV {tuple(kv.shape)} from {source}; link {link_kind}", err=True)
    machine = _machine()
    records = []
    pool, hevc_codec = None, None
    if pool_workers > 0:
        from kvcodec.video.nvdec_pool import NvdecPool, PoolCodec

        pool = NvdecPool(workers=pool_workers, device=device, max_frame=max(res, key=lambda r: r[0] * r[1]))
        hevc_codec = PoolCodec(pool)
    with tempfile.TemporaryDirectory(prefix="kvc-bench-") as tmp:
        link = _Link(link_kind, Path(tmp), store_kind)
        try:
            hevc = PrefixCache(link.base, model, cfg, device, max_inflight=max_inflight,
                               decode_workers=decode_workers, codec=hevc_codec)
            raw = PrefixCache(link.base, model, raw_cfg, device, codec=RawCodec(), max_inflight=max_inflight,
                              decode_workers=decode_workers, policy="fixed:0")
            raw.put(ids, kv)
            raw_bytes = kv.numel() * 2
            encode_s, sizes, profile = None, [], None
            if any(p != "raw-fp16" for p in pols):
                t = time.perf_counter()
                hevc.put(ids, kv)
                encode_s = time.perf_counter() - t
                profile = hevc.ensure_profile((L, H, D), kv.dtype)
                keys = hevc.keys(ids)
                sizes = [sum(len(link.base.get(blob_key(k, j)) or b"") for k in keys) for j in range(len(res))]
                click.echo(f"encoded in {encode_s:.1f}s; bytes per resolution {sizes} (fp16 {raw_bytes}); "
                           f"decode profile {[f'{v / 1e6:.1f}M/s' for v in profile.values_per_s()]}", err=True)
            # link goodput probe: the largest object, per condition
            probe_key = blob_key(raw.keys(ids)[0], 0)
            probe_bytes = len(link.base.get(probe_key))
            for trace in traces:
                link.shape(trace)
                goodput = _goodput(link.store, probe_key, probe_bytes)
                for pol in pols:
                    is_raw = pol == "raw-fp16"
                    base_cache = raw if is_raw else hevc
                    pc = PrefixCache(link.store, model, base_cache.config, device, codec=base_cache.codec,
                                     policy="fixed:0" if is_raw else pol, max_inflight=max_inflight,
                                     decode_workers=decode_workers, net_workers=net_workers,
                                     profile=None if is_raw else profile)
                    pc.fetch(ids, T)  # warm-up: the bandwidth estimator learns the link
                    runs = []
                    for _ in range(repeats):
                        out = torch.empty((L, 2, T, H, D), dtype=kv.dtype, device=device)
                        t = time.perf_counter()
                        r = pc.fetch(ids, T, out=out)
                        dt = time.perf_counter() - t
                        if r.error is not None:
                            raise click.ClickException(f"fetch failed under {pol} at {trace.name}: {r.error}")
                        runs.append((dt, r))
                    runs.sort(key=lambda x: x[0])
                    fetch_s, med = runs[len(runs) // 2]
                    s = med.stats
                    bw = trace.mean_gbit
                    net_s = s.bytes_fetched * 8 / (bw * 1e9)
                    dec_s = s.decode_busy_s / decode_workers
                    n = max(1, s.chunks_restored)
                    bound = max(net_s, dec_s) + min(net_s, dec_s) / n
                    if is_raw:
                        exact = bool(torch.equal(med.kv.cpu(), kv))
                    else:
                        exact = None
                    rec = {
                        "bandwidth_gbit": bw,
                        "trace": trace.name,
                        "prefix_tokens": T,
                        "policy": pol,
                        "fetch_s": fetch_s,
                        "fetch_s_min": runs[0][0],
                        "fetch_s_all": [x[0] for x in runs],
                        "bound_s": bound,
                        "time_over_bound": fetch_s / bound,
                        "bytes": s.bytes_fetched,
                        "fp16_bytes": raw_bytes,
                        "net_s_at_nominal_rate": net_s,
                        "decode_s": dec_s,
                        "link_goodput_gbit": goodput,
                        "link": link.describe["link"],
                        "link_detail": link.describe,
                        "resolution_counts": s.resolution_counts,
                        "stats": {k: v for k, v in s.to_dict().items() if k != "timeline"},
                        "timeline": [vars(t) for t in s.timeline],
                        "bit_exact": exact,
                        "machine": machine,
                        "load_avg_1m": os.getloadavg()[0],
                        "torch_threads": torch.get_num_threads(),
                        "device": device,
                        "net_workers": net_workers,
                        "decode_workers": decode_workers,
                        "store": store_kind,
                        "nvdec_pool_workers": pool_workers,
                    }
                    records.append(rec)
                    click.echo(f"{trace.name:>36} {pol:>10}: {fetch_s * 1e3:8.1f} ms  bound {bound * 1e3:8.1f} ms"
                               f"  x{fetch_s / bound:5.2f}  {s.bytes_fetched / 1e6:6.2f} MB  {s.resolution_counts}",
                               err=True)
                link.unshape()
        finally:
            link.close()
            if pool is not None:
                pool.close()

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%d-%H%M%S", time.gmtime())
    host = "gpu" if "gpu" in machine else "cpu"
    base = out / f"fetch-{host}-{stamp}"
    doc = {
        "benchmark": "fetch",
        "command": cmdline,
        "kv_source": source,
        "kv_shape": list(kv.shape),
        "codec_config": cfg.to_dict(),
        "encode_s": encode_s,
        "bytes_per_resolution": dict(zip(["x".join(map(str, r)) for r in res], sizes)),
        "decode_profile": profile.to_json() | {"source": profile.source} if profile else None,
        "machine": machine,
        "link": link_kind,
        "records": records,
    }
    base.with_suffix(".json").write_text(json.dumps(doc, indent=1))
    lines = [f"# fetch benchmark ({host}, link {link_kind})", "", f"`{cmdline}`", "",
             f"KV {tuple(kv.shape)} fp16 from {source}; machine {machine['cpu']}", "",
             "| rate Gbit/s | trace | policy | fetch ms | bound ms | x bound | MB | resolutions | link goodput Gbit/s |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in records:
        lines.append(f"| {r['bandwidth_gbit']:g} | {r['trace']} | {r['policy']} | {r['fetch_s'] * 1e3:.1f} | "
                     f"{r['bound_s'] * 1e3:.1f} | {r['time_over_bound']:.2f} | {r['bytes'] / 1e6:.2f} | "
                     f"{r['resolution_counts']} | {r['link_goodput_gbit']:.2f} |")
    base.with_suffix(".md").write_text("\n".join(lines) + "\n")
    click.echo(f"wrote {base}.json and .md", err=True)
