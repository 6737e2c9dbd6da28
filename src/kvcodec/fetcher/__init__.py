"""Remote prefix reuse: chunk keys, PrefixCache (lookup / put / fetch) and its pipeline parts.

Public API (what the serving engine calls):
    PrefixCache(store, model_id, codec, device, *, namespace=None, policy="adaptive", max_inflight=None, ...)
        (None: the device's defaults for in-flight chunks, decode and network threads)
        .lookup(token_ids, deadline_s=None) -> matched_tokens
        .put(token_ids, kv) -> chunks_written
        .fetch(token_ids, n_tokens, out=None, deadline_s=None, *, cancelled=None) -> FetchResult
            (out: tensor or PagedKV; cancelled: a callable, True once the caller gave up)
    FetchResult(kv, tokens_restored, error, stats)   (stats.timeline: per-chunk stage times)
    chunk_keys(token_ids, model_id, codec, namespace=None, shard=None) -> list[str]
    TPShard(rank, world, kv_heads), split_kv, join_kv   (tensor parallelism: PrefixCache(..., shard=))
"""

from kvcodec.fetcher.bandwidth import BandwidthEstimator
from kvcodec.fetcher.cache import PrefixCache
from kvcodec.fetcher.keys import ChunkMeta, blob_key, chunk_keys, config_fingerprint, meta_key
from kvcodec.fetcher.pipeline import FetchPipeline
from kvcodec.fetcher.policy import (
    AdaptivePolicy,
    ChoiceContext,
    FixedPolicy,
    MinBytesPolicy,
    MinDecodePolicy,
    get_policy,
    predicted_finish,
    register_policy,
)
from kvcodec.fetcher.profile import DecodeProfile, calibrate, load_or_calibrate
from kvcodec.fetcher.shards import TPShard, join_kv, shard_heads, split_kv, tiling_shards
from kvcodec.fetcher.stats import ChunkTiming, FetchResult, FetchStats

__all__ = [
    "AdaptivePolicy",
    "BandwidthEstimator",
    "ChoiceContext",
    "ChunkMeta",
    "ChunkTiming",
    "DecodeProfile",
    "FetchPipeline",
    "FetchResult",
    "FetchStats",
    "FixedPolicy",
    "MinBytesPolicy",
    "MinDecodePolicy",
    "PrefixCache",
    "TPShard",
    "blob_key",
    "calibrate",
    "chunk_keys",
    "config_fingerprint",
    "get_policy",
    "join_kv",
    "load_or_calibrate",
    "meta_key",
    "predicted_finish",
    "register_policy",
    "shard_heads",
    "split_kv",
    "tiling_shards",
]
