"""The transform codec's batched restore (restore.transform_kernels): the same values as the
per-group reference path, on the CPU here and on the GPU (NVDEC, NvcuvidThreads) where present.

CPU: the batched path against the reference path (dense, paged, escapes, sink tokens, RoPE
tables for every rotary style); its pure index arithmetic with hypothesis. GPU (skipped without
CUDA / NVDEC): GPU restore against the CPU restore, chunks in parallel on NvcuvidThreads.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import synthetic as codec_tests  # the synthetic KV the transform tests code
from kvcodec.codecs.transform.batch import restore_chunks, threads_decode_into
from kvcodec.codecs.transform.codec import TransformCodec
from kvcodec.errors import CorruptStreamError
from kvcodec.restore import transform_kernels as tk
from kvcodec.restore.paged import PagedKV
from kvcodec.transform import RopeSpec, calibrate, save_kvt
from kvcodec.transform.rope import apply_rope

L, H, D = 5, 2, 16
ROPE = RopeSpec(10000.0, D)
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def synthetic_kv(tokens: int, seed: int, first: int = 0, rank: int = 12) -> torch.Tensor:
    return codec_tests.synthetic_kv(tokens, seed, first, rank, layers=L)  # 5 layers: blocks of unequal height


@pytest.fixture(scope="module")
def kvt(tmp_path_factory):
    # max_group=2: groups of 2, 2, 1 layers, so blocks differ in height and coded count
    cal = calibrate([synthetic_kv(900, s) for s in (1, 2)], ROPE, max_group=2, info={"model": "synthetic"})
    path = tmp_path_factory.mktemp("kvt") / "synthetic.kvt"
    return path, save_kvt(cal, path)


def codecs(kvt, batched_device: str = "cpu", **kw):
    """(reference codec, batched codec) over the same transform."""
    kw.setdefault("chunk_tokens", 64)
    kw.setdefault("resolutions", ((64, 64),))
    kw.setdefault("coder", "zstd")
    ref, fast = TransformCodec(kvt[0], **kw), TransformCodec(kvt[0], **kw)
    ref._restorer.batched, fast._restorer.batched = False, True
    return ref, fast


def within_an_ulp(a: torch.Tensor, b: torch.Tensor) -> bool:
    """fp16 values equal up to the last bit's rounding (float32 sums in another order)."""
    return torch.allclose(a.float(), b.float(), rtol=2**-10, atol=2**-12)


def restore_all(c, chunks, shape, dtype=torch.float16, device="cpu"):
    out = torch.empty(shape, dtype=dtype, device=device)
    for ch in chunks:
        c.decode_chunk(ch.blobs[0], out[:, :, ch.start_token : ch.start_token + ch.tokens])
    return out


PRECISION = dict(fine_tokens=70, fine_bits=2, recon="laplace")  # finer tail over the last two chunks


@pytest.mark.parametrize(
    "kw",
    [dict(target_ratio=4.0), dict(theta=1e-6), dict(target_ratio=4.0, **PRECISION), dict(theta=1e-6, **PRECISION)],
    ids=["ratio4", "escapes", "ratio4-precision", "escapes-precision"],
)
def test_batched_restore_matches_the_reference_path(kvt, kw):
    ref, fast = codecs(kvt, **kw)
    kv = synthetic_kv(150, 7)  # 3 chunks: sink tokens in the first, a short last one
    chunks = ref.encode_chunks(kv)
    if "theta" in kw:
        assert ref.header(chunks[1].blobs[0])["escapes"] > 0
    a = restore_all(ref, chunks, kv.shape)
    b = restore_all(fast, chunks, kv.shape)
    assert torch.equal(a[:, :, :4], kv[:, :, :4])
    assert within_an_ulp(a, b)


def test_batched_restore_into_pages_equals_dense(kvt):
    _, fast = codecs(kvt, target_ratio=4.0)
    kv = synthetic_kv(128, 3)
    chunks = fast.encode_chunks(kv)
    dense = restore_all(fast, chunks, kv.shape)
    pages = torch.zeros((L, 2, 16, 8, H, D), dtype=torch.float16)
    table = torch.randperm(16)
    for ch in chunks:
        fast.decode_chunk(ch.blobs[0], PagedKV(pages, table))
    assert torch.equal(PagedKV(pages, table).gather(0, 128), dense)


def test_batched_restore_refuses_escapes_outside_the_chunk(kvt):
    _, fast = codecs(kvt, theta=1e-6)
    plan = fast._restorer._batched_plan({"theta": 1e-6, "key_weight": 1.0}, torch.device("cpu"))
    idx, vals = torch.tensor([0, 10**9]), torch.tensor([300, -300], dtype=torch.int32)
    with pytest.raises(CorruptStreamError):
        tk.escape_slots(plan, [(idx, vals)], 64, 100)


@settings(max_examples=40, deadline=None)
@given(st.data())
def test_escape_slots_place_each_chunks_escapes_in_its_own_columns(kvt, data):
    _, fast = codecs(kvt, theta=1e-6)
    plan = fast._restorer._batched_plan({"theta": 1e-6, "key_weight": 1.0}, torch.device("cpu"))
    rows, tokens = plan.slot_of_row.size, data.draw(st.integers(1, 64))
    escapes = []
    for _ in range(data.draw(st.integers(1, 5))):
        flat = data.draw(st.lists(st.integers(0, rows * tokens - 1), max_size=6, unique=True))
        values = data.draw(st.lists(st.integers(-(2**31), 2**31 - 1), min_size=len(flat), max_size=len(flat)))
        escapes.append((torch.tensor(sorted(flat), dtype=torch.int64), torch.tensor(values, dtype=torch.int32)))
    slots = tk.escape_slots(plan, escapes, tokens, rows)
    N, want_at, want_values = len(escapes), [], []
    for i, (idx, values) in enumerate(escapes):
        for k, v in zip(idx.tolist(), values.tolist()):
            want_at.append(int(plan.slot_of_row[k // tokens]) * N * tokens + i * tokens + k % tokens)
            want_values.append(v)
    assert slots.flat.tolist() == want_at and slots.values.tolist() == want_values
    assert slots.fit_half() == all(abs(v) <= tk.HALF_MAX for v in want_values)


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 10**6), st.integers(-(2**40), 2**40)), max_size=12, unique_by=lambda e: e[0]))
def test_split_half_clips_each_escape_to_float16_and_keeps_the_rest_beyond_it(escapes):
    flat = np.array([f for f, _ in escapes], dtype=np.int64)
    values = np.array([v for _, v in escapes], dtype=np.int64)
    fit, beyond = tk.EscapeSlots(flat, values).split_half()
    assert fit.flat.tolist() == flat.tolist() and fit.fit_half()
    rest = dict(zip(beyond.flat.tolist(), beyond.values.tolist()))
    assert set(rest) == {f for f, v in escapes if abs(v) > tk.HALF_MAX} and 0 not in rest.values()
    assert [c + rest.get(f, 0) for f, c in zip(fit.flat.tolist(), fit.values.tolist())] == values.tolist()


@pytest.mark.parametrize("value", [2049, -2049, 7837, -(2**31), 2**32 + 5])
def test_escapes_beyond_float16_keep_the_float16_gemm_and_restore_what_the_float32_gemm_does(kvt, value, monkeypatch):
    _, fast = codecs(kvt, theta=1e-6)
    plan = fast._restorer._batched_plan({"theta": 1e-6, "key_weight": 1.0}, torch.device("cpu"))
    rows, t = plan.slot_of_row.size, 64
    g = torch.Generator().manual_seed(3)
    samples = torch.randint(0, 256, (2, rows, t), dtype=torch.uint8, generator=g)
    dtype = torch.int32 if -(2**31) <= value < 2**31 else torch.int64  # 2**32 + 5 is no int32 (a caller's int64)
    block = plan.slot_of_row // plan.n
    a, b = next((a, b) for a in range(rows) for b in range(a + 1, rows) if block[a] == block[b])
    # chunk 0: one huge escape and one float16 holds; chunk 1: two huge ones in one block and token
    escapes = [
        (torch.tensor([3, 5 * t + 1]), torch.tensor([value, -300], dtype=dtype)),
        (torch.tensor(sorted([a * t + 7, b * t + 7])), torch.tensor([value, value], dtype=dtype)),
    ]
    slots = tk.escape_slots(plan, escapes, t, rows)
    want = tk._float_gemm(plan, samples, slots, "centre", None)
    monkeypatch.setattr(tk, "_float_gemm", None)  # restore() must not fall back to it
    got = tk._restore(plan, samples, slots, (L, H, D), None, [0, t], "centre", None)
    y = want.view(-1, 2 * t).index_select(0, plan.rows).view(L, 2, H, D, 2 * t)
    assert torch.allclose(got, y, rtol=1e-6, atol=1e-6 * float(y.abs().max()))


def test_running_out_of_device_memory_in_the_float16_gemm_raises_and_keeps_it(kvt, monkeypatch):
    _, fast = codecs(kvt, theta=1e-6)
    plan = fast._restorer._batched_plan({"theta": 1e-6, "key_weight": 1.0}, torch.device("cpu"))
    samples = torch.zeros((1, plan.slot_of_row.size, 64), dtype=torch.uint8)

    def out_of_memory(*args):
        raise torch.cuda.OutOfMemoryError("CUDA out of memory")

    monkeypatch.setattr(tk, "_half_gemm", out_of_memory)
    with pytest.raises(torch.cuda.OutOfMemoryError):
        tk._restore(plan, samples, tk.NO_ESCAPES, (L, H, D), None, [0], "centre", None)
    assert tk.HALF_GEMM  # not mistaken for a torch without the float16 GEMM


def torch_before_out_dtype(monkeypatch) -> list:
    """torch.bmm as torch before 2.8 has it (no out_dtype: a torch that old is not here to run);
    returns the list of refused calls."""
    bmm, refused = torch.bmm, []

    def old_bmm(*args, **kwargs):
        if "out_dtype" in kwargs:
            refused.append(1)
            raise TypeError("bmm() got an unexpected keyword argument 'out_dtype'")
        return bmm(*args, **kwargs)

    monkeypatch.setattr(torch, "bmm", old_bmm)
    monkeypatch.setattr(tk, "OUT_DTYPE_BMM", True)
    return refused


def test_products_on_the_cpu_come_from_a_float32_gemm_and_never_turn_the_cuda_one_off(kvt, monkeypatch):
    """The CPU has no float16 GEMM into float32: the products of the exact operands, without asking
    for it (a refusal there would turn it off for the process's CUDA restores too)."""
    _, fast = codecs(kvt, theta=1e-6)
    plan = fast._restorer._batched_plan({"theta": 1e-6, "key_weight": 1.0}, torch.device("cpu"))
    g = torch.Generator().manual_seed(5)
    q = torch.randint(-2048, 2049, (plan.blocks * plan.n, 3 * 64), generator=g).half()
    want = torch.bmm(plan.half.double(), q.double().view(plan.blocks, plan.n, -1))
    refused = torch_before_out_dtype(monkeypatch)
    for _ in range(2):
        got = tk._half_gemm_of(plan, q)
        assert got.dtype == torch.float32
        assert torch.allclose(got.double(), want, rtol=1e-6, atol=1e-6 * float(want.abs().max()))
    assert len(refused) == 0 and tk.OUT_DTYPE_BMM and tk.HALF_GEMM


def test_once_refused_the_float16_gemm_is_not_asked_for_again(kvt, monkeypatch):
    """As a CUDA torch before 2.8 answers (its bmm has no out_dtype; the gate is opened for the CPU
    tensors here): one refusal, then the float32 GEMM's products of the same operands."""
    _, fast = codecs(kvt, theta=1e-6)
    plan = fast._restorer._batched_plan({"theta": 1e-6, "key_weight": 1.0}, torch.device("cpu"))
    q = torch.randint(-2048, 2049, (plan.blocks * plan.n, 64), generator=torch.Generator().manual_seed(6)).half()
    want = torch.bmm(plan.half.double(), q.double().view(plan.blocks, plan.n, -1))
    refused = torch_before_out_dtype(monkeypatch)
    monkeypatch.setattr(tk, "_float16_gemm_offered", lambda q: tk.OUT_DTYPE_BMM)
    for _ in range(2):
        got = tk._half_gemm_of(plan, q)
        assert torch.allclose(got.double(), want, rtol=1e-6, atol=1e-6 * float(want.abs().max()))
    assert len(refused) == 1 and not tk.OUT_DTYPE_BMM and tk.HALF_GEMM


@pytest.mark.parametrize("kw", [{}, dict(fine_tokens=100, fine_bits=1), dict(recon="laplace")])
def test_many_chunks_restored_at_once_equal_one_by_one(kvt, kw):
    ref, fast = codecs(kvt, theta=1e-6, **kw)  # escapes in several chunks, a short last chunk, sink tokens
    kv = synthetic_kv(300, 5)
    chunks = ref.encode_chunks(kv)
    one = restore_all(ref, chunks, kv.shape)
    out = torch.empty_like(kv)
    order = [3, 0, 4, 2, 1]  # any order, each into its own slice
    outs = [out[:, :, chunks[i].start_token : chunks[i].start_token + chunks[i].tokens] for i in order]
    restore_chunks(fast, [chunks[i].blobs[0] for i in order], outs)
    assert within_an_ulp(out, one)
    with pytest.raises(ValueError):
        restore_chunks(fast, [chunks[0].blobs[0]], [])


@pytest.mark.parametrize("spec", [RopeSpec(1e4, 16), RopeSpec(5e5, 16, 8, "interleaved"), RopeSpec(1e6, 16, 12)])
def test_rope_tables_equal_apply_rope(spec):
    tables = tk.RopeTables(spec, "cpu")
    x = torch.randn(3, 40, 2, 16)  # (layers, tokens, heads, dim)
    want = apply_rope(x, torch.arange(5000, 5040), spec)
    cos, sin = tables.window(5000, 40)  # (D, t)
    k = x.permute(0, 2, 3, 1)  # (layers, heads, D, t)
    got = (k * cos + k.index_select(2, tables.partner) * sin).permute(0, 3, 1, 2)
    assert torch.allclose(got, want, atol=1e-5)


@settings(max_examples=40, deadline=None)
@given(
    sizes=st.lists(st.integers(1, 4), min_size=1, max_size=4),
    layer_dim=st.integers(1, 6),
    data=st.data(),
)
def test_block_layout_places_every_output_row_once(sizes, layer_dim, data):
    counts = [data.draw(st.integers(0, s * layer_dim)) for s in sizes for _ in range(2)]
    offsets, rows, n, d = tk.block_layout(counts, sizes, layer_dim)
    assert rows.size == sum(sizes) * 2 * layer_dim and len(set(rows.tolist())) == rows.size
    widest, height = max(1, max(counts)), max(sizes) * layer_dim
    assert widest <= n < widest + tk.GEMM_ALIGN and n % tk.GEMM_ALIGN == 0  # aligned for the GEMM
    assert height <= d < height + tk.GEMM_ALIGN and d % tk.GEMM_ALIGN == 0
    assert list(offsets) == list(np.cumsum([0] + counts[:-1]))
    j, within = rows // d, rows % d
    assert within.max() < d and j.max() < 2 * len(sizes)
    # output element (layer, kind, e) comes from block (group, kind), row lpos * layer_dim + e
    layer_of = np.repeat(np.arange(sum(sizes)), 2 * layer_dim)
    kind_of = np.tile(np.repeat([0, 1], layer_dim), sum(sizes))
    group_of = np.repeat(np.arange(len(sizes)), sizes)[layer_of]
    assert np.array_equal(j, 2 * group_of + kind_of)


def _random_calibration(sizes: list[int], layer_dim: int, cols: list[int], magnitude: float, seed: int):
    """A Calibration of groups of `sizes` layers (1 head of layer_dim channels), block j keeping
    cols[j] columns of its basis (as a pack cut to the coded coordinates does)."""
    from kvcodec.transform.calibration import KINDS, Calibration, GroupBasis

    g = torch.Generator().manual_seed(seed)
    bases = {}
    for j, c in enumerate(cols):
        rows = sizes[j // 2] * layer_dim
        basis = (torch.randn((rows, min(c, rows)), generator=g) * magnitude).float()
        var = torch.sort(torch.rand(basis.shape[1], generator=g), descending=True).values
        bases[(j // 2, KINDS[j % 2])] = GroupBasis(torch.randn(rows, generator=g), basis, var)
    layers, groups, first = sum(sizes), [], 0
    for size in sizes:
        groups.append(tuple(range(first, first + size)))
        first += size
    return Calibration(layers, 1, layer_dim, None, tuple(groups), bases, {})


@pytest.mark.parametrize("slice_bytes", [8, tk.SCALE_SLICE_BYTES], ids=["a-block-a-slice", "default-slices"])
@settings(max_examples=30, deadline=None)
@given(
    sizes=st.lists(st.integers(1, 3), min_size=1, max_size=3),
    layer_dim=st.integers(1, 12),
    magnitude=st.floats(1e-4, 1e3),
    data=st.data(),
)
def test_plans_built_from_the_stacked_calibration_hold_the_decode_basis_exactly(
    slice_bytes, sizes, layer_dim, magnitude, data
):
    """build_plan scales the stacked calibration on its device, slice by slice: block by block the
    very float16 values and scales that transform.inverse.decode_bases rounds on the host, zero past
    them; the float32 GEMM's bases and means, made on first use, are the decode basis and
    mean - OFFSET * its row sums, as the host made them."""
    from kvcodec.transform.inverse import decode_bases
    from kvcodec.transform.quantize import OFFSET

    cols = [data.draw(st.integers(1, s * layer_dim)) for s in sizes for _ in range(2)]
    cal = _random_calibration(sizes, layer_dim, cols, magnitude, data.draw(st.integers(0, 99)))
    counts = [data.draw(st.integers(0, c)) for c in cols]
    steps = torch.rand(sum(counts), generator=torch.Generator().manual_seed(sum(counts))) * 3 + 1e-3
    devices = ["cpu", "cuda"] if torch.cuda.is_available() else ["cpu"]
    want = decode_bases(cal, counts, steps)
    default, tk.SCALE_SLICE_BYTES = tk.SCALE_SLICE_BYTES, slice_bytes
    try:
        plans = [tk.build_plan(cal, counts, steps, torch.arange(sum(counts)), device) for device in devices]
    finally:
        tk.SCALE_SLICE_BYTES = default
    for plan in plans:
        for j, block in enumerate(want):
            rows, n = block.half.shape
            assert torch.equal(plan.half[j, :rows, :n].cpu(), block.half)
            assert float(plan.scales[j]) == block.scale
            assert not plan.half[j, rows:].any() and not plan.half[j, :, n:].any()
            assert torch.equal(plan.centred_means[j, :rows, 0].cpu(), block.mean)
            assert torch.equal(plan.bases[j, :rows, :n].cpu(), block.basis)
            mean = (block.mean.double() - OFFSET * block.basis.double().sum(1)).float()
            assert torch.allclose(plan.means[j, :rows, 0].cpu(), mean, rtol=1e-6, atol=1e-6 * float(mean.abs().max()))
            assert not plan.bases[j, rows:].any() and not plan.means[j, rows:].any()


# ----------------------------------------------------------------------------------------- GPU


@needs_cuda
@pytest.mark.parametrize("coder", ["zstd", "hevc"])
@pytest.mark.parametrize("kw", [{}, PRECISION], ids=["plain", "precision"])
def test_gpu_restore_matches_the_cpu_restore(kvt, coder, kw):
    from kvcodec.video.nvcuvid import NvcuvidDecoder

    if coder == "hevc" and not NvcuvidDecoder.is_available():
        pytest.skip("needs NVDEC")
    ref, fast = codecs(kvt, target_ratio=4.0, coder=coder, resolutions=((144, 144),), **kw)
    kv = synthetic_kv(200, 11)
    chunks = ref.encode_chunks(kv)
    cpu = restore_all(ref, chunks, kv.shape)
    gpu = restore_all(TransformCodec(kvt[0], chunk_tokens=64, coder=coder), chunks, kv.shape, device="cuda")
    torch.cuda.synchronize()
    assert within_an_ulp(cpu, gpu.cpu())


@needs_cuda
def test_nvcuvid_threads_restore_transform_chunks_in_parallel(kvt):
    from kvcodec.video.nvcuvid import NvcuvidDecoder
    from kvcodec.video.nvcuvid_threads import NvcuvidThreads

    if not NvcuvidDecoder.is_available():
        pytest.skip("needs NVDEC")
    c = TransformCodec(kvt[0], chunk_tokens=64, target_ratio=4.0, resolutions=((144, 144),), coder="mixed")
    kv = synthetic_kv(256, 13)
    chunks = c.encode_chunks(kv)
    one = restore_all(c, chunks, kv.shape, device="cuda")
    out = torch.empty(kv.shape, dtype=kv.dtype, device="cuda")
    with NvcuvidThreads(3) as dec:
        outs = [out[:, :, ch.start_token : ch.start_token + ch.tokens] for ch in chunks]
        dec.restore_blobs([ch.blobs[0] for ch in chunks], outs, synchronize=True, decode_into=threads_decode_into(c))
    assert torch.equal(out, one)


@needs_cuda
@pytest.mark.parametrize("kw", [{}, PRECISION], ids=["plain", "precision"])
def test_restore_chunks_on_nvcuvid_threads_matches_the_cpu(kvt, kw):
    from kvcodec.video.nvcuvid import NvcuvidDecoder
    from kvcodec.video.nvcuvid_threads import NvcuvidThreads

    if not NvcuvidDecoder.is_available():
        pytest.skip("needs NVDEC")
    ref, _ = codecs(kvt, target_ratio=4.0, coder="hevc", resolutions=((144, 144),), **kw)
    kv = synthetic_kv(300, 17)
    chunks = ref.encode_chunks(kv)
    cpu = restore_all(ref, chunks, kv.shape)
    c = TransformCodec(kvt[0], chunk_tokens=64, resolutions=((144, 144),))
    out = torch.empty(kv.shape, dtype=kv.dtype, device="cuda")
    outs = [out[:, :, ch.start_token : ch.start_token + ch.tokens] for ch in chunks]
    with NvcuvidThreads(3) as dec:
        restore_chunks(c, [ch.blobs[0] for ch in chunks], outs, threads=dec)
        torch.cuda.synchronize()
    assert within_an_ulp(cpu, out.cpu())


def test_batched_plans_are_kept_for_a_few_levels_only(kvt):
    from kvcodec.codecs.transform.decode import MAX_PLANS

    _, fast = codecs(kvt)
    kv = synthetic_kv(64, 9)
    for theta in (1e-4, 2e-4, 4e-4, 8e-4, 1.6e-3, 3.2e-3):
        ref, _ = codecs(kvt, theta=theta)
        ref._restorer.batched = False
        chunk = ref.encode_chunks(kv)[0]
        want = restore_all(ref, [chunk], kv.shape)
        assert within_an_ulp(restore_all(fast, [chunk], kv.shape), want)
    assert len(fast._restorer._batched_plans) == MAX_PLANS


def test_batched_restore_of_a_weighted_transform_matches_the_reference(tmp_path):
    weights = torch.rand(L, 2, H, D, generator=torch.Generator().manual_seed(3)) + 0.25
    cal = calibrate([synthetic_kv(900, s) for s in (1, 2)], ROPE, max_group=2, weights=weights, info={})
    path = tmp_path / "weighted.kvt"
    ref, fast = codecs((path, save_kvt(cal, path)), target_ratio=4.0)
    kv = synthetic_kv(128, 21)
    chunks = ref.encode_chunks(kv)
    assert within_an_ulp(restore_all(fast, chunks, kv.shape), restore_all(ref, chunks, kv.shape))


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=needs_cuda)])
@pytest.mark.parametrize(
    "kw",
    [dict(target_ratio=4.0), dict(target_ratio=4.0, fine_tokens=100, fine_bits=1), dict(theta=1e-6)],
    ids=["ratio4", "finer-tail", "escapes"],
)
def test_half_gemm_restores_what_the_float32_gemm_does(kvt, kw, device, monkeypatch):
    """The float16 GEMM (tensor cores on CUDA; the same values in float32 on the CPU) against the
    float32 GEMM over the same decode basis, chunks with escapes and finer tail tokens included."""
    _, fast = codecs(kvt, **kw)
    kv = synthetic_kv(300, 9)
    chunks = fast.encode_chunks(kv)
    half = restore_all(fast, chunks, kv.shape, device=device)
    monkeypatch.setattr(tk, "HALF_GEMM", False)
    full = restore_all(fast, chunks, kv.shape, device=device)
    assert within_an_ulp(half, full)


def test_the_reference_and_batched_paths_share_the_rounded_decode_basis(kvt):
    """Both restore paths use half_basis's rounding (the decode basis), not the calibrated float32 basis."""
    ref, fast = codecs(kvt, target_ratio=4.0)
    kv = synthetic_kv(64, 2)
    h = ref.header(ref.encode_chunks(kv)[0].blobs[0])
    plan = fast._restorer._batched_plan(h, torch.device("cpu"))
    rounded = ref._restorer._decode_bases(h, torch.device("cpu"))
    for j, (_, basis) in enumerate(rounded):
        rows, n = basis.shape
        assert torch.equal(plan.bases[j, :rows, :n], basis)
        assert torch.equal((plan.half[j, :rows, :n].double() * plan.scales[j]).float(), basis)


@needs_cuda
def test_a_cuda_fetch_restores_float16_chunks_straight_into_bfloat16_rounded_once(kvt):
    """The driven fetch's fused kernels write a bfloat16 target directly: the float32 restore of the
    same chunks rounded once (a float16 staging copy would round twice)."""
    from kvcodec.fetcher import PrefixCache
    from kvcodec.store import open_store

    c = TransformCodec(kvt[0], chunk_tokens=64, target_ratio=4.0, coder="zstd")
    kv = synthetic_kv(200, 17)
    ids = list(range(5000, 5200))
    store = open_store("memory://")
    PrefixCache(store, "synthetic", c, "cpu").put(ids, kv)
    cache = PrefixCache(store, "synthetic", c, "cuda")
    wide = torch.empty(kv.shape, dtype=torch.float32, device="cuda")
    into = torch.empty(kv.shape, dtype=torch.bfloat16, device="cuda")
    assert cache.fetch(ids, out=wide).tokens_restored == 200
    res = cache.fetch(ids, out=into)
    torch.cuda.synchronize()
    assert res.tokens_restored == 200 and res.kv is into and res.stats.chunks_staged == 0
    assert torch.equal(into, wide.to(torch.bfloat16))


@needs_cuda
def test_the_fused_kernels_clamp_an_overshoot_of_float16s_largest_instead_of_writing_inf(tmp_path, monkeypatch):
    """As transform_kernels.clamp_to_range_ on the reference path: the fused epilogue clamps to float16's
    range. KV scaled up to float16's largest."""
    from kvcodec.restore import transform_triton
    from kvcodec.transform import rate

    monkeypatch.setattr(rate, "on_grid", lambda theta: theta)  # the searched level: one whose restore overshoots
    scale = 65504.0 / max(float(synthetic_kv(900, s).abs().max()) for s in (1, 2))
    cal = calibrate([(synthetic_kv(900, s).float() * scale).half() for s in (1, 2)], ROPE, max_group=2)
    save_kvt(cal, tmp_path / "scaled.kvt")
    c = TransformCodec(tmp_path / "scaled.kvt", chunk_tokens=64, target_ratio=4.0, coder="zstd")
    kv = synthetic_kv(64, 18)
    blob = c.encode_chunks((kv.float() * (65504.0 / kv.abs().max())).half())[0].blobs[0]
    launched = []
    launch = transform_triton.launch
    monkeypatch.setattr(transform_triton, "launch", lambda *a: launched.append(launch(*a)) or launched[-1])
    wide = torch.empty(kv.shape, dtype=torch.float32, device="cuda")
    c.finish([c.stage(blob, wide)], [wide])
    out = torch.empty(kv.shape, dtype=torch.float16, device="cuda")
    c.finish([c.stage(blob, out)], [out])
    torch.cuda.synchronize()
    assert launched == [True, True]  # both restores ran the fused kernels
    assert wide.abs().max() > 65520  # an overshoot that a cast would turn to inf
    assert torch.isfinite(out).all() and torch.equal(out, tk.clamp_to_range_(wide.clone(), torch.float16).half())


@needs_cuda
@pytest.mark.parametrize(
    "theta, half", [(1e-2, True), (1e-6, True), (1e-6, False)], ids=["escapes", "beyond-float16", "float32-gemm"]
)
def test_many_chunks_with_escapes_restored_at_once_on_the_gpu_equal_the_cpu(kvt, theta, half, monkeypatch):
    monkeypatch.setattr(tk, "HALF_GEMM", half)
    ref, _ = codecs(kvt, theta=theta)
    kv = synthetic_kv(256, 19)
    chunks = ref.encode_chunks(kv)
    assert sum(ref.header(ch.blobs[0])["escapes"] > 0 for ch in chunks) >= 2
    cpu = restore_all(ref, chunks, kv.shape)
    out = torch.empty(kv.shape, dtype=kv.dtype, device="cuda")
    outs = [out[:, :, ch.start_token : ch.start_token + ch.tokens] for ch in chunks]
    restore_chunks(TransformCodec(kvt[0], chunk_tokens=64, coder="zstd"), [ch.blobs[0] for ch in chunks], outs)
    torch.cuda.synchronize()
    assert within_an_ulp(cpu, out.cpu())


def fused_launches(kvt, seed: int, monkeypatch, passes: int) -> list:
    """The fused launches (each True where the kernels ran) of `passes` batched CUDA restores of chunks
    with escapes, each asserted within an ulp of the CPU restore."""
    from kvcodec.restore import transform_triton

    ref, _ = codecs(kvt, theta=1e-6)
    kv = synthetic_kv(256, seed)
    chunks = ref.encode_chunks(kv)
    cpu = restore_all(ref, chunks, kv.shape)
    launched, launch = [], transform_triton.launch
    monkeypatch.setattr(transform_triton, "launch", lambda *a: launched.append(launch(*a)) or launched[-1])
    for _ in range(passes):
        out = torch.empty(kv.shape, dtype=kv.dtype, device="cuda")
        outs = [out[:, :, ch.start_token : ch.start_token + ch.tokens] for ch in chunks]
        restore_chunks(TransformCodec(kvt[0], chunk_tokens=64, coder="zstd"), [ch.blobs[0] for ch in chunks], outs)
        torch.cuda.synchronize()
        assert within_an_ulp(cpu, out.cpu())
    return launched


@needs_cuda
def test_a_cuda_torch_without_out_dtype_keeps_the_fused_restore_and_its_kv(kvt, monkeypatch):
    """torch before 2.8: the fused kernels restore every batch, from a float32 GEMM's products, with
    the same KV; the float16 GEMM is asked for once."""
    refused = torch_before_out_dtype(monkeypatch)
    launched = fused_launches(kvt, 21, monkeypatch, passes=2)
    assert len(refused) == 1 and len(launched) >= 2 and all(launched)


@needs_cuda
def test_the_fused_restore_serves_while_torch_accumulates_float16_gemms_in_float16(kvt, monkeypatch):
    """torch.backends.cuda.matmul.allow_fp16_accumulation (torch >= 2.7) refuses bmm(out_dtype=float32):
    the products come from a float32 GEMM for as long as it is set, and the float16 GEMM is kept."""
    matmul = torch.backends.cuda.matmul
    if not hasattr(matmul, "allow_fp16_accumulation"):
        pytest.skip("this torch has no float16-accumulation setting")
    monkeypatch.setattr(matmul, "allow_fp16_accumulation", True)
    monkeypatch.setattr(tk, "HALF_GEMM", True)  # a failure that turns it off stays in this test
    monkeypatch.setattr(tk, "OUT_DTYPE_BMM", True)
    launched = fused_launches(kvt, 22, monkeypatch, passes=1)
    assert launched and all(launched) and tk.OUT_DTYPE_BMM and tk.HALF_GEMM


@needs_cuda
def test_a_plan_evicted_while_a_stream_still_reads_it_keeps_its_memory(kvt, monkeypatch):
    """A plan dropped for another level's (MAX_PLANS) while a fetch's kernels on another stream are
    still queued behind other work: its memory must not go to the next allocation on the
    plan-building stream before those kernels have read it (BatchedPlan.used_on)."""
    from kvcodec.codecs.transform import decode as transform_decode

    _, fast = codecs(kvt, target_ratio=4.0)
    kv = synthetic_kv(64, 23)
    blob = fast.encode_chunks(kv)[0].blobs[0]
    r = fast._restorer
    want = torch.empty(kv.shape, dtype=torch.float16, device="cuda")
    fast.finish([fast.stage(blob, want)], [want])
    torch.cuda.synchronize()
    (key,) = [k for k in r._batched_plans if k[0] == fast.header(blob)["theta"]]
    shape = r._batched_plans[key].half.shape
    r._batched_plans.clear()
    side, out = torch.cuda.Stream(), torch.empty_like(want)
    with torch.cuda.stream(side):
        torch.cuda._sleep(1 << 30)  # the fetch's kernels wait behind ~0.5 s of other work
        fast.finish([fast.stage(blob, out)], [out])
    monkeypatch.setattr(transform_decode, "MAX_PLANS", 1)
    r._batched_plan({"theta": key[0] * 2, "key_weight": key[1]}, torch.device("cuda"))  # evicts the plan
    if side.query():  # the host took longer than the delay: the readers are done, there is no race to lose
        pytest.skip("the side stream finished before the eviction (a loaded host): the race was not set up")
    with torch.cuda.stream(tk._BUILD_STREAMS[tk.indexed("cuda")]):
        # the next allocations there, enough to take every free block of the plan's size
        junk = [torch.full(shape, float("nan"), dtype=torch.float16, device="cuda") for _ in range(8)]
    torch.cuda.synchronize()
    assert all(j.isnan().all() for j in junk)
    assert torch.equal(out, want)


@pytest.mark.parametrize("kw", [dict(target_ratio=2.0), dict(target_ratio=8.0), dict(theta=1e-9), dict(theta=1e3)])
def test_every_chunks_samples_fit_the_codecs_pinned_staging_block(kvt, kw):
    """pinned_block_bytes bounds sample_count at any level and chunk length (a short last chunk,
    a level that codes every coordinate, one that codes nearly none): one size class serves all."""
    codec = TransformCodec(kvt[0], chunk_tokens=64, coder="zstd", **kw)
    kv = synthetic_kv(150, 4)
    for ch in codec.encode_chunks(kv):
        h, _ = codec._read(ch.blobs[0])
        assert codec._restorer.sample_count(h) <= codec.pinned_block_bytes()  # 0 where nothing is coded
    at_finest = codec._restorer.sample_count({"theta": 1e-12, "key_weight": 1.0, "tokens": 64})
    assert at_finest == codec.pinned_block_bytes()
    assert TransformCodec(kvt[0], chunk_tokens=64, coder="hevc", target_ratio=4.0).pinned_block_bytes() == 0
