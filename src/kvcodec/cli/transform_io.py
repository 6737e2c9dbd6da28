"""`kvcodec encode/decode --transform MODEL.kvt`: the transform codec's side of those commands."""

from __future__ import annotations

import time
from pathlib import Path

import click


def encode_cmd(kv, dst: Path, transform: Path, target_ratio, chunk_tokens: int, coder: str, resolutions) -> None:
    from kvcodec.cli.codec_cmds import _atomic_write
    from kvcodec.codecs.transform import TransformCodec
    from kvcodec.codecs.transform_file import encode_file

    if coder not in ("hevc", "zstd"):
        raise click.BadParameter("with --transform the sample coder is hevc or zstd", param_hint="--sample-coder")
    kw = dict(target_ratio=target_ratio, chunk_tokens=chunk_tokens, coder=coder)
    if resolutions:
        kw["resolutions"] = resolutions[:1]
    codec = TransformCodec(transform, **kw)
    t0 = time.perf_counter()
    data = encode_file(kv, codec)
    _atomic_write(dst, data)
    click.echo(
        f"{dst}: {len(data):,} bytes for {kv.shape[2]} tokens in {time.perf_counter() - t0:.1f} s; "
        f"{kv.numel() * 2 / len(data):.2f}x vs fp16 (codec {codec.id})"
    )


def decode_cmd(data: bytes, dst: Path, transform: Path, device: str) -> None:
    from safetensors.torch import save_file

    from kvcodec.codecs.transform import TransformCodec
    from kvcodec.codecs.transform_file import decode_file

    t0 = time.perf_counter()
    kv = decode_file(data, TransformCodec(transform), device)
    elapsed = time.perf_counter() - t0
    save_file({"kv": kv.cpu().contiguous()}, str(dst))
    click.echo(f"{dst}: kv {tuple(kv.shape)} decoded on {device} with the transform in {elapsed:.2f} s")
