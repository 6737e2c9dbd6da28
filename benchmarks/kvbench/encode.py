"""`kvcodec bench encode`: how fast the store path encodes a KV cache, against the earlier default.

For a KV file (safetensors, tensor `kv`, e.g. from `kvcodec extract`), in one process:
  * "old default": the encode as it was before issue 24: x265 ultrafast with no tuning, chunks one
    at a time, the bit split and layout chosen by trial encodes in every new process;
  * "new, first of model": today's default with an empty plan cache (its trial encodes once);
  * "new default": today's default as a new process runs it (decisions read from the plan cache);
  * "staged chunks prepared one at a time": KV on a GPU quantized and packed on the calling thread
    chunk by chunk, as before the batches (the same bytes);
  * "chunks prepared on their threads": the same, but each chunk of KV on a GPU quantized and packed
    by its own chunk thread, as before the staged encode (the same bytes);
  * with --sweep, the x265 tuning alternatives at today's parallelism (bytes and speed of each).
The transform codec (--transform MODEL.kvt) is timed the same way: its earlier default (untuned x265,
chunks one at a time, the transform on the CPU, its bit allocation level solved on every encode, every
chunk HEVC) and now (its default coder: every chunk zstd), and now with every chunk HEVC and with HEVC and
zstd chunks in turn (the default until session 53).
Speeds are MB/s of the fp16 KV (2 bytes per value, whatever the file's dtype).
"""

from __future__ import annotations

import contextlib
import os
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import click

from kvbench.results import command_line, machine, result_path, write_result
from kvcodec.cli.options import check_device

SWEEP = ("", "info=0", "rd=1:info=0", "ctu=16:info=0", "ctu=16:rd=1:info=0")


def cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover
        return os.cpu_count() or 1


def gpu_name() -> str | None:
    import torch

    return torch.cuda.get_device_name(0) if torch.cuda.is_available() else None


@contextlib.contextmanager
def _setting(
    *, tuning: str | None = None, workers: int | None = None, plans: str = "cold", staged: str = "batches"
) -> Iterator[None]:
    """x265 tuning, encode workers, the plan cache ("cold": empty; "warm": as left by the
    previous run; "off": in memory only, emptied: every process pays the trials) and how GPU chunks
    are prepared (_staging) for one run."""
    from kvcodec.codecs.hevc import encode as hevc_encode
    from kvcodec.codecs.transform import codec as transform
    from kvcodec.layout import search
    from kvcodec.video import x265_cpu

    saved = (x265_cpu.default_tuning, hevc_encode.X265_TUNING, transform.X265_TUNING)
    saved_env = dict(os.environ)
    cold = tempfile.TemporaryDirectory(prefix="kvbench-plans-") if plans == "cold" else None
    try:
        if tuning is not None:
            x265_cpu.default_tuning = hevc_encode.X265_TUNING = transform.X265_TUNING = tuning
        if workers is not None:
            os.environ["KVCODEC_ENCODE_WORKERS"] = str(workers)
        search._cache.clear()
        search._bits_cache.clear()
        search._disk = None
        if plans == "off":
            os.environ["KVCODEC_PLAN_CACHE"] = "0"
        elif cold is not None:
            os.environ["KVCODEC_CACHE_DIR"] = cold.name
        with _staging(staged):
            yield
    finally:
        x265_cpu.default_tuning, hevc_encode.X265_TUNING, transform.X265_TUNING = saved
        os.environ.clear()
        os.environ.update(saved_env)
        if cold is not None:  # each run left a folder in /tmp
            cold.cleanup()


def _never(kv, workers) -> bool:  # noqa: ANN001
    return False


def _timed(encode: Callable[[], list], fp16_bytes: int) -> dict[str, Any]:
    t0, c0 = time.perf_counter(), time.process_time()
    chunks = encode()
    seconds, cpu = time.perf_counter() - t0, time.process_time() - c0
    size = sum(len(c.blobs[0]) for c in chunks)
    return {
        "seconds": round(seconds, 3),
        "cpu_seconds": round(cpu, 3),  # all threads of the process: the work, whatever the machine's load
        "bytes": size,
        "ratio_vs_fp16": round(fp16_bytes / size, 4),
        "encoded_mb_per_s": round(fp16_bytes / seconds / 1e6, 3),
    }


def _hevc_runs(kv, quant: str, repeat: int, sweep: bool) -> list[dict[str, Any]]:
    import kvcodec

    fp16 = kv.numel() * 2

    def encode(coder: str | None = None) -> list:
        codec = kvcodec.make_codec("hevc", quant=quant, **({"sample_coder": coder} if coder else {}))
        return codec.encode_chunks(kv)

    # before the sample coder was chosen per model, every chunk's samples were HEVC video
    plan = [("old default", dict(tuning="", workers=1, plans="off"), "hevc")]
    plan.append(("new, first of model", dict(plans="cold"), None))
    plan.append(("new, samples as HEVC video (sample_coder=hevc), first of model", dict(plans="cold"), "hevc"))
    if sweep:
        plan += [(f"tuning {t or '(none)'}, video", dict(tuning=t, plans="cold"), "hevc") for t in SWEEP]
    rows = []
    for name, kw, coder in plan:
        best = None
        for _ in range(repeat):
            with _setting(**kw):
                r = _timed(lambda coder=coder: encode(coder), fp16)
            best = r if best is None or r["seconds"] < best["seconds"] else best
        rows.append({"setting": name, "codec": f"hevc {quant}", "sample_coder": coder or "auto", **kw, **best})
    # a new process of a machine that has encoded this model before: decisions from the plan cache
    from kvcodec.layout import search

    staging = (
        ("new default", "batches", None),
        ("new, samples as HEVC video (sample_coder=hevc)", "batches", "hevc"),
        ("new, video, staged chunks prepared one at a time", "one", "hevc"),
        ("new, video, chunks prepared on their threads", "threads", "hevc"),
    )
    best: dict[str, dict[str, Any]] = {}
    with _setting(plans="cold"):
        encode(), encode("hevc")  # fill the (fresh) plan cache: the one-time trial encodes
        for _ in range(repeat):  # settings interleaved: a drift of the machine's speed hits each alike
            for name, staged, coder in staging:
                search._cache.clear()
                search._bits_cache.clear()
                search._disk = None  # read back from the file, as a new process would
                with _staging(staged):
                    r = _timed(lambda coder=coder: encode(coder), fp16)
                best[name] = r if name not in best or r["seconds"] < best[name]["seconds"] else best[name]
    rows += [
        {"setting": name, "codec": f"hevc {quant}", "sample_coder": coder or "auto", "plans": "warm", **best[name]}
        for name, _, coder in staging
    ]
    return rows


def _one_at_a_time(kv, chunk_tokens, workers) -> int:  # noqa: ANN001
    return 1


@contextlib.contextmanager
def _staging(staged: str) -> Iterator[None]:
    """Chunks of KV on a GPU prepared on the calling thread in batches ("batches", the default), one
    at a time there ("one": the staged encode before batches) or on the chunk threads ("threads")."""
    from kvcodec.codecs.hevc import encode as hevc_encode
    from kvcodec.codecs.transform import codec as transform

    saved = (hevc_encode.stage_on_caller, transform.stage_on_caller, hevc_encode.stage_batch, transform.stage_batch)
    if staged == "threads":
        hevc_encode.stage_on_caller = transform.stage_on_caller = _never
    elif staged == "one":
        hevc_encode.stage_batch = transform.stage_batch = _one_at_a_time
    try:
        yield
    finally:
        hevc_encode.stage_on_caller, transform.stage_on_caller, hevc_encode.stage_batch, transform.stage_batch = saved


def _transform_runs(kv, kvt: Path, repeat: int) -> list[dict[str, Any]]:
    import kvcodec
    from kvcodec.codecs.transform import codec as transform

    fp16 = kv.numel() * 2
    rows = []
    settings = (
        # before issue 24: untuned x265 (its own threads), chunks one at a time, the math on the CPU, every chunk HEVC
        ("transform, old default", dict(tuning="", workers=1), True, {"coder": "hevc"}),
        ("transform, new default", dict(), False, {}),
        ("transform, samples as HEVC video alone (coder=hevc)", dict(), False, {"coder": "hevc"}),
        (
            "transform, HEVC and zstd chunks in turn (coder=mixed, the default until session 53)",
            dict(),
            False,
            {"coder": "mixed"},
        ),
        ("transform, mixed, staged chunks prepared one at a time", dict(staged="one"), False, {"coder": "mixed"}),
        ("transform, mixed, chunks prepared on their threads", dict(staged="threads"), False, {"coder": "mixed"}),
    )
    for name, kw, on_cpu, options in settings:
        best = None
        for _ in range(repeat):
            with _setting(plans="cold", **kw):
                if on_cpu:  # the earlier encode solved the level of its bits per value every time
                    transform._WATER_LEVELS.clear()
                codec = kvcodec.make_codec("transform", transform=kvt, **options)
                r = _timed(lambda codec=codec, on_cpu=on_cpu: codec.encode_chunks(kv.cpu() if on_cpu else kv), fp16)
            best = r if best is None or r["seconds"] < best["seconds"] else best
        rows.append({"setting": name, "codec": "transform", "coder": codec.coder, **kw, **best})
    return rows


def _relative(rows: list[dict[str, Any]], base: dict[str, Any]) -> None:
    for r in rows:
        r["bytes_vs_base"] = round(r["bytes"] / base["bytes"] - 1, 5)
        r["speedup_vs_base"] = round(base["seconds"] / r["seconds"], 2)


def _markdown(doc: dict[str, Any]) -> list[str]:
    lines = [
        f"# Encode speed: {doc['kv_file']} {doc.get('kv_meta') or ''}",
        "",
        f"`{doc['command']}`",
        "",
        f"KV {doc['shape']} ({doc['fp16_mb']:.1f} MB as fp16) on {doc['kv_device']}, {doc['cores']} cores, "
        f"GPU: {doc['gpu'] or 'none'}, "
        f"CPU: {doc['machine']['cpu']}, load {doc['machine'].get('load_avg_1m', '?')}.",
        "",
        "| setting | codec | samples | s | CPU s | MB/s (fp16) | ratio vs fp16 | bytes vs base | speedup vs base |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in doc["rows"]:
        lines.append(
            f"| {r['setting']} | {r['codec']} | {r.get('sample_coder') or r.get('coder', 'hevc')} | {r['seconds']:.2f} | {r['cpu_seconds']:.1f} | {r['encoded_mb_per_s']:.2f} | "
            f"{r['ratio_vs_fp16']:.3f} | {r['bytes_vs_base']:+.2%} | {r['speedup_vs_base']:.1f}x |"
        )
    lines += [
        "",
        "Base: the first row of the same codec. 'old default' is the encode before issue 24 (x265 ultrafast "
        "untuned, chunks one at a time, trial encodes for the bit split and layout in every process); "
        "'new default' is a process on a machine whose plan cache knows the model; 'first of model' "
        "includes the one-time trial encodes; 'chunks prepared on their threads' is the new default as it "
        "was before the staged encode (each chunk thread also quantized and packed its chunk of GPU KV; "
        "now the calling thread does, in order, and the threads only run x265). CPU s: processor time of all the process's threads (the "
        "work done, less sensitive than wall time to other work on a shared machine).",
    ]
    return lines


@click.command("encode")
@click.argument("kv_file", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.option("--quant", default="int8", show_default=True, help="HEVC codec quantization.")
@click.option("--tokens", type=click.IntRange(min=1), help="Encode only the first N tokens.")
@click.option(
    "--transform",
    "kvt",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    help="Also time the transform codec with this MODEL.kvt.",
)
@click.option(
    "--repeat", type=click.IntRange(min=1), default=1, show_default=True, help="Runs per setting (fastest kept)."
)
@click.option("--sweep", is_flag=True, help="Also time each x265 tuning alternative.")
@click.option(
    "--device",
    default="cpu",
    show_default=True,
    callback=check_device,
    help="Where the KV is when encoding starts (cuda: as in serving).",
)
@click.option("--name", default=None, help="Result stem suffix (default: cpu or gpu).")
@click.option("--out", type=click.Path(dir_okay=False, path_type=Path), help="Result JSON path.")
def command(kv_file, quant, tokens, kvt, repeat, sweep, device, name, out) -> None:
    """Encode speed and size of KV_FILE (safetensors, tensor `kv`) now and with the earlier default."""
    from kvcodec.kvspec.files import load_plain_kv

    kv, _, recorded = load_plain_kv(kv_file)
    meta = {k: v for k, v in recorded.items() if k in ("model", "text", "tokens", "dtype")}  # `kvcodec extract`'s
    if tokens and tokens > kv.shape[2]:  # the result would record N tokens and time fewer
        raise click.BadParameter(
            f"{kv_file.name} holds {kv.shape[2]} tokens, fewer than {tokens}: give at most {kv.shape[2]}, or leave it out",
            param_hint="--tokens",
        )
    if tokens:
        kv = kv[:, :, :tokens].contiguous()
    if kvt:  # a damaged or foreign .kvt, or one of another KV shape, fails here, not after the HEVC runs
        import kvcodec

        codec = kvcodec.make_codec("transform", transform=kvt)
        cal = getattr(codec, "cal", None)
        if cal is None:
            raise click.BadParameter(
                f"{kvt} is a grouped .kvt; {kv_file.name} holds one KV tensor", param_hint="--transform"
            )
        cal.check_shape(tuple(kv.shape))
        from kvcodec.cli.transform_io import warn_if_other_model

        warn_if_other_model(codec, meta.get("model"), kv_file.name + "'s model")
    kv = kv.to(device)
    rows = _hevc_runs(kv, quant, repeat, sweep)
    _relative(rows, rows[0])
    if kvt:
        t_rows = _transform_runs(kv, kvt, repeat)
        _relative(t_rows, t_rows[0])
        rows += t_rows
    new = next(r for r in rows if r["setting"] == "new default")
    old = rows[0]
    doc = {
        "command": command_line("encode"),
        "kv_file": kv_file.name,
        "kv_meta": meta,
        "shape": list(kv.shape),
        "fp16_mb": kv.numel() * 2 / 1e6,
        "kv_device": str(kv.device),
        "codec": new["codec"],
        "ratio_vs_fp16": new["ratio_vs_fp16"],
        "encoded_mb_per_s": new["encoded_mb_per_s"],
        "speedup_vs_old_default": new["speedup_vs_base"],
        "bytes_vs_old_default": new["bytes_vs_base"],
        "old_default": {k: old[k] for k in ("seconds", "bytes", "ratio_vs_fp16", "encoded_mb_per_s")},
        "cores": cores(),
        "gpu": gpu_name(),
        "machine": machine(),
        "rows": rows,
    }
    stem = f"encode-{name or ('gpu' if doc['gpu'] else 'cpu')}"
    path = write_result(result_path(out, stem), doc, _markdown(doc))
    for line in _markdown(doc)[6:-2]:
        click.echo(line)
    click.echo(f"wrote {path}")
