"""`kvcodec ingest` encodes documents in worker processes by default (given the store's URL): the
stored objects are byte-identical to an ingest encoding on threads, and the report says where
they were encoded. A real model, real x265, real file:// stores."""

from __future__ import annotations

import pytest

from kvcodec.codecs import make_codec
from kvcodec.engine.tokens import Tokens
from kvcodec.errors import ConfigError
from kvcodec.fetcher import PrefixCache
from kvcodec.fetcher.keys import blob_key, meta_key
from kvcodec.ingest import ingest
from kvcodec.ingest.sources import Document
from kvcodec.models import model_id
from kvcodec.store import open_store

DOCS = [
    Document("mill", "The river ran past the old mill, where the miller kept a canoe tied to a post. " * 3),
    Document("light", "A lighthouse keeper counted ships at night and wrote each name in a blue book. " * 3),
]


@pytest.mark.parametrize(
    ("order", "workers"),
    [(("processes", "threads"), None), (("threads", "processes"), None), (("processes", "threads"), 2)],
)
def test_ingest_in_processes_stores_the_bytes_an_ingest_on_threads_stores(
    smollm2, tmp_path, fresh_plans, order, workers
):
    """On an empty plan cache, either first: the first run's trial decisions (layout, bit split;
    made once even while documents encode at once) land in the plan cache, which the second run's
    processes or threads read, so both code with the same plans."""
    model, tokenizer = smollm2
    stored = {}
    for where in order:
        url = f"file://{tmp_path / where}"
        cache = PrefixCache(open_store(url), model_id(model), make_codec("hevc", chunk_tokens=32, video_bits=8), "cpu")
        report = ingest(DOCS, model, tokenizer, cache, store_url=url, encode_in=where, store_workers=workers)
        s = report.to_dict()
        assert (s["stored"], s["failed"], s["encoded_in"]) == (2, 0, where) and s["kv_mb_per_s"] > 0
        keys = [k for d in DOCS for k in cache.keys(Tokens(tokenizer).encode(d.text))]
        stored[where] = [cache.store.get(meta_key(k)) for k in keys] + [cache.store.get(blob_key(k, 0)) for k in keys]
    same = [a == b for a, b in zip(stored["processes"], stored["threads"])]  # not bytes: pytest would diff them
    assert all(same) and all(stored["threads"]), same
    with pytest.raises(ConfigError):
        ingest(DOCS, model, tokenizer, cache, store_url=url, encode_in="gpu")
