#!/usr/bin/env python3
"""Probe (issue 21): `PrefixCache.fetch` of real models' KV on CUDA with the defaults, against
NVDEC's decode-only rate on the same streams, with a concurrent bf16 matmul's slowdown, the
decoder's standing memory and a host profile of where each chunk's CPU time goes.

    # on a CPU machine: KV of a real model (2048 tokens of an essay), a transform calibrated on two
    # other essays, every case coded into one file:// store, the CPU fetch's values sampled
    python benchmarks/probes/fetch_restore.py prep --model smollm2-135m --dir D \\
        --cases t5:ratio=5 --cases t8:ratio=8 --cases int8:hevc
    # on the GPU machine (D carried; its .kvt stays behind, the pack cut to the coded widths travels)
    python benchmarks/probes/fetch_restore.py run --dir D --out OUT.json
    # the first 2048 tokens' chunks of the same store, the defaults against runs opened per fetch
    python benchmarks/probes/fetch_restore.py run --dir D --out OUT.json --tokens 2048 --variants default-nokeep

A case is NAME:SPEC, SPEC comma-separated: `ratio=R` (transform codec at target ratio R), `hevc`
(int8 HEVC codec), `res=WxH` (frame size; without it the codec's own), `chunk=N` (tokens per chunk), `split=N`
(HEVC streams per chunk), `vbits=N` (HEVC bits per sample through the video stream, the rest as zstd'd planes),
`frames=N` (the transform's frames shrink until a chunk takes N, frames.MIN_FRAMES; 1: as large as `res`),
`coder=C` (how the samples are coded; without it the codec's own default: hevc for NVDEC, zstd restored from CPU
threads, the transform's zstd or int8's auto), `zframe=N` (bytes per zstd frame
of the samples; more than a chunk holds: one frame, as before the frames), `zlevel=N` (the samples' zstd
level; negative levels are zstd's fast ones, near raw bytes). run measures per case:
the fetch with PrefixCache's defaults (no decode or in-flight arguments: what `serve` and `Engine`
get) and with the settings in --variants (`default-nodrive`: decode worker threads instead of the
driven restore); NVDEC decode-only on the same chunk streams (7 threads, each streaming its chunks
through one parser); one chunk's video decoded alone on an idle session (the least a video chunk
takes: chunk-latency); the driven restore's host work per chunk without NVDEC (read, stage, finish);
a bf16 8192^3 matmul's TFLOP/s alone and beside fetches looping on another thread (one CUDA
context); the GPU memory the decoders hold after the
fetch (sessions, rings, plans); for transform cases the batched inverse-transform kernels alone
beside the matmul (SM cost per GB/s). Every GPU fetch is checked against the CPU fetch's sampled
values (prep). --profile CASE samples the stacks of every fetch thread (a sampling profiler in the
process) during a fetch loop of that case, with the defaults and with one decode thread. --trace CASE
records four default fetches of that case with torch.profiler (Python calls of every thread, CUDA
calls, kernels and copies per stream: a chunk's frames are copied out of NVDEC once decoded) into a
gzipped Chrome trace beside --out; --trace-busy traces them again with the matmul looping beside them
(per GPU operation: its count, GPU time, and wait from launch to start).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import pathlib
import shlex
import sys
import threading
import time
from collections.abc import Iterator

import torch

from kvbench.pack import PACK, read_pack, widest, write_pack

CAL_TEXTS = ("pg/aord", "pg/apple")
SERVED_TEXT = "pg/gap"
SAMPLES = 4096  # values of the CPU fetch kept as the reference (random positions, fixed seed)


# ------------------------------------------------------------------------------------ cases


def parse_case(text: str) -> dict:
    name, _, spec = text.partition(":")
    if not name:
        raise SystemExit(f"case {text!r} has no name (NAME:SPEC)")
    # res and coder None: the codec's own defaults (prep records the frame size the codec chose)
    case = {"name": name, "codec": "transform", "ratio": None, "res": None, "chunk": 256, "ns": None}
    case |= {"split": 1, "vbits": "auto", "coder": None}
    for part in filter(None, spec.split(",")):
        key, _, value = part.partition("=")
        if key == "hevc":
            case["codec"] = "hevc"
        elif key == "ratio":
            case["ratio"] = float(value)
        elif key == "res":
            case["res"] = [int(x) for x in value.split("x")]
        elif key == "chunk":
            case["chunk"] = int(value)
        elif key == "split":  # HEVC streams per chunk
            case["split"] = int(value)
        elif key == "vbits":  # HEVC bits per sample through the video stream
            case["vbits"] = value if value == "auto" else int(value)
        elif key == "coder":  # how the samples are coded: hevc (NVDEC) or zstd (CPU threads)
            case["coder"] = value
        elif key == "zframe":  # bytes per zstd frame of the samples (prep; larger than a chunk: one frame)
            case["zframe"] = int(value)
        elif key == "zlevel":  # zstd level of the samples (prep; negative: fast levels, ~raw bytes)
            case["zlevel"] = int(value)
        elif key == "frames":  # the least frames a chunk takes where frames shrink (prep: frames.MIN_FRAMES)
            case["min_frames"] = int(value)
        elif key == "ns":  # a key namespace: cases whose codec ids coincide (frame sizes) keep apart
            case["ns"] = value
        else:
            raise SystemExit(f"unknown case field {key!r} in {text!r}")
    if case["ns"] is None and any(k in case for k in ("zframe", "zlevel", "min_frames")):
        case["ns"] = name  # these settings change the bytes, not the codec id: without a namespace put skips them
    return case


def prefix_of(doc: dict, mem, tokens: int) -> dict:  # noqa: ANN001
    """The prepared run's `doc` cut to its first `tokens` (its first chunks; 0 or more than it holds:
    all), each case's bytes and ratio counted again over them in `mem`."""
    full = len(doc["ids"])
    if not tokens or tokens >= full:
        return doc
    doc = {**doc, "ids": doc["ids"][:tokens], "fp16_bytes": doc["fp16_bytes"] * tokens // full}
    for case in doc["cases"]:
        case["full_tokens"] = full
        case["coded_bytes"] = _stored_bytes(mem, doc, case)
        case["ratio_vs_fp16"] = round(doc["fp16_bytes"] / case["coded_bytes"], 3)
    return doc


def make_codec(case: dict, d: pathlib.Path, cal=None):
    """The case's codec ("hevc", "transform" or "transform-ans"): on the CPU (prep) over the .kvt, on
    the GPU machine over the pack."""
    res = {} if case["res"] is None else {"resolutions": (tuple(case["res"]),)}
    if case["codec"] == "hevc":
        from kvcodec.codecs.hevc.codec import HevcCodec
        from kvcodec.config import CodecConfig

        config = CodecConfig(quant="int8", chunk_tokens=case["chunk"], streams_per_chunk=case.get("split", 1), **res)
        coder = {} if case.get("coder") is None else {"sample_coder": case["coder"]}
        return HevcCodec(dataclasses.replace(config, video_bits=case.get("vbits", "auto"), **coder))
    from kvcodec.codecs.transform.codec import TransformCodec
    from kvcodec.codecs.transform_ans import TransformAnsCodec

    kind = TransformAnsCodec if case["codec"] == "transform-ans" else TransformCodec
    options = {"target_ratio": case["ratio"], "chunk_tokens": case["chunk"], **res}
    if case.get("coder") is not None and kind is TransformCodec:  # an ans case may carry its source's coder
        options["coder"] = case["coder"]
    if cal is not None:
        return kind(cal[0], kvt_hash=cal[1], **options)
    return kind(d.parent / f"{d.name}.kvt", **options)


def _samples_of(kv: torch.Tensor, n: int = SAMPLES) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    idx = torch.randint(0, kv.numel(), (n,), generator=g)
    return idx, kv.reshape(-1)[idx].float()


def prep(d: pathlib.Path, model_name: str, cases: list[dict], tokens: int, cal_tokens: int, text: str) -> None:
    from kvcodec.codecs.hevc import encode as hevc_encode
    from kvcodec.fetcher import DecodeProfile, PrefixCache
    from kvcodec.integrations.hf import extract_kv
    from kvcodec.models import load_model
    from kvcodec.models.texts import load_text
    from kvcodec.store import open_store
    from kvcodec.transform import RopeSpec, calibrate, frames, save_kvt

    d.mkdir(parents=True, exist_ok=True)
    model, tok = load_model(model_name)
    kvt = d.parent / f"{d.name}.kvt"
    if not kvt.exists() and any(c["codec"] == "transform" for c in cases):
        kvs = [extract_kv(model, tok, load_text(t), cal_tokens)[1] for t in CAL_TEXTS]
        save_kvt(calibrate(kvs, RopeSpec.from_hf_config(model.config), info={"model": model_name}), kvt)
    ids, kv = extract_kv(model, tok, "\n\n".join(load_text(t) for t in text.split(",")), tokens)
    kv = kv.half()
    store = open_store(f"file://{d / 'store'}")
    fp16 = kv.numel() * 2
    doc = {"model": model_name, "text": text, "ids": ids.tolist(), "fp16_bytes": fp16, "cases": []}
    if (d / "cases.json").exists():  # cases of an earlier prep are kept unless prepared again
        names = {c["name"] for c in cases}
        doc["cases"] = [c for c in json.loads((d / "cases.json").read_text())["cases"] if c["name"] not in names]
    for case in cases:
        codec = make_codec(case, d)
        profile = DecodeProfile.default(codec.resolutions)
        cache = PrefixCache(store, model_name, codec, "cpu", profile=profile, namespace=case["ns"])
        t0 = time.perf_counter()
        with (
            _frame_bytes(case.get("zframe")),
            _module_setting(hevc_encode, "SAMPLES_ZSTD_LEVEL", case.get("zlevel")),
            _module_setting(frames, "MIN_FRAMES", case.get("min_frames")),
        ):
            cache.put(ids, kv)
        enc = time.perf_counter() - t0
        r = cache.fetch(ids)
        assert r.ok, r.error
        idx, vals = _samples_of(r.kv)
        rel = float((r.kv.float() - kv.float()).norm() / kv.float().norm())
        case.update(codec_id=codec.id, res=list(codec.resolutions[0]), encode_s=round(enc, 2), relative_error=rel)
        case.update(ref_idx=idx.tolist(), ref_vals=vals.tolist())
        print(f"{case['name']}: {codec.id}, encoded in {enc:.1f}s, relative error {rel:.4f}", flush=True)
        doc["cases"].append(case)
    for case in doc["cases"]:
        case["coded_bytes"] = _stored_bytes(store, doc, case)
        case["ratio_vs_fp16"] = round(fp16 / case["coded_bytes"], 3)
    (d / "cases.json").write_text(json.dumps(doc))
    _pack(d, doc)
    size = sum(f.stat().st_size for f in d.rglob("*") if f.is_file())
    print(f"{d}: {size / 1e6:.1f} MB; ratios {[c['ratio_vs_fp16'] for c in doc['cases']]}")


@contextlib.contextmanager
def _frame_bytes(size: int | None):
    """zstd'd samples written `size` bytes a frame in the block (None: the default): the int8
    codec's (zstd_frames' default) and the transform's (its SAMPLES_FRAME_BYTES)."""
    from kvcodec.codecs import zstd_streams
    from kvcodec.codecs.transform import codec as transform_codec

    saved = zstd_streams.zstd_frames.__defaults__, transform_codec.SAMPLES_FRAME_BYTES
    if size:
        zstd_streams.zstd_frames.__defaults__ = (size,)
        transform_codec.SAMPLES_FRAME_BYTES = size
    try:
        yield
    finally:
        zstd_streams.zstd_frames.__defaults__, transform_codec.SAMPLES_FRAME_BYTES = saved


@contextlib.contextmanager
def _module_setting(module, name: str, value):  # noqa: ANN001 - a module and its constant's value
    """module.name set to `value` in the block (None: left as it is): the int8 codec's samples' zstd
    level (hevc.encode.SAMPLES_ZSTD_LEVEL), the transform's least frames a chunk (frames.MIN_FRAMES), the
    matmul's queue depth (nvcuvid_scaling.MATMUL_QUEUED)."""
    saved = getattr(module, name)
    if value is not None:
        setattr(module, name, value)
    try:
        yield
    finally:
        setattr(module, name, saved)


def _stored_bytes(store, doc: dict, case: dict) -> int:
    """Blob bytes (metas left out) of a case's chunks."""
    from kvcodec.fetcher import ChunkMeta, meta_key

    return sum(sum(ChunkMeta.from_bytes(store.get(meta_key(k))).sizes) for k in _keys(doc, case))


class _IdOnly:
    """Enough of a ChunkCodec for PrefixCache.keys: the id and chunk length of a prepared case."""

    def __init__(self, case: dict):
        self.id, self.chunk_tokens, self.resolutions = case["codec_id"], case["chunk"], (tuple(case["res"]),)

    def encode_chunks(self, *a, **k):  # pragma: no cover - never called
        raise NotImplementedError

    inspect_chunk = decode_chunk = encode_chunks


def _pack(d: pathlib.Path, doc: dict, also: list[pathlib.Path] = ()) -> None:
    """The calibration cut to the widest coordinates any transform case codes (travels light); with
    `also`, other prepared directories of the same calibration, whose cases the pack serves too."""
    from kvcodec.fetcher import blob_key
    from kvcodec.store import open_store

    headers, codec = [], None
    for src, sdoc in [(d, doc)] + [(o, json.loads((o / "cases.json").read_text())) for o in also]:
        store = open_store(f"file://{src / 'store'}")
        for case in sdoc["cases"]:
            if case["codec"] != "transform":
                continue
            codec = make_codec(case, d)
            headers += [codec.header(store.get(blob_key(k, 0))) for k in _keys(sdoc, case)]
    if codec is not None:
        write_pack(codec.cal, codec.kvt_hash, widest(codec, headers), d / PACK)


def _keys(doc: dict, case: dict) -> list[str]:
    from kvcodec.fetcher import PrefixCache

    return PrefixCache("memory://", doc["model"], _IdOnly(case), "cpu", namespace=case.get("ns")).keys(doc["ids"])


# ------------------------------------------------------------------------------------ GPU run


def _probe():
    sys.path.insert(0, str(pathlib.Path(__file__).parent))
    import nvcuvid_scaling

    return nvcuvid_scaling


QUEUED_TOO: tuple[int, ...] = ()  # --matmul-queued-too: the matmul's slowdown also at these queue depths
_alone_at: dict[int, float] = {}  # the matmul's TFLOP/s alone per queue depth of QUEUED_TOO, once a run


def _interference(probe, fn, secs: float, alone: float) -> dict:  # noqa: ANN001
    """probe.interference at the run's queue depth (probe.MATMUL_QUEUED) and, for each depth of
    QUEUED_TOO, the slowdown as matmul_slowdown_queued_N, against the matmul alone at that depth."""
    inter = probe.interference(fn, secs, alone)
    for q in QUEUED_TOO:
        with _module_setting(probe, "MATMUL_QUEUED", q):
            if q not in _alone_at:
                _alone_at[q] = probe.matmul_tflops(2.0)
            inter[f"matmul_slowdown_queued_{q}"] = probe.interference(fn, secs, _alone_at[q])["matmul_slowdown"]
    return inter


def _codes_video(case: dict, codec) -> bool:  # noqa: ANN001
    """Whether the case's chunks hold videos for NVDEC (zstd'd samples hold none): the transform
    codec's own coder (its default unless the case names one), an HEVC case's coder setting."""
    return codec.codes_video if case["codec"].startswith("transform") else case.get("coder") != "zstd"


def _queued_too(inter: dict) -> dict:
    return {k: v for k, v in inter.items() if k.startswith("matmul_slowdown_queued_")}


def _memory_store(d: pathlib.Path, doc: dict):
    from kvcodec.store import open_store

    src, mem = open_store(f"file://{d / 'store'}"), open_store("memory://")
    for k in src.list(""):
        mem.put(k, src.get(k))
    return mem


def _check(kv: torch.Tensor, case: dict) -> dict:
    idx, ref = torch.tensor(case["ref_idx"]), torch.tensor(case["ref_vals"])
    full, n = case.get("full_tokens", kv.shape[2]), kv.shape[2]
    if n != full:  # a prefix of the prepared tokens (run --tokens): the samples inside it, re-indexed
        inner = kv.shape[3] * kv.shape[4]
        t, lk, rest = (idx // inner) % full, idx // (inner * full), idx % inner
        keep = t < n
        idx, ref = ((lk * n + t) * inner + rest)[keep], ref[keep]
    got = kv.reshape(-1)[idx.to(kv.device)].float().cpu()
    diff = (got - ref).abs()
    ok = bool(torch.all(diff <= 2**-12 + 2**-10 * ref.abs()))  # fp16 rounding of float32 sums in another order
    return {"within_fp16_rounding": ok, "max_abs_diff": float(diff.max())}


def fetch_loop(cache, ids, repeat: int) -> tuple[list[float], torch.Tensor]:
    """Fetch times, each until the KV is ready on the caller's stream. The caller is a thread of its
    own stream (an engine's request thread): a device-wide sync, or the legacy default stream that
    the interference's matmul runs on, would time the matmul's queue as well."""
    times, kv = [], None
    caller = torch.cuda.Stream()
    for _ in range(repeat):
        t0 = time.perf_counter()
        with torch.cuda.stream(caller):
            r = cache.fetch(ids, deadline_s=None)
        caller.synchronize()
        times.append(time.perf_counter() - t0)
        if not r.ok:
            raise RuntimeError(f"fetch failed: {r.error}")
        kv = r.kv
    return times, kv


@contextlib.contextmanager
def _switches(codec, variant: dict):
    """A variant's switches: stream False (the staged decode chunk by chunk, a fresh parser each),
    native False (the parser's callbacks in Python), half False (the float32 inverse-transform GEMM),
    keep False (a driven fetch opens its sessions' parsers and feeder threads per fetch, as before 21n),
    hipri True (the restore's CUDA streams at the device's highest priority, not the default one),
    torch True (an HEVC codec restores with the reference torch restorer, not the fused kernel),
    fused False (the transform's inverse by the reference kernels, not restore.transform_triton's),
    pyseq True (the parser's sequence callback enters Python at every stream's first header, as before
    the native kv_sequence reused a format's surfaces), inorder True (a fetch's blobs submitted in
    chunk order, not the chunks with videos first: driven.VIDEO_FIRST off), pps N (pieces per NVDEC
    session a fetch cuts its chunks' videos into: driven.PIECES_PER_SESSION, 0 none), pyzstd True (zstd'd
    samples decompressed on the Python host pool, as before the native zstd threads: zstd_native.threads off),
    minf N (pipeline.MIN_FINISH_BYTES: a driven fetch holds a ready run under N bytes of KV until more come)."""
    from kvcodec.codecs import driven as transform_batch  # the driven restore's switches
    from kvcodec.codecs import zstd_native
    from kvcodec.fetcher import pipeline
    from kvcodec.restore import transform_kernels, transform_triton
    from kvcodec.video import nvcuvid, nvcuvid_native, streams

    fused = transform_triton.FUSED
    transform_triton.FUSED = variant.get("fused", True) and fused
    saved = nvcuvid_native.ENABLED, transform_kernels.HALF_GEMM, sys.getswitchinterval(), nvcuvid.DISPLAY_DELAY
    format_bytes = nvcuvid.FORMAT_BYTES
    if variant.get("pyseq"):  # parsers made from now on ask Python at every sequence header
        _close_idle()
        nvcuvid.FORMAT_BYTES = 0
    fed = nvcuvid_native.FEEDER, nvcuvid_native.FEED_DEPTH
    driven = transform_batch.DRIVEN, transform_batch.EAGER, transform_batch.VIDEO_FIRST
    transform_batch.VIDEO_FIRST = not variant.get("inorder") and driven[2]
    pieces = transform_batch.PIECES_PER_SESSION
    transform_batch.PIECES_PER_SESSION = variant.get("pps", pieces)
    keep, priority = nvcuvid_native.KEEP, streams.PRIORITY
    restore = getattr(codec, "restore", None)
    restore = restore if isinstance(restore, str) else None  # an HEVC codec's restorer choice
    if variant.get("torch") and restore is not None:  # the reference restorer, not the fused kernel
        codec.restore = "torch"
    if variant.get("hipri", False):  # the decoders' streams are made afresh at the highest priority
        _close_idle()
        streams.PRIORITY = streams.HIGHEST
    nvcuvid_native.KEEP = variant.get("keep", True) and keep
    transform_batch.DRIVEN = variant.get("drive", True) and variant.get("stream", True) and driven[0]
    transform_batch.EAGER = variant.get("eager", True) and driven[1]
    nvcuvid_native.FEEDER = variant.get("feed", True) and fed[0]
    nvcuvid_native.FEED_DEPTH = variant.get("fd", fed[1])
    nvcuvid_native.ENABLED = variant.get("native", True) and saved[0]
    transform_kernels.HALF_GEMM = variant.get("half", True) and saved[1]
    if variant.get("swi"):
        sys.setswitchinterval(variant["swi"])
    if variant.get("dd") is not None:
        _close_idle()
        nvcuvid.DISPLAY_DELAY = variant["dd"]
    if not variant.get("stream", True):
        codec.stage_stream = None
    pool = _host_pool(variant.get("ht"))
    native_zstd, min_finish = zstd_native.threads, pipeline.MIN_FINISH_BYTES
    pipeline.MIN_FINISH_BYTES = variant.get("minf", min_finish)
    if variant.get("pyzstd"):
        zstd_native.threads = lambda count: None
    try:
        yield {k: v for k, v in variant.items() if k not in SWITCHES}
    finally:
        zstd_native.threads, pipeline.MIN_FINISH_BYTES = native_zstd, min_finish
        nvcuvid_native.ENABLED, transform_kernels.HALF_GEMM = saved[:2]
        transform_triton.FUSED = fused
        nvcuvid_native.FEEDER, nvcuvid_native.FEED_DEPTH = fed
        transform_batch.DRIVEN, transform_batch.EAGER, transform_batch.VIDEO_FIRST = driven
        transform_batch.PIECES_PER_SESSION = pieces
        nvcuvid_native.KEEP = keep
        if priority != streams.PRIORITY:
            _close_idle()
            streams.PRIORITY = priority
        sys.setswitchinterval(saved[2])
        if variant.get("dd") is not None:
            _close_idle()
            nvcuvid.DISPLAY_DELAY = saved[3]
        if variant.get("pyseq"):
            _close_idle()
            nvcuvid.FORMAT_BYTES = format_bytes
        codec.__dict__.pop("stage_stream", None)
        _restore_pool(pool)
        if restore is not None:
            codec.restore = restore


def _host_pool(threads: int | None):  # noqa: ANN202 - the replaced pool
    """The driven fetch's host pool replaced by one of `threads` threads (None: kept); what
    _restore_pool puts back."""
    from concurrent.futures import ThreadPoolExecutor

    from kvcodec.codecs import driven

    saved = driven._host_pool
    if threads:
        driven._host_pool = ThreadPoolExecutor(threads, thread_name_prefix="kvcodec-host")
    return saved


def _restore_pool(saved) -> None:  # noqa: ANN001
    from kvcodec.codecs import driven

    if driven._host_pool is not saved and driven._host_pool is not None:
        driven._host_pool.shutdown(wait=False)
    driven._host_pool = saved


SWITCHES = (
    "stream",
    "native",
    "half",
    "swi",
    "dd",
    "feed",
    "fd",
    "drive",
    "eager",
    "keep",
    "hipri",
    "torch",
    "fused",
    "ht",
    "pyseq",
    "inorder",
    "pps",
    "pyzstd",
    "minf",
)


def _close_idle() -> None:
    """Close every idle decoder the fetches keep (a variant's decoders are made afresh)."""
    from kvcodec.codecs.hevc.decode import idle_decoders

    idle_decoders.close_idle()


def measure_fetch(mem, doc, case, codec, probe, variant: dict, repeat: int, alone: float, secs: float) -> dict:
    with _switches(codec, variant) as settings:
        rec = _measure_fetch(mem, doc, case, codec, probe, settings, repeat, alone, secs)
    rec["defaults"] = not variant
    return {"switches": {k: v for k, v in variant.items() if k in SWITCHES}, **rec}


def _measure_fetch(mem, doc, case, codec, probe, variant: dict, repeat: int, alone: float, secs: float) -> dict:
    from kvcodec.fetcher import PrefixCache

    before = probe.free_mb()
    cache = PrefixCache(mem, doc["model"], codec, "cuda", namespace=case.get("ns"), **variant)
    ids = doc["ids"]
    _, kv = fetch_loop(cache, ids, 2)  # warm-up: sessions opened, plans built
    out_mb = kv.numel() * kv.element_size() / 2**20
    del kv
    standing = before - probe.free_mb() - out_mb
    cpu0, wall0 = time.process_time(), time.perf_counter()
    times, kv = fetch_loop(cache, ids, repeat)
    cpu_s, wall_s = time.process_time() - cpu0, time.perf_counter() - wall0
    cpu_ms = 1e3 * cpu_s / repeat / -(-len(ids) // case["chunk"])
    med = sorted(times)[len(times) // 2]
    nbytes = doc["fp16_bytes"]
    rec = {
        "kind": "fetch",
        "backend": f"nvcuvid-threads:{cache.decode_workers}",
        "decode_workers": cache.decode_workers,
        "max_inflight": cache.max_inflight,
        "cuda_contexts": 1,
        "tokens": len(ids),
        "restored_gb_per_s": round(nbytes / med / 1e9, 3),
        "restored_gb_per_s_best": round(nbytes / min(times) / 1e9, 3),
        "coded_gbit_per_s": round(8 * case["coded_bytes"] / med / 1e9, 3),
        "standing_mb": round(standing, 1),
        "host_cpu_ms_per_chunk": round(cpu_ms, 3),
        "cores_used": round(cpu_s / wall_s, 2),  # process CPU seconds per wall second while fetching
        **_check(kv, case),
    }
    if secs > 0:
        inter = _interference(probe, lambda: fetch_loop(cache, ids, 1), secs, alone)
        rec["matmul_slowdown"] = inter["matmul_slowdown"]
        rec.update(_queued_too(inter))
        rec["restored_gb_per_s_under_matmul"] = round(nbytes / inter["call_s_during"] / 1e9, 3)
    return rec


def _videos(case, codec, mem, doc) -> tuple[list, list, tuple, float]:
    """The case's chunk videos, their frame counts, the frame size and the share of the KV they hold
    (a mixed coder's zstd chunks, and plain chunks, hold none)."""
    from kvcodec.fetcher import blob_key

    videos, frames, size = [], [], None
    keys = _keys(doc, case)
    for k in keys:
        blob = mem.get(blob_key(k, 0))
        if case["codec"] == "hevc":  # one stream per chunk (the probe's cases are not split)
            from kvcodec.container.format import parse_chunk, split_streams

            h, payload = parse_chunk(blob)
            if "video" not in (streams := split_streams(payload, h.streams, "chunk")):
                continue  # a plain chunk (a few tokens at the end)
            videos.append(bytes(streams["video"]))
            frames.append(h.frames)
            size = tuple(h.resolution)
            continue
        h, streams = codec._read(blob)
        if h["coder"] != "hevc":
            continue
        videos.append(bytes(streams["video"]))
        frames.append(h["frames"])
        size = tuple(h["resolution"])
    return videos, frames, size, len(videos) / len(keys)


def decode_only(case, codec, mem, doc, probe, copies: int, seconds: float) -> dict:
    """NVDEC alone on the case's chunk streams: 7 threads, each streaming its share through one parser."""
    from kvcodec.video.nvcuvid import NvcuvidDecoder
    from kvcodec.video.nvcuvid_threads import nvdec_engines

    videos, frames, size, share = _videos(case, codec, mem, doc)
    reps = max(1, copies // len(videos))
    videos, frames = videos * reps, frames * reps
    n = nvdec_engines(0)
    decs = [NvcuvidDecoder(0) for _ in range(n)]
    try:
        s = probe.timed(lambda: probe.decode_loop(videos, frames, size, decs, True), seconds)
    finally:
        for dec in decs:
            dec.close()
    return {
        "kind": "decode-only",
        "backend": "nvcuvid-streamed",
        "threads": n,
        "cuda_contexts": 1,
        "nvdec_gb_per_s": round(doc["fp16_bytes"] * share * reps / s / 1e9, 3),
        "video_share": round(share, 3),
        "coded_gbit_per_s": round(8 * sum(map(len, videos)) / s / 1e9, 3),
    }


def restore_alone(case, codec, mem, doc, probe, seconds: float) -> dict:
    """restore_chunks on NvcuvidThreads (one session per engine, streamed, math in waves): the
    restore without the fetch pipeline, for the pipeline's own cost."""
    from kvcodec.codecs.transform.batch import restore_chunks
    from kvcodec.fetcher import blob_key
    from kvcodec.video.nvcuvid_threads import NvcuvidThreads, nvdec_engines

    blobs = [mem.get(blob_key(k, 0)) for k in _keys(doc, case)]
    infos = [codec.inspect_chunk(b) for b in blobs]
    out = torch.empty((infos[0].layers, 2, len(doc["ids"]), infos[0].kv_heads, infos[0].head_dim), device="cuda")
    out = out.half()
    outs = [out[:, :, i.start_token : i.start_token + i.tokens] for i in infos]
    n = nvdec_engines(0)
    with NvcuvidThreads(n) as threads:

        def once():
            restore_chunks(codec, blobs, outs, threads=threads)
            torch.cuda.synchronize()

        s = probe.timed(once, seconds)
    return {
        "kind": "restore-alone",
        "backend": f"nvcuvid-threads-streamed:{n}",
        "cuda_contexts": 1,
        "restored_gb_per_s": round(doc["fp16_bytes"] / s / 1e9, 3),
        **_check(out, case),
    }


def chunk_latency(case, codec, mem, doc, reps: int = 20) -> dict:
    """One chunk's video decoded alone on an idle NVDEC session (NvcuvidDecoder.decode, waited for),
    chunk after chunk: the least time a fetch's video chunk takes, whatever the engines' throughput."""
    import statistics

    from kvcodec.video.nvcuvid import NvcuvidDecoder

    videos, frames, (w, h), _ = _videos(case, codec, mem, doc)
    dec = NvcuvidDecoder(0)
    try:
        times = []
        for i in range(reps + 1):  # the first opens the session
            t0 = time.perf_counter()
            for _ in dec.decode(videos[i % len(videos)], w, h):
                pass
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
    finally:
        dec.close()
    mean_bytes = statistics.mean(len(videos[i % len(videos)]) for i in range(1, reps + 1))
    median = statistics.median(times[1:])
    return {
        "kind": "chunk-latency",
        "chunks": len(videos),
        "frames": statistics.mean(frames),
        "frame": [w, h],
        "video_kb": round(mean_bytes / 1e3, 1),
        "ms_median": round(1e3 * median, 3),
        "ms_best": round(1e3 * min(times[1:]), 3),
        "coded_gbit_per_s": round(8 * mean_bytes / median / 1e9, 3),
    }


def decode_only_native(case, codec, mem, doc, probe, copies: int, seconds: float, loop: str = "into") -> dict:
    """NVDEC alone through the native callbacks (NvcuvidDecoder.decode_each_into): 7 threads, each
    streaming its share of the chunk videos into scratch buffers."""
    from concurrent.futures import ThreadPoolExecutor

    from kvcodec.video.nvcuvid import NvcuvidDecoder
    from kvcodec.video.nvcuvid_threads import nvdec_engines

    videos, frames, (w, h), share = _videos(case, codec, mem, doc)
    reps = max(1, copies // len(videos))
    videos, frames = videos * reps, frames * reps
    n = nvdec_engines(0)
    decs = [NvcuvidDecoder(0) for _ in range(n)]
    bufs = [torch.empty(max(frames) * 3 * w * h, dtype=torch.uint8, device="cuda") for _ in range(n)]
    pool = ThreadPoolExecutor(n)

    def work(i):
        torch.cuda.set_device(0)
        items = ((k, v, w, h, f, bufs[i].data_ptr()) for k, (v, f) in enumerate(zip(videos[i::n], frames[i::n])))
        for _ in getattr(decs[i], f"decode_each_{loop}")(items):
            pass

    def once():
        for f in [pool.submit(work, i) for i in range(n)]:
            f.result()

    try:
        s = probe.timed(once, seconds)
    finally:
        pool.shutdown()
        for dec in decs:
            dec.close()
    return {
        "kind": "decode-only",
        "backend": "nvcuvid-native-streamed" + ("-fed" if loop == "fed" else ""),
        "threads": n,
        "cuda_contexts": 1,
        "nvdec_gb_per_s": round(doc["fp16_bytes"] * share * reps / s / 1e9, 3),
        "video_share": round(share, 3),
        "coded_gbit_per_s": round(8 * sum(map(len, videos)) / s / 1e9, 3),
    }


def driven_host(case, codec, mem, doc, reps: int = 10) -> dict:
    """The driven restore's host work per chunk on this machine, NVDEC left out (codecs/driven.py):
    read (parse, checksums, checks), stage (from buffers of zeros: side streams uploaded, restorer
    made), finish (the math's launches); the whole blob's CRC32 alone for scale. ms per chunk."""
    from kvcodec.codecs.driven import driven_of
    from kvcodec.container.format import crc32
    from kvcodec.fetcher import blob_key

    chunks = driven_of(codec)
    blobs = [mem.get(blob_key(k, 0)) for k in _keys(doc, case)]
    infos = [codec.inspect_chunk(b) for b in blobs]
    i0 = infos[0]
    out = torch.empty((i0.layers, 2, len(doc["ids"]), i0.kv_heads, i0.head_dim), dtype=torch.float16, device="cuda")
    outs = [out[:, :, i.start_token : i.start_token + i.tokens] for i in infos]
    readings = [chunks.read(b, o) for b, o in zip(blobs, outs)]
    bufs = [[torch.zeros(p.buffer_bytes, dtype=torch.uint8, device="cuda") for p in r.pieces] for r in readings]
    spent = dict.fromkeys(("read", "stage", "finish", "crc32_blob"), 0.0)
    for rep in range(reps + 1):  # the first pass warms up
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        readings = [chunks.read(b, o) for b, o in zip(blobs, outs)]
        t1 = time.perf_counter()
        staged = [chunks.stage(r, bs, o) for r, bs, o in zip(readings, bufs, outs)]
        t2 = time.perf_counter()
        chunks.finish(staged, outs)
        t3 = time.perf_counter()
        for b in blobs:
            crc32(b)
        t4 = time.perf_counter()
        if rep:
            for k, dt in zip(spent, (t1 - t0, t2 - t1, t3 - t2, t4 - t3)):
                spent[k] += dt
    n = reps * len(blobs)
    return {
        "kind": "driven-host",
        "chunks": len(blobs),
        "ms_per_chunk": {k: round(1e3 * v / n, 4) for k, v in spent.items()},
    }


def kernels_only(
    case, codec, mem, doc, probe, alone: float, secs: float, half: bool = True, fused: bool = True
) -> dict:
    """The batched inverse transform alone (samples staged once), looping beside the matmul; fused:
    restore.transform_triton's kernels (else the reference kernels)."""
    from kvcodec.fetcher import blob_key
    from kvcodec.restore import transform_kernels, transform_triton

    keys = _keys(doc, case)
    blobs = [mem.get(blob_key(k, 0)) for k in keys]
    info = codec.inspect_chunk(blobs[0])
    L, H, D = info.layers, info.kv_heads, info.head_dim
    outs = [torch.empty((L, 2, case["chunk"], H, D), dtype=torch.float16, device="cuda") for _ in blobs]
    staged = [codec.stage(b, o) for b, o in zip(blobs, outs)]
    full = [i for i, s in enumerate(staged) if s.h["tokens"] == case["chunk"]]
    staged, outs = [staged[i] for i in full], [outs[i] for i in full]
    stream = torch.cuda.Stream()

    def loop():
        saved = transform_kernels.HALF_GEMM, transform_triton.FUSED
        transform_kernels.HALF_GEMM, transform_triton.FUSED = half, fused and saved[1]
        try:
            with torch.cuda.stream(stream):
                for _ in range(10):
                    codec.finish(staged, outs)
            stream.synchronize()
        finally:
            transform_kernels.HALF_GEMM, transform_triton.FUSED = saved

    loop()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record(stream)
    loop()
    end.record(stream)
    torch.cuda.synchronize()
    nbytes = 10 * sum(o.numel() * 2 for o in outs)
    rec = {"kind": "restore-kernels", "gemm": "fp16" if half else "fp32", "fused": fused and half}
    rec["chunks_per_pass"] = len(outs)
    rec["cuda_contexts"] = 1
    rec["kernels_gb_per_s_alone"] = round(nbytes / (start.elapsed_time(end) / 1e3) / 1e9, 3)
    if secs > 0:
        inter = _interference(probe, loop, secs, alone)
        gbs = nbytes / inter["call_s_during"] / 1e9
        rec.update(matmul_slowdown=inter["matmul_slowdown"], kernels_gb_per_s_under_matmul=round(gbs, 3))
        rec.update(_queued_too(inter))
        rec["matmul_slowdown_per_gb_per_s"] = round(inter["matmul_slowdown"] / max(gbs, 1e-9), 5)
    return rec


class Sampler:
    """A sampling profiler in this process: every `interval` s the stacks of the other threads
    (sys._current_frames), counted per thread group (its name without the trailing number) as
    self (leaf frame) and inclusive (every frame on the stack). The sampler needs the interpreter
    lock to take a sample, so its lateness measures how long threads hold it."""

    def __init__(self, interval: float = 5e-4):
        self.interval, self.stop = interval, threading.Event()
        self.self_counts: dict = {}
        self.incl_counts: dict = {}
        self.samples: dict = {}
        self.gaps: list[float] = []
        self.thread = threading.Thread(target=self._run, name="sampler", daemon=True)

    def _run(self) -> None:
        me, last = threading.get_ident(), time.perf_counter()
        while not self.stop.is_set():
            time.sleep(self.interval)
            now = time.perf_counter()
            self.gaps.append(now - last)
            last = now
            names = {t.ident: t.name.rstrip("0123456789_") for t in threading.enumerate()}
            for ident, frame in sys._current_frames().items():
                if ident == me:
                    continue
                group = names.get(ident, "?")
                self.samples[group] = self.samples.get(group, 0) + 1
                leaf = _where(frame)
                self.self_counts[(group, leaf)] = self.self_counts.get((group, leaf), 0) + 1
                seen = set()
                while frame is not None:
                    w = _where(frame)
                    if w not in seen:
                        seen.add(w)
                        self.incl_counts[(group, w)] = self.incl_counts.get((group, w), 0) + 1
                    frame = frame.f_back

    def __enter__(self):
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        self.thread.join()

    def report(self, scale: float, top: int = 30) -> dict:
        """ms per chunk (scale: wall ms per chunk / samples per thread) of the top functions."""
        mean_gap = sum(self.gaps) / max(len(self.gaps), 1)
        rows = {}
        for name, counts in (("self", self.self_counts), ("inclusive", self.incl_counts)):
            best = sorted(counts.items(), key=lambda kv: -kv[1])[:top]
            rows[name] = [[g, w, round(c * scale, 4)] for (g, w), c in best]
        return {"sampler_interval_ms": round(1e3 * mean_gap, 3), "samples_per_group": self.samples, **rows}


def _where(frame) -> str:
    code = frame.f_code
    return f"{code.co_filename.split('/')[-1]}:{code.co_name}:{frame.f_lineno}"


def standing_sessions(probe) -> dict:
    """GPU memory the fetches' decoder sessions hold (every idle NVDEC session closed and measured)."""
    from kvcodec.codecs.hevc.decode import idle_decoders

    before = probe.free_mb()
    sessions = idle_decoders.close_idle()
    return {"kind": "standing", "sessions": sessions, "standing_mb": round(probe.free_mb() - before, 1)}


def profile_fetch(mem, doc, case, codec, variant: dict, repeat: int, out: pathlib.Path) -> dict:
    """Where each thread of `repeat` fetches spends its time (Sampler): ms per chunk per function; and by
    cProfile (`calls`: function, calls, own and cumulative ms per fetch; the sampler misplaces time spent
    holding the interpreter lock, cProfile does not). From Python 3.12 cProfile sees every thread's calls
    (sys.monitoring), before it the calling thread's (the driven fetch's restore)."""
    from grouped_fetch import profiled

    from kvcodec.fetcher import PrefixCache

    cache = PrefixCache(mem, doc["model"], codec, "cuda", namespace=case.get("ns"), **variant)
    fetch_loop(cache, doc["ids"], 2)
    chunks = repeat * -(-len(doc["ids"]) // case["chunk"])
    with Sampler() as sampler:
        t0 = time.perf_counter()
        fetch_loop(cache, doc["ids"], repeat)
        wall = time.perf_counter() - t0
    per_sample = 1e3 * wall / chunks / max(len(sampler.gaps), 1)  # ms per chunk that one sample stands for
    rec = {"kind": "profile", "variant": variant, "chunks": chunks, "wall_ms_per_chunk": round(1e3 * wall / chunks, 3)}
    rec.update(sampler.report(per_sample))
    rec["calls"] = profiled(cache, doc["ids"], repeat)
    out.write_text(json.dumps(rec, indent=1) + "\n")
    return {k: v for k, v in rec.items() if k not in ("inclusive", "calls")}


def trace_fetch(mem, doc, case, codec, fetches: int, out: pathlib.Path, busy: bool = False) -> dict:
    """`fetches` fetches with the defaults under torch.profiler (CPU ops, CUDA kernels and copies on
    every stream, Python calls): the Chrome trace to `out` (gzip), and per fetch the span of the call
    with the GPU work on each stream (where a chunk's frames are copied out of NVDEC: its decode is done)
    and per GPU operation its count, time and wait after its launch; busy: with the matmul looping
    beside the fetches (its own thread and stream), as on a GPU that serves."""
    import gzip

    from torch.profiler import ProfilerActivity, profile

    from kvcodec.fetcher import PrefixCache

    cache = PrefixCache(mem, doc["model"], codec, "cuda", namespace=case.get("ns"))
    fetch_loop(cache, doc["ids"], 3)
    with (
        _matmul_beside(busy) as matmul_threads,
        profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], with_stack=True) as prof,
    ):
        for _ in range(fetches):
            with torch.profiler.record_function("kvc_fetch"):
                fetch_loop(cache, doc["ids"], 1)
    raw = out.with_suffix(".json")
    prof.export_chrome_trace(str(raw))
    events = json.loads(raw.read_text())["traceEvents"]
    out.write_bytes(gzip.compress(raw.read_bytes()))
    raw.unlink()
    rec = {"kind": "trace", "busy": busy, "fetches": fetches, "file": out.name, "summary": _trace_summary(events)}
    return rec | {"gpu_ops": _gpu_ops(events, matmul_threads)}


@contextlib.contextmanager
def _matmul_beside(on: bool) -> Iterator[set]:
    """The probe's bf16 matmul looping on a thread of its own (its own stream) for the block, which
    gets that thread's OS id (the tid of its launches in a trace; none when off)."""
    threads: set = set()
    if not on:
        yield threads
        return
    probe, stop = _probe(), threading.Event()

    def loop() -> None:
        threads.add(threading.get_native_id())
        while not stop.is_set():
            probe.matmul_tflops(0.2)

    t = threading.Thread(target=loop, daemon=True)
    t.start()
    time.sleep(0.5)
    try:
        yield threads
    finally:
        stop.set()
        t.join()


def _gpu_ops(events: list, skip_threads: set) -> list:
    """Per GPU operation name inside the kvc_fetch spans, but for those launched by `skip_threads`
    (the matmul's): count, ms on the GPU, and ms from its launch (the CPU-side runtime call it
    correlates with) to its start, median and max."""
    spans = [(e["ts"], e["ts"] + e["dur"]) for e in events if e.get("name") == "kvc_fetch" and "dur" in e]
    launches = {
        e["args"]["correlation"]: (e["ts"], e.get("tid"))
        for e in events
        if e.get("cat") in ("cuda_runtime", "cuda_driver") and "correlation" in e.get("args", {})
    }
    ops: dict = {}
    for e in events:
        if e.get("cat") not in ("kernel", "gpu_memcpy", "gpu_memset") or "dur" not in e:
            continue
        launched, tid = launches.get(e.get("args", {}).get("correlation"), (None, None))
        if tid in skip_threads or not any(a <= e["ts"] <= b for a, b in spans):
            continue
        op = ops.setdefault(e["name"][:80], [0, 0.0, []])
        op[0], op[1] = op[0] + 1, op[1] + e["dur"]
        if launched is not None:
            op[2].append(e["ts"] - launched)
    rows = []
    for name, (n, dur, waits) in sorted(ops.items(), key=lambda kv: -kv[1][1] - sum(kv[1][2])):
        row = {"op": name, "count": n, "gpu_ms": round(dur / 1e3, 3)}
        if waits:
            waits.sort()
            row |= {"wait_ms_median": round(waits[len(waits) // 2] / 1e3, 3), "wait_ms_max": round(waits[-1] / 1e3, 3)}
        rows.append(row)
    return rows[:30]


def _trace_summary(events: list) -> list:
    """Per kvc_fetch span: ms from its start of the GPU work on each stream (first start, last end, count)."""
    spans = sorted((e["ts"], e["ts"] + e["dur"]) for e in events if e.get("name") == "kvc_fetch" and "dur" in e)
    gpu = [e for e in events if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset") and "dur" in e]
    rows = []
    for t0, t1 in spans:
        streams: dict = {}
        for e in gpu:
            if t0 <= e["ts"] <= t1:
                s = streams.setdefault(str(e.get("args", {}).get("stream", e.get("tid"))), [1e18, 0.0, 0])
                s[0], s[1], s[2] = min(s[0], e["ts"] - t0), max(s[1], e["ts"] + e["dur"] - t0), s[2] + 1
        rows.append(
            {
                "fetch_ms": round((t1 - t0) / 1e3, 3),
                "streams": {k: [round(v[0] / 1e3, 3), round(v[1] / 1e3, 3), v[2]] for k, v in sorted(streams.items())},
            }
        )
    return rows


def _sequence_counts() -> tuple[int, int]:
    """(calls, ns) of the Python sequence callbacks of the kept runs of every idle decoder (kv_sequence)."""
    from kvcodec.codecs.hevc.decode import idle_decoders

    states = [getattr(getattr(d, "_kept", None), "state", None) for ds in idle_decoders._idle.values() for d in ds]
    states = [s for s in states if s is not None]
    return sum(s.sequence_calls for s in states), sum(s.sequence_ns for s in states)


def timeline(mem, doc, case, codec, variant: dict, repeat: int) -> dict:
    """One fetch's per-chunk path (decode start/end per worker thread, restore) and NVDEC's
    utilization (NVML, sampled) over a loop of fetches: where the engines wait."""
    import subprocess

    from kvcodec.fetcher import PrefixCache

    with _switches(codec, variant) as settings:
        cache = PrefixCache(mem, doc["model"], codec, "cuda", namespace=case.get("ns"), **settings)
        fetch_loop(cache, doc["ids"], 2)
        smi = subprocess.Popen(
            ["nvidia-smi", "--query-gpu=utilization.decoder", "--format=csv,noheader,nounits", "-lms", "100"],
            stdout=subprocess.PIPE,
            text=True,
        )
        try:
            t0 = time.perf_counter()
            while time.perf_counter() - t0 < 2.0:
                fetch_loop(cache, doc["ids"], 1)
        finally:
            smi.terminate()
        util = [float(x) for x in smi.communicate()[0].split() if x.strip().replace(".", "").isdigit()]
        seq0 = _sequence_counts()
        t0 = time.perf_counter()
        r = cache.fetch(doc["ids"], deadline_s=None)
        call_s = time.perf_counter() - t0
        torch.cuda.synchronize()
        sync_s = time.perf_counter() - t0
        seq = [b - a for a, b in zip(seq0, _sequence_counts())]
    tl = sorted(r.stats.timeline, key=lambda t: t.index)
    rows = [
        [t.index, t.worker, round(1e3 * t.net_end, 3), round(1e3 * t.dec_start, 3), round(1e3 * t.dec_end, 3)]
        + [round(1e3 * t.restore_start, 3), round(1e3 * t.restore_end, 3)]
        + [round(1e3 * t.queued, 3), round(1e3 * t.submitted, 3)]
        for t in tl
    ]
    workers: dict = {}
    for t in tl:
        workers.setdefault(t.worker, []).append(1e3 * (t.dec_end - t.dec_start))
    return {
        "kind": "timeline",
        "switches": {k: v for k, v in variant.items() if k in SWITCHES},
        "nvdec_util_pct": util[len(util) // 4 :],  # the loop's steady part
        "fetch_ms": round(1e3 * max(t.restore_end for t in tl), 3),
        "call_ms": round(1e3 * call_s, 3),  # the whole fetch call (the last restore_end is fetch_ms)
        "call_synced_ms": round(1e3 * sync_s, 3),
        "python_sequence_calls": seq[0],  # the parsers' sequence callbacks that entered Python in the fetch
        "python_sequence_ms": round(seq[1] / 1e6, 3),  # their time, with the wait for the interpreter lock
        "chunks_per_worker": {w: len(v) for w, v in workers.items()},
        "chunks": rows,
        "columns": [
            "index",
            "worker",
            "net_end_ms",
            "dec_start_ms",
            "dec_end_ms",
            "restore_start_ms",
            "restore_end_ms",
            "queued_ms",
            "submitted_ms",
        ],
    }


def run_log(script: str, doc: dict, alone: float, out: pathlib.Path):  # noqa: ANN201 - (result, log(record))
    """A run's result document (command, device, data, the matmul alone) and the function that adds a
    record to it, prints it and rewrites `out` (a run cut short keeps what it measured)."""
    result = {
        "command": "python " + shlex.join([script, *sys.argv[1:]]),
        "device": torch.cuda.get_device_name(),
        "model": doc["model"],
        "tokens": len(doc["ids"]),
        "fp16_bytes": doc["fp16_bytes"],
        "matmul": f"bf16 8192x8192 torch.mm on its own stream, launched 10 at a time with "
        f"{_probe().MATMUL_QUEUED} such batch(es) queued while its thread waits, same process",
        "matmul_queued": _probe().MATMUL_QUEUED,
        **({"matmul_queued_too": list(QUEUED_TOO)} if QUEUED_TOO else {}),
        "matmul_alone_tflops": round(alone, 1),
        "records": [],
    }

    def log(rec: dict) -> None:
        result["records"].append(rec)
        print(json.dumps(rec), flush=True)
        out.write_text(json.dumps(result, indent=1) + "\n")

    return result, log


def run(
    d, out, variants, repeat, seconds, interference_s, profile_case, only, pack=None, quick=False, interfere_all=False,
    tokens=0, sample=False, trace_case="", trace_busy=False,
) -> None:  # fmt: skip
    from kvcodec.transform import frames  # noqa: F401 - import before threads start

    probe = _probe()
    doc = json.loads((d / "cases.json").read_text())
    cal, pack = None, pack or d / PACK
    if pack.exists():
        cal = read_pack(pack)
    torch.zeros(1, device="cuda")
    mem = _memory_store(d, doc)
    doc = prefix_of(doc, mem, tokens)
    alone = probe.matmul_tflops(2.0)
    result, log = run_log("benchmarks/probes/fetch_restore.py", doc, alone, out)

    for case in doc["cases"]:
        if only and case["name"] not in only:
            continue
        codec = make_codec(case, d, cal if case["codec"].startswith("transform") else None)
        if codec.id.startswith(case["codec_id"]):  # prepared before the id named its frame sizes (8d2f2fe)
            codec.id = case["codec_id"]
        assert codec.id == case["codec_id"], (codec.id, case["codec_id"])
        base = {k: case[k] for k in ("name", "codec", "ratio_vs_fp16", "res", "chunk")} | {"model": doc["model"]}
        for i, variant in enumerate([{}] + variants):
            secs = interference_s if i == 0 or interfere_all else 0.0
            _stage(log, base, measure_fetch, mem, doc, case, codec, probe, variant, repeat, alone, secs)
        if _codes_video(case, codec):
            if not quick:
                _stage(log, base, decode_only, case, codec, mem, doc, probe, 56, seconds)
            _stage(log, base, decode_only_native, case, codec, mem, doc, probe, 56, seconds)
            _stage(log, base, decode_only_native, case, codec, mem, doc, probe, 56, seconds, "fed")
            _stage(log, base, chunk_latency, case, codec, mem, doc)
            _against_decode_only(result["records"], case["name"])
        _stage(log, base, driven_host, case, codec, mem, doc)
        if case["codec"] == "transform" and not quick:
            _stage(log, base, restore_alone, case, codec, mem, doc, probe, seconds)
            for half, fused in ((True, True), (True, False), (False, False)):
                _stage(log, base, kernels_only, case, codec, mem, doc, probe, alone, interference_s, half, fused)
        if case["name"] == profile_case:
            for v in [{}] + variants:
                _stage(log, base, timeline, mem, doc, case, codec, v, repeat)
            for v in ({},) if sample else () if quick else ({}, {"decode_workers": 1}):
                name = f"profile-{doc['model']}-{case['name']}-w{v.get('decode_workers', 'default')}.json"
                _stage(log, base, profile_fetch, mem, doc, case, codec, v, repeat, out.parent / name)
        if case["name"] == trace_case:
            name = f"{out.stem}-trace-{case['name']}-{len(doc['ids'])}.json.gz"
            _stage(log, base, trace_fetch, mem, doc, case, codec, 4, out.parent / name)
            if trace_busy:
                busy_name = name.replace("-trace-", "-trace-busy-")
                _stage(log, base, trace_fetch, mem, doc, case, codec, 4, out.parent / busy_name, True)
    _stage(log, {"model": doc["model"]}, standing_sessions, probe)
    result["matmul_alone_again_tflops"] = round(probe.matmul_tflops(2.0), 1)
    out.write_text(json.dumps(result, indent=1) + "\n")


def _against_decode_only(records: list, name: str) -> None:
    """Each fetch record of case `name`: its rate over NVDEC's decode-only rate on the same streams
    (the native parser loop, the faster of the two decode-only records)."""
    only = [r.get("nvdec_gb_per_s", 0) for r in records if r.get("name") == name and r.get("kind") == "decode-only"]
    if not only or not max(only):
        return
    for r in records:
        if r.get("name") == name and r.get("kind") == "fetch" and "restored_gb_per_s" in r:
            r["vs_decode_only"] = round(r["restored_gb_per_s"] / max(only), 3)


def _stage(log, base, fn, *args) -> None:
    try:
        rec = fn(*args)
    except Exception as e:  # noqa: BLE001 - reported in the results, the run goes on
        rec = {"kind": fn.__name__, "error": repr(e)[:400]}
    log({**base, **rec})


def _variant(text: str) -> dict:
    """WORKERSxINFLIGHT (or "default") with switches -nostream, -python, -fp32, -nofeed, -nodrive, -lazy,
    -nokeep, -hipri, -torch, -unfused, -pyseq, -inorder, -swiN, -ddN, -fdN, -htN (the Python host pool's threads:
    with -pyzstd; the native zstd threads are sized once per process),
    -ppsN (pieces per NVDEC session: driven.PIECES_PER_SESSION; 0 never cuts a video), -pyzstd, -minfN (MiB: the
    driven fetch's pipeline.MIN_FINISH_BYTES; 0 finishes every ready run at once) (see _switches)."""
    size, *switches = text.split("-")
    v = {} if size == "default" else dict(zip(("decode_workers", "max_inflight"), map(int, size.split("x"))))
    names = {  # switch -> (variant key, value)
        "nostream": ("stream", False),
        "python": ("native", False),
        "fp32": ("half", False),
        "nofeed": ("feed", False),
        "nodrive": ("drive", False),
        "lazy": ("eager", False),
        "nokeep": ("keep", False),
        "hipri": ("hipri", True),
        "torch": ("torch", True),
        "unfused": ("fused", False),
        "pyseq": ("pyseq", True),
        "inorder": ("inorder", True),
        "pyzstd": ("pyzstd", True),
    }
    for sw in switches:
        if sw.startswith("ht"):  # -ht4: threads of the driven fetch's host pool
            v["ht"] = int(sw[2:])
        elif sw.startswith("swi"):  # -swi500: the interpreter's switch interval in microseconds
            v["swi"] = int(sw[3:]) * 1e-6
        elif sw.startswith("dd"):  # -dd3: the parser's display delay
            v["dd"] = int(sw[2:])
        elif sw.startswith("fd"):  # -fd4: streams a native feeder holds fed and not complete
            v["fd"] = int(sw[2:])
        elif sw.startswith("pps"):  # -pps0: a fetch never cuts its chunks' videos into pieces
            v["pps"] = int(sw[3:])
        elif sw.startswith("minf"):  # -minf0: a driven fetch finishes every ready run at once
            v["minf"] = int(sw[4:]) << 20
        else:
            key, value = names[sw]
            v[key] = value
    return v


FETCH_COLS = (
    "name",
    "ratio_vs_fp16",
    "switches",
    "decode_workers",
    "restored_gb_per_s",
    "restored_gb_per_s_best",
    "coded_gbit_per_s",
)
FETCH_COLS += ("vs_decode_only", "matmul_slowdown", "standing_mb", "host_cpu_ms_per_chunk", "cores_used")
FETCH_COLS += ("within_fp16_rounding",)


def report(src: pathlib.Path, dst: pathlib.Path, title: str, notes: list[str], extra: dict) -> None:
    """A run's JSON (from the GPU machine) as a committed result: JSON + markdown tables."""
    sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))
    import re

    from kvbench.results import write_result

    doc = json.loads(src.read_text()) | extra
    doc["command"] = re.sub(r"--out \S*/", "--out $OUT/", doc["command"])  # the GPU machine's output folder
    recs = doc["records"]
    md = [f"# {title}", "", f"Command (GPU machine): `{doc['command']}`", ""]
    md += (
        [
            f"Machine: {doc.get('machine_note', doc['device'])}; matmul {doc['matmul']}, "
            f"{doc['matmul_alone_tflops']} TFLOP/s alone.",
            "",
        ]
        + notes
        + ["", "## Fetch (PrefixCache defaults + switches)", ""]
    )
    md += ["| " + " | ".join(FETCH_COLS) + " |", "|" + "---|" * len(FETCH_COLS)]
    md += ["| " + " | ".join(str(r.get(c, "")) for c in FETCH_COLS) + " |" for r in recs if r.get("kind") == "fetch"]
    md += [
        "",
        "## NVDEC decode-only (same streams)",
        "",
        "| name | backend | nvdec_gb_per_s | coded_gbit_per_s |",
        "|---|---|---|---|",
    ]
    md += [
        f"| {r['name']} | {r['backend']} | {r['nvdec_gb_per_s']} | {r['coded_gbit_per_s']} |"
        for r in recs
        if r.get("kind") == "decode-only"
    ]
    tl = [r for r in recs if r.get("kind") == "timeline"]
    if tl:
        md += ["", "## One fetch's timeline and NVDEC utilization (NVML, 100 ms samples over 2 s of fetches)", ""]
        md += [
            "| name | switches | fetch ms | NVDEC utilization % (median) | chunks per decode thread |",
            "|---|---|---|---|---|",
        ]
        for r in tl:
            u = sorted(r["nvdec_util_pct"])
            md.append(
                f"| {r['name']} | {r['switches']} | {r['fetch_ms']} | {u[len(u) // 2] if u else ''} | "
                f"{sorted(r['chunks_per_worker'].values())} |"
            )
    other = [r for r in recs if r.get("kind") not in ("fetch", "decode-only", "timeline")]
    if other:
        md += ["", "## Other records", ""] + [f"- `{json.dumps(r)}`" for r in other]
    write_result(dst, doc, md)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    k = sub.add_parser("pack", help="DIR's pack cut to serve the cases of --also DIRS too (same calibration)")
    k.add_argument("--dir", type=pathlib.Path, required=True)
    k.add_argument("--also", type=pathlib.Path, action="append", default=[])
    p = sub.add_parser("prep")
    p.add_argument("--dir", type=pathlib.Path, required=True, help="its .kvt is written beside it, as DIR.kvt")
    p.add_argument("--model", required=True)
    p.add_argument("--cases", action="append", required=True, help="NAME:SPEC (see the module's doc)")
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--cal-tokens", type=int, default=1024)
    p.add_argument("--text", default=SERVED_TEXT, help="served texts, comma-separated (joined): not the calibration's")
    r = sub.add_parser("run")
    r.add_argument("--dir", type=pathlib.Path, required=True)
    r.add_argument("--out", type=pathlib.Path, required=True)
    r.add_argument(
        "--variants",
        default="1x4,7x4,7x16",
        help="fetch settings measured besides the defaults, comma-separated: WORKERSxINFLIGHT or default, "
        "each with optional -nostream (chunk by chunk), -python (Python parser callbacks), -fp32 (float32 GEMM)",
    )
    r.add_argument("--repeat", type=int, default=7)
    r.add_argument("--seconds", type=float, default=1.5)
    r.add_argument("--interference-seconds", type=float, default=3.0)
    r.add_argument("--profile", default="", help="case name whose fetches are profiled")
    r.add_argument("--only", default="", help="case names, comma-separated (default: all)")
    r.add_argument("--pack", type=pathlib.Path, default=None, help="the cut calibration (default: DIR's)")
    r.add_argument("--quick", action="store_true", help="no restore-alone, kernel or sampler-profile stages")
    r.add_argument("--interfere-all", action="store_true", help="the matmul's slowdown for every variant")
    r.add_argument("--tokens", type=int, default=0, help="fetch this prefix of the prepared tokens (default: all)")
    r.add_argument("--sample", action="store_true", help="the sampler profile of the defaults, also with --quick")
    r.add_argument("--trace", default="", help="case name whose default fetches are traced (torch.profiler, gzip)")
    r.add_argument("--trace-busy", action="store_true", help="--trace also with the matmul looping beside the fetches")
    r.add_argument(
        "--matmul-queued",
        type=int,
        default=1,
        help="matmul batches kept queued while its thread waits: 1 (default) lets its stream idle while the thread "
        "waits for the interpreter lock, 2 or more measure the GPU's sharing alone (kvbench.busy)",
    )
    r.add_argument("--matmul-queued-too", default="", help="queue depths, comma-separated, also measured per record")
    a = ap.parse_args()
    if a.cmd == "pack":
        _pack(a.dir, json.loads((a.dir / "cases.json").read_text()), a.also)
        return
    if a.cmd == "prep":
        prep(a.dir, a.model, [parse_case(c) for c in a.cases], a.tokens, a.cal_tokens, a.text)
        return
    global QUEUED_TOO
    _probe().MATMUL_QUEUED = a.matmul_queued
    QUEUED_TOO = tuple(int(q) for q in filter(None, a.matmul_queued_too.split(",")))
    variants = [_variant(v) for v in filter(None, a.variants.split(","))]
    only = set(filter(None, a.only.split(",")))
    run(
        a.dir, a.out, variants, a.repeat, a.seconds, a.interference_seconds, a.profile, only, a.pack, a.quick,
        a.interfere_all, a.tokens, a.sample, a.trace, a.trace_busy,
    )  # fmt: skip


if __name__ == "__main__":
    main()
