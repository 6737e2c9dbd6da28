#!/usr/bin/env python3
"""Probe (issue 21, the SM alternative): the same transform-coded KV fetched through NVDEC (HEVC
chunks, codec "transform") and through the SMs (the same integers rANS-coded, codec
"transform-ans"), side by side in one run on one GPU.

    # on a CPU machine: a prepared fetch_restore.py directory's transform cases (real KV, HEVC chunks)
    # transcoded to transform-ans chunks (the HEVC samples decoded, rANS-coded: the same integers),
    # both put in one file:// store with the cut calibration
    python benchmarks/probes/ans_fetch.py prep --src .fr/smol --dir .ans/smol --cases t5,t8
    # on the GPU machine: per case PrefixCache.fetch with the defaults (+ a concurrent bf16 matmul's
    # slowdown), NVDEC decode-only for the HEVC cases, the restore kernels alone beside the matmul
    # (the SM path: rANS decode + inverse transform), and the rANS kernel alone
    python benchmarks/probes/ans_fetch.py run --dir .ans/smol --out OUT.json
    # CPU seconds to code a chunk's samples, rANS against x265
    python benchmarks/probes/ans_fetch.py encode-speed --src .fr/smol --out benchmarks/results/NAME
    python benchmarks/probes/ans_fetch.py report --src OUT.json --out benchmarks/results/NAME
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import shlex
import shutil
import sys
import time

import torch

HERE = pathlib.Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent))
import fetch_restore as fr  # noqa: E402


def prep(src: pathlib.Path, d: pathlib.Path, names: list[str]) -> None:
    from kvcodec.codecs.base import EncodedChunk
    from kvcodec.fetcher import PrefixCache, blob_key, meta_key
    from kvcodec.store import open_store

    doc = json.loads((src / "cases.json").read_text())
    d.mkdir(parents=True, exist_ok=True)
    kvt = src.parent / f"{src.name}.kvt"
    inp, out = open_store(f"file://{src / 'store'}"), open_store(f"file://{d / 'store'}")
    cases = []
    for case in [c for c in doc["cases"] if c["name"] in names]:
        tcodec = fr.make_codec(case, src)
        acodec = fr.make_codec({**case, "codec": "transform-ans", "coder": None}, src)  # the same integers, rANS-coded
        acase = {**case, "name": "a" + case["name"][1:], "codec": "transform-ans", "coder": None, "codec_id": acodec.id}
        cache = PrefixCache(out, doc["model"], acodec, "cpu", namespace=case.get("ns"))
        t0, hevc_s = time.perf_counter(), 0.0
        for kt, ka in zip(fr._keys(doc, case), fr._keys(doc, acase)):
            for k in (blob_key(kt, 0), meta_key(kt)):
                out.put(k, inp.get(k))
            blob = inp.get(blob_key(kt, 0))
            h, streams = tcodec._read(blob)
            t1 = time.perf_counter()
            samples = tcodec._restorer.decode_samples(h, streams, torch.device("cpu")).samples
            hevc_s += time.perf_counter() - t1
            ablob = acodec.transcode({**h, "key": ka}, samples.contiguous().numpy().reshape(-1),
                                     streams["escapes"], streams.get("sink"))  # fmt: skip
            L, H, D = h["shape"]
            chunk = EncodedChunk(h["index"], h["start_token"], h["tokens"], (tuple(case["res"]),), (ablob,))
            cache.store_chunk(ka, chunk, (L, H, D), h["dtype"])
        enc = time.perf_counter() - t0 - hevc_s
        r = cache.fetch(doc["ids"])
        assert r.ok, r.error
        check = fr._check(r.kv, case)  # the HEVC case's CPU fetch: the same integers restore the same values
        assert check["within_fp16_rounding"], check
        acase.update(encode_s=round(enc, 2), ans_equal_to_hevc_fetch=check["max_abs_diff"] == 0.0)
        for c in (case, acase):
            c["coded_bytes"] = fr._stored_bytes(out, doc, c)
            c["ratio_vs_fp16"] = round(doc["fp16_bytes"] / c["coded_bytes"], 3)
        acase["bytes_vs_hevc"] = round(acase["coded_bytes"] / case["coded_bytes"], 4)
        print(f"{acase['name']}: {acodec.id} {acase['ratio_vs_fp16']}x ({acase['bytes_vs_hevc']} of HEVC), "
              f"rANS-coded in {enc:.1f} s, CPU fetch max diff {check['max_abs_diff']}", flush=True)  # fmt: skip
        cases += [case, acase]
    (d / "cases.json").write_text(json.dumps({**doc, "cases": cases}))
    if (src / fr.PACK).exists():
        shutil.copy(src / fr.PACK, d / fr.PACK)
    shutil.copy(kvt, d.parent / f"{d.name}.kvt")


def ans_only(case, codec, mem, doc, probe, alone: float, secs: float) -> dict:
    """The rANS kernel alone on every chunk of the case (one launch), looping beside the matmul."""
    from kvcodec.codecs.transform_ans import gpu, rans
    from kvcodec.fetcher import blob_key

    blobs = [mem.get(blob_key(k, 0)) for k in fr._keys(doc, case)]
    heads = [codec._read(b) for b in blobs]
    params = rans.AnsParams(heads[0][0]["block"], heads[0][0]["lanes"])
    streams = [rans.parse(s["ans"], h["samples"], params) for h, s in heads]
    counts = [h["samples"] for h, _ in heads]
    stream = torch.cuda.Stream()

    def loop():
        with torch.cuda.stream(stream):
            for _ in range(10):
                out, err = gpu.decode_batch(streams, counts, params, torch.device("cuda"))
        stream.synchronize()
        assert int(err.abs().sum()) == 0

    loop()
    t0 = time.perf_counter()
    loop()
    s = time.perf_counter() - t0
    rec = {
        "kind": "ans-kernel",
        "chunks_per_pass": len(blobs),
        "blocks_per_pass": sum(x.states.shape[0] for x in streams),
    }
    rec["ans_gb_per_s_alone"] = round(10 * doc["fp16_bytes"] / s / 1e9, 3)
    rec["samples_gb_per_s_alone"] = round(10 * sum(counts) / s / 1e9, 3)
    if secs > 0:
        inter = probe.interference(loop, secs, alone)
        gbs = 10 * doc["fp16_bytes"] / inter["call_s_during"] / 1e9
        rec.update(matmul_slowdown=inter["matmul_slowdown"], ans_gb_per_s_under_matmul=round(gbs, 3))
    return rec


def run(d: pathlib.Path, out: pathlib.Path, repeat: int, seconds: float, inter_s: float, tokens: int) -> None:
    from kvbench.pack import read_pack

    probe = fr._probe()
    doc = json.loads((d / "cases.json").read_text())
    cal = read_pack(d / fr.PACK) if (d / fr.PACK).exists() else None  # None: the .kvt beside DIR
    torch.zeros(1, device="cuda")
    mem = fr._memory_store(d, doc)
    doc = fr.prefix_of(doc, mem, tokens)
    alone = probe.matmul_tflops(2.0)
    result, log = fr.run_log("benchmarks/probes/ans_fetch.py", doc, alone, out)

    for case in doc["cases"]:
        ans = case["codec"] == "transform-ans"
        codec = fr.make_codec(case, d, cal)
        if codec.id.startswith(case["codec_id"]):  # prepared before the id named its frame sizes (8d2f2fe)
            codec.id = case["codec_id"]
        assert codec.id == case["codec_id"], (codec.id, case["codec_id"])
        base = {k: case[k] for k in ("name", "codec", "ratio_vs_fp16", "res", "chunk")} | {"model": doc["model"]}
        base["bytes_vs_hevc"] = case.get("bytes_vs_hevc", 1.0)
        fr._stage(log, base, fr.measure_fetch, mem, doc, case, codec, probe, {}, repeat, alone, inter_s)
        if ans:
            fr._stage(log, base, ans_only, case, codec, mem, doc, probe, alone, inter_s)
        elif fr._codes_video(case, codec):  # NVDEC decode-only: for chunks with video streams
            fr._stage(log, base, fr.decode_only_native, case, codec, mem, doc, probe, 56, seconds)
        fr._stage(log, base, fr.kernels_only, case, codec, mem, doc, probe, alone, inter_s, True)
    result["matmul_alone_again_tflops"] = round(probe.matmul_tflops(2.0), 1)
    out.write_text(json.dumps(result, indent=1) + "\n")


def encode_speed(src: pathlib.Path, names: list[str], out: pathlib.Path, repeat: int) -> None:
    """CPU seconds to code one chunk's samples: rANS (numpy) against x265 (one thread, the transform
    codec's tuning), on the prepared HEVC chunks' own samples; median of `repeat` per chunk."""
    import platform

    from kvbench.results import write_result
    from kvcodec.codecs.transform_ans import rans
    from kvcodec.fetcher import blob_key
    from kvcodec.store import open_store
    from kvcodec.transform import frames

    doc = json.loads((src / "cases.json").read_text())
    store, recs = open_store(f"file://{src / 'store'}"), []
    for case in [c for c in doc["cases"] if c["name"] in names]:
        codec = fr.make_codec(case, src)
        encoder = codec._encoder(1)
        for i, k in enumerate(fr._keys(doc, case)[:3]):
            h, streams = codec._read(store.get(blob_key(k, 0)))
            x = codec._restorer.decode_samples(h, streams, torch.device("cpu")).samples.contiguous()
            w, hh = h["resolution"]
            pictures = [f.numpy() for f in frames.to_frames(x, w, hh)]
            times = {"x265": [], "rans": []}
            for _ in range(repeat):
                t0 = time.process_time()
                video = encoder.encode(pictures, w, hh)
                t1 = time.process_time()
                coded = rans.encode(x.numpy().reshape(-1))
                times["x265"].append(t1 - t0)
                times["rans"].append(time.process_time() - t1)
            med = {n: sorted(t)[len(t) // 2] for n, t in times.items()}
            recs.append({"name": case["name"], "chunk": i, "samples": x.numel(), "x265_cpu_s": round(med["x265"], 3),
                         "rans_cpu_s": round(med["rans"], 3), "x265_bytes": len(video), "rans_bytes": len(coded)})  # fmt: skip
            print(json.dumps(recs[-1]), flush=True)
    command = "python " + shlex.join(["benchmarks/probes/ans_fetch.py", *sys.argv[1:]])
    cols = list(recs[0])
    md = ["# Coding the transform's samples: rANS (numpy) vs x265 (one thread), CPU seconds per chunk", ""]
    md += [f"Command: `{command}`", "", f"Machine: {platform.machine()}, {os.cpu_count()} cores (shared, loaded)", ""]
    md += ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    md += ["| " + " | ".join(str(r[c]) for c in cols) + " |" for r in recs]
    write_result(out, {"command": command, "model": doc["model"], "records": recs}, md)


COLS = ("name", "codec", "ratio_vs_fp16", "bytes_vs_hevc", "tokens", "backend", "restored_gb_per_s")
COLS += ("restored_gb_per_s_best", "coded_gbit_per_s", "matmul_slowdown", "restored_gb_per_s_under_matmul")
COLS += ("host_cpu_ms_per_chunk", "standing_mb", "within_fp16_rounding")


def report(src: pathlib.Path, dst: pathlib.Path, notes: list[str]) -> None:
    import re

    from kvbench.results import write_result

    doc = json.loads(src.read_text())
    doc["command"] = re.sub(r"--out \S*/", "--out $OUT/", doc["command"])
    recs = doc["records"]
    for r in recs:  # fetch_restore's fetch record names the NVDEC threads; a transform-ans fetch has stage threads
        if r.get("codec") == "transform-ans" and str(r.get("backend", "")).startswith("nvcuvid-threads:"):
            r["backend"] = f"sm-rans-triton:{r['decode_workers']}-stage-threads"
    md = [
        f"# Fetch through NVDEC vs the SMs (transform vs transform-ans), {doc['model']}, {doc['tokens']} tokens, H200"
    ]
    md += ["", f"Command (GPU machine): `{doc['command']}`", ""]
    md += [f"Machine: {doc['device']}; matmul {doc['matmul']}, {doc['matmul_alone_tflops']} TFLOP/s alone.", ""]
    md += notes + ["", "## Fetch (PrefixCache defaults)", ""]
    md += ["| " + " | ".join(COLS) + " |", "|" + "---|" * len(COLS)]
    md += ["| " + " | ".join(str(r.get(c, "")) for c in COLS) + " |" for r in recs if r.get("kind") == "fetch"]
    md += ["", "## Other records (decode-only, restore kernels beside the matmul, rANS kernel alone)", ""]
    md += [f"- `{json.dumps(r)}`" for r in recs if r.get("kind") != "fetch"]
    write_result(dst, doc, md)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("prep")
    p.add_argument("--src", type=pathlib.Path, required=True, help="a fetch_restore.py prep directory")
    p.add_argument("--dir", type=pathlib.Path, required=True)
    p.add_argument("--cases", default="t5,t8")
    r = sub.add_parser("run")
    r.add_argument("--dir", type=pathlib.Path, required=True)
    r.add_argument("--out", type=pathlib.Path, required=True)
    r.add_argument("--repeat", type=int, default=5)
    r.add_argument("--seconds", type=float, default=1.5)
    r.add_argument("--interference-seconds", type=float, default=3.0)
    r.add_argument("--tokens", type=int, default=0, help="fetch this prefix of the prepared tokens (default: all)")
    e = sub.add_parser("encode-speed")
    e.add_argument("--src", type=pathlib.Path, required=True, help="a fetch_restore.py prep directory")
    e.add_argument("--cases", default="t5,t8")
    e.add_argument("--repeat", type=int, default=3)
    e.add_argument("--out", type=pathlib.Path, required=True)
    w = sub.add_parser("report")
    w.add_argument("--src", type=pathlib.Path, required=True)
    w.add_argument("--out", type=pathlib.Path, required=True)
    w.add_argument("--note", action="append", default=[])
    a = ap.parse_args()
    if a.cmd == "prep":
        prep(a.src, a.dir, a.cases.split(","))
    elif a.cmd == "encode-speed":
        encode_speed(a.src, a.cases.split(","), a.out, a.repeat)
    elif a.cmd == "run":
        run(a.dir, a.out, a.repeat, a.seconds, a.interference_seconds, a.tokens)
    else:
        report(a.src, a.out, a.note)


if __name__ == "__main__":
    main()
