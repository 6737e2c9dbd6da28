"""The store half of the reliability fuzzer (reliability.py): damage one stored entry of a real
prefix, fetch it through PrefixCache, and check that every restored token is exact, that the
fetch stops with an error instead of serving wrong or foreign data, and that the next put heals
the store (a fetch after it restores the whole prefix)."""

from __future__ import annotations

import json
import random
import time

import torch
from reliability import LOOSE, STRICT, Tally, m_bitflip, m_resize, mutate_json

from kvcodec import CodecConfig
from kvcodec.dtypes import SAME_SIZE_INT
from kvcodec.fetcher import PrefixCache, blob_key, meta_key
from kvcodec.store.memory import MemoryStore

MODEL = "fuzz-model"


def _cache(store, chunk_tokens: int) -> PrefixCache:
    config = CodecConfig(quant="int8", chunk_tokens=chunk_tokens, resolutions=((144, 144),))
    return PrefixCache(store, MODEL, config, "cpu", policy="fixed:0")


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(a.view(SAME_SIZE_INT[a.dtype]), b.view(SAME_SIZE_INT[b.dtype]))


def _edit_meta(rng: random.Random, raw: bytes) -> bytes:
    d = json.loads(raw)
    mutate_json(rng, d)
    return json.dumps(d).encode()


def _mutations(keys: list[str], other_keys: list[str]):
    """category -> (allowed outcomes, edit(rng, store, snapshot) -> None)."""

    def blob(rng):
        return blob_key(rng.choice(keys), 0)

    def damage(fn):
        def edit(rng, st, snap):
            k = blob(rng)
            st.put(k, fn(rng, snap[k]))

        return edit

    def swap(rng, st, snap):
        a, b = rng.sample(range(len(keys)), 2)
        st.put(blob_key(keys[a], 0), snap[blob_key(keys[b], 0)])

    def foreign(rng, st, snap):
        i = rng.randrange(min(len(keys), len(other_keys)))
        st.put(blob_key(keys[i], 0), snap[blob_key(other_keys[i], 0)])

    def meta(rng, st, snap):
        k = meta_key(rng.choice(keys))
        st.put(k, _edit_meta(rng, snap[k]))

    def missing(rng, st, snap):
        st.delete(blob(rng))

    return {
        "store-blob-bitflip": (STRICT, damage(m_bitflip)),
        "store-blob-resize": (STRICT, damage(m_resize)),
        "store-blob-swap": (STRICT, swap),
        "store-blob-foreign": (STRICT, foreign),
        "store-meta-edit": (LOOSE - {"altered"}, meta),
        "store-blob-missing": (STRICT, missing),
    }


def fuzz_store(
    kv: torch.Tensor, chunk_tokens: int, seed: int, cases: int, seconds: float | None = None, min_cases: int = 0
) -> Tally:
    """Up to `cases` store mutations, round-robin over the categories; after `min_cases`, stop
    once `seconds` have passed."""
    ids = torch.arange(kv.shape[2]) + 1000
    other_ids = ids + 7  # another prefix of the same model and length
    base = MemoryStore()
    cache = _cache(base, chunk_tokens)
    cache.put(ids, kv)
    cache.put(other_ids, kv.flip(2).contiguous())
    snapshot = {k: base.get(k) for k in base.list()}
    clean = cache.fetch(ids).kv.clone()
    mutations = _mutations(cache.keys(ids), cache.keys(other_ids))
    names = list(mutations)
    rng, tally = random.Random(seed), Tally()
    end = None if seconds is None else time.monotonic() + seconds
    for n in range(cases):
        if n >= min_cases and end is not None and time.monotonic() > end:
            break
        category = names[n % len(names)]
        allowed, edit = mutations[category]
        case_seed = rng.randrange(2**32)
        st = MemoryStore()
        st.put_many(snapshot)
        edit(random.Random(case_seed), st, snapshot)
        t0 = time.monotonic()
        outcome = _fetch_and_heal(st, chunk_tokens, ids, kv, clean)
        tally.add(category, outcome, allowed, time.monotonic() - t0, f"case seed {case_seed}")
    return tally


def _fetch_and_heal(st, chunk_tokens: int, ids, kv, clean) -> str:
    cache = _cache(st, chunk_tokens)
    try:
        res = cache.fetch(ids, deadline_s=30.0)
        n = res.tokens_restored
        if res.kv is None:  # nothing could be planned (e.g. an unreadable meta of chunk 0)
            if n:
                return f"altered:{n} tokens reported restored without a result tensor"
        elif not _same(res.kv[:, :, :n], clean[:, :, :n]):
            return "altered:restored tokens differ from the stored prefix (wrong or foreign data)"
        outcome = "original" if n == len(ids) and res.error is None else "error"
        cache.put(ids, kv)
        healed = cache.fetch(ids, deadline_s=30.0)
        if healed.tokens_restored != len(ids) or not _same(healed.kv, clean):
            return f"unhealed:after a put the fetch restored {healed.tokens_restored} of {len(ids)} ({healed.error})"
        return outcome
    except Exception as e:  # noqa: BLE001 - fetch and put must not raise for stored-data damage
        return f"crash:{type(e).__name__}:{str(e)[:80]}"
