import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcodec.quant import exact, integer

DTYPES = [torch.float16, torch.bfloat16, torch.float32]
_INT = {2: torch.int16, 4: torch.int32}


@st.composite
def kv_tensors(draw, finite=True):
    layers = draw(st.integers(1, 3))
    tokens = draw(st.integers(1, 9))
    heads = draw(st.integers(1, 2))
    dim = draw(st.sampled_from([1, 4, 8]))
    scale = draw(st.sampled_from([1e-3, 1.0, 30.0, 5e3]))
    seed = draw(st.integers(0, 2**31 - 1))
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(layers, 2, tokens, heads, dim, generator=g) * scale
    if draw(st.booleans()):
        x[..., 0] = x[..., 0] * 0 + draw(st.floats(-100, 100))  # constant channel
    return x


@given(kv_tensors(), st.sampled_from(DTYPES), st.data())
@settings(max_examples=60, deadline=None)
def test_integer_quantization_error_is_at_most_half_a_step(x, dtype, data):
    x = x.to(dtype)
    bits = torch.tensor([data.draw(st.integers(2, 8)) for _ in range(x.shape[0])])
    offset, step = integer.minmax_params(x, bits)
    q = integer.quantize(x, offset, step, bits)
    assert q.dtype == torch.uint8
    assert (q.amax(dim=(1, 2, 3, 4)).long() <= (2**bits - 1)).all()
    back = integer.dequantize(q, offset, step, torch.float32)
    err = (x.float() - back).abs()
    bound = step.float().unsqueeze(2) / 2
    assert (err <= bound * (1 + 1e-5) + 1e-6 * x.float().abs() + 1e-7).all()


@given(kv_tensors(), st.sampled_from(DTYPES))
@settings(max_examples=40, deadline=None)
def test_quantization_params_cover_every_value(x, dtype):
    x = x.to(dtype)
    bits = torch.full((x.shape[0],), 8)
    offset, step = integer.minmax_params(x, bits)
    assert (offset.float() <= x.float().amin(dim=2)).all()
    assert (offset.float() + step.float() * 255 >= x.float().amax(dim=2)).all()


@given(st.sampled_from(DTYPES), st.integers(0, 2**31 - 1))
@settings(max_examples=30, deadline=None)
def test_exact_byte_planes_restore_every_bit(dtype, seed):
    width = exact.bytes_per_value(dtype)
    g = torch.Generator().manual_seed(seed)
    bits = torch.randint(-(2 ** (8 * width - 1)), 2 ** (8 * width - 1), (257,), generator=g, dtype=torch.int64)
    x = bits.to(_INT[width]).view(dtype)  # every bit pattern: NaNs, infinities, -0, subnormals
    planes = exact.split_bytes(x)
    assert len(planes) == width and all(p.dtype == torch.uint8 for p in planes)
    assert torch.equal(exact.join_bytes(planes, dtype).view(_INT[width]), x.view(_INT[width]))


@given(st.sampled_from(DTYPES), st.lists(st.floats(-6e4, 6e4, allow_nan=False), min_size=2, max_size=50))
@settings(max_examples=40, deadline=None)
def test_top_byte_is_monotone_in_magnitude_and_ignores_sign(dtype, values):
    x = torch.tensor(values).to(dtype)
    top = exact.split_bytes(x)[0].long()
    mag = x.float().abs()
    smaller_top = top.unsqueeze(1) < top.unsqueeze(0)
    assert (mag.unsqueeze(1) <= mag.unsqueeze(0))[smaller_top].all()  # larger top byte, never smaller magnitude
    assert torch.equal(exact.split_bytes(-x)[0], exact.split_bytes(x)[0])


@given(st.integers(1, 6), st.integers(1, 20), st.integers(1, 8), st.data())
@settings(max_examples=50, deadline=None)
def test_centering_is_a_bijection_per_bit_width(units, tokens, dim, data):
    from kvcodec.quant import centering

    bits = torch.tensor([data.draw(st.integers(2, 8)) for _ in range(units)])
    modulus = 2**bits
    seed = data.draw(st.integers(0, 2**31 - 1))
    g = torch.Generator().manual_seed(seed)
    symbols = (torch.randint(0, 256, (units, tokens, dim), generator=g) % modulus.view(-1, 1, 1)).to(torch.uint8)
    centers = centering.channel_centers(symbols, modulus)
    shifted = centering.center(symbols, centers, modulus)
    assert (shifted.long() < modulus.view(-1, 1, 1)).all()
    assert torch.equal(centering.uncenter(shifted, centers, modulus), symbols)
    # the fast CPU paths equal the plain definitions: torch's lower median, the modular shift
    assert torch.equal(centers, symbols.median(dim=1).values)
    m = modulus.view(-1, 1, 1)
    assert torch.equal(
        shifted, torch.remainder(symbols.long() - centers.long().unsqueeze(1) + m // 2, m).to(torch.uint8)
    )


@given(
    st.floats(1e30, 3.4e38),
    st.integers(2, 8),
    st.integers(0, 2**31 - 1),
)
@settings(max_examples=60, deadline=None)
def test_values_near_the_float32_limit_quantize_without_overflow(scale, bits, seed):
    g = torch.Generator().manual_seed(seed)
    x = (torch.rand(2, 2, 7, 1, 4, generator=g) * 2 - 1) * scale
    x[0, 0, 0] = scale
    x[0, 0, 1] = -scale
    b = torch.full((2,), bits)
    offset, step = integer.minmax_params(x, b)
    assert torch.isfinite(step).all() and torch.isfinite(offset).all()
    back = integer.dequantize(integer.quantize(x, offset, step, b), offset, step, torch.float32)
    assert torch.isfinite(back).all()
    err = (back.double() - x.double()).abs()
    assert (err <= step.double().unsqueeze(2) / 2 * (1 + 1e-6) + x.double().abs() * 2**-23).all()


def test_int8_codec_round_trip_of_plus_minus_3e38_has_no_nan():
    import kvcodec

    x = torch.randn(2, 2, 32, 2, 16, generator=torch.Generator().manual_seed(1)) * 1e37
    x[:, :, 0] = 3e38
    x[:, :, 1] = -3e38
    config = kvcodec.CodecConfig(quant="int8", chunk_tokens=32, resolutions=((144, 144),), sample_coder="zstd")
    out = kvcodec.decode(kvcodec.encode(x, config))
    assert not out.isnan().any()
    assert ((out.double() - x.double()).abs() <= 6e38 / 255 / 2 * 1.001).all()
