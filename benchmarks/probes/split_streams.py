"""Probe: a chunk as several HEVC streams (CodecConfig.streams_per_chunk, issue 14), so that one
fetch keeps every NVDEC engine busy. Two steps:

    # CPU: encode a real KV (given by path) once per split, measure coded size and frames per
    # chunk, keep the first --carry-tokens of each split for the GPU, hash the CPU restore
    python benchmarks/probes/split_streams.py prepare --kv kv.safetensors --streams 1,2,4 --dir D

    # GPU: batch restore rate per split on in-process NVDEC threads (one CUDA context), a bf16
    # matmul's slowdown beside it, then fetches of --fetch-tokens over a token-bucket link
    python benchmarks/probes/split_streams.py run --dir D --out OUT_DIR

The GPU step stores --fetch-tokens by replicating the carried chunks of the real KV under
distinct keys (each copy's header rebound to its key, chunk index and first token; the coded
bytes are those of the real chunks), because a call carries at most 64 MiB.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import pathlib
import sys
import time

import torch

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parent))

from kvcodec.codecs.hevc.codec import HevcCodec  # noqa: E402
from kvcodec.codecs.hevc.decode import decode_chunk_blob, part_headers  # noqa: E402
from kvcodec.config import CodecConfig  # noqa: E402
from kvcodec.container import split  # noqa: E402
from kvcodec.container.format import CHUNK_MAGIC, read_object, write_object  # noqa: E402


def sha(t: torch.Tensor) -> str:
    return hashlib.sha256(t.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()


def config_for(args, streams: int) -> CodecConfig:
    w, h = (int(v) for v in args.resolution.split("x"))
    return CodecConfig(quant=args.quant, resolutions=((w, h),), streams_per_chunk=streams)


def prepare(args) -> None:
    from safetensors.torch import load_file

    kv = load_file(args.kv)["kv"].to(torch.float16)[:, :, : args.size_tokens].contiguous()
    out = pathlib.Path(args.dir)
    out.mkdir(parents=True, exist_ok=True)
    carry_chunks = args.carry_tokens // 256
    manifest = {"kv": pathlib.Path(args.kv).name, "kv_shape": list(kv.shape), "splits": [], "hashes": []}
    ref = None
    for s in [int(v) for v in args.streams.split(",")]:
        config = config_for(args, s)
        t = time.perf_counter()
        chunks = HevcCodec(config).encode_chunks(kv)
        encode_s = time.perf_counter() - t
        blobs = [c.blobs[0] for c in chunks]
        heads = [part_headers(b) for b in blobs]
        restored = torch.cat([decode_chunk_blob(b) for b in blobs[:carry_chunks]], dim=2)
        if ref is None:
            ref = restored
            manifest["hashes"] = [sha(restored[:, :, i * 256 : (i + 1) * 256]) for i in range(carry_chunks)]
        rec = {
            "streams_per_chunk": s,
            "config": config.to_dict(),
            "parts": len(heads[0]),
            "part_layers": [h.layers for h in heads[0]],
            "bytes": sum(map(len, blobs)),
            "video_bytes": sum(st.length for hs in heads for h in hs for st in h.streams if st.name == "video"),
            "frames_per_chunk": sum(h.frames for h in heads[0]),
            "tokens": kv.shape[2],
            "fp16_bytes": kv.numel() * 2,
            "encode_s_cpu": round(encode_s, 2),
            "same_values_as_one_stream": bool(torch.equal(restored, ref)),
        }
        rec["ratio_vs_fp16"] = round(rec["fp16_bytes"] / rec["bytes"], 4)
        if s in [int(v) for v in args.carry.split(",")]:
            for i, b in enumerate(blobs[:carry_chunks]):
                (out / f"s{s}-c{i}.blob").write_bytes(b)
            rec["carried_chunks"] = carry_chunks
        manifest["splits"].append(rec)
        print(json.dumps(rec), flush=True)
    one = manifest["splits"][0]["bytes"]
    for rec in manifest["splits"]:
        rec["size_vs_one_stream"] = round(rec["bytes"] / one, 4)
    (out / "manifest.json").write_text(json.dumps(manifest, indent=1))


# --------------------------------------------------------------------------------------------- GPU


def rebind(blob: bytes, key: str, index: int, start: int) -> bytes:
    """`blob` with its header (and each part's) naming another key, chunk index and first token."""

    def edit(h: dict) -> None:
        h.update(key=key, chunk_index=index, start_token=start)

    if not split.is_split(blob):
        h, payload = read_object(blob, CHUNK_MAGIC, "chunk")
        edit(h)
        return write_object(CHUNK_MAGIC, h, [bytes(payload)])
    h, payload = read_object(blob, split.SPLIT_MAGIC, "split chunk")
    parts, pos = [], 0
    for p in h["parts"]:
        parts.append(rebind(bytes(payload[pos : pos + p["length"]]), key, index, start))
        pos += p["length"]
    edit(h)
    for p, b in zip(h["parts"], parts):
        p["length"] = len(b)
    return write_object(split.SPLIT_MAGIC, h, parts)


class Split:
    """One split's carried chunks, replicated to `chunks` chunks bound to `keys`."""

    def __init__(self, rec: dict, d: pathlib.Path, keys: list[str]):
        self.rec, self.s = rec, rec["streams_per_chunk"]
        self.config = CodecConfig.from_dict(rec["config"])
        distinct = [(d / f"s{self.s}-c{i}.blob").read_bytes() for i in range(rec["carried_chunks"])]
        self.blobs = [rebind(distinct[i % len(distinct)], k, i, i * 256) for i, k in enumerate(keys)]
        self.bytes = sum(map(len, self.blobs))


class Phases:
    """Wall seconds spent inside wrapped functions, summed over threads (a thread waiting for the
    GIL inside one counts too): where a restore's time goes, per stream."""

    WRAPPED = (
        ("kvcodec.codecs.hevc.decode", "parse_chunk", "header parse"),
        ("kvcodec.codecs.hevc.decode", "split_streams", "stream split + CRC"),
        ("kvcodec.codecs.hevc.decode", "_chunk_terms", "side streams, uploads, terms"),
        ("kvcodec.codecs.hevc.decode", "_stream_tensor", "terms: one stream to the device"),
        ("kvcodec.codecs.hevc.decode", "_unzstd_into", "terms: zstd"),
        ("kvcodec.codecs.hevc.decode", "_copy_into", "terms: raw copy"),
        ("kvcodec.quant.centering", "uncenter_terms", "terms: uncenter ops"),
        ("kvcodec.codecs.hevc.decode", "restorer_for", "restorer"),
        ("kvcodec.codecs.hevc.decode", "_restore_frames", "frames: decode + restore"),
        ("kvcodec.video.nvcuvid._Parser", "__init__", "parser create"),
        ("kvcodec.video.nvcuvid._Session", "_copy_out", "map + copy + sync per frame"),
        ("kvcodec.video.nvcuvid._Parser", "feed", "parser feed (decode calls)"),
        ("kvcodec.video.nvcuvid._Parser", "close", "parser destroy"),
    )

    def __init__(self):
        import importlib
        import threading

        self.lock, self.acc, self.undo = threading.Lock(), {}, []
        for mod, attr, label in self.WRAPPED:
            owner = importlib.import_module(mod) if "._" not in mod else self._cls(importlib, mod)
            fn = getattr(owner, attr)
            setattr(owner, attr, self._wrap(fn, label))
            self.undo.append((owner, attr, fn))

    @staticmethod
    def _cls(importlib, path):
        mod, cls = path.rsplit(".", 1)
        return getattr(importlib.import_module(mod), cls)

    def _wrap(self, fn, label):
        import functools

        @functools.wraps(fn)
        def timed_call(*a, **k):
            t = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                dt = time.perf_counter() - t
                with self.lock:
                    n, s = self.acc.get(label, (0, 0.0))
                    self.acc[label] = (n + 1, s + dt)

        return timed_call

    def close(self) -> dict:
        for owner, attr, fn in self.undo:
            setattr(owner, attr, fn)
        return {k: {"calls": n, "ms_total": round(s * 1e3, 2)} for k, (n, s) in self.acc.items()}


def batch_rate(sp: Split, restore, shape, hashes, seconds: float) -> dict:
    """Every part of every chunk submitted at once to restore(blobs, outs) (NVDEC threads or a
    pool): the steady-state rate."""
    from nvcuvid_scaling import timed

    from kvcodec.codecs.hevc.decode import chunk_parts

    out = torch.empty(shape, dtype=torch.float16, device="cuda")
    jobs = [p for i, b in enumerate(sp.blobs) for p in chunk_parts(b, out[:, :, i * 256 : (i + 1) * 256])]
    blobs, outs = [b for b, _ in jobs], [t for _, t in jobs]

    def run():
        restore(blobs, outs)
        torch.cuda.synchronize()

    s = timed(run, seconds)
    phases = Phases()
    t = time.perf_counter()
    run()
    profiled_s = time.perf_counter() - t
    phases = {"profiled_run_s": round(profiled_s, 4), **phases.close()}
    exact = all(sha(out[:, :, i * 256 : (i + 1) * 256]) == h for i, h in enumerate(hashes))
    return {
        "jobs": len(jobs),
        "seconds": s,
        "restored_gb_per_s": round(out.numel() * 2 / s / 1e9, 3),
        "coded_gbit_per_s": round(sp.bytes * 8 / s / 1e9, 3),
        "exact_vs_cpu": exact,
        "phases": phases,
        "run": run,
        "out": out,
    }


def fetch_records(sp: Split, threads, ids, args, store, rates, want: torch.Tensor) -> list[dict]:
    from kvbench.net.throttle import ThrottledStore
    from kvcodec.fetcher import PrefixCache
    from kvcodec.fetcher.profile import DecodeProfile

    codec = HevcCodec(sp.config, pool=threads)
    sync = torch.cuda.synchronize if want.is_cuda else (lambda: None)
    recs = []
    for (workers, inflight), rate in [(w, r) for w in args.workers for r in rates]:
        link = ThrottledStore(store, rate) if rate > 0 else store
        pc = PrefixCache(
            link,
            "split-probe",
            codec,
            want.device,
            policy="fixed:0",
            max_inflight=inflight,
            decode_workers=workers,
            profile=DecodeProfile.default(sp.config.resolutions),
        )
        pc.fetch(ids, args.fetch_tokens)
        runs = []
        for _ in range(args.repeats):
            out = torch.empty(want.shape, dtype=torch.float16, device=want.device)
            sync()
            t = time.perf_counter()
            r = pc.fetch(ids, args.fetch_tokens, out=out)
            sync()
            runs.append((time.perf_counter() - t, r, out))
        runs.sort(key=lambda x: x[0])
        fetch_s, r, out = runs[len(runs) // 2]
        st = r.stats
        recs.append(
            {
                "streams_per_chunk": sp.s,
                "bandwidth_gbit": rate or None,
                "prefix_tokens": args.fetch_tokens,
                "fetch_s": fetch_s,
                "fetch_s_all": [x[0] for x in runs],
                "bytes": st.bytes_fetched,
                "fp16_bytes": want.numel() * 2,
                "tokens_restored": r.tokens_restored,
                "error": str(r.error) if r.error else None,
                "exact_vs_batch_restore": bool(torch.equal(out, want)),
                "decode_workers": workers,
                "max_inflight": inflight,
                "stats": {k: v for k, v in st.to_dict().items() if k != "timeline"},
                "timeline": [vars(t) for t in st.timeline],
            }
        )
        print(
            f"fetch s={sp.s} workers={workers} inflight={inflight} rate={rate}: {fetch_s * 1e3:.1f} ms "
            f"({r.tokens_restored} tokens)",
            flush=True,
        )
    return recs


def pool_records(args, splits, shape, hashes, ids) -> list[dict]:
    """The same batch restore (and the fetch at the first rate) in an NvdecPool of worker processes."""
    from nvcuvid_scaling import free_mb

    from kvcodec.codecs.hevc.pool import open_pool, restore_in_pool

    before = free_mb()
    pool = open_pool(args.pool, device="cuda", max_frame=tuple(splits[0].config.resolutions[0]))
    standing = round(before - free_mb(), 1)
    recs = []
    try:
        for sp in splits:
            b = batch_rate(sp, lambda bl, o: restore_in_pool(pool, bl, o), shape, hashes, args.seconds)
            rec = {"backend": f"nvdec-pool:{args.pool}", "cuda_contexts": args.pool + 1, "gpus": 1}
            rec |= {"streams_per_chunk": sp.s, "standing_mb": standing}
            rec |= {k: v for k, v in b.items() if k not in ("run", "out", "phases")}
            print(json.dumps(rec), flush=True)
            recs.append(rec)
    finally:
        pool.close()
    return recs


def run(args) -> None:
    from nvcuvid_scaling import free_mb, matmul_tflops

    from kvcodec.codecs.base import EncodedChunk
    from kvcodec.codecs.hevc.pool import open_threads, restore_chunk
    from kvcodec.fetcher import PrefixCache
    from kvcodec.store import open_store

    d = pathlib.Path(args.dir)
    manifest = json.loads((d / "manifest.json").read_text())
    L, _, _, H, D = manifest["kv_shape"]
    n_chunks = -(-args.fetch_tokens // 256)
    shape = (L, 2, n_chunks * 256, H, D)
    ids = torch.arange(n_chunks * 256)
    results = {"manifest": manifest, "decode": [], "fetch": [], "gpu": torch.cuda.get_device_name()}
    results["args"] = vars(args)
    alone = matmul_tflops(1.0)
    results["matmul_alone_tflops"] = round(alone, 1)
    before = free_mb()
    store = open_store("memory://split-probe")
    splits, threads = [], None
    wanted = {int(v) for v in args.splits.split(",") if v}
    for rec in [r for r in manifest["splits"] if "carried_chunks" in r]:
        if wanted and rec["streams_per_chunk"] not in wanted:
            continue
        writer = PrefixCache(store, "split-probe", HevcCodec(CodecConfig.from_dict(rec["config"])))
        sp = Split(rec, d, writer.keys(ids))
        for i, (k, b) in enumerate(zip(writer.keys(ids), sp.blobs)):
            writer.store_chunk(k, EncodedChunk(i, i * 256, 256, sp.config.resolutions, (b,)), (L, H, D), "float16")
        if threads is None:
            threads = open_threads(args.sessions, warm_blob=sp.blobs[0])
            results["standing_mb"] = round(before - free_mb(), 1)
        splits.append(sp)

    def on_threads(blobs, outs):
        threads.restore_blobs(blobs, outs, decode_into=restore_chunk)

    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    for interval in [float(v) for v in args.switch_intervals.split(",")]:
        sys.setswitchinterval(interval)
        for sp in splits:
            rec = measure_batch(args, sp, on_threads, shape, manifest["hashes"], alone)
            results["decode"].append(rec | {"switch_interval_s": interval, "standing_mb": results["standing_mb"]})
            print(json.dumps(results["decode"][-1]), flush=True)
        best = max(r["coded_gbit_per_s"] for r in results["decode"])
        for sp in splits:
            want = sp.batch["out"][:, :, : args.fetch_tokens]
            for r in fetch_records(sp, threads, ids, args, store, [float(v) for v in args.rates.split(",")], want):
                results["fetch"].append(r | {"switch_interval_s": interval})
        for r in results["fetch"]:  # the bound: the best batch rate of the whole run
            link = r["bytes"] * 8 / (r["bandwidth_gbit"] * 1e9) if r["bandwidth_gbit"] else 0.0
            r["bound_s"] = max(link, r["bytes"] * 8 / (best * 1e9))
            r["bound_nvdec_gbit"] = best
            r["time_over_bound"] = round(r["fetch_s"] / r["bound_s"], 3)
        (out / "split-streams.json").write_text(json.dumps(results, indent=1, default=str))
    threads.close()
    if args.pool:
        results["pool"] = pool_records(args, splits, shape, manifest["hashes"], ids)
        (out / "split-streams.json").write_text(json.dumps(results, indent=1, default=str))


def measure_batch(args, sp: Split, restore, shape, hashes, alone: float) -> dict:
    from nvcuvid_scaling import interference

    sp.batch = batch_rate(sp, restore, shape, hashes, args.seconds)
    rec = {
        "backend": f"nvcuvid:{args.sessions}x{args.sessions}",
        "cuda_contexts": 1,
        "gpus": 1,
        "streams_per_chunk": sp.s,
        "chunks": shape[2] // 256,
        **{k: v for k, v in sp.batch.items() if k not in ("run", "out")},
    }
    if sp.s in [int(v) for v in args.interference.split(",") if v]:
        rec.update(interference(sp.batch["run"], args.interference_seconds, alone))
    return rec


def report(args) -> None:
    """Markdown tables of a run's JSON (sizes, batch restores, fetches)."""
    doc = json.loads(pathlib.Path(args.json).read_text())
    lines = ["| streams/chunk | parts (layers) | bytes | vs 1 stream | video bytes | frames/chunk | ratio vs fp16 |"]
    lines.append("|---|---|---|---|---|---|---|")
    for r in doc["manifest"]["splits"]:
        lines.append(
            f"| {r['streams_per_chunk']} | {r['part_layers']} | {r['bytes']} | {r['size_vs_one_stream']:.4f} | "
            f"{r['video_bytes']} | {r['frames_per_chunk']} | {r['ratio_vs_fp16']:.3f} |"
        )
    lines += [
        "",
        "| backend | switch s | streams/chunk | jobs | restored GB/s | coded Gbit/s | matmul slowdown | exact |",
    ]
    lines.append("|---|---|---|---|---|---|---|---|")
    for r in doc["decode"] + doc.get("pool", []):
        slow = f"{r['matmul_slowdown'] * 100:.1f}%" if "matmul_slowdown" in r else ""
        lines.append(
            f"| {r['backend']} | {r.get('switch_interval_s', '')} | {r['streams_per_chunk']} | {r['jobs']} | "
            f"{r['restored_gb_per_s']} | {r['coded_gbit_per_s']} | {slow} | {r['exact_vs_cpu']} |"
        )
    lines += [
        "",
        "| switch s | streams/chunk | workers:inflight | link Gbit/s | fetch ms (median) | all ms | bound ms | x bound |",
    ]
    lines.append("|---|---|---|---|---|---|---|---|")
    for r in doc["fetch"]:
        lines.append(
            f"| {r.get('switch_interval_s', '')} | {r['streams_per_chunk']} | {r['decode_workers']}:{r['max_inflight']} | "
            f"{r['bandwidth_gbit'] or 'unshaped'} | {r['fetch_s'] * 1e3:.1f} | "
            f"{', '.join(f'{x * 1e3:.0f}' for x in r['fetch_s_all'])} | {r['bound_s'] * 1e3:.1f} | "
            f"{r['time_over_bound']:.2f} |"
        )
    print("\n".join(lines))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="step", required=True)
    p = sub.add_parser("prepare")
    p.add_argument("--kv", required=True)
    p.add_argument("--streams", default="1,2,3,4,5,7")
    p.add_argument("--carry", default="1,2,4")
    p.add_argument("--size-tokens", type=int, default=1024)
    p.add_argument("--carry-tokens", type=int, default=512)
    p.add_argument("--quant", default="int8")
    p.add_argument("--resolution", default="512x512")
    p.add_argument("--dir", required=True)
    r = sub.add_parser("run")
    r.add_argument("--dir", required=True)
    r.add_argument("--out", required=True)
    r.add_argument("--fetch-tokens", type=int, default=8000)
    r.add_argument("--sessions", type=int, default=7)
    r.add_argument("--seconds", type=float, default=1.0)
    r.add_argument("--interference", default="", help="splits whose matmul slowdown is measured")
    r.add_argument("--interference-seconds", type=float, default=2.0)
    r.add_argument("--rates", default="40", help="link Gbit/s (0: no shaping)")
    r.add_argument("--repeats", type=int, default=5)
    r.add_argument("--workers", default="7:16", help="decode_workers:max_inflight pairs of the fetches")
    r.add_argument("--splits", default="", help="streams_per_chunk values to run (default: every carried one)")
    r.add_argument(
        "--switch-intervals", default="0.005", help="sys.setswitchinterval values (s) to run everything under"
    )
    r.add_argument("--pool", type=int, default=0, help="also restore in an NvdecPool of this many processes")
    t = sub.add_parser("report")
    t.add_argument("--json", required=True)
    args = ap.parse_args()
    if args.step == "report":
        return report(args)
    if args.step == "run":
        args.workers = [tuple(int(v) for v in p.split(":")) for p in args.workers.split(",")]
    prepare(args) if args.step == "prepare" else run(args)


if __name__ == "__main__":
    main()
