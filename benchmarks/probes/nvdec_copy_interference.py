"""Probe: where does the NVDEC pool's interference with a concurrent matmul come from?

Each of `--workers` processes decodes the chunk videos of a .kvc file in a loop with one NVDEC
session and does one of: nothing with the frame ("none"), a torch copy into a slot ("kernel", what
the pool shipped with), or a driver pitched memcpy into a slot ("dma"). The main process measures a
bf16 matmul alone and while the workers run. Run on the GPU machine:

    python benchmarks/probes/nvdec_copy_interference.py --kvc DATA/int8_1024x1024.kvc --out OUT.json
"""

from __future__ import annotations

import argparse
import ctypes
import functools
import json
import multiprocessing as mp
import time

import torch


class _Memcpy2D(ctypes.Structure):
    """CUDA_MEMCPY2D of the driver API."""

    _fields_ = [
        ("srcXInBytes", ctypes.c_size_t),
        ("srcY", ctypes.c_size_t),
        ("srcMemoryType", ctypes.c_int),
        ("srcHost", ctypes.c_void_p),
        ("srcDevice", ctypes.c_uint64),
        ("srcArray", ctypes.c_void_p),
        ("srcPitch", ctypes.c_size_t),
        ("dstXInBytes", ctypes.c_size_t),
        ("dstY", ctypes.c_size_t),
        ("dstMemoryType", ctypes.c_int),
        ("dstHost", ctypes.c_void_p),
        ("dstDevice", ctypes.c_uint64),
        ("dstArray", ctypes.c_void_p),
        ("dstPitch", ctypes.c_size_t),
        ("WidthInBytes", ctypes.c_size_t),
        ("Height", ctypes.c_size_t),
    ]


_CU_MEMORYTYPE_DEVICE = 2


@functools.cache
def _memcpy2d_async():
    fn = ctypes.CDLL("libcuda.so.1").cuMemcpy2DAsync_v2
    fn.argtypes = [ctypes.POINTER(_Memcpy2D), ctypes.c_void_p]
    fn.restype = ctypes.c_int
    return fn


def copy_frame_dma(dst: torch.Tensor, frame: torch.Tensor, stream: torch.cuda.Stream) -> None:
    """Copy a (3, H, W) uint8 frame with any row pitch into the contiguous (3, H, W) `dst` with
    the driver's pitched memcpy on `stream`: a copy-engine transfer, no kernel on the SMs (a
    kernel launched from a decoder process makes the GPU time-slice with the model's process)."""
    planes, height, width = frame.shape
    if dst.shape != frame.shape or not dst.is_contiguous() or frame.stride(2) != 1:
        raise ValueError("copy_frame_dma needs a row-major frame and a contiguous destination of its shape")
    one_block = frame.stride(0) == frame.stride(1) * height
    copies = (
        [(frame.data_ptr(), dst.data_ptr(), planes * height)]
        if one_block
        else [(frame[p].data_ptr(), dst[p].data_ptr(), height) for p in range(planes)]
    )
    for src, dst_ptr, rows in copies:
        desc = _Memcpy2D(
            srcMemoryType=_CU_MEMORYTYPE_DEVICE,
            srcDevice=src,
            srcPitch=frame.stride(1),
            dstMemoryType=_CU_MEMORYTYPE_DEVICE,
            dstDevice=dst_ptr,
            dstPitch=width,
            WidthInBytes=width,
            Height=rows,
        )
        err = _memcpy2d_async()(ctypes.byref(desc), ctypes.c_void_p(stream.cuda_stream))
        if err:
            raise RuntimeError(f"cuMemcpy2DAsync failed with CUDA error {err}")


def _videos(path: str):
    from kvcodec import codec
    from kvcodec.container.format import CHUNK_MAGIC, read_object, split_streams

    with open(path, "rb") as f:
        data = f.read()
    fh, payload = codec.read_file_header(data)
    res = fh.resolutions[0]
    out = []
    for i, _ in enumerate(fh.chunk_tokens):
        e = fh.blob(i, res)
        blob = payload[e.offset : e.offset + e.length]
        h = codec.inspect_chunk_blob(blob)
        _, pl = read_object(blob, CHUNK_MAGIC, "chunk")
        out.append(bytes(split_streams(pl, h.streams, "chunk")["video"]))
    return out, res


def _worker(path, mode, ready, stop, frames_out):
    from kvcodec.video.nvdec import NvdecDecoder

    torch.cuda.set_device(0)
    videos, (w, h) = _videos(path)
    dec = NvdecDecoder(0, latency="low", copy=False)
    slots = torch.empty((4, 3, h, w), dtype=torch.uint8, device="cuda")
    cur = torch.cuda.current_stream()
    count = 0
    ready.set()
    while not stop.is_set():
        for v in videos:
            for frame in dec.decode(v, w, h):
                if mode == "kernel":
                    slots[count % 4].copy_(frame)
                elif mode == "dma":
                    copy_frame_dma(slots[count % 4], frame, cur)
                count += 1
            cur.synchronize()
    frames_out.value = count


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--kvc", required=True)
    ap.add_argument("--workers", default="1,7", help="decoder process counts, comma-separated")
    ap.add_argument("--modes", default="none,kernel,dma")
    ap.add_argument("--seconds", type=float, default=6.0)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    from kvbench.decode import _matmul_tflops

    ctx = mp.get_context("spawn")
    _, res = _videos(args.kvc)
    alone = _matmul_tflops(torch.device("cuda", 0), args.seconds)
    records = [{"case": "alone", "matmul_tflops": alone}]
    print(records[-1], flush=True)
    for workers in [int(w) for w in args.workers.split(",")]:
        for mode in args.modes.split(","):
            stop = ctx.Event()
            readies = [ctx.Event() for _ in range(workers)]
            counts = [ctx.Value("q", 0) for _ in range(workers)]
            procs = [ctx.Process(target=_worker, args=(args.kvc, mode, r, stop, c)) for r, c in zip(readies, counts)]
            for p in procs:
                p.start()
            for r in readies:
                r.wait(120)
            time.sleep(1.0)
            during = _matmul_tflops(torch.device("cuda", 0), args.seconds)
            stop.set()
            for p in procs:
                p.join(60)
            frames = sum(c.value for c in counts)
            rec = {
                "case": f"{workers} decoder processes, copy={mode}",
                "workers": workers,
                "copy": mode,
                "matmul_tflops": during,
                "matmul_slowdown": 1 - during / alone,
                "frames_decoded": frames,
                "resolution": f"{res[0]}x{res[1]}",
            }
            records.append(rec)
            print(rec, flush=True)
    alone2 = _matmul_tflops(torch.device("cuda", 0), args.seconds)
    records.append({"case": "alone again", "matmul_tflops": alone2})
    print(records[-1], flush=True)
    command = "python benchmarks/probes/nvdec_copy_interference.py " + " ".join(
        f"--{k} {v}" for k, v in vars(args).items()
    )
    with open(args.out, "w") as f:
        json.dump({"command": command, "records": records}, f, indent=1)


if __name__ == "__main__":
    main()
