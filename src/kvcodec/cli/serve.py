"""`kvcodec serve`: the OpenAI-compatible HTTP server (kvcodec.server) over an Engine, storing and
fetching prompt KV with any registered codec (kvcodec.codecs.registry)."""

from __future__ import annotations

import re
from collections.abc import Collection
from pathlib import Path
from typing import Any

import click

from kvcodec.cli.options import (
    FiniteRange,
    count_option,
    device_option,
    dtype_option,
    encode_in_option,
    parse_codec_options,
    parse_deadline,
    torch_dtype,
)


@click.command("serve")
@click.option(
    "--model",
    "model_name",
    default="smollm2-135m",
    show_default=True,
    help="Registered model name (kvcodec.models), local model directory or .gguf file.",
)
@dtype_option(help="Run the model in this dtype (default: its own; float32 weights run as float16 on CUDA).")
@click.option(
    "--store",
    "store_url",
    default=None,
    help="KV store URL (file://, memory://, redis://); default: a temporary file:// directory, deleted on exit "
    "(memory:// with --no-reuse --no-store).",
)
@click.option(
    "--codec",
    "codec_name",
    default=None,
    help="Registered codec of stored KV (hevc, raw, transform, ...; default hevc, or transform with --transform).",
)
@click.option(
    "--codec-option",
    "codec_options",
    multiple=True,
    callback=parse_codec_options,
    metavar="KEY=VALUE",
    help="An option of the codec (repeatable), e.g. quant=int4, sample_coder=zstd, resolutions=256x256.",
)
@click.option(
    "--transform",
    type=click.Path(dir_okay=False, path_type=Path),
    default=None,
    help="Store KV transform-coded with this calibration (.kvt from `kvcodec calibrate`): --codec transform.",
)
@click.option("--preset", type=click.Choice(["accurate", "compact"]), default=None, help="Transform codec size preset.")
@click.option(
    "--target-ratio",
    type=FiniteRange(min=1, min_open=True),
    default=None,
    help="Transform codec: size vs fp16 (> 1).",
)
@click.option(
    "--target-quality",
    default=None,
    help="Transform codec: the highest ratio whose held-out quality at calibration met this (top1=0.99, ppl=0.5).",
)
@click.option("--quant", default=None, help="HEVC codec quantization of stored KV (int8 by default, exact, int4, ...).")
@count_option("--chunk-tokens", help="Tokens per stored chunk [codec's: 256].")
@click.option("--policy", type=click.Choice(["fetch-aware", "blocking"]), default="fetch-aware", show_default=True)
@click.option("--max-batch", default=8, show_default=True, type=click.IntRange(min=1))
@click.option(
    "--prefill-chunk-tokens",
    default=2048,  # EngineConfig.prefill_chunk_tokens
    show_default=True,
    type=click.IntRange(min=1),
    help="Prompt tokens prefilled per engine step while other requests decode (a long prompt never stalls "
    "them); a prompt alone goes in one forward up to EngineConfig.max_prefill_tokens (65536).",
)
@click.option("--no-reuse", is_flag=True, help="Never fetch stored prefixes.")
@click.option("--no-store", is_flag=True, help="Never store prompt KV after prefill.")
@click.option(
    "--store-min-tokens", default=None, type=click.IntRange(min=0), help="Store prompts of at least this many tokens."
)
@count_option(
    "--store-encode-workers",
    help="Threads encoding stored prompts' chunks in all, below the engine's priority [the cores less a quarter].",
)
@encode_in_option(
    "--store-encode-in",
    help="Encode stored prompts in worker processes (the serving process only copies the KV to shared memory) "
    "or on threads of the serving process (also where the store is memory://).",
)
@count_option(
    "--store-encode-processes",
    help="Worker processes sharing the encode threads [the split that stores most 2k-token prompts].",
)
@click.option(
    "--fetch-deadline",
    default="auto",
    show_default=True,
    callback=parse_deadline,
    help="Seconds a fetch may take before the rest is recomputed; auto: the measured time to "
    "recompute the prefix; none: no deadline.",
)
@click.option(
    "--stall-timeout",
    default=60.0,
    show_default=True,
    type=FiniteRange(min=0, min_open=True),
    help="/health answers 503 after this many seconds without engine progress while work is pending.",
)
@device_option(default=None, help="cpu or cuda (default: cuda if available).")
@click.option("--host", default="127.0.0.1", show_default=True)
@click.option("--port", default=8000, show_default=True, type=click.IntRange(0, 65535))
@click.option(
    "--nvdec-pool",
    "nvdec_pool",
    default=0,
    show_default=True,
    type=click.IntRange(min=0),
    help="CUDA: restore fetched chunks in this many NVDEC worker processes (7 on an H100/H200). "
    "Keeps decoding off the serving process, whose request loop an in-process decoder slows "
    "(benchmarks/results/interference-h200-v2.md). 0 (default): decoder sessions on threads of this process, "
    "one per NVDEC engine (see --decode-workers).",
)
@click.option(
    "--nvdec-threads",
    "nvdec_threads",
    default=0,
    show_default=True,
    type=click.IntRange(min=0),
    help="CUDA: restore fetched chunks on this many NVDEC sessions in this process's own CUDA context "
    "(7 on an H100/H200; needs only the driver's libnvcuvid). Costs a concurrent matmul 3-5% where "
    "the pool costs 10-19% and 5 GB (benchmarks/results/decode-h200-nvcuvid*.md).",
)
@count_option(
    "--decode-workers",
    help="Decode threads of a fetch (default: the pool's or threads' size; without them one per NVDEC "
    "engine on CUDA, each thread its own NVDEC session in this process's CUDA context: 7 on an H100/H200; "
    "1 on the CPU). A transform fetch on CUDA drives that many NVDEC sessions from its restore thread "
    "instead (KVCODEC_DRIVEN=0: a thread per session) for its video chunks; zstd'd chunks (the transform's "
    "default coder) decompress on the host pool's threads (half the cores, at most 8).",
)
@click.option(
    "--sdpa-backends",
    default="flash,efficient,math",
    show_default=True,
    callback=lambda ctx, param, value: _sdpa_backends(value),
    help="Attention kernels the model may use (comma-separated: flash, efficient, math, cudnn; 'default': "
    "torch's own choice). cuDNN is left out because it plans anew for every new query/key length "
    "(H200: 0.67 s first suffix forward, +20-40 ms per new length; "
    "benchmarks/results/ttft-gpu-h200-latency.md).",
)
def command(
    model_name: str,
    dtype: str | None,
    store_url: str | None,
    codec_name: str | None,
    codec_options: dict[str, Any],
    transform: Path | None,
    preset: str | None,
    target_ratio: float | None,
    target_quality: str | None,
    quant: str | None,
    chunk_tokens: int | None,
    policy: str,
    max_batch: int,
    prefill_chunk_tokens: int,
    no_reuse: bool,
    no_store: bool,
    store_min_tokens: int | None,
    store_encode_workers: int | None,
    store_encode_in: str,
    store_encode_processes: int | None,
    fetch_deadline: float | str | None,
    stall_timeout: float,
    device: str | None,
    host: str,
    port: int,
    nvdec_pool: int,
    nvdec_threads: int,
    sdpa_backends: tuple[str, ...] | None,
    decode_workers: int | None,
) -> None:
    """Serve a model over an OpenAI-compatible API with remote KV prefix reuse.

    \b
    Exactness: --quant exact restores the prefix's KV bit for bit, so every answer is the one
    the model gives without reuse. The default (int8) and --transform are lossy: answers match
    almost always, but a temperature-0 answer whose top two tokens nearly tie can change after
    its prefix is restored (1 of 4 prompts in one test). Use --quant exact where that matters.
    """
    import shutil
    import tempfile

    from kvcodec.engine import Engine, StorePolicy
    from kvcodec.server import serve
    from kvcodec.server.run import sigterm_exits

    _check_port(host, port)  # before the model loads
    refusal = None if store_url is None else check_store(store_url, writes="skip" if no_store else "warn")
    if refusal is not None and no_reuse:
        raise click.BadParameter(
            "the store refuses writes and --no-reuse fetches nothing from it: nothing would use it",
            param_hint="--store",
        )
    if not (no_reuse and no_store):
        check_model(model_name)  # a model whose KV kvcodec cannot code fails here, from its config, in seconds
    flags = {
        "transform": transform,
        "preset": preset,
        "target_ratio": target_ratio,
        "target_quality": target_quality,
        "quant": quant,
    }
    flags["chunk_tokens"] = chunk_tokens
    name, options = codec_choice(codec_name, codec_options, flags)
    codec = build_codec(name, options, flags)  # a bad codec, option or .kvt is refused before pools or the model start
    if not (no_reuse and no_store):
        check_transform_fits_model(codec, model_name)
    with sigterm_exits():
        temp_store = pool = None
        try:  # SIGTERM from here on leaves as SystemExit, so the finally runs (server.run.sigterm_exits)
            if store_url is None:  # made once every check passed: a refused start leaves no empty directory behind
                temp_store = None if no_reuse and no_store else tempfile.mkdtemp(prefix="kvcodec-store-")
                store_url = "memory://" if temp_store is None else "file://" + temp_store
            pool = (
                _nvdec_pool(nvdec_pool, device)
                if not nvdec_threads
                else _nvdec_threads(nvdec_threads, nvdec_pool, device)
            )
            if pool is not None:
                codec = build_codec(name, {**options, "pool": pool})
            click.echo(
                f"kvcodec serve: model {model_name}, store {store_url}, policy {policy}, codec {codec.id}", err=True
            )
            engine = Engine(
                model_name,
                store_url=store_url,
                codec=codec,
                decode_workers=decode_workers or max(nvdec_pool, nvdec_threads) or None,
                reuse=not no_reuse,
                store_policy=StorePolicy(
                    enabled=not no_store and refusal is None,
                    min_tokens=store_min_tokens,
                    encode_workers=store_encode_workers,
                    encode_in=store_encode_in,
                    encode_processes=store_encode_processes,
                ),
                policy=policy,
                max_batch=max_batch,
                prefill_chunk_tokens=prefill_chunk_tokens,
                fetch_deadline_s=fetch_deadline,
                store_writable=refusal is None,  # dropping a damaged meta repairs: also with --no-store
                stall_s=stall_timeout,
                device=device,
                dtype=torch_dtype(dtype),
                sdpa_backends=sdpa_backends,
            )
            _check_codec_fits(codec, engine)
            serve(engine, model_name, host=host, port=port)  # closes the engine: its stores are written or dropped
        finally:
            if pool is not None:
                pool.close()
            if temp_store is not None:
                shutil.rmtree(temp_store, ignore_errors=True)


def _check_codec_fits(codec: Any, engine: Any) -> None:
    """Refuse at start a transform whose .kvt was calibrated for KV of another shape than the
    served model's (another model): every store would fail, and the server would never reuse."""
    cal = getattr(codec, "cal", None)
    if cal is None:
        return
    from kvcodec.engine.prefix import kv_dims
    from kvcodec.errors import KVCodecError

    layers, heads, dim = kv_dims(engine.model)
    try:
        cal.check_shape((layers, 2, 1, heads, dim))
    except KVCodecError as e:
        engine.close()
        raise click.UsageError(f"--transform does not fit the served model: {e}") from None


def check_transform_fits_model(codec: Any, model_name: str) -> None:
    """Before the model loads: refuse a transform whose .kvt was calibrated for KV of another shape
    than the model's config says (another model), instead of failing every store after each prefill.
    A .kvt of another model whose shape fits is warned of by the Engine (logged)."""
    cal = getattr(codec, "cal", None)
    if cal is None:
        return
    from kvcodec.errors import KVCodecError
    from kvcodec.models.check import inspect_model

    try:
        layers = inspect_model(model_name).spec.layers
    except KVCodecError:
        return  # check_model says what is wrong with the model
    shapes = {x.k_shape for x in layers}
    if len(shapes) != 1:
        return  # layer groups of several shapes: a grouped .kvt's codec checks each group
    ((heads, dim),) = shapes
    try:
        cal.check_shape((len(layers), 2, 1, heads, dim))
    except KVCodecError as e:
        raise click.UsageError(f"--transform does not fit {model_name}: {e}") from None


def check_model(model_name: str) -> None:
    from kvcodec.errors import KVCodecError
    from kvcodec.models.check import inspect_model

    try:
        inspect_model(model_name)
    except KVCodecError as e:
        raise click.BadParameter(str(e), param_hint="--model") from None


def codec_choice(name: str | None, options: dict[str, Any], flags: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """(registered codec name, its options): --codec-option values plus the shorthand flags that
    were given (--transform names the transform codec and its calibration file)."""
    options = dict(options)
    for key, value in flags.items():
        if value is None:
            continue
        if key in options:
            raise click.UsageError(f"{_flag(key)} and --codec-option {key}=... are alternatives: give one")
        options[key] = str(value) if isinstance(value, Path) else value
    if flags.get("transform") is not None and name not in (None, "transform"):
        raise click.UsageError(f"--transform stores KV with the transform codec; --codec {name} contradicts it")
    name = name or ("transform" if flags.get("transform") is not None else "hevc")
    if name not in _TRANSFORM_CODECS and (given := [_flag(k) for k in _TRANSFORM_ONLY if flags.get(k) is not None]):
        raise click.UsageError(
            f"{' / '.join(given)} size a transform codec: give --transform (a .kvt) or --codec transform-ans"
        )
    return name, options


_TRANSFORM_CODECS = ("transform", "transform-ans")  # the codecs the sizing flags below are for
_TRANSFORM_ONLY = ("preset", "target_ratio", "target_quality")


def _flag(key: str) -> str:
    return "--" + key.replace("_", "-")


def _blamed(error: Exception, options: dict[str, Any], flags: Collection[str]) -> str:
    """Where a codec's refusal came from: the one option its message names, as its flag (where the
    command has one: `flags`) and --codec-option; --codec where it names none or several."""
    said = str(error)
    named = [k for k in options if re.search(rf"\b{k}\b", said)]
    if len(named) != 1:  # none, or a message about several options: which one was wrong is not said
        return "--codec"
    (key,) = named
    return f"{_flag(key)} / --codec-option {key}" if key in flags else f"--codec-option {key}"


def build_codec(name: str, options: dict[str, Any], flags: Collection[str] = ()):  # noqa: ANN201 - a ChunkCodec
    """The registered codec `name` built from `options`; a one-line usage error when the name,
    an option or a file it reads (a .kvt) is wrong, naming the option's flag where it is one of `flags`."""
    from kvcodec.codecs import make_codec as make
    from kvcodec.errors import KVCodecError

    try:
        return make(name, **options)
    except TypeError as e:  # an option the codec's factory does not take
        given = ", ".join(sorted(options)) or "none"
        raise click.BadParameter(
            f"codec {name!r} refuses its options ({given}): {e}", param_hint=_blamed(e, options, flags)
        ) from None
    except KVCodecError as e:
        said = str(e) if str(e).startswith(f"codec {name!r}") else f"codec {name!r}: {e}"
        raise click.BadParameter(said, param_hint=_blamed(e, options, flags)) from None


def _check_port(host: str, port: int) -> None:
    """--host/--port: an address this machine can listen on now (a busy port failed only once the
    model had loaded). SO_REUSEADDR as the server binds: a port in TIME_WAIT is free."""
    import socket

    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
    except (OSError, UnicodeError) as e:
        raise click.BadParameter(f"{host!r}: {e}", param_hint="--host") from None
    with socket.socket(family, kind, proto) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(address)
        except OSError as e:
            raise click.BadParameter(
                f"cannot listen on {host}:{port}: {e.strerror or e}", param_hint="--port"
            ) from None


def check_store(url: str, reach: bool = True, writes: str = "skip") -> str | None:
    """--store, before the model loads: a known scheme, and (reach) a store that opens (its server
    answers) within the engine's own deadline; a StoreError is the command's `error:` line.
    writes: "skip"; "warn": why the store refused a probe write (None where it took it), after a
    warning; "require": that refusal is the command's error (nothing could be stored)."""
    from kvcodec.engine.prefix import STORE_OPEN_DEADLINE_S
    from kvcodec.store import open_store

    _check_store_scheme(url)
    if not reach:
        return None
    store = open_store(url, deadline_s=STORE_OPEN_DEADLINE_S)
    try:
        refusal = None if writes == "skip" else write_refusal(store, STORE_OPEN_DEADLINE_S)
    finally:
        if hasattr(store, "close"):
            store.close()
    if refusal is not None and writes == "require":
        raise click.BadParameter(f"the store refuses writes: {refusal}", param_hint="--store")
    if refusal is not None:
        click.echo(
            f"kvcodec serve: warning: the store refuses writes ({refusal}): storing is off; "
            "prefixes others stored are still fetched",
            err=True,
        )
    return refusal


def write_refusal(store, within_s: float) -> str | None:  # noqa: ANN001
    """Why `store` refused an empty probe object (store.probe_write); None where it took it, or
    did not answer within `within_s` seconds (said on stderr: a slow store is not a read-only one)."""
    import time

    from kvcodec.errors import StoreError, StoreTimeoutError
    from kvcodec.store import DeadlineStore

    try:
        DeadlineStore(store, time.monotonic() + within_s).probe_write()
    except StoreTimeoutError as e:
        click.echo(f"kvcodec: warning: the store did not answer a probe write ({e}); storing stays on", err=True)
        return None
    except StoreError as e:
        return str(e)
    except Exception as e:  # noqa: BLE001 - a plugin store's own failure: a refusal all the same
        return f"{type(e).__name__}: {e}"
    return None


def _check_store_scheme(url: str) -> None:
    from kvcodec.store import redact_url, store_schemes

    scheme = url.split("://", 1)[0].lower() if "://" in url else "file"
    if scheme not in store_schemes():
        raise click.BadParameter(
            f"{redact_url(url)!r}: unknown scheme {scheme!r}; known: {', '.join(store_schemes())}",
            param_hint="--store",
        )


def _sdpa_backends(value: str) -> tuple[str, ...] | None:
    """--sdpa-backends: "default" (torch's choice: None) or names from SDPA_BACKENDS."""
    from kvcodec.engine.config import SDPA_BACKENDS

    if value.strip().lower() == "default":
        return None
    names = tuple(n.strip().lower() for n in value.split(",") if n.strip())
    if not names or not set(names) <= set(SDPA_BACKENDS):
        raise click.BadParameter(f"{value!r}: expected 'default' or names from {', '.join(SDPA_BACKENDS)}")
    return names


def _require_cuda(device: str | None, option: str) -> None:
    import torch

    if not (device or ("cuda" if torch.cuda.is_available() else "cpu")).startswith("cuda"):
        raise click.BadParameter(f"{option} needs a CUDA device", param_hint=option)


def _nvdec_threads(sessions: int, pool_workers: int, device: str | None):  # noqa: ANN202
    """NVDEC sessions on threads of the serving process (one CUDA context)."""
    if pool_workers:
        raise click.UsageError("--nvdec-threads and --nvdec-pool are alternatives: give one")
    _require_cuda(device, "--nvdec-threads")
    from kvcodec.codecs.hevc.pool import open_threads

    threads = open_threads(sessions, device=device)
    click.echo(f"kvcodec serve: fetched chunks restored by {sessions} in-process NVDEC sessions", err=True)
    return threads


def _nvdec_pool(workers: int, device: str | None):  # noqa: ANN202
    """An NvdecPool restoring fetched chunks in `workers` NVDEC processes; None for 0."""
    if workers <= 0:
        return None
    _require_cuda(device, "--nvdec-pool")
    from kvcodec.codecs.hevc.pool import open_pool

    pool = open_pool(workers, device=device)
    click.echo(f"kvcodec serve: fetched chunks restored by {workers} NVDEC worker processes", err=True)
    return pool
