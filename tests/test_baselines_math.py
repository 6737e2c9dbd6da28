"""Property tests for the pure math under the baselines: CacheGen's per-token quantizer, the
vectorised rANS coder, frequency normalisation and byte-plane shuffling."""

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvbench.baselines import base, cachegen, general, rans
from kvcodec.errors import CorruptStreamError

DTYPES = [torch.float16, torch.bfloat16, torch.float32]


@st.composite
def kv_tensors(draw):
    layers = draw(st.integers(1, 3))
    tokens = draw(st.integers(1, 9))
    heads = draw(st.integers(1, 2))
    dim = draw(st.sampled_from([1, 4, 8]))
    scale = draw(st.sampled_from([1e-3, 1.0, 30.0, 5e3]))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**31 - 1)))
    x = torch.randn(layers, 2, tokens, heads, dim, generator=g) * scale
    if draw(st.booleans()):
        x[:, :, 0] = 0  # an all-zero token: max is 0
    return x


@given(kv_tensors(), st.sampled_from(DTYPES), st.data())
@settings(max_examples=80, deadline=None)
def test_cachegen_quantization_stays_in_range_and_within_half_a_step(x, dtype, data):
    x = x.to(dtype)
    L = x.shape[0]
    bins = torch.tensor([[data.draw(st.sampled_from([4, 8, 16, 32, 64])) for _ in range(2)] for _ in range(L)])
    maxes = cachegen.token_absmax(x)
    assert maxes.dtype == dtype
    q = cachegen.quantize(x, maxes, bins)
    c = cachegen.half_range(bins)
    assert q.dtype == torch.uint8
    assert bool((q.long() <= 2 * c[:, :, None, None, None]).all())
    back = cachegen.dequantize(q, maxes, bins, torch.float32)
    err = (back - x.float()).abs()
    bound = cachegen.error_bound(maxes, bins)[..., None, None]
    assert bool((err <= bound * (1 + 1e-5) + 1e-30).all())
    # zero tokens come back as exact zeros; the token's extreme value is exact
    zero = maxes == 0
    assert bool((back[zero] == 0).all())


@given(st.integers(1, 40), st.integers(0, 70), st.integers(2, 40), st.integers(0, 2**31 - 1), st.floats(0.1, 8))
@settings(max_examples=60, deadline=None)
def test_rans_round_trips_any_lanes(lanes, n, A, seed, sharpness):
    g = torch.Generator().manual_seed(seed)
    alpha = torch.randint(2, A + 1, (lanes,), generator=g)
    logits = torch.randn(lanes, A, generator=g) * sharpness
    logits[torch.arange(A).unsqueeze(0) >= alpha.unsqueeze(1)] = -float("inf")
    probs = torch.softmax(logits, 1)
    sym = torch.multinomial(probs, max(n, 1), replacement=True, generator=g)[:, :n]
    counts = torch.zeros(lanes, A, dtype=torch.int64).scatter_add_(1, sym, torch.ones_like(sym))
    freq = rans.normalize_freqs(counts, alpha)
    words, nwords = rans.encode(sym, freq)
    assert int(words.min()) >= 0 and int(words.max()) <= 0xFFFF
    assert bool((nwords <= n + 2).all()) and int(nwords.sum()) == words.numel()
    assert torch.equal(rans.decode(words, nwords, freq, n), sym)


@given(st.integers(1, 30), st.integers(3, 64), st.integers(0, 2**31 - 1), st.integers(0, 500))
@settings(max_examples=60, deadline=None)
def test_normalized_frequencies_sum_to_the_precision_and_cover_the_alphabet(lanes, A, seed, total):
    g = torch.Generator().manual_seed(seed)
    alpha = torch.randint(1, A + 1, (lanes,), generator=g)
    counts = torch.randint(0, total + 1, (lanes, A), generator=g)
    freq = rans.normalize_freqs(counts, alpha)
    assert bool((freq.sum(1) == rans.M).all())
    inside = torch.arange(A).unsqueeze(0) < alpha.unsqueeze(1)
    assert bool((freq[inside] >= 1).all())
    assert bool((freq[~inside] == 0).all())


def test_rans_cost_is_close_to_the_entropy():
    g = torch.Generator().manual_seed(3)
    lanes, n, A = 64, 256, 31
    probs = torch.softmax(torch.randn(lanes, A, generator=g) * 2, 1)
    sym = torch.multinomial(probs, n, replacement=True, generator=g)
    counts = torch.zeros(lanes, A, dtype=torch.int64).scatter_add_(1, sym, torch.ones_like(sym))
    words, _ = rans.encode(sym, rans.normalize_freqs(counts, torch.full((lanes,), A)))
    p = counts.float() / n
    entropy_bits = float(-(counts.float() * torch.log2(p.clamp(min=1e-12))).sum())
    coded = words.numel() * 16
    assert entropy_bits < coded < entropy_bits * 1.01 + lanes * 40  # <= ~40 bits a lane of flush


def test_rans_rejects_words_that_do_not_match_the_tables():
    sym = torch.tensor([[0, 1, 2, 1, 0] * 20])
    counts = torch.tensor([[40, 40, 20]])
    freq = rans.normalize_freqs(counts, torch.tensor([3]))
    words, nwords = rans.encode(sym, freq)
    with pytest.raises(CorruptStreamError):
        rans.decode(words[:-1], nwords, freq, 100)
    other = rans.normalize_freqs(torch.tensor([[1, 1, 98]]), torch.tensor([3]))
    with pytest.raises(CorruptStreamError):
        rans.decode(words, nwords, other, 100)


@given(st.integers(0, 200), st.sampled_from([1, 2, 4]), st.integers(0, 2**31 - 1))
@settings(max_examples=50, deadline=None)
def test_byte_shuffle_is_a_permutation_and_invertible(n, itemsize, seed):
    raw = np.random.default_rng(seed).integers(0, 256, n * itemsize, dtype=np.uint8)
    planes = base.shuffle_bytes(raw, itemsize)
    assert sorted(planes.tolist()) == sorted(raw.tolist())
    assert np.array_equal(base.unshuffle_bytes(planes, itemsize), raw)
    if n and itemsize > 1:
        assert np.array_equal(planes[:n], raw.reshape(n, itemsize)[:, 0])


@given(kv_tensors(), st.integers(1, 8))
@settings(max_examples=50, deadline=None)
def test_fallback_minmax_quantizer_is_within_half_a_step(x, bits):
    q, lo, step = general._quantize_chunk_fallback(x, bits)
    assert int(q.max()) <= (1 << bits) - 1
    back = lo.unsqueeze(2) + q.float() * step.unsqueeze(2)
    err = (back - x).abs()
    assert bool((err <= step.unsqueeze(2) / 2 * (1 + 1e-5) + x.abs() * 1e-6 + 1e-6).all())


@given(st.sampled_from(["raw", "zstd-3", "int8-zstd-19", "cachegen"]), st.data())
@settings(max_examples=60, deadline=None)
def test_any_flip_or_cut_of_a_container_is_a_format_error(name, data):
    """Whatever byte is changed or however much is cut, decoding raises a FormatError subclass
    (never another exception, never silently wrong data)."""
    from kvbench.baselines import get_codec
    from kvcodec.errors import FormatError

    codec = get_codec(name)
    blob = _small_container(name)
    if data.draw(st.booleans()):
        pos = data.draw(st.integers(0, len(blob) - 1))
        bad = bytearray(blob)
        bad[pos] ^= data.draw(st.integers(1, 255))
        bad = bytes(bad)
    else:
        bad = blob[: data.draw(st.integers(0, len(blob) - 1))]
    with pytest.raises(FormatError):
        codec.decode(bad)


_CONTAINERS: dict = {}


def _small_container(name):
    if name not in _CONTAINERS:
        from kvbench.baselines import get_codec

        kv = torch.randn(2, 2, 9, 1, 8, generator=torch.Generator().manual_seed(5)).half()
        _CONTAINERS[name] = get_codec(name).encode(kv)
    return _CONTAINERS[name]
