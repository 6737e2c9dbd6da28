"""The kvcodec serde inside the real LMCache package: its memory objects from a real L1Manager,
its serde registry and SerdeL2AdapterWrapper, its L2 adapter config parsing, and kvcodec's L2
adapter over a real file store and a real Redis. KV comes from a real model's forward pass."""

from __future__ import annotations

import os
import time

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvbench.net.redis_server import redis_server_binary

os.environ.setdefault("LMCACHE_TRACK_USAGE", "false")  # LMCache's usage telemetry: no network here
os.environ.setdefault("DO_NOT_TRACK", "1")
pytest.importorskip("lmcache.v1.distributed.serde", reason="lmcache not installed (scripts/install-integrations.sh)")

from lmcache.v1.distributed.api import MemoryLayoutDesc, ObjectKey  # noqa: E402
from lmcache.v1.distributed.config import L1ManagerConfig, L1MemoryManagerConfig  # noqa: E402
from lmcache.v1.distributed.l1_manager import L1Manager  # noqa: E402
from lmcache.v1.distributed.l2_adapters.config import get_l2_adapter_config_class  # noqa: E402
from lmcache.v1.distributed.l2_adapters.factory import create_l2_adapter_from_registry  # noqa: E402
from lmcache.v1.distributed.l2_adapters.serde_wrapper import SerdeL2AdapterWrapper  # noqa: E402
from lmcache.v1.distributed.serde import (  # noqa: E402
    SerdeConfig,
    create_serde_processor,
    get_registered_serde_types,
    serialized_layout_desc,
)

import kvcodec.integrations.lmcache_plugin as plugin  # noqa: E402
import kvcodec.integrations.lmcache_serde as lmcache_serde  # noqa: E402
from kvcodec.codecs import make_codec  # noqa: E402
from kvcodec.errors import ChecksumError, ConfigError, FormatError, KVCodecError  # noqa: E402
from kvcodec.integrations.lmcache_serde import (  # noqa: E402
    KVCodecCoder,
    SerdeOptions,
    from_canonical,
    split_frame,
    to_canonical,
)
from kvcodec.integrations.lmcache_store import KVCodecStoreL2Adapter, object_key, store_key  # noqa: E402
from kvcodec.store import open_store  # noqa: E402

_TAG = "test"


@pytest.fixture(scope="module")
def real_kv(smollm2, short_text):
    """SmolLM2 KV of a real text, canonical (layers, 2, tokens, kv_heads, head_dim), float32."""
    from kvcodec.integrations.hf import extract_kv

    model, tok = smollm2
    _, kv = extract_kv(model, tok, short_text, max_tokens=96)
    return kv


def lmcache_layout(kv: torch.Tensor) -> torch.Tensor:
    """Canonical KV as LMCache's (2, layers, tokens, hidden) object layout."""
    layers, _, tokens, heads, dim = kv.shape
    return kv.permute(1, 0, 2, 3, 4).reshape(2, layers, tokens, heads * dim).contiguous()


@pytest.fixture
def l1():
    manager = L1Manager(L1ManagerConfig(memory_config=L1MemoryManagerConfig(size_in_bytes=64 << 20, use_lazy=False)))
    yield manager
    manager.close()


_counter = iter(range(1, 1 << 30))


def new_key() -> ObjectKey:
    return ObjectKey(chunk_hash=next(_counter).to_bytes(16, "big"), model_name="smollm2/135m", kv_rank=0)


def memory_obj(l1, layout: MemoryLayoutDesc, temporary: bool = False):
    key = new_key()
    err, obj = l1.reserve_write([key], [temporary], layout, tag=_TAG)[key]
    assert obj is not None, err
    return key, obj


def kv_object(l1, tensors: list[torch.Tensor]):
    """A resident LMCache memory object holding `tensors` (one per shape group)."""
    layout = MemoryLayoutDesc(shapes=[t.shape for t in tensors], dtypes=[t.dtype for t in tensors])
    key, obj = memory_obj(l1, layout)
    for i, t in enumerate(tensors):
        (obj.tensor if len(tensors) == 1 else obj.get_tensor(i)).copy_(t)
    l1.finish_write([key], tag=_TAG)
    return key, obj, layout


def serde_round_trip(l1, kwargs: dict, tensors: list[torch.Tensor]):
    """Serialize and deserialize through the registered factory's sync halves, with LMCache's own
    temp-buffer sizing; returns (serialized bytes, restored tensors)."""
    processor = create_serde_processor(SerdeConfig("kvcodec", kwargs))
    try:
        key, src, layout = kv_object(l1, tensors)
        _, tmp = memory_obj(l1, serialized_layout_desc(layout, processor), temporary=True)
        n = processor._serializer.serialize(src, tmp, key)
        _, dst = memory_obj(l1, layout)
        processor._deserializer.deserialize(tmp, dst, key)
        parts = [dst.tensor] if len(tensors) == 1 else [dst.get_tensor(i) for i in range(len(tensors))]
        return n, [p.clone() for p in parts]
    finally:
        processor.close()


def test_registered_with_lmcache():
    assert "kvcodec" in get_registered_serde_types()
    plugin.register()  # idempotent
    with pytest.raises(ConfigError, match="unknown codec"):
        create_serde_processor(SerdeConfig("kvcodec", {"codec": "nope"}))
    with pytest.raises(ConfigError):
        create_serde_processor(SerdeConfig("kvcodec", {"quant": "int9"}))
    with pytest.raises(ConfigError, match="one chunk"):
        create_serde_processor(SerdeConfig("kvcodec", {"chunk_tokens": 16}))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_exact_round_trip_is_bitwise_and_smaller(l1, real_kv, dtype):
    x = lmcache_layout(real_kv.to(dtype))
    n, (y,) = serde_round_trip(l1, {"quant": "exact"}, [x])
    assert torch.equal(y.view(torch.int16), x.view(torch.int16))
    assert n < x.numel() * x.element_size()


def test_int8_equals_kvcodecs_own_decode(l1, real_kv):
    kv = real_kv.to(torch.float16)
    n, (y,) = serde_round_trip(l1, {"quant": "int8", "head_dim": 64}, [lmcache_layout(kv)])
    codec = make_codec("hevc", quant="int8", chunk_tokens=kv.shape[2], resolutions=((256, 256),))
    want = codec.decode_chunk(codec.encode_chunks(kv)[0].blobs[0], torch.empty_like(kv))
    assert torch.equal(y, lmcache_layout(want))
    assert n < kv.numel() * 2 / 1.5  # int8 coding is at least 1.5x smaller than fp16


def test_mla_and_multi_group_objects(l1, real_kv):
    kv = real_kv.to(torch.bfloat16)
    mla = kv[:, 0].reshape(kv.shape[0], kv.shape[2], -1)  # (layers, tokens, latent)
    _, (y,) = serde_round_trip(l1, {"quant": "exact"}, [mla])
    assert torch.equal(y.view(torch.int16), mla.view(torch.int16))
    groups = [lmcache_layout(kv[:10]), lmcache_layout(kv[10:])]
    _, ys = serde_round_trip(l1, {"quant": "exact"}, groups)
    assert all(torch.equal(a.view(torch.int16), b.view(torch.int16)) for a, b in zip(ys, groups))


def test_layout_maps_are_inverse():
    x = torch.arange(2 * 3 * 5 * 12, dtype=torch.float32).reshape(2, 3, 5, 12)
    assert torch.equal(from_canonical(to_canonical(x, 4), x.shape), x)
    assert to_canonical(x, 4)[1, 0, 2, 1, 3] == x[0, 1, 2, 7]
    m = torch.arange(3 * 5 * 8, dtype=torch.float32).reshape(3, 5, 8)
    assert torch.equal(from_canonical(to_canonical(m, None), m.shape), m)


def test_a_one_token_object_stays_within_the_bound(l1, real_kv):
    x = lmcache_layout(real_kv[:2, :, :1].to(torch.float16))  # one token: side info outweighs it
    n, (y,) = serde_round_trip(l1, {"quant": "int8"}, [x])
    assert torch.equal(y, x)  # int8 of one token is exact: each channel's min is its max
    processor = create_serde_processor(SerdeConfig("kvcodec", {}))
    assert n <= processor.estimate_serialized_size(MemoryLayoutDesc([x.shape], [x.dtype]))
    processor.close()


def test_damaged_bytes_raise_kvcodec_errors(real_kv):
    coder = KVCodecCoder(SerdeOptions.from_kwargs({"quant": "int8"}))
    x = lmcache_layout(real_kv.to(torch.float16))
    data = bytearray(coder.encode([x], b"k"))
    out = torch.zeros_like(x)
    with pytest.raises(KVCodecError):
        coder.decode_into(memoryview(bytes(data[:100])), [out], b"k")
    data[len(data) // 2] ^= 0xFF
    with pytest.raises(KVCodecError):
        coder.decode_into(memoryview(bytes(data)), [out], b"k")
    with pytest.raises(KVCodecError):
        coder.decode_into(memoryview(b"LMC\x00" + bytes(64)), [out], b"k")
    with pytest.raises(KVCodecError):  # wrong destination shape
        coder.decode_into(memoryview(coder.encode([x], b"k")), [torch.zeros_like(x[:, :, :5])], b"k")


def test_an_object_read_under_another_key_is_refused(real_kv):
    coder = KVCodecCoder(SerdeOptions.from_kwargs({"quant": "int8"}))
    x = lmcache_layout(real_kv.to(torch.float16))
    data = memoryview(coder.encode([x], b"key a"))
    with pytest.raises(FormatError, match="another key"):
        coder.decode_into(data, [torch.zeros_like(x)], b"key b")
    coder.decode_into(data, [torch.zeros_like(x)], b"key a")


def test_a_raw_part_is_checked_and_keeps_its_dtype(real_kv, monkeypatch):
    """A part that codes larger than raw (beyond a headroom real objects stay within, so none here)
    is stored raw: a flipped bit there, or a buffer of another dtype, is refused."""
    monkeypatch.setattr(lmcache_serde, "_HEADROOM", 0)
    coder = KVCodecCoder(SerdeOptions.from_kwargs({"quant": "int8"}))
    x = lmcache_layout(real_kv[:2, :, :1].to(torch.float16))
    data = bytearray(coder.encode([x], b"k"))
    assert split_frame(memoryview(data))[1][0][0] == 2  # stored raw
    with pytest.raises(FormatError, match="stored as torch.float16; the buffer is torch.bfloat16"):
        coder.decode_into(memoryview(bytes(data)), [torch.zeros_like(x, dtype=torch.bfloat16)], b"k")
    data[-1] ^= 0x01
    with pytest.raises(ChecksumError):
        coder.decode_into(memoryview(bytes(data)), [torch.zeros_like(x)], b"k")


def test_objects_of_the_first_version_are_refused(real_kv):
    """Version 1 bound no object to its key: its objects are misses (recomputed), not read."""
    coder = KVCodecCoder(SerdeOptions.from_kwargs({"quant": "exact"}))
    x = lmcache_layout(real_kv[:2].to(torch.float16))
    data = bytearray(coder.encode([x], b"k"))
    data[4] = 1
    with pytest.raises(FormatError, match="version 1"):
        coder.decode_into(memoryview(bytes(data)), [torch.zeros_like(x)], b"k")


# -- through LMCache's L2 path: config parsing, the serde wrapper, an adapter ------------------


def l2_adapter(l1, spec: dict):
    """What LMCache's StorageManager builds for one --l2-adapter JSON with a "serde" dict."""
    cfg = get_l2_adapter_config_class(spec["type"]).from_dict(spec)
    cfg.serde_config = type(cfg)._parse_serde_config(spec)
    inner = create_l2_adapter_from_registry(cfg)
    return SerdeL2AdapterWrapper(inner=inner, serde=create_serde_processor(cfg.serde_config), l1_manager=l1)


def wait(poll, timeout: float = 120.0):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        result = poll()
        if result is not None:
            return result
        time.sleep(0.01)
    raise TimeoutError("LMCache task did not complete")


def store_then_load(l1, adapter, x: torch.Tensor) -> tuple[bool, torch.Tensor, ObjectKey]:
    key, _, layout = kv_object(l1, [x])
    src = l1.reserve_read([key])[key][1]
    task = adapter.submit_store_task([key], [src])
    result = wait(lambda: adapter.pop_completed_store_tasks().get(task))
    assert result.is_successful()
    l1.finish_read([key])
    lookup = adapter.submit_lookup_and_lock_task([key], {0: layout})
    hit = wait(lambda: adapter.query_lookup_and_lock_result(lookup))
    assert hit.test(0)
    adapter.submit_unlock([key])
    _, dst = memory_obj(l1, layout)
    dst.tensor.zero_()
    load = adapter.submit_load_task([key], [dst])
    loaded = wait(lambda: adapter.query_load_result(load))
    return loaded.test(0), dst.tensor.clone(), key


def plugin_spec(url: str, **serde) -> dict:
    return {
        "type": "plugin",
        "module_path": "kvcodec.integrations.lmcache_store",
        "class_name": "KVCodecStoreL2Adapter",
        "adapter_params": {"url": url},
        "serde": {"type": "kvcodec", **serde},
    }


def test_l2_store_and_load_through_kvcodec_adapter(l1, real_kv, store_url):
    x = lmcache_layout(real_kv.to(torch.bfloat16))
    adapter = l2_adapter(l1, plugin_spec(store_url, quant="exact"))
    try:
        ok, y, key = store_then_load(l1, adapter, x)
    finally:
        adapter.close()
    assert ok and torch.equal(y.view(torch.int16), x.view(torch.int16))
    with open_store(store_url) as st:
        stored = st.get(store_key(key))
    assert stored is not None and len(stored) < x.numel() * 2


@pytest.mark.skipif(redis_server_binary() is None, reason="needs redis-server")
def test_l2_adapter_over_a_dead_store_deletes_nothing_without_raising_and_reports_unhealthy(l1, real_kv, redis_server):
    """LMCache calls delete from its eviction thread, which an exception ends for good: a store
    down raised StoreError there, and report_status said healthy all the while."""
    x = lmcache_layout(real_kv.to(torch.float16))
    spec = plugin_spec(redis_server.url, quant="exact")
    spec["adapter_params"].update(socket_timeout=0.5, retries=0)
    adapter = l2_adapter(l1, spec)
    try:
        ok, _, key = store_then_load(l1, adapter, x)
        assert ok and adapter.report_status()["is_healthy"]
        redis_server.kill()
        adapter.delete([key])  # returns: nothing deleted
        status = adapter.report_status()
        assert not status["is_healthy"] and "delete" in status["error"]
    finally:
        adapter.close()


def test_l2_damaged_object_is_a_miss_not_wrong_data(l1, real_kv, tmp_path):
    url = f"file://{tmp_path / 'store'}"
    x = lmcache_layout(real_kv.to(torch.float16))
    adapter = l2_adapter(l1, plugin_spec(url, quant="int8"))
    try:
        key, _, layout = kv_object(l1, [x])
        src = l1.reserve_read([key])[key][1]
        task = adapter.submit_store_task([key], [src])
        assert wait(lambda: adapter.pop_completed_store_tasks().get(task)).is_successful()
        with open_store(url) as st:
            blob = bytearray(st.get(store_key(key)))
            blob[len(blob) // 3] ^= 0x55
            st.put(store_key(key), bytes(blob))
        _, dst = memory_obj(l1, layout)
        load = adapter.submit_load_task([key], [dst])
        loaded = wait(lambda: adapter.query_load_result(load))
    finally:
        adapter.close()
    assert not loaded.test(0)


def test_l2_objects_swapped_between_keys_are_misses_not_wrong_data(l1, real_kv, tmp_path):
    """A store that serves another key's object (here: two objects swapped on disk)."""
    url = f"file://{tmp_path / 'store'}"
    xs = [lmcache_layout(real_kv[:, :, s : s + 32].to(torch.float16)) for s in (0, 32)]
    adapter = l2_adapter(l1, plugin_spec(url, quant="int8"))
    try:
        stored = []
        for x in xs:
            key, _, layout = kv_object(l1, [x])
            task = adapter.submit_store_task([key], [l1.reserve_read([key])[key][1]])
            assert wait(lambda task=task: adapter.pop_completed_store_tasks().get(task)).is_successful()
            stored.append(key)
        with open_store(url) as st:
            a, b = (st.get(store_key(k)) for k in stored)
            st.put_many({store_key(stored[0]): b, store_key(stored[1]): a})
        dsts = [memory_obj(l1, layout)[1] for _ in stored]
        load = adapter.submit_load_task(stored, dsts)
        loaded = wait(lambda: adapter.query_load_result(load))
    finally:
        adapter.close()
    assert not loaded.test(0) and not loaded.test(1)


def test_lmcache_fs_adapter_cannot_load_coded_objects(l1, real_kv, tmp_path):
    """Why kvcodec ships its own L2 adapter: LMCache 0.5.6's fs adapter stores the coded (shorter)
    object but loads only objects exactly as long as the serde's size bound. If LMCache fixes
    that, this test fails and the docs should say fs works too."""
    x = lmcache_layout(real_kv.to(torch.float16))
    adapter = l2_adapter(l1, {"type": "fs", "base_path": str(tmp_path / "fs"), "serde": {"type": "kvcodec"}})
    try:
        ok, _, _ = store_then_load(l1, adapter, x)
    finally:
        adapter.close()
    assert not ok


def test_a_part_stored_in_another_dtype_than_the_buffer_is_refused_not_cast(l1, real_kv):
    """The buffer's dtype must be the stored one: a coded part that cast silently would leave the
    object's raw parts misread."""
    processor = create_serde_processor(SerdeConfig("kvcodec", {"quant": "exact"}))
    try:
        key, src, layout = kv_object(l1, [lmcache_layout(real_kv.to(torch.float16))])
        _, tmp = memory_obj(l1, serialized_layout_desc(layout, processor), temporary=True)
        processor._serializer.serialize(src, tmp, key)
        other = MemoryLayoutDesc(shapes=layout.shapes, dtypes=[torch.bfloat16])
        _, dst = memory_obj(l1, other)
        with pytest.raises(FormatError, match="stored as torch.float16; the buffer is torch.bfloat16"):
            processor._deserializer.deserialize(tmp, dst, key)
    finally:
        processor.close()


SALT = st.text(st.characters(blacklist_characters="@/\\\x00"), max_size=12)


@settings(max_examples=200, deadline=None)
@given(
    model=st.text(st.characters(blacklist_characters="@"), max_size=12),
    salts=st.lists(SALT, min_size=2, max_size=2, unique=True),
    rank=st.integers(0, 2**20),
    group=st.integers(0, 9),
    digest=st.binary(min_size=1, max_size=8),
)
def test_store_keys_are_injective_and_parse_back(model, salts, rank, group, digest):
    keys = [ObjectKey(digest, model, rank, group, salt) for salt in salts]
    names = [store_key(k, "lm/c") for k in keys]
    assert names[0] != names[1]
    assert [object_key(n, "lm/c") for n in names] == keys
    assert object_key(names[0], "lmcache") is None and object_key(names[0] + "x", "lm/c") is None


def test_salts_that_read_alike_byte_by_byte_get_their_own_keys():
    """U+0100 and "\\x10" + "0" were both "=100" when a character's code was written in as many digits as it took."""
    a, b = (ObjectKey(b"\x01", "m", 0, 0, salt) for salt in ("\u0100", "\x100"))
    assert store_key(a) != store_key(b)
    assert object_key("lmcache/m/0/0/=100/01") is None  # the first scheme's key for a: no object of this one


def test_the_adapter_lists_its_objects_a_page_at_a_time(tmp_path):
    url = f"file://{tmp_path}"
    keys = [ObjectKey(bytes([i]), model, 0, 0, "s") for i, model in enumerate(["org/a", "org/a", "org/b"])]
    with open_store(url) as st_:
        for i, k in enumerate(keys):
            st_.put(store_key(k), b"x" * (i + 1))
        st_.put("lmcache/not-an-object", b"y")
    adapter = KVCodecStoreL2Adapter({"url": url})
    try:
        seen, cursor = [], None
        while True:
            page = adapter.list_l2_keys(page_size=2, cursor=cursor)
            assert len(page.entries) <= 2
            seen += [(e.key, e.size_bytes) for e in page.entries]
            if page.next_page_token is None:
                break
            cursor = page.next_page_token
        assert sorted(seen, key=str) == sorted(
            ((k.to_encoded_object_key(), i + 1) for i, k in enumerate(keys)), key=str
        )
        only_a = adapter.list_l2_keys(model_name="org/a").entries
        assert sorted(e.key.chunk_hash_hex for e in only_a) == ["00", "01"]
        with pytest.raises(ValueError):
            adapter.list_l2_keys(page_size=0)
        with pytest.raises(ValueError):
            adapter.list_l2_keys(cursor="elsewhere/x")
    finally:
        adapter.close()
