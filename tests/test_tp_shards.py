"""Tensor-parallel shards: the head-split rule (vLLM / SGLang), split / join, keys per head range,
and PrefixCache ranks (threads) putting and fetching only their heads through a real file://
store and a real redis-server, with the real HEVC codec."""

from __future__ import annotations

import threading

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcodec.codecs.hevc.codec import HevcCodec
from kvcodec.config import CodecConfig
from kvcodec.errors import ConfigError, FormatError, ShapeError
from kvcodec.fetcher import DecodeProfile, PrefixCache, blob_key, chunk_keys, meta_key
from kvcodec.fetcher.shards import TPShard, join_kv, shard_heads, split_kv, tiling_shards
from kvcodec.store import open_store

# no plain fallback: a shard's chunk and the full chunk are both int8-coded whatever their sizes
# (the plain threshold would otherwise decide per shard)
CFG = CodecConfig(
    quant="int8", chunk_tokens=32, resolutions=((256, 256),), search_layout=False, video_bits=3, plain_fallback=False
)


def tp_pairs():
    """(world, kv_heads) pairs the TP rule accepts: heads split evenly, or each head replicated."""
    k, m = st.integers(1, 6), st.integers(1, 6)
    return st.one_of(
        st.tuples(k, m).map(lambda t: (t[0], t[0] * t[1])), st.tuples(k, m).map(lambda t: (t[0] * t[1], t[0]))
    )


def make_kv(tokens=80, layers=2, heads=4, dim=64, seed=0):
    g = torch.Generator().manual_seed(seed)
    scale = torch.exp(torch.randn((layers, 2, 1, heads, dim), generator=g))
    return (torch.randn((layers, 2, tokens, heads, dim), generator=g) * scale).half()


def ids_for(n):
    return list(range(500, 500 + n))


def cache(store, shard=None, **kw):
    return PrefixCache(
        store,
        "m7b",
        HevcCodec(CFG),
        "cpu",
        shard=shard,
        policy="fixed:0",
        profile=DecodeProfile.default(CFG.resolutions),
        **kw,
    )


# -- the rule and the pure functions ---------------------------------------------------------------
@given(tp_pairs())
def test_heads_cover_every_head_evenly(pair):
    world, kv_heads = pair
    spans = [shard_heads(r, world, kv_heads) for r in range(world)]
    held = [h for a, b in spans for h in range(a, b)]
    assert set(held) == set(range(kv_heads))
    assert all(b - a == max(1, kv_heads // world) for a, b in spans)
    assert all(held.count(h) == max(1, world // kv_heads) for h in range(kv_heads))
    assert [a for a, _ in spans] == sorted(a for a, _ in spans)  # rank order, replicas consecutive


@given(tp_pairs())
def test_replicated_heads_follow_the_vllm_rule(pair):
    world, kv_heads = pair
    for r in range(world):
        a, b = shard_heads(r, world, kv_heads)
        if kv_heads < world:
            assert (a, b) == (r * kv_heads // world, r * kv_heads // world + 1)
        else:
            assert (a, b) == (r * kv_heads // world, (r + 1) * kv_heads // world)


@pytest.mark.parametrize(
    "rank, world, kv_heads", [(2, 2, 8), (-1, 2, 8), (0, 3, 8), (0, 4, 6), (0, 0, 8), (0, 2, 0), (True, 2, 8)]
)
def test_impossible_shards_are_config_errors(rank, world, kv_heads):
    with pytest.raises(ConfigError):
        TPShard(rank, world, kv_heads)


@settings(max_examples=40, deadline=None)
@given(
    tp_pairs(), st.integers(1, 5), st.integers(1, 3), st.sampled_from([torch.float16, torch.bfloat16, torch.float32])
)
def test_split_then_join_is_identity(pair, tokens, dim, dtype):
    world, kv_heads = pair
    kv = torch.randn((2, 2, tokens, kv_heads, dim)).to(dtype)
    parts = split_kv(kv, world)
    assert len(parts) == world
    for r, part in enumerate(parts):
        assert part.is_contiguous()
        assert torch.equal(part, TPShard(r, world, kv_heads).take(kv))
    assert torch.equal(join_kv(parts, kv_heads), kv)


def test_join_refuses_wrong_heads_shapes_and_disagreeing_replicas():
    kv = make_kv(tokens=4, heads=2)
    parts = split_kv(kv, 4)  # each head on two ranks
    with pytest.raises(ShapeError, match="rank 1 of 4 holds heads 0..0"):
        join_kv([parts[0], kv, parts[2], parts[3]], 2)
    with pytest.raises(ShapeError, match="rank 3"):
        join_kv([parts[0], parts[1], parts[2], parts[3][:, :, :2]], 2)
    bad = parts[3].clone()
    bad[0, 0, 0, 0, 0] += 1
    with pytest.raises(ShapeError, match="replica"):
        join_kv([parts[0], parts[1], parts[2], bad], 2)
    with pytest.raises(ShapeError):
        TPShard(0, 2, 4).take(kv)  # kv has 2 heads, the shard takes from 4


def test_keys_name_the_head_range_not_the_rank():
    ids = ids_for(100)
    codec = HevcCodec(CFG)
    plain = chunk_keys(ids, "m", codec)
    assert chunk_keys(ids, "m", codec, shard=TPShard(0, 1, 8)) == plain  # every head: the unsharded keys
    halves = [chunk_keys(ids, "m", codec, shard=TPShard(r, 2, 8)) for r in range(2)]
    assert len({tuple(plain), *map(tuple, halves)}) == 3
    assert not set(halves[0]) & set(halves[1])
    # the same heads under another TP degree, and replicas, share keys
    assert chunk_keys(ids, "m", codec, shard=TPShard(3, 8, 8)) == chunk_keys(ids, "m", codec, shard=TPShard(6, 16, 8))
    assert chunk_keys(ids, "m", codec, shard=TPShard(6, 16, 8)) == chunk_keys(ids, "m", codec, shard=TPShard(7, 16, 8))
    # a namespace and a head range are different fields
    assert chunk_keys(ids, "m", codec, namespace="tp-heads:0:4/8") != halves[0]


# -- ranks as threads over real stores -------------------------------------------------------------
def run_ranks(fn, world):
    """fn(rank) on `world` threads at once; their results in rank order (re-raises a failure)."""
    results, errors = [None] * world, []

    def one(r):
        try:
            results[r] = fn(r)
        except BaseException as e:  # noqa: BLE001 - re-raised below
            errors.append(e)

    threads = [threading.Thread(target=one, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return results


def fetch_rank(store, shard, ids):
    c = cache(store, shard)
    assert c.lookup(ids) == len(ids)
    res = c.fetch(ids)
    assert res.error is None and res.tokens_restored == len(ids)
    assert res.kv.shape[3] == shard.local_heads
    return res.kv


def full_restore(store, ids, kv):
    c = cache(store)
    c.put(ids, kv)
    res = c.fetch(ids)
    assert res.error is None
    return res.kv


@pytest.mark.parametrize("world", [2, 4])
def test_tp1_producer_serves_tp_ranks_over_file_store(tmp_path, world):
    """A TP=1 producer stores the full KV sharded; each rank (a thread) fetches only its heads;
    the joined ranks restore exactly what a TP=1 consumer restores (per-channel quantization
    does not see the other heads)."""
    store = open_store(f"file://{tmp_path / 'store'}")
    kv, ids = make_kv(tokens=80, heads=4), ids_for(80)
    written = cache(store).put_sharded(ids, kv, world)
    assert written == world * 3  # 3 chunks of 32 tokens per shard
    assert cache(store).put_sharded(ids, kv, world) == 0
    parts = run_ranks(lambda r: fetch_rank(store, TPShard(r, world, 4), ids), world)
    reference = full_restore(open_store("memory://"), ids, kv)
    assert torch.equal(join_kv(parts, 4), reference)
    assert (reference.float() - kv.float()).abs().max() < 0.05 * kv.float().abs().max()


def test_tp_ranks_put_and_fetch_their_own_heads_over_file_store(tmp_path):
    """TP=2 ranks each put their local KV and fetch it back; another TP degree's shard finds
    nothing stored for its heads (the store never mixes head ranges)."""
    store = open_store(f"file://{tmp_path / 'store'}")
    kv, ids = make_kv(tokens=64, heads=4), ids_for(64)
    shards = TPShard.all(2, 4)
    assert run_ranks(lambda r: cache(store, shards[r]).put(ids, shards[r].take(kv)), 2) == [2, 2]
    parts = run_ranks(lambda r: fetch_rank(store, shards[r], ids), 2)
    assert torch.equal(join_kv(parts, 4), full_restore(open_store("memory://"), ids, kv))
    assert cache(store, TPShard(0, 4, 4)).lookup(ids) == 0
    assert cache(store).lookup(ids) == 0  # a TP=1 consumer: the full heads were never stored


@pytest.mark.redis
def test_replicated_heads_over_redis(redis_server):
    """kv_heads < world: 4 ranks over 2 heads; each head is stored once and fetched by both of its replicas."""
    store = open_store(redis_server.url)
    kv, ids = make_kv(tokens=40, heads=2), ids_for(40)
    assert cache(store).put_sharded(ids, kv, 4) == 2 * 2
    parts = run_ranks(lambda r: fetch_rank(store, TPShard(r, 4, 2), ids), 4)
    assert torch.equal(parts[0], parts[1]) and torch.equal(parts[2], parts[3])
    assert torch.equal(join_kv(parts, 2), full_restore(open_store("memory://"), ids, kv))


# -- mismatches are clear errors -------------------------------------------------------------------
def test_a_rank_refuses_full_or_foreign_kv_and_targets():
    store = open_store("memory://")
    kv, ids = make_kv(tokens=32, heads=4), ids_for(32)
    shard = TPShard(1, 2, 4)
    c = cache(store, shard)
    with pytest.raises(ShapeError, match=r"rank 1 of 2 holds heads 2..3 of 4"):
        c.put(ids, kv)
    with pytest.raises(ShapeError, match="holds"):
        c.put(ids, TPShard(1, 4, 4).take(kv))  # another world's shard
    c.put(ids, shard.take(kv))
    with pytest.raises(ShapeError, match="out has 4 KV heads"):
        c.fetch(ids, out=torch.empty_like(kv))
    with pytest.raises(ConfigError):
        cache(store, shard).put_sharded(ids, kv, 2)
    with pytest.raises(ConfigError):
        cache(store, shard="rank 1")


def test_a_chunk_of_other_heads_under_a_shards_key_is_refused():
    """A store serving chunks of the wrong heads under a shard's keys: the fetch stops with a
    FormatError (nothing restored, the chunk dropped), it never hands back other heads."""
    store = open_store("memory://")
    kv, ids = make_kv(tokens=32, heads=4), ids_for(32)
    full = cache(store)
    full.put(ids, kv)
    shard = TPShard(0, 2, 4)
    [k_full], [k_shard] = full.keys(ids), cache(store, shard).keys(ids)
    for name in (blob_key(k_full, 0), meta_key(k_full)):
        store.put(name.replace(k_full, k_shard), store.get(name))
    res = cache(store, shard).fetch(ids)
    assert res.tokens_restored == 0 and isinstance(res.error, FormatError)
    assert "4 KV heads" in str(res.error)
    assert cache(store, shard).lookup(ids) == 0  # dropped: the next put rewrites it


# -- reading chunks stored by another TP degree ---------------------------------------------------
@given(tp_pairs(), st.data())
def test_tiling_shards_cover_a_range_exactly_or_refuse(pair, data):
    """A holder reads its heads from stored shards when their bounds fall on its range's bounds;
    otherwise (a stored shard straddles the range) it is a ConfigError."""
    world, kv_heads = pair
    own_world = data.draw(st.sampled_from([d for d in range(1, world * 2 + 1) if valid_tp(d, kv_heads)]))
    own = TPShard(data.draw(st.integers(0, own_world - 1)), own_world, kv_heads)
    per = max(1, kv_heads // world)  # heads per stored shard
    fine = own.heads.start % per == 0 and own.heads.stop % per == 0
    if fine:
        tiles = tiling_shards(own.heads, world, kv_heads)
        assert [h for s in tiles for h in s.heads] == list(own.heads)
    else:
        with pytest.raises(ConfigError):
            tiling_shards(own.heads, world, kv_heads)


def valid_tp(world, kv_heads):
    try:
        TPShard(0, world, kv_heads)
    except ConfigError:
        return False
    return True


def test_tp1_consumer_reads_what_tp_ranks_stored(tmp_path):
    """TP=2 ranks each put their own heads; a TP=1 consumer (and a TP=2 rank of a TP=4 store)
    restores its heads from those shards, bit for bit what a TP=1 store restores."""
    store = open_store(f"file://{tmp_path / 'store'}")
    kv, ids = make_kv(tokens=64, heads=4), ids_for(64)
    for world in (2, 4):
        for shard in TPShard.all(world, 4):
            cache(store, shard).put(ids, shard.take(kv))
    reference = full_restore(open_store("memory://"), ids, kv)
    full = cache(store, TPShard(0, 1, 4))
    assert full.lookup(ids) == 0 and full.lookup_sharded(ids, 2) == 64
    res = full.fetch_sharded(ids, 2)
    assert res.error is None and res.tokens_restored == 64 and torch.equal(res.kv, reference)
    out = torch.zeros_like(kv)
    res = full.fetch_sharded(ids, 4, out=out)
    assert res.kv is out and torch.equal(out, reference) and res.stats.chunks_restored == 4 * 2
    rank1 = cache(store, TPShard(1, 2, 4))
    assert torch.equal(rank1.fetch_sharded(ids, 4).kv, reference[:, :, :, 2:4])
    with pytest.raises(ConfigError, match="do not tile"):
        cache(store, TPShard(3, 4, 4)).fetch_sharded(ids, 2)
    with pytest.raises(ShapeError):
        full.fetch_sharded(ids, 2, out=torch.empty_like(kv[:, :, :, :2]))
    with pytest.raises(ConfigError):
        cache(store).fetch_sharded(ids, 2)


def test_fetch_sharded_stops_at_the_shortest_shard():
    store = open_store("memory://")
    kv, ids = make_kv(tokens=96, heads=4), ids_for(96)
    for shard in TPShard.all(2, 4):
        cache(store, shard).put(ids, shard.take(kv))
    shard1 = cache(store, TPShard(1, 2, 4))
    store.delete(meta_key(shard1.keys(ids)[1]))  # shard 1 keeps only its first 32 tokens
    full = cache(store, TPShard(0, 1, 4))
    assert full.lookup_sharded(ids, 2) == 32
    res = full.fetch_sharded(ids, 2)
    assert res.tokens_restored == 32 and res.error is not None
