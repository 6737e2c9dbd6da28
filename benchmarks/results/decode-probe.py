"""Device probe: API introspection, single decoder, PyAV, pool scaling, staging memory."""
import json
import os
import sys
import time
import traceback

import numpy as np
import torch

OUT = os.environ.get("OUT", "/tmp/out")
res = {}


def P(*a):
    print(*a, flush=True)


def step(name):
    def deco(fn):
        t = time.time()
        try:
            r = fn()
            res[name] = r
            P(f"== {name} ok {time.time()-t:.1f}s: {r}")
        except Exception as e:
            res[name] = f"FAIL {type(e).__name__}: {e}"
            P(f"== {name} FAIL {time.time()-t:.1f}s")
            traceback.print_exc()
        return fn
    return deco


@step("env")
def _():
    import PyNvVideoCodec as nvc
    d = {"torch": torch.__version__, "nvc": nvc.__version__, "gpu": torch.cuda.get_device_name(0)}
    d["nvc_names"] = [x for x in dir(nvc) if not x.startswith("_")]
    d["chroma"] = [x for x in dir(nvc.cudaVideoChromaFormat) if not x.startswith("__")]
    try:
        d["caps"] = str(nvc.GetDecoderCaps(gpuid=0, codec=nvc.cudaVideoCodec.HEVC, chromaformat=nvc.cudaVideoChromaFormat._444, bitdepth=8))
    except Exception as e:
        d["caps"] = f"FAIL {e}"
    from kvcodec.video.nvdec import NvdecDecoder
    d["available"] = NvdecDecoder.is_available()
    return d


from kvcodec.video.x265_cpu import FFmpegHevcDecoder, X265Encoder


def frames(w, h, n, seed, spread):
    rng = np.random.default_rng(seed)
    base = rng.integers(40, 200, size=(3, h, 1))
    return [np.clip(base + rng.normal(0, spread, size=(3, h, w)), 0, 255).astype(np.uint8) for _ in range(n)]


enc = X265Encoder(threads=16)
W = H = 1024
t0 = time.time()
SRC = {sp: frames(W, H, 16, 1, sp) for sp in (1.0, 8.0)}
BS = {sp: enc.encode(SRC[sp], W, H) for sp in SRC}
P("encode", time.time() - t0, {sp: len(b) * 8 / (16 * 3 * W * H) for sp, b in BS.items()})


@step("introspect_frame")
def _():
    import PyNvVideoCodec as nvc
    from kvcodec.video.nvcuvid_api import primary_context as _primary_context
    from kvcodec.video.nvdec import split_access_units
    dec = nvc.CreateDecoder(gpuid=0, codec=nvc.cudaVideoCodec.HEVC, cudacontext=_primary_context(0), cudastream=0, usedevicememory=True)
    bs = BS[8.0]
    buf = np.frombuffer(bs, np.uint8)
    out = {}
    for off, ln in split_access_units(bs):
        pkt = nvc.PacketData(); pkt.bsl_data = buf.ctypes.data + off; pkt.bsl = ln
        fr = dec.Decode(pkt)
        if fr:
            f = fr[0]
            out["attrs"] = [a for a in dir(f) if not a.startswith("__")]
            for a in ("format", "shape", "dtype", "framesize"):
                try:
                    v = getattr(f, a); out[a] = str(v() if callable(v) else v)
                except Exception as e:
                    out[a] = f"ERR {e}"
            try:
                t = torch.from_dlpack(f); out["dlpack"] = (tuple(t.shape), str(t.dtype), t.stride())
            except Exception as e:
                out["dlpack"] = f"ERR {e}"
            try:
                out["cuda"] = [str(c.__cuda_array_interface__) for c in f.cuda()]
            except Exception as e:
                out["cuda"] = f"ERR {e}"
            out["dec"] = [a for a in dir(dec) if not a.startswith("__")]
            try:
                out["wh"] = (dec.GetWidth(), dec.GetHeight())
            except Exception as e:
                out["wh"] = f"ERR {e}"
            break
    return out


def bench_single(latency, sp, reps=3):
    from kvcodec.video.nvdec import NvdecDecoder
    dec = NvdecDecoder(0, latency=latency, copy=True)
    bs = BS[sp]
    n = sum(1 for _ in dec.decode(bs, W, H))  # warm
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(reps):
        for f in dec.decode(bs, W, H):
            pass
    torch.cuda.synchronize()
    dt = time.perf_counter() - t
    return {"frames_per_s": reps * n / dt, "coded_gbit_s": reps * len(bs) * 8 / dt / 1e9, "samples_gb_s": reps * n * 3 * W * H / dt / 1e9}


@step("exact_single")
def _():
    from kvcodec.video.nvdec import NvdecDecoder
    dec = NvdecDecoder(0)
    ok = {}
    for sp in BS:
        got = [f.cpu().numpy() for f in dec.decode(BS[sp], W, H)]
        ok[sp] = len(got) == 16 and all(np.array_equal(a, b) for a, b in zip(got, SRC[sp]))
    return ok


for lat in ("low", "native"):
    for sp in BS:
        step(f"single_{lat}_{sp}")(lambda lat=lat, sp=sp: bench_single(lat, sp))


@step("staging_single")
def _():
    from kvcodec.video.nvdec import NvdecDecoder
    torch.cuda.synchronize()
    free0, _ = torch.cuda.mem_get_info()
    dec = NvdecDecoder(0)
    peak = 0
    for f in dec.decode(BS[8.0], W, H):
        free, _ = torch.cuda.mem_get_info()
        peak = max(peak, free0 - free)
    return {"device_mem_delta_mb": peak / 2**20, "torch_reserved_mb": torch.cuda.memory_reserved() / 2**20}


@step("pyav")
def _():
    from kvcodec.video.nvdec_pyav import PyAVNvdecDecoder
    d = PyAVNvdecDecoder(0)
    got = [f.cpu().numpy() for f in d.decode(BS[8.0], W, H)]
    exact = len(got) == 16 and all(np.array_equal(a, b) for a, b in zip(got, SRC[8.0]))
    torch.cuda.synchronize()
    t = time.perf_counter()
    n = 0
    for _ in range(3):
        for f in d.decode(BS[8.0], W, H):
            n += 1
    torch.cuda.synchronize()
    dt = time.perf_counter() - t
    return {"exact": exact, "frames_per_s": n / dt, "coded_gbit_s": 3 * len(BS[8.0]) * 8 / dt / 1e9}


def bench_pool(workers, sp, nstreams=42):
    from kvcodec.video.nvdec_pool import NvdecPool
    t = time.perf_counter()
    with NvdecPool(workers=workers, slots=4) as pool:
        start_s = time.perf_counter() - t
        streams = [(BS[sp], W, H)] * nstreams
        list(pool.decode_streams(streams[:workers]))  # warm
        out = torch.empty((3, H, W), dtype=torch.uint8, device="cuda")
        torch.cuda.synchronize()
        t = time.perf_counter()
        n = 0
        for sid, idx, fr in pool.decode_streams(streams):
            out.copy_(fr)
            n += 1
        torch.cuda.synchronize()
        dt = time.perf_counter() - t
    return {"start_s": start_s, "frames": n, "coded_gbit_s": nstreams * len(BS[sp]) * 8 / dt / 1e9, "samples_gb_s": n * 3 * W * H / dt / 1e9}


@step("pool_exact")
def _():
    from kvcodec.video.nvdec_pool import NvdecPool
    with NvdecPool(workers=2, slots=2) as pool:
        bad = 0
        for sid, idx, fr in pool.decode_streams([(BS[1.0], W, H), (BS[8.0], W, H)] * 2):
            bad += not np.array_equal(fr.cpu().numpy(), SRC[[1.0, 8.0][sid % 2]][idx])
    return {"mismatches": bad}


for wk in (1, 4, 7, 10):
    step(f"pool_{wk}_8.0")(lambda wk=wk: bench_pool(wk, 8.0))
step("pool_7_1.0")(lambda: bench_pool(7, 1.0))

json.dump(res, open(f"{OUT}/probe.json", "w"), indent=1, default=str)
