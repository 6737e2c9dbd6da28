"""The raw chunk codec's restore (codecs/raw.py): one checksum pass and one bulk copy per chunk,
into dense, strided and paged targets, and a damaged chunk refused before a value is written."""

from __future__ import annotations

import tracemalloc

import pytest
import torch

from kvcodec.codecs import raw as raw_codec
from kvcodec.codecs.raw import RawCodec
from kvcodec.errors import ChecksumError, FormatError
from kvcodec.fetcher import DecodeProfile, PrefixCache
from kvcodec.restore.paged import PagedKV
from kvcodec.store import open_store

CT = 64
SHAPE = (4, 2, 3 * CT, 4, 64)  # 3 chunks of 128 KiB each


def make_kv(dtype=torch.float16, seed=0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(SHAPE, generator=g).to(dtype)


def cache_for(codec: RawCodec, device: str = "cpu") -> PrefixCache:
    profile = DecodeProfile.default(codec.resolutions)
    return PrefixCache(open_store("memory://"), "m", codec, device, policy="fixed:0", profile=profile)


def engine_layout(dtype=torch.float16, device="cpu") -> torch.Tensor:
    """A (L, 2, T, H, D) view of a cache stored as [L, 2, H, T, D] (the engine's restore target)."""
    L, _, T, H, D = SHAPE
    return torch.full((L, 2, H, T, D), -7.0, dtype=dtype, device=device).transpose(2, 3)


def payload_crcs(monkeypatch) -> list[int]:
    """Sizes of the checksums computed over a chunk's values (headers are a few hundred bytes)."""
    sizes: list[int] = []
    crc32 = raw_codec.crc32

    def counted(data):
        if len(data) > 4096:
            sizes.append(len(data))
        return crc32(data)

    monkeypatch.setattr(raw_codec, "crc32", counted)
    return sizes


def test_a_fetch_checksums_each_payload_once(monkeypatch):
    codec = RawCodec(chunk_tokens=CT)
    kv, ids = make_kv(), list(range(SHAPE[2]))
    cache = cache_for(codec)
    cache.put(ids, kv)
    sizes = payload_crcs(monkeypatch)
    r = cache.fetch(ids)
    assert r.ok and torch.equal(r.kv, kv), r.error
    assert sizes == [kv[:, :, :CT].numel() * 2] * 3  # inspect_chunk reads the header only


@pytest.mark.parametrize("variant", ["raw", "zstd"])
def test_decode_copies_the_values_once(variant):
    """No intermediate copies of a raw payload (bytes(), bytearray()): the values go from the blob's
    buffer straight into the target; a zstd one is decompressed once (lz4's decompressor grows its
    own buffer)."""
    codec = RawCodec((variant,), chunk_tokens=CT)
    kv = make_kv()
    blob = codec.encode_chunks(kv)[0].blobs[0]
    out = torch.empty_like(kv[:, :, :CT])
    codec.decode_chunk(blob, out)  # imports, first-use allocations
    nbytes = out.numel() * 2
    tracemalloc.start()
    try:
        codec.decode_chunk(blob, out)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert torch.equal(out, kv[:, :, :CT])
    assert peak < (nbytes // 4 if variant == "raw" else nbytes + nbytes // 4), peak


@pytest.mark.parametrize("variant", ["raw", "zstd", "lz4"])
def test_every_variant_restores_into_a_strided_target(variant):
    if variant == "lz4":
        pytest.importorskip("lz4.frame")
    codec = RawCodec((variant,), chunk_tokens=SHAPE[2])
    kv = make_kv()
    out = engine_layout()
    codec.decode_chunk(codec.encode_chunks(kv)[0].blobs[0], out)
    assert torch.equal(out, kv)


def test_strided_and_paged_targets_get_every_value():
    codec = RawCodec(chunk_tokens=CT)
    kv, ids = make_kv(), list(range(SHAPE[2]))
    cache = cache_for(codec)
    cache.put(ids, kv)
    out = engine_layout()
    r = cache.fetch(ids, out=out)
    assert r.ok and r.kv is out and torch.equal(out, kv), r.error
    L, _, T, H, D = SHAPE
    pages = torch.zeros((L, 2, 16, 16, H, D), dtype=torch.float16)
    table = torch.tensor([3, 15, 0, 7, 9, 1, 12, 4, 2, 10, 5, 6])
    r = cache.fetch(ids, out=PagedKV(pages, table))
    assert r.ok and torch.equal(PagedKV(pages, table).gather(0, T), kv), r.error
    bf = engine_layout(torch.bfloat16)  # another dtype: staged, converted in the restore
    assert cache.fetch(ids, out=bf).ok and torch.equal(bf, kv.to(torch.bfloat16))


def flip_payload_byte(cache: PrefixCache, ids: list[int], chunk: int) -> None:
    from kvcodec.fetcher import blob_key

    key = blob_key(cache.keys(ids)[chunk], 0)
    blob = bytearray(cache.store.get(key))
    blob[-100] ^= 0x08
    cache.store.put(key, bytes(blob))


def test_a_damaged_payload_is_refused_before_a_value_is_written():
    codec = RawCodec(chunk_tokens=CT)
    kv, ids = make_kv(), list(range(SHAPE[2]))
    blob = bytearray(codec.encode_chunks(kv[:, :, :CT])[0].blobs[0])
    blob[-100] ^= 0x08
    out = torch.full_like(kv[:, :, :CT], 3.0)
    codec.inspect_chunk(bytes(blob))  # the header is intact: inspect reads only that
    with pytest.raises(ChecksumError):
        codec.decode_chunk(bytes(blob), out)
    assert (out == 3.0).all()
    cache = cache_for(codec)
    cache.put(ids, kv)
    flip_payload_byte(cache, ids, 1)
    out = engine_layout()
    r = cache.fetch(ids, out=out)
    assert isinstance(r.error, ChecksumError) and r.tokens_restored == CT
    # chunk 1 untouched (chunk 2, decoded ahead of the restore, may be there: the fetch's prefix ends at CT)
    assert torch.equal(out[:, :, :CT], kv[:, :, :CT]) and (out[:, :, CT : 2 * CT] == -7.0).all()
    assert cache.lookup(ids) == CT  # dropped: the next put rewrites it


@pytest.mark.parametrize(
    ("edit", "says"),
    [
        (lambda h: h.pop("format"), r"lacks \['format'\]"),
        (lambda h: h.pop("resolution"), r"lacks \['resolution'\]"),
        (lambda h: h.update(format="kvcodec-chunk"), "names format 'kvcodec-chunk'"),
        (lambda h: h.update(bogus=1), r"unknown fields \['bogus'\]"),
        (lambda h: h.update(resolution=[256]), "not \\[width, height\\]"),
        (lambda h: h.update(resolution=[256, True]), "not \\[width, height\\]"),
    ],
)
def test_a_header_without_its_fields_exactly_is_refused(edit, says):
    """docs/FORMAT.md: every field but `key` is required, and none other is allowed."""
    from kvcodec.container.format import read_object, write_object

    blob = RawCodec(chunk_tokens=CT).encode_chunks(make_kv()[:, :, :CT])[0].blobs[0]
    header, payload = read_object(blob, raw_codec.MAGIC, "raw chunk")
    assert raw_codec.parse_chunk(write_object(raw_codec.MAGIC, dict(header), [bytes(payload)]))[0]["index"] == 0
    edit(header)
    with pytest.raises(FormatError, match=says):
        raw_codec.parse_chunk(write_object(raw_codec.MAGIC, header, [bytes(payload)]))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_targets_through_pinned_staging():
    codec = RawCodec(chunk_tokens=CT)
    kv, ids = make_kv(), list(range(SHAPE[2]))
    cache = cache_for(codec, "cuda")
    cache.put(ids, kv)
    for _ in range(3):  # pinned staging blocks are reused across chunks and fetches
        r = cache.fetch(ids)
        assert r.ok and torch.equal(r.kv.cpu(), kv), r.error
    for dtype in (torch.float16, torch.bfloat16):  # direct into the engine's layout, and staged
        out = engine_layout(dtype, "cuda")
        r = cache.fetch(ids, out=out)
        assert r.ok and torch.equal(out.cpu(), kv.to(dtype)), r.error
    L, _, T, H, D = SHAPE
    pages = torch.zeros((L, 2, 16, 16, H, D), dtype=torch.float16, device="cuda")
    table = torch.tensor([3, 15, 0, 7, 9, 1, 12, 4, 2, 10, 5, 6])
    r = cache.fetch(ids, out=PagedKV(pages, table))
    assert r.ok and torch.equal(PagedKV(pages, table).gather(0, T).cpu(), kv), r.error
    flip_payload_byte(cache, ids, 2)
    out = engine_layout(torch.float16, "cuda")
    r = cache.fetch(ids, out=out)
    assert isinstance(r.error, ChecksumError) and r.tokens_restored == 2 * CT
    assert (out[:, :, 2 * CT :] == -7.0).all()
