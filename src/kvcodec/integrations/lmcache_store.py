"""An LMCache L2 adapter on any kvcodec store (file://, redis://, ...), loaded as LMCache's
"plugin" adapter type:

    --l2-adapter '{"type": "plugin", "module_path": "kvcodec.integrations.lmcache_store",
                   "class_name": "KVCodecStoreL2Adapter",
                   "adapter_params": {"url": "redis://127.0.0.1:6379/0"},
                   "serde": {"type": "kvcodec", "quant": "int8"}}'

Why it exists: LMCache 0.5.6's own adapters (fs, resp) load an object only when its stored size
equals the load buffer, which the serde wrapper sizes from the serde's upper bound; a coded
object is smaller, so they store it and then never load it. This adapter keeps each object's
own length and loads it into the front of the buffer. Importing this module also registers the
"kvcodec" serde, so the config line above is all LMCache needs.
"""

from __future__ import annotations

import logging
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from lmcache.lmcache_native import Bitmap
from lmcache.v1.distributed.api import KeyEntry, KeyListPage, MemoryLayoutDesc, ObjectKey
from lmcache.v1.distributed.internal_api import L2StoreResult
from lmcache.v1.distributed.l2_adapters.base import L2AdapterInterface, L2TaskId
from lmcache.v1.memory_management import MemoryObj
from lmcache.v1.platform import create_event_notifier

import kvcodec.integrations.lmcache_plugin  # noqa: F401  (registers the "kvcodec" serde)
from kvcodec.config import whole_number
from kvcodec.errors import ConfigError, KVCodecError
from kvcodec.store import open_store
from kvcodec.store.keys import field_text, key_field

log = logging.getLogger(__name__)


# The keys' scheme, a segment of every key: the first scheme wrote a character outside the safe set
# as its code in as many hex digits as it took, so its "=100" (U+0100) reads in this one as
# "\x10" + "0". Its keys have no such segment, so none of them is read as an object of this scheme.
KEY_SCHEME = "k2"


def store_key(key: ObjectKey, prefix: str = "lmcache") -> str:
    """A kvcodec store key for an LMCache ObjectKey (every field, injectively)."""
    fields = [key_field(key.model_name), str(key.kv_rank), str(key.object_group_id), key_field(key.cache_salt)]
    return "/".join([prefix, KEY_SCHEME, *fields, key.chunk_hash.hex()])


def object_key(stored: str, prefix: str = "lmcache") -> ObjectKey | None:
    """store_key's inverse: the ObjectKey a store key was made from; None for any other key."""
    parts = stored.split("/")
    head = [*prefix.split("/"), KEY_SCHEME]
    if len(parts) != len(head) + 5 or parts[: len(head)] != head:
        return None
    model, rank, group, salt, digest = parts[len(head) :]
    try:
        key = ObjectKey(bytes.fromhex(digest), field_text(model), int(rank), int(group), field_text(salt))
    except ValueError:
        return None
    return key if store_key(key, prefix) == stored else None


class KVCodecStoreL2Adapter(L2AdapterInterface):
    """LMCache L2 adapter over `kvcodec.store.open_store(url)`. Objects are immutable in the store,
    so lookup-and-lock is an existence check and unlock has nothing to release."""

    def __init__(self, params: dict[str, Any], **_: Any) -> None:
        super().__init__(_at_least(params.get("max_capacity_bytes", 0), "adapter_params.max_capacity_bytes", 0))
        workers = _at_least(params.get("workers", 2), "adapter_params.workers", 1)
        url = params.get("url")
        if not isinstance(url, str) or not url:
            raise ConfigError("KVCodecStoreL2Adapter needs adapter_params.url (a kvcodec store URL)")
        options = {k: v for k, v in params.items() if k not in ("url", "workers", "max_capacity_bytes", "prefix")}
        self._store = open_store(url, **options)
        self._prefix = str(params.get("prefix", "lmcache"))
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="kvcodec-l2")
        self._lock = threading.Lock()
        self._next_id = 0
        self._efds = {op: create_event_notifier() for op in ("store", "lookup", "load")}
        self._done: dict[str, dict[L2TaskId, Any]] = {op: {} for op in self._efds}
        self._failing: str | None = None  # the last store operation's failure, until one succeeds

    def get_store_event_fd(self) -> int:
        return self._efds["store"].fileno()

    def get_lookup_and_lock_event_fd(self) -> int:
        return self._efds["lookup"].fileno()

    def get_load_event_fd(self) -> int:
        return self._efds["load"].fileno()

    def submit_store_task(self, keys: list[ObjectKey], objects: list[MemoryObj]) -> L2TaskId:
        return self._submit("store", self._store_objects, keys, objects)

    def pop_completed_store_tasks(self) -> dict[L2TaskId, L2StoreResult]:
        with self._lock:
            done, self._done["store"] = self._done["store"], {}
        return done

    def submit_lookup_and_lock_task(
        self, keys: list[ObjectKey], group_layout_descs: dict[int, MemoryLayoutDesc]
    ) -> L2TaskId:
        return self._submit("lookup", self._lookup, keys)

    def query_lookup_and_lock_result(self, task_id: L2TaskId) -> Bitmap | None:
        return self._pop("lookup", task_id)

    def submit_unlock(self, keys: list[ObjectKey]) -> None:
        return None

    def submit_load_task(self, keys: list[ObjectKey], objects: list[MemoryObj]) -> L2TaskId:
        return self._submit("load", self._load, keys, objects)

    def query_load_result(self, task_id: L2TaskId) -> Bitmap | None:
        return self._pop("load", task_id)

    def delete(self, keys: list[ObjectKey]) -> None:
        """Called from LMCache's eviction thread, which does not survive an exception: a store that
        fails deletes nothing and says so in report_status."""
        try:
            sizes = [self._store.size(store_key(k, self._prefix)) or 0 for k in keys]
            gone = [(k, s) for k, s in zip(keys, sizes) if self._store.delete(store_key(k, self._prefix))]
        except KVCodecError as e:
            self._failed("delete", e)
            return
        self._failing = None
        if gone:
            self._notify_keys_deleted([k for k, _ in gone], [s for _, s in gone])

    def list_l2_keys(
        self, model_name: str | None = None, page_size: int = 500, cursor: str | None = None
    ) -> KeyListPage:
        """The stored objects' keys and sizes, a page at a time in key order (LMCache's object
        service); the cursor is the last store key of the previous page. Each page lists the store's
        keys under the prefix again (a directory walk, a Redis SCAN) and asks each object's size on
        it: for an operator's occasional listing, not for a request's path."""
        if page_size <= 0:
            raise ValueError(f"page_size must be positive (got {page_size})")
        under = f"{self._prefix}/{KEY_SCHEME}/" + ("" if model_name is None else key_field(model_name) + "/")
        if cursor is not None and (not cursor.startswith(under) or object_key(cursor, self._prefix) is None):
            raise ValueError(f"not a cursor of this listing: {cursor!r}")
        try:
            names = sorted({k for k in self._store.list(under) if cursor is None or k > cursor})  # a SCAN may repeat
            entries = []
            for name in names:
                key = object_key(name, self._prefix)
                size = None if key is None else self._store.size(name)
                if size is not None:  # not an object's key, or gone since the listing: skipped
                    entries.append(KeyEntry(key=key.to_encoded_object_key(), size_bytes=size))
                if len(entries) == page_size:
                    return KeyListPage(tuple(entries), name if name != names[-1] else None)
        except KVCodecError as e:
            raise RuntimeError(f"kvcodec L2 listing failed: {e}") from e
        return KeyListPage(tuple(entries), None)

    def close(self) -> None:
        self._pool.shutdown(wait=True)
        self._store.close()
        for efd in self._efds.values():
            efd.close()

    def report_status(self) -> dict:
        status = {"is_healthy": self._failing is None, "type": type(self).__name__, "store": repr(self._store)}
        return status if self._failing is None else {**status, "error": self._failing}

    def _failed(self, op: str, error: Exception) -> None:
        self._failing = f"{op}: {error}"
        log.warning("kvcodec L2 %s failed: %s", op, error)

    # -- work, on the adapter's threads ------------------------------------------------------
    def _store_objects(self, keys: list[ObjectKey], objects: list[MemoryObj]) -> L2StoreResult:
        items = {store_key(k, self._prefix): bytes(o.byte_array) for k, o in zip(keys, objects, strict=True)}
        self._store.put_many(items)
        self._notify_keys_stored(list(keys), [len(v) for v in items.values()])
        return L2StoreResult(True, sum(len(v) for v in items.values()))

    def _lookup(self, keys: list[ObjectKey]) -> Bitmap:
        bitmap = Bitmap(len(keys))
        for i, hit in enumerate(self._store.exists_many([store_key(k, self._prefix) for k in keys])):
            if hit:
                bitmap.set(i)
        return bitmap

    def _load(self, keys: list[ObjectKey], objects: list[MemoryObj]) -> Bitmap:
        bitmap = Bitmap(len(keys))
        blobs = self._store.get_many([store_key(k, self._prefix) for k in keys])
        for i, (blob, obj) in enumerate(zip(blobs, objects, strict=True)):
            buf = obj.byte_array.cast("B")  # ctypes exposes '<B', which slice assignment refuses
            if blob is not None and len(blob) <= len(buf):
                buf[: len(blob)] = blob
                bitmap.set(i)
        hits = [keys[i] for i in bitmap.get_indices_list()]
        if hits:
            self._notify_keys_accessed(hits)
        return bitmap

    def _submit(self, op: str, fn, *args) -> L2TaskId:
        with self._lock:
            task_id = self._next_id
            self._next_id += 1
        self._pool.submit(self._run, op, task_id, fn, *args)
        return task_id

    def _run(self, op: str, task_id: L2TaskId, fn, keys: list[ObjectKey], *rest) -> None:
        try:
            result = fn(keys, *rest)
            self._failing = None
        except Exception as e:  # noqa: BLE001 - a failed batch is reported to LMCache, which treats it as a miss
            self._failed(op, e)
            result = L2StoreResult(False, 0) if op == "store" else Bitmap(len(keys))
        with self._lock:
            self._done[op][task_id] = result
        self._efds[op].notify()

    def _pop(self, op: str, task_id: L2TaskId):
        with self._lock:
            return self._done[op].pop(task_id, None)


def _at_least(value: Any, name: str, least: int) -> int:
    n = whole_number(value, name)
    if n < least:
        raise ConfigError(f"{name} must be >= {least}; got {value!r}")
    return n
