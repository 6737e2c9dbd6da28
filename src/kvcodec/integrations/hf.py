"""Adapters between transformers KV caches and kvcodec's canonical KV tensor.

Canonical KV tensor: ``(layers, 2, tokens, kv_heads, head_dim)``, index 0 = keys, 1 = values, for
one sequence (batch of 1). transformers (5.x) keeps, per layer, ``cache.layers[i].keys`` and
``.values`` of shape ``[batch, kv_heads, seq, head_dim]``; models take ``cache=`` and return
``.cache`` (older releases: ``past_key_values``), both handled here.

    input_ids, kv = extract_kv(model, tokenizer, text, max_tokens=512)
    out = continue_from_kv(model, input_ids, kv, continuation_ids)   # out.logits: [1, n, vocab]
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from kvcodec.errors import ConfigError, ShapeError
from kvcodec.kvspec.hf import cache_kwarg, output_cache, prefill
from kvcodec.models.registry import kv_shape

KV_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def layer_pairs(cache: Any) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(keys, values) per layer, each [batch, kv_heads, seq, head_dim], whatever the cache layout."""
    layers = getattr(cache, "layers", None)
    if layers is not None:
        pairs = []
        for i, layer in enumerate(layers):
            k, v = getattr(layer, "keys", None), getattr(layer, "values", None)
            if not isinstance(k, torch.Tensor) or not isinstance(v, torch.Tensor):
                raise ShapeError(f"cache layer {i} holds no keys/values (empty or unsupported layer type)")
            pairs.append((k, v))
        return pairs
    if hasattr(cache, "key_cache"):  # transformers < 4.56
        return list(zip(cache.key_cache, cache.value_cache))
    if isinstance(cache, (tuple, list)):  # legacy tuple of (key, value) per layer
        return [(kv[0], kv[1]) for kv in cache]
    raise ShapeError(f"unsupported cache type {type(cache).__name__}; expected a transformers Cache")


def make_cache(pairs: list[tuple[torch.Tensor, torch.Tensor]], config: Any) -> Any:
    """A DynamicCache holding `pairs` ([batch, kv_heads, seq, head_dim] per layer).

    Full-attention layers adopt the given tensors (no copy: DynamicCache's own constructor
    concatenates them onto an empty tensor, a copy); other layer types are filled with update().
    """
    from transformers import DynamicCache

    try:
        cache = DynamicCache(config=config)
    except TypeError:  # pragma: no cover - transformers releases without config=
        return DynamicCache.from_legacy_cache(tuple(pairs))
    layers = getattr(cache, "layers", None)
    if layers is None or len(layers) != len(pairs):
        return DynamicCache(pairs, config=config)
    for layer, (k, v) in zip(layers, pairs):
        if not (type(layer).__name__ == "DynamicLayer" and _adopt(layer, k, v)):
            layer.update(k, v)
    return cache


def reserved_cache(storage: list[tuple[torch.Tensor, torch.Tensor]], filled: int, config: Any) -> Any:
    """A DynamicCache over preallocated storage: ([batch, kv_heads, capacity, head_dim] keys, values)
    per layer whose first `filled` tokens hold valid KV (e.g. a restored prefix).

    Its full-attention layers write each forward's new tokens in place after the filled ones and
    hand attention views of the storage, so neither the restored prefix nor earlier tokens are
    copied again (DynamicCache concatenates the whole layer into new tensors at every forward). A
    layer that outgrows its capacity moves once into double the room. Where this transformers
    release's layers differ, the cache adopts the filled views instead (make_cache).
    """
    from transformers import DynamicCache

    filled_pairs = [(k[:, :, :filled], v[:, :, :filled]) for k, v in storage]
    try:
        cache = DynamicCache(config=config)
    except TypeError:  # pragma: no cover - transformers releases without config=
        return make_cache(filled_pairs, config)
    layers = getattr(cache, "layers", None)
    if layers is None or len(layers) != len(storage) or ReservedLayer is None:
        return make_cache(filled_pairs, config)
    for i, (layer, (k, v)) in enumerate(zip(layers, storage)):
        if type(layer).__name__ == "DynamicLayer":
            layers[i] = ReservedLayer(k, v, filled)
        elif filled:
            layer.update(k[:, :, :filled], v[:, :, :filled])
    return cache


def _reserved_layer_class() -> Any:
    """ReservedLayer, or None where transformers has no DynamicLayer to derive it from."""
    try:
        from transformers.cache_utils import DynamicLayer
    except ImportError:  # pragma: no cover - transformers < 4.56
        return None

    class _ReservedLayer(DynamicLayer):
        """A DynamicLayer whose keys/values are views of preallocated storage (see reserved_cache)."""

        def __init__(self, k_store: torch.Tensor, v_store: torch.Tensor, filled: int) -> None:
            super().__init__()
            self.device = k_store.device
            self._k, self._v = k_store, v_store
            self.keys, self.values = k_store[:, :, :filled], v_store[:, :, :filled]
            self.is_initialized = True

        def _fits(self, k_new: torch.Tensor, v_new: torch.Tensor, end: int) -> bool:
            """The new tokens go in place: keys/values are still the leading views of the storage
            (crop keeps them so; a batch reorder or reset replaces them) and it has room and shape."""
            k, v, ks, vs = self.keys, self.values, self._k, self._v
            return (
                _same_start(k, ks)
                and _same_start(v, vs)
                and k.stride() == ks.stride()
                and v.stride() == vs.stride()
                and end <= ks.shape[2]
                and (k.shape[0], k_new.shape[1], k_new.shape[3]) == (ks.shape[0], ks.shape[1], ks.shape[3])
                and (v_new.shape[1], v_new.shape[3]) == (vs.shape[1], vs.shape[3])
            )

        def _reserve(self, need: int, k_like: torch.Tensor, v_like: torch.Tensor) -> None:
            """Move the filled tokens into new storage with room for `need` tokens (one copy)."""
            n = self.keys.shape[-2] if self.keys is not None else 0
            batch = self.keys.shape[0] if n else k_like.shape[0]
            cap = max(need, 2 * self._k.shape[2])
            self._k = k_like.new_empty((batch, k_like.shape[1], cap, k_like.shape[3]))
            self._v = v_like.new_empty((batch, v_like.shape[1], cap, v_like.shape[3]))
            if n:
                self._k[:, :, :n].copy_(self.keys)
                self._v[:, :, :n].copy_(self.values)
            self.keys, self.values = self._k[:, :, :n], self._v[:, :, :n]

        def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            if not self.is_initialized or self.keys is None:  # after reset()
                self.keys = self.values = None
                self.is_initialized = True
                self._reserve(key_states.shape[-2], key_states, value_states)
            n = self.keys.shape[-2]
            end = n + key_states.shape[-2]
            if not self._fits(key_states, value_states, end):
                self._reserve(end, key_states, value_states)
            self._k[:, :, n:end].copy_(key_states)
            self._v[:, :, n:end].copy_(value_states)
            self.keys, self.values = self._k[:, :, :end], self._v[:, :, :end]
            return self.keys, self.values

    return _ReservedLayer


def _same_start(view: torch.Tensor, base: torch.Tensor) -> bool:
    """`view` starts where `base` does in the same storage (data_ptr() is 0 for empty views)."""
    return (
        view.untyped_storage().data_ptr() == base.untyped_storage().data_ptr()
        and view.storage_offset() == base.storage_offset()
    )


ReservedLayer = _reserved_layer_class()


def _adopt(layer: Any, k: torch.Tensor, v: torch.Tensor) -> bool:
    """Make a fresh DynamicLayer hold k and v themselves; False where this release's layer
    cannot be initialized that way (the caller then copies them in with update())."""
    try:
        layer.lazy_initialization(k, v)
    except (AttributeError, TypeError):
        return False
    layer.keys, layer.values = k, v
    return True


def cache_to_tensor(cache: Any) -> torch.Tensor:
    """A transformers cache (DynamicCache, or legacy tuples) -> canonical (L, 2, T, H, D) tensor.

    The cache must hold one sequence (batch 1) and the same shape in every layer.
    """
    pairs = layer_pairs(cache)
    if not pairs:
        raise ShapeError("the cache has no layers")
    k0 = pairs[0][0]
    if k0.dim() != 4 or k0.shape[0] != 1:
        raise ShapeError(f"cache keys must be [1, kv_heads, seq, head_dim]; got {list(k0.shape)} in layer 0")
    for i, (k, v) in enumerate(pairs):
        if k.shape != k0.shape or v.shape != k0.shape:
            raise ShapeError(
                f"cache layer {i}: keys {list(k.shape)} / values {list(v.shape)}, expected {list(k0.shape)}"
                " like layer 0 (sliding-window, MLA or mixed-shape caches: use kvcodec.kvspec.split_cache)"
            )
        if k.dtype != k0.dtype or v.dtype != k0.dtype:
            raise ShapeError(f"cache layer {i}: dtype {k.dtype}/{v.dtype}, expected {k0.dtype}")
    # [1, H, T, D] -> [T, H, D]
    return torch.stack([torch.stack([k[0].transpose(0, 1), v[0].transpose(0, 1)]) for k, v in pairs]).contiguous()


def check_kv(kv: torch.Tensor, config_or_model: Any, tokens: int | None = None) -> None:
    """Raise ShapeError unless kv is a canonical KV tensor for this model (and token count)."""
    if not isinstance(kv, torch.Tensor):
        raise ShapeError(f"KV must be a torch.Tensor; got {type(kv).__name__}")
    layers, kv_heads, head_dim = kv_shape(config_or_model)
    if kv.dim() != 5 or kv.shape[1] != 2:
        raise ShapeError(
            f"KV tensor must be (layers, 2, tokens, kv_heads, head_dim) = ({layers}, 2, T, {kv_heads}, {head_dim});"
            f" got {tuple(kv.shape)}"
        )
    got = (kv.shape[0], kv.shape[3], kv.shape[4])
    if got != (layers, kv_heads, head_dim):
        raise ShapeError(
            f"KV tensor (layers, kv_heads, head_dim) = {got} does not fit the model, which expects "
            f"{(layers, kv_heads, head_dim)}"
        )
    if tokens is not None and kv.shape[2] != tokens:
        raise ShapeError(f"KV tensor holds {kv.shape[2]} tokens, expected {tokens} (the prefix length)")
    if kv.dtype not in KV_DTYPES:
        raise ShapeError(f"KV dtype must be float16, bfloat16 or float32; got {kv.dtype}")
    model_dtype = getattr(config_or_model, "dtype", None)
    if isinstance(config_or_model, torch.nn.Module) and model_dtype is not None and kv.dtype != model_dtype:
        raise ShapeError(f"KV dtype {kv.dtype} differs from the model's {model_dtype}; cast with kv.to({model_dtype})")


def tensor_to_cache(kv: torch.Tensor, config_or_model: Any) -> Any:
    """Canonical (L, 2, T, H, D) tensor -> a DynamicCache holding it (batch 1), ready for forward().

    The cache holds copies: running the model on it never changes `kv`. With a model, the cache is
    put on the model's device and the dtypes must match.
    """
    check_kv(kv, config_or_model)
    device = getattr(config_or_model, "device", None) if isinstance(config_or_model, torch.nn.Module) else None
    config = getattr(config_or_model, "config", config_or_model)
    if device is not None:
        kv = kv.to(device)
    data = [
        (kv[i, 0].transpose(0, 1).unsqueeze(0).contiguous(), kv[i, 1].transpose(0, 1).unsqueeze(0).contiguous())
        for i in range(kv.shape[0])
    ]
    return make_cache(data, config)


def _as_ids(ids: Any, name: str) -> torch.Tensor:
    t = torch.as_tensor(ids, dtype=torch.long)
    if t.dim() == 2:
        if t.shape[0] != 1:
            raise ShapeError(f"{name} must hold one sequence; got batch {t.shape[0]}")
        t = t[0]
    if t.dim() != 1:
        raise ShapeError(f"{name} must be a 1-D sequence of token ids; got shape {tuple(t.shape)}")
    return t


@torch.inference_mode()
def forward_ids(
    model: Any,
    input_ids: Any,
    *,
    chunk_tokens: int | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> tuple[torch.Tensor, Any]:
    """Run the model over input_ids from scratch; return (logits [T, vocab], cache).

    chunk_tokens: prefill in chunks of this many tokens (bounded memory, progress reports); the
    KV then differs from a one-shot prefill only by float rounding.
    """
    ids = _as_ids(input_ids, "input_ids").to(model.device)
    if ids.numel() == 0:
        raise ShapeError("input_ids is empty")
    return prefill(model, ids, chunk_tokens=chunk_tokens, progress=progress)


def extract_kv(
    model: Any,
    tokenizer: Any,
    text: str,
    max_tokens: int | None = None,
    *,
    chunk_tokens: int | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Tokenize text (cut to max_tokens) and run a real forward pass; return (input_ids [T], kv).

    kv is canonical (layers, 2, T, kv_heads, head_dim) in the model's dtype, on the CPU.
    """
    if max_tokens is not None and max_tokens < 1:
        raise ConfigError(f"max_tokens must be >= 1; got {max_tokens}")
    ids = tokenizer(text, return_tensors="pt").input_ids[0]
    if max_tokens is not None:
        ids = ids[:max_tokens]
    if ids.numel() == 0:
        raise ShapeError("the text tokenizes to no tokens")
    _, cache = forward_ids(model, ids, chunk_tokens=chunk_tokens, progress=progress)
    return ids, cache_to_tensor(cache).cpu()


@torch.inference_mode()
def continue_from_kv(
    model: Any,
    input_ids_prefix: Any,
    kv: torch.Tensor,
    continuation_ids: Any,
) -> Any:
    """Run the model on continuation_ids as if it had just processed input_ids_prefix, whose KV is kv.

    Returns the model output: ``.logits`` is [1, len(continuation), vocab] (logits[0, j] predicts
    the token after continuation_ids[j]); ``.cache`` (or ``.past_key_values``) holds prefix +
    continuation. `kv` itself is not modified.
    """
    prefix = _as_ids(input_ids_prefix, "input_ids_prefix")
    cont = _as_ids(continuation_ids, "continuation_ids").to(model.device)
    if cont.numel() == 0:
        raise ShapeError("continuation_ids is empty")
    check_kv(kv, model, tokens=prefix.numel())
    cache = tensor_to_cache(kv, model)
    return model(cont.unsqueeze(0), use_cache=True, **{cache_kwarg(model): cache})


@torch.inference_mode()
def greedy_from_kv(
    model: Any,
    input_ids_prefix: Any,
    kv: torch.Tensor,
    prompt_ids: Sequence[int] | torch.Tensor,
    n_tokens: int,
) -> list[int]:
    """Greedy-decode n_tokens after prefix (given by its KV) + prompt_ids (computed fresh)."""
    out = continue_from_kv(model, input_ids_prefix, kv, prompt_ids)
    cache = output_cache(out)
    kw = cache_kwarg(model)
    tokens: list[int] = []
    nxt = int(out.logits[0, -1].argmax())
    for _ in range(n_tokens):
        tokens.append(nxt)
        if len(tokens) == n_tokens:
            break
        out = model(torch.tensor([[nxt]], device=model.device), use_cache=True, **{kw: cache})
        cache = output_cache(out)
        nxt = int(out.logits[0, -1].argmax())
    return tokens
