"""GroupedPrefixCache: PrefixCache for models whose KV is several layer groups (kvspec.GroupedKV:
sliding-window layers, MLA latent caches, mixed shapes).

Keys, lookup and the store layout are PrefixCache's (the codec is a GroupedCodec, so its id keeps
these chunks apart from canonical ones); a chunk's meta records shape (layers, 1, 1): the group
shapes are in the KVSpec of the blob header. `put` takes a GroupedKV and writes only chunks whose
every group holds all of the chunk's positions (a sliding group recorded from before the chunk),
since a later, shorter prompt may need any of them. `fetch` runs PrefixCache's fetch pipeline
(gets bounded by the deadline, network and decode overlapped, chunks restored in order) with
GroupedKV targets: each chunk decodes into its positions of the target (every group from 0).
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from typing import Any

import torch

from kvcodec.codecs.base import ChunkCodec, ChunkInfo
from kvcodec.codecs.grouped import GroupedCodec, GroupedStaged
from kvcodec.config import CodecConfig
from kvcodec.dtypes import DTYPES
from kvcodec.errors import ConfigError, FetchError, FormatError, ShapeError
from kvcodec.fetcher import storecalls
from kvcodec.fetcher.cache import BadChunks, PrefixCache, _runs
from kvcodec.fetcher.keys import ChunkMeta, as_token_array, meta_key
from kvcodec.fetcher.pipeline import Decoded, FetchPipeline, FetchPlan, PipelineSettings
from kvcodec.fetcher.policy import get_policy
from kvcodec.fetcher.profile import DecodeProfile
from kvcodec.fetcher.stats import FetchResult, FetchStats
from kvcodec.kvspec import GroupedKV, KVSpec


def grouped_codec(codec: Any) -> GroupedCodec:
    """A GroupedCodec around `codec` (a ChunkCodec or a CodecConfig of the HEVC codec)."""
    if isinstance(codec, GroupedCodec):
        return codec
    if isinstance(codec, CodecConfig):
        from kvcodec.codecs.hevc.codec import HevcCodec

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
        if not isinstance(kv, GroupedKV):
            raise ShapeError(f"expected a GroupedKV of this model's KVSpec; got {type(kv).__name__}")
        if dataclasses.replace(kv.spec, dtype=self.spec.dtype) != self.spec:  # stored in any dtype (StorePolicy)
            raise ShapeError(f"expected a GroupedKV of this model's KVSpec {self.spec}; got one of {kv.spec}")
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
                self._store_chunk(keys[c.index], c, (len(self.spec.layers), 1, 1), kv.spec.dtype)
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
        cancelled: Callable[[], bool] | None = None,
    ) -> FetchResult:
        """Restore the first `n_tokens` tokens (default all) into `out` (a GroupedKV holding every
        group from 0, e.g. `target(n)`), through the fetch pipeline (policy: which stored
        resolution per chunk, default the cache's; decode times come from the cache's `profile` or
        a neutral prior, never a calibration of canonical KV). Never raises for store, data or deadline failures: the
        result says how many tokens were restored and why it stopped. cancelled: as PrefixCache.fetch's."""
        t0 = time.monotonic()
        deadline = storecalls.Deadline(deadline_s, t0, cancelled)
        pol = get_policy(policy, self.codec.resolutions) if policy is not None else self.policy
        stats = FetchStats(policy=pol.name, codec=self.codec.id, max_inflight=self.max_inflight)
        stats.decoder = self.decoder_name()
        ids = as_token_array(token_ids)
        n_tokens = len(ids) if n_tokens is None else int(n_tokens)
        if not 0 <= n_tokens <= len(ids):
            raise ConfigError(f"n_tokens={n_tokens} outside 0..{len(ids)}")
        if out is not None and (not isinstance(out, GroupedKV) or out.stop < n_tokens or max(out.starts) > 0):
            raise ShapeError(f"out must be a GroupedKV holding every group from 0 to >= {n_tokens}")
        if n_tokens == 0:
            return self._result(stats, t0, out, 0, n_tokens, None)
        metas, keys, plan_error = self._plan(ids, n_tokens, deadline, stats)
        out = out if out is not None else self.target(n_tokens)
        if not metas:
            return self._result(stats, t0, out, 0, n_tokens, plan_error)
        settings = PipelineSettings(
            self.codec,
            self.store,
            out.device,
            self.max_inflight,
            self.decode_workers,
            self.net_workers,
            True,
            self.batched_restore,  # staged (on CUDA by default) where every group's codec is: GroupedCodec.stages
        )
        bad = BadChunks(lambda i, e: self._drop_damaged(keys[i], i, e), stats, self.drop_damaged)
        pipeline = _GroupedPipeline(
            settings,
            FetchPlan(metas, keys, n_tokens, DTYPES[self.spec.dtype], out),
            pol,
            self.profile or DecodeProfile.default(self.codec.resolutions),
            self.bandwidth,
            stats,
            deadline,
            t0,
            bad.report,
        )
        restored, error = pipeline.run()
        bad.close()
        self._heal_suspect(plan_error, error, stats)
        if error is None and restored < n_tokens:
            error = plan_error or FetchError(f"only {restored} of {n_tokens} tokens restored")
        return self._result(stats, t0, out, restored, n_tokens, error)


class _GroupedPipeline(FetchPipeline):
    """The fetch pipeline over a GroupedKV target: a chunk decodes into its positions of the
    target; the last chunk, when it reaches past the target, into a GroupedKV of its own whose
    positions that fit are copied over by the decode worker (so the in-order restore has no
    staging to copy). A blob is checked against its key, chunk, positions and the model's KVSpec."""

    def _check_binding(self, i: int, info: ChunkInfo) -> None:
        m, key = self.plan.metas[i], self.plan.keys[i]
        if info.key != key:
            raise FormatError(f"chunk {i}: the stored blob is bound to another prefix key ({info.key!r})")
        if (info.index, info.start_token, info.tokens) != (m.index, m.start_token, m.tokens):
            raise FormatError(
                f"chunk {i}: the blob is chunk {info.index} at {info.start_token} (+{info.tokens}); its meta says "
                f"chunk {m.index} at {m.start_token} (+{m.tokens})"
            )
        spec = getattr(info, "spec", None)
        if spec is not None and dataclasses.replace(spec, dtype=self.out.spec.dtype) != self.out.spec:  # any dtype
            raise FormatError(f"chunk {i}: the blob holds KV of another KVSpec than this model's")

    def _fp16_bytes(self, i: int) -> int:
        """A grouped chunk's meta records shape (layers, 1, 1): its size is the spec's groups' over its positions."""
        m = self.plan.metas[i]
        return 2 * sum(
            t.numel() for t in self.out.view(m.start_token, min(self.out.stop, m.start_token + m.tokens)).tensors
        )

    def _target(self, m: ChunkMeta) -> tuple[GroupedKV, bool]:
        self.direct_used = True  # every decode writes into the caller's target: a stopped fetch waits for it
        end = m.start_token + m.tokens
        if end <= self.out.stop:
            return self.out.view(m.start_token, end), True
        return GroupedKV.empty(self.out.spec, end, start=m.start_token, device=self.out.device, window=False), False

    def _staged(self, i: int, part: object, fed: tuple, busy_s: float | None = None) -> None:
        j, target, direct = fed
        if not direct and isinstance(part, GroupedStaged):  # driven, past the target: the finish copies what fits
            copies = _fitting(self.out, self.plan.metas[i].start_token, target)
            part, fed = GroupedStaged(part.parts, part.copies + copies), (j, target, True)
        super()._staged(i, part, fed, busy_s)

    def _decode(self, i: int, j: int, blob: bytes, staged: bool | None = None) -> Decoded:
        m = self.plan.metas[i]
        # a chunk past the target's end is decoded whole into memory of its own; the positions that fit are copied
        fits = m.start_token + m.tokens <= self.out.stop
        done = super()._decode(i, j, blob, staged=self.s.staged and fits)
        if done.staging is None:
            return done
        copies = _fitting(self.out, m.start_token, done.staging)
        if self.s.staged:  # the caller's target is written by finish only (a fetch stopped early never waits for it)
            return Decoded(done.target, None, GroupedStaged((), copies))
        for dst, src in copies:
            dst.copy_(src)
        return Decoded(done.target, None, done.part)


def _fitting(out: GroupedKV, start: int, whole: GroupedKV) -> tuple[tuple[torch.Tensor, torch.Tensor], ...]:
    """(target, values) of the positions of a chunk decoded whole (from `start`) that `out` holds."""
    return tuple((dst, src[:, :, : dst.shape[2]]) for dst, src in zip(out.view(start, out.stop).tensors, whole.tensors))
