"""`kvcodec bench decode`: restoring KV from lossless HEVC on the GPU's NVDEC engines.

For every quantization mode and frame resolution of a data folder (.kvc containers made by
`--prepare` from a real KV cache), it measures

* restore: chunk blobs -> KV tensor on the GPU through the codec (`decode_chunk_blob`), per backend:
  one NVDEC session (`nvdec`), the NVDEC process pool (`nvdec-pool`), FFmpeg on the CPU
  (`ffmpeg-cpu`, one thread per chunk over all cores), and nvCOMP's SM-based decompressors on the
  same symbols / byte planes (`nvcomp-ANS`, `nvcomp-GDeflate`, restored by the same torch
  dequantization / byte-join the codec uses);
  GB/s of restored KV (fp16 bytes), tokens/s for the model's shape, Gbit/s of coded input;
* decode only: NVDEC frames without de-tiling, Gbit/s coded and GB/s of 8-bit samples;
* staging memory: peak GPU memory a restore needs beyond its output tensor, sampled with
  cudaMemGetInfo (so it includes the decoders' own surfaces), for several prefix lengths;
* interference: throughput of a bf16 matmul alone and while each backend restores flat out.

The chunk blobs of a container are replicated `--copies` times so that every backend has enough
independent streams to fill all engines; every copy is a real, separately decoded stream.
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from pathlib import Path

import click

from kvbench.busy import beside_matmul, matmul_tflops
from kvbench.results import command_line, result_path, write_json, write_result

DEFAULT_MODES = "exact,int8,int4,int2"
DEFAULT_RESOLUTIONS = "256x256,512x512,1024x1024"
DEFAULT_BACKENDS = "nvdec,nvdec-pool,ffmpeg-cpu,nvcomp,nvdec-pyav"
NVCOMP_ALGORITHMS = ("ANS", "GDeflate")


def _mode(label: str) -> tuple[str, int | str]:
    """A mode label: a quant mode, optionally with "-vN" for N video bits (default: auto)."""
    from kvcodec.config import QUANT_MODES

    quant, _, bits = label.partition("-v")
    if quant not in QUANT_MODES or (bits and not (bits.isdigit() and 1 <= int(bits) <= 8)):
        raise click.BadParameter(
            f"{label!r}: a quant mode ({', '.join(QUANT_MODES)}), optionally -v1..-v8", param_hint="--modes"
        )
    return quant, int(bits) if bits else "auto"


def _res(s: str) -> tuple[int, int]:
    w, h = s.lower().split("x")
    return int(w), int(h)


# ------------------------------------------------------------------------------------ prepare


def prepare(kv_path: str, data_dir: str, modes: list[str], resolutions: list[tuple[int, int]], tokens: int) -> None:
    """Encode the first `tokens` tokens of a KV cache (safetensors, key "kv") into one .kvc per
    (mode, resolution) in data_dir, on the CPU with x265."""
    import kvcodec
    from kvcodec.config import CodecConfig
    from kvcodec.kvspec.files import load_plain_kv

    settings = {mode: _mode(mode) for mode in modes}  # every mode checked before the first file is written
    kv = load_plain_kv(kv_path)[0][:, :, :tokens].contiguous()
    out = Path(data_dir)
    out.mkdir(parents=True, exist_ok=True)
    meta = {"source": Path(kv_path).name, "shape": list(kv.shape), "dtype": str(kv.dtype), "files": {}}
    for mode, (quant, video_bits) in settings.items():
        for w, h in resolutions:
            t = time.time()
            data = kvcodec.encode(kv, CodecConfig(quant=quant, resolutions=((w, h),), video_bits=video_bits))
            name = f"{mode}_{w}x{h}.kvc"
            (out / name).write_bytes(data)
            ratio = 2 * kv.numel() / len(data)
            meta["files"][name] = {"bytes": len(data), "ratio_vs_fp16": ratio}
            click.echo(f"{name}: {len(data)} bytes, {ratio:.2f}x vs fp16, {time.time() - t:.1f}s")
    from safetensors.torch import save_file

    save_file({"kv": kv}, str(out / "kv.safetensors"))  # for the nvCOMP comparison on the same values
    (out / "meta.json").write_text(json.dumps(meta, indent=1))


# ------------------------------------------------------------------------------------ helpers


class _MemSampler:
    """Peak device memory in use (all processes) while active, via cudaMemGetInfo."""

    def __init__(self, device, period: float = 0.0005):
        import torch

        self.torch = torch
        self.device = device
        self.period = period
        self.min_free = None
        self._stop = threading.Event()

    def __enter__(self):
        self.min_free = self.torch.cuda.mem_get_info(self.device)[0]
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()
        return self

    def _run(self):
        while not self._stop.is_set():
            free = self.torch.cuda.mem_get_info(self.device)[0]
            self.min_free = min(self.min_free, free)
            time.sleep(self.period)

    def __exit__(self, *exc):
        self._stop.set()
        self._t.join()
        self.min_free = min(self.min_free, self.torch.cuda.mem_get_info(self.device)[0])


def _free_now(device) -> int:
    import torch

    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    return torch.cuda.mem_get_info(device)[0]


def _timed(fn, seconds: float, min_reps: int = 2) -> tuple[float, int]:
    """Run fn() (which synchronizes) repeatedly for about `seconds`; (seconds per call, calls)."""
    fn()  # warm-up: sessions, allocator, caches
    reps, t0 = 0, time.perf_counter()
    while reps < min_reps or time.perf_counter() - t0 < seconds:
        fn()
        reps += 1
    return (time.perf_counter() - t0) / reps, reps


class _Case:
    """One container: its chunk blobs at one resolution, replicated `copies` times."""

    def __init__(self, path: Path, copies: int):
        from kvcodec import codec
        from kvcodec.config import CodecConfig
        from kvcodec.container.format import CHUNK_MAGIC, read_object, split_streams
        from kvcodec.container.split import is_split, parse_split

        self.name = path.stem
        self.path = path
        self.data = path.read_bytes()
        fh, payload = codec.read_file_header(self.data)
        self.fh = fh
        self.config = CodecConfig.from_dict(fh.config)
        self.mode = path.stem.rsplit("_", 1)[0]  # the label it was prepared under (quant[-vN])
        self.resolution = fh.resolutions[0]
        blobs = []
        for index, _ in enumerate(fh.chunk_tokens):
            e = fh.blob(index, self.resolution)
            blobs.append(bytes(payload[e.offset : e.offset + e.length]))
        self.unique_blobs = blobs
        self.blobs = [blobs[i % len(blobs)] for i in range(max(copies, len(blobs)))]
        self.chunk_tokens = [fh.chunk_tokens[i % len(blobs)] for i in range(len(self.blobs))]
        # a split chunk (CodecConfig.streams_per_chunk > 1) holds several chunk blobs: its parts
        self.parts = [[bytes(p) for _, p in parse_split(b)[1]] if is_split(b) else [b] for b in self.blobs]
        self.streams_per_chunk = len(self.parts[0])
        self.headers = [codec.inspect_chunk_blob(p) for parts in self.parts for p in parts]
        self.video_bits = self.headers[0].video_bits
        self.videos = []
        for b, h in zip([p for parts in self.parts for p in parts], self.headers):
            _, pl = read_object(b, CHUNK_MAGIC, "chunk blob")
            self.videos.append(bytes(split_streams(pl, h.streams, "chunk")["video"]))
        L, _, _, H, D = fh.shape
        self.layers, self.heads, self.dim = L, H, D
        self.tokens = sum(self.chunk_tokens)
        self.fp16_bytes = 2 * L * 2 * self.tokens * H * D
        self.coded_bytes = sum(len(b) for b in self.blobs)
        self.video_bytes = sum(len(v) for v in self.videos)
        self.frames = sum(h.frames for h in self.headers)
        self.samples = self.frames * 3 * self.resolution[0] * self.resolution[1]
        self.dtype = codec.DTYPES[fh.dtype]

    def outputs(self, device):
        import torch

        out = torch.empty((self.layers, 2, self.tokens, self.heads, self.dim), dtype=self.dtype, device=device)
        views, start = [], 0
        for t in self.chunk_tokens:
            views.append(out[:, :, start : start + t])
            start += t
        return out, views

    def part_jobs(self, views) -> tuple[list, list]:
        """(blobs, targets) with every part of a split chunk a job of its own (what spreads one
        chunk over several engines)."""
        from kvcodec.codecs.hevc.decode import chunk_parts

        jobs = [job for blob, view in zip(self.blobs, views) for job in chunk_parts(blob, view)]
        return [b for b, _ in jobs], [t for _, t in jobs]

    def record(self, backend: str, seconds: float, **extra) -> dict:
        return {
            "kind": "restore",
            "backend": backend,
            "mode": self.mode,
            "resolution": f"{self.resolution[0]}x{self.resolution[1]}",
            "chunks": len(self.blobs),
            "tokens": self.tokens,
            "coded_gbit_per_s": self.coded_bytes * 8 / seconds / 1e9,
            "restored_gb_per_s": self.fp16_bytes / seconds / 1e9,
            "tokens_per_s": self.tokens / seconds,
            "samples_gb_per_s": self.samples / seconds / 1e9,
            "ratio_vs_fp16": self.fp16_bytes / self.coded_bytes,
            "video_bits": self.video_bits,
            "values_g_per_s": self.fp16_bytes / 2 / seconds / 1e9,
            "streams_per_chunk": self.streams_per_chunk,
            "gpus": 1,
            **extra,
        }


# ------------------------------------------------------------------------------------ backends


_THREADS: dict = {}
THREAD_SESSIONS = 7  # NVDEC engines of an H100/H200


def _nvcuvid_threads(device, warm_blob):
    """One NvcuvidThreads per device for the whole run (sessions warmed on a chunk of the data)."""
    from kvcodec.codecs.hevc.pool import open_threads

    key = str(device)
    if key not in _THREADS:
        _THREADS[key] = open_threads(THREAD_SESSIONS, warm_blob=warm_blob, device=device)
    return _THREADS[key]


def cuda_contexts(backend: str, pool_workers: int) -> int:
    """CUDA contexts a backend's restore runs in: the process's own (the output lives there),
    plus a pool's workers'."""
    return pool_workers + 1 if backend.startswith("nvdec-pool") else 1


def _restore_fn(backend: str, case: _Case, device, pool=None, cpu_threads: int = 16, restore: str = "auto"):
    """A zero-argument function restoring every blob of `case` into a KV tensor on `device`
    (`restore`: the codec's frame restorer, "auto" or "torch")."""
    import torch

    from kvcodec import codec

    out, views = case.outputs(device)
    if backend in ("nvdec", "nvdec-pyav"):  # one decoder, chunks in order
        if backend == "nvdec":
            from kvcodec.video.nvdec import NvdecDecoder as Decoder
        else:
            from kvcodec.video.nvdec_pyav import PyAVNvdecDecoder as Decoder
        dec = Decoder(device)

        def run():
            for blob, o in zip(case.blobs, views):
                codec.decode_chunk_blob(blob, device, out=o, decoder=dec, restore=restore)
            torch.cuda.synchronize(device)

        return run
    if backend in ("nvdec-pool", "nvdec-pool-consumer"):
        from kvcodec.codecs.hevc.pool import decode_blobs_parallel

        where = "workers" if backend == "nvdec-pool" else "consumer"
        blobs, targets = case.part_jobs(views)

        def run():
            decode_blobs_parallel(blobs, targets, pool, restore=restore, where=where)
            torch.cuda.synchronize(device)

        return run
    if backend == "nvcuvid-threads":  # in-process NVDEC sessions on threads, torch's own context
        from kvcodec.codecs.hevc.pool import restore_in_pool

        threads = _nvcuvid_threads(device, case.unique_blobs[0])
        blobs, targets = case.part_jobs(views)

        def run():
            restore_in_pool(threads, blobs, targets, restore=restore)
            torch.cuda.synchronize(device)

        return run
    if backend == "ffmpeg-cpu":
        from concurrent.futures import ThreadPoolExecutor

        from kvcodec.video.x265_cpu import FFmpegHevcDecoder

        ex = ThreadPoolExecutor(cpu_threads)

        def one(job):
            blob, o = job
            codec.decode_chunk_blob(blob, device, out=o, decoder=FFmpegHevcDecoder(threads=1), restore=restore)

        def run():
            list(ex.map(one, zip(case.blobs, views)))
            torch.cuda.synchronize(device)

        return run
    raise click.BadParameter(f"unknown backend {backend}")


def _decode_only(case: _Case, device, pool, seconds: float) -> list[dict]:
    """NVDEC frames without de-tiling: one session, and the pool."""
    import torch

    from kvcodec.video.nvdec import NvdecDecoder

    w, h = case.resolution
    recs = []
    dec = NvdecDecoder(device, latency="native")

    def single():
        for v in case.videos:
            for _ in dec.decode(v, w, h):
                pass
        torch.cuda.synchronize(device)

    runs = [("nvdec", single)]
    if pool is not None:

        def pooled():
            for _ in pool.decode_streams([(v, w, h) for v in case.videos]):
                pass
            torch.cuda.synchronize(device)

        runs.append(("nvdec-pool", pooled))
    for name, fn in runs:
        sec, _ = _timed(fn, seconds)
        recs.append(
            {
                "kind": "decode_only",
                "backend": name,
                "mode": case.mode,
                "resolution": f"{w}x{h}",
                "frames_per_s": case.frames / sec,
                "coded_gbit_per_s": case.video_bytes * 8 / sec / 1e9,
                "samples_gb_per_s": case.samples / sec / 1e9,
                "bits_per_sample": case.video_bytes * 8 / case.samples,
            }
        )
    return recs


def _import_nvcomp():
    """nvidia.nvcomp, also when another site directory holds a regular `nvidia` package."""
    try:
        from nvidia import nvcomp
    except ImportError:
        import nvidia

        for entry in sys.path:
            d = os.path.join(entry, "nvidia")
            if os.path.isdir(os.path.join(d, "nvcomp")) and d not in list(nvidia.__path__):
                nvidia.__path__.append(d)
        from nvidia import nvcomp
    return nvcomp


class _NvcompCase:
    """The same KV symbols the video carries (quantized integers, or exact mode's byte planes),
    compressed with nvCOMP per chunk and restored on the GPU by the codec's own torch ops."""

    def __init__(self, case: _Case, algorithm: str, device):
        import torch

        from kvcodec import codec
        from kvcodec.quant import exact as exact_q
        from kvcodec.quant import integer as int_q

        self.case, self.algorithm, self.device = case, algorithm, device
        nvcomp = _import_nvcomp()
        src = case.path.parent / "kv.safetensors"
        if src.exists():  # the original KV the containers were made from (written by --prepare)
            from kvcodec.kvspec.files import load_plain_kv

            kv = load_plain_kv(src)[0][:, :, : case.fh.tokens]
        else:  # exact: bit-exact; intN: the dequantized values (re-quantized below)
            kv = codec.decode(case.data, device).cpu()
        cfg = case.config
        self.nv = nvcomp
        try:
            self.codec = nvcomp.Codec(algorithm=algorithm, cuda_stream=torch.cuda.current_stream(device).cuda_stream)
        except TypeError:
            self.codec = nvcomp.Codec(algorithm=algorithm)
        self.chunks, self.comp, comp_bytes = [], [], 0
        for start in range(0, kv.shape[2], cfg.chunk_tokens):
            x = kv[:, :, start : start + cfg.chunk_tokens].contiguous()
            if cfg.is_exact:
                planes = exact_q.split_bytes(x)
                side = None
            else:
                bits = codec._bits(cfg, x.shape[0])
                offset, step = int_q.minmax_params(x, bits)
                planes = [int_q.quantize(x, offset, step, bits)]
                side = (offset.to(device), step.to(device))
                comp_bytes += 2 * offset.numel() * offset.element_size()
            flat = torch.cat([p.reshape(-1) for p in planes]).to(device)
            comp = self.codec.encode(nvcomp.as_array(flat))
            ct = torch.as_tensor(comp, device=device)
            comp_bytes += int(ct.numel() * ct.element_size())
            self.chunks.append((x.shape, len(planes), side))
            self.comp.append(comp)
        self.copies = len(case.blobs) // len(case.unique_blobs)
        self.comp_bytes = comp_bytes
        self.ratio = 2 * kv.numel() / comp_bytes
        torch.cuda.synchronize(device)

    def run_fn(self):
        import torch

        from kvcodec.quant import exact as exact_q
        from kvcodec.quant import integer as int_q

        case, device = self.case, self.device
        out, views = case.outputs(device)
        comps = self.comp * self.copies
        metas = self.chunks * self.copies

        batch = self.nv.as_arrays(comps)

        def run():
            decoded = self.codec.decode(batch)
            for i, ((shape, nplanes, side), o) in enumerate(zip(metas, views)):
                arr = decoded[i]
                raw = torch.as_tensor(arr, device=device).view(torch.uint8).reshape(nplanes, *shape)
                if side is None:
                    o.copy_(exact_q.join_bytes(list(raw.unbind(0)), case.dtype))
                else:
                    o.copy_(int_q.dequantize(raw[0], side[0], side[1], case.dtype))
            torch.cuda.synchronize(device)

        return run


def _interference(name: str, fn, device, seconds: float, alone: float) -> dict:  # noqa: ANN001
    rec = beside_matmul(fn, device, seconds, alone)
    return {
        "kind": "interference",
        "backend": name,
        **{k: v for k, v in rec.items() if k not in ("calls_during", "call_s_during")},
        "decoder_runs_during": rec["calls_during"],
    }


def _staging(case_paths: dict, device, pool, restore: str = "auto") -> list[dict]:
    """Peak GPU memory beyond the output KV for restores of different prefix lengths."""
    import torch

    import kvcodec
    from kvcodec.codecs.hevc.pool import decode_parallel
    from kvcodec.video.nvdec import NvdecDecoder

    recs = []
    for label, data in case_paths.items():
        fh, _ = kvcodec.codec.read_file_header(data)
        res = fh.resolutions[0]
        for backend in ("nvdec", "nvdec-pool") if pool is not None else ("nvdec",):
            out = torch.empty(fh.shape, dtype=kvcodec.codec.DTYPES[fh.dtype], device=device)
            out_bytes = out.numel() * out.element_size()
            free0 = _free_now(device) + out_bytes  # as if `out` were not allocated yet
            t = time.perf_counter()
            with _MemSampler(device) as m:
                if backend == "nvdec":
                    kvcodec.decode(data, device, out=out, decoder=NvdecDecoder(device), restore=restore)
                else:
                    decode_parallel(data, pool, out=out, restore=restore)
                torch.cuda.synchronize(device)
            sec = time.perf_counter() - t
            peak = free0 - m.min_free - out_bytes
            recs.append(
                {
                    "kind": "staging",
                    "backend": backend,
                    "prefix": label,
                    "tokens": fh.tokens,
                    "resolution": f"{res[0]}x{res[1]}",
                    "staging_peak_mb": peak / 2**20,
                    "output_mb": out_bytes / 2**20,
                    "restored_gb_per_s": 2 * out.numel() / sec / 1e9,
                    "note": "pool: beyond the pool's standing ring and worker contexts (see pool_fixed)",
                }
            )
            del out
    return recs


def _synthetic_containers(shape_lhd, tokens_list, res) -> dict:
    """KV-shaped Gaussian fp16 caches of several lengths, int8 at `res` (for staging only)."""
    import torch

    import kvcodec
    from kvcodec.config import CodecConfig

    L, H, D = shape_lhd
    out = {}
    g = torch.Generator().manual_seed(0)
    for t in tokens_list:
        kv = (torch.randn(L, 2, t, H, D, generator=g) * 0.5).to(torch.float16)
        out[f"{t}tok"] = kvcodec.encode(kv, CodecConfig(quant="int8", resolutions=(res,), search_layout=False))
    return out


# ------------------------------------------------------------------------------------ command


@click.command("decode")
@click.option("--data", "data_dir", type=click.Path(file_okay=False), required=True, help="Folder of .kvc containers.")
@click.option(
    "--prepare",
    "kv_path",
    type=click.Path(exists=True, dir_okay=False),
    default=None,
    help="Build --data from this KV safetensors file (key 'kv'), on the CPU, and exit.",
)
@click.option("--tokens", default=256, show_default=True, help="(--prepare) tokens of the KV to encode.")
@click.option(
    "--modes",
    default=DEFAULT_MODES,
    show_default=True,
    help="Quant modes, each optionally with -vN for N video bits (e.g. int8-v8: no bit split); "
    "files are <mode>_<W>x<H>.kvc in --data.",
)
@click.option("--resolutions", default=DEFAULT_RESOLUTIONS, show_default=True)
@click.option(
    "--backends",
    default=DEFAULT_BACKENDS,
    show_default=True,
    help="nvdec, nvdec-pool (restore in the workers), nvdec-pool-consumer (frames from the workers, "
    "restore in this process), nvcuvid-threads (7 NVDEC sessions on threads of this process, one "
    "CUDA context), ffmpeg-cpu, nvcomp (ANS and GDeflate), nvdec-pyav. Split chunks "
    "(streams_per_chunk > 1) run one job per part on the pool and the threads.",
)
@click.option(
    "--restore",
    "restore",
    default="auto",
    show_default=True,
    help="Frame restorers to measure, comma-separated: auto (the fused Triton kernel on CUDA "
    "for integer modes) and/or torch (the reference ops).",
)
@click.option("--detile", default=None, hidden=True, help="Old name of --restore (its values codec/cached mean auto).")
@click.option(
    "--scaling-workers",
    default="1,4,7,10",
    show_default=True,
    help="Pool sizes for the worker-scaling measurement ('' to skip).",
)
@click.option("--workers", default=7, show_default=True, help="NVDEC pool processes.")
@click.option("--copies", default=56, show_default=True, help="Chunk streams per measurement (replicated).")
@click.option("--seconds", default=1.0, show_default=True, help="Minimum time per measurement.")
@click.option("--interference/--no-interference", default=True, show_default=True)
@click.option("--interference-case", default="int8_1024x1024", show_default=True)
@click.option(
    "--interference-seconds",
    default=5.0,
    show_default=True,
    help="Matmul timing window, alone and during each backend.",
)
@click.option(
    "--staging-tokens",
    default="512,2048,8192",
    show_default=True,
    help="Prefix lengths of the synthetic int8 caches whose staging memory is measured ('' to skip).",
)
@click.option("--out", "out_path", default=None, help="JSON path (default benchmarks/results/decode-<gpu>.json).")
def command(
    data_dir,
    kv_path,
    tokens,
    modes,
    resolutions,
    backends,
    restore,
    detile,
    scaling_workers,
    workers,
    copies,
    seconds,
    interference,
    interference_case,
    interference_seconds,
    staging_tokens,
    out_path,
) -> None:
    """GPU-native decode: restored KV GB/s, tokens/s, coded Gbit/s, staging memory, interference."""
    modes_l = [m for m in modes.split(",") if m]
    res_l = [_res(r) for r in resolutions.split(",") if r]
    if kv_path:
        prepare(kv_path, data_dir, modes_l, res_l, tokens)
        return
    import torch

    if not torch.cuda.is_available():
        raise click.ClickException("bench decode needs a CUDA GPU")
    if detile:
        restore = ",".join(dict.fromkeys("auto" if d in ("codec", "cached") else d for d in detile.split(",") if d))
    run = DecodeRun(
        data_dir, [b for b in backends.split(",") if b], [r for r in restore.split(",") if r], seconds, out_path
    )
    try:
        if any(b.startswith("nvdec-pool") for b in run.backends):
            run.start_pool(workers, res_l)
        for mode in modes_l:
            run.restore_mode(mode, res_l, copies)
        if interference:
            run.interference(interference_case, interference_seconds)
        if scaling_workers and run.cases and "nvdec-pool" in run.backends:
            run.scaling([int(x) for x in scaling_workers.split(",")], interference_case)
        if staging_tokens:
            run.staging([int(t) for t in staging_tokens.split(",")], res_l)
    finally:
        if run.pool is not None:
            run.pool.close()
    write_result(run.out, run.result, _markdown(run.result))
    click.echo(f"wrote {run.out} and {run.out.with_suffix('.md')}")


class DecodeRun:
    """One `bench decode` run on the current CUDA device: the prepared containers as cases, an
    optional NVDEC pool, and the result whose records each step appends (and saves at once, so
    partial results survive an interrupted run)."""

    def __init__(self, data_dir: str, backends: list[str], restores: list[str], seconds: float, out_path) -> None:  # noqa: ANN001
        import torch

        self.data_dir, self.backends, self.restores, self.seconds = Path(data_dir), backends, restores, seconds
        self.device = torch.device("cuda", torch.cuda.current_device())
        self.gpu = torch.cuda.get_device_name(self.device)
        meta_path = self.data_dir / "meta.json"
        meta = json.loads(meta_path.read_text()) if meta_path.exists() else {}
        self.result = {
            "command": command_line("decode"),
            "gpu": self.gpu,
            "cpu_cores": os.cpu_count(),
            "data": meta,
            "records": [],
        }
        self.out = result_path(out_path, f"decode-{self.gpu.replace(' ', '-').lower()}")
        self.pool = None
        self.cases: dict[str, _Case] = {}
        self.nvc_cases: dict[str, _NvcompCase] = {}

    def log(self, rec: dict) -> None:
        rec.setdefault("gpu", self.gpu)
        self.result["records"].append(rec)
        click.echo(json.dumps({k: (round(v, 3) if isinstance(v, float) else v) for k, v in rec.items()}))
        write_json(self.out, self.result)

    def start_pool(self, workers: int, res_l: list[tuple[int, int]]) -> None:
        from kvcodec.video.nvdec_pool import NvdecPool

        free0 = _free_now(self.device)
        t = time.perf_counter()
        self.pool = NvdecPool(workers=workers, device=self.device, max_frame=max(res_l, key=lambda r: r[0] * r[1]))
        fixed = free0 - _free_now(self.device)
        ring = workers * self.pool.slots * self.pool.slot_bytes
        self.log(
            {
                "kind": "pool_fixed",
                "workers": workers,
                "start_s": time.perf_counter() - t,
                "pool_fixed_mb": fixed / 2**20,
                "ring_mb": ring / 2**20,
                "worker_context_mb": (fixed - ring) / 2**20 / workers,
            }
        )

    def timed(self, fn) -> tuple[float, int, float]:  # noqa: ANN001
        """(seconds per call, calls, MB of GPU memory the calls took beyond what was free)."""
        free0 = _free_now(self.device)
        with _MemSampler(self.device) as m:
            sec, reps = _timed(fn, self.seconds)
        return sec, reps, (free0 - m.min_free) / 2**20

    def restore_mode(self, mode: str, res_l: list[tuple[int, int]], copies: int) -> None:
        """Every backend (and restore variant) on each prepared container of `mode`, then nvCOMP."""
        for w, h in res_l:
            path = self.data_dir / f"{mode}_{w}x{h}.kvc"
            if not path.exists():
                click.echo(f"skip {path.name}: missing", err=True)
                continue
            case = self.cases[path.stem] = _Case(path, copies)
            for backend in [b for b in self.backends if b != "nvcomp"]:
                for variant in self.restores if backend.startswith("nvdec") else self.restores[:1]:
                    try:
                        sec, reps, mem = self.timed(_restore_fn(backend, case, self.device, self.pool, restore=variant))
                        contexts = cuda_contexts(backend, getattr(self.pool, "workers", 0))
                        self.log(
                            case.record(
                                backend, sec, reps=reps, restore=variant, mem_growth_mb=mem, cuda_contexts=contexts
                            )
                        )
                    except Exception as e:
                        self.log(
                            {
                                "kind": "restore",
                                "backend": backend,
                                "mode": mode,
                                "resolution": f"{w}x{h}",
                                "restore": variant,
                                "error": repr(e)[:500],
                            }
                        )
            if {"nvdec", "nvdec-pool"} & set(self.backends):
                for rec in _decode_only(case, self.device, self.pool, self.seconds):
                    self.log(rec)
        mode_cases = [c for c in self.cases.values() if c.mode == mode]
        if "nvcomp" in self.backends and mode_cases:
            self.nvcomp(mode_cases[0])

    def nvcomp(self, case: _Case) -> None:
        for alg in NVCOMP_ALGORITHMS:
            try:
                nc = _NvcompCase(case, alg, self.device)
                sec, reps, mem = self.timed(nc.run_fn())
                rec = case.record(f"nvcomp-{alg}", sec, reps=reps, mem_growth_mb=mem)
                rec.update(
                    resolution="-",
                    coded_gbit_per_s=nc.comp_bytes * nc.copies * 8 / sec / 1e9,
                    ratio_vs_fp16=nc.ratio,
                    samples_gb_per_s=None,
                )
                self.log(rec)
                self.nvc_cases[f"nvcomp-{alg}-{case.mode}"] = nc
            except Exception as e:
                self.log({"kind": "restore", "backend": f"nvcomp-{alg}", "mode": case.mode, "error": repr(e)[:500]})

    def base_case(self, name: str | None) -> _Case:
        return self.cases.get(name) or next(iter(self.cases.values()))

    def interference_runs(self, base: _Case) -> list[tuple[str, str, object]]:
        """(backend, restore variant, maker of its restore function) for every backend measured."""
        device, pool, runs = self.device, self.pool, []
        for backend in self.backends:
            if backend == "nvcomp":
                for alg in NVCOMP_ALGORITHMS:
                    nc = self.nvc_cases.get(f"nvcomp-{alg}-{base.mode}")
                    if nc is not None:
                        runs.append((f"nvcomp-{alg}", "nvcomp", nc.run_fn()))
            elif backend.startswith("nvdec-pool") and pool is not None:
                for variant in self.restores:
                    runs.append(
                        (backend, variant, lambda b=backend, v=variant: _restore_fn(b, base, device, pool, restore=v))
                    )
                wv, hv = base.resolution
                streams = [(v, wv, hv) for v in base.videos]
                runs.append(
                    ("nvdec-pool-decode-only", "-", lambda s=streams: lambda: [None for _ in pool.decode_streams(s)])
                )
            elif backend == "nvdec":
                for variant in self.restores:
                    runs.append(
                        (backend, variant, lambda v=variant: _restore_fn("nvdec", base, device, pool, restore=v))
                    )
            elif backend != "nvdec-pyav":
                first = self.restores[0]
                runs.append((backend, first, lambda b=backend, v=first: _restore_fn(b, base, device, pool, restore=v)))
        return runs

    def interference(self, case_name: str | None, seconds: float) -> None:
        """A bf16 matmul's TFLOP/s alone and while each backend restores flat out."""
        alone = matmul_tflops(self.device, seconds)
        base = self.base_case(case_name)
        for name, variant, make in self.interference_runs(base):
            try:
                rec = _interference(name, make() if variant != "nvcomp" else make, self.device, seconds, alone)
            except Exception as e:
                rec = {"kind": "interference", "backend": name, "error": repr(e)[:500]}
            rec.update(mode=base.mode, resolution=f"{base.resolution[0]}x{base.resolution[1]}", restore=variant)
            self.log(rec)

    def scaling(self, worker_counts: list[int], case_name: str | None) -> None:
        """Decode-only and restore throughput of pools of each size."""
        from kvcodec.video.nvdec_pool import NvdecPool

        base = self.base_case(case_name)
        wv, hv = base.resolution
        streams = [(v, wv, hv) for v in base.videos]
        for nw in worker_counts:
            try:
                with NvdecPool(workers=nw, device=self.device, max_frame=(wv, hv)) as p2:
                    sec, _ = _timed(lambda p=p2: [None for _ in p.decode_streams(streams)], self.seconds)
                    rsec, _ = _timed(
                        _restore_fn("nvdec-pool", base, self.device, p2, restore=self.restores[0]), self.seconds
                    )
                self.log(
                    {
                        "kind": "scaling",
                        "workers": nw,
                        "mode": base.mode,
                        "resolution": f"{wv}x{hv}",
                        "decode_coded_gbit_per_s": base.video_bytes * 8 / sec / 1e9,
                        "decode_samples_gb_per_s": base.samples / sec / 1e9,
                        "restore_gb_per_s": base.fp16_bytes / rsec / 1e9,
                        "restore_coded_gbit_per_s": base.coded_bytes * 8 / rsec / 1e9,
                    }
                )
            except Exception as e:
                self.log({"kind": "scaling", "workers": nw, "error": repr(e)[:500]})

    def staging(self, tokens_list: list[int], res_l: list[tuple[int, int]]) -> None:
        """Staging memory of decoding prefixes of each length (synthetic containers)."""
        shape = next(iter(self.cases.values())) if self.cases else None
        lhd = (shape.layers, shape.heads, shape.dim) if shape else (30, 3, 64)
        synth = _synthetic_containers(lhd, tokens_list, max(res_l, key=lambda r: r[0] * r[1]))
        for variant in self.restores:
            for rec in _staging(synth, self.device, self.pool, restore=variant):
                rec["restore"] = variant
                self.log(rec)


def _f(v, nd=2) -> str:
    return "-" if v is None else (f"{v:.{nd}f}" if isinstance(v, float) else str(v))


def _restore(r: dict) -> str:
    return r.get("restore", r.get("detile", "-"))


def _restore_row(r: dict) -> list:
    return [
        r["mode"],
        r.get("video_bits", 8),
        r["resolution"],
        r["backend"],
        _restore(r),
        _f(r["restored_gb_per_s"]),
        _f(r.get("values_g_per_s")),
        _f(r["tokens_per_s"], 0),
        _f(r["coded_gbit_per_s"]),
        _f(r.get("samples_gb_per_s")),
        _f(r["ratio_vs_fp16"]),
    ]


def _decode_only_row(r: dict) -> list:
    speeds = [_f(r["frames_per_s"], 0), _f(r["coded_gbit_per_s"]), _f(r["samples_gb_per_s"])]
    return [r["mode"], r["resolution"], r["backend"], *speeds, _f(r["bits_per_sample"])]


def _interference_row(r: dict) -> list:
    return [
        r["backend"],
        _restore(r),
        f"{r['mode']} {r['resolution']}",
        _f(r["matmul_tflops_alone"], 0),
        _f(r["matmul_tflops_during"], 0),
        f"{100 * r['matmul_slowdown']:.1f}%",
    ]


def _scaling_row(r: dict) -> list:
    restore = r.get("restore_gb_per_s", r.get("restore_cached_gb_per_s"))
    return [
        r["workers"],
        f"{r['mode']} {r['resolution']}",
        _f(r["decode_coded_gbit_per_s"]),
        _f(r["decode_samples_gb_per_s"]),
        _f(restore),
    ]


# (record kind, section title, columns, row of a record): the tables of the markdown, in order
_TABLES = (
    (
        "restore",
        "Restore (chunk blobs -> KV on the GPU)",
        "mode | video bits | resolution | backend | restore | restored GB/s (fp16) | values G/s | tokens/s"
        " | coded Gbit/s | frame samples GB/s | ratio vs fp16",
        _restore_row,
    ),
    (
        "decode_only",
        "NVDEC decode only (no de-tiling)",
        "mode | resolution | backend | frames/s | coded Gbit/s | 8-bit samples GB/s | bits/sample",
        _decode_only_row,
    ),
    (
        "interference",
        "Interference: bf16 matmul 8192^3 while a backend restores flat out",
        "backend | restore | case | matmul TFLOP/s alone | during | slowdown",
        _interference_row,
    ),
    (
        "scaling",
        "NVDEC pool: worker processes",
        "workers | case | decode-only coded Gbit/s | decode-only samples GB/s | restore GB/s fp16",
        _scaling_row,
    ),
)


def _table(title: str, columns: str, rows: list[list]) -> list[str]:
    """A markdown section: its title and a table of `rows` under `columns` (names joined by ' | ')."""
    head = [f"## {title}", "", f"| {columns} |", "|" + "---|" * (columns.count("|") + 1)]
    return head + ["| " + " | ".join(map(str, row)) + " |" for row in rows]


def _markdown(result: dict) -> str:
    records = result["records"]
    lines = [f"# kvcodec bench decode on {result['gpu']}", "", f"`{result['command']}`"]
    for kind, title, columns, row in _TABLES:
        rows = [row(r) for r in records if r["kind"] == kind and "error" not in r]
        if rows:
            lines += ["", *_table(title, columns, rows)]
    st = [r for r in records if r["kind"] in ("staging", "pool_fixed")]
    if st:
        lines += ["", "## Staging memory", ""]
        lines += ["- " + ", ".join(f"{k}={_f(v)}" for k, v in r.items() if k != "kind") for r in st]
    errs = [r for r in records if "error" in r]
    if errs:
        lines += ["", "## Errors", ""] + [f"- {r.get('backend')} {r.get('mode')}: {r['error']}" for r in errs]
    return "\n".join(lines) + "\n"
