"""transformers (5.x) caches <-> KVSpec / GroupedKV.

    spec = spec_from_cache(cache, model.config)     # what each layer holds
    gkv = split_cache(cache, model.config)          # one canonical tensor per uniform layer group
    cache = build_cache(gkv, model, tokens=n)       # a DynamicCache of the first n positions

Cache layers are recognized by their exact class (a subclass may carry state this module would
drop): DynamicLayer (full attention, or an MLA latent cache when the config has `kv_lora_rank`)
and DynamicSlidingWindowLayer (sliding window or chunked attention: it keeps its last
`sliding_window - 1` positions). Anything else is refused with a ShapeError naming the layer.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from typing import Any

import torch

from kvcodec.dtypes import DTYPE_NAMES
from kvcodec.errors import ShapeError
from kvcodec.kvspec.spec import KVSpec, LayerSpec
from kvcodec.kvspec.tensors import GroupedKV

_LAYER_KINDS = {"DynamicLayer": "full", "DynamicSlidingWindowLayer": "sliding"}
_UNSUPPORTED_HINTS = {
    "StaticLayer": "a static (preallocated) cache; use the default DynamicCache",
    "StaticSlidingWindowLayer": "a static (preallocated) cache; use the default DynamicCache",
    "DynamicIndexedLayer": "a sparse-attention indexer cache (its indexer keys are not coded)",
    "DummyLayer": "a layer without a KV cache of its own (KV sharing or no attention)",
}
_UNSUPPORTED_FAMILIES = {  # class-name fragment -> why
    "Linear": "linear-attention / recurrent state (convolution or state-space caches), not keys and values",
    "Quant": "quantized cache storage; use the default DynamicCache",
}


def _text_config(config: Any) -> Any:
    config = getattr(config, "config", config)
    get = getattr(config, "get_text_config", None)
    return get(decoder=True) if get is not None else config


def _is_mla(config: Any, k_shape: tuple[int, int], v_shape: tuple[int, int]) -> bool:
    c = _text_config(config) if config is not None else None
    rank, rope = getattr(c, "kv_lora_rank", None), getattr(c, "qk_rope_head_dim", None)
    return rank is not None and k_shape == (1, rank) and v_shape == (1, rope)


def _cache_layers(cache: Any) -> list[Any]:
    layers = getattr(cache, "layers", None)
    if layers is None:
        raise ShapeError(f"unsupported cache type {type(cache).__name__}: expected a transformers 5.x Cache")
    if not layers:
        raise ShapeError("the cache has no layers")
    return list(layers)


def _layer_spec(i: int, layer: Any, config: Any) -> LayerSpec:
    cls = type(layer).__name__
    kind = _LAYER_KINDS.get(cls)
    if kind is None:
        family = next((why for part, why in _UNSUPPORTED_FAMILIES.items() if part in cls), "an unknown layer type")
        why = _UNSUPPORTED_HINTS.get(cls, family)
        raise ShapeError(f"cache layer {i} is a {cls}: {why}; kvcodec cannot code it")
    k, v = layer.keys, layer.values
    if not isinstance(k, torch.Tensor) or not isinstance(v, torch.Tensor) or k.dim() != 4 or k.numel() == 0:
        raise ShapeError(f"cache layer {i} ({cls}) holds no keys/values (empty or never filled)")
    if k.shape[0] != 1 or v.shape[0] != 1:
        raise ShapeError(f"cache layer {i} holds a batch of {k.shape[0]}; kvcodec codes one sequence")
    if k.dtype not in DTYPE_NAMES or v.dtype != k.dtype:
        raise ShapeError(f"cache layer {i}: dtypes {k.dtype}/{v.dtype}; expected one of float16, bfloat16, float32")
    k_shape, v_shape = (k.shape[1], k.shape[3]), (v.shape[1], v.shape[3])
    if kind == "sliding":
        return LayerSpec("sliding", k_shape, v_shape, keep=int(layer.sliding_window) - 1)
    return LayerSpec("mla" if _is_mla(config, k_shape, v_shape) else "full", k_shape, v_shape)


def spec_from_cache(cache: Any, config: Any = None) -> KVSpec:
    """The KVSpec of a filled cache (config: the model or its config, to recognize MLA layers)."""
    layers = _cache_layers(cache)
    specs = tuple(_layer_spec(i, layer, config) for i, layer in enumerate(layers))
    dtypes = {layer.keys.dtype for layer in layers}
    if len(dtypes) != 1:
        raise ShapeError(f"cache layers hold different dtypes: {sorted(map(str, dtypes))}")
    return KVSpec(specs, DTYPE_NAMES[dtypes.pop()])


def split_cache(cache: Any, config: Any = None) -> GroupedKV:
    """A filled cache -> GroupedKV (copies on the cache's device). Each layer holds its last
    positions before the cache's length (a sliding layer its window, or more while recording)."""
    spec = spec_from_cache(cache, config)
    layers = _cache_layers(cache)
    stop = max(int(layer.get_seq_length()) for layer in layers)
    pairs = []
    for i, layer in enumerate(layers):
        if int(layer.get_seq_length()) != stop:
            raise ShapeError(f"cache layer {i} has seen {layer.get_seq_length()} positions, others {stop}")
        held = layer.keys.shape[2]
        if layer.values.shape[2] != held or held > stop:
            raise ShapeError(f"cache layer {i} holds {held} keys / {layer.values.shape[2]} values of {stop} positions")
        pairs.append((layer.keys[0].transpose(0, 1), layer.values[0].transpose(0, 1)))
    return GroupedKV.from_layers(spec, stop, pairs)


def _check_model_layer(i: int, layer: Any, want: LayerSpec) -> None:
    kind = _LAYER_KINDS.get(type(layer).__name__)
    keep = int(layer.sliding_window) - 1 if kind == "sliding" else None
    if kind is None or (kind == "sliding") != (want.kind == "sliding") or keep != want.keep:
        have = f"{type(layer).__name__}" + (f" keeping {keep}" if keep else "")
        raise ShapeError(
            f"the model's cache layer {i} is a {have}; the stored KV holds a {want.kind} layer (keep={want.keep})"
        )


def build_cache(gkv: GroupedKV, config_or_model: Any, tokens: int | None = None) -> Any:
    """A DynamicCache holding the first `tokens` positions (default: all) of `gkv`, laid out as the
    model's config says (sliding layers get their window and know the full length). With a model,
    tensors go to its device and the dtypes must match."""
    from transformers import DynamicCache

    part = gkv.prefix(gkv.stop if tokens is None else tokens)
    device = part.device
    if isinstance(config_or_model, torch.nn.Module):
        param = next(config_or_model.parameters())
        if param.dtype != part.tensors[0].dtype:
            raise ShapeError(f"KV dtype {part.tensors[0].dtype} differs from the model's {param.dtype}")
        device = param.device
    cache = DynamicCache(config=getattr(config_or_model, "config", config_or_model))
    if len(cache.layers) != len(part.spec.layers):
        raise ShapeError(f"the model has {len(cache.layers)} cache layers; the stored KV holds {len(part.spec.layers)}")
    for i, (layer, want, (_, (k, v))) in enumerate(zip(cache.layers, part.spec.layers, part.layers())):
        _check_model_layer(i, layer, want)
        layer.update(k.transpose(0, 1).unsqueeze(0).to(device), v.transpose(0, 1).unsqueeze(0).to(device))
        if hasattr(layer, "cumulative_length"):
            layer.cumulative_length = part.stop
    return cache


def cache_kwarg(model: Any) -> str:
    """Name of the forward() argument that takes a cache: "cache" (5.x) or "past_key_values"."""
    params = inspect.signature(model.forward).parameters
    return "cache" if "cache" in params else "past_key_values"


def _takes(model: Any, name: str) -> bool:
    return name in inspect.signature(model.forward).parameters


def output_cache(out: Any) -> Any:
    """The cache a forward(use_cache=True) returned (`.cache` in 5.x, `.past_key_values` before)."""
    cache = getattr(out, "cache", None)
    if cache is None:
        cache = getattr(out, "past_key_values", None)
    if cache is None:
        raise ShapeError("the model output carries no cache; call the model with use_cache=True")
    return cache


def prefill(
    model: Any,
    ids: torch.Tensor,
    *,
    cache: Any = None,
    chunk_tokens: int | None = None,
    progress: Callable[[int, int], None] | None = None,
    all_logits: bool = True,
) -> tuple[torch.Tensor, Any]:
    """(logits [T, vocab], cache) of running the model over token ids (1-D, on the model's device) from
    `cache` (None: the model's own new cache), in chunks of chunk_tokens (None: at once).
    all_logits=False: only each chunk's last position's logits (callers that want the cache: the
    output layer over every position is about a fifth of a small model's work, and its memory)."""
    n = ids.numel()
    kw, step = cache_kwarg(model), n if not chunk_tokens else max(1, int(chunk_tokens))
    extra = {} if all_logits or not _takes(model, "logits_to_keep") else {"logits_to_keep": 1}
    logits = []
    for start in range(0, n, step):
        args = {kw: cache} if cache is not None else {}
        out = model(ids[start : start + step].unsqueeze(0), use_cache=True, **args, **extra)
        cache = output_cache(out)
        logits.append(out.logits[0])
        if progress is not None:
            progress(min(start + step, n), n)
    return torch.cat(logits), cache


def recording_cache(config_or_model: Any) -> Any:
    """An empty DynamicCache whose sliding-window layers keep every position until
    `end_recording`: a prefill into it yields the full history that prefix chunks store (a chunk's
    content must not depend on how long the prompt that stored it was)."""
    from transformers import DynamicCache

    cache = DynamicCache(config=getattr(config_or_model, "config", config_or_model))
    for layer in cache.layers:
        if type(layer).__name__ == "DynamicSlidingWindowLayer":
            layer.activate_past_recording()
    return cache


def end_recording(cache: Any) -> Any:
    """Back to normal sliding-window behaviour: drop the positions past each window; returns cache."""
    for layer in _cache_layers(cache):
        if type(layer).__name__ == "DynamicSlidingWindowLayer" and layer.record_past:
            layer.record_past = False
            if layer.keys is not None and layer.keys.dim() == 4 and layer.keys.shape[2] > layer.sliding_window - 1:
                layer.keys = layer.keys[:, :, -layer.sliding_window + 1 :]
                layer.values = layer.values[:, :, -layer.sliding_window + 1 :]
    return cache
