"""The GPU memory of CUDA fetches with PrefixCache's defaults: whether a fetch's output is freed as
soon as the caller drops it (no reference cycle keeps it until the garbage collector runs), the
peak the fetch allocates beyond its output (scratch: staged samples, the transform's products),
what torch's allocator keeps reserved after each fetch, and what the idle decoder sessions hold.
For A/B runs of the fetch path (run it under each tree's PYTHONPATH).

    python benchmarks/probes/fetch_memory.py --dir D --method kvcodec-transform-8 \\
        --tokens 8192,32768 --out $OUT/memory.json

D: a `kvcodec bench ttft-engine prep` folder (its seed chunks stored over the prefix, as the engine
benchmark stores them). Needs a CUDA GPU.
"""

from __future__ import annotations

import gc
import json
import pathlib
import platform
import time
import weakref

import click
import torch

from kvbench.ttft_engine import MANIFEST, build_store, fp16_token_bytes, run_codec, seed_blobs
from kvcodec.fetcher import PrefixCache
from kvcodec.store import open_store

MB = 2**20


def fetch_once(pc: PrefixCache, ids: list[int], out_mb: float) -> dict:
    """One fetch of `ids`: its peak beyond the output, and whether dropping it frees the output."""
    torch.cuda.synchronize()
    start = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    r = pc.fetch(ids, deadline_s=None)
    torch.cuda.synchronize()
    if r.tokens_restored != len(ids):
        raise click.ClickException(f"restored {r.tokens_restored} of {len(ids)} tokens: {r.error}")
    output = weakref.ref(r.kv)
    del r
    freed = output() is None
    gc.collect()
    return {
        "output_freed_without_gc": freed,
        "peak_beyond_output_mb": round((torch.cuda.max_memory_allocated() - start) / MB - out_mb, 1),
        "reserved_mb": round(torch.cuda.memory_reserved() / MB, 1),
    }


def idle_sessions_mb() -> dict:
    """The idle NVDEC sessions closed: how many, and the device memory that frees."""
    from kvcodec.codecs.hevc.decode import idle_decoders

    before = torch.cuda.mem_get_info()[0]
    sessions = idle_decoders.close_idle()
    torch.cuda.synchronize()
    return {"sessions": sessions, "sessions_mb": round((torch.cuda.mem_get_info()[0] - before) / MB, 1)}


def measure(d: pathlib.Path, man: dict, method: str, tokens: int, fetches: int) -> dict:
    shape = tuple(man["shape"])
    codec = run_codec(method, d, man)
    seeds = seed_blobs(method, d, man, codec)
    store, ids = open_store("memory://"), list(range(1000, 1000 + tokens))
    build_store(PrefixCache(store, "probe", codec, "cpu", policy="fixed:0"), ids, seeds, shape)
    pc = PrefixCache(store, "probe", codec, "cuda", policy="fixed:0")
    out_mb = tokens * fp16_token_bytes(shape) / MB
    gc.collect()
    torch.cuda.empty_cache()
    rec = {"method": method, "codec_id": codec.id, "tokens": tokens, "output_mb": round(out_mb, 1)}
    rec["fetches"] = [fetch_once(pc, ids, out_mb) for _ in range(fetches)]
    rec |= idle_sessions_mb()
    del pc, store
    gc.collect()
    torch.cuda.empty_cache()
    return rec


def _lengths(text: str) -> list[int]:
    try:
        lengths = [int(v) for v in text.split(",")]
    except ValueError:
        lengths = []
    if not lengths or min(lengths) < 1:
        raise click.BadParameter(f"{text!r}: positive token counts, comma-separated", param_hint="--tokens")
    return lengths


@click.command()
@click.option("--dir", "d", required=True, type=click.Path(exists=True, file_okay=False, path_type=pathlib.Path))
@click.option("--method", "methods", multiple=True, default=["kvcodec-transform-8"], show_default=True)
@click.option("--tokens", default="8192,32768", show_default=True, help="Prefix lengths, comma-separated.")
@click.option("--fetches", default=3, show_default=True, help="Fetches per prefix length.")
@click.option("--label", default="", help="A name for the tree measured (A/B runs).")
@click.option("--out", required=True, type=click.Path(dir_okay=False, path_type=pathlib.Path))
def main(d, methods, tokens, fetches, label, out) -> None:  # noqa: ANN001
    lengths = _lengths(tokens)
    if not torch.cuda.is_available():
        raise click.ClickException("needs a CUDA GPU")
    if not (d / MANIFEST).is_file():
        raise click.ClickException(f"{d} is not a `kvcodec bench ttft-engine prep` folder (no {MANIFEST})")
    man = json.loads((d / MANIFEST).read_text())
    runs = [measure(d, man, m, n, fetches) for m in methods for n in lengths]
    rec = {
        "probe": "fetch-memory",
        "label": label,
        "gpu": torch.cuda.get_device_name(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "runs": runs,
    }
    out.write_text(json.dumps(rec, indent=1))
    for r in runs:
        click.echo(json.dumps(r))


if __name__ == "__main__":
    main()
