"""Each SM kernel of a transform restore, timed alone with CUDA events on one batch of stored
chunks: the gather (uint8 samples -> float16 q), cuBLAS's GEMM, the epilogue (scales, means, RoPE,
cast, store), and the whole TransformCodec.finish. With --sweep, the same over the kernels' tile
shapes, each checked against the reference kernels (restore + emit). For choosing the kernels'
constants and for A/B runs of kernel changes (run it under each tree's PYTHONPATH).

    python benchmarks/probes/restore_kernels.py --dir D --method kvcodec-transform-8 --chunks 32 \\
        --out $OUT/kernels.json [--sweep]

D: a `kvcodec bench ttft-engine prep` folder (its seed chunks, relocated to positions 0 .. chunks-1,
as the engine benchmark stores them). Needs a CUDA GPU with NVDEC and Triton.
"""

from __future__ import annotations

import inspect
import json
import pathlib
import platform
import statistics
import time

import click
import torch

from kvbench.ttft_engine import CHUNK, MANIFEST, relocate, run_codec, seed_at, seed_blobs
from kvcodec.restore import transform_kernels as tk
from kvcodec.restore import transform_triton as tt
from kvcodec.transform import quantize

GATHER_TILES = [(8, 256), (4, 256), (16, 256), (16, 128), (32, 64), (8, 512)]
EPILOGUE_TILES = [(32, 4), (32, 8), (64, 4), (64, 8), (16, 4)]


class Batch:
    """N staged chunks of one method, their outputs, plan and the epilogue's launch."""

    def __init__(self, d: pathlib.Path, method: str, chunks: int):
        if not (d / MANIFEST).is_file():
            raise click.ClickException(f"{d} is not a `kvcodec bench ttft-engine prep` folder (no {MANIFEST})")
        man = json.loads((d / MANIFEST).read_text())
        self.codec = run_codec(method, d, man)
        seeds = seed_blobs(method, d, man, self.codec)
        blobs = [relocate(seed_at(seeds, i), i, i * CHUNK, f"probe-{i}") for i in range(chunks)]
        L, H, D = man["shape"]
        self.shape = (L, H, D)
        self.outs = [torch.empty((L, 2, CHUNK, H, D), dtype=torch.float16, device="cuda") for _ in blobs]
        self.staged = [self.codec.stage(b, o) for b, o in zip(blobs, self.outs)]
        torch.cuda.synchronize()
        restorer = self.codec._restorer
        h0 = self.staged[0].h
        self.plan = restorer._batched_plan(h0, torch.device("cuda"))
        self.rope = restorer.rope_tables(torch.device("cuda"))
        self.chunks = [c.samples.contiguous() for c in self.staged]
        self.escapes = [c.escapes for c in self.staged]
        self.starts = [c.h["start_token"] for c in self.staged]
        sinks = [None if c.sink is None else c.sink.to("cuda", torch.float16) for c in self.staged]
        self.sinks = sinks
        self.meta = tt.meta_table(self.starts, self.outs, self.chunks, sinks).cuda()
        self.table = self.meta[2 * chunks : 3 * chunks]
        self.fp16_bytes = sum(o.numel() * 2 for o in self.outs)
        per = [quantize.token_scales(CHUNK, c.h["fine_tokens"], c.h["fine_bits"]) for c in self.staged]
        fine = any(c.h["fine_tokens"] for c in self.staged)
        self.token_scales = torch.stack(per).float().cuda() if fine else None  # as TransformRestorer.finish

    def gather(self) -> torch.Tensor:
        t, n = self.chunks[0].shape[1], len(self.chunks)
        if "aligned" in inspect.signature(tt.gather_centred).parameters:
            return tt.gather_centred(self.table, self.plan.gather, t, n, tt.gather_aligned(self.chunks))
        return tt.gather_centred(self.table, self.plan.gather, t, n)

    def launch(self, x: torch.Tensor) -> tt.Launch:
        end = max(self.starts) + CHUNK
        cos, sin = self.rope.covering(end) if self.rope is not None else (torch.zeros((1, 1), device="cuda"),) * 2
        return tt.Launch(
            x=x, cos=cos, sin=sin, token_scales=self.token_scales, meta=self.meta, tokens=CHUNK,
            out_strides=tuple(self.outs[0].stride()), heads=self.shape[1], out_dtype=torch.float16,
            sinks=any(s is not None for s in self.sinks), regular=tt.regular(CHUNK, self.outs),
        )  # fmt: skip

    def restored(self, fused: bool) -> list[torch.Tensor]:
        """The batch restored by TransformCodec.finish: by the fused kernels, or by the reference
        kernels (restore + emit) they replace."""
        saved = tt.FUSED
        tt.FUSED = fused
        try:
            for o in self.outs:
                o.fill_(float("nan"))
            self.codec.finish(self.staged, self.outs)
            return [o.clone() for o in self.outs]
        finally:
            tt.FUSED = saved


def timed_ms(fn, reps: int) -> float:  # noqa: ANN001
    """Median GPU ms of fn() over reps, each between two CUDA events (after two warm calls)."""
    fn(), fn()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def measure(batch: Batch, reps: int, check: bool) -> dict:
    """ms per batch and per GB of fp16 KV for each kernel, and whether the fused restore matches
    the reference kernels (q exactly; outputs within a float16 ulp)."""
    q = batch.gather()
    x = tk._half_gemm_of(batch.plan, q)
    run = batch.launch(x)
    ms = {
        "gather": timed_ms(batch.gather, reps),
        "gemm": timed_ms(lambda: tk._half_gemm_of(batch.plan, q), reps),
        "epilogue": timed_ms(lambda: tt._launch(batch.plan, run), reps),
        "finish": timed_ms(lambda: batch.codec.finish(batch.staged, batch.outs), reps),
    }
    gb = batch.fp16_bytes / 1e9
    rec = {"ms": {k: round(v, 4) for k, v in ms.items()}, "ms_per_gb": {k: round(v / gb, 4) for k, v in ms.items()}}
    rec["ms_per_gb"]["kernels"] = round((ms["gather"] + ms["gemm"] + ms["epilogue"]) / gb, 4)
    if check:
        rec.update(_check(batch))
    return rec


def _check(batch: Batch) -> dict:
    want, got = batch.restored(fused=False), batch.restored(fused=True)
    worst = max(_ulps(g, w) for g, w in zip(got, want))
    return {"max_error_ulps": worst, "ok": worst <= 1.0}


def sweep(batch: Batch, reps: int) -> list[dict]:
    rows = []
    saved = tt.GATHER_SLOTS, tt.GATHER_COLS, tt.BLOCK_N, tt.EPILOGUE_WARPS
    try:
        for slots, cols in GATHER_TILES:
            tt.GATHER_SLOTS, tt.GATHER_COLS = slots, cols
            rows.append({"gather_tile": [slots, cols], "gather_ms": round(timed_ms(batch.gather, reps), 4)})
        tt.GATHER_SLOTS, tt.GATHER_COLS = saved[:2]
        x = tk._half_gemm_of(batch.plan, batch.gather())
        for block_n, warps in EPILOGUE_TILES:
            tt.BLOCK_N, tt.EPILOGUE_WARPS = block_n, warps
            run = batch.launch(x)
            ms = timed_ms(lambda r=run: tt._launch(batch.plan, r), reps)
            rows.append({"epilogue_tile": [block_n, warps], "regular": run.regular, "epilogue_ms": round(ms, 4)})
            rows[-1].update(_check(batch))
    finally:
        tt.GATHER_SLOTS, tt.GATHER_COLS, tt.BLOCK_N, tt.EPILOGUE_WARPS = saved
    return rows


def _ulps(got: torch.Tensor, want: torch.Tensor) -> float:
    ulp = torch.finfo(torch.float16).eps * want.float().abs().clamp_min(2**-14)
    return round(float(((got.float() - want.float()).abs() / ulp).nan_to_num(float("inf")).max()), 3)


@click.command()
@click.option("--dir", "d", required=True, type=click.Path(exists=True, file_okay=False, path_type=pathlib.Path))
@click.option("--method", default="kvcodec-transform-8", show_default=True)
@click.option("--chunks", default=32, show_default=True, help="Chunks of 256 tokens in the batch.")
@click.option("--reps", default=20, show_default=True)
@click.option("--sweep", "do_sweep", is_flag=True, help="Also time the kernels' tile shapes.")
@click.option("--label", default="", help="A name for the tree measured (A/B runs).")
@click.option("--out", required=True, type=click.Path(dir_okay=False, path_type=pathlib.Path))
def main(d, method, chunks, reps, do_sweep, label, out) -> None:  # noqa: ANN001
    if not torch.cuda.is_available():
        raise click.ClickException("needs a CUDA GPU")
    batch = Batch(d, method, chunks)
    rec = {
        "probe": "restore-kernels",
        "label": label,
        "method": method,
        "codec_id": batch.codec.id,
        "chunks": chunks,
        "tokens": chunks * CHUNK,
        "fp16_mb": round(batch.fp16_bytes / 1e6, 1),
        "gpu": torch.cuda.get_device_name(),
        "python": platform.python_version(),
        "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "constants": {
            "gather_tile": [tt.GATHER_SLOTS, tt.GATHER_COLS],
            "epilogue_tile": [tt.BLOCK_N, getattr(tt, "EPILOGUE_WARPS", 4)],
        },
        "batch": measure(batch, reps, check=True),
    }
    if do_sweep:
        rec["sweep"] = sweep(batch, reps)
    out.write_text(json.dumps(rec, indent=1))
    click.echo(json.dumps(rec["batch"]))


if __name__ == "__main__":
    main()
