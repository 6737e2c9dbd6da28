"""SGLang HiCache storage backend: HiCache pages coded with kvcodec on any kvcodec store.

    python -m sglang.launch_server ... --enable-hierarchical-cache \\
        --hicache-storage-backend dynamic \\
        --hicache-storage-backend-extra-config '{"backend_name": "kvcodec",
            "module_path": "kvcodec.integrations.sglang_hicache", "class_name": "KVCodecHiCacheStorage",
            "url": "redis://127.0.0.1:6379/0", "quant": "int8"}'

Pages are small (page_size tokens), and a kvcodec chunk that small loses much of its ratio (see
docs/integrations/sglang.md), so the pages of one batch_set are coded together in groups of
`group_tokens` tokens: the group's blob is stored once, and each page key holds a small pointer
(group key, index). Reading a page decodes its whole group; a batch_get decodes each group once.

Options in the extra config (besides SGLang's backend_name / module_path / class_name): `url`
(required), `codec` ("hevc") and its options (`quant`, `video_bits`, ...), `resolution`
("256x256"), `group_tokens`, `device` ("auto": NVDEC on CUDA where present), `prefix`.
"""

from __future__ import annotations

import hashlib
import logging
import threading
from typing import Any

import torch
from sglang.srt.mem_cache.hicache_storage import (
    HiCacheStorage,
    HiCacheStorageConfig,
    HiCacheStorageExtraInfo,
    PoolTransferResult,
)

from kvcodec.codecs import ChunkCodec, make_codec
from kvcodec.codecs.base import decode_chunk_as
from kvcodec.config import one_resolution, whole_number
from kvcodec.errors import ConfigError, FormatError, KVCodecError, ShapeError, StoreError
from kvcodec.integrations.sglang_pages import (
    PageGeometry,
    PagePointer,
    canonical_to_page,
    group_spans,
    page_to_canonical,
)
from kvcodec.store import open_store
from kvcodec.store.keys import key_field

logger = logging.getLogger(__name__)

DEFAULT_GROUP_TOKENS = 256
_SGLANG_KEYS = {"backend_name", "module_path", "class_name", "interface_v1"}
_OWN_KEYS = {"url", "codec", "resolution", "group_tokens", "device", "prefix", "store_options"}


class KVCodecHiCacheStorage(HiCacheStorage):
    """HiCacheStorage over `kvcodec.store.open_store(url)`, pages coded in groups (generic
    get/set interface: SGLang copies pages between its host pool and the tensors given here)."""

    def __init__(self, storage_config: HiCacheStorageConfig, kwargs: dict | None = None) -> None:
        extra = dict(storage_config.extra_config or {})
        if extra.get("interface_v1"):  # SGLang would call batch_get_v1 / batch_set_v1, which this backend has not
            raise ConfigError(
                "the kvcodec HiCache backend implements the generic get/set interface: leave out interface_v1"
            )
        if storage_config.is_mla_model:
            raise ConfigError("the kvcodec HiCache backend supports MHA/GQA host pools, not MLA")
        url = extra.get("url")
        if not isinstance(url, str) or not url:
            raise ConfigError("the kvcodec HiCache backend needs 'url' (a kvcodec store URL) in the extra config")
        self.group_tokens = whole_number(extra.get("group_tokens", DEFAULT_GROUP_TOKENS), "group_tokens")
        if self.group_tokens < 1:
            raise ConfigError(f"group_tokens must be >= 1; got {self.group_tokens}")
        self.codec_name = str(extra.get("codec", "hevc"))
        options = {k: v for k, v in extra.items() if k not in _SGLANG_KEYS | _OWN_KEYS}
        if "chunk_tokens" in options or "resolutions" in options:
            raise ConfigError("set group_tokens and resolution, not chunk_tokens / resolutions")
        if "resolution" in extra or self.codec_name == "hevc":
            options["resolutions"] = (one_resolution(extra.get("resolution", "256x256")),)
        self.codec_options = options
        make_codec(self.codec_name, **options, chunk_tokens=self.group_tokens)  # bad options fail at startup
        device = str(extra.get("device", "auto"))
        self.device = torch.device(("cuda" if torch.cuda.is_available() else "cpu") if device == "auto" else device)
        shard = f"tp{storage_config.tp_rank}of{storage_config.tp_size}"
        if storage_config.pp_size > 1:
            shard += f"-pp{storage_config.pp_rank}of{storage_config.pp_size}"
        model = key_field(storage_config.model_name or "model")
        self.prefix = f"{key_field(str(extra.get('prefix', 'sglang')))}/{model}/{shard}"
        self.store = open_store(url, **dict(extra.get("store_options", {})))
        self.geometry: PageGeometry | None = None
        self.refused: str | None = None  # why an attach was refused (_refuse_sidecars): every call a miss
        self._codecs: dict[int, ChunkCodec] = {}
        self._lock = threading.Lock()

    # -- registration ---------------------------------------------------------------------
    def register_mem_pool_host(self, mem_pool_host) -> None:
        super().register_mem_pool_host(mem_pool_host)
        self.geometry = PageGeometry(
            layout=mem_pool_host.layout,
            layers=mem_pool_host.layer_num,
            page_size=mem_pool_host.page_size,
            heads=mem_pool_host.head_num,
            head_dim=mem_pool_host.head_dim,
            dtype=mem_pool_host.dtype,
        )

    def register_mem_host_pool_v2(self, host_pool, host_pool_name) -> None:  # noqa: ANN001
        """A hybrid model's host pools (the KV anchor, and Mamba or sliding-window state or an
        indexer beside it). Only the KV pool is stored here: SGLang would read and write the others
        through batch_exists_v2 / batch_get_v2 / batch_set_v2, which this backend has not. One that
        comes after the attach (a dynamic sidecar) is refused at once."""
        super().register_mem_host_pool_v2(host_pool, host_pool_name)
        if getattr(self, "_pools_final", False):
            self._refuse_sidecars()

    def on_host_pools_registered(self) -> None:
        """The attach's pools are all registered: one besides the KV pool fails the attach here,
        not the first prefetch. At a server's start that stops the server with this error. SGLang's
        hybrid controller calls this after its attach has already enabled the backend, so a refused
        attach at run time leaves the backend attached: it then answers every call as a miss (refused),
        and needs a detach before another backend can attach."""
        self._pools_final = True
        self._refuse_sidecars()

    def _refuse_sidecars(self) -> None:
        kv_pool = getattr(self, "mem_pool_host", None)
        others = sorted(
            str(name) for name, pool in getattr(self, "registered_pools", {}).items() if pool is not kv_pool
        )
        if others:
            self.refused = (
                f"the kvcodec HiCache backend stores the KV host pool only, not this model's {', '.join(others)} "
                "pool(s) (a hybrid model's state or indexer): run it without the kvcodec storage backend"
            )
            raise ConfigError(self.refused)

    # -- HiCacheStorage -------------------------------------------------------------------
    def get(self, key: str, target_location: Any | None = None, target_sizes: Any | None = None):
        return self.batch_get([key], [target_location])[0]

    def batch_get(self, keys: list[str], target_locations: Any | None = None, target_sizes: Any | None = None):
        if self.refused:
            return [None] * len(keys)
        g = self._geometry()
        targets = list(target_locations) if target_locations is not None else [None] * len(keys)
        out: list[torch.Tensor | None] = [None] * len(keys)
        unreadable: list[int] = []  # pages whose pointer or group is damaged or lost: forgotten below
        try:
            pointers, unreadable = self._pointers(keys)
            groups: dict[tuple[str, int], list[int]] = {}  # by what the pointers say: key and size of their group
            for i, p in enumerate(pointers):
                if p is not None:
                    groups.setdefault((p.group_key, p.pages), []).append(i)
            names = list(dict.fromkeys(k for k, _ in groups))
            blobs = dict(zip(names, self.store.get_many(names)))
            for (group_key, _), members in groups.items():
                try:
                    if blobs[group_key] is None:
                        raise StoreError(f"group {group_key} is gone from the store")
                    self._restore_group(blobs[group_key], [pointers[i] for i in members], members, targets, out, g)
                except (FormatError, StoreError) as e:  # damaged or lost in the store: a miss, and forgotten
                    logger.warning("kvcodec HiCache: %d pages unreadable: %s", len(members), e)
                    unreadable += members
                except KVCodecError as e:  # sound, but not what this reader takes (shape, dtype): a miss, kept
                    logger.warning("kvcodec HiCache: %d pages not restored here: %s", len(members), e)
        except KVCodecError as e:  # the store could not be read: a miss
            logger.warning("kvcodec HiCache get failed: %s", e)
        self._forget([keys[i] for i in unreadable])
        return out

    def set(
        self, key: str, value: Any | None = None, target_location: Any | None = None, target_sizes: Any | None = None
    ) -> bool:
        return self.batch_set([key], [value])

    def batch_set(
        self,
        keys: list[str],
        values: Any | None = None,
        target_locations: Any | None = None,
        target_sizes: Any | None = None,
    ) -> bool:
        if self.refused:
            return False
        g = self._geometry()
        if values is None or len(values) != len(keys):
            raise ConfigError("batch_set needs one page tensor per key")
        have = self.store.exists_many([self._page_key(k) for k in keys])
        todo = [i for i, h in enumerate(have) if not h]
        per_group = max(1, self.group_tokens // g.page_size)
        try:
            for start, end in group_spans(len(todo), per_group):
                self._write_group([keys[i] for i in todo[start:end]], [values[i] for i in todo[start:end]], g)
        except KVCodecError as e:
            logger.warning("kvcodec HiCache set failed: %s", e)
            return False
        return True

    def exists(self, key: str) -> bool:
        return not self.refused and self.store.exists(self._page_key(key))

    def batch_exists(self, keys: list[str], extra_info: HiCacheStorageExtraInfo | None = None) -> int:
        if self.refused:
            return 0
        found = self.store.exists_many([self._page_key(k) for k in keys])
        return next((i for i, f in enumerate(found) if not f), len(keys))

    def batch_exists_v2(self, keys, pool_transfers=None, extra_info=None):  # noqa: ANN001, ANN201
        """Pools beside the KV pool are refused (_refuse_sidecars); a refused backend finds nothing."""
        if self.refused:
            return PoolTransferResult(kv_hit_pages=0, extra_pool_hit_pages={})
        return super().batch_exists_v2(keys, pool_transfers, extra_info)

    def batch_get_v2(self, transfers, extra_info=None):  # noqa: ANN001, ANN201
        if self.refused:
            return {t.name: [False] * len(t.keys or []) for t in transfers}
        return super().batch_get_v2(transfers, extra_info)

    def batch_set_v2(self, transfers, extra_info=None):  # noqa: ANN001, ANN201
        if self.refused:
            return {t.name: [False] * len(t.keys or []) for t in transfers}
        return super().batch_set_v2(transfers, extra_info)

    def clear(self) -> None:
        if self.refused:  # SGLang still counts a refused backend attached: its clear deletes nothing
            return
        for key in list(self.store.list(self.prefix + "/")):
            self.store.delete(key)

    def close(self) -> None:
        self.store.close()

    # -- internals ------------------------------------------------------------------------
    def _geometry(self) -> PageGeometry:
        if self.geometry is None:
            raise ConfigError("the kvcodec HiCache backend has no host pool registered yet")
        return self.geometry

    def _page_key(self, key: str) -> str:
        return f"{self.prefix}/p/{key_field(key)}"

    def _codec(self, tokens: int) -> ChunkCodec:
        with self._lock:
            if tokens not in self._codecs:
                self._codecs[tokens] = make_codec(self.codec_name, **self.codec_options, chunk_tokens=tokens)
            return self._codecs[tokens]

    def _pointers(self, keys: list[str]) -> tuple[list[PagePointer | None], list[int]]:
        """Each page's pointer (None: not stored, or damaged), and the indices of the damaged ones."""
        pointers: list[PagePointer | None] = []
        damaged: list[int] = []
        page_keys = [self._page_key(k) for k in keys]
        for i, (page_key, raw) in enumerate(zip(page_keys, self.store.get_many(page_keys))):
            try:
                pointers.append(None if raw is None else PagePointer.from_bytes(raw, page_key))
            except KVCodecError:
                pointers.append(None)
                damaged.append(i)
        return pointers, damaged

    def _write_group(self, keys: list[str], pages: list[torch.Tensor], g: PageGeometry) -> None:
        kv = torch.cat([page_to_canonical(p.detach().to("cpu"), g) for p in pages], dim=2)
        group_key = f"{self.prefix}/g/{key_field(keys[0])}+{len(keys)}+{_members_digest(keys)}"  # "+": in no field
        blob = self._codec(kv.shape[2]).encode_chunks(kv, keys=[group_key])[0].blobs[0]  # bound to its key
        self.store.put(group_key, blob)  # the group first: a pointer never names a missing group
        pointers = [PagePointer(self._page_key(k), group_key, i, len(keys)) for i, k in enumerate(keys)]
        self.store.put_many({p.page_key: p.to_bytes() for p in pointers})

    def _forget(self, keys: list[str]) -> None:
        """Pages found unreadable (a damaged pointer, a damaged group, a group the store lost) are
        forgotten: exists then says so and the next batch_set rewrites them, instead of a miss on
        every read, forever. Best effort: a store that refuses is logged."""
        if not keys:
            return
        try:
            self.store.delete_many([self._page_key(k) for k in keys])
        except KVCodecError as e:
            logger.warning("kvcodec HiCache: could not forget %d unreadable pages: %s", len(keys), e)

    def _restore_group(self, blob, pointers, members, targets, out, g: PageGeometry) -> None:
        tokens = pointers[0].pages * g.page_size
        codec = self._codec(tokens)
        info = codec.inspect_chunk(blob)
        if info.key != pointers[0].group_key or info.tokens != tokens:  # another group's blob, or a group of other size
            raise FormatError(f"group blob holds {info.tokens} tokens under {info.key}; its pointers name another")
        shape = (g.layers, 2, tokens, g.heads, g.head_dim)
        kv = decode_chunk_as(codec, blob, shape, g.dtype, self.device, f"group {info.key}", info).cpu()
        for p, i in zip(pointers, members):
            target = targets[i] if targets[i] is not None else torch.empty(g.numel, dtype=g.dtype)
            page = kv[:, :, p.index * g.page_size : (p.index + 1) * g.page_size]
            try:
                out[i] = canonical_to_page(page, g, target.reshape(-1))
            except ShapeError as e:  # the caller's target, not the store's data: a miss for this page alone
                logger.warning("kvcodec HiCache: page %d not restored: %s", i, e)


def _members_digest(keys: list[str]) -> str:
    """16 hex digits naming exactly which pages a group holds, in order: two groups of other pages
    never share a blob key (first, last and count did: a later group overwrote a blob that pages of
    an earlier one still pointed into)."""
    return hashlib.blake2b("\0".join(keys).encode(), digest_size=8).hexdigest()
