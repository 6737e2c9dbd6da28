"""The transform codec's samples coded by zstd at several levels against x265 (the HEVC coder), on
one KV file and .kvt: bytes, encode and decode speed of one thread, per target ratio. Chose the
samples' zstd level (kvcodec.codecs.transform.codec.ZSTD_LEVEL) for the mixed coder.

    python benchmarks/probes/transform_zstd_level.py KV.safetensors --kvt M.kvt --ratios 5,8 \
        --levels 1,3,9,16,19 --out benchmarks/results/transform-zstd-level-cpu-NAME.json

Every chunk but the first (its fp16 sink tokens) is coded alone, at the level the codec finds for
the ratio on this KV; times are one thread's (torch and x265 held to one), summed over the chunks.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
import zstandard

from kvbench.results import machine, utc_now, write_result
from kvcodec.codecs.transform.codec import TransformCodec
from kvcodec.kvspec.files import load_kv_file
from kvcodec.transform import frames


def measure(kv: torch.Tensor, kvt: Path, ratio: float, levels: list[int], resolution: tuple[int, int]) -> dict:
    codec = TransformCodec(kvt, target_ratio=ratio, coder="hevc", resolutions=(resolution,))
    theta = codec._level(None, kv, 0)
    y = codec.coefficients(kv, 0, codec.plan(theta).counts)
    encoder, ct = codec._encoder(1), codec.chunk_tokens
    rows = {"hevc": [0, 0.0, None], **{lvl: [0, 0.0, 0.0] for lvl in levels}}  # bytes, encode s, decode s
    raw = 0
    for s in range(ct, kv.shape[2] - ct + 1, ct):
        samples, _, _ = codec._samples_and_side(y[s : s + ct], kv[:, :, s : s + ct], theta, s, 0)
        data = samples.numpy().tobytes()
        raw += len(data)
        planes = [f.numpy() for f in frames.to_frames(samples, *resolution)]
        t0 = time.perf_counter()
        rows["hevc"][0] += len(encoder.encode(planes, *resolution))
        rows["hevc"][1] += time.perf_counter() - t0
        for lvl in levels:
            t0 = time.perf_counter()
            z = zstandard.ZstdCompressor(level=lvl).compress(data)
            t1 = time.perf_counter()
            zstandard.ZstdDecompressor().decompress(z)
            rows[lvl][0] += len(z)
            rows[lvl][1] += t1 - t0
            rows[lvl][2] += time.perf_counter() - t1
    base = rows["hevc"][0]
    return {
        "ratio": ratio,
        "theta": theta,
        "sample_bytes": raw,
        "coders": [
            {
                "coder": "hevc (x265)" if k == "hevc" else f"zstd-{k}",
                "bytes": b,
                "bytes_vs_hevc": round(b / base, 4),
                "encode_mb_per_s": round(raw / enc / 1e6, 1),
                "decode_mb_per_s": None if dec is None else round(raw / dec / 1e6, 1),
            }
            for k, (b, enc, dec) in rows.items()
        ],
    }


def markdown(doc: dict) -> list[str]:
    out = [
        f"# The transform's samples: zstd levels against x265 ({doc['kv']}, {doc['kvt']})",
        "",
        f"`{doc['command']}`",
        "",
    ]
    out += [
        f"Machine: {doc['machine']['cpu']}, one thread. MB/s of samples (uint8), summed over every chunk but the first.",
        "",
    ]
    for r in doc["results"]:
        out += [f"## target ratio {r['ratio']:g} ({r['sample_bytes'] / 1e6:.2f} MB of samples)", ""]
        out += ["| coder | bytes | vs HEVC | encode MB/s | decode MB/s |", "|---|---|---|---|---|"]
        for c in r["coders"]:
            dec = "NVDEC" if c["decode_mb_per_s"] is None else f"{c['decode_mb_per_s']:.0f}"
            out.append(
                f"| {c['coder']} | {c['bytes']:,} | {c['bytes_vs_hevc']:.3f} | {c['encode_mb_per_s']:.1f} | {dec} |"
            )
        out.append("")
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("kv", type=Path)
    ap.add_argument("--kvt", type=Path, required=True)
    ap.add_argument("--ratios", default="5,8")
    ap.add_argument("--levels", default="1,3,9,16,19")
    ap.add_argument("--resolution", default="512x512")
    ap.add_argument("--out", type=Path, required=True)
    a = ap.parse_args()
    torch.set_num_threads(1)
    kv, _ = load_kv_file(a.kv)
    levels = [int(x) for x in a.levels.split(",")]
    resolution = tuple(int(x) for x in a.resolution.split("x"))
    results = [measure(kv, a.kvt, float(r), levels, resolution) for r in a.ratios.split(",")]
    doc = {
        "kind": "transform-zstd-level",
        "command": "python benchmarks/probes/transform_zstd_level.py " + " ".join(sys.argv[1:]),
        "kv": a.kv.name,
        "kvt": a.kvt.name,
        "shape": list(kv.shape),
        "machine": machine(),
        "utc": utc_now(),
        "results": results,
    }
    print(f"wrote {write_result(a.out, doc, markdown(doc))}")


if __name__ == "__main__":
    main()
