"""x265 parameters against speed and size on real KV frames (issue 24, target 1), one thread.

params: the frames of three 256-token chunks (tokens 256, 2048, 4096) of a KV file as the HEVC
        int8 codec packs them and as the transform codec (a .kvt) packs them, each encoded by
        single-threaded x265 (pools=1) with today's tuning (x265_cpu.FAST_TUNING) plus each
        variant in turn (";"-separated; "-": none), interleaved over --repeat rounds: the
        fastest processor time per chunk and the bytes against the first variant.
open:   the fixed cost of one x265 encode (open, one tiny frame, flush, close), the part an
        encoder kept per worker could save.
record: the JSON rows of several `params` runs (e.g. run at once on idle cores) as one result.

python benchmarks/probes/x265_params.py params KV.safetensors --kvt M.kvt --variants "-;no-wpp=1" --out part.json
python benchmarks/probes/x265_params.py record part1.json part2.json --out results/encode-cpu-x.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

CHUNK_STARTS = (256, 2048, 4096)


def _frames(kv_path: str, kvt: str) -> tuple[list, list, tuple[int, int]]:
    from safetensors.torch import load_file

    import kvcodec
    from kvcodec.codecs.hevc import encode as hevc
    from kvcodec.layout.tiling import frame_blocks, pack_frame
    from kvcodec.transform import frames as tframes

    kv = load_file(kv_path)["kv"]
    codec = kvcodec.make_codec("hevc", quant="int8")
    plan = hevc._plan(kv, codec.config, codec.encoder)
    layout = plan.layouts[0]
    tc = kvcodec.make_codec("transform", transform=kvt)
    hevc_sets, transform_sets = [], []
    for s in CHUNK_STARTS:
        x = kv[:, :, s : s + 256].contiguous()
        samples, _, _ = hevc._split_low_bits(hevc._symbols(x, codec.config), plan.video_bits)
        hevc_sets.append([pack_frame(b, layout).numpy() for _, _, b in frame_blocks(samples, layout)])
        y = tc.coefficients(x, s)
        tsamples, _, _ = tc._samples_and_side(y, x, tc._level(y, x, s), s, 0)
        transform_sets.append([f.numpy() for f in tframes.to_frames(tsamples, 512, 512)])
    return hevc_sets, transform_sets, (layout.width, layout.height)


def params(args) -> list[dict]:  # noqa: ANN001
    from kvcodec.video.x265_cpu import FAST_TUNING, X265Encoder

    hevc_sets, transform_sets, (w, h) = _frames(args.kv, args.kvt)
    variants = args.variants.split(";")
    times = {v: {"hevc": [], "transform": []} for v in variants}
    sizes: dict = {}
    for _ in range(args.repeat):
        for v in variants:
            enc = X265Encoder("ultrafast", threads=1, tuning=FAST_TUNING + (":" + v if v not in ("", "-") else ""))
            for kind, sets, size in (("hevc", hevc_sets, (w, h)), ("transform", transform_sets, (512, 512))):
                c0 = time.process_time()
                try:
                    sizes[(v, kind)] = sum(len(enc.encode(f, *size)) for f in sets)
                except Exception:  # noqa: BLE001 - a parameter x265 refuses
                    sizes[(v, kind)] = None
                times[v][kind].append((time.process_time() - c0) / len(sets))
    base = variants[0]
    rows = []
    for v in variants:
        row = {"variant": v}
        for kind in ("hevc", "transform"):
            ok = sizes[(v, kind)] is not None
            row[f"{kind}_ms"] = round(min(times[v][kind]) * 1e3, 1) if ok else None
            row[f"{kind}_bytes_vs_first"] = round(sizes[(v, kind)] / sizes[(base, kind)] - 1, 6) if ok else None
        rows.append(row)
    return rows


def open_cost(repeat: int) -> dict:
    import numpy as np

    from kvcodec.video.x265_cpu import FAST_TUNING, X265Encoder

    enc = X265Encoder("ultrafast", threads=1, tuning=FAST_TUNING)
    out = {}
    for side in (16, 64, 512):
        frame = [np.zeros((3, side, side), np.uint8)]
        best = min(_cpu(lambda f=frame, s=side: enc.encode(f, s, s)) for _ in range(repeat))
        out[f"one zero frame {side}x{side} ms"] = round(best * 1e3, 2)
    return out


def _cpu(fn) -> float:  # noqa: ANN001
    c0 = time.process_time()
    fn()
    return time.process_time() - c0


def _markdown(doc: dict) -> list[str]:
    lines = [f"# x265 parameters on real KV frames: {doc.get('kv', '')}", "", f"`{doc['command']}`", ""]
    lines += [doc.get("note", ""), ""]
    for i, part in enumerate(doc.get("parts", [])):
        lines += [
            f"Run {i + 1} (bytes and times against its first row):",
            "",
            "| x265 parameters added | HEVC int8 ms/chunk | bytes | transform ms/chunk | bytes |",
            "|---|---|---|---|---|",
        ]
        for r in part:
            cells = []
            for kind in ("hevc", "transform"):
                ms, b = r[f"{kind}_ms"], r[f"{kind}_bytes_vs_first"]
                cells += ["refused", ""] if ms is None else [f"{ms:.1f}", f"{b:+.3%}"]
            lines.append(
                f"| {r['variant'] if r['variant'] not in ('', '-') else '(today: ' + doc['tuning'] + ')'} | "
                + " | ".join(cells)
                + " |"
            )
        lines.append("")
    if "open" in doc:
        lines += ["Fixed cost of one encode (open, one frame, flush, close), one thread, processor time:", ""]
        lines += [f"- {k}: {v}" for k, v in doc["open"].items()]
    return lines


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("what", choices=("params", "open", "record"))
    ap.add_argument("inputs", nargs="*", help="params: a KV safetensors file; record: params JSON parts")
    ap.add_argument("--kvt", help="params: the transform codec's .kvt")
    ap.add_argument("--variants", default="-", help='params: ";"-separated x265 parameter sets ("-": none)')
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--open", dest="open_json", help="record: an `open` JSON to include")
    ap.add_argument("--note", default="", help="record: what the markdown says about the runs")
    ap.add_argument("--out", help="JSON out (record: markdown beside it)")
    args = ap.parse_args()
    os.environ["KVCODEC_ENCODE_WORKERS"] = "1"
    import torch

    torch.set_num_threads(1)
    if args.what == "params":
        args.kv = args.inputs[0]
        result = params(args)
    elif args.what == "open":
        result = open_cost(args.repeat)
    else:
        from kvbench.results import machine, write_result
        from kvcodec.video.x265_cpu import FAST_TUNING

        doc = {
            "command": "python benchmarks/probes/x265_params.py " + " ".join(a for a in sys.argv[1:] if a != args.note)
        }
        doc.update(note=args.note, tuning=FAST_TUNING, machine=machine())
        doc["parts"] = [json.loads(Path(p).read_text()) for p in args.inputs]
        if args.open_json:
            doc["open"] = json.loads(Path(args.open_json).read_text())
        write_result(args.out, doc, _markdown(doc))
        print("\n".join(_markdown(doc)))
        return
    text = json.dumps(result, indent=1)
    if args.out:
        Path(args.out).write_text(text)
    print(text)


if __name__ == "__main__":
    main()
