"""Where a chunk's encode time goes on the CPU (issue 24, target 1): fixed per-chunk overhead
against work that scales with the data, and an A/B of two source trees on the same KV.

    split: one encode thread (KVCODEC_ENCODE_WORKERS=1, x265 pools=1, torch on one thread), one
           chunk of a KV file cut to L layers / H heads / T tokens; processor time of the process
           (x265's own threads included: less sensitive to a shared machine's load than wall time),
           the x265 part (HevcCodec's sample coding) and the rest; a least-squares line of time
           against the fp16 MB of the chunk gives the fixed part (its intercept).
    ab:    the HEVC int8 and the transform codec (a .kvt) on the KV's first 256 and 1000 tokens, in
           child processes importing kvcodec from --a and from --b in turn (interleaved repeats):
           bytes, a digest of the chunks, processor time (best of the repeats in a process, then the
           median over processes); B's over A's per codec.

    python benchmarks/probes/encode_split.py split KV.safetensors --out results/encode-cpu-x.json
    python benchmarks/probes/encode_split.py ab KV.safetensors --kvt M.kvt --a OLD/src --b src --rounds 3 --out ...
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

SPLIT_CASES = ((30, 3, 16), (30, 3, 64), (30, 3, 128), (30, 3, 256), (1, 3, 256), (4, 3, 256), (8, 3, 256))
SPLIT_CASES += ((15, 3, 256), (6, 2, 256), (24, 2, 256))  # the last two: Qwen2.5-0.5B's heads, 6 and 24 layers
AB_TOKENS = (256, 1000)


def _single_thread() -> None:
    os.environ["KVCODEC_ENCODE_WORKERS"] = "1"
    import torch

    torch.set_num_threads(1)


def _load(path: str):  # noqa: ANN202 - a tensor
    from safetensors.torch import load_file

    return load_file(path)["kv"]


def split(args) -> dict:  # noqa: ANN001
    _single_thread()
    import kvcodec
    from kvcodec.codecs.hevc import encode as hevc
    from kvcodec.video.x265_cpu import X265Encoder

    kv = _load(args.kv)
    x265_s = [0.0]
    code_samples = hevc._code_samples

    def timed(*a, **k):  # noqa: ANN002, ANN003, ANN202
        c0 = time.process_time()
        try:
            return code_samples(*a, **k)
        finally:
            x265_s[0] += time.process_time() - c0

    hevc._code_samples = timed
    encoder = X265Encoder("ultrafast", threads=1, tuning=hevc.X265_TUNING)
    runs = {}
    for L, H, T in SPLIT_CASES:
        codec = kvcodec.make_codec("hevc", quant="int8", encoder=encoder)
        x = kv[:L, :, 256 : 256 + T, :H].contiguous()
        codec.encode_chunks(kv[:L, :, :256, :H].contiguous())  # the coding plan (on a whole chunk), untimed
        runs[(L, H, T)] = (codec, x, hevc._plan(x, codec.config, encoder).layouts[0])
    best: dict = {}
    for _ in range(args.repeat):  # interleaved: every case once per round
        for case, (codec, x, _) in runs.items():
            x265_s[0] = 0.0
            c0 = time.process_time()
            codec.encode_chunks(x)
            r = (time.process_time() - c0, x265_s[0])
            best[case] = min(best.get(case, r), r)
    rows = []
    for (L, H, T), (_, x, layout) in runs.items():
        cpu, x265 = best[(L, H, T)]
        rows.append(
            {
                "layers": L,
                "kv_heads": H,
                "tokens": T,
                "fp16_mb": round(x.numel() * 2 / 1e6, 3),
                "frames": -(-T // layout.tokens_per_frame),
                "tokens_per_frame": layout.tokens_per_frame,
                "frame_fill": round(layout.fill, 3),
                "cpu_ms": round(cpu * 1e3, 1),
                "x265_ms": round(x265 * 1e3, 1),
                "rest_ms": round((cpu - x265) * 1e3, 1),
            }
        )
    full = [r for r in rows if r["tokens"] == 256]  # whole chunks
    fit = {k: _line([r["fp16_mb"] for r in full], [r[k] for r in full]) for k in ("cpu_ms", "x265_ms", "rest_ms")}
    return {"rows": rows, "fit_ms_per_fp16_mb": fit}


def _line(xs: list[float], ys: list[float]) -> dict:
    """Least-squares ys ~ fixed + per_mb * xs."""
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    return {"fixed_ms": round(my - slope * mx, 1), "ms_per_fp16_mb": round(slope, 1)}


def measure(args) -> dict:  # noqa: ANN001
    """One child of `ab`: every codec and length, in the kvcodec the path gives."""
    _single_thread()
    import kvcodec

    kv = _load(args.kv)
    out = {}
    for tokens in AB_TOKENS:
        x = kv[:, :, :tokens].contiguous()
        makers = {"hevc int8": lambda: kvcodec.make_codec("hevc", quant="int8")}
        if args.kvt:
            makers["transform"] = lambda: kvcodec.make_codec("transform", transform=args.kvt)
        for name, make in makers.items():
            codec = make()
            codec.encode_chunks(x)  # plans, bases on the device: once per process
            best = None
            for _ in range(args.repeat):
                c0 = time.process_time()
                chunks = codec.encode_chunks(x)
                best = min(best or 1e9, time.process_time() - c0)
            blobs = [b for c in chunks for b in c.blobs]
            out[f"{name} {tokens}"] = {
                "tokens": tokens,
                "fp16_mb": x.numel() * 2 / 1e6,
                "bytes": sum(map(len, blobs)),
                "digest": hashlib.sha256(b"".join(blobs)).hexdigest()[:16],
                "cpu_s": best,
            }
    return out


def ab(args) -> dict:  # noqa: ANN001
    runs: dict[str, list[dict]] = {"a": [], "b": []}
    for _ in range(args.rounds):
        for side in ("a", "b"):
            env = {
                **os.environ,
                "PYTHONPATH": os.pathsep.join(filter(None, [getattr(args, side), os.environ.get("PYTHONPATH")])),
            }
            cmd = [sys.executable, __file__, "measure", args.kv, "--repeat", str(args.repeat)]
            cmd += ["--kvt", args.kvt] if args.kvt else []
            done = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True)
            runs[side].append(json.loads(done.stdout.strip().splitlines()[-1]))
    rows = []
    for key in runs["a"][0]:
        a, b = ([r[key] for r in runs[s]] for s in ("a", "b"))
        cpu_a, cpu_b = statistics.median(r["cpu_s"] for r in a), statistics.median(r["cpu_s"] for r in b)
        ratios = [rb["cpu_s"] / ra["cpu_s"] for ra, rb in zip(a, b)]
        rows.append(
            {
                "case": key,
                "fp16_mb": round(a[0]["fp16_mb"], 3),
                "a_cpu_s": round(cpu_a, 3),
                "b_cpu_s": round(cpu_b, 3),
                "speedup": round(cpu_a / cpu_b, 3),
                "round_speedups": [round(1 / r, 3) for r in ratios],
                "a_bytes": a[0]["bytes"],
                "b_bytes": b[0]["bytes"],
                "bytes_b_vs_a": round(b[0]["bytes"] / a[0]["bytes"] - 1, 5),
                "same_bytes": a[0]["digest"] == b[0]["digest"],
                "b_mb_per_s_one_core": round(a[0]["fp16_mb"] / cpu_b, 2),
                "b_ratio_vs_fp16": round(a[0]["fp16_mb"] * 1e6 / b[0]["bytes"], 4),
            }
        )
    return {"rows": rows}


def _markdown(doc: dict) -> list[str]:
    lines = [f"# Encode time split: {doc['kv']}", "", f"`{doc['command']}`", ""]
    m = doc["machine"]
    lines += [
        f"Machine: {m.get('cpu')}, {m.get('cpu_count', '?')} cores, load {m.get('load_avg_1m', '?')}. {doc['note']}",
        "",
    ]
    if "split" in doc:
        lines += [
            "| layers | heads | tokens | fp16 MB | frames (tpf, fill) | CPU ms | x265 ms | rest ms |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for r in doc["split"]["rows"]:
            lines.append(
                f"| {r['layers']} | {r['kv_heads']} | {r['tokens']} | {r['fp16_mb']:.2f} | {r['frames']} "
                f"({r['tokens_per_frame']}, {r['frame_fill']:.2f}) | {r['cpu_ms']:.1f} | {r['x265_ms']:.1f} | "
                f"{r['rest_ms']:.1f} |"
            )
        fit = doc["split"]["fit_ms_per_fp16_mb"]
        lines += [
            "",
            "Least-squares line over the whole-frame rows, ms = fixed + per MB x fp16 MB: "
            + "; ".join(f"{k}: {v['fixed_ms']} + {v['ms_per_fp16_mb']}/MB" for k, v in fit.items()),
            "",
        ]
    if "ab" in doc:
        lines += [
            "| case | fp16 MB | A CPU s | B CPU s | speedup (per round) | bytes B vs A | same bytes | B MB/s, 1 core |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for r in doc["ab"]["rows"]:
            lines.append(
                f"| {r['case']} | {r['fp16_mb']:.2f} | {r['a_cpu_s']:.3f} | {r['b_cpu_s']:.3f} | {r['speedup']:.2f}x "
                f"({', '.join(f'{s:.2f}' for s in r['round_speedups'])}) | {r['bytes_b_vs_a']:+.3%} | "
                f"{'yes' if r['same_bytes'] else 'no'} | {r['b_mb_per_s_one_core']:.1f} |"
            )
    return lines


def _without_note(argv: list[str]) -> list[str]:
    """The command line less --note and its text (the markdown shows the note on its own)."""
    return [a for i, a in enumerate(argv) if a != "--note" and (i == 0 or argv[i - 1] != "--note")]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("what", choices=("split", "ab", "measure"))
    ap.add_argument("kv", help="a KV safetensors file (tensor `kv`, e.g. from kvcodec extract)")
    ap.add_argument("--kvt", help="a .kvt for the transform codec (ab)")
    ap.add_argument("--a", help="ab: the source tree (its src folder) of side A")
    ap.add_argument("--b", help="ab: the source tree of side B (default: the installed kvcodec)")
    ap.add_argument("--rounds", type=int, default=3, help="ab: interleaved processes per side")
    ap.add_argument("--repeat", type=int, default=3, help="timed encodes per case (fastest kept)")
    ap.add_argument("--note", default="", help="what the markdown should say about the run (the trees, the load)")
    ap.add_argument("--out", help="result JSON (markdown beside it)")
    args = ap.parse_args()
    if args.what == "measure":
        print(json.dumps(measure(args)))
        return
    from kvbench.results import machine, write_result

    doc = {
        "command": "python benchmarks/probes/encode_split.py " + " ".join(_without_note(sys.argv[1:])),
        "kv": os.path.basename(args.kv),
    }
    doc["note"] = args.note
    doc["machine"] = machine()
    doc[args.what] = split(args) if args.what == "split" else ab(args)
    if args.what == "ab":  # the fields of an encode record (issue 24): side B's longest HEVC int8 case, one core
        top = [r for r in doc["ab"]["rows"] if r["case"].startswith("hevc")][-1]
        doc.update(codec=top["case"].rsplit(" ", 1)[0], ratio_vs_fp16=top["b_ratio_vs_fp16"])
        doc.update(encoded_mb_per_s=top["b_mb_per_s_one_core"], cores=1, gpu=None)
    if args.out:
        prev = json.loads(Path(args.out).read_text()) if Path(args.out).exists() else {}
        doc = {**prev, **doc, "command": "; ".join(filter(None, [prev.get("command"), doc["command"]]))}
        if prev.get("note") and args.note != prev["note"]:
            doc["note"] = " ".join(filter(None, [prev["note"], args.note]))
        write_result(args.out, doc, _markdown(doc))
    print("\n".join(_markdown(doc)))


if __name__ == "__main__":
    main()
