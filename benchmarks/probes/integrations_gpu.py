"""The LMCache serde and the SGLang HiCache backend on the GPU machine, through the real packages.

Two steps, because the GPU machine has no model loader (no gguf) and a call carries 64 MiB:

    # here (CPU): real SmolLM2 KV, coded by the real LMCache serde into LMCache memory objects
    python benchmarks/probes/integrations_gpu.py prepare --out DATA [--tokens 512]
    # there (GPU): deserialize on NVDEC, check, time; serialize again; the L2 path; SGLang's backend
    python benchmarks/probes/integrations_gpu.py run --data DATA --json OUT.json [--device cuda]

`prepare` writes each LMCache object (256 tokens, all layers) serialized in `exact` and `int8`,
plus the SHA-256 of the original object and of kvcodec's own CPU decode of each int8 object.
`run` checks: exact deserialize bitwise equal to the original; int8 deserialize equal to
kvcodec's own decode of the same blob (on the same device, and the CPU decode made here); the
same for SGLang's backend (created by SGLang's StorageBackendFactory as "dynamic"), and times
serialize / deserialize / batch_set / batch_get. `--device cpu` is a dry run of the same steps.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("LMCACHE_TRACK_USAGE", "false")  # LMCache's usage telemetry: no network
os.environ.setdefault("DO_NOT_TRACK", "1")

import torch  # noqa: E402

OBJECT_TOKENS = 256  # LMCache's default chunk size: one LMCache object
HEAD_DIM = 64
QUANTS = ("exact", "int8")
TAG = "probe"


def sha(t: torch.Tensor) -> str:
    return hashlib.sha256(t.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()


def lmcache_layout(kv: torch.Tensor) -> torch.Tensor:
    """Canonical (layers, 2, tokens, heads, dim) KV as LMCache's (2, layers, tokens, hidden)."""
    layers, _, tokens, heads, dim = kv.shape
    return kv.permute(1, 0, 2, 3, 4).reshape(2, layers, tokens, heads * dim).contiguous()


def timed(fn, reps: int) -> tuple[float, object]:
    """Median seconds of `reps` calls of fn, and its last result."""
    times, result = [], None
    for _ in range(reps):
        t0 = time.perf_counter()
        result = fn()
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), result


# -- LMCache memory objects ---------------------------------------------------------------------
class L1:
    """A real LMCache L1Manager and helpers to make memory objects in it."""

    def __init__(self, size_mb: int = 512) -> None:
        from lmcache.v1.distributed.config import L1ManagerConfig, L1MemoryManagerConfig
        from lmcache.v1.distributed.l1_manager import L1Manager

        config = L1MemoryManagerConfig(size_in_bytes=size_mb << 20, use_lazy=False)
        self.manager = L1Manager(L1ManagerConfig(memory_config=config))
        self._n = 0

    def key(self):
        from lmcache.v1.distributed.api import ObjectKey

        self._n += 1
        return ObjectKey(chunk_hash=self._n.to_bytes(16, "big"), model_name="smollm2/135m", kv_rank=0)

    def obj(self, layout, temporary: bool = False):
        key = self.key()
        err, obj = self.manager.reserve_write([key], [temporary], layout, tag=TAG)[key]
        if obj is None:
            raise RuntimeError(f"L1 reserve failed: {err}")
        return key, obj

    def kv_obj(self, x: torch.Tensor):
        from lmcache.v1.distributed.api import MemoryLayoutDesc

        layout = MemoryLayoutDesc(shapes=[x.shape], dtypes=[x.dtype])
        key, obj = self.obj(layout)
        obj.tensor.copy_(x)
        self.manager.finish_write([key], tag=TAG)
        return key, obj, layout

    def release(self, staged=(), resident=()) -> None:
        """Give back staging objects (never admitted) and resident ones."""
        if staged:
            self.manager.finish_write_and_delete(list(staged), tag=TAG)
        if resident:
            self.manager.delete(list(resident), force=True)


def processor(quant: str, device: str):
    from lmcache.v1.distributed.serde import SerdeConfig, create_serde_processor

    import kvcodec.integrations.lmcache_plugin  # noqa: F401  registers the "kvcodec" serde

    return create_serde_processor(SerdeConfig("kvcodec", {"quant": quant, "head_dim": HEAD_DIM, "device": device}))


def stored_key(index: int):
    """The LMCache key object `index` is serialized under (the serde binds each object to its key):
    the same on the machine that prepares the objects and on the one that deserializes them."""
    from lmcache.v1.distributed.api import ObjectKey

    return ObjectKey(chunk_hash=index.to_bytes(16, "big"), model_name="smollm2/135m-objects", kv_rank=0)


def serialize(l1: L1, proc, x: torch.Tensor, index: int, reps: int = 1) -> tuple[float, bytes]:
    """LMCache's serializer call on a resident object into a temp buffer sized by LMCache, under
    stored_key(index): (median seconds of `reps` calls, the bytes)."""
    from lmcache.v1.distributed.serde import serialized_layout_desc

    key, src, layout = l1.kv_obj(x)
    tkey, tmp = l1.obj(serialized_layout_desc(layout, proc), temporary=True)
    t, n = timed(lambda: proc._serializer.serialize(src, tmp, stored_key(index)), reps)
    data = bytes(tmp.tensor.reshape(-1)[:n].numpy().tobytes())
    l1.release(staged=[tkey], resident=[key])
    return t, data


# -- prepare (CPU, here) ------------------------------------------------------------------------
def real_kv(tokens: int, text: str) -> torch.Tensor:
    from kvcodec.integrations.hf import extract_kv
    from kvcodec.models import load_model
    from kvcodec.models.texts import load_text

    model, tok = load_model("smollm2-135m")
    _, kv = extract_kv(model, tok, load_text(text, max_chars=tokens * 8), max_tokens=tokens)
    if kv.shape[2] < tokens:
        raise SystemExit(f"text {text} gave {kv.shape[2]} tokens < {tokens}")
    return kv.to(torch.float16)


def prepare(args) -> None:
    from kvcodec.codecs import make_codec
    from kvcodec.integrations.lmcache_serde import to_canonical

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    kv = real_kv(args.tokens, args.text)
    l1 = L1()
    objects = []
    for i in range(args.tokens // OBJECT_TOKENS):
        x = lmcache_layout(kv[:, :, i * OBJECT_TOKENS : (i + 1) * OBJECT_TOKENS])
        entry = {"index": i, "shape": list(x.shape), "dtype": "float16", "sha_original": sha(x), "bytes": {}}
        for quant in QUANTS:
            _, data = serialize(l1, processor(quant, "cpu"), x, i)
            (out / f"{quant}_{i}.bin").write_bytes(data)
            entry["bytes"][quant] = len(data)
        codec = make_codec("hevc", quant="int8", chunk_tokens=OBJECT_TOKENS, resolutions=((256, 256),))
        blob = codec.encode_chunks(to_canonical(x, HEAD_DIM))[0].blobs[0]
        own = codec.decode_chunk(blob, torch.empty_like(to_canonical(x, HEAD_DIM)))
        entry["sha_int8_own_cpu_decode"] = sha(lmcache_layout(own))
        objects.append(entry)
    manifest = {"model": "smollm2-135m", "text": args.text, "tokens": args.tokens, "objects": objects}
    (out / "manifest.json").write_text(json.dumps(manifest, indent=1))
    print(json.dumps(manifest, indent=1))


# -- run (GPU, there) ---------------------------------------------------------------------------
def environment() -> dict:
    from importlib.metadata import version

    from kvcodec.video import available_backends

    env = {"python": platform.python_version(), "torch": torch.__version__, "cuda": torch.cuda.is_available()}
    env["gpu"] = torch.cuda.get_device_name() if torch.cuda.is_available() else None
    for package in ("lmcache", "sglang"):
        try:
            env[package] = version(package)
        except Exception as e:  # carried as unpacked files without metadata
            env[package] = f"unknown ({type(e).__name__})"
    env["video_backends"] = available_backends()
    try:
        import lmcache.cuda_ops  # noqa: F401

        env["lmcache_cuda_ops"] = "imports"
    except Exception as e:  # recorded: LMCache falls back to its torch ops without it
        env["lmcache_cuda_ops"] = f"{type(e).__name__}: {e}"[:300]
    return env


def deserialize(l1: L1, proc, data: bytes, shape, index: int, reps: int) -> tuple[float, torch.Tensor]:
    """LMCache's deserializer call, under stored_key(index), from a temp buffer holding `data` into
    a fresh memory object: (median seconds of `reps` calls, the restored tensor)."""
    from lmcache.v1.distributed.api import MemoryLayoutDesc
    from lmcache.v1.distributed.serde import serialized_layout_desc

    layout = MemoryLayoutDesc(shapes=[torch.Size(shape)], dtypes=[torch.float16])
    key, tmp = l1.obj(serialized_layout_desc(layout, proc), temporary=True)
    tmp.tensor.reshape(-1)[: len(data)].copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
    dkey, dst = l1.obj(layout)
    dst.tensor.zero_()
    t, _ = timed(lambda: proc._deserializer.deserialize(tmp, dst, stored_key(index)), reps)
    y = dst.tensor.clone()
    l1.release(staged=[key, dkey])
    return t, y


def own_decode(data: bytes, shape, device: str) -> torch.Tensor:
    """kvcodec's own decode of the serde's coded part, bypassing LMCache."""
    from kvcodec.codecs import make_codec
    from kvcodec.integrations.lmcache_serde import split_frame

    _, ((_, _, blob),) = split_frame(memoryview(data))
    canonical = (shape[1], 2, shape[2], shape[3] // HEAD_DIM, HEAD_DIM)
    codec = make_codec("hevc", quant="int8", chunk_tokens=shape[2], resolutions=((256, 256),))
    out = codec.decode_chunk(blob, torch.empty(canonical, dtype=torch.float16, device=device))
    return lmcache_layout(out.cpu())


def run_lmcache(data_dir: Path, manifest: dict, device: str, reps: int) -> tuple[dict, list[torch.Tensor]]:
    l1 = L1()
    res: dict = {"objects": [], "deserialize": {}, "serialize": {}}
    originals = []
    for entry in manifest["objects"]:
        shape, i = entry["shape"], entry["index"]
        got = {"index": i}
        for quant in QUANTS:
            data = (data_dir / f"{quant}_{i}.bin").read_bytes()
            for dev in dict.fromkeys((device, "cpu")):
                proc = processor(quant, dev)
                n = reps if dev == device else max(1, reps // 5)
                t, y = deserialize(l1, proc, data, shape, i, n)
                res["deserialize"].setdefault(f"{quant}/{dev}", []).append(t)
                if quant == "exact":
                    got[f"exact_{dev}_bitwise"] = sha(y) == entry["sha_original"]
                    if dev == device:
                        originals.append(y)
                else:
                    got[f"int8_{dev}_eq_own_decode_same_device"] = torch.equal(y, own_decode(data, shape, dev))
                    got[f"int8_{dev}_eq_own_cpu_decode_prepared"] = sha(y) == entry["sha_int8_own_cpu_decode"]
                proc.close()
        res["objects"].append(got)
    for quant in QUANTS:
        proc = processor(quant, device)
        for i, x in enumerate(originals):
            t, data = serialize(l1, proc, x, i, max(1, reps // 5))
            res["serialize"].setdefault(quant, []).append(t)
            same = data == (data_dir / f"{quant}_{i}.bin").read_bytes()
            res["objects"][i][f"{quant}_serialized_bytes_equal_cpu_machine"] = same
        proc.close()
    res["l2_adapter"] = run_l2(l1, originals[0], device)
    return res, originals


def run_l2(l1: L1, x: torch.Tensor, device: str) -> dict:
    """One object through what LMCache's StorageManager builds for a --l2-adapter with a serde:
    SerdeL2AdapterWrapper around kvcodec's L2 adapter over a file store."""
    from lmcache.v1.distributed.l2_adapters.config import get_l2_adapter_config_class
    from lmcache.v1.distributed.l2_adapters.factory import create_l2_adapter_from_registry
    from lmcache.v1.distributed.l2_adapters.serde_wrapper import SerdeL2AdapterWrapper
    from lmcache.v1.distributed.serde import create_serde_processor

    with tempfile.TemporaryDirectory() as tmp:
        spec = {
            "type": "plugin",
            "module_path": "kvcodec.integrations.lmcache_store",
            "class_name": "KVCodecStoreL2Adapter",
            "adapter_params": {"url": f"file://{tmp}/store"},
            "serde": {"type": "kvcodec", "quant": "exact", "device": device},
        }
        cfg = get_l2_adapter_config_class("plugin").from_dict(spec)
        cfg.serde_config = type(cfg)._parse_serde_config(spec)
        adapter = SerdeL2AdapterWrapper(
            inner=create_l2_adapter_from_registry(cfg),
            serde=create_serde_processor(cfg.serde_config),
            l1_manager=l1.manager,
        )
        try:
            return l2_store_then_load(l1, adapter, x)
        finally:
            adapter.close()


def wait(poll, timeout: float = 120.0):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        result = poll()
        if result is not None:
            return result
        time.sleep(0.001)
    raise TimeoutError("LMCache task did not complete")


def l2_store_then_load(l1: L1, adapter, x: torch.Tensor) -> dict:
    key, _, layout = l1.kv_obj(x)
    src = l1.manager.reserve_read([key])[key][1]
    t0 = time.perf_counter()
    task = adapter.submit_store_task([key], [src])
    stored = wait(lambda: adapter.pop_completed_store_tasks().get(task)).is_successful()
    t_store = time.perf_counter() - t0
    l1.manager.finish_read([key])
    _, dst = l1.obj(layout)
    dst.tensor.zero_()
    t0 = time.perf_counter()
    load = adapter.submit_load_task([key], [dst])
    loaded = wait(lambda: adapter.query_load_result(load)).test(0)
    t_load = time.perf_counter() - t0
    bitwise = torch.equal(dst.tensor.view(torch.int16), x.view(torch.int16))
    return {"stored": stored, "loaded": bool(loaded), "exact_bitwise": bitwise, "store_s": t_store, "load_s": t_load}


# -- SGLang HiCache backend ---------------------------------------------------------------------
class HostPoolGeometry:
    """The attributes of SGLang's MHA host pool that a storage backend reads (the pool class
    itself imports sgl_kernel on CUDA, which is not carried)."""

    def __init__(self, layout: str, layers: int, page: int, heads: int, dim: int, dtype) -> None:
        self.layout, self.layer_num, self.page_size = layout, layers, page
        self.head_num, self.head_dim, self.dtype = heads, dim, dtype


def sglang_backend(url: str, kv: torch.Tensor, page: int, **extra):
    from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig
    from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory

    config = HiCacheStorageConfig(
        tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
        is_mla_model=False, enable_storage_metrics=False, is_page_first_layout=False,
        model_name="HuggingFaceTB/SmolLM2-135M",
        extra_config={"backend_name": "kvcodec", "module_path": "kvcodec.integrations.sglang_hicache",
                      "class_name": "KVCodecHiCacheStorage", "url": url, **extra},
    )  # fmt: skip
    pool = HostPoolGeometry("layer_first", kv.shape[0], page, kv.shape[3], kv.shape[4], kv.dtype)
    backend = StorageBackendFactory.create_backend("dynamic", config, pool)
    backend.register_mem_pool_host(pool)
    return backend


def run_sglang(kv: torch.Tensor, device: str, page: int, reps: int) -> dict:
    from kvcodec.codecs import make_codec

    buf = kv.permute(1, 0, 2, 3, 4).contiguous()  # the MHA host pool's layer_first layout
    n = kv.shape[2] // page
    pages = [buf[:, :, i * page : (i + 1) * page].flatten() for i in range(n)]
    res: dict = {"page_size": page, "pages": n, "group_tokens": 256, "layout": "layer_first"}
    try:
        import sglang.srt.mem_cache.memory_pool_host  # noqa: F401

        res["memory_pool_host_import"] = "imports"
    except Exception as e:
        res["memory_pool_host_import"] = f"{type(e).__name__}: {e}"[:300]
    for quant in QUANTS:
        with tempfile.TemporaryDirectory() as tmp:
            b = sglang_backend(f"file://{tmp}/store", kv, page, quant=quant, group_tokens=256, device=device)
            keys = [f"{quant}{i:062x}" for i in range(1, n + 1)]
            t_set, ok = timed(lambda b=b, keys=keys: b.batch_set(keys, pages), 1)
            dummies = [torch.zeros_like(p) for p in pages]
            t_get, got = timed(lambda b=b, keys=keys, d=dummies: b.batch_get(keys, d), reps)
            r = {"batch_set_ok": ok, "batch_exists": b.batch_exists(keys), "batch_set_s": t_set, "batch_get_s": t_get}
            if quant == "exact":
                r["exact_bitwise"] = all(
                    torch.equal(g.view(torch.int16), p.view(torch.int16)) for g, p in zip(got, pages)
                )
            else:
                codec = make_codec("hevc", quant="int8", chunk_tokens=256, resolutions=((256, 256),))
                groups = [kv[:, :, s : s + 256] for s in range(0, kv.shape[2], 256)]
                want = torch.cat([codec.decode_chunk(codec.encode_chunks(g)[0].blobs[0],
                                  torch.empty(g.shape, dtype=g.dtype, device=device)).cpu() for g in groups], 2)  # fmt: skip
                wbuf = want.permute(1, 0, 2, 3, 4).contiguous()
                r["int8_eq_own_decode"] = all(
                    torch.equal(g, wbuf[:, :, i * page : (i + 1) * page].flatten()) for i, g in enumerate(got)
                )
            b.close()
            res[quant] = r
    return res


def run(args) -> None:
    data_dir = Path(args.data)
    manifest = json.loads((data_dir / "manifest.json").read_text())
    t0 = time.perf_counter()
    result = {"command": " ".join(sys.argv), "environment": environment(), "data": manifest}
    lm, originals = run_lmcache(data_dir, manifest, args.device, args.reps)
    result["lmcache"] = lm
    kv = torch.cat([o.reshape(2, o.shape[1], o.shape[2], -1, HEAD_DIM).permute(1, 0, 2, 3, 4) for o in originals], 2)
    try:
        result["sglang"] = run_sglang(kv.contiguous(), args.device, args.page, args.reps)
    except Exception as e:  # recorded, not hidden: the LMCache part stands on its own
        result["sglang"] = {"error": f"{type(e).__name__}: {e}"[:500]}
    result["wall_s"] = time.perf_counter() - t0
    Path(args.json).write_text(json.dumps(result, indent=1))
    print(json.dumps(result, indent=1))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="step", required=True)
    p = sub.add_parser("prepare")
    p.add_argument("--out", required=True)
    p.add_argument("--tokens", type=int, default=512)
    p.add_argument("--text", default="pg/gap")
    r = sub.add_parser("run")
    r.add_argument("--data", required=True)
    r.add_argument("--json", required=True)
    r.add_argument("--device", default="cuda")
    r.add_argument("--reps", type=int, default=10)
    r.add_argument("--page", type=int, default=64)
    args = parser.parse_args()
    prepare(args) if args.step == "prepare" else run(args)


if __name__ == "__main__":
    main()
