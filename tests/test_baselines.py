"""Baseline codecs: registry, bit-exact round trips, error bounds of the lossy ones, and the
container's reaction to corruption and truncation."""

import struct
import zlib

import pytest
import torch

from kvbench.baselines import (
    TensorCoder,
    available_codecs,
    base,
    cachegen,
    general,
    get_codec,
    register_codec,
    registered_codecs,
)
from kvcodec.errors import (
    BackendUnavailableError,
    ChecksumError,
    ConfigError,
    CorruptStreamError,
    FormatError,
    ShapeError,
    TruncatedError,
)

DTYPES = [torch.float16, torch.bfloat16, torch.float32]
CPU_LOSSLESS = ["raw", "zstd-3", "zstd-19", "zstd-3-shuffle", "zstd-19-shuffle", "lz4", "lz4-shuffle"]
CPU_LOSSY = ["int8-zstd-19", "int4-zstd-19", "cachegen", "cachegen-compact"]
OWN_CPU = CPU_LOSSLESS + CPU_LOSSY


def random_kv(shape=(3, 2, 37, 2, 16), dtype=torch.float16, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g).to(dtype)


def structured_kv(shape=(12, 2, 260, 2, 16), dtype=torch.float16, seed=1):
    """KV-like: per-channel offsets and scales, a few outlier channels, a slow drift over tokens,
    a constant channel and an all-zero token."""
    g = torch.Generator().manual_seed(seed)
    L, _, T, H, D = shape
    scale = torch.rand(L, 2, 1, H, D, generator=g) * 2 + 0.05
    offset = torch.randn(L, 2, 1, H, D, generator=g) * 3
    drift = torch.cumsum(torch.randn(L, 2, T, H, D, generator=g) * 0.05, dim=2)
    x = offset + scale * torch.randn(L, 2, T, H, D, generator=g) + drift
    x[:, 0, :, 0, :2] *= 20  # outlier key channels
    x[:, :, :, H - 1, min(3, D - 1)] = 0.5  # constant channel
    x[:, :, min(5, T - 1)] = 0  # a token of zeros
    return x.to(dtype)


def rounding(out):
    """The output dtype's own rounding of a reconstructed value (half an ulp, generously)."""
    rel = {torch.float16: 2**-10, torch.bfloat16: 2**-7, torch.float32: 2**-22}[out.dtype]
    return out.float().abs() * rel


def bits_equal(a, b):
    return (
        a.dtype == b.dtype
        and a.shape == b.shape
        and torch.equal(a.view(base.BITS_VIEW[a.dtype]), b.view(base.BITS_VIEW[b.dtype]))
    )


# --- registry -------------------------------------------------------------------------------------


def test_registry_lists_cpu_codecs_and_builds_them_by_name():
    avail = available_codecs()
    for name in OWN_CPU:
        assert name in avail
        codec = get_codec(name)
        assert isinstance(codec, TensorCoder)
        assert codec.name == name
        assert codec.lossless == (name in CPU_LOSSLESS)
    names = registered_codecs()
    for name in (
        "nvcomp-ans",
        "nvcomp-bitcomp",
        "nvcomp-gdeflate",
        "kvcodec-int8",
        "kvcodec-exact",
        "lmcache-cachegen",
    ):
        assert name in names


def test_unknown_and_duplicate_names_are_config_errors():
    with pytest.raises(ConfigError):
        get_codec("zstd-42")
    with pytest.raises(ConfigError):
        register_codec("raw", "kvbench.baselines.general:RawCodec")


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only behaviour")
def test_gpu_codecs_are_unavailable_without_cuda():
    avail = available_codecs()
    for name in ("nvcomp-ans", "nvcomp-bitcomp", "nvcomp-gdeflate"):
        assert name not in avail
        with pytest.raises(BackendUnavailableError):
            get_codec(name)


def test_overrides_reach_the_constructor():
    codec = get_codec("cachegen", chunk_tokens=64)
    assert codec.chunk_tokens == 64
    with pytest.raises(ConfigError):
        get_codec("cachegen", table="bogus")


# --- lossless round trips ------------------------------------------------------------------------


@pytest.mark.parametrize("name", CPU_LOSSLESS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", ["random", "structured", "special"])
def test_lossless_codecs_restore_every_bit(name, dtype, kind):
    if kind == "random":
        kv = random_kv(dtype=dtype)
    elif kind == "structured":
        kv = structured_kv((2, 2, 64, 2, 16), dtype=dtype)
    else:
        kv = random_kv((2, 2, 5, 1, 8), dtype=dtype)
        flat = kv.view(-1)
        flat[:6] = torch.tensor([float("inf"), float("-inf"), float("nan"), -0.0, 0.0, 1e-40]).to(dtype)
    codec = get_codec(name)
    data = codec.encode(kv)
    assert isinstance(data, bytes)
    out = codec.decode(data)
    assert bits_equal(out, kv)
    assert out.device.type == "cpu"


def test_shuffling_helps_on_structured_fp16():
    kv = structured_kv()
    plain = len(get_codec("zstd-3").encode(kv))
    shuffled = len(get_codec("zstd-3-shuffle").encode(kv))
    assert shuffled < plain < len(get_codec("raw").encode(kv))


def test_encode_rejects_non_kv_tensors():
    codec = get_codec("zstd-3")
    with pytest.raises(ShapeError):
        codec.encode(torch.zeros(2, 3, 4, 5, 6))
    with pytest.raises(ShapeError):
        codec.encode(torch.zeros(2, 2, 4, 5))
    with pytest.raises(ShapeError):
        codec.encode(torch.zeros(2, 2, 4, 1, 8, dtype=torch.int16))


# --- lossy codecs --------------------------------------------------------------------------------


@pytest.mark.parametrize("bits", [8, 4])
@pytest.mark.parametrize("dtype", DTYPES)
def test_int_zstd_error_is_at_most_half_a_step(bits, dtype):
    kv = structured_kv(dtype=dtype)
    codec = get_codec(f"int{bits}-zstd-19")
    out = codec.decode(codec.encode(kv))
    assert out.dtype == dtype and out.shape == kv.shape
    _, off, step = general.minmax_quantize(kv, bits, codec.chunk_tokens)
    for c in range(off.shape[0]):
        sl = slice(c * codec.chunk_tokens, (c + 1) * codec.chunk_tokens)
        err = (out[:, :, sl].float() - kv[:, :, sl].float()).abs()
        bound = step[c].unsqueeze(2) / 2 * (1 + 1e-4) + rounding(out[:, :, sl]) + 1e-6
        assert (err <= bound).all()


def test_int8_zstd_codes_the_same_integers_as_kvcodec():
    integer = pytest.importorskip("kvcodec.quant.integer")
    kv = structured_kv((2, 2, 300, 2, 16))
    q, _, _ = general.minmax_quantize(kv, 8, 256)
    b = torch.full((2,), 8, dtype=torch.int64)
    off, st = integer.minmax_params(kv[:, :, :256], b)
    assert torch.equal(q[:, :, :256], integer.quantize(kv[:, :, :256], off, st, b))


@pytest.mark.parametrize("name", ["cachegen", "cachegen-compact"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("kind", ["random", "structured"])
def test_cachegen_error_is_bounded_by_its_quantization_step(name, dtype, kind):
    kv = random_kv((12, 2, 260, 2, 16), dtype=dtype) if kind == "random" else structured_kv(dtype=dtype)
    codec = get_codec(name)
    out = codec.decode(codec.encode(kv))
    assert out.dtype == dtype and out.shape == kv.shape
    bins = codec.bins_for(kv.shape[0])
    bound = cachegen.error_bound(cachegen.token_absmax(kv), bins)[..., None, None]
    err = (out.float() - kv.float()).abs()
    # the output dtype's own rounding comes on top of half a step
    assert (err <= bound * (1 + 1e-4) + rounding(out) + 1e-30).all()
    assert bool((out[:, :, 5] == 0).all()) if kind == "structured" else True


def test_cachegen_uses_lmcache_default_bins():
    k, v = cachegen.default_bins(30)
    assert k[:10] == (32,) * 10 and k[10:] == (16,) * 20
    assert v[:2] == (32, 32) and v[2:] == (16,) * 28
    assert cachegen.default_bins(6) == ((32,) * 6, (32,) * 6)
    kv = structured_kv((12, 2, 64, 2, 16))
    codec = get_codec("cachegen")
    _, bins, _, q = codec.decode_symbols(codec.encode(kv))
    c = cachegen.half_range(bins)
    assert int(q[0, 0].max()) <= 30 and int(q[11, 0].max()) <= 14 and int(q[2, 1].max()) <= 14
    assert int(q[0, 0].max()) > 14  # early key layers really use the finer grid
    assert bool((q <= (2 * c)[:, :, None, None, None]).all())


def test_cachegen_compact_is_smaller_and_decodes_identically():
    kv = structured_kv()
    a, b = get_codec("cachegen"), get_codec("cachegen-compact")
    da, db = a.encode(kv), b.encode(kv)
    assert len(db) < len(da) < len(get_codec("int8-zstd-19").encode(kv))
    assert torch.equal(a.decode(da), b.decode(db))


def test_cachegen_handles_token_counts_that_are_not_chunk_multiples():
    kv = structured_kv((2, 2, 7, 1, 8))
    codec = get_codec("cachegen", chunk_tokens=3)
    out = codec.decode(codec.encode(kv))
    bound = cachegen.error_bound(cachegen.token_absmax(kv), codec.bins_for(2))[..., None, None]
    assert ((out.float() - kv.float()).abs() <= bound * 1.001 + rounding(out)).all()


def test_lmcache_reference_decodes_to_the_same_values():
    """Where LMCache's own CacheGen runs, the CacheGen-style codec reconstructs identical values."""
    if "lmcache-cachegen" not in available_codecs():
        pytest.skip("lmcache is not installed with a compute backend")
    kv = structured_kv((12, 2, 300, 2, 32))
    ref = get_codec("lmcache-cachegen")
    ours = get_codec("cachegen")
    assert torch.equal(ref.decode(ref.encode(kv)), ours.decode(ours.encode(kv)))


def test_kvcodec_adapter_round_trip():
    if "kvcodec-exact" not in available_codecs():
        pytest.skip("kvcodec.encode/decode not in this build")
    kv = structured_kv((2, 2, 32, 1, 16))
    codec = get_codec("kvcodec-exact")
    assert codec.lossless
    out = codec.decode(codec.encode(kv))
    assert bits_equal(out.cpu(), kv)


# --- container: corruption and truncation --------------------------------------------------------


def reseal(data: bytes, payload_len: int | None = None) -> bytes:
    """Recompute the container's CRC (and optionally its payload length) after a deliberate edit,
    so that the codec's own checks are what is tested."""
    ndim, namelen = data[6], data[7]
    off = 8 + namelen + 4 * ndim
    if payload_len is not None:
        data = data[:off] + struct.pack("<Q", payload_len) + data[off + 8 :]
    crc_off = off + 8
    crc = zlib.crc32(data[crc_off + 4 :], zlib.crc32(data[:crc_off]))
    return data[:crc_off] + struct.pack("<I", crc) + data[crc_off + 4 :]


@pytest.mark.parametrize("name", OWN_CPU)
def test_flipped_byte_is_a_checksum_error(name):
    codec = get_codec(name)
    data = bytearray(codec.encode(random_kv()))
    data[len(data) // 2] ^= 0x40
    with pytest.raises(ChecksumError):
        codec.decode(bytes(data))


@pytest.mark.parametrize("name", OWN_CPU)
def test_truncation_is_a_truncated_error(name):
    codec = get_codec(name)
    data = codec.encode(random_kv())
    for cut in (len(data) - 1, len(data) // 2, 20, 6):
        with pytest.raises(TruncatedError):
            codec.decode(data[:cut])


@pytest.mark.parametrize("name", ["raw", "zstd-19", "cachegen"])
def test_foreign_bytes_are_format_errors(name):
    codec = get_codec(name)
    data = codec.encode(random_kv())
    with pytest.raises(FormatError):
        codec.decode(b"\x28\xb5\x2f\xfd" + data[4:])  # a zstd frame magic, not ours
    with pytest.raises(FormatError):
        codec.decode(b"")
    with pytest.raises(FormatError):
        codec.decode(data + b"\x00")
    other = "zstd-3" if name != "zstd-3" else "raw"
    with pytest.raises(FormatError):
        get_codec(other).decode(data)  # written by another codec
    bad_version = data[:4] + bytes([99]) + data[5:]
    with pytest.raises(FormatError):
        codec.decode(bad_version)


@pytest.mark.parametrize("name", ["zstd-19", "zstd-3-shuffle", "lz4", "int8-zstd-19", "cachegen", "cachegen-compact"])
def test_payload_that_passes_the_crc_but_does_not_decode_is_corrupt(name):
    codec = get_codec(name)
    data = codec.encode(structured_kv((2, 2, 40, 1, 16)))
    _, payload = base.unpack(data)
    start = len(data) - len(payload)
    # cachegen: inside the rANS words at the end; others: inside the compressed frame
    pos = len(data) - 3 if name == "cachegen" else start + len(payload) // 3
    broken = bytearray(data)
    broken[pos] ^= 0xFF
    broken[pos + 1] ^= 0x5A
    with pytest.raises(CorruptStreamError):
        codec.decode(reseal(bytes(broken)))


def test_cachegen_lane_lengths_that_disagree_with_the_words_are_corrupt():
    codec = get_codec("cachegen")
    data = codec.encode(structured_kv((2, 2, 40, 1, 16)))
    _, payload = base.unpack(data)
    with pytest.raises(CorruptStreamError):
        codec.decode(reseal(data[:-2], payload_len=len(payload) - 2))


# --- GPU ------------------------------------------------------------------------------------------

NVCOMP = ["nvcomp-ans", "nvcomp-ans-shuffle", "nvcomp-bitcomp", "nvcomp-gdeflate", "nvcomp-gdeflate-shuffle"]
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@pytest.mark.gpu
@needs_cuda
def test_cachegen_cuda_decode_matches_the_cpu_decode():
    from kvbench.baselines import cachegen_cuda

    kv = structured_kv((12, 2, 300, 2, 32))
    codec = get_codec("cachegen")
    data = codec.encode(kv)
    cpu = codec.decode(data)
    assert cachegen_cuda.is_available(), "CuPy is expected on the GPU machine"
    gpu = codec.decode(data, device="cuda")
    assert gpu.device.type == "cuda"
    assert torch.equal(gpu.cpu(), cpu)
    # the vectorised torch decoder on CUDA agrees too
    _, bins, maxes, q = codec.decode_symbols(data, "cpu")
    header, _, _, chunks = codec.parse(data)
    from kvbench.baselines import rans

    for _start, n, freq, nw, words in chunks:
        a = rans.decode(words.cuda(), nw.cuda(), freq.cuda(), n).cpu()
        b = cachegen_cuda.decode_lanes(words.cuda(), nw.cuda(), freq.cuda(), n).cpu().long()
        assert torch.equal(a, b)


@pytest.mark.gpu
@needs_cuda
def test_cachegen_cuda_decode_detects_corrupt_lanes():
    from kvbench.baselines import cachegen_cuda

    codec = get_codec("cachegen")
    header, _, _, chunks = codec.parse(codec.encode(structured_kv((2, 2, 40, 1, 16))))
    _, n, freq, nw, words = chunks[0]
    words = words.clone()
    words[-1] ^= 0x5A5A
    with pytest.raises(CorruptStreamError):
        cachegen_cuda.decode_lanes(words.cuda(), nw.cuda(), freq.cuda(), n)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("name", NVCOMP)
@pytest.mark.parametrize("dtype", DTYPES)
def test_nvcomp_codecs_are_bit_exact(name, dtype):
    if name not in available_codecs():
        pytest.skip("nvidia-nvcomp-cu13 is not installed")
    kv = structured_kv(dtype=dtype)
    codec = get_codec(name)
    data = codec.encode(kv)
    out = codec.decode(data, device="cuda")
    assert out.device.type == "cuda"
    assert bits_equal(out.cpu(), kv)
    assert bits_equal(codec.decode(data, device="cpu"), kv)
    broken = bytearray(data)
    broken[-5] ^= 0x11
    with pytest.raises(FormatError):
        codec.decode(bytes(broken))
