"""`kvcodec bench ratio`: compressed size and accuracy cost of each quant mode on real KV caches.

For each (model, text): the prefix KV of `--tokens` tokens from a real forward pass; then
  * kvcodec in each quant mode (HEVC samples; every stored resolution; and the "auto" coder),
    and in each per-layer bit scheme of `--layer-bits-schemes` (CodecConfig.layer_bits),
  * zstd-3 / zstd-19 / lz4 on the fp16 bytes and on the SAME quantized integers kvcodec codes,
  * CacheGen-style (kvbench.baselines "cachegen"),
  * with --transform MODEL.kvt: the transform codec at each of --target-ratios (kvcodec-transform-<r>), its KV
    coded chunk by chunk as a store holds it,
  * the order-0 entropy of the quantized symbols per (layer, K/V, head, channel): the size a
    per-channel static entropy coder could reach,
  * accuracy: perplexity of the text's continuation and greedy-token agreement over
    `--greedy-tokens` tokens, prefix KV restored vs recomputed.
"""

from __future__ import annotations

import dataclasses
import math
import re
import time
from pathlib import Path
from typing import Any

import click

from kvbench.results import RESULTS_DIR, check_tag, command_line, machine, write_result
from kvbench.transform_options import transform_methods, transform_options
from kvcodec.config import QUANT_MODES

FP16 = 2
NOTE = (
    "sizes are bytes of the stored representation including side information; kvcodec rows give the "
    "smallest stored resolution. The models compute KV in fp32; what is coded is that KV cast to fp16, "
    "and ppl_delta / token_agreement compare the restored KV with the fp32 KV the model computed, so "
    "'exact' rows show the cost of fp16 storage alone."
)


def per_channel_entropy_bits(symbols) -> float:
    """Mean order-0 entropy in bits/value, with one histogram per (layer, K/V, head, channel).
    symbols: (layers, 2, tokens, heads, dim) integer tensor."""
    import torch

    L, _, T, H, D = symbols.shape
    rows = symbols.permute(0, 1, 3, 4, 2).reshape(-1, T).long()
    counts = torch.zeros(rows.shape[0], 256, dtype=torch.float64)
    counts.scatter_add_(1, rows, torch.ones_like(rows, dtype=torch.float64))
    p = counts / T
    ent = -(p * torch.where(p > 0, p.log2(), torch.zeros_like(p))).sum(1)
    return float(ent.mean())


_SCHEME_ITEM = re.compile(r"^(all|rest|first\d+|last\d+|\d+-\d+|\d+):([2-8])$")


def scheme_items(spec: str) -> list[tuple[str, int]]:
    """(selector, bits) per item of a layer-bits scheme such as "first8:4,rest:3"; raises
    click.BadParameter on anything that is not SEL:BITS (see parse_layer_bits_scheme)."""
    items = [i.strip().lower() for i in spec.split(",") if i.strip()]
    if not items:
        raise click.BadParameter(f"empty layer-bits scheme {spec!r}")
    bad = [i for i in items if not _SCHEME_ITEM.match(i)]
    if bad:
        raise click.BadParameter(f"scheme {spec!r}: items {bad} are not SEL:BITS with BITS in 2..8 (see --help)")
    return [(m.group(1), int(m.group(2))) for m in map(_SCHEME_ITEM.match, items)]


def parse_layer_bits_scheme(spec: str, n_layers: int) -> tuple[int, ...]:
    """Per-layer bit widths from a scheme such as "first8:4,rest:3".

    Items SEL:BITS are applied left to right, a later item overriding an earlier one, except
    `rest`, which sets only the layers no earlier item set. SEL is one of: firstN, lastN, A-B (layers
    A..B inclusive, 0-based), N (one layer), all, rest. Every layer must end up with a width in 2..8."""
    bits: list[int | None] = [None] * n_layers
    for sel, width in scheme_items(spec):
        if sel == "all":
            layers = list(range(n_layers))
        elif sel == "rest":
            layers = [i for i in range(n_layers) if bits[i] is None]
        elif sel.startswith("first"):
            layers = list(range(int(sel[5:])))
        elif sel.startswith("last"):
            layers = list(range(n_layers - int(sel[4:]), n_layers))
        elif "-" in sel:
            a, _, z = sel.partition("-")
            layers = list(range(int(a), int(z) + 1))
        else:
            layers = [int(sel)]
        if (not layers and sel != "rest") or any(not 0 <= i < n_layers for i in layers):
            raise click.BadParameter(f"{sel}:{width} in scheme {spec!r}: layers outside 0..{n_layers - 1}")
        for i in layers:
            bits[i] = width
    unset = [i for i, v in enumerate(bits) if v is None]
    if unset:
        raise click.BadParameter(f"scheme {spec!r} leaves layers {unset} without a bit width (add rest:BITS)")
    return tuple(int(v) for v in bits)


def quantized_symbols(kv, quant: str, chunk_tokens: int, layer_bits=()):
    """The integers kvcodec codes, per chunk (exact: the ordered byte planes), with side bytes.
    layer_bits: per-layer widths overriding quant's (as CodecConfig.layer_bits)."""
    import torch

    from kvcodec.quant import exact, integer

    pieces, side = [], 0
    for s in range(0, kv.shape[2], chunk_tokens):
        x = kv[:, :, s : s + chunk_tokens]
        if quant == "exact":
            pieces.append(torch.stack(exact.split_bytes(x)))  # (bytes, L, 2, T, H, D)
        else:
            if layer_bits:
                bits = torch.tensor(list(layer_bits), dtype=torch.int64)
            else:
                bits = torch.full((kv.shape[0],), int(quant[3:]))
            off, step = integer.minmax_params(x, bits)
            pieces.append(integer.quantize(x, off, step, bits).unsqueeze(0))
            side += off.numel() * off.element_size() * 2
    return torch.cat(pieces, dim=3), side


def _first_blob(data: bytes) -> memoryview:
    from kvcodec import codec

    fh, payload = codec.read_file_header(data)
    entry = fh.blobs[0]
    return payload[entry.offset : entry.offset + entry.length]


def _byte_coders():
    import lz4.frame
    import zstandard

    return {
        "zstd-3": lambda b: len(zstandard.ZstdCompressor(level=3).compress(b)),
        "zstd-19": lambda b: len(zstandard.ZstdCompressor(level=19).compress(b)),
        "lz4": lambda b: len(lz4.frame.compress(b)),
    }


@dataclasses.dataclass
class Prefix:
    """A real model's KV of a text's first tokens, and the tokens after it that accuracy is scored on."""

    model_name: str
    text_name: str
    model: Any
    kv32: Any  # the KV the model computed (fp32)
    kv: Any  # what is coded: that KV cast to fp16
    prefix_ids: Any
    continuation: Any  # 128 tokens: perplexity
    prompt: Any  # 16 tokens: greedy agreement


def load_prefix(model_name: str, text_name: str, tokens: int, log) -> Prefix:  # noqa: ANN001
    import torch

    from kvcodec.integrations.hf import extract_kv
    from kvcodec.models import load_model
    from kvcodec.models.texts import load_text

    model, tok = load_model(model_name)
    text = load_text(text_name)
    ids_all = tok(text, return_tensors="pt").input_ids[0]
    if ids_all.numel() < tokens + 160:
        raise click.ClickException(f"text {text_name} has only {ids_all.numel()} tokens; need {tokens + 160}")
    t0 = time.perf_counter()
    _, kv32 = extract_kv(model, tok, text, max_tokens=tokens)
    log(f"{model_name} / {text_name}: KV {tuple(kv32.shape)} in {time.perf_counter() - t0:.1f} s")
    return Prefix(
        model_name,
        text_name,
        model,
        kv32,
        kv32.to(torch.float16),
        ids_all[:tokens],
        ids_all[tokens : tokens + 128],
        ids_all[tokens : tokens + 16],
    )


class Records:
    """The records of one prefix: size and ratio vs fp16 of each (codec, quant), with extras."""

    def __init__(self, p: Prefix, log) -> None:  # noqa: ANN001
        self.fp16_bytes = p.kv.numel() * FP16
        self.base = {
            "model": p.model_name,
            "text": p.text_name,
            "prefix_tokens": p.kv.shape[2],
            "kv_shape": list(p.kv.shape),
        }
        self.log = log
        self.rows: list[dict] = []

    def add(self, codec: str, quant: str, nbytes: int, **extra) -> None:  # noqa: ANN003
        r = {
            **self.base,
            "codec": codec,
            "quant": quant,
            "bytes": int(nbytes),
            "ratio_vs_fp16": self.fp16_bytes / nbytes,
            "entropy_bits_per_value": None,
            "ppl_delta": None,
            "token_agreement": None,
            **extra,
        }
        self.rows.append(r)
        self.log(f"  {codec:>22} {quant:>6} {nbytes:>11,} B  {self.fp16_bytes / nbytes:5.2f}x")


def accuracy(p: Prefix, restored, greedy_tokens: int) -> dict:  # noqa: ANN001
    """Perplexity delta and greedy-token agreement of restored KV against the computed KV."""
    from kvbench import accuracy_metrics as acc

    ppl = acc.perplexity_delta(p.model, p.prefix_ids, restored.to(p.kv32.dtype), p.kv32, p.continuation)
    agree = acc.greedy_agreement(p.model, p.prefix_ids, restored.to(p.kv32.dtype), p.kv32, p.prompt, greedy_tokens)
    return {
        "ppl_reference": ppl.ppl_reference,
        "ppl_restored": ppl.ppl_restored,
        "ppl_delta": ppl.delta,
        "token_agreement": agree.agreement,
        "kv_error": acc.kv_error(restored.float(), p.kv.float()),
    }


def measure(
    model_name: str,
    text_name: str,
    tokens: int,
    quants,
    greedy_tokens: int,
    chunk_tokens: int,
    log,
    layer_bits_schemes=(),
    transforms=(),
    kvt: Path | None = None,
) -> list[dict]:
    from kvbench.baselines import get_codec

    p = load_prefix(model_name, text_name, tokens, log)
    out = Records(p, log)
    raw = p.kv.numpy().tobytes()
    for name, size in _byte_coders().items():
        out.add(name, "fp16", size(raw))
    # (label in the quant column, CodecConfig.quant, CodecConfig.layer_bits)
    modes = [(q, q, ()) for q in quants]
    for spec in layer_bits_schemes:
        lb = parse_layer_bits_scheme(spec, p.kv.shape[0])
        modes.append((f"layers {spec}", f"int{max(lb)}", lb))
    for label_quant, quant, layer_bits in modes:
        measure_quant(p, out, label_quant, quant, layer_bits, chunk_tokens, greedy_tokens)
    cachegen = get_codec("cachegen")
    data = cachegen.encode(p.kv)
    out.add("cachegen-style", "cachegen", len(data), **accuracy(p, cachegen.decode(data), greedy_tokens))
    for method in transforms:
        measure_transform(p, out, method, kvt, chunk_tokens, greedy_tokens)
    return out.rows


def measure_transform(p: Prefix, out: Records, method: str, kvt: Path, chunk_tokens: int, greedy_tokens: int) -> None:
    """A kvcodec-transform-<r> method: the KV coded by the .kvt's transform chunk by chunk, as a store holds it
    (every chunk's bytes counted), decoded, and its accuracy."""
    import torch

    from kvbench.methods import chunk_bytes, decode_chunks_into, encode_in_chunks, method_codec, transform_ratio
    from kvcodec.config import CodecConfig

    codec = method_codec(method, CodecConfig(chunk_tokens=chunk_tokens), transform=kvt)
    chunks, _ = encode_in_chunks(codec, p.kv)
    restored = torch.empty_like(p.kv)
    decode_chunks_into(codec, chunks, restored)
    scores = accuracy(p, restored, greedy_tokens)
    out.add("kvcodec-transform", method, chunk_bytes(chunks), target_ratio=transform_ratio(method), **scores)


def measure_quant(
    p: Prefix, out: Records, label_quant: str, quant: str, layer_bits, chunk_tokens: int, greedy_tokens: int
) -> None:  # noqa: ANN001
    """General-purpose coders on the same integers kvcodec codes, their entropy bound, and kvcodec
    itself (bit split, auto coder, every bit in the video); accuracy of the default."""
    import kvcodec

    quant_extra = {"layer_bits": list(layer_bits), "mean_bits": sum(layer_bits) / len(layer_bits)} if layer_bits else {}
    symbols, side = quantized_symbols(p.kv, quant, chunk_tokens, layer_bits)
    entropy = sum(per_channel_entropy_bits(s) for s in symbols)  # exact: sum over byte planes
    for name, size in _byte_coders().items():
        out.add(
            f"{name} (same integers)",
            label_quant,
            sum(size(s.numpy().tobytes()) for s in symbols) + side,
            entropy_bits_per_value=entropy,
            **quant_extra,
        )
    out.add(
        "entropy bound (per-channel order-0)",
        label_quant,
        math.ceil(entropy * p.kv.numel() / 8) + side,
        entropy_bits_per_value=entropy,
        **quant_extra,
    )
    variants = (
        ("kvcodec", "hevc", "auto"),
        ("kvcodec (auto coder)", "auto", "auto"),
        ("kvcodec (every bit in the video)", "hevc", 8),
    )
    for label, coder, video_bits in variants:
        config = kvcodec.CodecConfig(
            quant=quant, chunk_tokens=chunk_tokens, sample_coder=coder, video_bits=video_bits, layer_bits=layer_bits
        )
        t0 = time.perf_counter()
        data = kvcodec.encode(p.kv, config)
        enc_s = time.perf_counter() - t0
        info = kvcodec.inspect(data)
        best_name, best = min(info["resolutions"].items(), key=lambda kv_: kv_[1]["bytes"])
        extra = {
            **quant_extra,
            "entropy_bits_per_value": entropy,
            "resolution": best_name,
            "bytes_per_resolution": {k: v["bytes"] for k, v in info["resolutions"].items()},
            "streams": best["streams"],
            "layout": best["layout"],
            "encode_s_cpu": enc_s,
            "video_bits": kvcodec.codec.inspect_chunk_blob(_first_blob(data)).video_bits,
        }
        if label == "kvcodec":
            restored = kvcodec.decode(data, resolution=tuple(int(v) for v in best_name.split("x")))
            extra.update(accuracy(p, restored, greedy_tokens))
        out.add(label, label_quant, best["bytes"], **extra)


def markdown(records, doc: dict) -> list[str]:
    lines = [
        f"# kvcodec bench ratio ({doc['machine']['cpu']})",
        "",
        f"`{doc['command']}`",
        "",
        doc["note"],
        "",
        "| model | text | codec | quant | video bits | bytes | ratio vs fp16 | entropy bits/value | ppl delta (restored - recomputed, absolute) | token agreement |",
        "|---|---|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    fmt = lambda v, f: "" if v is None else format(v, f)  # noqa: E731
    for r in records:
        lines.append(
            f"| {r['model']} | {r['text']} | {r['codec']} | {r['quant']} | {r.get('video_bits') or ''} | {r['bytes']:,} | {r['ratio_vs_fp16']:.2f} "
            f"| {fmt(r['entropy_bits_per_value'], '.2f')} | {fmt(r['ppl_delta'], '+.4f')} | {fmt(r['token_agreement'], '.3f')} |"
        )
    return lines


@click.command("ratio")
@click.option("--models", default="smollm2-135m,qwen2.5-coder-0.5b", show_default=True)
@click.option("--texts", default="pg/addiction,pg/aord", show_default=True, help="Names from kvcodec.models.texts.")
@click.option("--tokens", type=click.IntRange(min=1), default=512, show_default=True, help="Prefix tokens per text.")
@click.option("--quants", default="exact,int8,int6,int4", show_default=True)
@click.option("--greedy-tokens", type=click.IntRange(min=1), default=64, show_default=True)
@click.option("--chunk-tokens", type=click.IntRange(min=1), default=256, show_default=True)
@click.option(
    "--layer-bits-schemes",
    default="",
    show_default=True,
    help="Per-layer bit schemes (CodecConfig.layer_bits) to measure besides --quants, separated by ';', "
    "e.g. 'first8:4,rest:3;all:3'. Items SEL:BITS left to right; SEL: firstN, lastN, A-B, N, all, "
    "rest (layers not yet set).",
)
@transform_options
@click.option(
    "--out",
    "out_dir",
    default=str(RESULTS_DIR),
    show_default="benchmarks/results",
    type=click.Path(file_okay=False, path_type=Path),
)
@click.option(
    "--tag",
    default="cpu",
    show_default=True,
    callback=check_tag,
    help="Suffix of the result files: ratio-<tag>.json/.md.",
)
@click.pass_context
def command(
    ctx,
    models,
    texts,
    tokens,
    quants,
    greedy_tokens,
    chunk_tokens,
    layer_bits_schemes,
    kvt,
    target_ratios,
    out_dir,
    tag,
):  # noqa: ANN001
    """Compression ratio vs fp16, zstd, lz4 and the entropy bound, with accuracy, on real KV (and the
    transform codec of a .kvt at --target-ratios, with --transform)."""
    schemes = [s.strip() for s in layer_bits_schemes.split(";") if s.strip()]
    for spec in schemes:  # syntax check before any model loads (layer counts are checked per model)
        scheme_items(spec)
    quant_list = [q.strip() for q in quants.split(",") if q.strip()]
    for q in quant_list:  # before any model loads, not after the whole measurement
        if q not in QUANT_MODES:
            raise click.BadParameter(f"{q!r} is not one of {', '.join(QUANT_MODES)}", param_hint="--quants")
    transforms = transform_methods(ctx, kvt, target_ratios, models.split(","))
    records = []
    for model_name in models.split(","):
        for text_name in texts.split(","):
            records += measure(
                model_name,
                text_name,
                tokens,
                quant_list,
                greedy_tokens,
                chunk_tokens,
                lambda m: click.echo(m, err=True),
                schemes,
                transforms,
                kvt,
            )
    doc = {
        "benchmark": "ratio",
        "command": command_line("ratio"),
        "machine": machine(),
        "note": NOTE,
        "records": records,
    }
    path = write_result(out_dir / f"ratio-{tag}.json", doc, markdown(records, doc))
    click.echo(f"wrote {path} and {path.with_suffix('.md')}")
