"""Background writer: after a prefill, encode the prompt's KV (CPU x265) and put it in the store.

The queue is bounded: each queued store keeps slices of a request's KV cache alive (on the GPU
when the model runs there) until it is encoded, so past `max_pending` a new store is dropped,
logged and counted instead of queued.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

from kvcodec.kvspec.tensors import GroupedKV

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class StorePolicy:
    """What gets stored after a prefill.

    enabled: store at all.
    min_tokens: prompts shorter than this are not stored (None: one chunk of the codec config).
    max_tokens: store at most this many leading prompt tokens (None: all full chunks).
    skip_if_restored: skip when the restored prefix already covers every full chunk of the prompt.
    dtype: dtype the KV is stored from ("float16", "bfloat16", "float32"; None: the model's).
        quant="exact" restores exactly what was stored, so keep the model's dtype for bit-exact reuse.
    """

    enabled: bool = True
    min_tokens: int | None = None
    max_tokens: int | None = None
    skip_if_restored: bool = True
    dtype: str | None = None


class KVStorer:
    """Runs PrefixCache.put on a worker thread so that the engine never waits for an encode."""

    def __init__(
        self, prefix_cache: Any, policy: StorePolicy, chunk_tokens: int, workers: int = 1, max_pending: int = 4
    ) -> None:
        self.prefix_cache = prefix_cache
        self.policy = policy
        self.chunk_tokens = max(1, chunk_tokens)
        self.max_pending = max(1, int(max_pending))
        self.dropped = 0
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="kvcodec-store")
        self._pending: set[Future] = set()
        self._lock = threading.Lock()
        self.on_done: Any = None  # callable(chunks_written | None, error | None)
        self.on_drop: Any = None  # callable() when a store is dropped (queue full)

    def tokens_to_store(self, prompt_len: int, restored: int) -> int:
        p = self.policy
        if not p.enabled or self.prefix_cache is None:
            return 0
        min_tokens = p.min_tokens if p.min_tokens is not None else self.chunk_tokens
        if prompt_len < max(min_tokens, 1):
            return 0
        n = prompt_len if p.max_tokens is None else min(prompt_len, p.max_tokens)
        full = (n // self.chunk_tokens) * self.chunk_tokens
        if full == 0:
            return 0
        if p.skip_if_restored and restored >= full:
            return 0
        return n

    def submit(self, prompt_ids: list[int], cache: Any, restored: int = 0) -> Future | None:
        """Snapshot the first tokens of `cache` (no copy) and store them in the background."""
        n = self.tokens_to_store(len(prompt_ids), restored)
        if n == 0:
            return None
        # The request's cache writes later tokens after the prompt (in place, or into new storage
        # when it grows), so these views of the prompt's tokens stay unchanged while it decodes.
        from kvcodec.integrations.hf import layer_pairs

        with self._lock:
            if len(self._pending) >= self.max_pending:
                self.dropped += 1
                log.warning("KV store queue full (%d pending): not storing %d tokens", len(self._pending), n)
                if self.on_drop:
                    self.on_drop()
                return None
            if isinstance(cache, GroupedKV):  # models with several KV layer groups
                layers = cache.view(0, n)
            else:
                layers = [(k[:, :, :n], v[:, :, :n]) for k, v in layer_pairs(cache)]
            fut = self._pool.submit(self._put, list(prompt_ids[:n]), layers)
            self._pending.add(fut)
        fut.add_done_callback(self._forget)
        return fut

    def _put(self, ids: list[int], layers: list) -> int:
        import torch

        from kvcodec.integrations.hf import cache_to_tensor

        try:
            if isinstance(layers, GroupedKV):
                kv = layers.to("cpu", getattr(torch, self.policy.dtype) if self.policy.dtype else None)
            else:
                kv = cache_to_tensor(layers).to("cpu")  # a list of (keys, values) per layer is accepted
                if self.policy.dtype:
                    kv = kv.to(getattr(torch, self.policy.dtype))
            written = int(self.prefix_cache.put(ids, kv) or 0)
        except Exception as e:
            log.warning("storing %d tokens of KV failed: %s", len(ids), e)
            if self.on_done:
                self.on_done(None, e)
            raise
        if self.on_done:
            self.on_done(written, None)
        return written

    def _forget(self, fut: Future) -> None:
        with self._lock:
            self._pending.discard(fut)

    def flush(self, timeout: float | None = None) -> None:
        """Wait until every queued store has finished (errors are logged, not raised)."""
        with self._lock:
            pending = list(self._pending)
        for f in pending:
            try:
                f.result(timeout=timeout)
            except Exception:
                pass

    def shutdown(self, wait: bool = True) -> None:
        """Stop the worker; wait=False drops queued stores (the one being encoded finishes)."""
        self._pool.shutdown(wait=wait, cancel_futures=not wait)
