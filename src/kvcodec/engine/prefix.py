"""The engine's prefix cache: built from an EngineConfig, and the tensors fetches restore into."""

from __future__ import annotations

from typing import Any

import torch

from kvcodec.engine.config import EngineConfig
from kvcodec.engine.runner import restore_target


def open_prefix_cache(cfg: EngineConfig, model: Any, device: torch.device, layout: Any = None) -> tuple[Any, Any]:
    """(store, PrefixCache) for `cfg`: its store URL (memory:// by default), codec and policy; a
    GroupedPrefixCache for a model with several KV layer groups (`layout`, kvspec.serving)."""
    from kvcodec.config import CodecConfig
    from kvcodec.fetcher import PrefixCache
    from kvcodec.models import model_id
    from kvcodec.store import open_store

    store = open_store(cfg.store_url or "memory://")
    codec_config = cfg.codec_config or CodecConfig(quant="int8")
    options: dict[str, Any] = {
        "policy": cfg.resolution_policy,
        "decode_workers": cfg.decode_workers,
        "store_partial": cfg.store_partial,
    }
    if cfg.codec is not None:
        options["codec"] = cfg.codec
    try:
        if layout is not None:
            from kvcodec.fetcher.grouped import GroupedPrefixCache

            codec = options.pop("codec", None) or codec_config
            cache = GroupedPrefixCache(store, model_id(model), codec, device, spec=layout.spec, **options)
        else:
            cache = PrefixCache(store, model_id(model), codec_config, device, **options)
    except BaseException:
        if hasattr(store, "close"):
            store.close()
        raise
    return store, cache


def kv_dims(model: Any) -> tuple[int, int, int]:
    """(layers, kv_heads, head_dim) of a transformers model."""
    from kvcodec.models.registry import kv_shape

    return tuple(int(x) for x in kv_shape(model))


class RestoreTargets:
    """Allocates, per fetch, the tensor its chunks are restored into: on the model's device, in the
    model's dtype and in its cache's [heads, tokens, head_dim] layout, so that the decoded values
    become the request's cache without another copy."""

    def __init__(self, model: Any, device: torch.device, dtype: torch.dtype, layout: Any = None) -> None:
        self.layers, self.kv_heads, self.head_dim = kv_dims(model)
        self.device, self.dtype, self.layout = device, dtype, layout

    def __call__(self, req: Any) -> torch.Tensor | None:
        if req.matched_tokens <= 0:
            return None
        if self.layout is not None:
            return self.layout.restore_target(req.matched_tokens)
        return restore_target(self.layers, req.matched_tokens, self.kv_heads, self.head_dim, self.device, self.dtype)
