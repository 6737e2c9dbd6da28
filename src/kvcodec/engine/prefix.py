"""The engine's prefix cache: built from an EngineConfig, and the tensors fetches restore into."""

from __future__ import annotations

from typing import Any

import torch

from kvcodec.engine.config import EngineConfig
from kvcodec.engine.runner import cache_capacity, restore_target
from kvcodec.errors import ConfigError

# A store that is down or paused when the engine starts fails the start in seconds, naming the store.
STORE_OPEN_DEADLINE_S = 10.0


def engine_codec(cfg: EngineConfig) -> Any:
    """The ChunkCodec of `cfg`: its codec (an object or a registered name), configured by its
    codec_config when both are given; by default the HEVC codec at int8."""
    from kvcodec.codecs import HevcCodec, make_codec
    from kvcodec.config import CodecConfig

    codec = make_codec(cfg.codec) if isinstance(cfg.codec, str) else cfg.codec
    if codec is None:
        return HevcCodec(cfg.codec_config or CodecConfig(quant="int8"))
    if cfg.codec_config is not None:
        if not hasattr(codec, "with_config"):
            raise ConfigError(f"codec {type(codec).__name__} cannot take a codec_config; configure the codec itself")
        codec = codec.with_config(cfg.codec_config)
    return codec


def open_prefix_cache(cfg: EngineConfig, model: Any, device: torch.device, layout: Any = None) -> tuple[Any, Any]:
    """(store, PrefixCache) for `cfg`: its store URL (memory:// by default), codec and policy; a
    GroupedPrefixCache for a model with several KV layer groups (`layout`, kvspec.serving)."""
    from kvcodec.fetcher import PrefixCache
    from kvcodec.models import model_id
    from kvcodec.store import open_store

    codec = engine_codec(cfg)
    store = open_store(cfg.store_url or "memory://", deadline_s=STORE_OPEN_DEADLINE_S)
    options = {
        "policy": cfg.resolution_policy,
        "decode_workers": cfg.decode_workers,
        "store_partial": cfg.store_partial,
        "drop_damaged": cfg.store_writable,
    }
    try:
        if layout is not None:
            from kvcodec.fetcher.grouped import GroupedPrefixCache

            cache = GroupedPrefixCache(store, model_id(model), codec, device, spec=layout.spec, **options)
        else:
            cache = PrefixCache(store, model_id(model), codec, device, **options)
    except BaseException:
        if hasattr(store, "close"):
            store.close()
        raise
    return store, cache


def chunk_tokens_of(prefix_cache: Any, default: int = 256) -> int:
    """Tokens per stored chunk of a prefix cache (its codec's, or its config's)."""
    for owner in (getattr(prefix_cache, "codec", None), getattr(prefix_cache, "config", None)):
        n = getattr(owner, "chunk_tokens", None)
        if n:
            return int(n)
    return default


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
        # room for the suffix and the answer too: the request's cache works in this storage
        capacity = max(req.matched_tokens, cache_capacity(req))
        return restore_target(self.layers, capacity, self.kv_heads, self.head_dim, self.device, self.dtype)
