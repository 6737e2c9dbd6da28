"""vLLM KV connector: prompt prefixes stored as kvcodec chunks in any kvcodec store.

    vllm serve MODEL --kv-transfer-config '{"kv_connector": "KVCodecConnector",
        "kv_connector_module_path": "kvcodec.integrations.vllm_connector", "kv_role": "kv_both",
        "kv_connector_extra_config": {"url": "redis://127.0.0.1:6379/0", "quant": "int8"}}'

Scheduler side: get_num_new_matched_tokens looks up the prompt's chained chunk keys (one batched
exists query) and offers the stored whole chunks beyond what vLLM already has; build_connector_meta
tells the workers which chunks to restore into which blocks, and which fully prefilled prompts to
store (after a partial hit, their chunks past the stored ones). Worker side: start_load_kv decodes
each chunk (NVDEC on CUDA where present) and writes its
tokens into every layer's paged cache (vLLM 0.33: one [blocks, kv_heads, block_size, 2 * head_dim]
tensor per layer, K then V on the last axis); wait_for_save gathers the stored prompts' KV from the
paged caches and codes and stores it on a background thread (a lost save is a later miss).

Extra config: `url` (required), `codec` ("hevc") and its options (`quant`, `chunk_tokens`,
`resolutions`, ...), `model_id` (default: the served model name; it goes into the keys), `namespace`.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import json
import logging
import re
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

from kvcodec.codecs import make_codec
from kvcodec.codecs.base import ChunkInfo, decode_chunk_as, stored_dtype, warm_up_codec
from kvcodec.errors import ConfigError, CorruptStreamError, FormatError, KVCodecError
from kvcodec.fetcher.keys import chunk_keys, longest_present
from kvcodec.restore.paged import PagedKV
from kvcodec.store import open_store

logger = logging.getLogger(__name__)
_OWN = {"url", "codec", "model_id", "namespace", "store_options"}
RECENT_LOAD_STEPS = 8  # steps whose failed loads a save is checked against (more than vLLM's lag in steps)


@dataclasses.dataclass(frozen=True)
class ChunkLoad:
    """Restore chunks `keys` (covering tokens [0, len(keys) * chunk_tokens)) into `block_ids`,
    writing only tokens from `skip_tokens` on (the ones vLLM already holds stay untouched)."""

    req_id: str
    keys: tuple[str, ...]
    block_ids: tuple[int, ...]
    skip_tokens: int

    def written_blocks(self, block_size: int) -> tuple[int, ...]:
        """The blocks this load writes: from the one holding token `skip_tokens` on."""
        return self.block_ids[self.skip_tokens // block_size :]


@dataclasses.dataclass(frozen=True)
class PrefixSave:
    """Store the whole chunks of `token_ids` from token `first` on (a multiple of the chunk size:
    the chunks before it are stored already), whose KV sits in `block_ids` after this step, under
    keys of `namespace` (the request's: see KVCodecConnector.request_namespace)."""

    req_id: str
    token_ids: tuple[int, ...]
    block_ids: tuple[int, ...]
    namespace: str | None = None
    first: int = 0


@dataclasses.dataclass(frozen=True)
class _Offer:
    """What the scheduler side offered a request: tokens to load, of which prompt, in which namespace."""

    external: int
    prompt: tuple[int, ...]
    namespace: str | None


@dataclasses.dataclass
class KVCodecConnectorMetadata(KVConnectorMetadata):
    loads: list[ChunkLoad] = dataclasses.field(default_factory=list)
    saves: list[PrefixSave] = dataclasses.field(default_factory=list)


def worker_rank() -> tuple[int, int]:
    """(TP rank, PP rank) of this worker; (0, 0) where vLLM's process groups are not set up."""
    from vllm.distributed import parallel_state

    try:
        return parallel_state.get_tensor_model_parallel_rank(), parallel_state.get_pp_group().rank_in_group
    except (AssertionError, AttributeError):
        return 0, 0


def paged_view(caches: list[torch.Tensor]) -> torch.Tensor | None:
    """One (layers, 2, blocks, block_size, heads, head_dim) view over vLLM's per-layer caches
    ([blocks, heads, block_size, 2 * head_dim] each) when they are evenly spaced views of one
    allocation, as vLLM 0.33 allocates them; None otherwise. kvcodec's paged restore (PagedKV)
    then writes each chunk straight into its blocks, every layer at once."""
    first = caches[0]
    same = all(
        c.shape == first.shape and c.stride() == first.stride() and c.dtype == first.dtype and c.device == first.device
        for c in caches
    )
    if not same or first.dim() != 4 or first.shape[-1] % 2:
        return None
    if any(c.untyped_storage().data_ptr() != first.untyped_storage().data_ptr() for c in caches):
        return None
    step = caches[1].storage_offset() - first.storage_offset() if len(caches) > 1 else first.numel()
    if step <= 0 or any(c.storage_offset() - first.storage_offset() != i * step for i, c in enumerate(caches)):
        return None
    blocks, heads, block_size, two_d = first.shape
    sb, sh, sn, sc = first.stride()
    d = two_d // 2
    return torch.as_strided(
        first,
        size=(len(caches), 2, blocks, block_size, heads, d),
        stride=(step, d * sc, sb, sn, sh, sc),
        storage_offset=first.storage_offset(),
    )


def layer_order(names) -> list[str]:
    """Layer names in model order (by the first integer in each name: model.layers.N...)."""

    def index(name: str) -> int:
        m = re.search(r"\d+", name)
        return int(m.group()) if m else -1

    return sorted(names, key=lambda n: (index(n), n))


def token_slots(block_ids, block_size: int, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(block, offset in block) of sequence tokens [start, end)."""
    pos = torch.arange(start, end)
    return torch.as_tensor(block_ids, dtype=torch.int64)[pos // block_size], pos % block_size


def kernel_blocks(block_ids, per_block: int) -> tuple[int, ...]:
    """The cache tensors' own blocks of the scheduler's `block_ids`, where vLLM splits each scheduler
    block into `per_block` kernel blocks (block b: kernel blocks b * per_block .. b * per_block + per_block - 1)."""
    if per_block == 1:
        return tuple(block_ids)
    return tuple(b * per_block + j for b in block_ids for j in range(per_block))


class KVCodecConnector(KVConnectorBase_V1):
    def __init__(self, vllm_config, role: KVConnectorRole, kv_cache_config=None) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        extra = dict(self._kv_transfer_config.kv_connector_extra_config or {})
        url = extra.get("url")
        if not isinstance(url, str) or not url:
            raise ConfigError("KVCodecConnector needs kv_connector_extra_config.url (a kvcodec store URL)")
        options = {k: v for k, v in extra.items() if k not in _OWN}
        if extra.get("codec", "hevc") == "hevc":
            options.setdefault("resolutions", [[256, 256]])  # one stored frame size per chunk
        self.codec = make_codec(str(extra.get("codec", "hevc")), **options)
        model = getattr(vllm_config.model_config, "model", None) if vllm_config.model_config else None
        self.model_id = str(extra.get("model_id") or model or "model")
        self.namespace = str(extra["namespace"]) if extra.get("namespace") else None  # a JSON number names one too
        self.block_size = vllm_config.cache_config.block_size
        parallel = vllm_config.parallel_config
        self.shards = (parallel.tensor_parallel_size, parallel.pipeline_parallel_size)
        self.rank = (0, 0) if role == KVConnectorRole.SCHEDULER else worker_rank()
        self.store = open_store(url, **dict(extra.get("store_options", {})))
        self._offers: dict[str, _Offer] = {}  # req_id -> the load vLLM now counts as computed
        self._namespaces: dict[str, str | None] = {}  # req_id -> its keys' namespace; absent: not keyable
        self._kv_caches: dict[str, torch.Tensor] = {}
        self._kernel_block = self.block_size  # tokens per block of the cache tensors (vLLM may split blocks)
        self._pages: torch.Tensor | None = None  # all layers as one paged view, where vLLM's layout allows
        self._load_errors: set[int] = set()  # until vLLM asks for them
        # Blocks whose load failed in the last steps, which a save must not read: vLLM may take a
        # step's errors before its wait_for_save (speculative decoding), and learns of them steps
        # late (asynchronous scheduling, pipeline stages) while it hands those blocks to other
        # requests from its own prefix cache.
        self._recent_failed: collections.deque[set[int]] = collections.deque(maxlen=RECENT_LOAD_STEPS)
        # Scheduler side: blocks whose load failed on any rank (vLLM's merged invalid_block_ids), until
        # vLLM hands them out again for new KV; and the blocks loaded in the last steps (TP/PP: a rank
        # cannot see another's failure until vLLM reports it, steps later).
        self._tainted: set[int] = set()
        self._recent_loading: collections.deque[set[int]] = collections.deque(maxlen=RECENT_LOAD_STEPS)
        self._saver = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvcodec-save")

    def object_key(self, chunk_key: str, rank: tuple[int, int] | None = None) -> str:
        """Store key of a chunk's blob for one (TP rank, PP rank): each rank holds its own heads and
        layers, its blob bound to this key (`b2`: blobs of earlier versions, bound to the chunk key
        only, are misses). The scheduler counts a chunk stored when every rank's object exists; a
        rank whose blob is missing or damaged reports a load error."""
        tp, pp = self.rank if rank is None else rank
        return f"{chunk_key}/b2-tp{tp}of{self.shards[0]}-pp{pp}of{self.shards[1]}"

    # -- scheduler side -------------------------------------------------------------------
    def _keys(self, token_ids, namespace: str | None) -> list[str]:
        return chunk_keys(token_ids, self.model_id, self.codec, partial=False, namespace=namespace)

    def _stored_chunks(self, token_ids, namespace: str | None) -> int:
        """Leading chunks of `token_ids` stored by every TP/PP rank (a rank's object a load deleted
        ends them there); 0 where the store cannot say (down, slow: a miss, never a failure of
        vLLM's scheduler)."""
        keys = self._keys(token_ids, namespace)
        if not keys:
            return 0
        ranks = list(itertools.product(range(self.shards[0]), range(self.shards[1])))
        try:
            present = self.store.exists_many([self.object_key(k, r) for k in keys for r in ranks])
            return longest_present([all(present[i : i + len(ranks)]) for i in range(0, len(present), len(ranks))])
        except KVCodecError as e:
            logger.warning("kvcodec lookup failed (a miss): %s", e)
            return 0

    def request_namespace(self, request) -> tuple[bool, str | None]:
        """(keyable, namespace of its keys). The same tokens give other KV under another cache salt
        (vLLM's per-request isolation) or LoRA adapter, so those name the keys' namespace beside the
        configured one; a prompt whose tokens do not say what the model saw (images or other
        multimodal inputs behind placeholder tokens, prompt embeddings) is not keyable: never
        offered, never stored."""
        if getattr(request, "mm_features", None) or getattr(request, "prompt_embeds", None) is not None:
            return False, None
        salt, lora = getattr(request, "cache_salt", None), getattr(request, "lora_request", None)
        if not salt and lora is None:
            return True, self.namespace  # the configured namespace alone: keys as without this scoping
        adapter = None if lora is None else [lora.lora_name, str(lora.lora_path)]  # its weights' path: a reload differs
        return True, json.dumps([self.namespace, salt or None, adapter])  # no value can pose as another field

    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> tuple[int | None, bool]:
        keyable, namespace = self.request_namespace(request)
        if not keyable:
            self._namespaces.pop(request.request_id, None)
            return 0, False
        self._namespaces[request.request_id] = namespace
        prompt = request.prompt_token_ids or []
        usable = max(0, len(prompt) - 1)  # vLLM must compute at least the last prompt token
        hit = self._stored_chunks(prompt[:usable], namespace) * self.codec.chunk_tokens
        return max(0, hit - num_computed_tokens), False

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int) -> None:
        if num_external_tokens > 0:
            namespace = self._namespaces.get(request.request_id)
            prompt = tuple(request.prompt_token_ids or ())
            self._offers[request.request_id] = _Offer(num_external_tokens, prompt, namespace)

    def _load_of(self, req_id: str, offer: _Offer, computed: int, block_ids) -> ChunkLoad:
        """The chunks of an offer; the scheduler has set `computed` to vLLM's own hit plus ours."""
        ct = self.codec.chunk_tokens
        keys = tuple(self._keys(offer.prompt[: -(-computed // ct) * ct], offer.namespace))
        return ChunkLoad(req_id, keys, tuple(block_ids), computed - offer.external)

    def build_connector_meta(self, scheduler_output) -> KVCodecConnectorMetadata:
        meta = KVCodecConnectorMetadata()
        ct = self.codec.chunk_tokens
        for req in scheduler_output.scheduled_new_reqs:
            prompt = list(req.prompt_token_ids or [])
            block_ids = tuple(req.block_ids[0])
            offer = self._offers.pop(req.req_id, None)
            own_hit = req.num_computed_tokens - (offer.external if offer is not None else 0)
            self._tainted.difference_update(block_ids[own_hit // self.block_size :])  # new KV goes there now
            if offer is not None:
                meta.loads.append(self._load_of(req.req_id, offer, req.num_computed_tokens, block_ids))
            if req.req_id not in self._namespaces:
                continue  # not keyable (multimodal), or never asked: not stored
            namespace = self._namespaces[req.req_id]
            scheduled = scheduler_output.num_scheduled_tokens.get(req.req_id, 0)
            whole = (len(prompt) // ct) * ct
            # Only prompts prefilled in this one step are stored (chunked prefill is not); after a
            # partial hit, the chunks past the stored and loaded ones (their KV computed over the
            # restored prefix; the loaded chunks are never coded again).
            if whole and req.num_computed_tokens + scheduled >= len(prompt):
                stored = self._stored_chunks(prompt[:whole], namespace) * ct
                if offer is not None:
                    stored = max(stored, req.num_computed_tokens // ct * ct)
                if stored < whole:
                    meta.saves.append(PrefixSave(req.req_id, tuple(prompt[:whole]), block_ids, namespace, stored))
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):  # resumed after preemption: all of its blocks are new
            offer = self._offers.pop(req_id, None)
            if offer is not None and req_id in cached.resumed_req_ids and cached.new_block_ids[i] is not None:
                meta.loads.append(
                    self._load_of(req_id, offer, cached.num_computed_tokens[i], cached.new_block_ids[i][0])
                )
        self._recent_loading.append({b for load in meta.loads for b in load.written_blocks(self.block_size)})
        # No save reads a block whose load failed (its KV, and what was computed over it, is not the
        # prompt's); under TP/PP none reads a block loaded in the last steps either: a rank cannot see
        # another rank's failed load, whose garbage reaches its KV through the all-reduce or the
        # pipeline, until vLLM reports it (vLLM shares a block being loaded with later requests at once).
        unsafe = set(self._tainted)
        if self.shards != (1, 1):
            unsafe = unsafe.union(*self._recent_loading)
        meta.saves = [save for save in meta.saves if not unsafe.intersection(save.block_ids)]
        for req_id in self._offers:  # vLLM counts these tokens computed: say so where none was scheduled to load
            logger.error("kvcodec: request %s was offered stored tokens but not scheduled to load them", req_id)
        self._offers.clear()
        return meta

    def update_connector_output(self, connector_output) -> None:
        """The workers' report of a step: blocks whose load failed, on any rank, are not saved from."""
        self._tainted.update(getattr(connector_output, "invalid_block_ids", None) or ())

    def request_finished(self, request, block_ids) -> tuple[bool, dict[str, Any] | None]:
        self._namespaces.pop(request.request_id, None)
        self._offers.pop(request.request_id, None)
        return False, None

    # -- worker side ----------------------------------------------------------------------
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        self._kv_caches = {name: kv_caches[name] for name in layer_order(kv_caches)}
        if self._kv_caches:  # vLLM may split each scheduler block into kernel blocks of the cache tensors
            kernel = next(iter(self._kv_caches.values())).shape[2]
            if kernel < 1 or self.block_size % kernel:
                raise ConfigError(
                    f"KVCodecConnector: the KV cache's blocks of {kernel} tokens do not divide vLLM's block size "
                    f"{self.block_size}"
                )
            self._kernel_block = kernel
        self._pages = paged_view(list(self._kv_caches.values())) if self._kv_caches else None
        if self._kv_caches:  # the restore's kernels compiled now, not during the first request's load
            first = next(iter(self._kv_caches.values()))
            warm_up_codec(self.codec, first.device, first.dtype)

    def start_load_kv(self, forward_context, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        failed_now: set[int] = set()
        self._recent_failed.append(failed_now)
        for load in getattr(meta, "loads", []):
            try:
                self._load(load)
            except (KVCodecError, IndexError, RuntimeError) as e:  # a miss vLLM recomputes, never a dead worker
                logger.warning("kvcodec load for request %s failed: %s", load.req_id, e)
                failed = load.written_blocks(self.block_size)
                self._load_errors.update(failed)
                failed_now.update(failed)

    def wait_for_layer_load(self, layer_name: str) -> None:
        return None  # start_load_kv restores every layer before the forward pass

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata, **kwargs: Any) -> None:
        return None  # saved whole (all layers, whole chunks) in wait_for_save

    def wait_for_save(self) -> None:
        meta = self._get_connector_metadata()
        failed = set().union(*self._recent_failed)
        for save in getattr(meta, "saves", []):
            if failed.intersection(save.block_ids):  # a block vLLM recomputes: its KV is not this prompt's
                logger.warning("kvcodec: request %s not stored: part of its prefix failed to load", save.req_id)
                continue
            kv = self.gather(save.block_ids, save.first, len(save.token_ids)).cpu()  # copied before the blocks move on
            self._saver.submit(self._store_prefix, save.token_ids, kv, save.namespace, save.first)

    def get_block_ids_with_load_errors(self) -> set[int]:
        errors, self._load_errors = self._load_errors, set()
        return errors

    def shutdown(self) -> None:
        self._saver.shutdown(wait=True)
        self.store.close()

    # -- the paged caches -----------------------------------------------------------------
    def _layers(self) -> list[torch.Tensor]:
        if not self._kv_caches:
            raise ConfigError("KVCodecConnector has no registered KV caches")
        return list(self._kv_caches.values())

    def _kernel_table(self, block_ids) -> tuple[int, ...]:
        """The cache tensors' own blocks of the scheduler's `block_ids`."""
        return kernel_blocks(block_ids, self.block_size // self._kernel_block)

    def _slots(self, block_ids, start: int, end: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(cache block, offset in it) of sequence tokens [start, end), in the cache tensors' own blocks."""
        return token_slots(self._kernel_table(block_ids), self._kernel_block, start, end)

    def gather(self, block_ids, start: int, end: int) -> torch.Tensor:
        """Tokens [start, end) of a sequence as canonical (layers, 2, tokens, heads, head_dim)."""
        layers = self._layers()
        blocks, offsets = self._slots(block_ids, start, end)
        d = layers[0].shape[-1] // 2
        per_layer = [c[blocks.to(c.device), :, offsets.to(c.device)] for c in layers]  # (tokens, heads, 2d)
        return torch.stack([torch.stack([x[..., :d], x[..., d:]]) for x in per_layer])

    def scatter(self, kv: torch.Tensor, block_ids, start: int) -> None:
        """Write canonical KV of sequence tokens [start, start + kv.shape[2]) into the paged caches."""
        blocks, offsets = self._slots(block_ids, start, start + kv.shape[2])
        for layer, c in enumerate(self._layers()):
            d = c.shape[-1] // 2
            b, o = blocks.to(c.device), offsets.to(c.device)
            c[b, :, o, :d] = kv[layer, 0].to(c.device)
            c[b, :, o, d:] = kv[layer, 1].to(c.device)

    def _load(self, load: ChunkLoad) -> None:
        ct = self.codec.chunk_tokens
        blobs = self.store.get_many([self.object_key(k) for k in load.keys])
        for i, (key, blob) in enumerate(zip(load.keys, blobs)):
            if (i + 1) * ct <= load.skip_tokens:
                continue
            if blob is None:
                raise KVCodecError(f"chunk {key} vanished from the store")
            try:
                self._load_chunk(blob, self._checked_info(blob, key), i * ct, load)
            except FormatError as e:  # damaged or not this rank's: a miss from now on; a decoder that fails
                if not isinstance(e, CorruptStreamError):  # on streams whose checksums held keeps the object
                    self._forget(self.object_key(key))
                raise

    def _load_chunk(self, blob: bytes, info: ChunkInfo, start: int, load: ChunkLoad) -> None:
        """A checked chunk blob whose first token is `start` into the request's blocks: straight into
        them where it is stored in the caches' dtype, else restored in theirs (decode_chunk_as: cast,
        a ShapeError for values a narrower cache cannot hold) and scattered."""
        layers = self._layers()
        cache = layers[0]
        if self._pages is not None and start >= load.skip_tokens and stored_dtype(info) == cache.dtype:
            table = torch.as_tensor(self._kernel_table(load.block_ids))
            self.codec.decode_chunk(blob, PagedKV(self._pages, table))
            return
        shape = (len(layers), 2, self.codec.chunk_tokens, cache.shape[1], cache.shape[-1] // 2)
        kv = decode_chunk_as(self.codec, blob, shape, cache.dtype, cache.device, f"chunk at token {start}", info)
        first = max(start, load.skip_tokens)
        self.scatter(kv[:, :, first - start :], load.block_ids, first)

    def _checked_info(self, blob: bytes, key: str) -> ChunkInfo:
        """The blob's header; a FormatError unless it is bound to this rank's object key of the chunk
        `key` names (the chained key names the chunk's place: another chunk's, prefix's or rank's blob
        is refused)."""
        info, obj = self.codec.inspect_chunk(blob), self.object_key(key)
        if info.key != obj:
            raise FormatError(f"chunk blob under {obj} is bound to {info.key!r}")
        return info

    def _forget(self, obj: str) -> None:
        """Delete a refused object (best effort: a store, a plug-in's too, that refuses is logged)."""
        try:
            self.store.delete(obj)
        except Exception as e:  # noqa: BLE001 - never out into vLLM's worker step
            logger.warning("kvcodec could not delete the refused object %s: %s", obj, e)

    def _store_prefix(self, token_ids, kv: torch.Tensor, namespace: str | None = None, first: int = 0) -> None:
        """Code and store `kv`, the KV of token_ids[first:] (whole chunks, `first` a chunk boundary)."""
        if first % self.codec.chunk_tokens:
            logger.error("kvcodec save skipped: it starts at token %d, inside a chunk", first)
            return
        try:
            objects = [self.object_key(k) for k in self._keys(token_ids, namespace)]
            skip = first // self.codec.chunk_tokens
            chunks = self.codec.encode_chunks(kv, first_chunk_index=skip, keys=objects[skip:])
            for chunk in chunks:  # each blob bound to its rank's object
                self.store.put(objects[chunk.index], chunk.blobs[0])
        except KVCodecError as e:
            logger.warning("kvcodec save failed: %s", e)

    def wait_for_pending_saves(self) -> None:
        """Block until background saves are done (tests, shutdown)."""
        self._saver.submit(lambda: None).result()
