"""Models given by path: a local transformers model directory or a GGUF file.

    model, tokenizer = load_local("/srv/models/my-gemma")          # config.json + weights + tokenizer
    model, tokenizer = load_local("/srv/models/model.Q4_K_M.gguf")  # dequantized to float32

A directory loads in its checkpoint's own dtype (bf16 stays bf16) unless `dtype` says otherwise.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvcodec.errors import ConfigError

if TYPE_CHECKING:  # pragma: no cover
    import torch


def is_local(name: str) -> bool:
    """True when `name` names a path (it contains a separator, or ends in .gguf) rather than a
    registered model."""
    return isinstance(name, str) and ("/" in name or "\\" in name or name.endswith(".gguf") or Path(name).is_dir())


def same_model(a: str, b: str) -> bool:
    """Whether two names of a model (registered names or paths) name the same one."""
    if is_local(a) and is_local(b):
        return Path(a).expanduser().resolve() == Path(b).expanduser().resolve()
    return a == b


def calibrated_on(codec: Any) -> str | None:
    """The model a transform codec's .kvt names as the one it was calibrated on (None: not a
    transform, or a .kvt that does not say)."""
    cals = [getattr(codec, "cal", None), *(getattr(c, "cal", None) for c in getattr(codec, "per_group", {}).values())]
    names = {str(c.info.get("model")) for c in cals if c is not None and (c.info or {}).get("model")}
    return names.pop() if len(names) == 1 else None


def kvt_of_another_model(codec: Any, model: str | None) -> str | None:
    """The model the codec's .kvt was calibrated on where that is not `model` (a registered name or a
    path); None where it is, or either is unknown. Its shape may fit, but its basis and quality report are
    another model's: the ratio's accuracy can be far worse."""
    kvt_model = calibrated_on(codec)
    if kvt_model is None or model is None or same_model(kvt_model, str(model)):
        return None
    return kvt_model


def load_local(name: str, *, dtype: torch.dtype | None = None) -> tuple[Any, Any]:
    """(model, tokenizer) from a model directory or GGUF file, on the CPU, in eval mode."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = Path(name).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ConfigError(f"model directory {name!r} has no config.json (a transformers model folder is needed)")
        where, extra = str(path), {}
    elif path.is_file() and path.suffix == ".gguf":
        from kvcodec.models.registry import _require_loader_deps

        _require_loader_deps()
        where, extra = str(path.parent), {"gguf_file": path.name}
        dtype = dtype or torch.float32  # GGUF weights are dequantized
    else:
        raise ConfigError(f"model {name!r} is neither a registered name, a model directory nor a .gguf file")
    try:
        model = AutoModelForCausalLM.from_pretrained(where, dtype=dtype or "auto", **extra)
        tokenizer = AutoTokenizer.from_pretrained(where, **extra)
    except Exception as e:  # noqa: BLE001 - a damaged weights file raises its reader's own type (SafetensorError, ...)
        first = str(e).splitlines()[0] if str(e) else ""
        raise ConfigError(f"cannot load model {name!r}: {type(e).__name__}: {first}") from e
    return model.eval(), tokenizer
