#!/usr/bin/env python3
"""Restore of transform-coded KV through NVDEC, inverse transform included, in one process and
one CUDA context (NvcuvidThreads): NVDEC decode -> batched restore (restore.transform_kernels:
gather, one GEMM over every (group, K|V) block, RoPE, cast) -> dense fp16 KV on the GPU.

    # on a CPU machine: transform-coded files (x265) and CPU references
    python benchmarks/transform_nvdec.py prep --kvt M.kvt --kv KV.safetensors --ratios 5,8 \\
        --resolutions 1024x1024,512x512 --dir D
    # on the GPU machine
    python benchmarks/transform_nvdec.py run --dir D --threads 7x7,7x14 --out STEM

prep writes the files, the calibration with each basis cut to the coordinates any file codes
(`transform.pack.safetensors`, so the data travels light; the codec still checks the .kvt hash),
the sha256 of every chunk's samples as the CPU's FFmpeg decodes them, and the CPU restore of the
first chunk of the first file. run checks NVDEC's samples against those hashes and the GPU restore
against the CPU's, then measures per file: NVDEC decode alone (7 threads), the full restore with
N sessions x M threads (restored GB/s of fp16-equivalent KV, coded Gbit/s, the GPU memory the
backend holds), a bf16 matmul's slowdown beside each, and the restore kernels alone (GPU time per
chunk by CUDA events, host time per chunk, and their own cost to the matmul).
"""

from __future__ import annotations

import functools
import hashlib
import json
import pathlib
import platform
import re
import shlex
import sys
import time

import click
import torch

from kvbench.pack import PACK, pack_widths, read_pack, write_pack

REF_TOKENS = 128  # leading tokens of the first chunk's CPU restore kept as the reference


# ------------------------------------------------------------------------------------ shared


def _chunks(data: bytes) -> tuple[dict, list[bytes]]:
    from kvcodec.codecs.transform.file import read_header

    h, payload = read_header(data)
    blobs, pos = [], 0
    for _, length, _ in h["chunks"]:
        blobs.append(bytes(payload[pos : pos + length]))
        pos += length
    return h, blobs


def _sample_count(codec, h: dict) -> int:
    return codec.plan(float(h["theta"]), float(h["key_weight"])).steps.numel() * h["tokens"]


def _samples(codec, blob: bytes, decoder, device) -> torch.Tensor:
    from kvcodec.transform import frames

    h, streams = codec._read(blob)
    w, hh = h["resolution"]
    count = _sample_count(codec, h)
    return frames.from_frames(decoder.decode(bytes(streams["video"]), w, hh), count, w, hh, device)


def _sha(t: torch.Tensor) -> str:
    return hashlib.sha256(t.cpu().contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()


def load_pack(path: pathlib.Path):
    """A TransformCodec over the cut calibration prep wrote (bases as wide as any file codes)."""
    from kvcodec.codecs.transform.codec import TransformCodec

    cal, kvt_hash = read_pack(path)
    return TransformCodec(cal, kvt_hash=kvt_hash)


# -------------------------------------------------------------------------------------- prep


def _existing(out: pathlib.Path) -> tuple[dict, list | None, object]:
    """Hashes and basis widths of an earlier prep into the same folder (a later prep adds files)."""
    from kvcodec.video.registry import get_decoder

    hashes = json.loads((out / "hashes.json").read_text()) if (out / "hashes.json").exists() else {}
    widths = pack_widths(out / PACK) if (out / PACK).exists() else None
    return hashes, widths, get_decoder("cpu")


@click.group()
def cli():
    pass


@cli.command()
@click.option("--kvt", required=True)
@click.option("--kv", "kv_path", required=True)
@click.option("--ratios", default="5,8")
@click.option("--resolutions", default="1024x1024,512x512")
@click.option("--tokens", default=2048, help="leading tokens of the KV file coded")
@click.option("--chunk-tokens", default=256, help="tokens per chunk (files of other sizes are named -cN)")
@click.option("--dir", "out_dir", required=True)
def prep(kvt, kv_path, ratios, resolutions, tokens, chunk_tokens, out_dir):
    from safetensors.torch import load_file, save_file

    from kvcodec.codecs.transform.codec import TransformCodec
    from kvcodec.codecs.transform.file import encode_file

    kv = load_file(kv_path)["kv"]
    kv = kv[:, :, : min(tokens, kv.shape[2]) // chunk_tokens * chunk_tokens].contiguous()
    out = pathlib.Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    hashes, widths, cpu = _existing(out)
    for res in resolutions.split(","):
        w, h = (int(x) for x in res.split("x"))
        for r in ratios.split(","):
            codec = TransformCodec(
                kvt, target_ratio=float(r), resolutions=((w, h),), chunk_tokens=chunk_tokens, coder="hevc"
            )  # every chunk a video: this bench measures NVDEC
            data = encode_file(kv, codec)
            name = f"hevc-r{r}-{res}" + (f"-c{chunk_tokens}" if chunk_tokens != 256 else "")
            (out / f"{name}.kvc").write_bytes(data)
            _, blobs = _chunks(data)
            hashes[name] = [_sha(_samples(codec, b, cpu, "cpu")) for b in blobs]
            counts = codec.plan(codec.header(blobs[0])["theta"], codec.key_weight).counts
            widths = [max(a, b) for a, b in zip(widths or counts, counts)]
            if not (out / "reference.safetensors").exists():  # the CPU restore of the first chunk
                ref = torch.empty((kv.shape[0], 2, chunk_tokens, kv.shape[3], kv.shape[4]), dtype=kv.dtype)
                codec.decode_chunk(blobs[0], ref)
                ref = ref[:, :, :REF_TOKENS].contiguous()  # sink, escapes and RoPE in a fraction of the bytes
                save_file({"kv": ref}, str(out / "reference.safetensors"), metadata={"file": name})
            print(f"{name}: {kv.numel() * 2 / len(data):.2f}x, coded coordinates {sum(counts)}", flush=True)
    write_pack(codec.cal, codec.kvt_hash, widths, out / PACK)
    (out / "hashes.json").write_text(json.dumps(hashes, indent=1) + "\n")


# --------------------------------------------------------------------------------------- run


class Case:
    """A file's chunk blobs replicated to `copies` jobs, each restoring into its own tensor."""

    def __init__(self, path: pathlib.Path, codec, copies: int):
        h, self.blobs = _chunks(path.read_bytes())
        self.name, self.shape = path.stem, tuple(h["shape"])
        self.headers = [codec.header(b) for b in self.blobs]
        L, _, _, H, D = self.shape
        reps = [i % len(self.blobs) for i in range(copies)]
        self.job_blobs = [self.blobs[i] for i in reps]
        self.outs = [
            torch.empty((L, 2, self.headers[i]["tokens"], H, D), dtype=torch.float16, device="cuda") for i in reps
        ]
        self.fp16_bytes = sum(o.numel() * 2 for o in self.outs)
        self.blob_bytes = sum(len(b) for b in self.job_blobs)
        self.videos = [bytes(codec._read(b)[1]["video"]) for b in self.job_blobs]
        self.video_bytes = sum(map(len, self.videos))
        self.frames = sum(self.headers[i]["frames"] for i in reps)
        self.ratio = 2 * torch.Size(self.shape).numel() / sum(map(len, self.blobs))
        self.bits_per_value = 8 * sum(map(len, self.blobs)) / torch.Size(self.shape).numel()

    def rates(self, seconds: float) -> dict:
        return {
            "restored_gb_per_s": round(self.fp16_bytes / seconds / 1e9, 3),
            "coded_gbit_per_s": round(self.video_bytes * 8 / seconds / 1e9, 3),
            "blob_gbit_per_s": round(self.blob_bytes * 8 / seconds / 1e9, 3),
            "frames_per_s": round(self.frames / seconds, 1),
        }


def check_exact(codec, case: Case, hashes: dict, reference: dict) -> dict:
    """NVDEC samples vs the CPU's FFmpeg (sha256 per chunk); GPU restore vs the CPU restore."""
    from kvcodec.video.nvcuvid import NvcuvidDecoder

    dec = NvcuvidDecoder(0)
    got = [_sha(_samples(codec, b, dec, "cuda")) for b in case.blobs]
    dec.close()
    rec = {"samples_exact_vs_cpu": got == hashes.get(case.name), "chunks_checked": len(got)}
    if reference.get("file") == case.name:
        L, _, _, H, D = case.shape
        out = torch.empty((L, 2, case.headers[0]["tokens"], H, D), dtype=torch.float16, device="cuda")
        codec.decode_chunk(case.blobs[0], out)
        out = out[:, :, : reference["kv"].shape[2]]
        diff = (out.cpu().float() - reference["kv"].float()).abs()
        rec["restore_vs_cpu_max_abs"] = float(diff.max())
        rec["restore_vs_cpu_within_fp16_ulp"] = bool(
            torch.allclose(out.cpu().float(), reference["kv"].float(), rtol=2**-10, atol=2**-12)
        )
    return rec


def stream_probe(codec, case: Case, hashes: dict) -> dict:
    """The file's chunks through one parser back to back (NvcuvidDecoder.decode_each): the packet
    timestamps NVDEC hands back per picture, and each chunk's samples against the CPU's hashes."""
    from kvcodec.transform import frames
    from kvcodec.video import nvcuvid

    seen, original = [], nvcuvid.attribute

    def record(expected, timestamp):
        seen.append(int(timestamp))
        return original(expected, timestamp)

    nvcuvid.attribute = record
    dec = nvcuvid.NvcuvidDecoder(0)
    rec: dict = {}
    try:
        items = []
        for k, blob in enumerate(case.blobs):
            h, streams = codec._read(blob)
            items.append((k, bytes(streams["video"]), *h["resolution"], h["frames"]))
        got: dict = {}
        for key, frame in dec.decode_each(iter(items)):
            got.setdefault(key, []).append(frame.clone())
        shas = []
        for k, (_, _, w, hh, _) in enumerate(items):
            count = _sample_count(codec, case.headers[k])
            shas.append(_sha(frames.from_frames(iter(got.get(k, [])), count, w, hh, "cuda")))
        rec["samples_exact_vs_cpu"] = shas == hashes.get(case.name)
    except Exception as e:  # noqa: BLE001 - the probe reports what NVDEC did
        rec["error"] = repr(e)[:300]
    finally:
        nvcuvid.attribute = original
        dec.close()
    rec["timestamps"] = seen
    return rec


def kernel_times(codec, case: Case, repeat: int = 100, batch: int = 16) -> dict:
    """The restore math alone, samples already on the GPU: ms per chunk on the GPU (CUDA events)
    and on the host (launch-bound), for one chunk at a time and `batch` chunks in one pass, by the
    fused kernel (restore.transform_triton) and by the reference kernels (restore + emit), one
    chunk replayed from a CUDA graph (GPU time without launch gaps), and the per-group reference
    path; whether the fused kernel's output is the reference kernels' within an fp16 rounding."""
    from kvcodec.codecs.transform import decode as transform_decode
    from kvcodec.restore import transform_kernels as tk
    from kvcodec.restore import transform_triton as tt
    from kvcodec.transform import quantize
    from kvcodec.video.nvcuvid import NvcuvidDecoder

    r, blob = codec._restorer, case.blobs[1 % len(case.blobs)]
    h, streams = codec._read(blob)
    (L, H, D), t, dev = h["shape"], h["tokens"], torch.device("cuda")
    C = codec.plan(float(h["theta"]), float(h["key_weight"])).steps.numel()
    dec = NvcuvidDecoder(0)
    samples = _samples(codec, blob, dec, "cuda").view(C, t)
    dec.close()
    esc = quantize.unpack_escapes(transform_decode.unzstd(streams["escapes"], "escapes", 4 + 8 * int(h["escapes"])))
    bp, rope = r._batched_plan(h, dev), r.rope_tables(dev)
    outs = [torch.empty((L, 2, t, H, D), dtype=torch.float16, device=dev) for _ in range(batch)]
    many = samples[None].expand(batch, C, t).contiguous()
    none = (torch.zeros(0, dtype=torch.int64), torch.zeros(0, dtype=torch.int32))
    fused_on = tt.FUSED

    def run(n, escapes=(esc,), fused=True):
        def fn():
            tt.FUSED = fused and fused_on
            try:
                starts = [h["start_token"] + i * t for i in range(n)]
                tk.restore_into(bp, many[:n], list(escapes) * n, (L, H, D), rope, starts, outs[:n])
            finally:
                tt.FUSED = fused_on

        return fn

    def reference():
        r._samples = lambda *a, **k: samples.reshape(-1)
        try:
            outs[0].copy_(r._restore(h, streams, dev))
        finally:
            del r._samples

    rec = {"escapes_in_chunk": int(h["escapes"]), "coded_coordinates": C, "batch": batch}
    run(1)()
    fused = outs[0].clone()
    run(1, fused=False)()
    diff = (fused.float() - outs[0].float()).abs()
    rec["fused_max_abs_diff"] = float(diff.max())
    rec["fused_within_an_fp16_rounding"] = bool(
        torch.allclose(fused.float(), outs[0].float(), rtol=2**-10, atol=2**-12)
    )
    cases = (
        ("batched", run(1, fused=False), 1),
        (f"batched_x{batch}", run(batch, fused=False), batch),
        ("fused", run(1), 1),
        (f"fused_x{batch}", run(batch), batch),
        ("reference", reference, 1),
    )
    for name, fn, n in cases:
        gpu, host = _event_ms(fn, max(repeat // n, 5))
        rec[f"{name}_gpu_ms_per_chunk"], rec[f"{name}_host_ms_per_chunk"] = round(gpu / n, 4), round(host / n, 4)
    for name, fused_graph in (("batched", False), ("fused", True)):
        try:
            rec[f"{name}_graph_gpu_ms_per_chunk"] = _graph_ms(run(1, (none,), fused_graph), repeat)
        except Exception as e:  # noqa: BLE001 - capture is a probe here, not the product's path
            rec[f"{name}_graph_error"] = repr(e)
    rec["_batched_fn"], rec["_fused_fn"] = run(1, fused=False), run(1)
    return rec


def gemm_precision(codec, case: Case, batch: int = 16, repeat: int = 50) -> dict:
    """The batched restore's GEMM (J blocks of basis @ samples over `batch` chunks): the float16
    GEMM it runs (the decode basis, transform_kernels.half_basis, over centred integers) against
    the float32 GEMM over the same basis and over the calibrated basis before its rounding: GPU ms
    per chunk and how far each output, rounded to fp16, moves from the float32 GEMM's on the decode
    basis (max abs and RMS; within the tests' one-fp16-rounding tolerance, rtol 2^-10 atol 2^-12)."""
    from kvcodec.transform.calibration import KINDS
    from kvcodec.transform.quantize import OFFSET
    from kvcodec.video.nvcuvid import NvcuvidDecoder

    r, blob = codec._restorer, case.blobs[1 % len(case.blobs)]
    h, _ = codec._read(blob)
    t, dev = h["tokens"], torch.device("cuda")
    plan = codec.plan(float(h["theta"]), float(h["key_weight"]))
    C = plan.steps.numel()
    dec = NvcuvidDecoder(0)
    samples = _samples(codec, blob, dec, "cuda").view(C, t)
    dec.close()
    bp = r._batched_plan(h, dev)
    J, n = bp.bases.shape[0], bp.n
    g = samples[None].expand(batch, C, t).index_select(1, bp.gather).permute(1, 0, 2).float().contiguous()
    g = g.view(J, n, batch * t)
    q16 = (g - OFFSET).half()
    calibrated = torch.zeros_like(bp.bases)
    off = 0
    for j in range(J):
        b, c = codec.cal.basis(j // 2, KINDS[j % 2]), int(plan.counts[j])
        calibrated[j, : b.mean.numel(), :c] = (
            (b.basis[:, :c].double() * plan.steps[off : off + c].double()).float().to(dev)
        )
        off += c
    cal_means = (bp.centred_means.double() - OFFSET * calibrated.double().sum(2, keepdim=True)).float()

    def half():
        return torch.bmm(bp.half, q16, out_dtype=torch.float32).mul_(bp.scales).add_(bp.centred_means)

    variants = {
        "fp32": lambda: torch.baddbmm(bp.means, bp.bases, g),
        "fp16": half,
        "fp32_calibrated_basis": lambda: torch.baddbmm(cal_means, calibrated, g),
    }
    rec, ref = {"batch": batch, "gemm_gflop_per_chunk": round(2 * J * bp.bases.shape[1] * n * t / 1e9, 3)}, None
    saved = torch.backends.cuda.matmul.allow_tf32
    torch.backends.cuda.matmul.allow_tf32 = False
    try:
        for name, fn in variants.items():
            try:
                x = fn()
                gpu, _ = _event_ms(fn, repeat)
                rec[f"{name}_gpu_ms_per_chunk"] = round(gpu / batch, 5)
                ref = x if ref is None else ref
                a, b = x.half().float(), ref.half().float()
                rec[f"{name}_max_abs_vs_fp32"] = float((a - b).abs().max())
                rec[f"{name}_rms_vs_fp32"] = float((a - b).pow(2).mean().sqrt())
                rec[f"{name}_within_test_tolerance"] = bool(torch.allclose(a, b, rtol=2**-10, atol=2**-12))
            except Exception as e:  # noqa: BLE001 - a variant this torch lacks is reported, not fatal
                rec[f"{name}_error"] = repr(e)[:200]
    finally:
        torch.backends.cuda.matmul.allow_tf32 = saved
    rec["output_rms"] = float(ref.pow(2).mean().sqrt())
    energy = bp.bases.double().pow(2).sum(2)  # per output row: what a uniform error of +-step/2 per term adds
    rec["quantization_rms_estimate"] = float((energy[energy > 0] / 12).mean().sqrt())
    return rec


def host_profile(codec, case: Case, rounds: int = 3) -> dict:
    """Where one thread's time goes per chunk in the first half of restore_chunks (the part that
    runs on the NVDEC worker threads): host ms per chunk for each step, one chunk after another."""
    from kvcodec.codecs.transform import decode as transform_decode
    from kvcodec.container.format import crc32
    from kvcodec.transform import frames, quantize
    from kvcodec.video.nvcuvid import NvcuvidDecoder

    dec, dev = NvcuvidDecoder(0), torch.device("cuda")
    steps = dict.fromkeys(("read_and_crc", "escapes", "nvdec_frames", "to_samples", "crc_only"), 0.0)
    n = 0
    for _ in range(rounds):
        for blob in case.blobs:
            t0 = time.perf_counter()
            h, streams = codec._read(blob)
            t1 = time.perf_counter()
            quantize.unpack_escapes(transform_decode.unzstd(streams["escapes"], "escapes", 4 + 8 * int(h["escapes"])))
            t2 = time.perf_counter()
            w, hh = h["resolution"]
            got = [f.clone() for f in dec.decode(streams["video"], w, hh)]
            torch.cuda.synchronize()
            t3 = time.perf_counter()
            frames.from_frames(iter(got), _sample_count(codec, h), w, hh, dev)
            torch.cuda.synchronize()
            t4 = time.perf_counter()
            crc32(blob)
            t5 = time.perf_counter()
            for k, v in zip(steps, (t1 - t0, t2 - t1, t3 - t2, t4 - t3, t5 - t4)):
                steps[k] += v
            n += 1
    dec.close()
    rec = {f"{k}_ms_per_chunk": round(1e3 * v / n, 4) for k, v in steps.items()}
    rec["blob_mb"] = round(sum(map(len, case.blobs)) / len(case.blobs) / 1e6, 3)
    try:
        import isal.isal_zlib  # noqa: F401

        rec["crc32_backend"] = "isal"
    except ImportError:
        rec["crc32_backend"] = "zlib"
    return rec


def _event_ms(fn, repeat: int) -> tuple[float, float]:
    """(GPU ms, host ms) per call of fn, `repeat` calls queued back to back."""
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    t0 = time.perf_counter()
    start.record()
    for _ in range(repeat):
        fn()
    end.record()
    host = time.perf_counter() - t0
    torch.cuda.synchronize()
    return start.elapsed_time(end) / repeat, 1e3 * host / repeat


def _graph_ms(fn, repeat: int) -> float:
    """GPU ms per call of fn's kernels replayed from a CUDA graph (no launch gaps)."""
    graph, stream = torch.cuda.CUDAGraph(), torch.cuda.Stream()
    with torch.cuda.stream(stream):
        fn()
        stream.synchronize()
        with torch.cuda.graph(graph, stream=stream):
            fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeat):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return round(start.elapsed_time(end) / repeat, 4)


def measure_threads(probe, codec, case: Case, spec: dict, secs: tuple, alone: float) -> dict:
    """NvcuvidThreads restoring every job (spec: see _spec). mode "chunk": per chunk on the worker
    threads (threads_decode_into); "v2": session 5's restore_chunks (a fresh parser per chunk, the
    math in one pass once all are decoded); "stream": restore_chunks now (each session streams its
    chunks through one parser, the math in waves as they come). cpu_ms_per_chunk: the process's
    CPU time per chunk restored (all threads; CUDA waits may spin)."""
    from kvcodec.codecs.transform import batch as transform_batch
    from kvcodec.restore import transform_triton
    from kvcodec.video.nvcuvid_threads import NvcuvidThreads

    mode, wave = spec["mode"], spec["wave"]
    into = transform_batch.threads_decode_into(codec)
    before = probe.free_mb()
    dec = NvcuvidThreads(spec["sessions"], threads=spec["threads"], device=0, display_delay=spec["display_delay"])
    h0 = case.headers[0]
    dec.warm_up(lambda d: codec.decode_chunk(case.blobs[0], case.outs[0][:, :, : h0["tokens"]], decoder=d))
    time.sleep(0.2)
    name = f"nvcuvid-threads-{mode}:{spec['sessions']}x{spec['threads']}"
    name += (f"-wave{wave}" if mode == "stream" else "") + f"-delay{spec['display_delay']}"
    name += f"-switch{spec['switch_us']}us" if spec["switch_us"] else ""
    name += "-nomath" if spec["no_math"] else ""
    name += f"-drivers{spec['drivers']}" if spec["drivers"] else ""
    name += "" if spec["fused"] else "-unfused"
    rec = {"backend": name, **spec, "cuda_contexts": 1, "standing_mb": round(before - probe.free_mb(), 1)}
    fallbacks = _count_fallbacks(transform_batch)
    side = torch.cuda.Stream()  # the consumer's stream: waiting for the restore never blocks the matmul's
    calls = [0]

    def run():
        with torch.cuda.stream(side):
            if mode == "stream":
                transform_batch.restore_chunks(
                    codec, case.job_blobs, case.outs, threads=dec, wave=wave, drivers=spec["drivers"]
                )
            elif mode == "v2":
                restore_chunks_v2(codec, case.job_blobs, case.outs, dec)
            else:
                dec.restore_blobs(case.job_blobs, case.outs, decode_into=into)
            side.synchronize()
        calls[0] += 1

    switch, finish, fused = sys.getswitchinterval(), codec._restorer.finish, transform_triton.FUSED
    transform_triton.FUSED = fused and spec["fused"]
    if spec["no_math"]:
        codec._restorer.finish = lambda chunks, outs: None
    if spec["switch_us"]:
        sys.setswitchinterval(spec["switch_us"] / 1e6)
    try:
        cpu0 = time.process_time()
        rec.update(case.rates(probe.timed(run, secs[0])))
        rec["cpu_ms_per_chunk"] = round(1e3 * (time.process_time() - cpu0) / (calls[0] * len(case.job_blobs)), 3)
        if secs[1] > 0:
            rec.update(probe.interference(run, secs[1], alone))
            rec["restored_gb_per_s_under_matmul"] = round(case.fp16_bytes / rec["call_s_during"] / 1e9, 3)
    finally:
        sys.setswitchinterval(switch)
        codec._restorer.finish = finish
        transform_triton.FUSED = fused
        dec.close()
        rec["chunks_decoded_alone_after_a_stream_failed"] = fallbacks.pop()
    return rec


def _count_fallbacks(transform_batch) -> list:
    """Counts the chunks restore_chunks re-decodes on their own after a streamed decode failed
    (0 when every stream decodes as fed); .pop() restores the method and returns the count."""
    run, original, count = transform_batch._Run, transform_batch._Run._one, [0]

    def one(self, *a):
        count[0] += 1
        return original(self, *a)

    run._one = one

    class Counter(list):
        def pop(self):
            run._one = original
            return count[0]

    return Counter()


def restore_chunks_v2(codec, blobs, outs, threads) -> None:
    """Session 5's restore_chunks, kept as the baseline: every chunk decoded by a worker with a
    fresh parser per stream (restore_blobs), then one pass of the math over all of them."""
    r = codec._restorer
    decoded: list = [None] * len(blobs)

    def first_half(blob, i, decoder, restore="auto"):
        from kvcodec.codecs.transform.decode import check_target

        h, streams = codec._read(blob)
        check_target(h, outs[i])
        decoded[i] = r.decode_samples(h, streams, outs[i].device, decoder)

    threads.restore_blobs(blobs, list(range(len(blobs))), decode_into=first_half)
    r.finish(decoded, list(outs))


def kernel_interference(probe, fn, case: Case, seconds: float, alone: float, kernels: str = "batched") -> dict:
    """The restore kernels alone (`kernels`: the reference "batched" ones or the "fused" one),
    looping on their own stream beside the matmul."""
    stream = torch.cuda.Stream()

    def loop():
        with torch.cuda.stream(stream):
            for _ in range(50):
                fn()
        stream.synchronize()

    rec = probe.interference(loop, seconds, alone)
    chunk_bytes = case.outs[0].numel() * 2 * 50
    return {
        "backend": f"{kernels}-kernels",
        "cuda_contexts": 1,
        "matmul_slowdown": rec["matmul_slowdown"],
        "matmul_tflops": rec["matmul_tflops"],
        "kernels_gb_per_s_under_matmul": round(chunk_bytes / rec["call_s_during"] / 1e9, 3),
    }


@cli.command()
@click.option("--dir", "in_dir", required=True)
@click.option(
    "--threads",
    "thread_specs",
    default="b7x7,s7x7,s7x7d3",
    help="[c|b|s]SESSIONSxTHREADS[wWAVE][dDELAY][iMICROSECONDS], comma-separated: c per chunk, b session 5's "
    "batched restore, s restore_chunks streaming each session's chunks (math in waves of WAVE chunks, default "
    "16, 0: at the end); DELAY: the parsers' display delay; i: the interpreter's switch interval",
)
@click.option("--copies", default=56, help="chunk jobs per timed call (chunks replicated)")
@click.option("--seconds", default=2.0)
@click.option("--interference-seconds", default=4.0)
@click.option("--only", default="", help="comma-separated file stems (default: every hevc-*.kvc)")
@click.option("--skip", default="", help="stage kinds to leave out, comma-separated (e.g. decode-only,check)")
@click.option("--out", "out_stem", required=True)
def run(in_dir, thread_specs, copies, seconds, interference_seconds, only, skip, out_stem):
    from safetensors import safe_open

    sys.path.insert(0, str(pathlib.Path(__file__).parent / "probes"))
    import nvcuvid_scaling as probe

    d = pathlib.Path(in_dir)
    torch.zeros(1, device="cuda")
    hashes = json.loads((d / "hashes.json").read_text())
    with safe_open(str(d / "reference.safetensors"), "pt") as f:
        reference = {"kv": f.get_tensor("kv"), "file": f.metadata()["file"]}
    alone = probe.matmul_tflops(interference_seconds or 2.0)
    doc = {
        "command": "python " + shlex.join(["benchmarks/transform_nvdec.py", *sys.argv[1:]]),
        "machine": f"{torch.cuda.get_device_name()} ({platform.machine()})",
        "torch": torch.__version__,
        "matmul": "bf16 8192x8192 torch.mm on its own stream, waited for per 10, same process; TFLOP/s",
        "matmul_alone_tflops": round(alone, 1),
        "records": [],
    }

    def log(rec):
        doc["records"].append(rec)
        print(json.dumps(rec), flush=True)
        pathlib.Path(out_stem + ".json").write_text(json.dumps(doc, indent=1) + "\n")

    SKIP.update(k for k in skip.split(",") if k)
    stems = [s for s in only.split(",") if s]
    for path in sorted(d.glob("hevc-*.kvc")):
        if not stems or path.stem in stems:
            specs = [_spec(spec) for spec in thread_specs.split(",")]
            measure_file(log, probe, d, path, copies, specs, (seconds, interference_seconds), alone, hashes, reference)
    doc["matmul_alone_again_tflops"] = round(probe.matmul_tflops(interference_seconds or 2.0), 1)
    pathlib.Path(out_stem + ".json").write_text(json.dumps(doc, indent=1) + "\n")


@cli.command()
@click.option("--dir", "in_dir", required=True)
@click.option("--out", "out_stem", required=True)
@click.option("--codec", "codec_name", type=click.Choice(["transform", "int8"]), default="transform")
def first(in_dir, out_stem, codec_name):
    """The first chunk a fresh process restores, with and without the codec's warm_up (what Engine
    runs at start), each in a new process with an empty Triton cache, then once more with the cache
    the first run left on disk (a restarted server): seconds of warm-up, of the first chunk's
    restore and of the second's. int8: the default HEVC codec over the pack's reference KV,
    encoded in the process (CPU) before the clock starts."""
    import os
    import subprocess
    import tempfile

    doc = {"command": "python " + shlex.join(["benchmarks/transform_nvdec.py", *sys.argv[1:]]), "records": []}
    for warm in (False, True):
        with tempfile.TemporaryDirectory() as cache:
            for triton_cache in ("empty", "left by the run before"):
                env = {**os.environ, "TRITON_CACHE_DIR": cache}
                cmd = [sys.executable, __file__, "first-one", "--dir", in_dir, "--codec", codec_name]
                cmd += ["--warm"] if warm else []
                out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True).stdout
                rec = {"warm_up": warm, "triton_cache": triton_cache, **json.loads(out.strip().splitlines()[-1])}
                doc["records"].append(rec)
                print(json.dumps(rec), flush=True)
    pathlib.Path(out_stem + ".json").write_text(json.dumps(doc, indent=1) + "\n")


@cli.command(name="first-one")
@click.option("--dir", "in_dir", required=True)
@click.option("--codec", "codec_name", default="transform")
@click.option("--warm", is_flag=True)
def first_one(in_dir, codec_name, warm):
    d = pathlib.Path(in_dir)
    torch.zeros(1, device="cuda")
    if codec_name == "int8":
        from safetensors.torch import load_file

        from kvcodec.codecs.hevc.codec import HevcCodec
        from kvcodec.config import CodecConfig

        codec, case = HevcCodec(CodecConfig()), "int8-default"
        chunk = codec.encode_chunks(load_file(str(d / "reference.safetensors"))["kv"].to(torch.float16))[0]
        blob, shape = chunk.blobs[0], codec.inspect_chunk(chunk.blobs[0])
        L, H, D, t = shape.layers, shape.kv_heads, shape.head_dim, shape.tokens
    else:
        codec = load_pack(d / PACK)
        path = sorted(d.glob("hevc-*.kvc"))[0]
        case, blob = path.stem, _chunks(path.read_bytes())[1][0]
        h = codec.header(blob)
        (L, H, D), t = h["shape"], h["tokens"]
    out = torch.empty((L, 2, t, H, D), dtype=torch.float16, device="cuda")
    rec = {"case": case, "warm_up_s": None}
    if warm:
        t0 = time.perf_counter()
        codec.warm_up("cuda", torch.float16)
        rec["warm_up_s"] = round(time.perf_counter() - t0, 4)
    for name in ("first_restore_s", "second_restore_s"):
        t0 = time.perf_counter()
        codec.decode_chunk(blob, out)
        torch.cuda.synchronize()
        rec[name] = round(time.perf_counter() - t0, 4)
    print(json.dumps(rec))


def measure_file(log, probe, d, path, copies, specs, secs, alone, hashes, reference) -> None:
    """Every measurement of one file, each logged as it completes."""
    codec = load_pack(d / PACK)
    case = Case(path, codec, copies)
    base = {
        "case": case.name,
        "ratio_vs_fp16": round(case.ratio, 3),
        "bits_per_value": round(case.bits_per_value, 3),
        "shape": list(case.shape),
        "chunks": len(case.job_blobs),
    }
    stage(log, base, "check", check_exact, codec, case, hashes, reference)
    stage(log, base, "stream-probe", stream_probe, codec, case, hashes)
    for sessions, streamed in DECODE_ONLY:
        stage(log, base, "decode-only", decode_only, probe, case, sessions, streamed, secs, alone)
    for spec in specs:
        stage(log, base, "restore", measure_threads, probe, codec, case, spec, secs, alone)
    stage(log, base, "host-profile", host_profile, codec, case)
    stage(log, base, "gemm-precision", gemm_precision, codec, case)
    k = stage(log, base, "restore-kernels", kernel_times, codec, case)
    for name in ("batched", "fused"):
        if secs[1] > 0 and f"_{name}_fn" in k:
            fn = k[f"_{name}_fn"]
            stage(log, base, "restore-kernels-only", kernel_interference, probe, fn, case, secs[1], alone, name)


def decode_only(probe, case: Case, sessions: int, streamed: bool, secs: tuple, alone: float) -> dict:
    """NVDEC alone (frames decoded, nothing restored) on `sessions` threads: the engines' rate for
    this stream, a fresh parser per chunk or (streamed) each thread's chunks through one parser."""
    from kvcodec.video.nvcuvid import NvcuvidDecoder

    decs = [NvcuvidDecoder(0) for _ in range(sessions)]
    size = tuple(case.headers[0]["resolution"])
    frames = [case.headers[i % len(case.headers)]["frames"] for i in range(len(case.videos))]
    try:
        fn = functools.partial(probe.decode_loop, case.videos, frames, size, decs, streamed)
        rec = {"backend": "nvcuvid" + ("-streamed" if streamed else ""), "threads": sessions, "cuda_contexts": 1}
        rec.update(case.rates(probe.timed(fn, secs[0])))
        if secs[1] > 0:
            rec.update(probe.interference(fn, secs[1], alone))
        return rec
    finally:
        for dec in decs:
            dec.close()


SPEC = re.compile(r"([cbs]?)(\d+)x(\d+)((?:[wdintf]\d+)*)$")


def _spec(spec: str) -> dict:
    """[c|b|s]SESSIONSxTHREADS[wWAVE][dDELAY][iMICROSECONDS][n1][tN][f0]: c per chunk, b session 5's batched
    restore, s streamed (restore_chunks); WAVE chunks per pass of the math (default 16, 0: at the
    end), DELAY the parser's display delay (default 1), i the interpreter's switch interval, n1: no
    math (finish skipped: what decoding and the host work alone reach), tN: N host threads drive the
    sessions (restore_chunks' drivers; default one per session), f0: the reference kernels instead of
    the fused inverse transform."""
    m = SPEC.match(spec)
    if m is None:
        raise click.BadParameter(f"thread spec {spec!r}")
    opts = {k: int(v) for k, v in re.findall(r"([wdintf])(\d+)", m[4])}
    mode = {"c": "chunk", "b": "v2", "s": "stream", "": "chunk"}[m[1]]
    return {
        "sessions": int(m[2]),
        "threads": int(m[3]),
        "mode": mode,
        "wave": opts.get("w", 16),
        "display_delay": opts.get("d", 1),
        "switch_us": opts.get("i"),
        "no_math": bool(opts.get("n")),
        "drivers": opts.get("t"),
        "fused": bool(opts.get("f", 1)),
    }


SKIP: set[str] = set()  # stage kinds left out (run --skip)
DECODE_ONLY = [(7, False), (7, True), (14, True)]  # (sessions, streamed) of the decode-only stage


def stage(log, base: dict, kind: str, fn, *args) -> dict:
    """fn(*args), one measurement, logged; a failure is logged as the stage's error and the run goes on."""
    if kind in SKIP:
        return {}
    try:
        rec = fn(*args)
    except Exception as e:  # noqa: BLE001 - reported in the results
        rec = {"error": repr(e)}
    log({"kind": kind, **base, **{k: v for k, v in rec.items() if not k.startswith("_")}})
    return rec


if __name__ == "__main__":
    cli()
