"""The transform codec in `kvcodec demo`: a quick calibration (.kvt) on the KV of other essays than
the demo's document, prefilled with the model already loaded, and the document's stored fp16 KV
coded into a store of its own with it."""

from __future__ import annotations

import math
import os
import time
from dataclasses import dataclass
from typing import Any

from kvcodec.transform.calibration import CALIBRATION_POOL, DEFAULT_SINK_TOKENS
from kvcodec.transform.pca import MIN_TOKENS_PER_DIM

FIT_TEXTS = 2  # essays fitted on; one more is held out (the per-channel fallback check)


@dataclass(frozen=True)
class QuickCalibration:
    """A .kvt fitted in the demo: where it is, on what, and how long it took (prefills + fit + save)."""

    path: str
    fitted: tuple[str, ...]
    held_out: str
    tokens_per_text: int
    seconds: float
    prefill_s: float  # of `seconds`: the calibration texts' prefills (the rest: the fit and the save)


def calibration_texts(document: str) -> tuple[str, ...]:
    """The first FIT_TEXTS + 1 essays of the calibration pool, never the demo's document."""
    return tuple(t for t in CALIBRATION_POOL if t != document)[: FIT_TEXTS + 1]


def quick_calibration(model: Any, tok: Any, model_name: str, document: str, tokens: int, out_dir: str):  # noqa: ANN201
    """A QuickCalibration of `model`'s KV on `tokens` tokens of each calibration text (raised to the
    fewest the fit accepts for this model), or None for a cache of several layer groups (not shown)."""
    import torch

    from kvcodec.models.check import inspect_model
    from kvcodec.models.extract import extract_text_kv
    from kvcodec.models.texts import load_text
    from kvcodec.transform import calibrate, save_kvt

    t0 = time.perf_counter()
    layout = inspect_model(model_name)
    if not layout.spec.uniform:
        return None
    heads, dim = layout.spec.layers[0].k_shape
    tokens = max(tokens, math.ceil(MIN_TOKENS_PER_DIM * heads * dim / FIT_TEXTS) + DEFAULT_SINK_TOKENS)
    texts = calibration_texts(document)
    kvs = [extract_text_kv(model, tok, layout, load_text(t), tokens)[1].to(torch.float16) for t in texts]
    prefill_s = time.perf_counter() - t0
    info = {"model": model_name, "sources": list(texts[:FIT_TEXTS])}
    cal = calibrate(kvs[:FIT_TEXTS], layout.uniform_rope, held_out=kvs[FIT_TEXTS:], info=info)
    path = os.path.join(out_dir, f"{model_name.replace('/', '_')}-demo.kvt")
    save_kvt(cal, path)
    return QuickCalibration(path, texts[:FIT_TEXTS], texts[FIT_TEXTS], tokens, time.perf_counter() - t0, prefill_s)


def transcode(src: Any, dst: Any, ids: list[int]) -> tuple[int, float]:
    """(tokens, seconds): the fp16 KV prefix cache `src` holds for `ids` restored, then encoded and
    stored through prefix cache `dst` (its codec); the seconds are dst's encode + store."""
    from kvcodec.errors import StoreError

    n = src.lookup(ids)
    got = src.fetch(ids, n)
    if got.error is not None or got.tokens_restored != n or n == 0:
        raise StoreError(f"the stored fp16 KV could not be read back for the transform codec: {got.error}")
    t0 = time.perf_counter()
    dst.put(ids[:n], got.kv)
    return n, time.perf_counter() - t0
