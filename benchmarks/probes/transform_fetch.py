#!/usr/bin/env python3
"""Probe: fetch of transform-coded KV through PrefixCache on CUDA, with and without the staged
(batched) restore of the fetch pipeline (codecs.base.StagedDecode; issue 12).

    # on a CPU machine: a transform calibrated on two essays, other essays' SmolLM2 KV (fp16)
    # coded with it into a file:// store (20 MB for 2048 tokens at the compact preset)
    python benchmarks/probes/transform_fetch.py prep --dir D [--texts pg/gap,pg/love]
    # on the GPU machine
    python benchmarks/probes/transform_fetch.py run --dir D --out OUT.json

prep writes the .kvt beside D (not into it) and into D the calibration with each basis cut to the
coordinates the stored chunks code (benchmarks/transform_nvdec.py's pack: the data travels light;
the codec keeps the .kvt's hash, so its id and chunk keys are the .kvt's).

run copies the stored chunks into a memory:// store (the network is not timed) and fetches every
prefix with PrefixCache(..., "cuda", decode_workers=W, max_inflight=M, batched_restore=B) for
each W and B: restored GB/s of fp16 KV over `--repeat` fetches after one warm-up, and the batch
sizes the staged restore's finish was handed. For comparison, restore_chunks on NvcuvidThreads
(every chunk at once, no fetcher) where the driver's libnvcuvid opens. Exactness: every CUDA
result against the same fetch on the CPU (FFmpeg decode, reference math: equal up to fp16
rounding of float32 sums in another order), the CPU fetch against the hash prep computed, and
the batched fetch against the unbatched one.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import pathlib
import platform
import shlex
import sys
import time

import torch

MODEL = "smollm2-135m"
CAL_TEXTS = ("pg/aord", "pg/apple")


def _sha(t: torch.Tensor) -> str:
    return hashlib.sha256(t.cpu().contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()


PACK = "transform.pack.safetensors"


def _kvt(d: pathlib.Path) -> pathlib.Path:
    return d.parent / "smollm2.kvt"


def _codec(d: pathlib.Path):
    from kvcodec.codecs.transform.codec import TransformCodec

    options = json.loads((d / "codec.json").read_text())
    if not (d / PACK).exists():
        return TransformCodec(_kvt(d), **options)
    from transform_nvdec import load_pack

    packed = load_pack(d / PACK)
    return TransformCodec(packed.cal, kvt_hash=packed.kvt_hash, **options)


def pack(d: pathlib.Path) -> None:
    """The calibration cut to the widest coordinates any stored chunk codes, into D."""
    from kvcodec.fetcher import blob_key
    from kvcodec.store import open_store
    from transform_nvdec import _write_pack

    codec, store = _codec(d), open_store(f"file://{d / 'store'}")
    cache, widths = _cache(store, codec, "cpu"), None
    for p in json.loads((d / "prefixes.json").read_text())["prefixes"]:
        for k in cache.keys(p["ids"]):
            counts = codec.plan(codec.header(store.get(blob_key(k, 0)))["theta"]).counts
            widths = [max(a, b) for a, b in zip(widths or counts, counts)]
    _write_pack(codec.cal, codec.kvt_hash, widths, d / PACK)
    assert _codec(d).id == codec.id


def _cache(store, codec, device: str, **kw):
    from kvcodec.fetcher import DecodeProfile, PrefixCache

    kw.setdefault("profile", DecodeProfile.default(codec.resolutions))
    return PrefixCache(store, MODEL, codec, device, policy="fixed:0", **kw)


def prep(d: pathlib.Path, texts: list[str], cal_tokens: int, tokens: int, options: dict) -> None:
    from kvcodec.integrations.hf import extract_kv
    from kvcodec.models import load_model
    from kvcodec.models.texts import load_text
    from kvcodec.store import open_store
    from kvcodec.transform import RopeSpec, calibrate, save_kvt

    d.mkdir(parents=True, exist_ok=True)
    model, tok = load_model(MODEL)
    if not _kvt(d).exists():  # a calibration of an earlier prep is kept
        kvs = [extract_kv(model, tok, load_text(t), cal_tokens)[1] for t in CAL_TEXTS]
        save_kvt(calibrate(kvs, RopeSpec.from_hf_config(model.config), info={"model": MODEL}), _kvt(d))
    (d / "codec.json").write_text(json.dumps(options))
    codec = _codec(d)
    cache = _cache(open_store(f"file://{d / 'store'}"), codec, "cpu")
    prefixes = []
    for t in texts:
        ids, kv = extract_kv(model, tok, load_text(t), tokens)
        ids = ids.tolist()
        cache.put(ids, kv.half())
        r = cache.fetch(ids)
        assert r.ok, r.error
        rel = float((r.kv.float() - kv).norm() / kv.norm())
        prefixes.append({"text": t, "ids": ids, "cpu_sha256": _sha(r.kv), "relative_error": rel})
    (d / "prefixes.json").write_text(json.dumps({"codec_id": codec.id, "prefixes": prefixes}))
    pack(d)
    size = sum(f.stat().st_size for f in d.rglob("*") if f.is_file())
    print(f"{d}: {size / 1e6:.1f} MB; codec {codec.id}; relative errors {[p['relative_error'] for p in prefixes]}")


def _memory_copy(d: pathlib.Path, codec, prefixes: list) -> object:
    """The stored chunks (metas and blobs) in a memory:// store."""
    from kvcodec.fetcher import blob_key, meta_key
    from kvcodec.store import open_store

    src, mem = open_store(f"file://{d / 'store'}"), open_store("memory://")
    cache = _cache(src, codec, "cpu")
    for p in prefixes:
        for k in cache.keys(p["ids"]):
            mem.put(meta_key(k), src.get(meta_key(k)))
            for j in range(len(codec.resolutions)):
                mem.put(blob_key(k, j), src.get(blob_key(k, j)))
    return mem


def _counting(codec) -> list[int]:
    sizes: list[int] = []
    finish = codec.finish

    def counted(staged, outs):
        sizes.append(len(staged))
        finish(staged, outs)

    codec.finish = counted
    return sizes


def _fetch_all(cache, prefixes: list) -> tuple[list, float]:
    t0 = time.perf_counter()
    outs = []
    for p in prefixes:
        r = cache.fetch(p["ids"], deadline_s=None)
        if not r.ok:
            raise RuntimeError(f"fetch failed: {r.error}")
        outs.append(r.kv)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return outs, time.perf_counter() - t0


def _close(a: torch.Tensor, b: torch.Tensor) -> dict:
    a, b = a.float().cpu(), b.float().cpu()
    return {
        "equal": bool(torch.equal(a, b)),
        "within_fp16_rounding": bool(torch.allclose(a, b, rtol=2**-10, atol=2**-12)),
        "max_abs_diff": float((a - b).abs().max()),
    }


def measure(mem, d, prefixes, device, workers: int, inflight: int, batched: bool, repeat: int) -> tuple[dict, list]:
    from kvcodec.codecs.hevc.decode import decoder_name

    codec = _codec(d)  # its own restorer: plans and tables built in its warm-up
    sizes = _counting(codec) if batched else []
    cache = _cache(mem, codec, device, decode_workers=workers, max_inflight=inflight, batched_restore=batched)
    outs, warm = _fetch_all(cache, prefixes)
    sizes.clear()
    times = [_fetch_all(cache, prefixes)[1] for _ in range(repeat)]
    nbytes = sum(o.numel() * o.element_size() for o in outs)
    rec = {
        "batched": batched,
        "decode_workers": workers,
        "max_inflight": inflight,
        "decoder": decoder_name(device),  # the video decoder the codec's samples are decoded by
        "tokens": sum(len(p["ids"]) for p in prefixes),
        "restored_bytes": nbytes,
        "warmup_s": warm,
        "fetch_s": times,
        "gb_per_s_median": nbytes / sorted(times)[len(times) // 2] / 1e9,
        "gb_per_s_best": nbytes / min(times) / 1e9,
        "finish_batch_sizes": sorted(set(sizes)),
        "mean_finish_batch": (sum(sizes) / len(sizes)) if sizes else None,
    }
    print(json.dumps(rec), flush=True)
    return rec, outs


def restore_chunks_rate(mem, d, prefixes, sessions: int, repeat: int) -> dict:
    """Every chunk of every prefix at once through restore_chunks on NvcuvidThreads (no fetcher)."""
    from kvcodec.codecs.transform.batch import restore_chunks
    from kvcodec.fetcher import blob_key
    from kvcodec.video.nvcuvid_threads import NvcuvidThreads

    codec = _codec(d)
    cache = _cache(mem, codec, "cpu")
    blobs = [mem.get(blob_key(k, 0)) for p in prefixes for k in cache.keys(p["ids"])]
    infos = [codec.inspect_chunk(b) for b in blobs]
    outs = [torch.empty(i.shape, dtype=torch.float16, device="cuda") for i in infos]
    with NvcuvidThreads(sessions) as threads:
        restore_chunks(codec, blobs, outs, threads=threads)
        torch.cuda.synchronize()
        times = []
        for _ in range(repeat):
            t0 = time.perf_counter()
            restore_chunks(codec, blobs, outs, threads=threads)
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
    nbytes = sum(o.numel() * 2 for o in outs)
    return {"sessions": sessions, "restored_bytes": nbytes, "s": times, "gb_per_s_best": nbytes / min(times) / 1e9}


def run(d: pathlib.Path, out: pathlib.Path, device: str, workers: list[int], inflights: list[int], repeat: int) -> None:
    meta = json.loads((d / "prefixes.json").read_text())
    prefixes = meta["prefixes"]
    codec = _codec(d)
    assert codec.id == meta["codec_id"], (codec.id, meta["codec_id"])
    mem = _memory_copy(d, codec, prefixes)
    t0 = time.perf_counter()
    cpu = [_cache(mem, codec, "cpu").fetch(p["ids"], deadline_s=None).kv for p in prefixes]
    checks = {
        "cpu_fetch_s": time.perf_counter() - t0,
        "cpu_matches_prep": [_sha(c) == p["cpu_sha256"] for c, p in zip(cpu, prefixes)],
    }
    records = []
    for w, m in ((w, m) for w in workers for m in inflights):
        results = {}
        for batched in (False, True):
            rec, outs = measure(mem, d, prefixes, device, w, m, batched, repeat)
            rec["vs_cpu"] = [_close(o, c) for o, c in zip(outs, cpu)]
            results[batched] = outs
            records.append(rec)
        checks[f"batched_vs_unbatched_w{w}_m{m}"] = [_close(a, b) for a, b in zip(results[True], results[False])]
    try:
        checks["restore_chunks_nvcuvid"] = restore_chunks_rate(mem, d, prefixes, max(workers), repeat)
    except Exception as e:  # noqa: BLE001 - an optional comparison: say why it is missing
        checks["restore_chunks_nvcuvid"] = f"unavailable: {type(e).__name__}: {e}"
    doc = {
        "command": "python " + " ".join(shlex.quote(a) for a in sys.argv),
        "machine": {
            "device": torch.cuda.get_device_name() if device.startswith("cuda") else platform.processor() or "cpu",
            "torch": torch.__version__,
        },
        "codec_id": meta["codec_id"],
        "relative_error_vs_model_kv": [p["relative_error"] for p in prefixes],
        "records": records,
        "checks": checks,
    }
    out.write_text(json.dumps(doc, indent=1))
    print(json.dumps(checks, indent=1))


def _ints(text: str) -> list[int]:
    return [int(x) for x in text.split(",")]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("prep")
    p.add_argument("--dir", type=pathlib.Path, required=True)
    p.add_argument("--texts", default="pg/gap", help="served texts (their KV is stored), comma-separated")
    p.add_argument("--cal-tokens", type=int, default=1024)
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--options", default='{"chunk_tokens": 256, "preset": "compact"}', help="TransformCodec options")
    sub.add_parser("pack").add_argument("--dir", type=pathlib.Path, required=True)
    r = sub.add_parser("run")
    r.add_argument("--dir", type=pathlib.Path, required=True)
    r.add_argument("--out", type=pathlib.Path, required=True)
    r.add_argument("--device", default="cuda", help="cpu: a smoke test of this script (batched forced on)")
    r.add_argument("--workers", default="7")
    r.add_argument("--max-inflight", default="4,16", help="PrefixCache max_inflight values (4: its default)")
    r.add_argument("--repeat", type=int, default=5)
    a = ap.parse_args()
    if a.cmd == "pack":
        pack(a.dir)
    elif a.cmd == "prep":
        prep(a.dir, a.texts.split(","), a.cal_tokens, a.tokens, json.loads(a.options))
    else:
        run(a.dir, a.out, a.device, _ints(a.workers), _ints(a.max_inflight), a.repeat)


if __name__ == "__main__":
    main()
