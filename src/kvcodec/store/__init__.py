"""KV object stores chosen by URL: ``file://DIR`` (default), ``memory://``, ``redis://``,
``rediss://``, ``redis+cluster://``, and ``throttle://`` (a bandwidth-shaped wrapper for benchmarks).

    from kvcodec.store import open_store
    with open_store("redis://localhost:6379/0", socket_timeout=2.0) as st:
        st.put("k", b"v"); st.exists_many(["k", "x"])  # -> [True, False]
"""

from kvcodec.store.base import BaseStore, KVStore, check_key, open_store, redact_url, register_store, store_schemes
from kvcodec.store.deadline import DeadlineStore

__all__ = [
    "KVStore",
    "BaseStore",
    "DeadlineStore",
    "check_key",
    "open_store",
    "redact_url",
    "register_store",
    "store_schemes",
]
