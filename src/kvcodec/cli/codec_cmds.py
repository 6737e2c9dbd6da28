"""`kvcodec encode | decode | inspect`: files on disk <-> kvcodec containers."""

from __future__ import annotations

import json
import time
from pathlib import Path

import click

from kvcodec.cli.options import (
    FiniteRange,
    check_distinct,
    check_output_path,
    device_option,
    parse_layer_bits,
    parse_resolutions,
)
from kvcodec.config import QUANT_MODES, SAMPLE_CODERS
from kvcodec.errors import FormatError, ShapeError

TRANSFORM_MAGICS = (b"KVTF", b"KVGF")  # transform files and grouped files: decoded with their .kvt


def _load_kv(src: Path):  # noqa: ANN202
    """The tensor named `kv` of a safetensors file; a clear error for anything else."""
    from kvcodec.errors import ConfigError
    from kvcodec.kvspec.files import LAYOUT_GROUPED, no_kv_tensor, read_tensors

    try:
        tensors, meta = read_tensors(src)
    except ConfigError as e:  # the safetensors parser's own errors, for a damaged file
        raise click.BadParameter(str(e), param_hint="SRC") from None
    if "kv" in tensors:
        return tensors["kv"]
    if meta.get("layout") == LAYOUT_GROUPED:
        raise ShapeError(
            f"{src} holds the KV of several layer groups (a sliding-window or MLA model); an HEVC file holds one KV "
            "tensor: encode it with --transform MODEL.kvt (kvcodec calibrate --model), which writes a grouped file"
        )
    raise ShapeError(no_kv_tensor(src, tensors, meta))


@click.command("encode")
@click.argument("src", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.argument("dst", type=click.Path(dir_okay=False, path_type=Path), callback=check_output_path)
@click.option(
    "--quant",
    type=click.Choice(QUANT_MODES),
    default="int8",
    show_default=True,
    help="Quantization of an HEVC file (exact: bit for bit). Like --layer-bits, --video-bits, "
    "--streams-per-chunk and a second resolution, not with --transform.",
)
@click.option("--chunk-tokens", type=click.IntRange(min=1), default=256, show_default=True)
@click.option("--resolutions", help="Frame sizes, e.g. 256x256,512x512 (default: 512x512; --transform: 1024x1024).")
@click.option("--layer-bits", help="Comma-separated bit width per layer (integer modes).")
@click.option(
    "--sample-coder",
    type=click.Choice([*SAMPLE_CODERS, "mixed", "ans"]),
    default=None,
    help="How samples are coded: hevc (video for NVDEC), zstd (host cores), auto (an HEVC file's default: "
    "the smaller on the first chunk, decided once per model); with --transform zstd (default: every "
    "chunk, decoded on the host's threads), hevc (every chunk as video for NVDEC), mixed (every other "
    "chunk as video, the rest zstd) or ans (the integers rANS-coded for decoding on the GPU's SMs).",
)
@click.option(
    "--video-bits",
    type=click.Choice(["auto", *map(str, range(1, 9))]),
    default="auto",
    show_default=True,
    help="Top bits of each sample coded as video; the rest go to packed bit planes (8: all in the video).",
)
@click.option(
    "--transform",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    help="MODEL.kvt: transform-code the KV.",
)
@click.option(
    "--target-ratio",
    type=FiniteRange(min=1, min_open=True),
    help="With --transform: file size = fp16 size / R (within 10%).",
)
@click.option(
    "--target-quality",
    help="With --transform: the highest ratio whose held-out quality at calibration met this: top1=0.99 "
    "(top-1 agreement at least), ppl=0.5 (perplexity change at most, %), err=0.01 (KV-file calibrations).",
)
@click.option(
    "--streams-per-chunk",
    type=click.IntRange(1, 64),
    default=1,
    show_default=True,
    help="Code each chunk as N independent HEVC streams by layer range, so one chunk decodes on N NVDEC "
    "engines at once. 1 is the default because 2-7 restored and fetched slower on the H200 "
    "(benchmarks/results/decode-h200-split-streams.md).",
)
def encode_cmd(
    src,
    dst,
    quant,
    chunk_tokens,
    resolutions,
    layer_bits,
    sample_coder,
    video_bits,
    transform,
    target_ratio,
    target_quality,
    streams_per_chunk,
):
    """Encode SRC.safetensors (a tensor named `kv`, shape layers x 2 x tokens x kv_heads x head_dim) into DST.kvc."""
    from tqdm import tqdm

    import kvcodec
    from kvcodec.atomic import write_atomic
    from kvcodec.codec import check_kv

    res = parse_resolutions(resolutions)  # options first: a typo fails before any work
    check_distinct(dst, "DST", SRC=src, **{"--transform": transform})
    # read back by its name, a coded file would pass for a KV file or a .kvt
    if dst.suffix.lower() in (".safetensors", ".kvt"):
        raise click.BadParameter(f"{dst}: a coded file is not {dst.suffix}; name it .kvc", param_hint="DST")
    if transform or target_ratio or target_quality:
        from kvcodec.cli import transform_io

        if not transform:
            raise click.BadParameter("--target-ratio / --target-quality need --transform", param_hint="--target-ratio")
        _refuse_hevc_options(res)
        return transform_io.encode_cmd(
            src, dst, transform, target_ratio, chunk_tokens, sample_coder, res, target_quality=target_quality
        )
    if sample_coder in ("ans", "mixed"):
        raise click.BadParameter(
            f"{sample_coder} codes the transform's integers: give --transform", param_hint="--sample-coder"
        )
    bits = parse_layer_bits(layer_bits)
    kv = _load_kv(src)
    kw = dict(
        quant=quant,
        chunk_tokens=chunk_tokens,
        **({"sample_coder": sample_coder} if sample_coder else {}),
        video_bits=video_bits if video_bits == "auto" else int(video_bits),
        streams_per_chunk=streams_per_chunk,
    )
    if res:
        kw["resolutions"] = res
    if bits:
        kw["layer_bits"] = bits
    config = kvcodec.CodecConfig(**kw)
    check_kv(kv, config)
    chunks = -(-kv.shape[2] // chunk_tokens)
    t0 = time.perf_counter()
    with tqdm(total=chunks, unit="chunk", desc="encode", disable=None) as bar:
        data = kvcodec.encode(kv, config, on_chunk=lambda c: bar.update(1))
    elapsed = time.perf_counter() - t0
    write_atomic(dst, data)
    info = kvcodec.inspect(data)
    best = min(info["resolutions"].items(), key=lambda kv_: kv_[1]["bytes"])
    click.echo(
        f"{dst}: {len(data):,} bytes for {kv.shape[2]} tokens ({chunks} chunks x {len(config.resolutions)} resolutions) "
        f"in {elapsed:.1f} s; {info['fp16_bytes'] / len(data):.2f}x vs fp16 (one resolution, {best[0]}: "
        f"{best[1]['ratio_vs_fp16']:.2f}x)"
    )
    if len(info["resolutions"]) > 1 and all("samples" in r["streams"] for r in info["resolutions"].values()):
        click.echo(
            f"warning: the samples are zstd-coded, the same bytes at every frame size: the {len(info['resolutions'])} "
            "resolutions store them as many times for nothing (give one, or --sample-coder hevc for video)",
            err=True,
        )


def _refuse_hevc_options(resolutions) -> None:  # noqa: ANN001
    """encode --transform: the HEVC file's options given on the command line are refused, not ignored."""
    ctx = click.get_current_context()
    for name in ("quant", "layer_bits", "video_bits", "streams_per_chunk"):
        if ctx.get_parameter_source(name) is not click.core.ParameterSource.DEFAULT:
            flag = "--" + name.replace("_", "-")
            raise click.BadParameter("applies to HEVC files, not --transform", param_hint=flag)
    if resolutions and len(resolutions) > 1:
        raise click.BadParameter("a transform file stores one resolution", param_hint="--resolutions")


@click.command("decode")
@click.argument("src", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.argument("dst", type=click.Path(dir_okay=False, path_type=Path), callback=check_output_path)
@device_option()
@click.option(
    "--resolution", help="HEVC files: which stored resolution to decode, e.g. 512x512 (default: the largest)."
)
@click.option(
    "--nvdec-pool",
    "pool_workers",
    type=click.IntRange(min=0),
    default=0,
    show_default=True,
    help="CUDA, HEVC files: decode the chunks in parallel in this many NVDEC worker processes (0: one decoder here).",
)
@click.option(
    "--transform",
    type=click.Path(exists=True, dir_okay=False, path_type=Path),
    help="The MODEL.kvt SRC was encoded with (needed for a transform-coded SRC).",
)
def decode_cmd(src, dst, device, resolution, pool_workers, transform):
    """Decode SRC.kvc into DST.safetensors (one tensor named `kv`)."""
    import kvcodec
    from kvcodec.kvspec.files import save_kv_file

    res = parse_resolutions(resolution, "--resolution")
    if res and len(res) > 1:
        raise click.BadParameter(f"{resolution!r}: give one resolution", param_hint="--resolution")
    check_distinct(dst, "DST", SRC=src, **{"--transform": transform})
    if dst.suffix != ".safetensors":
        raise click.BadParameter(f"{dst}: the output name must end in .safetensors", param_hint="DST")
    data = src.read_bytes()
    if transform:
        from kvcodec.cli import transform_io

        for flag, given in (("--resolution", resolution), ("--nvdec-pool", pool_workers)):
            if given:
                raise click.BadParameter("applies to HEVC files, not --transform", param_hint=flag)
        return transform_io.decode_cmd(data, dst, transform, device)
    if bytes(data[:4]) in TRANSFORM_MAGICS:
        raise FormatError(
            f"{src} is transform-coded: decode it with --transform MODEL.kvt, the .kvt it was encoded with "
            f"(`kvcodec inspect {src}` shows that .kvt's sha256)"
        )
    if res and f"{res[0][0]}x{res[0][1]}" not in (stored := kvcodec.inspect(data)["resolutions"]):
        raise click.BadParameter(
            f"{resolution!r} is not stored; {src} holds {', '.join(stored)}", param_hint="--resolution"
        )
    if pool_workers > 0:
        if not device.startswith("cuda"):
            raise click.BadParameter("--nvdec-pool needs --device cuda", param_hint="--nvdec-pool")
        from kvcodec.codecs.hevc.pool import decode_parallel, open_pool

        with open_pool(workers=pool_workers, device=device) as pool:
            t0 = time.perf_counter()
            kv = decode_parallel(data, pool, resolution=res[0] if res else None)
            elapsed = time.perf_counter() - t0
    else:
        t0 = time.perf_counter()
        kv = kvcodec.decode(data, device=device, resolution=res[0] if res else None)
        elapsed = time.perf_counter() - t0
    save_kv_file(dst, kv.cpu(), {})  # written beside dst and renamed: a failed write leaves no partial dst
    click.echo(
        f"{dst}: kv {tuple(kv.shape)} {str(kv.dtype).removeprefix('torch.')} decoded on {device} in {elapsed:.2f} s"
    )


@click.command("inspect")
@click.argument("src", type=click.Path(exists=True, dir_okay=False, path_type=Path))
@click.option("--json", "as_json", is_flag=True, help="Print the summary as JSON (with every chunk's size).")
def inspect_cmd(src, as_json):
    """Show what a kvcodec file (or one chunk blob, as a store holds it) holds: format and version,
    codec, KV shape and dtype, tokens and chunks, sizes and ratio vs fp16, and what its format adds
    (an HEVC .kvc file's quantization, streams and layouts; a transform file's calibration and
    settings; a grouped file's groups). Every chunk is checksummed and checked against its place.
    A .kvt: its shape, layer groups and rotary settings, what it was fitted on and the quality it
    measured on held-out texts (the safe ratio). A KV file of extract or decode: its tensors and model."""
    from kvcodec.cli.inspect_tensors import describe_tensors, is_safetensors, tensors_lines
    from kvcodec.codecs.describe import describe

    data = src.read_bytes()
    tensors = is_safetensors(data)
    info = describe_tensors(src, data) if tensors else describe(data)
    if as_json:
        click.echo(json.dumps(info, indent=2))
    elif tensors:
        click.echo("\n".join(tensors_lines(src, info)))
    else:
        click.echo(f"file        {src} ({info['file_bytes']:,} bytes, {info['format']} v{info['version']})")
        click.echo(f"codec       {info['codec']}")
        click.echo("\n".join(_DETAILS[info["format"]](info)))


def _common_lines(info: dict, kv: str) -> list[str]:
    return [
        f"kv          {kv} {info['dtype']}, {info['tokens']} tokens in {info['chunks']} chunks",
        f"fp16 size   {info['fp16_bytes']:,} bytes; {info['ratio_vs_fp16']:.2f}x vs fp16 (the whole file)",
    ]


def _hevc_lines(info: dict) -> list[str]:
    cfg = info["config"]
    bits = f" layer bits {cfg['layer_bits']}" if cfg["layer_bits"] else ""
    lines = _common_lines(info, f"shape {tuple(info['shape'])}")
    lines[0] += f" of {cfg['chunk_tokens']}"
    coder = cfg["sample_coder"]
    coder = "the smaller of video and zstd (auto, chosen per model)" if coder == "auto" else coder
    lines.append(f"quant       {cfg['quant']}{bits}; samples coded with {coder}")
    for name, r in info["resolutions"].items():
        lines += _resolution_lines(name, r, info["chunks"])
    return lines


def _transform_lines(info: dict) -> list[str]:
    s = info["settings"]
    lines = _common_lines(info, f"shape {tuple(info['shape'])}")
    lines[0] += f" of {info['chunk_tokens']}"
    fine = f"last {s['fine_tokens']} tokens 2^{s['fine_bits']} finer" if s.get("fine_bits") else "no finer tail"
    sink = f"{s['sink_tokens']} sink tokens fp16, " if "sink_tokens" in s else ""
    thetas = info["chunk_theta"]
    level = f"theta {thetas[0]:.4g}" + (f"..{max(thetas):.4g}" if max(thetas) != thetas[0] else "")
    lines.append(f"calibration {info['kvt']} (sha256 of the .kvt it was coded with)")
    lines.append(
        f"transform   coder {info['coder']}, {level}, key weight {s['key_weight']:g}, {sink}{fine}, "
        f"recon {s['recon']}, frames {s['resolution'][0]}x{s['resolution'][1]}"
    )
    lines.append("streams     " + ", ".join(f"{k} {v:,}" for k, v in info["streams"].items()))
    return lines


def _grouped_lines(info: dict) -> list[str]:
    lines = _common_lines(info, f"{info['layers']} layers in {len(info['groups'])} groups,")
    lines[0] += f" of {info['chunk_tokens']}"
    for g in info["groups"]:
        lines.append(f"group       {g['name']}: layers {_spans(g['layers'])}, from position {g['start']}")
    for name, size in info["bytes_per_resolution"].items():
        lines.append(f"  {name:>9}  {size:>12,} bytes  {info['fp16_bytes'] / size:5.2f}x")
    return lines


def _chunk_lines(info: dict) -> list[str]:
    """A chunk blob: where it lies, its streams, and what its format adds (calibration, parts)."""
    shape = (
        f"{info['layers']} layers"
        if "kv_heads" not in info
        else f"{info['layers']}x{info['kv_heads']}x{info['head_dim']}"
    )
    start, end = info["start_token"], info["start_token"] + info["tokens"]
    key = f", key {info['key']}" if info.get("key") else ""
    lines = [
        f"chunk       {info['chunk_index']}: tokens {start}-{end - 1} ({info['tokens']}) of {shape} {info['dtype']}{key}",
        f"fp16 size   {info['fp16_bytes']:,} bytes; {info['ratio_vs_fp16']:.2f}x vs fp16",
    ]
    if "kvt" in info:
        lines.append(f"calibration {info['kvt']}; coder {info['coder']}, theta {info['theta']:.4g}")
    if info.get("pieces"):
        lines.append(
            f"video       {info['frames']} frames, each a stream of its own: "
            + ", ".join(f"{n:,}" for n in info["pieces"])
        )
    if "quant" in info:
        lines.append(f"quant       {info['quant']}")
    if "streams" in info:
        lines.append("streams     " + ", ".join(f"{k} {v:,}" for k, v in info["streams"].items()))
    for i, p in enumerate(info.get("parts", []) if len(info.get("parts", [])) != 1 else []):
        what = (
            f"{p['layers']} layers"
            if "layers" in p
            else f"{p['group']} positions {p['start']}-{p['start'] + p['tokens'] - 1}"
        )
        lines.append(f"  part {i}   {what}" + (f", {p['bytes']:,} bytes" if "bytes" in p else ""))
    return lines


def _spans(layers: list[int]) -> str:
    """0-3, 8, 10-11: runs of consecutive layers."""
    runs: list[list[int]] = []
    for n in layers:
        if runs and n == runs[-1][1] + 1:
            runs[-1][1] = n
        else:
            runs.append([n, n])
    return ", ".join(f"{a}-{b}" if b > a else str(a) for a, b in runs)


_DETAILS = {  # format name -> its own lines after the file and codec lines
    "kvcodec-file": _hevc_lines,
    "kvcodec-transform-file": _transform_lines,
    "kvcodec-grouped-file": _grouped_lines,
    **dict.fromkeys(
        (
            "kvcodec-chunk",
            "kvcodec-split-chunk",
            "kvcodec-transform-chunk",
            "kvcodec-transform-ans-chunk",
            "kvcodec-grouped-chunk",
            "kvcodec-raw-chunk",
        ),
        _chunk_lines,
    ),
}


def _layout_text(layout: dict, frames: int, video_bits: int) -> str:
    if not layout:
        return "plain (values stored as their own bytes)"
    return (
        f"{layout['orientation']} tiles {layout['tile_w']}x{layout['tile_h']}, {layout['tokens_per_frame']} "
        f"tokens/frame, {frames} frames/chunk, top {video_bits} bits in the video"
    )


def _resolution_lines(name: str, r: dict, chunks: int) -> list[str]:
    """One line per stored resolution, then one per part of a split chunk (its layer range)."""
    streams = ", ".join(f"{k} {v:,}" for k, v in r["streams"].items())
    plain = r.get("plain_chunks", 0)
    note = f"; {plain} of {chunks} chunks plain" if plain and r["layout"] else ""
    parts = r.get("parts", [])
    zstd = "samples" in r["streams"]  # the samples zstd-coded: no video, its frames never made
    where = (
        f"{len(parts)} streams per chunk" + ("" if zstd else f", {r['frames_per_chunk']} frames/chunk")
        if parts
        else _layout_text(r["layout"], r["frames_per_chunk"], r["video_bits"])
    )
    if zstd:
        where = "samples zstd-coded (no video)" if not parts else where + ", samples zstd-coded (no video)"
    lines = [f"  {name:>9}  {r['bytes']:>12,} bytes  {r['ratio_vs_fp16']:5.2f}x  {where}{note}  [{streams}]"]
    start = 0
    for i, p in enumerate(parts):
        end = start + p["layers"]
        layout = "" if zstd else ", " + _layout_text(p["layout"], p["frames"], p["video_bits"])
        lines.append(f"{'':15}part {i}: layers {start}-{end - 1}{layout}")
        start = end
    return lines


commands = [encode_cmd, decode_cmd, inspect_cmd]
