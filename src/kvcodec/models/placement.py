"""Where and in which dtype a model runs: float32 weights become float16 on a GPU, other dtypes stay
(bf16 stays bf16), and the RoPE frequencies (float32 `inv_freq` buffers) stay float32 either way.

    model, tokenizer = load_for_device("smollm2-135m", "cuda")   # loaded as float16, then moved

The engine, ingest and calibrate all load through `load_for_device`, so the KV each one computes
is the KV the others store and read. Weights load in the dtype they run in (from_pretrained's
dtype), not cast after: a 7B float32 model then takes 14 GB of host memory on its way to a GPU,
not 28.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # pragma: no cover
    import torch


def run_dtype(own: torch.dtype | None, device: Any, dtype: torch.dtype | None = None) -> torch.dtype | None:
    """The dtype weights of dtype `own` run in on `device`: `dtype` when given, else float16 for
    float32 weights anywhere but on the CPU, else `own` (None: not known yet)."""
    import torch

    if dtype is not None:
        return dtype
    return torch.float16 if own == torch.float32 and torch.device(device).type != "cpu" else own


def weights_dtype(name: str) -> torch.dtype | None:
    """The dtype a model's weights load in by default, known before loading: float32 for a
    registered model or a .gguf file (dequantized), a model directory's config.json dtype, else
    None (load_model then says what is wrong, or the loaded weights tell)."""
    import torch

    from kvcodec.models.local import is_local
    from kvcodec.models.registry import MODELS

    if name in MODELS or not is_local(name) or name.endswith(".gguf"):
        return torch.float32
    try:
        config = json.loads((Path(name).expanduser() / "config.json").read_text())
    except (OSError, ValueError):
        return None
    named = (config.get("dtype") or config.get("torch_dtype")) if isinstance(config, dict) else None
    found = getattr(torch, named, None) if isinstance(named, str) else None
    return found if isinstance(found, torch.dtype) else None


def place_model(model: Any, device: Any, dtype: torch.dtype | None = None) -> Any:
    """An already loaded model on `device` in its run_dtype, in eval mode (cast through
    cast_model: inv_freq stays float32)."""
    import torch

    from kvcodec.models.registry import cast_model

    own = next(model.parameters()).dtype
    want = run_dtype(own, device, dtype)
    return cast_model(model, device=torch.device(device), dtype=None if want == own else want).eval()


def load_for_device(name: str, device: Any, *, dtype: torch.dtype | None = None) -> tuple[Any, Any]:
    """(model, tokenizer) of a registered name, a model directory or a .gguf file
    (kvcodec.models.load_model), on `device` in run_dtype (`dtype` overrides it), in eval mode.

    The weights load in that dtype directly; only a model directory whose config names no dtype
    loads in its own and is cast after. On the CPU a model loads as load_model(name) loads it.
    Raises ConfigError as load_model does; a GPU out-of-memory error propagates."""
    import torch

    from kvcodec.models.registry import load_model

    device = torch.device(device)
    own = weights_dtype(name)
    want = run_dtype(own, device, dtype)
    model, tokenizer = load_model(name, dtype=None if want == own else want)
    return place_model(model, device, dtype), tokenizer
