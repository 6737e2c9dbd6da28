"""PrefixCache: store, look up and fetch KV-cache prefixes chunk by chunk (the serving engine's API).

    cache = PrefixCache(open_store("redis://kv:6379/0"), "qwen2.5-coder-0.5b", HevcCodec(CodecConfig()), "cuda")
    n = cache.lookup(token_ids)                     # tokens whose KV is stored (one batched query)
    res = cache.fetch(token_ids, n, out=kv_buffer, deadline_s=0.2)   # out: a tensor or a PagedKV
    # the first res.tokens_restored tokens of res.kv are restored; recompute the rest. res.error
    # says why a fetch stopped early (None when everything asked for was restored).
    cache.put(token_ids, kv)                        # after prefill: encode + store missing chunks

With tensor parallelism each rank keeps a cache of its own KV heads, restored on its own GPU:

    cache = PrefixCache(store, model_id, codec, f"cuda:{local_rank}", shard=TPShard(rank, world, kv_heads))
    cache.put(token_ids, local_kv)                  # this rank's heads only (TPShard.take(kv))
    PrefixCache(store, model_id, codec).put_sharded(token_ids, kv, world)   # a TP=1 producer, for TP=world
    cache.fetch_sharded(token_ids, stored_world)    # this cache's heads from chunks a TP=stored_world producer stored

The fetch itself runs in fetcher.pipeline.FetchPipeline.
"""

from __future__ import annotations

import copy
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import torch

from kvcodec.codecs.base import ChunkCodec, EncodedChunk, Target, reserve_staging, warm_up_codec
from kvcodec.codecs.driven import host_threads
from kvcodec.config import CodecConfig, torch_device
from kvcodec.dtypes import DTYPES, name_of
from kvcodec.errors import ConfigError, FetchError, FormatError, KVCodecError, ShapeError, StoreError
from kvcodec.fetcher import storecalls
from kvcodec.fetcher.bandwidth import BandwidthEstimator
from kvcodec.fetcher.keys import ChunkMeta, as_token_array, blob_key, chunk_keys, longest_present, meta_key
from kvcodec.fetcher.pipeline import (
    FetchPipeline,
    FetchPlan,
    PipelineSettings,
    check_binding,
    default_decode_workers,
    default_max_inflight,
    default_net_workers,
    kv_tensor,
    stage_executor,
)
from kvcodec.fetcher.policy import ResolutionPolicy, get_policy
from kvcodec.fetcher.profile import DecodeProfile, load_or_calibrate
from kvcodec.fetcher.shards import TPShard, tiling_shards
from kvcodec.fetcher.stats import ChunkTiming, FetchResult, FetchStats
from kvcodec.restore.paged import PagedKV
from kvcodec.store.base import size_many

log = logging.getLogger(__name__)

__all__ = ["ChunkTiming", "FetchResult", "FetchStats", "PrefixCache"]

# pinned staging blocks beyond max_inflight that a long fetch held at once: a dropped chunk's block
# returns to torch's pinned cache only when its upload is done (a 32k-token fetch of a 7-8B model,
# max_inflight 64: 73 blocks, plan-cost-h200-s65-first-fetch.log)
STAGING_SPARE = 12


def _resolve_codec(codec: Any, legacy: dict[str, Any]) -> ChunkCodec:
    """The codec: a ChunkCodec as given, or (the earlier form) a CodecConfig with an optional
    `codec=` keyword naming a codec to configure with it (default: the HEVC codec)."""
    other = legacy.pop("codec", None)
    if legacy:
        raise TypeError(f"PrefixCache got unexpected keyword arguments {sorted(legacy)}")
    if isinstance(codec, CodecConfig):
        if other is None:
            from kvcodec.codecs.hevc.codec import HevcCodec

            return HevcCodec(codec)
        if not hasattr(other, "with_config"):
            raise ConfigError(f"{type(other).__name__} cannot take a CodecConfig; pass the codec as the third argument")
        return other.with_config(codec)
    if other is not None:
        raise ConfigError("PrefixCache takes one codec: pass it as the third argument")
    if not isinstance(codec, ChunkCodec):
        raise ConfigError(f"PrefixCache needs a ChunkCodec (or a CodecConfig); got {type(codec).__name__}")
    return codec


def _device(device: str | torch.device) -> torch.device:
    dev = torch_device(device)
    if dev.type == "cuda" and dev.index is None and torch.cuda.is_available():
        dev = torch.device("cuda", torch.cuda.current_device())
    return dev


class _MetaMismatchError(FormatError):
    """A chunk's meta disagrees with chunk 0's shape or dtype (one of the two is damaged)."""

    def __init__(self, message: str, index: int, key: str) -> None:
        super().__init__(message)
        self.index, self.key = index, key


class BadChunks:
    """The chunks a fetch's decoders find damaged. Each is dropped from the store on the thread that
    found it (best effort; no lock is held across the store call, so a slow delete cannot hold the fetch
    past its deadline); those found before the fetch closes the list are counted in its stats at once,
    so the counts a caller gets do not change after the fetch returns."""

    def __init__(self, drop: Callable[[int, KVCodecError], object], stats: FetchStats, counts: bool) -> None:
        self._drop, self._stats, self._counts = drop, stats, counts
        self._lock, self._found, self._open = threading.Lock(), [], True

    def report(self, index: int, error: KVCodecError) -> None:
        with self._lock:
            if self._open:
                self._found.append(index)
                self._stats.chunks_dropped += self._counts
        self._drop(index, error)

    def close(self) -> list[int]:
        """The chunks reported so far; later reports are dropped from the store but not counted."""
        with self._lock:
            self._open = False
            return list(self._found)


class PrefixCache:
    """Stored KV prefixes of one model under one chunk codec.

    store: a KVStore, or a store URL for kvcodec.store.open_store.
    model_id: identity string of the model (part of every key: different models never collide).
    codec: a ChunkCodec (its id is part of every key; the codec decides how chunks are decoded,
        e.g. HevcCodec(config, pool=pool) restores inside an NVDEC pool).
    device: where fetched KV is decoded and restored ("cpu", "cuda", "cuda:1").
    namespace: a tenant's salt in every key: tenants sharing a store cannot find each other's prefixes.
    policy: resolution policy name or object ("adaptive", "fixed:J", "min-bytes", "min-decode").
    max_inflight: chunks between network get and restore at once (bounds peak memory); None: 64
        on CUDA (never caps the staged batch), 4 on the CPU (pipeline.default_max_inflight).
    decode_workers: decode threads (results are restored in order); None: on CUDA one per NVDEC
        engine (7 on an H100/H200, each thread its own session, all in this process's CUDA
        context), 1 on the CPU (pipeline.default_decode_workers).
    net_workers: concurrent gets (several connections; helps where one client stream cannot fill
        the link, and keeps it busy while a chunk's host work begins). The bandwidth estimator charges
        overlapping gets only their non-overlapped time. None: 2 on CUDA from a store across a link
        (its `remote`: Redis), else 1 (pipeline.default_net_workers).
    profile: a DecodeProfile; None = calibrate (cached in the cache dir) on first adaptive fetch.
    initial_gbit: bandwidth prior until chunks have been received.
    store_partial: also store a last chunk shorter than chunk_tokens.
    direct: decode each chunk straight into the fetch's target when it is on `device` in the
        stored dtype or, a tensor, in one the codec restores into (codecs.base.restores_into: the
        transform's float dtypes that hold the stored range): no staging tensor, no copy; a fetch
        that stops early then waits for the decodes in flight to finish their chunk, so nothing
        writes into `out` after `fetch` returns. False: decode into staging tensors and copy
        (returns at once on a deadline).
    shard: a TPShard: this cache holds one tensor-parallel rank's KV heads (puts and fetches
        carry only those heads, under keys of their own); None: every head.
    batched_restore: restore codecs with the StagedDecode capability in two halves, the second
        batched over the chunks ready together (fetcher/pipeline.py); on CUDA, chunks of codecs
        with a driven form (codecs/driven.py: transform, int8 HEVC) are then decoded by the
        driven path. None: on CUDA only. False also turns the driven path off.
    drop_damaged: a chunk a fetch finds damaged has its meta deleted, so that the next put (this
        cache's or a peer's) rewrites it; False leaves it in place and skips the checks of the
        chunks behind it (a store that refuses writes: nothing would rewrite it, and each delete
        would fail).
    """

    def __init__(
        self,
        store: Any,
        model_id: str,
        codec: ChunkCodec | CodecConfig,
        /,
        device: str | torch.device = "cpu",
        *,
        namespace: str | None = None,
        policy: str | ResolutionPolicy = "adaptive",
        max_inflight: int | None = None,
        decode_workers: int | None = None,
        net_workers: int | None = None,
        profile: DecodeProfile | None = None,
        initial_gbit: float = 8.0,
        bandwidth_alpha: float = 0.3,
        store_partial: bool = True,
        direct: bool = True,
        shard: TPShard | None = None,
        batched_restore: bool | None = None,
        drop_damaged: bool = True,
        **legacy: Any,
    ) -> None:
        if any(n is not None and n < 1 for n in (max_inflight, decode_workers, net_workers)):
            raise ConfigError(
                "max_inflight, decode_workers and net_workers must be >= 1 (or None: the device's default)"
            )
        if shard is not None and not isinstance(shard, TPShard):
            raise ConfigError(f"shard must be a TPShard; got {type(shard).__name__}")
        if isinstance(store, str):
            from kvcodec.store import open_store

            store = open_store(store)
        self.store = store
        self.model_id = str(model_id)
        self.codec = _resolve_codec(codec, legacy)
        self.device = _device(device)
        if self.device.type == "cuda":
            host_threads()  # a bad KVCODEC_HOST_THREADS is refused here, not in each fetch
        self.namespace = namespace
        self.policy = get_policy(policy, self.codec.resolutions)
        self.decode_workers = int(decode_workers or default_decode_workers(self.device))
        self.max_inflight = int(max_inflight or default_max_inflight(self.device, self.decode_workers))
        self.net_workers = max(1, min(int(net_workers or default_net_workers(self.device, store)), self.max_inflight))
        if profile is not None and not profile.fits(self.codec.resolutions):
            raise ConfigError(
                f"the decode profile is of frame sizes {list(profile.resolutions)}; the codec's are "
                f"{list(self.codec.resolutions)}"
            )
        self.profile = profile
        self.bandwidth = BandwidthEstimator(initial_gbit, bandwidth_alpha)
        self.store_partial = store_partial
        self.direct = bool(direct)
        self.shard = shard
        self.batched_restore = batched_restore
        self.drop_damaged = bool(drop_damaged)
        self._decoder_name: str | None = None
        self._profile_failed = False  # a failed decode calibration is not retried per fetch
        self._executor = None  # the fetch stages' threads, started once (pipeline.stage_executor)

    @property
    def chunk_tokens(self) -> int:
        return int(self.codec.chunk_tokens)

    @property
    def config(self) -> CodecConfig | None:
        """The HEVC codec's CodecConfig (None for codecs without one)."""
        return getattr(self.codec, "config", None)

    @property
    def codec_id(self) -> str:
        return self.codec.id

    def keys(self, token_ids: Any) -> list[str]:
        return chunk_keys(
            token_ids, self.model_id, self.codec, partial=self.store_partial, namespace=self.namespace, shard=self.shard
        )

    def for_shard(self, shard: TPShard | None) -> PrefixCache:
        """This cache (same store, codec, device and options) for another shard's heads."""
        if shard is not None and not isinstance(shard, TPShard):
            raise ConfigError(f"shard must be a TPShard; got {type(shard).__name__}")
        other = copy.copy(self)
        other.shard = shard
        return other

    # -- lookup ------------------------------------------------------------------------------
    def lookup(self, token_ids: Any, deadline_s: float | None = None, *, whole: bool = False) -> int:
        """Number of leading tokens of `token_ids` whose KV is stored (0 if none), found with one
        batched existence query of the chunks' metas (whole=True: their metas read and every blob of the
        size its meta records, which a store that evicts may have dropped first or damage may have cut:
        what a job that skips stored work asks; two batched queries, the metas and the blobs' sizes). Raises StoreError if the store cannot
        be asked, FetchError if it does not answer within `deadline_s`."""
        ids = as_token_array(token_ids)
        keys = self.keys(ids)
        if not keys:
            return 0
        query = self._stored_readable if whole else lambda ks: self.store.exists_many([meta_key(k) for k in ks])
        flags = storecalls.call(storecalls.Deadline(deadline_s), "lookup", query, keys)
        return min(len(ids), longest_present(flags) * self.chunk_tokens)

    # -- put ---------------------------------------------------------------------------------
    def put(self, token_ids: Any, kv: torch.Tensor) -> int:
        """Encode and store the chunks of `kv` (its token axis aligned with `token_ids`) that are
        not stored yet; returns how many chunks were written. Idempotent: a second call writes 0.
        Each chunk's blobs (bound to its key) are written before its meta object, the commit marker."""
        ids = as_token_array(token_ids)
        if not isinstance(kv, torch.Tensor) or kv.dim() != 5 or kv.shape[1] != 2:
            raise ShapeError(
                f"KV must be (layers, 2, tokens, kv_heads, head_dim); got {tuple(getattr(kv, 'shape', ()))}"
            )
        if self.shard is not None:
            self.shard.check_local(kv.shape[3])
        T = kv.shape[2]
        if len(ids) < T:
            raise ShapeError(f"KV holds {T} tokens but only {len(ids)} token ids were given")
        keys = self.keys(ids[:T])
        present = self._stored_whole(keys)
        written = 0
        for run in _runs([i for i, p in enumerate(present) if not p]):
            a, b = run[0] * self.chunk_tokens, min(T, (run[-1] + 1) * self.chunk_tokens)
            chunks = self.codec.encode_chunks(kv[:, :, a:b], first_chunk_index=run[0], keys=[keys[i] for i in run])
            for c in chunks:
                self.store_chunk(keys[c.index], c, (kv.shape[0], kv.shape[3], kv.shape[4]), name_of(kv.dtype))
                written += 1
        return written

    def _stored_whole(self, keys: list[str]) -> list[bool]:
        """Whether each chunk is stored whole: its meta and every blob (one batched query). A chunk
        whose meta survived but a blob did not is unreadable: put rewrites it instead of skipping it."""
        if not keys:
            return []
        n = len(self.codec.resolutions)
        flags = self.store.exists_many([meta_key(k) for k in keys] + [blob_key(k, j) for k in keys for j in range(n)])
        metas, blobs = flags[: len(keys)], flags[len(keys) :]
        return [bool(m) and all(blobs[i * n : (i + 1) * n]) for i, m in enumerate(metas)]

    def _stored_readable(self, keys: list[str]) -> list[bool]:
        """Whether each chunk's meta parses as this cache's chunk and each of its blobs has the size the
        meta records, in order up to the first that does not; that one, damaged, is dropped (drop_damaged)
        so that the next put rewrites it. Two batched queries: the metas, then their blobs' sizes."""
        recorded: list[list[int]] = []  # the blob sizes each chunk's meta records, up to the first missing or bad
        bad_meta: FormatError | None = None
        for i, raw in enumerate(self.store.get_many([meta_key(k) for k in keys])):
            if raw is None:
                break
            try:
                recorded.append(list(self._checked_meta(raw, i).sizes))
            except FormatError as e:
                bad_meta = e
                break
        found = iter(
            size_many(self.store, [blob_key(keys[i], j) for i, s in enumerate(recorded) for j in range(len(s))])
        )
        for i, sizes in enumerate(recorded):
            cut = [j for j, n in enumerate(sizes) if next(found) != n]
            if cut:
                why = f"its blobs {cut} are missing or not of the sizes its meta records {sizes}"
                self._drop_damaged(keys[i], i, FormatError(why))
                return [True] * i + [False] * (len(keys) - i)
        if bad_meta is not None:  # dropped only once every chunk before it is whole, as it is reached in order
            self._drop_damaged(keys[len(recorded)], len(recorded), bad_meta)
        return [True] * len(recorded) + [False] * (len(keys) - len(recorded))

    def put_sharded(self, token_ids: Any, kv: torch.Tensor, world: int) -> int:
        """Store the full `kv` as `world` tensor-parallel ranks will fetch it: each distinct head
        range once, under its shard's keys (a TP=1 producer serving TP=world consumers). Returns
        the chunks written over all shards."""
        if self.shard is not None and not self.shard.full:
            raise ConfigError(f"put_sharded takes the full KV; this cache holds only {self.shard}")
        if not isinstance(kv, torch.Tensor) or kv.dim() != 5:
            raise ShapeError(
                f"KV must be (layers, 2, tokens, kv_heads, head_dim); got {tuple(getattr(kv, 'shape', ()))}"
            )
        written, seen = 0, set()
        for shard in TPShard.all(world, kv.shape[3]):
            if shard.key_field not in seen:
                seen.add(shard.key_field)
                written += self.for_shard(shard).put(token_ids, shard.take(kv).contiguous())
        return written

    def store_chunk(self, key: str, chunk: EncodedChunk, shape: tuple[int, int, int], dtype: str) -> None:
        """Store an encoded chunk (e.g. encoded in another process) under `key` (one of `keys()`):
        its blobs, then its meta object (the commit marker lookups test for). shape: (layers,
        kv_heads, head_dim) of the chunk's KV, dtype its name (kvcodec.dtypes)."""
        if self.shard is not None:
            self.shard.check_local(shape[1], "the chunk")
        self.store.put_many({blob_key(key, j): blob for j, blob in enumerate(chunk.blobs)})
        meta = ChunkMeta(
            index=chunk.index,
            start_token=chunk.start_token,
            tokens=chunk.tokens,
            shape=shape,
            dtype=dtype,
            resolutions=tuple(tuple(r) for r in chunk.resolutions),
            sizes=tuple(len(bl) for bl in chunk.blobs),
            codec=self.codec.id,
        )
        self.store.put(meta_key(key), meta.to_bytes())

    _store_chunk = store_chunk  # the name GroupedPrefixCache calls

    def drop_chunk(self, key: str) -> bool:
        """Forget a stored chunk (its meta, the commit marker): lookups stop reporting it and the
        next put rewrites it. Best effort: a store failure is logged (False)."""
        try:
            storecalls.call(storecalls.Deadline(5.0), "delete", self.store.delete, meta_key(key))
        except KVCodecError as e:
            log.warning("could not drop the meta of chunk %s: %s", key[:16], e)
            return False
        return True

    def warm_up(self, dtype: torch.dtype = torch.float16, tokens: int | None = None) -> float:
        """Compile the codec's restore kernels for fetches into `dtype` now (codecs with the WarmUp
        capability, on CUDA), and make the pinned staging blocks a fetch of `tokens` (None: of any
        length; 0: none) holds at once (PinnedStaging codecs: as many as max_inflight chunks, and
        STAGING_SPARE for uploads still in flight). torch's pinned cache keeps them for the process's
        life, as it keeps what a long fetch pinned: at Llama-3-8B's shape up to 76 blocks of 16 MiB,
        1.2 GiB of host memory. Seconds spent. A failure is logged, never raised: the first fetch
        then compiles or pins them, or falls back as it would have."""
        seconds = warm_up_codec(self.codec, self.device, dtype)
        if tokens is not None and tokens <= 0:
            return seconds
        chunks = self.max_inflight if tokens is None else min(self.max_inflight, -(-tokens // self.codec.chunk_tokens))
        return seconds + reserve_staging(self.codec, self.device, chunks + STAGING_SPARE)

    # -- profile -----------------------------------------------------------------------------
    def ensure_profile(self, shape: tuple[int, int, int], dtype: torch.dtype = torch.float16) -> DecodeProfile:
        """Load (or calibrate and cache) the decode-speed profile for KV of `shape` (L, H, D)."""
        if self.profile is None:
            self.profile = load_or_calibrate(self.codec, self.device, tuple(shape), dtype)
        return self.profile

    def decoder_name(self) -> str:
        if self._decoder_name is None:
            name = getattr(self.codec, "decoder_name", None)
            try:
                self._decoder_name = str(name(self.device)) if name else type(self.codec).__name__
            except KVCodecError as e:
                self._decoder_name = f"unavailable ({e})"
        return self._decoder_name

    # -- fetch -------------------------------------------------------------------------------
    def fetch(
        self,
        token_ids: Any,
        n_tokens: int | None = None,
        out: Target | None = None,
        deadline_s: float | None = None,
        *,
        policy: str | ResolutionPolicy | None = None,
        cancelled: Callable[[], bool] | None = None,
    ) -> FetchResult:
        """Restore the KV of the first `n_tokens` tokens of `token_ids` (default: all of them).

        out: optional target: a (layers, 2, >= n_tokens, kv_heads, head_dim) tensor on any
            device/dtype (restored values go to ``out[:, :, :n]``), or a PagedKV whose block table
            covers n_tokens. Chunks decode straight into it when it is on the cache's device in
            the stored dtype (a tensor: or in a dtype the codec restores into, codecs.base.restores_into:
            the transform's float dtypes that hold the stored range). Without it a tensor of the
            stored dtype on `device` is allocated.
        deadline_s: time budget in seconds from the call, covering every store call; when it
            runs out the fetch stops.
        cancelled: checked as the deadline is (while the fetch waits for chunks): once it returns
            True the fetch stops there, as at a deadline (the engine's aborted requests).
        Never raises for store, format, stored-data or deadline failures: it stops at the first
        chunk that cannot be restored in order and returns what was restored with `error` set
        (also logged). A chunk that fails its checks is dropped so the next put rewrites it
        (unless drop_damaged is off).
        Invalid arguments (n_tokens, or an `out` too short for them) raise ShapeError/ConfigError;
        an `out` whose (layers, heads, dim) differ from the stored metas' is a result error, as is a
        chunk with values beyond the range of a narrower `out` (bfloat16 chunks into float16: the
        fetch stops before it, writing none of it; the chunks are kept).
        """
        t0 = time.monotonic()
        deadline = storecalls.Deadline(deadline_s, t0, cancelled)
        pol = get_policy(policy, self.codec.resolutions) if policy is not None else self.policy
        stats = FetchStats(policy=pol.name, codec=self.codec.id, max_inflight=self.max_inflight)
        ids = as_token_array(token_ids)
        n_tokens = self._tokens_asked(ids, n_tokens, out)
        if n_tokens == 0:
            return self._result(stats, t0, out, 0, n_tokens, None)
        metas, keys, plan_error = self._plan(ids, n_tokens, deadline, stats)
        if not metas:
            return self._result(stats, t0, out, 0, n_tokens, plan_error)
        dtype = DTYPES[metas[0].dtype]
        try:
            self._check_out(out, metas[0].shape, n_tokens)
        except ShapeError as e:  # the caller's target or the stored metas are wrong: no fetch
            self._drop_meta_if_its_blob_fits(out, keys[0], metas[0], deadline, stats)
            return self._result(stats, t0, out, 0, n_tokens, e)
        profile = self._profile_for(pol, metas[0].shape, dtype, keys[0])
        stats.decoder = self.decoder_name()
        bad = BadChunks(lambda i, e: self._drop_damaged(keys[i], i, e), stats, self.drop_damaged)
        pipeline = FetchPipeline(
            self._pipeline_settings(),
            FetchPlan(metas, keys, n_tokens, dtype, out),
            pol,
            profile,
            self.bandwidth,
            stats,
            deadline,
            t0,
            bad.report,
        )
        restored, error = pipeline.run()
        self._drop_damaged_after(keys, metas, bad.close(), deadline, stats)
        self._heal_suspect(plan_error, error, stats)
        if error is None and restored < n_tokens:
            error = plan_error or FetchError(f"only {restored} of {n_tokens} tokens restored")
        return self._result(stats, t0, pipeline.out, restored, n_tokens, error)

    def _tokens_asked(self, ids, n_tokens: int | None, out: Target | None) -> int:  # noqa: ANN001 - token array
        """fetch's n_tokens (None: all of `ids`), checked with `out` against it; ConfigError or ShapeError."""
        n_tokens = len(ids) if n_tokens is None else int(n_tokens)
        if n_tokens < 0 or n_tokens > len(ids):
            raise ConfigError(f"n_tokens={n_tokens} outside 0..{len(ids)}")
        if out is None:
            return n_tokens
        tensor = kv_tensor(out)
        capacity = out.capacity if isinstance(out, PagedKV) else out.shape[2]
        if capacity < n_tokens or (isinstance(out, torch.Tensor) and out.dim() != 5):
            raise ShapeError(f"out holds {capacity} tokens; {n_tokens} asked for")
        if not tensor.dtype.is_floating_point:
            raise ShapeError(f"out is {tensor.dtype}; KV is restored into a floating-point tensor")
        if self.shard is not None:
            self.shard.check_local(tensor.shape[-2], "out")
        return n_tokens

    def _pipeline_settings(self) -> PipelineSettings:
        return PipelineSettings(
            self.codec,
            self.store,
            self.device,
            self.max_inflight,
            self.decode_workers,
            self.net_workers,
            self.direct,
            self.batched_restore,
            executor=self._stage_executor(),
        )

    # -- chunks stored by another TP degree ------------------------------------------------------
    def _stored_shards(self, stored_world: int) -> tuple[TPShard, ...]:
        if self.shard is None:
            raise ConfigError("give the cache a shard (TPShard(0, 1, kv_heads) for every head) to read sharded chunks")
        return tiling_shards(self.shard.heads, stored_world, self.shard.kv_heads)

    def lookup_sharded(self, token_ids: Any, stored_world: int, deadline_s: float | None = None) -> int:
        """Leading tokens of `token_ids` whose KV of this cache's heads a `stored_world`-rank TP
        producer stored (each rank its own heads; see fetch_sharded)."""
        shards = self._stored_shards(stored_world)
        return min(self.for_shard(s).lookup(token_ids, deadline_s) for s in shards)

    def fetch_sharded(
        self,
        token_ids: Any,
        stored_world: int,
        n_tokens: int | None = None,
        out: Target | None = None,
        deadline_s: float | None = None,
        *,
        cancelled: Callable[[], bool] | None = None,
    ) -> FetchResult:
        """Restore this cache's heads from chunks stored by the ranks of a `stored_world`-rank TP
        producer whose head ranges tile them (that TP degree or a finer one, e.g. a TP=1 consumer
        of TP=2 ranks' puts): each stored shard is fetched in turn into its heads of `out`
        (allocated on the cache's device when None). tokens_restored is the least any shard
        restored; the first error is returned. ConfigError when the stored shards do not tile
        this cache's heads."""
        t0 = time.monotonic()
        shards = self._stored_shards(stored_world)
        if out is not None:
            self.shard.check_local(kv_tensor(out).shape[-2], "out")
        base = self.shard.heads.start
        parts: list[FetchResult] = []
        for shard in shards:
            a, b = shard.heads.start - base, shard.heads.stop - base
            left = None if deadline_s is None else max(0.0, deadline_s - (time.monotonic() - t0))
            view = None if out is None else _head_view(out, a, b)
            parts.append(
                self.for_shard(shard).fetch(token_ids, n_tokens, out=view, deadline_s=left, cancelled=cancelled)
            )
        if out is None and all(isinstance(p.kv, torch.Tensor) for p in parts):
            out = torch.cat([p.kv for p in parts], dim=3)
        stats = FetchStats(policy=parts[0].stats.policy, codec=self.codec.id, decoder=parts[0].stats.decoder)
        for p in parts:
            for name in ("chunks_planned", "chunks_restored", "chunks_dropped", "bytes_fetched"):
                setattr(stats, name, getattr(stats, name) + getattr(p.stats, name))
        stats.wall_s = time.monotonic() - t0
        error = next((p.error for p in parts if p.error is not None), None)
        return FetchResult(out, min(p.tokens_restored for p in parts), error, stats)

    def _result(self, stats: FetchStats, t0: float, kv, restored: int, n_tokens: int, error) -> FetchResult:
        stats.wall_s = time.monotonic() - t0
        stats.bandwidth_estimate_gbit = self.bandwidth.gbit
        stats.latency_estimate_s = self.bandwidth.latency_s
        if error is not None:
            log.warning("fetch stopped after %d of %d tokens: %s: %s", restored, n_tokens, type(error).__name__, error)
        return FetchResult(kv, restored, error, stats)

    def _heal_suspect(self, plan_error: KVCodecError | None, error: KVCodecError | None, stats: FetchStats) -> None:
        """Every chunk before a meta that disagrees with chunk 0's restored cleanly: that meta is
        the damaged one, so it is dropped and the next put rewrites it."""
        if isinstance(plan_error, _MetaMismatchError) and error is None:
            self._bad_chunk(plan_error.key, plan_error.index, plan_error, stats)

    def _drop_damaged_after(self, keys: list[str], metas: list[ChunkMeta], bad: list[int], deadline, stats) -> None:
        """After a damaged chunk, check the planned chunks behind it (each one's blobs fetched and
        decoded into scratch, while the fetch's deadline lasts) and drop every damaged one too: one
        put then rewrites them all, instead of one fetch and put per damaged chunk."""
        if not bad or not self.drop_damaged:  # nothing would be dropped: the check would only cost the fetch
            return
        n = len(self.codec.resolutions)
        for j in range(min(bad) + 1, len(metas)):
            if j in bad:
                continue
            try:
                blobs = storecalls.call(
                    deadline, "check get", self.store.get_many, [blob_key(keys[j], r) for r in range(n)]
                )
            except KVCodecError:
                return  # the deadline or a store failure ends the check: the chunks not checked stay as they are
            try:
                for blob in blobs:
                    self._check_blob(blob, metas[j], keys[j])
            except KVCodecError as e:
                self._bad_chunk(keys[j], j, e, stats)

    def _drop_meta_if_its_blob_fits(self, out: Target, key: str, m: ChunkMeta, deadline, stats: FetchStats) -> None:
        """`out` cannot hold chunk 0 as its meta describes it: where chunk 0's blob holds KV of out's
        (layers, heads, dim), the meta is the damaged one, so the chunk is dropped for the next put."""
        if not self.drop_damaged:
            return
        tensor = kv_tensor(out)
        fits = (tensor.shape[0], *tensor.shape[-2:])
        try:
            (blob,) = storecalls.call(deadline, "check get", self.store.get_many, [blob_key(key, 0)])
            info = self.codec.inspect_chunk(blob) if blob is not None else None
        except KVCodecError:
            return  # the store or the blob cannot say: nothing is dropped on a guess
        if info is not None and (info.layers, info.kv_heads, info.head_dim) == fits:
            self._bad_chunk(
                key, m.index, FormatError(f"chunk {m.index} meta says {m.shape}; its blob holds {fits}"), stats
            )

    def _check_blob(self, blob: bytes | None, m: ChunkMeta, key: str) -> None:
        """KVCodecError unless `blob` is chunk `m` of the prefix `key` names and decodes."""
        if blob is None:
            raise StoreError(f"chunk {m.index} blob is missing")
        check_binding(m.index, self.codec.inspect_chunk(blob), m, key)
        L, H, D = m.shape
        scratch = torch.empty((L, 2, m.tokens, H, D), dtype=DTYPES[m.dtype], device=self.device)
        stage = getattr(self.codec, "stage", None)  # a staged codec verifies its streams in its first half
        if stage is not None and self.batched_restore is not False:
            stage(blob, scratch)
        else:
            self.codec.decode_chunk(blob, scratch)

    def _bad_chunk(self, key: str, index: int, error: KVCodecError, stats: FetchStats) -> None:
        stats.chunks_dropped += self._drop_damaged(key, index, error)

    def _drop_damaged(self, key: str, index: int, error: KVCodecError) -> bool:
        """Whether the chunk that fails its checks was dropped (drop_damaged on and the store answered)."""
        if not self.drop_damaged:
            log.warning("chunk %d fails its checks (%s); left in the store (drop_damaged is off)", index, error)
            return False
        log.warning("chunk %d fails its checks (%s); dropping it so the next put rewrites it", index, error)
        return self.drop_chunk(key)

    def _plan(
        self, ids, n_tokens: int, deadline, stats: FetchStats
    ) -> tuple[list[ChunkMeta], list[str], KVCodecError | None]:
        """The metas of the stored chunks covering n_tokens, in order, up to the first missing
        or unusable one (whose reason is the third item)."""
        ct = self.chunk_tokens
        n_chunks = -(-n_tokens // ct)
        keys = self.keys(ids[: min(len(ids), n_chunks * ct)])[:n_chunks]
        tm0 = time.monotonic()
        try:
            raw_metas = storecalls.call(deadline, "meta get", self.store.get_many, [meta_key(k) for k in keys])
        except KVCodecError as e:
            return [], keys, e
        stats.meta_s = time.monotonic() - tm0
        self.bandwidth.add_latency(stats.meta_s)  # one round trip of ~200 bytes per chunk
        metas: list[ChunkMeta] = []
        error: KVCodecError | None = None
        for i, raw in enumerate(list(raw_metas)[: len(keys)]):
            if raw is None:
                error = FetchError(
                    f"chunk {i} (tokens {i * ct}..) is not stored; only {i * ct} of {n_tokens} tokens can be fetched"
                )
                break
            try:
                m = self._checked_meta(raw, i)
            except FormatError as e:
                self._bad_chunk(keys[i], i, e, stats)
                error = e
                break
            if metas and (m.shape, m.dtype) != (metas[0].shape, metas[0].dtype):
                # one of the two is damaged: chunk 0's blob check tells which (see _heal_suspect)
                error = _MetaMismatchError(f"chunk {i} meta has another shape or dtype than chunk 0: {m}", i, keys[i])
                break
            metas.append(m)
        if metas and metas[-1].start_token + metas[-1].tokens < min(n_tokens, metas[-1].start_token + ct):
            error = error or FetchError("stored tail chunk is shorter than the tokens asked for")
        stats.chunks_planned = len(metas)
        return metas, keys[: len(metas)], error

    def _checked_meta(self, raw: bytes, i: int) -> ChunkMeta:
        m = ChunkMeta.from_bytes(raw)
        ct = self.chunk_tokens
        if m.index != i or m.start_token != i * ct or m.tokens > ct or m.codec != self.codec.id:
            raise FormatError(f"chunk {i} meta does not match this cache's codec and chunking: {m}")
        if self.shard is not None and m.shape[1] != self.shard.local_heads:
            raise FormatError(f"chunk {i} meta has {m.shape[1]} KV heads; {self.shard} holds {self.shard.local_heads}")
        if len(m.sizes) != len(self.codec.resolutions):
            raise FormatError(
                f"chunk {i} meta lists {len(m.sizes)} resolutions; the codec has {len(self.codec.resolutions)}"
            )
        return m

    def _check_out(self, out: Target | None, shape: tuple[int, int, int], n_tokens: int) -> None:
        """ShapeError unless the caller's target can hold n_tokens of KV of `shape` (L, H, D)."""
        if out is None:
            return
        L, H, D = shape
        if isinstance(out, PagedKV):
            p = out.pages
            if (p.shape[0], p.shape[4], p.shape[5]) != (L, H, D) or out.capacity < n_tokens:
                raise ShapeError(
                    f"pages {tuple(p.shape)} with {out.capacity} tokens of block table cannot hold "
                    f"({L}, 2, {n_tokens}, {H}, {D})"
                )
        elif out.dim() != 5 or tuple(out.shape[:2]) != (L, 2) or tuple(out.shape[3:]) != (H, D):
            raise ShapeError(f"out is {tuple(out.shape)}; the stored KV is ({L}, 2, {n_tokens}, {H}, {D})")

    def _profile_for(self, pol: ResolutionPolicy, shape, dtype, key: str | None = None) -> DecodeProfile:
        """The decode profile the policy weighs resolutions with. Calibrated only for an adaptive
        policy over several resolutions (with one there is nothing to choose), on the stored blobs
        of the chunk `key` (no encoder needed here); a calibration that fails is not retried."""
        several = len(self.codec.resolutions) > 1
        if pol.name == "adaptive" and self.profile is None and several and not self._profile_failed:
            try:
                blobs = None if key is None else (lambda: self._chunk_blobs(key))
                self.profile = load_or_calibrate(self.codec, self.device, tuple(shape), dtype, blobs=blobs)
            except Exception as e:  # noqa: BLE001 - calibration failed: fall back to a neutral prior
                self._profile_failed = True
                log.warning("decode calibration failed (%s: %s); using a default profile", type(e).__name__, e)
        return self.profile or DecodeProfile.default(self.codec.resolutions)

    def _stage_executor(self):  # noqa: ANN202 - a ThreadPoolExecutor
        if self._executor is None:
            self._executor = stage_executor(self.decode_workers, self.net_workers)
        return self._executor

    def _chunk_blobs(self, key: str) -> list[bytes] | None:
        """A stored chunk's blob at every resolution (None when one is missing)."""
        blobs = storecalls.call(
            storecalls.Deadline(10.0),
            "profile blobs",
            self.store.get_many,
            [blob_key(key, j) for j in range(len(self.codec.resolutions))],
        )
        blobs = list(blobs)
        return None if any(b is None for b in blobs) else blobs


def _head_view(out: Target, a: int, b: int) -> Target:
    """Heads [a, b) of a fetch target (a view: restores write straight into `out`)."""
    if isinstance(out, PagedKV):
        return PagedKV(out.pages[:, :, :, :, a:b], out.block_table)
    return out[:, :, :, a:b]


def _runs(indices: list[int]) -> list[list[int]]:
    """Contiguous runs of sorted indices: [1, 2, 5] -> [[1, 2], [5]]."""
    runs: list[list[int]] = []
    for i in indices:
        if runs and runs[-1][-1] == i - 1:
            runs[-1].append(i)
        else:
            runs.append([i])
    return runs
