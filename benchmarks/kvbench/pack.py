"""The transform's calibration cut for travel ("pack"): each (layer group, K|V) basis kept only as
wide as the coordinates some prepared chunks code, float16 where that is exact (calibration rounds
bases to float16), in one safetensors file beside the chunks. The benchmarks that carry a .kvt to
the GPU machine (ttft-engine, transform_nvdec.py, probes/fetch_restore.py, probes/ans_fetch.py)
write and read this one format."""

from __future__ import annotations

import json
import pathlib

PACK = "transform.pack.safetensors"


def widest(codec, headers) -> list[int]:  # noqa: ANN001
    """Per block, the most coordinates any of the chunks (their headers) codes."""
    widths = None
    for h in headers:
        counts = codec.plan(h["theta"], h.get("key_weight", codec.key_weight)).counts
        widths = [max(a, b) for a, b in zip(widths or counts, counts)]
    if widths is None:
        raise ValueError("a pack needs at least one coded chunk")
    return widths


def write_pack(cal, kvt_hash: str, widths: list[int], path: pathlib.Path) -> None:  # noqa: ANN001
    import torch
    from safetensors.torch import save_file

    from kvcodec.transform.calibration import KINDS

    tensors = {}
    for j, (g, k) in enumerate((g, k) for g in range(len(cal.groups)) for k in KINDS):
        b = cal.basis(g, k)
        basis = b.basis[:, : max(widths[j], 1)].contiguous()
        half = basis.to(torch.float16)
        tensors[f"g{g}.{k}.mean"] = b.mean.contiguous()
        tensors[f"g{g}.{k}.basis"] = half if torch.equal(half.float(), basis.float()) else basis
        tensors[f"g{g}.{k}.variances"] = b.variances.contiguous()
    meta = {
        "kvt_hash": kvt_hash,
        "shape": json.dumps([cal.layers, cal.kv_heads, cal.head_dim]),
        "rope": json.dumps(cal.rope.to_dict() if cal.rope else None),
        "groups": json.dumps([list(g) for g in cal.groups]),
    }
    save_file(tensors, str(path), metadata=meta)


def read_pack(path: pathlib.Path, square: bool = False):  # noqa: ANN201 - (Calibration, kvt sha256)
    """(Calibration, kvt sha256) of a pack; square: each basis padded back to square with zero
    columns (as a .kvt holds it), else as wide as the pack keeps it."""
    import torch
    from safetensors import safe_open

    from kvcodec.transform.calibration import KINDS, Calibration, GroupBasis
    from kvcodec.transform.rope import RopeSpec

    with safe_open(str(path), "pt") as f:
        meta = f.metadata()
        groups = tuple(tuple(g) for g in json.loads(meta["groups"]))
        bases = {}
        for g in range(len(groups)):
            for k in KINDS:
                mean, basis, var = (f.get_tensor(f"g{g}.{k}.{n}").float() for n in ("mean", "basis", "variances"))
                if square:
                    full = torch.zeros((basis.shape[0], basis.shape[0]), dtype=torch.float32)
                    full[:, : basis.shape[1]] = basis
                    basis = full
                bases[(g, k)] = GroupBasis(mean, basis, var)
    layers, heads, dim = json.loads(meta["shape"])
    rope = json.loads(meta["rope"])
    cal = Calibration(layers, heads, dim, RopeSpec.from_dict(rope) if rope else None, groups, bases, {})
    return cal, meta["kvt_hash"]


def pack_widths(path: pathlib.Path) -> list[int]:
    """The basis widths a pack keeps, block by block (a later prep widens them)."""
    from safetensors import safe_open

    with safe_open(str(path), "pt") as f:
        names = [k for k in f.keys() if k.endswith(".basis")]  # noqa: SIM118 - safe_open is no dict
        names.sort(key=lambda k: (int(k[1:].split(".")[0]), k))
        return [f.get_slice(k).get_shape()[1] for k in names]
