"""The kvcodec HiCache backend inside the real SGLang package: created by SGLang's own
StorageBackendFactory as a "dynamic" backend from the extra config, called through the
HiCacheStorage interface the way HiCacheController's generic page path calls it (batch_set of
flat host pages, batch_exists, batch_get into flat dummy pages), over a real file store and a
real Redis, with real model KV.

Untested here: SGLang's host pool class itself (sglang.srt.mem_cache.memory_pool_host) does not
import on this CPU machine (its import chain needs torchvision, which has no build for the CPU
torch here), so the pages below are cut from a host buffer laid out as SGLang's MHA host pool
lays it out (layer_first: (2, layers, tokens, heads, dim); page_first: (2, tokens, layers, heads,
dim)), and the registered host pool is a record of its geometry attributes.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

pytest.importorskip(
    "sglang.srt.mem_cache.hicache_storage", reason="sglang not installed (scripts/install-integrations.sh)"
)

from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig, PoolName, PoolTransfer  # noqa: E402
from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory  # noqa: E402

from kvcodec.codecs import make_codec  # noqa: E402
from kvcodec.errors import ConfigError  # noqa: E402
from kvcodec.integrations.sglang_hicache import KVCodecHiCacheStorage  # noqa: E402
from kvcodec.integrations.sglang_pages import PageGeometry, page_to_canonical  # noqa: E402
from kvcodec.store import open_store  # noqa: E402

PAGE = 16


@dataclasses.dataclass
class HostPoolGeometry:
    """The attributes of SGLang's MHA host pool that a storage backend reads."""

    layout: str
    layer_num: int
    page_size: int
    head_num: int
    head_dim: int
    dtype: torch.dtype


def host_buffer(kv: torch.Tensor, layout: str) -> torch.Tensor:
    """Canonical KV laid out as SGLang's MHA host pool buffer."""
    return {"layer_first": kv.permute(1, 0, 2, 3, 4), "page_first": kv.permute(1, 2, 0, 3, 4)}[layout].contiguous()


def host_page(buf: torch.Tensor, layout: str, i: int) -> torch.Tensor:
    """Page i of the host buffer, flat, as the host pool's get_data_page gives it."""
    span = slice(i * PAGE, (i + 1) * PAGE)
    return (buf[:, :, span] if layout == "layer_first" else buf[:, span]).flatten()


@pytest.fixture(scope="module")
def real_kv(smollm2, short_text):
    from kvcodec.integrations.hf import extract_kv

    model, tok = smollm2
    _, kv = extract_kv(model, tok, short_text, max_tokens=96)  # 6 pages of 16 tokens
    return kv


def storage_config(url: str, **extra) -> HiCacheStorageConfig:
    return HiCacheStorageConfig(
        tp_rank=0,
        tp_size=1,
        pp_rank=0,
        pp_size=1,
        attn_cp_rank=0,
        attn_cp_size=1,
        is_mla_model=False,
        enable_storage_metrics=False,
        is_page_first_layout=False,
        model_name="HuggingFaceTB/SmolLM2-135M",
        extra_config={
            "backend_name": "kvcodec",
            "module_path": "kvcodec.integrations.sglang_hicache",
            "class_name": "KVCodecHiCacheStorage",
            "url": url,
            **extra,
        },
    )


def backend(url: str, kv: torch.Tensor, layout: str = "layer_first", **extra):
    pool = HostPoolGeometry(layout, kv.shape[0], PAGE, kv.shape[3], kv.shape[4], kv.dtype)
    b = StorageBackendFactory.create_backend("dynamic", storage_config(url, **extra), pool)
    b.register_mem_pool_host(pool)  # as HiCacheController does after creating the backend
    return b


def keys_for(n: int, tag: str = "") -> list[str]:
    return [f"{tag}{i:064x}" for i in range(1, n + 1)]


def dummy_pages(n: int, kv: torch.Tensor) -> list[torch.Tensor]:
    return [torch.zeros(2 * kv.shape[0] * PAGE * kv.shape[3] * kv.shape[4], dtype=kv.dtype) for _ in range(n)]


@pytest.mark.parametrize("layout", ["layer_first", "page_first"])
def test_exact_pages_round_trip_through_sglang_factory(real_kv, store_url, layout):
    kv = real_kv.to(torch.bfloat16)
    b = backend(store_url, kv, layout, quant="exact", group_tokens=64)
    assert isinstance(b, KVCodecHiCacheStorage)
    buf = host_buffer(kv, layout)
    n = kv.shape[2] // PAGE
    keys = keys_for(n)
    pages = [host_page(buf, layout, i) for i in range(n)]
    assert b.batch_set(keys, pages)
    assert b.batch_exists(keys) == n
    got = b.batch_get(keys, dummy_pages(n, kv))
    assert all(torch.equal(g.view(torch.int16), p.view(torch.int16)) for g, p in zip(got, pages))
    one = b.get(keys[5], dummy_pages(1, kv)[0])  # a page of the second group, alone
    assert torch.equal(one.view(torch.int16), pages[5].view(torch.int16))
    with open_store(store_url) as st:
        stored = [k for k in st.list("sglang/") if "/g/" in k]
        coded = sum(st.size(k) for k in stored)
    assert len(stored) == 2 and coded < kv.numel() * 2  # 6 pages in groups of 4: two blobs, smaller than bf16
    b.close()


def test_int8_equals_kvcodecs_own_decode_of_the_group(real_kv, tmp_path):
    kv = real_kv.to(torch.float16)
    b = backend(f"file://{tmp_path}", kv, quant="int8", group_tokens=48)
    buf = host_buffer(kv, "layer_first")
    keys = keys_for(6)
    assert b.batch_set(keys, [host_page(buf, "layer_first", i) for i in range(6)])
    got = b.batch_get(keys, dummy_pages(6, kv))
    codec = make_codec("hevc", quant="int8", chunk_tokens=48, resolutions=((256, 256),))
    want = torch.cat(
        [codec.decode_chunk(c.blobs[0], torch.empty_like(kv[:, :, :48])) for c in codec.encode_chunks(kv)], 2
    )
    want_buf = host_buffer(want, "layer_first")
    assert all(torch.equal(g, host_page(want_buf, "layer_first", i)) for i, g in enumerate(got))


def test_exists_counts_the_stored_prefix_and_get_stops_at_a_miss(real_kv, tmp_path):
    kv = real_kv.to(torch.float16)
    b = backend(f"file://{tmp_path}", kv, quant="int8", group_tokens=32)
    buf = host_buffer(kv, "layer_first")
    keys = keys_for(6)
    assert b.batch_set(keys[:3], [host_page(buf, "layer_first", i) for i in range(3)])
    assert b.batch_exists(keys) == 3
    assert not b.exists(keys[4])
    got = b.batch_get(keys, dummy_pages(6, kv))
    assert [g is not None for g in got] == [True] * 3 + [False] * 3
    assert b.batch_set(keys, [host_page(buf, "layer_first", i) for i in range(6)])  # stored pages are skipped
    assert b.batch_exists(keys) == 6


def six_pages_stored(real_kv, url: str, quant: str):  # noqa: ANN201
    """(backend, kv, keys, pages): six pages of real KV stored as one group."""
    kv = real_kv.to(torch.float16)
    b = backend(url, kv, quant=quant, group_tokens=96)
    buf = host_buffer(kv, "layer_first")
    keys, pages = keys_for(6), [host_page(buf, "layer_first", i) for i in range(6)]
    assert b.batch_set(keys, pages)
    return b, kv, keys, pages


def test_damaged_group_is_a_miss(real_kv, tmp_path):
    url = f"file://{tmp_path}"
    b, kv, keys, _ = six_pages_stored(real_kv, url, "int8")
    with open_store(url) as st:
        (group,) = [k for k in st.list("sglang/") if "/g/" in k]
        blob = bytearray(st.get(group))
        blob[len(blob) // 2] ^= 0x40
        st.put(group, bytes(blob))
    assert b.batch_get(keys, dummy_pages(6, kv)) == [None] * 6
    assert b.batch_exists(keys) == 0  # forgotten: the next set stores the pages again, not a miss forever


def test_pages_whose_group_the_store_lost_are_forgotten_then_stored_again(real_kv, tmp_path):
    # an evicted group left its pointers: exists said 6 of 6, every read missed, and set skipped them, forever
    url = f"file://{tmp_path}"
    b, kv, keys, pages = six_pages_stored(real_kv, url, "exact")
    with open_store(url) as st:
        (group,) = [k for k in st.list("sglang/") if "/g/" in k]
        st.delete(group)  # what a Redis maxmemory or TTL eviction of the big value does
    assert b.batch_get(keys, dummy_pages(6, kv)) == [None] * 6
    assert b.batch_exists(keys) == 0
    assert b.batch_set(keys, pages) and b.batch_exists(keys) == 6
    assert all(torch.equal(got, want) for got, want in zip(b.batch_get(keys, dummy_pages(6, kv)), pages))


def test_a_damaged_page_pointer_is_a_miss(real_kv, tmp_path):
    url = f"file://{tmp_path}"
    b, kv, keys, _ = six_pages_stored(real_kv, url, "exact")
    with open_store(url) as st:
        pointer = sorted(k for k in st.list("sglang/") if "/p/" in k)[0]
        raw = bytearray(st.get(pointer))
        raw[-3] = 0xFF  # once, a byte that was not UTF-8 any more raised UnicodeDecodeError out of batch_get
        st.put(pointer, bytes(raw))
    got = b.batch_get(keys, dummy_pages(6, kv))
    assert got[0] is None and all(g is not None for g in got[1:])  # the other pages' group still restores
    assert b.batch_exists(keys) == 0  # the damaged page is forgotten, to be stored again


@pytest.mark.parametrize("edit", ["index", "pages-forged"])
def test_an_edited_pointer_never_reads_another_page(real_kv, tmp_path, edit):
    # a pointer had no checksum: its index edited from 0 to 1 returned page 1's KV for page 0; a first
    # pointer naming another group size failed (and forgot) its whole group
    from kvcodec.integrations.sglang_pages import PagePointer

    url = f"file://{tmp_path}"
    b, kv, keys, pages = six_pages_stored(real_kv, url, "exact")
    with open_store(url) as st:
        pointer = sorted(k for k in st.list("sglang/") if "/p/" in k)[0]
        raw = bytearray(st.get(pointer))
        if edit == "index":
            raw[5] = 1  # the index field, its checksum left as it was
        else:  # a consistent forgery: checksum right, the group's size wrong
            p = PagePointer.from_bytes(bytes(raw), pointer)
            raw = bytearray(PagePointer(p.page_key, p.group_key, p.index, p.pages + 1).to_bytes())
        st.put(pointer, bytes(raw))
    got = b.batch_get(keys, dummy_pages(6, kv))
    assert got[0] is None and all(torch.equal(a, w) for a, w in zip(got[1:], pages[1:]))
    assert b.batch_exists(keys) == 0 and all(b.exists(k) for k in keys[1:])


def test_pointers_the_store_serves_under_other_page_keys_are_misses(real_kv, tmp_path):
    """A store that serves the wrong object: two pages' pointers swapped (a pointer named no page,
    so page 0 read page 1's KV)."""
    url = f"file://{tmp_path}"
    b, kv, keys, pages = six_pages_stored(real_kv, url, "exact")
    with open_store(url) as st:
        first, second = sorted(k for k in st.list("sglang/") if "/p/" in k)[:2]
        a, c = st.get(first), st.get(second)
        st.put_many({first: c, second: a})
    got = b.batch_get(keys, dummy_pages(6, kv))
    swapped = [i for i, g in enumerate(got) if g is None]
    assert len(swapped) == 2 and all(torch.equal(got[i], pages[i]) for i in range(6) if i not in swapped)


def test_a_group_of_other_pages_never_overwrites_the_blob_pages_point_into(real_kv, tmp_path):
    """A group's blob key named its first and last page and the count: a later group of other pages
    between the same two overwrote the blob, and a page still pointing into it read another page's KV."""
    url = f"file://{tmp_path}"
    kv = real_kv.to(torch.float16)
    b = backend(url, kv, quant="exact", group_tokens=64)
    buf = host_buffer(kv, "layer_first")
    pages = [host_page(buf, "layer_first", i) for i in range(4)]
    a, bb, c, d = keys = keys_for(4)
    assert b.batch_set([c], [pages[2]]) and b.batch_set(keys, pages)  # the group [a, bb, d]
    with open_store(url) as st:  # an eviction (maxmemory, TTL, capacity) of three pointers
        st.delete_many([b._page_key(k) for k in (a, c, d)])
    assert b.batch_set(keys, pages)  # the group [a, c, d]
    assert torch.equal(b.batch_get([bb], dummy_pages(1, kv))[0], pages[1])


def test_what_the_reader_cannot_take_is_a_miss_that_keeps_the_pages(real_kv, tmp_path):
    """Only damage in the store forgets pages: a bfloat16 server's pages read by a float16 one (the same
    keys) restore cast, and a wrongly sized target misses that page alone; neither deletes anything."""
    url = f"file://{tmp_path}"
    kv = real_kv.to(torch.bfloat16)
    b16 = backend(url, kv, quant="int8", group_tokens=64)
    buf = host_buffer(kv, "layer_first")
    keys, pages = keys_for(4), [host_page(buf, "layer_first", i) for i in range(4)]
    assert b16.batch_set(keys, pages)
    half = kv.to(torch.float16)
    got = backend(url, half, quant="int8", group_tokens=64).batch_get(keys, dummy_pages(4, half))
    mine = b16.batch_get(keys, dummy_pages(4, kv))
    assert all(g is not None and g.dtype == torch.float16 for g in got)
    assert all(torch.equal(g, m.to(torch.float16)) for g, m in zip(got, mine))
    targets = [*dummy_pages(3, kv), torch.zeros(10, dtype=kv.dtype)]
    assert [g is not None for g in b16.batch_get(keys, targets)] == [True, True, True, False]
    assert b16.batch_exists(keys) == 4


def test_malformed_option_values_are_one_line_naming_the_option(real_kv, tmp_path):
    url = f"file://{tmp_path}"
    for extra, name in (({"resolution": "256x256x2"}, "resolution"), ({"group_tokens": "abc"}, "group_tokens")):
        with pytest.raises(ConfigError, match=name):
            backend(url, real_kv, **extra)


def test_bad_configs_fail_at_startup(real_kv, tmp_path):
    url = f"file://{tmp_path}"
    with pytest.raises(ConfigError, match="url"):
        StorageBackendFactory.create_backend("dynamic", storage_config(""), None)
    with pytest.raises(ConfigError):
        backend(url, real_kv, quant="int9")
    with pytest.raises(ConfigError, match="group_tokens"):
        backend(url, real_kv, chunk_tokens=16)
    mla = dataclasses.replace(storage_config(url), is_mla_model=True)
    with pytest.raises(ConfigError, match="MLA"):
        StorageBackendFactory.create_backend("dynamic", mla, None)
    with pytest.raises(ConfigError, match="layout"):
        PageGeometry("page_unified", 2, 16, 2, 64, torch.float16)
    with pytest.raises(ConfigError, match="interface_v1"):  # SGLang would call methods the backend has not
        StorageBackendFactory.create_backend("dynamic", storage_config(url, interface_v1=1), None)


def test_a_hybrid_models_other_host_pools_fail_the_attach(real_kv, tmp_path):
    """As HybridCacheController attaches: the KV anchor, then every pool of the host pool group
    through register_mem_host_pool_v2, then on_host_pools_registered. The KV pool alone attaches; a
    state pool beside it fails the attach, and so does one registered later (a dynamic sidecar)."""
    b = backend(f"file://{tmp_path}", real_kv)
    b.register_mem_host_pool_v2(b.mem_pool_host, "kv")
    b.on_host_pools_registered()
    page = host_page(host_buffer(real_kv, "layer_first"), "layer_first", 0)
    assert b.batch_set(keys_for(1, "s"), [page]) and b.batch_exists(keys_for(1, "s")) == 1  # attached: it serves
    other = backend(f"file://{tmp_path}", real_kv)
    other.register_mem_host_pool_v2(other.mem_pool_host, "kv")
    other.register_mem_host_pool_v2(object(), "mamba")
    with pytest.raises(ConfigError, match="mamba"):
        other.on_host_pools_registered()
    with pytest.raises(ConfigError, match="swa"):
        b.register_mem_host_pool_v2(object(), "swa")
    # SGLang's hybrid controller had enabled the backend before it asked: it stays attached, answering misses
    assert b.batch_set(keys_for(1), [page]) is False and b.batch_exists(keys_for(1, "s")) == 0
    assert b.batch_get(keys_for(1, "s"), dummy_pages(1, real_kv)) == [None] and not b.exists(keys_for(1, "s")[0])
    transfer = PoolTransfer(name=PoolName.KV, keys=keys_for(1, "s"))
    assert b.batch_exists_v2(keys_for(1, "s"), [transfer]).kv_hit_pages == 0
    assert b.batch_get_v2([transfer]) == {PoolName.KV: [False]} == b.batch_set_v2([transfer])
    b.clear()  # SGLang's admin clear of a backend it still counts attached: nothing deleted
    with open_store(f"file://{tmp_path}") as st:
        assert any("/p/" in k for k in st.list("sglang/"))


@pytest.mark.parametrize("layout", ["layer_first", "page_first", "page_first_direct", "page_head"])
def test_page_layouts_map_to_canonical(layout):
    L, H, D = 3, 2, 4
    kv = torch.arange(L * 2 * PAGE * H * D, dtype=torch.float32).reshape(L, 2, PAGE, H, D)
    flat = {  # each layout's page as SGLang's host pool stores it
        "layer_first": kv.permute(1, 0, 2, 3, 4),
        "page_first": kv.permute(1, 2, 0, 3, 4),
        "page_first_direct": kv.permute(1, 0, 2, 3, 4).unsqueeze(1),
        "page_head": kv.permute(1, 3, 2, 0, 4).unsqueeze(1),
    }[layout].flatten()
    g = PageGeometry(layout, L, PAGE, H, D, torch.float32)
    assert torch.equal(page_to_canonical(flat, g), kv)
