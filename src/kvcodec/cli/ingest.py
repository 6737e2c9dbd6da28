"""`kvcodec ingest`: prefill a corpus with a model and store every document's prefix KV, so that
later requests beginning with a document restore its KV instead of computing it."""

from __future__ import annotations

import contextlib
import json
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Any

import click

from kvcodec.cli.options import (
    check_distinct,
    check_report_path,
    count_option,
    device_option,
    dtype_option,
    encode_in_option,
    parse_codec_options,
    torch_dtype,
)
from kvcodec.ingest.sources import JSON_LINES_SUFFIXES

LOG_PROGRESS_S = 10.0  # a progress line this often where stderr is a log, not a terminal


@click.command("ingest")
@click.argument("docs", type=click.Path(exists=True, path_type=Path))
@click.option("--model", "model_name", required=True, help="Registered model name, model directory or .gguf file.")
@click.option("--store", "store_url", required=True, help="Store URL (file:///path, redis://host:port, ...).")
@click.option("--codec", "codec_name", default=None, help="Registered codec of stored KV (default hevc).")
@click.option(
    "--codec-option",
    "codec_options",
    multiple=True,
    callback=parse_codec_options,
    metavar="KEY=VALUE",
    help="An option of the codec (repeatable), e.g. quant=int4.",
)
@click.option(
    "--transform", type=click.Path(exists=True, dir_okay=False, path_type=Path), help="MODEL.kvt: transform-code."
)
@click.option("--quant", default=None, help="HEVC codec quantization (int8 by default, exact, int4, ...).")
@count_option("--chunk-tokens", help="Tokens per stored chunk [256].")
@click.option("--template", default=None, help="Shared prompt template with {text} where each document goes.")
@click.option("--text-field", default="text", show_default=True, help="JSONL: the field holding the text.")
@click.option("--id-field", default="id", show_default=True, help="JSONL: the field naming the document.")
@count_option("--max-tokens", help="Leading tokens kept per document.")
@count_option("--store-workers", help="Documents encoded at once [enough that their chunks fill the cores].")
@encode_in_option(
    "--encode-in",
    help="Encode documents in worker processes (each takes a document's KV from shared memory) or on threads "
    "of this process.",
)
@click.option(
    "--report",
    type=click.Path(dir_okay=False, path_type=Path),
    callback=check_report_path,
    help="Write the summary (JSON) here.",
)
@click.option(
    "--ray",
    "ray_address",
    default=None,
    help="Run on a Ray cluster (ADDRESS or auto; the ray extra): prefill actors on its GPUs, encode tasks on "
    "its CPUs, all writing to the store (which every node must reach).",
)
@count_option("--prefill-actors", help="--ray: actors [one per GPU].")
@click.option(
    "--encode-cpus", type=click.IntRange(min=1), default=4, show_default=True, help="--ray: CPUs per encode task."
)
@device_option(default=None, help="cpu, cuda, cuda:1 ... (default: cuda if present)")
@dtype_option(
    help="Prefill in this dtype (default: as `kvcodec serve` runs the model on the device: its own dtype, float32 "
    "weights as float16 on CUDA). Stored keys name the dtype: a server finds the documents when it runs the model "
    "in the same dtype (e.g. --dtype float16 on a CPU for a CUDA server)."
)
def command(
    docs: Path,
    model_name: str,
    store_url: str,
    codec_name: str | None,
    codec_options: dict[str, Any],
    transform: Path | None,
    quant: str | None,
    chunk_tokens: int | None,
    template: str | None,
    text_field: str,
    id_field: str,
    max_tokens: int | None,
    store_workers: int | None,
    encode_in: str,
    report: Path | None,
    ray_address: str | None,
    prefill_actors: int | None,
    encode_cpus: int,
    device: str | None,
    dtype: str | None,
) -> None:
    """Prefill each document of DOCS with MODEL and store its KV in the store.

    DOCS: a folder of text files (.txt/.md), a .jsonl/.ndjson file (objects with a text field), or a file
    of prompts, one per line. Documents already stored are skipped (run the same command again to
    resume); a document that fails is reported and the others go on (exit code 1 if any failed).
    """
    from kvcodec.cli.serve import build_codec, check_transform_fits_model, codec_choice
    from kvcodec.errors import ConfigError
    from kvcodec.ingest import read_documents
    from kvcodec.ingest.run import IngestReport, StoreDownError
    from kvcodec.ingest.sources import check_template

    check_template(template)  # everything a run needs is checked first, in seconds, before the model loads
    check_distinct(report, "--report", DOCS=docs, **{"--transform": transform})
    _refuse_unused(click.get_current_context(), bool(ray_address), Path(docs))
    if ray_address:
        from kvcodec.ingest.distributed import import_ray

        import_ray()  # the ray extra installed
    flags = {"transform": transform, "quant": quant, "chunk_tokens": chunk_tokens}
    name, options = codec_choice(codec_name, codec_options, flags)
    codec = build_codec(name, options, flags)
    documents = list(read_documents(docs, template=template, text_field=text_field, id_field=id_field))
    if not documents:
        raise ConfigError(f"{docs} holds no documents")
    _check_model_and_store(model_name, store_url, here=not ray_address)
    if not ray_address:  # on a Ray cluster the nodes hold the model
        check_transform_fits_model(codec, model_name)
    click.echo(f"kvcodec ingest: {len(documents)} documents, model {model_name}, codec {codec.id}", err=True)
    bar, on_result, counts, results = _progress(len(documents))
    started, stopped_by = time.perf_counter(), {}
    try:
        with bar, _terminate_as_interrupt(stopped_by):
            if ray_address:
                from kvcodec.ingest.distributed import RayJob

                options = tuple(sorted(options.items()))
                job = RayJob(model_name, store_url, name, options, max_tokens, encode_cpus=encode_cpus, dtype=dtype)
                result = _on_ray(ray_address, documents, job, prefill_actors, on_result)
            else:
                where = {"store_workers": store_workers, "encode_in": encode_in}
                model_at = (model_name, device, dtype)
                result = _here(documents, model_at, store_url, codec, max_tokens, where, on_result)
    except (KeyboardInterrupt, StoreDownError) as e:
        done = f"{', '.join(f'{v} {k}' for k, v in counts.items())} of {len(documents)} documents"
        down = str(e) if isinstance(e, StoreDownError) else None
        click.echo(
            f"{down} ({done})" if down else f"interrupted after {done}; run the same command to resume", err=True
        )
        if report:  # the documents done so far (those in flight were finished and counted), errors included
            partial = IngestReport(tuple(results), time.perf_counter() - started).to_dict()
            partial.update(documents=len(documents), done=len(results), interrupted=not down, store_down=down)
            report.write_text(json.dumps(partial, indent=1) + "\n")
        code = 1 if isinstance(e, StoreDownError) else 128 + stopped_by.get("signal", signal.SIGINT)
        raise click.exceptions.Exit(code) from None
    summary = result.to_dict()
    click.echo(_summary_line(summary))
    if report:
        report.write_text(json.dumps(summary, indent=1) + "\n")
    if summary["failed"]:
        raise click.exceptions.Exit(1)


@contextlib.contextmanager
def _terminate_as_interrupt(stopped_by: dict):  # noqa: ANN202 - a context manager
    """SIGTERM (what timeout, batch schedulers and Kubernetes send) ends the run as Ctrl-C does: the
    documents in flight finish, the report is written, the exit code is 128 + the signal's number
    (put in stopped_by["signal"])."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def interrupt(signum: int, frame: Any) -> None:
        stopped_by["signal"] = signum
        raise KeyboardInterrupt

    before = signal.signal(signal.SIGTERM, interrupt)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, before)


# options of one way of running only: given with the other they would be ignored
_RAY_ONLY = ("prefill_actors", "encode_cpus")
_HERE_ONLY = ("device", "store_workers", "encode_in")


def _refuse_unused(ctx: click.Context, on_ray: bool, docs: Path) -> None:
    """A usage error for an option the run would ignore: --prefill-actors / --encode-cpus without --ray, --device /
    --store-workers / --encode-in with it (the actors pick their devices; encode tasks take --encode-cpus),
    --text-field / --id-field for DOCS that are not JSON Lines."""
    given = _given(ctx, _HERE_ONLY if on_ray else _RAY_ONLY)
    if given:
        raise click.UsageError(f"{given}: not used {'with' if on_ray else 'without'} --ray", ctx=ctx)
    given = _given(ctx, ("text_field", "id_field"))
    if given and (docs.is_dir() or docs.suffix.lower() not in JSON_LINES_SUFFIXES):
        raise click.UsageError(f"{given}: for DOCS of JSON Lines ({', '.join(JSON_LINES_SUFFIXES)}) only", ctx=ctx)


def _given(ctx: click.Context, names: tuple[str, ...]) -> str:
    """The options of `names` given on the command line (or by the environment), as flags; "" if none."""
    source = ctx.get_parameter_source
    flags = ["--" + n.replace("_", "-") for n in names if source(n) not in (click.core.ParameterSource.DEFAULT, None)]
    return ", ".join(flags)


def _check_model_and_store(model_name: str, store_url: str, here: bool) -> None:
    """Before the model loads: the model kvcodec can code and the store it can reach, where the job
    runs here; on a Ray cluster, whose nodes hold them, only what the names say."""
    from kvcodec.cli.serve import check_model, check_store

    if store_url.lower().startswith("memory:"):
        raise click.BadParameter(
            "a memory:// store ends with this process: give file:// or redis://", param_hint="--store"
        )
    if here:
        check_model(model_name)
    check_store(store_url, reach=here, writes="require")


def _progress(total: int):  # noqa: ANN202 - (tqdm bar, on_result callback, counts so far, results so far)
    """A progress bar on stderr: live on a terminal, a line every LOG_PROGRESS_S in a log."""
    from tqdm import tqdm

    counts = {"stored": 0, "skipped": 0, "failed": 0}
    results = []
    bar = tqdm(total=total, unit="doc", desc="ingest", mininterval=0.1 if sys.stderr.isatty() else LOG_PROGRESS_S)

    def on_result(r) -> None:  # noqa: ANN001
        results.append(r)
        counts[r.status] += 1
        if r.status == "failed":
            tqdm.write(f"failed: {r.id}: {r.error}", file=sys.stderr)
        bar.set_postfix(counts, refresh=False)
        bar.update(1)

    return bar, on_result, counts, results


def _here(documents, model_at, store_url, codec, max_tokens, where, on_result):  # noqa: ANN001, ANN202
    """The job on this machine: its GPU (or CPU) prefills, its cores encode. model_at: (model name,
    device or None, dtype name or None)."""
    from kvcodec.engine.config import EngineConfig
    from kvcodec.engine.prefix import open_prefix_cache
    from kvcodec.errors import ConfigError
    from kvcodec.ingest import ingest
    from kvcodec.ingest.run import load_for_ingest
    from kvcodec.kvspec.serving import layout_for
    from kvcodec.models import model_id

    model_name, device, dtype = model_at
    model, tokenizer, dev = load_for_ingest(model_name, device, torch_dtype(dtype))
    click.echo(f"prefilling on {dev} in {model.dtype}: stored under model id {model_id(model)}", err=True)
    if layout_for(model, dev) is not None:
        raise ConfigError(f"{model_name} keeps several KV layer groups; kvcodec ingest stores uniform caches only")
    store, cache = open_prefix_cache(EngineConfig(store_url=store_url, codec=codec), model, dev)
    try:
        return ingest(
            documents, model, tokenizer, cache, max_tokens=max_tokens, on_result=on_result, store_url=store_url, **where
        )
    finally:
        if hasattr(store, "close"):
            store.close()


def _on_ray(address: str, documents, job, actors, on_result):  # noqa: ANN001, ANN202
    """The job on a Ray cluster (connected here, left running)."""
    from kvcodec.ingest.distributed import import_ray, ingest_on_ray

    ray = import_ray()
    ray.init(address=address, ignore_reinit_error=True, log_to_driver=False)
    return ingest_on_ray(documents, job, actors=actors, on_result=on_result)


def _summary_line(s: dict[str, Any]) -> str:
    rate = f"{s['tokens_per_s']:,.0f} tokens/s" if s["tokens_per_s"] else "-"
    return (
        f"{s['documents']} documents: {s['stored']} stored, {s['skipped']} already stored, {s['failed']} failed; "
        f"{s['stored_tokens']:,} tokens in {s['chunks']} chunks in {s['seconds']:.1f} s ({rate}"
        + (f", {s['stored'] / s['seconds']:.1f} documents/s" if s["stored"] and s["seconds"] > 0 else "")
        + "; "
        f"prefill {s['prefill_s']:.1f} s, encode+write {s['store_s']:.1f} s"
        + (f"; {s['kv_mb_per_s']:,.1f} MB/s of KV" if s.get("kv_mb_per_s") else "")
        + (f", encoded in {s['encoded_in']}" if s.get("encoded_in") else "")
        + ")"
    )
