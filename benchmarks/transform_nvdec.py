#!/usr/bin/env python3
"""Restore of transform-coded KV through NVDEC: decode -> dequantize -> inverse transform (one
GEMM per layer group and K/V) -> RoPE -> a dense fp16 KV tensor on the GPU.

    # on a CPU machine: encode (x265) a KV file at several target ratios into transform-coded files
    python benchmarks/transform_nvdec.py prep --kvt M.kvt --kv KV.safetensors --ratios 6,8,10 --dir D
    # on the GPU machine: time the restore
    python benchmarks/transform_nvdec.py run --kvt M.kvt --dir D --processes 1,4,7 --out STEM

`run` times one decoder in this process (chunk after chunk into one tensor), and N processes
each with its own NVDEC decoder restoring every chunk into its own tensor (aggregate rate of
fp16-equivalent KV restored). It checks the NVDEC restore against the same integers coded with
zstd and restored on the GPU without video (equal up to GEMM rounding), and times the dense
stages (dequantize, GEMMs, RoPE) alone.
"""

from __future__ import annotations

import json
import multiprocessing as mp
import platform
import shlex
import sys
import time
from pathlib import Path

import click
import torch


def _chunks(data: bytes):
    from kvcodec.codecs.transform_file import read_header

    h, payload = read_header(data)
    blobs, pos = [], 0
    for _, length, _ in h["chunks"]:
        blobs.append(bytes(payload[pos : pos + length]))
        pos += length
    return h, blobs


def _restore_all(codec, blobs, shape, device, repeat=1):
    out = torch.empty(shape, dtype=torch.float16, device=device)
    t = codec.chunk_tokens
    for _ in range(repeat):
        for i, b in enumerate(blobs):
            codec.decode_chunk(b, out[:, :, i * t : (i + 1) * t])
    if device.type == "cuda":
        torch.cuda.synchronize()
    return out


def _worker(kvt, blobs, shape, repeat, barrier, q):
    from kvcodec.codecs.transform import TransformCodec

    codec = TransformCodec(kvt)
    dev = torch.device("cuda")
    _restore_all(codec, blobs[:1], (shape[0], 2, codec.chunk_tokens, shape[3], shape[4]), dev)  # session, bases
    barrier.wait()
    t0 = time.perf_counter()
    _restore_all(codec, blobs, shape, dev, repeat)
    q.put((t0, time.perf_counter()))


def pool_rate(kvt, blobs, shape, processes, repeat) -> float:
    ctx = mp.get_context("spawn")
    barrier, q = ctx.Barrier(processes), ctx.Queue()
    procs = [ctx.Process(target=_worker, args=(kvt, blobs, shape, repeat, barrier, q)) for _ in range(processes)]
    for p in procs:
        p.start()
    spans = [q.get(timeout=300) for _ in procs]
    for p in procs:
        p.join()
    elapsed = max(e for _, e in spans) - min(s for s, _ in spans)
    return 2 * torch.Size(shape).numel() * repeat * processes / elapsed / 1e9


def dense_stage_ms(codec, blob, device, repeat=20) -> float:
    """ms per chunk of dequantize + GEMMs + RoPE, the decoded samples already on the GPU."""
    h, streams = codec._read(blob)
    count = codec.plan(h["theta"], h["key_weight"]).steps.numel() * h["tokens"]
    samples = codec._restorer._samples(h, streams, count, device)
    codec._restorer._samples = lambda *a, **k: samples
    try:
        codec._restorer._restore(h, streams, device)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for _ in range(repeat):
            codec._restorer._restore(h, streams, device)
        torch.cuda.synchronize()
        return 1e3 * (time.perf_counter() - t0) / repeat
    finally:
        del codec._restorer._samples


@click.group()
def cli():
    pass


@cli.command()
@click.option("--kvt", required=True)
@click.option("--kv", "kv_path", required=True)
@click.option("--ratios", default="6,8,10")
@click.option("--resolution", default="1024x1024")
@click.option("--dir", "out_dir", required=True)
def prep(kvt, kv_path, ratios, resolution, out_dir):
    from safetensors.torch import load_file

    from kvcodec.codecs.transform import TransformCodec
    from kvcodec.codecs.transform_file import encode_file

    kv = load_file(kv_path)["kv"]
    kv = kv[:, :, : kv.shape[2] // 256 * 256].contiguous()
    w, h = (int(x) for x in resolution.split("x"))
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    for r in ratios.split(","):
        codec = TransformCodec(kvt, target_ratio=float(r), resolutions=((w, h),))
        data = encode_file(kv, codec)
        (Path(out_dir) / f"hevc-r{r}.kvc").write_bytes(data)
        theta = codec.header(_chunks(data)[1][0])["theta"]
        z = encode_file(kv, TransformCodec(kvt, theta=theta, coder="zstd"))
        (Path(out_dir) / f"zstd-r{r}.kvc").write_bytes(z)
        print(f"r{r}: hevc {kv.numel() * 2 / len(data):.2f}x, zstd on the same integers {kv.numel() * 2 / len(z):.2f}x")


@cli.command()
@click.option("--kvt", required=True)
@click.option("--dir", "in_dir", required=True)
@click.option("--processes", default="1,4,7")
@click.option("--repeat", default=3)
@click.option("--out", "out_stem", required=True)
def run(kvt, in_dir, processes, repeat, out_stem):
    from kvcodec.codecs.transform import TransformCodec

    records = []
    dev = torch.device("cuda")
    for path in sorted(Path(in_dir).glob("hevc-r*.kvc")):
        h, blobs = _chunks(path.read_bytes())
        zpath = path.parent / path.name.replace("hevc", "zstd")
        shape = tuple(h["shape"])
        codec = TransformCodec(kvt)
        gpu = _restore_all(codec, blobs, shape, dev)  # also warms the decoder session
        if zpath.exists():  # the same integers without video: equal up to GEMM rounding
            via_zstd = _restore_all(codec, _chunks(zpath.read_bytes())[1], shape, dev)
            diff = float((gpu.float() - via_zstd.float()).abs().max())
        else:
            diff = None
        t0 = time.perf_counter()
        _restore_all(codec, blobs, shape, dev, repeat)
        one = 2 * torch.Size(shape).numel() * repeat / (time.perf_counter() - t0) / 1e9
        size = sum(map(len, blobs))
        rec = dict(
            file=path.name,
            ratio_vs_fp16=round(2 * torch.Size(shape).numel() / size, 3),
            bits_per_value=round(8 * size / torch.Size(shape).numel(), 3),
            shape=list(shape),
            nvdec_vs_zstd_path_max_abs=diff,
            one_decoder_gbps=round(one, 3),
            dense_stages_ms_per_chunk=round(dense_stage_ms(codec, blobs[0], dev), 3),
            coded_gbit_per_s_one_decoder=round(
                8 * size * repeat / (2 * torch.Size(shape).numel() * repeat / one / 1e9) / 1e9, 3
            ),
        )
        for p in (int(x) for x in processes.split(",")):
            rec[f"processes_{p}_gbps"] = round(pool_rate(kvt, blobs, shape, p, repeat), 3)
        print(json.dumps(rec), flush=True)
        records.append(rec)
    doc = dict(
        command="python " + shlex.join(sys.argv),
        machine=f"{torch.cuda.get_device_name()} ({platform.machine()})",
        torch=torch.__version__,
        records=records,
    )
    Path(out_stem + ".json").write_text(json.dumps(doc, indent=1) + "\n")


if __name__ == "__main__":
    cli()
