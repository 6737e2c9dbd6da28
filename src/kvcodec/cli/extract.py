"""`kvcodec extract`: run a real model over a text and save its KV cache as a safetensors file."""

from __future__ import annotations

import json
import time
from pathlib import Path

import click

from kvcodec.cli.options import check_output_path
from kvcodec.errors import ConfigError

_DTYPES = ("float16", "bfloat16", "float32")


def _read_text(spec: str) -> tuple[str, str]:
    """(text, label): a file path if one exists, else a kvcodec.models.texts name."""
    from kvcodec.models.texts import TEXT_KINDS, load_text, read_text_file

    path = Path(spec)
    if path.is_file():
        return read_text_file(path), path.name
    if spec.startswith(TEXT_KINDS):
        return load_text(spec), spec
    raise ConfigError(
        f"--text {spec!r} is neither a file nor a text name ('pg', 'pg/<essay>', 'py/<module>', 'doc/<module>', "
        "'dlg/<n>')"
    )


@click.command("extract")
@click.option(
    "--model",
    "model_name",
    default="smollm2-135m",
    show_default=True,
    help="A registered model name, a transformers model directory or a .gguf file.",
)
@click.option(
    "--text",
    "text_spec",
    required=True,
    help="A UTF-8 file, or a text name: pg, pg/<essay>, py/<module>, doc/<module>, dlg/<n> (kvcodec.models.texts).",
)
@click.option(
    "--max-tokens",
    type=click.IntRange(min=1),
    default=2048,
    show_default=True,
    help="Tokens to keep (never beyond the model's context).",
)
@click.option(
    "--dtype", type=click.Choice(_DTYPES), default="float16", show_default=True, help="dtype of the saved KV."
)
@click.option("--chunk-tokens", type=click.IntRange(min=1), default=256, show_default=True, help="Prefill chunk size.")
@click.argument("out", type=click.Path(dir_okay=False, path_type=Path), callback=check_output_path)
def command(model_name: str, text_spec: str, max_tokens: int, dtype: str, chunk_tokens: int, out: Path) -> None:
    """Prefill MODEL on a text and save its KV to OUT.safetensors.

    A uniform cache is one tensor `kv` of shape (layers, 2, tokens, kv_heads, head_dim) (0 = keys,
    1 = values); a cache of several layer groups (sliding-window layers, recorded whole; MLA latents)
    is one tensor per group with its KVSpec in the metadata (docs/KVSPEC.md). Metadata: model,
    model_id, tokens, dtype, text, the token ids (JSON) and each layer's RoPE.
    """
    import torch
    from tqdm import tqdm

    from kvcodec.kvspec.files import save_kv_file
    from kvcodec.models import load_model, model_id
    from kvcodec.models.check import inspect_model
    from kvcodec.models.extract import extract_text_kv

    if out.suffix != ".safetensors":
        raise click.BadParameter(f"{out}: the output name must end in .safetensors", param_hint="OUT")
    layout = inspect_model(model_name)  # a model kvcodec cannot code fails here, in seconds
    text, label = _read_text(text_spec)
    if not text.strip():
        raise ConfigError(f"--text {text_spec!r} is empty")

    t0 = time.perf_counter()
    click.echo(f"loading {model_name} ...", err=True)
    model, tokenizer = load_model(model_name)
    click.echo(f"loaded in {time.perf_counter() - t0:.1f} s", err=True)

    t0 = time.perf_counter()
    with tqdm(total=None, unit="tok", desc="prefill", disable=None) as bar:

        def progress(done: int, total: int) -> None:
            bar.total = total
            bar.update(done - bar.n)

        ids, kv = extract_text_kv(
            model, tokenizer, layout, text, max_tokens, chunk_tokens=chunk_tokens, progress=progress
        )
    elapsed = time.perf_counter() - t0
    kv = kv.to(dtype=getattr(torch, dtype))
    metadata = {
        "model": model_name,
        "model_id": model_id(model),
        "tokens": str(int(ids.numel())),
        "dtype": dtype,
        "text": label,
        "input_ids": json.dumps(ids.tolist()),
        "ropes": json.dumps([r.to_dict() if r else None for r in layout.ropes]),
    }
    if isinstance(kv, torch.Tensor) and len(set(layout.ropes)) == 1 and layout.ropes[0] is not None:
        metadata["rope"] = json.dumps(layout.ropes[0].to_dict())
    save_kv_file(out, kv, metadata)
    shape = tuple(kv.shape) if isinstance(kv, torch.Tensor) else ", ".join(g.name for g in kv.spec.groups)
    click.echo(
        f"{out}: kv {shape} {dtype}, {_nbytes(kv):,} bytes, "
        f"{ids.numel()} tokens of {label} in {elapsed:.1f} s ({ids.numel() / max(elapsed, 1e-9):.0f} tok/s)"
    )


def _nbytes(kv) -> int:  # noqa: ANN001 - a tensor or a GroupedKV
    return kv.nbytes if not hasattr(kv, "numel") else kv.numel() * kv.element_size()
