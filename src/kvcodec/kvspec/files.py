"""KV files on disk (safetensors): one canonical tensor `kv`, or, for a cache of several layer groups,
one tensor per group (`group.<i>`) with the KVSpec and the positions each holds in the metadata.

    save_kv_file(path, kv_or_grouped, {"model": ...})
    kv, meta = load_kv_file(path)     # a (layers, 2, T, H, D) tensor, or a GroupedKV
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from kvcodec.atomic import replacing
from kvcodec.errors import ConfigError, FormatError, ShapeError
from kvcodec.kvspec.spec import KVSpec
from kvcodec.kvspec.tensors import GroupedKV

LAYOUT_PLAIN = "layers,2,tokens,kv_heads,head_dim"
LAYOUT_GROUPED = "kvspec-groups"


def save_kv_file(path: str | Path, kv: torch.Tensor | GroupedKV, metadata: dict[str, str]) -> None:
    """Write atomically; metadata values are strings (safetensors). A failed write (a full disk, a
    file size limit) is an OSError naming the path, as Python's own writes are; nothing is left."""
    from safetensors import SafetensorError
    from safetensors.torch import save_file

    path = Path(path)
    meta = dict(metadata)
    if isinstance(kv, GroupedKV):
        tensors = {f"group.{i}": t.contiguous() for i, t in enumerate(kv.tensors)}
        meta.update(
            layout=LAYOUT_GROUPED,
            kvspec=json.dumps(kv.spec.to_dict()),
            starts=json.dumps(list(kv.starts)),
            stop=str(kv.stop),
        )
    else:
        tensors, meta["layout"] = {"kv": kv.contiguous()}, LAYOUT_PLAIN
    try:
        with replacing(path) as tmp:
            save_file(tensors, tmp, metadata=meta)
    except SafetensorError as e:  # not an OSError: safetensors' writer reports its I/O errors as its own
        raise OSError(f"cannot write {path}: {e}") from None


def read_tensors(path: str | Path) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """(every tensor by name, metadata) of a safetensors file; a missing, damaged or foreign file is
    one ConfigError naming it."""
    from safetensors import SafetensorError
    from safetensors.torch import safe_open

    try:
        with safe_open(str(path), "pt") as f:
            names = f.keys()  # a safe_open handle cannot be iterated
            return {n: f.get_tensor(n) for n in names}, dict(f.metadata() or {})
    except (OSError, ValueError, SafetensorError) as e:
        raise ConfigError(f"{path}: not a readable safetensors KV file ({e})") from e


def no_kv_tensor(path: str | Path, names, meta: dict[str, str]) -> str:  # noqa: ANN001 - any iterable of names
    """Why a safetensors file is not a KV file: a .kvt given as KV, or which tensors it holds instead (a few)."""
    if str(meta.get("format", "")).startswith("kvcodec-transform"):
        return (
            f"{path} is a transform calibration (.kvt), not a KV file: give it as --transform, and KV (kvcodec extract)"
        )
    shown = sorted(names)
    more = f" and {len(shown) - 8} more" if len(shown) > 8 else ""
    return f"{path} holds no tensor named 'kv' (it has {shown[:8]}{more})"


def load_plain_kv(path: str | Path) -> tuple[torch.Tensor, dict[str, torch.Tensor], dict[str, str]]:
    """(the `kv` tensor, every tensor, metadata) of a KV file with one plain `kv` tensor (as `kvcodec
    extract` writes for a model of one layer kind)."""
    tensors, meta = read_tensors(path)
    if "kv" not in tensors:
        if meta.get("layout") == LAYOUT_GROUPED:
            raise ShapeError(
                f"{path} holds no tensor named 'kv' (a grouped KV file, one tensor per layer group): give a plain KV file"
            )
        raise ShapeError(no_kv_tensor(path, tensors, meta))
    return tensors["kv"], tensors, meta


def load_kv_file(path: str | Path) -> tuple[torch.Tensor | GroupedKV, dict[str, str]]:
    """(kv tensor or GroupedKV, metadata) of a file written by save_kv_file (or any file holding `kv`)."""
    tensors, meta = read_tensors(path)
    names = set(tensors)
    if "kv" in tensors:
        return tensors["kv"], meta
    if meta.get("layout") != LAYOUT_GROUPED:
        raise ShapeError(no_kv_tensor(path, names, meta))
    try:
        spec = KVSpec.from_dict(json.loads(meta["kvspec"]))
        starts = tuple(int(s) for s in json.loads(meta["starts"]))
        group_tensors = tuple(tensors[f"group.{i}"] for i in range(len(spec.groups)))
        return GroupedKV(spec, int(meta["stop"]), starts, group_tensors), meta
    except (KeyError, ValueError, TypeError, ShapeError) as e:
        raise FormatError(f"{path}: damaged grouped KV file ({e})") from e


KV_FILE_FIELDS = ("model", "model_id", "text", "layout")  # what extract writes that inspect shows


def describe_kv_file(path: str | Path) -> dict[str, object]:
    """A KV file's summary for `kvcodec inspect`, read with load_kv_file's checks: its tensors
    (shape each), dtype, tokens, and the metadata extract writes (KV_FILE_FIELDS where present)."""
    kv, meta = load_kv_file(path)
    if isinstance(kv, GroupedKV):
        tensors = {g.name: list(t.shape) for g, t in zip(kv.spec.groups, kv.tensors)}
        dtype, tokens = kv.spec.dtype, kv.stop
    else:
        tensors, dtype = {"kv": list(kv.shape)}, str(kv.dtype).removeprefix("torch.")
        tokens = kv.shape[2] if kv.dim() == 5 else None
    fields = {k: meta[k] for k in KV_FILE_FIELDS if k in meta}
    return {"format": "kv-file", "tensors": tensors, "dtype": dtype, "tokens": tokens, **fields}
