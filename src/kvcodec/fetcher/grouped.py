"""GroupedPrefixCache: PrefixCache for models whose KV is several layer groups (kvspec.GroupedKV:
sliding-window layers, MLA latent caches, mixed shapes).

Keys, lookup and the store layout are PrefixCache's (the codec is a GroupedCodec, so its id keeps
these chunks apart from canonical ones); a chunk's meta records shape (layers, 1, 1): the group
shapes are in the KVSpec of the blob header. `put` takes a GroupedKV and writes only chunks whose
every group holds all of the chunk's positions (a sliding group recorded from before the chunk),
since a later, shorter prompt may need any of them. `fetch` restores chunk by chunk, in order,
into a GroupedKV target (every group from position 0), network and decode one after the other: the
pipelined fetcher of PrefixCache takes canonical tensors only.
"""

from __future__ import annotations

import time
from typing import Any

import torch

from kvcodec.codecs.base import ChunkCodec
from kvcodec.codecs.grouped import GroupedCodec
from kvcodec.config import CodecConfig
from kvcodec.errors import ConfigError, FetchError, KVCodecError, ShapeError
from kvcodec.fetcher import storecalls
from kvcodec.fetcher.cache import PrefixCache, _runs
from kvcodec.fetcher.keys import ChunkMeta, as_token_array, blob_key, meta_key
from kvcodec.fetcher.stats import FetchResult, FetchStats
from kvcodec.kvspec import GroupedKV, KVSpec


def grouped_codec(codec: Any) -> GroupedCodec:
    """A GroupedCodec around `codec` (a ChunkCodec or a CodecConfig of the HEVC codec)."""
    if isinstance(codec, GroupedCodec):
        return codec
    if isinstance(codec, CodecConfig):
        from kvcodec.codecs.hevc import HevcCodec

        codec = HevcCodec(codec)
    if not isinstance(codec, ChunkCodec):
        raise ConfigError(f"GroupedPrefixCache needs a ChunkCodec or a CodecConfig; got {type(codec).__name__}")
    return GroupedCodec(codec)


class GroupedPrefixCache(PrefixCache):
    """Stored KV prefixes of one model whose KV is described by `spec` (see module doc)."""

    def __init__(
        self,
        store: Any,
        model_id: str,
        codec: Any,
        /,
        device: str | torch.device = "cpu",
        *,
        spec: KVSpec,
        **options: Any,
    ) -> None:
        super().__init__(store, model_id, grouped_codec(codec), device, **options)
        self.spec = spec

    def put(self, token_ids: Any, kv: GroupedKV) -> int:  # type: ignore[override]
        """Encode and store the complete chunks of `kv` not stored yet; returns how many were written."""
        ids = as_token_array(token_ids)
        if not isinstance(kv, GroupedKV) or kv.spec != self.spec:
            raise ShapeError(f"expected a GroupedKV of this model's KVSpec; got {type(kv).__name__}")
        if kv.stop > len(ids):
            raise ShapeError(f"KV holds {kv.stop} tokens but only {len(ids)} token ids were given")
        keys = self.keys(ids[: kv.stop])
        present = self.store.exists_many([meta_key(k) for k in keys]) if keys else []
        complete = max(kv.starts)  # chunks starting before this lack positions of some group
        missing = [i for i, p in enumerate(present) if not p and i * self.chunk_tokens >= complete]
        written = 0
        for run in _runs(missing):
            a, b = run[0] * self.chunk_tokens, min(kv.stop, (run[-1] + 1) * self.chunk_tokens)
            for c in self.codec.encode_chunks(kv.view(a, b), first_chunk_index=run[0], keys=[keys[i] for i in run]):
                self._store_chunk(keys[c.index], c, (len(self.spec.layers), 1, 1), self.spec.dtype)
                written += 1
        return written

    def target(self, tokens: int) -> GroupedKV:
        """Where a fetch of `tokens` tokens restores to: every group from position 0."""
        return GroupedKV.empty(self.spec, tokens, device=self.device, window=False)

    def fetch(
        self,
        token_ids: Any,
        n_tokens: int | None = None,
        out: GroupedKV | None = None,
        deadline_s: float | None = None,
        *,
        policy: Any = None,
    ) -> FetchResult:
        """Restore the first `n_tokens` tokens (default all) into `out` (a GroupedKV holding every
        group from 0, e.g. `target(n)`). Never raises for store, data or deadline failures: the
        result says how many tokens were restored and why it stopped."""
        t0 = time.monotonic()
        deadline = storecalls.Deadline(deadline_s, t0)
        stats = FetchStats(policy="fixed:0", codec=self.codec.id, max_inflight=1, decoder=self.decoder_name())
        ids = as_token_array(token_ids)
        n_tokens = len(ids) if n_tokens is None else int(n_tokens)
        if not 0 <= n_tokens <= len(ids):
            raise ConfigError(f"n_tokens={n_tokens} outside 0..{len(ids)}")
        if out is not None and (not isinstance(out, GroupedKV) or out.stop < n_tokens or max(out.starts) > 0):
            raise ShapeError(f"out must be a GroupedKV holding every group from 0 to >= {n_tokens}")
        if n_tokens == 0:
            return self._result(stats, t0, out, 0, n_tokens, None)
        metas, keys, error = self._plan(ids, n_tokens, deadline, stats)
        out = out if out is not None else self.target(n_tokens)
        restored = 0
        for i, (m, key) in enumerate(zip(metas, keys)):
            try:
                restored = self._fetch_chunk(m, key, out, n_tokens, deadline, stats)
            except FetchError as e:
                error = e
                break
            except KVCodecError as e:
                self._bad_chunk(key, i, e, stats)
                error = e
                break
        if error is None and restored < n_tokens:
            error = FetchError(f"only {restored} of {n_tokens} tokens restored")
        return self._result(stats, t0, out, restored, n_tokens, error)

    def _fetch_chunk(self, m: ChunkMeta, key: str, out: GroupedKV, n_tokens: int, deadline, stats) -> int:
        blob = storecalls.call(deadline, "get", self.store.get, blob_key(key, 0))
        if blob is None:
            raise FetchError(f"chunk {m.index}: its blob is missing")
        info = self.codec.inspect_chunk(blob)
        if (info.index, info.start_token, info.tokens, info.key) != (m.index, m.start_token, m.tokens, key):
            raise ShapeError(
                f"chunk {m.index}: the blob is chunk {info.index} at {info.start_token} "
                f"(+{info.tokens}) bound to another key"
            )
        end = m.start_token + m.tokens
        if end <= out.stop:
            self.codec.decode_chunk(blob, out.view(m.start_token, end))
        else:  # the last chunk reaches past the target: restore it whole, keep what fits
            part = GroupedKV.empty(self.spec, end, start=m.start_token, device=out.device, window=False)
            self.codec.decode_chunk(blob, part)
            for dst, src in zip(out.view(m.start_token, out.stop).tensors, part.tensors):
                dst.copy_(src[:, :, : dst.shape[2]])
        stats.bytes_fetched += len(blob)
        stats.chunks_restored += 1
        return min(end, n_tokens)
