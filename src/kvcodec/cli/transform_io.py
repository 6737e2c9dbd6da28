"""`kvcodec encode/decode --transform MODEL.kvt`: the transform codec's side of those commands.
A KV file of several layer groups (sliding windows, MLA) is coded group by group with the grouped
.kvt's transforms into one grouped file (KVGF); a plain one into a transform file (KVTF)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import click

from kvcodec.models.local import kvt_of_another_model


def pick_ratio(transform: Path, target_ratio: float | None, target_quality: str | None) -> float | None:
    """--target-quality: the highest calibrated ratio that met it on the held-out texts; --target-ratio
    beyond the measured safe ratio: a warning on stderr."""
    from kvcodec.codecs.transform.codec import kvt_info
    from kvcodec.transform.quality import ratio_for, ratio_warning

    report = kvt_info(transform).get("quality")
    if target_quality is not None:
        if target_ratio is not None:
            raise click.BadParameter("give --target-ratio or --target-quality, not both", param_hint="--target-quality")
        ratio = ratio_for(report, target_quality)
        click.echo(f"--target-quality {target_quality}: ratio {ratio:g} (held-out, from {transform.name})", err=True)
        return ratio
    if target_ratio is not None and (warning := ratio_warning(report, target_ratio)):
        click.echo(warning, err=True)
    return target_ratio


RATIO_TOLERANCE = 0.10  # --target-ratio's promise: the file's size within 10% of fp16's / R


def encode_cmd(
    src: Path,
    dst: Path,
    transform: Path,
    target_ratio,
    chunk_tokens: int,
    coder: str | None,
    resolutions,
    target_quality=None,
) -> None:
    """coder: the samples' coder (None: the transform codec's default)."""
    from kvcodec.atomic import write_atomic
    from kvcodec.codecs.grouped import GroupedCodec
    from kvcodec.codecs.grouped_file import encode_grouped
    from kvcodec.codecs.transform.codec import CODERS, open_transform
    from kvcodec.codecs.transform.file import encode_file
    from kvcodec.errors import ShapeError
    from kvcodec.kvspec.files import load_kv_file
    from kvcodec.models.quality import fp16_bytes

    if coder not in (None, *CODERS, "ans"):
        raise click.BadParameter(
            f"with --transform the sample coder is {', '.join(CODERS)} or ans", param_hint="--sample-coder"
        )
    target_ratio = pick_ratio(transform, target_ratio, target_quality)
    kv, meta = load_kv_file(src)
    kw = dict(target_ratio=target_ratio, chunk_tokens=chunk_tokens, **({"coder": coder} if coder else {}))
    if resolutions:
        kw["resolutions"] = resolutions[:1]
    codec = _ans_codec(transform, **kw) if coder == "ans" else open_transform(transform, **kw)
    warn_if_other_model(codec, meta.get("model"), f"{src}'s model")
    t0 = time.perf_counter()
    if isinstance(codec, GroupedCodec) != hasattr(kv, "spec"):
        held = "a cache of layer groups" if hasattr(kv, "spec") else "one KV tensor"
        want = "a cache of layer groups" if isinstance(codec, GroupedCodec) else "one KV tensor"
        raise ShapeError(f"{src} holds {held}; {transform} is calibrated for {want}")
    data = encode_grouped(kv, codec) if isinstance(codec, GroupedCodec) else encode_file(kv, codec)
    write_atomic(dst, data)
    tokens = kv.stop if hasattr(kv, "spec") else kv.shape[2]
    ratio = fp16_bytes(kv) / len(data)
    click.echo(
        f"{dst}: {len(data):,} bytes for {tokens} tokens in {time.perf_counter() - t0:.1f} s; "
        f"{ratio:.2f}x vs fp16 (codec {codec.id})"
    )
    if target_ratio is not None and abs(ratio / target_ratio - 1) > RATIO_TOLERANCE:
        why = "short chunks and files carry more side information a token; the transform has a coarsest level"
        click.echo(
            f"warning: {ratio:.2f}x misses the {target_ratio:g}x asked by over {RATIO_TOLERANCE:.0%} ({why})", err=True
        )


def decode_cmd(data: bytes, dst: Path, transform: Path, device: str) -> None:
    from kvcodec.codecs.grouped import GroupedCodec
    from kvcodec.codecs.grouped_file import decode_grouped, inspect_grouped
    from kvcodec.codecs.transform.codec import open_transform
    from kvcodec.codecs.transform.file import decode_file
    from kvcodec.kvspec.files import save_kv_file

    codec = _ans_codec(transform) if _file_coder(data) == "ans" else open_transform(transform)
    t0 = time.perf_counter()
    if isinstance(codec, GroupedCodec):
        head = inspect_grouped(data)
        codec = open_transform(transform, chunk_tokens=head["chunk_tokens"])
        # the file names the codec with its size setting (which decoding does not need): accept it when it
        # is this transform's; every part's chunk header still names its own .kvt part, checked on decode
        if codec.inner.kvt_hash[:16] in head["codec"] and head["codec"].startswith("grouped-"):
            codec.id = head["codec"]
        kv = decode_grouped(data, codec, device).to(device="cpu")
        shape = ", ".join(g.name for g in kv.spec.groups)
    else:
        kv = decode_file(data, codec, device).cpu()
        shape = tuple(kv.shape)
    elapsed = time.perf_counter() - t0
    save_kv_file(dst, kv, {})
    click.echo(f"{dst}: kv {shape} decoded on {device} with the transform in {elapsed:.2f} s")


def _ans_codec(transform: Path, **kw):  # noqa: ANN202 - a TransformAnsCodec
    """The transform codec with rANS-coded samples (decoded on the GPU's SMs): --sample-coder ans."""
    from kvcodec.codecs.transform_ans import make_transform_ans_codec

    return make_transform_ans_codec(transform, **kw)


def _file_coder(data: bytes) -> str | None:
    """The sample coder a transform file (KVTF) says its chunks use; None for other files."""
    from kvcodec.codecs.transform.file import FILE_MAGIC, read_header

    if bytes(data[:4]) != FILE_MAGIC:
        return None
    return (read_header(data)[0].get("settings") or {}).get("coder")


def warn_if_other_model(codec: Any, model: str | None, what: str) -> None:
    """On stderr: the .kvt was calibrated on another model than `model` (named as the user named it:
    a registered name or a path). Its shape fits (that is checked apart), but its basis and its quality
    report are another model's: the ratio's accuracy can be far worse (a fine-tune of it is near)."""
    kvt_model = kvt_of_another_model(codec, model)
    if kvt_model is None:
        return
    click.echo(
        f"kvcodec: warning: the .kvt was calibrated on {kvt_model!r}, {what} is {model!r}: its quality report does "
        f"not apply (calibrate on {model!r} for one that does)",
        err=True,
    )
