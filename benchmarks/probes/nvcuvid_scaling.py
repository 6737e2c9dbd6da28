"""Probe: every NVDEC engine from one process and one CUDA context (issue 14), against the
7-process NvdecPool and PyNvVideoCodec decoders in-process. Run on the GPU machine:

    python benchmarks/probes/nvcuvid_scaling.py --kvc A.kvc --kvc B.kvc --out OUT.json [--hashes H.json]

Per container (the KV cache given by path, stored at one resolution): decode-only scaling with
N threads (nvcuvid and PyNvVideoCodec), full restore rate (decode + restore kernel into the output
tensor) per backend, a bf16 matmul's slowdown while each backend restores in a loop, and the GPU
memory each backend holds before any request (standing_mb). --hashes: sha256 of chunks restored
on the CPU (x265/FFmpeg path) to check the GPU restores bit for bit.
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import json
import pathlib
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import torch

from kvcodec import codec
from kvcodec.container.format import CHUNK_MAGIC, read_object, split_streams

MB = 1 << 20


class Case:
    """A container's chunk blobs replicated to `copies` jobs, each with its own output tensor."""

    def __init__(self, path: str, copies: int, device):
        data = pathlib.Path(path).read_bytes()
        _, jobs = codec.file_chunks(data, "cpu")
        self.name = path.rsplit("/", 1)[-1].removesuffix(".kvc")
        self.blobs = [bytes(b) for b, _ in jobs]
        self.headers = [codec.inspect_chunk_blob(b) for b in self.blobs]
        self.videos = [self._video(b, h) for b, h in zip(self.blobs, self.headers)]
        self.size = tuple(self.headers[0].resolution)
        reps = [i % len(self.blobs) for i in range(copies)]
        self.job_blobs = [self.blobs[i] for i in reps]
        self.job_videos = [self.videos[i] for i in reps]
        self.outs = [
            torch.empty(self.headers[i].shape, dtype=codec.DTYPES[self.headers[i].dtype], device=device) for i in reps
        ]
        self.fp16_bytes = sum(o.numel() * 2 for o in self.outs)
        self.video_bytes = sum(len(v) for v in self.job_videos)
        self.blob_bytes = sum(len(b) for b in self.job_blobs)
        self.job_frames = [self.headers[i].frames for i in reps]
        self.frames = sum(self.job_frames)

    @staticmethod
    def _video(blob, h) -> bytes:
        _, payload = read_object(blob, CHUNK_MAGIC, "chunk")
        return bytes(split_streams(payload, h.streams, "chunk")["video"])

    def rates(self, seconds: float) -> dict:
        return {
            "restored_gb_per_s": round(self.fp16_bytes / seconds / 1e9, 3),
            "coded_gbit_per_s": round(self.video_bytes * 8 / seconds / 1e9, 3),
            "blob_gbit_per_s": round(self.blob_bytes * 8 / seconds / 1e9, 3),
            "frames_per_s": round(self.frames / seconds, 1),
        }


def timed(fn, seconds: float) -> float:
    """Seconds per call of fn (median of repeats within `seconds`, at least 3)."""
    fn()
    times = []
    t_end = time.perf_counter() + seconds
    while len(times) < 3 or time.perf_counter() < t_end:
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return sorted(times)[len(times) // 2]


MATMUL_QUEUED = 1  # matmul batches kept queued on its stream while its thread waits (kvbench.busy)


def matmul_tflops(seconds: float, n: int = 8192) -> float:
    """A bf16 n^3 matmul's TFLOP/s, 10 at a time on its own stream (kvbench.busy.matmul_tflops),
    MATMUL_QUEUED batches in flight: 1 waits for each 10 as an engine waits for its own step (a
    device-wide synchronize, before 2026-12-04, also waited for the restore's streams)."""
    from kvbench.busy import matmul_tflops as busy_tflops

    return busy_tflops("cuda", seconds, n, batch=10, queued=MATMUL_QUEUED)


def interference(fn, seconds: float, alone: float) -> dict:
    """Matmul TFLOP/s while fn runs in a loop on another thread (kvbench.busy.beside_matmul, with
    this module's matmul), and fn's own rate meanwhile."""
    from kvbench.busy import beside_matmul

    rec = beside_matmul(fn, "cuda", seconds, alone, 0.5, batch=10, queued=MATMUL_QUEUED)
    if "error" in rec:
        raise RuntimeError(rec["error"])
    return {
        "matmul_tflops": round(rec["matmul_tflops_during"], 1),
        "matmul_slowdown": round(rec["matmul_slowdown"], 4),
        "calls_during": rec["calls_during"],
        "call_s_during": round(rec["call_s_during"], 4),
    }


def free_mb() -> float:
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    return torch.cuda.mem_get_info()[0] / MB


def decode_only(case: Case, make_decoder, threads: int, seconds: float) -> dict:
    """Frames/s with `threads` threads, each decoding its share of the case's videos (no restore)."""
    decs = [make_decoder() for _ in range(threads)]
    w, h = case.size
    shares = [case.job_videos[i::threads] for i in range(threads)]

    def work(i):
        torch.cuda.set_device(0)
        n = 0
        for v in shares[i]:
            for _ in decs[i].decode(v, w, h):
                n += 1
        torch.cuda.current_stream().synchronize()
        return n

    with ThreadPoolExecutor(threads) as ex:

        def run():
            return sum(ex.map(work, range(threads)))

        s = timed(run, seconds)
    for d in decs:
        d.close()
    return {"threads": threads, **case.rates(s)}


def decode_loop(videos, frames, size: tuple[int, int], decs, streamed: bool = False) -> None:
    """Every video decoded once (no restore), spread over the decoders' threads (frames: each
    video's frame count). streamed: each thread feeds its share to one parser back to back
    (NvcuvidDecoder.decode_each); else one decode() per video (a fresh parser each)."""
    w, h = size
    n = len(decs)

    def work(i):
        torch.cuda.set_device(0)
        if streamed:
            items = ((k, v, w, h, f) for k, (v, f) in enumerate(zip(videos[i::n], frames[i::n])))
            for _ in decs[i].decode_each(items):
                pass
        else:
            for v in videos[i::n]:
                for _ in decs[i].decode(v, w, h):
                    pass
        torch.cuda.current_stream().synchronize()

    threads = [threading.Thread(target=work, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()


def check_exact(case: Case, restore_fn, hashes: dict) -> dict:
    out = {}
    for i in range(min(2, len(case.blobs))):
        key = f"{case.name}/{i}"
        if key not in hashes:
            continue
        target = torch.empty(case.headers[i].shape, dtype=codec.DTYPES[case.headers[i].dtype], device="cuda")
        restore_fn([case.blobs[i]], [target])
        torch.cuda.synchronize()
        got = hashlib.sha256(target.cpu().contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()
        out[key] = got == hashes[key]
    return out


class ThreadRestorer:
    """codec.decode_chunk_blob on `threads` threads, each with its own decoder and CUDA stream
    (the in-process PyNvVideoCodec baseline; NvcuvidThreads does the same with nvcuvid)."""

    def __init__(self, make_decoder, threads: int):
        self.make_decoder, self.local = make_decoder, threading.local()
        self.pool = ThreadPoolExecutor(threads)
        self.decoders = []

    def _one(self, blob, out):
        if not hasattr(self.local, "dec"):
            torch.cuda.set_device(0)
            self.local.dec, self.local.stream = self.make_decoder(), torch.cuda.Stream()
            self.decoders.append(self.local.dec)
        with torch.cuda.stream(self.local.stream):
            codec.decode_chunk_blob(blob, "cuda", out=out, decoder=self.local.dec)
        self.local.stream.synchronize()

    def restore_blobs(self, blobs, outs):
        for f in [self.pool.submit(self._one, b, o) for b, o in zip(blobs, outs)]:
            f.result()

    def close(self):
        self.pool.shutdown()
        for d in self.decoders:
            d.close()


def backends(args, case: Case):
    """(backend name, threads or workers, CUDA contexts, opener) for each compared backend; an opener
    returns (restore_fn(blobs, outs), close_fn)."""
    from kvcodec.codecs.hevc.pool import open_threads, restore_chunk
    from kvcodec.video.nvdec import NvdecDecoder

    def nvcuvid(sessions, threads):
        def open_():
            d = open_threads(
                sessions, threads=threads, device=0, display_delay=args.display_delay, warm_blob=case.blobs[0]
            )
            return (lambda b, o: d.restore_blobs(b, o, synchronize=True, decode_into=restore_chunk)), d.close

        return open_

    def warm_outs(n):
        h = case.headers[0]
        return [torch.empty(h.shape, dtype=codec.DTYPES[h.dtype], device="cuda") for _ in range(n)]

    def pynv(n):
        def open_():
            r = ThreadRestorer(lambda: NvdecDecoder(0), n)
            r.restore_blobs(case.blobs[:1] * n, warm_outs(n))
            return r.restore_blobs, r.close

        return open_

    def pool(n):
        def open_():
            from kvcodec.codecs.hevc.pool import open_pool, restore_in_pool

            p = open_pool(workers=n)

            def run(b, o):
                restore_in_pool(p, b, o)
                torch.cuda.synchronize()

            run(case.blobs[:1] * n, warm_outs(n))
            return run, p.close

        return open_

    out = [(f"nvcuvid:{s}x{t}", s, 1, nvcuvid(s, t)) for s, t in args.restore_threads]
    out += [("pynvvideocodec", n, 1, pynv(n)) for n in (1, 7)]
    if not args.skip_pool:
        out.append(("nvdec-pool", 7, 8, pool(7)))
    return out


def measure_backend(args, case, name, n, contexts, opener, alone, hashes) -> dict:
    before = free_mb()
    restore, close = opener()
    time.sleep(0.2)
    standing = before - free_mb()
    rec = {
        "backend": name,
        "threads": n,
        "cuda_contexts": contexts,
        "gpus": 1,
        "case": case.name,
        "resolution": f"{case.size[0]}x{case.size[1]}",
        "chunks": len(case.job_blobs),
        "standing_mb": round(standing, 1),
    }
    try:
        rec["exact_vs_cpu"] = check_exact(case, restore, hashes)
        s = timed(lambda: restore(case.job_blobs, case.outs), args.seconds)
        rec.update(case.rates(s))
        if args.interference_seconds > 0:
            rec.update(interference(lambda: restore(case.job_blobs, case.outs), args.interference_seconds, alone))
            rec["restored_gb_per_s_under_matmul"] = round(case.fp16_bytes / rec["call_s_during"] / 1e9, 3)
    finally:
        close()
    return rec


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--kvc", action="append", required=True)
    ap.add_argument("--copies", type=int, default=28, help="chunk jobs per measurement (blobs replicated)")
    ap.add_argument("--seconds", type=float, default=2.0)
    ap.add_argument("--interference-seconds", type=float, default=4.0)
    ap.add_argument("--scaling-threads", default="1,2,4,7,10")
    ap.add_argument("--restore-threads", default="7x14", help="nvcuvid SESSIONSxTHREADS, comma-separated")
    ap.add_argument("--display-delay", type=int, default=1)
    ap.add_argument("--pynv-decode-threads", default="1,7")
    ap.add_argument("--skip-pool", action="store_true")
    ap.add_argument("--hashes", default=None)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    args.pynv_decode_threads = [int(x) for x in args.pynv_decode_threads.split(",") if x]
    args.restore_threads = [tuple(int(v) for v in x.split("x")) for x in args.restore_threads.split(",")]
    from kvcodec.video.nvcuvid import NvcuvidDecoder
    from kvcodec.video.nvdec import NvdecDecoder

    torch.cuda.init()
    torch.zeros(1, device="cuda")
    hashes = json.loads(pathlib.Path(args.hashes).read_text()) if args.hashes else {}
    result = {"device": torch.cuda.get_device_name(0), "args": vars(args), "records": []}
    alone = matmul_tflops(args.interference_seconds or 2.0)
    result["matmul_alone_tflops"] = round(alone, 1)

    def log(rec):
        result["records"].append(rec)
        print(json.dumps(rec), flush=True)
        pathlib.Path(args.out).write_text(json.dumps(result, indent=1))

    for path in args.kvc:
        case = Case(path, args.copies, "cuda")
        for n in [int(x) for x in args.scaling_threads.split(",") if x]:
            make = lambda: NvcuvidDecoder(0, display_delay=args.display_delay)  # noqa: E731
            log(
                {
                    "kind": "decode-only",
                    "backend": "nvcuvid",
                    "case": case.name,
                    **decode_only(case, make, n, args.seconds),
                }
            )
        if args.interference_seconds > 0:
            decs = [NvcuvidDecoder(0, display_delay=args.display_delay) for _ in range(7)]
            log(
                {
                    "kind": "decode-only-interference",
                    "backend": "nvcuvid",
                    "threads": 7,
                    "case": case.name,
                    **interference(
                        functools.partial(decode_loop, case.job_videos, case.job_frames, case.size, decs),
                        args.interference_seconds,
                        alone,
                    ),
                }
            )
            for d in decs:
                d.close()
        for n in args.pynv_decode_threads:
            log(
                {
                    "kind": "decode-only",
                    "backend": "pynvvideocodec",
                    "case": case.name,
                    **decode_only(case, lambda: NvdecDecoder(0), n, args.seconds),
                }
            )
        for name, n, contexts, opener in backends(args, case):
            try:
                log({"kind": "restore", **measure_backend(args, case, name, n, contexts, opener, alone, hashes)})
            except Exception as e:  # noqa: BLE001 - a failing backend is reported, the others still run
                log({"kind": "restore", "backend": name, "threads": n, "case": case.name, "error": repr(e)})
    result["matmul_alone_again_tflops"] = round(matmul_tflops(args.interference_seconds or 2.0), 1)
    pathlib.Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
