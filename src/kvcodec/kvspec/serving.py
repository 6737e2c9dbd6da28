"""How a serving engine keeps, stores and restores the KV of a model with several layer groups.

`layout_for(model, device)` returns None for a model whose KV is one canonical tensor (the engine
keeps its plain path) and a GroupedLayout otherwise:

* a prefill starts from a cache whose sliding-window layers record every position (a stored
  chunk must hold them all: a later, shorter prompt may restore up to any chunk boundary);
  `after_prefill` trims them back to their window once the prompt's KV is snapshotted;
* `snapshot` splits the cache into a GroupedKV for the store; `restored_cache` rebuilds a
  (recording) cache from a fetched GroupedKV; `restore_target` allocates what a fetch fills;
* decoding runs one request per forward (left-padding caches of sliding layers into one batch
  would misplace their windows).
"""

from __future__ import annotations

from typing import Any

import torch

from kvcodec.errors import ShapeError
from kvcodec.kvspec.hf import build_cache, end_recording, recording_cache, spec_from_cache, split_cache
from kvcodec.kvspec.spec import KVSpec
from kvcodec.kvspec.tensors import GroupedKV


@torch.inference_mode()
def probe_spec(model: Any) -> KVSpec:
    """The KVSpec of a model, from a one-token forward (no config parsing: the cache says it)."""
    device = next(model.parameters()).device
    out = model(torch.zeros(1, 1, dtype=torch.long, device=device), use_cache=True)
    cache = getattr(out, "cache", None) or getattr(out, "past_key_values", None)
    return spec_from_cache(cache, model.config)


class GroupedLayout:
    """The engine's KV handling for one model with a non-uniform KVSpec (see module doc)."""

    batch_decode = False

    def __init__(self, model: Any, spec: KVSpec, device: torch.device) -> None:
        self.model, self.spec, self.device = model, spec, torch.device(device)
        self.records = any(g.keep is not None for g in spec.groups)

    def new_cache(self) -> Any:
        return recording_cache(self.model) if self.records else None

    def restored_cache(self, kv: GroupedKV, tokens: int) -> Any:
        cache = build_cache(kv, self.model, tokens)
        for layer in cache.layers:
            if hasattr(layer, "activate_past_recording") and self.records:
                layer.activate_past_recording()
        return cache

    def snapshot(self, cache: Any) -> GroupedKV:
        return split_cache(cache, self.model.config)

    def after_prefill(self, cache: Any) -> None:
        end_recording(cache)

    def restore_target(self, tokens: int) -> GroupedKV:
        return GroupedKV.empty(self.spec, tokens, device=self.device, window=False)


WITHOUT_REUSE = (
    ". Serve this model without KV reuse and storing (Engine(reuse=False, store_policy=StorePolicy(enabled=False)); "
    "kvcodec serve --no-reuse --no-store)"
)


def layout_for(model: Any, device: torch.device | str) -> GroupedLayout | None:
    """None for a uniform cache, else the GroupedLayout; ShapeError for caches kvcodec cannot code."""
    try:
        spec = probe_spec(model)
    except ShapeError as e:
        raise ShapeError(f"{e}{WITHOUT_REUSE}") from e
    return None if spec.uniform else GroupedLayout(model, spec, torch.device(device))
