"""KV of a text under any model kvcodec can code: one canonical tensor for uniform caches, a
GroupedKV for caches of several layer groups (sliding windows, MLA). Sliding-window layers are
recorded whole (every position, not only their window): calibration fits on all of them and a
stored prefix must not depend on the prompt's length (docs/KVSPEC.md)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from kvcodec.errors import ShapeError
from kvcodec.kvspec.hf import prefill, recording_cache, split_cache
from kvcodec.kvspec.tensors import GroupedKV
from kvcodec.models.check import ModelLayout, check_cache_spec
from kvcodec.models.registry import token_limit


@torch.inference_mode()
def prefill_recorded(
    model: Any,
    ids: torch.Tensor,
    chunk_tokens: int | None = None,
    progress: Callable[[int, int], None] | None = None,
    all_logits: bool = True,
) -> tuple[torch.Tensor, Any]:
    """(logits [T, vocab], cache) of a prefill into a recording cache (sliding layers keep every
    position): kvspec.hf.prefill, the loop integrations.hf.forward_ids runs too (all_logits=False:
    only each chunk's last logits)."""
    if ids.numel() == 0:
        raise ShapeError("the text tokenizes to no tokens")
    cache = recording_cache(model)
    return prefill(
        model, ids.to(model.device), cache=cache, chunk_tokens=chunk_tokens, progress=progress, all_logits=all_logits
    )


def extract_text_kv(
    model: Any,
    tokenizer: Any,
    layout: ModelLayout,
    text: str,
    max_tokens: int | None = None,
    *,
    chunk_tokens: int | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> tuple[torch.Tensor, torch.Tensor | GroupedKV]:
    """(token ids, KV on the CPU) of the text's first max_tokens tokens (never beyond the model's
    context): a (layers, 2, T, H, D) tensor for a uniform cache, else a GroupedKV whose groups all
    hold positions [0, T)."""
    ids = tokenizer(text, return_tensors="pt").input_ids[0]
    limit = token_limit(model, max_tokens)
    if limit is not None:
        ids = ids[:limit]
    return ids, kv_of_ids(model, layout, ids, chunk_tokens=chunk_tokens, progress=progress)


def kv_of_ids(
    model: Any,
    layout: ModelLayout,
    ids: torch.Tensor,
    *,
    chunk_tokens: int | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> torch.Tensor | GroupedKV:
    _, cache = prefill_recorded(model, ids, chunk_tokens, progress, all_logits=False)  # the KV only
    gkv = split_cache(cache, model.config)
    check_cache_spec(layout, gkv.spec)
    gkv = gkv.to(device="cpu")
    return gkv.tensors[0] if gkv.spec.uniform else gkv
