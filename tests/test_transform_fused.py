"""The fused inverse transform (restore.transform_triton): its channel-pair table with hypothesis,
its semantics emulated on the CPU against the reference kernels, and on a GPU (skipped without
CUDA and Triton) the kernel itself against the reference kernels it replaces.
"""

from __future__ import annotations

import contextlib

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import test_transform_gpu as gpu_tests  # the synthetic transform and KV of the batched-restore tests
from kvcodec.restore import transform_kernels as tk
from kvcodec.restore import transform_triton as tt
from kvcodec.transform import RopeSpec, calibrate, save_kvt

kvt = gpu_tests.kvt  # the module-scoped fixture
L, H, D = gpu_tests.L, gpu_tests.H, gpu_tests.D
needs_triton = pytest.mark.skipif(
    not torch.cuda.is_available() or tt.triton_modules() is None, reason="needs a CUDA GPU and Triton"
)

SPECS = [None, RopeSpec(1e4, 16), RopeSpec(5e5, 16, 8, "interleaved"), RopeSpec(1e6, 16, 12), RopeSpec(1e4, 16, 6)]


def _partners(spec):
    return None if spec is None else tk._rotating_partners(spec)


@settings(max_examples=60, deadline=None)
@given(
    sizes=st.lists(st.integers(1, 3), min_size=1, max_size=3),
    heads=st.integers(1, 3),
    spec=st.sampled_from(SPECS),
    data=st.data(),
)
def test_unit_table_names_each_head_s_rows_and_pairs_each_channel_with_its_partner(sizes, heads, spec, data):
    layer_dim = heads * 16
    counts = [data.draw(st.integers(0, s * layer_dim)) for s in sizes for _ in range(2)]
    _, rows, _, d = tk.block_layout(counts, sizes, layer_dim)
    units, pairs = tt.unit_table(rows, (sum(sizes), heads, 16), _partners(spec))
    assert units.shape == (sum(sizes) * 2 * heads,) and pairs.shape == (3, 8)
    # channel c of head unit u is GEMM row units[u] + c, in the block of the unit's layer group and kind
    assert np.array_equal((units[:, None] + np.arange(16)).ravel(), rows)
    lo, hi, turn = pairs
    assert sorted(np.concatenate([lo, hi]).tolist()) == list(range(16)) and np.all(lo < hi)
    want, _, sign = tk.rope_partner(spec) if spec is not None else (np.arange(16), None, np.zeros(16))
    assert np.array_equal(turn.astype(bool), sign[lo] != 0) and np.array_equal(sign[lo] != 0, sign[hi] != 0)
    assert np.array_equal(want[lo[turn == 1]], hi[turn == 1])  # a rotating channel's pair is its RoPE partner
    assert tt.halves(pairs, 16) == (spec is None or (spec.style == "half" and spec.rotary == 16))


@settings(max_examples=60, deadline=None)
@given(partner_style=st.sampled_from(["none", "half", "interleaved"]), D=st.integers(1, 20), data=st.data())
def test_channel_pairs_cover_every_channel_once(partner_style, D, data):
    r = 0 if partner_style == "none" else 2 * data.draw(st.integers(0, D // 2))
    ch = np.arange(D)
    partner = ch.copy()
    if partner_style == "half":
        partner[:r] = np.where(ch[:r] < r // 2, ch[:r] + r // 2, ch[:r] - r // 2)
    elif partner_style == "interleaved":
        partner[:r] = ch[:r] ^ 1
    lo, hi, turn = tt.channel_pairs(partner, ch < r)
    assert lo.size == (D + 1) // 2
    valid = hi < D
    assert sorted(np.concatenate([lo, hi[valid]]).tolist()) == list(range(D)) and (~valid).sum() == D % 2
    assert np.array_equal(partner[lo[turn == 1]], hi[turn == 1]) and np.all(turn == (lo < r))
    assert not tt.halves(np.stack([lo, hi, turn]), D) or D % 2 == 0


def test_unit_table_refuses_heads_whose_rows_are_not_consecutive():
    _, rows, _, _ = tk.block_layout([16, 16], [1], 16)
    with pytest.raises(ValueError):
        tt.unit_table(rows[::-1].copy(), (1, 1, 16), None)


def emulate(plan, x, cos, sin, starts, outs, token_scales=None) -> None:
    """What the kernel computes from the GEMM's products x (J, d, N t), head by head, in torch on
    the CPU (the kernel's contract)."""
    NT = x.shape[2]
    t = outs[0].shape[2]
    x = x * plan.scales
    if token_scales is not None:
        x = x * token_scales.reshape(1, 1, NT)
    x = (x + plan.centred_means).reshape(-1, NT)  # flat GEMM rows
    L, _, _, H, D = outs[0].shape
    lo, hi, pair_turns = plan.pairs.long()
    paired = hi < D  # each channel's partner and whether it rotates, read from its pair
    partner, turn = torch.arange(D), torch.zeros(D, dtype=torch.long)
    partner[lo[paired]], partner[hi[paired]] = hi[paired], lo[paired]
    turn[lo], turn[hi[paired]] = pair_turns, pair_turns[paired]
    cols = torch.arange(NT)
    pos = torch.tensor(starts)[cols // t] + cols % t
    for u, row0 in enumerate(plan.units.tolist()):
        own = x[row0 : row0 + D]
        if (u // H) % 2 == 0:  # keys rotate their rotary channels
            on = turn.bool()[:, None]
            y = own * torch.where(on, cos[:, pos], 1.0) + own[partner] * torch.where(on, sin[:, pos], 0.0)
        else:
            y = own
        layer, kind, head = u // (2 * H), (u // H) % 2, u % H
        for i, out in enumerate(outs):
            out[layer, kind, :, head] = y[:, i * t : (i + 1) * t].T.to(out.dtype)


def decoded(codec, chunks):
    r = codec._restorer
    got = []
    for ch in chunks:
        h, streams = codec._read(ch.blobs[0])
        got.append(r.decode_samples(h, streams, torch.device("cpu")))
    return r, got


@pytest.mark.parametrize("kw", [dict(target_ratio=4.0), dict(target_ratio=4.0, fine_tokens=100, fine_bits=1)])
def test_the_kernels_contract_restores_what_the_reference_kernels_do(kvt, kw):
    """The pair table read as the kernel reads it (emulate) against restore() + emit()."""
    from kvcodec.transform import quantize

    _, fast = gpu_tests.codecs(kvt, **kw)
    chunks = fast.encode_chunks(gpu_tests.synthetic_kv(192, 4))
    r, dec = decoded(fast, chunks)
    h0 = dec[0].h
    plan, rope = r._batched_plan(h0, torch.device("cpu")), r._rope_tables.get(torch.device("cpu"))
    t = h0["tokens"]
    samples = torch.stack([c.samples for c in dec])
    escapes, starts = [c.escapes for c in dec], [c.h["start_token"] for c in dec]
    scales = None
    if kw.get("fine_tokens"):
        scales = torch.stack([quantize.token_scales(t, c.h["fine_tokens"], c.h["fine_bits"]) for c in dec])
    want = [torch.empty((L, 2, t, H, D), dtype=torch.float16) for _ in dec]
    y = tk.restore(plan, samples, escapes, (L, H, D), rope, starts, token_scales=scales)
    for i, out in enumerate(want):
        tk.emit(y, i, t, out)
    got = [torch.full_like(w, float("nan")) for w in want]
    cos, sin = rope.covering(max(starts) + t)
    slots = tk.escape_slots(plan, escapes, t, samples.shape[1])
    emulate(plan, tk._half_products(plan, samples, slots), cos, sin, starts, got, scales)
    for a, b in zip(want, got):
        assert gpu_tests.within_an_ulp(a, b)


# ------------------------------------------------------------ the kernels' source, interpreted on the CPU


@pytest.fixture
def interpreted(triton_interpreter, monkeypatch):
    """The Triton kernels' own source run by Triton's interpreter on CPU tensors (not the GPU
    compiler's output: its vector loads and stores are the GPU tests'), so that CI checks them."""
    kernel, gather = tt._kernel.__wrapped__(), tt._gather_kernel.__wrapped__()
    monkeypatch.setattr(tt, "_kernel", lambda: kernel)
    monkeypatch.setattr(tt, "_gather_kernel", lambda: gather)
    monkeypatch.setattr(torch.cuda, "device", lambda _: contextlib.nullcontext())  # the launches' device scope
    monkeypatch.setattr(tt, "FUSED", True)  # a failing kernel turns it off: for this test only


@pytest.fixture(scope="module")
def kvt_of(kvt, tmp_path_factory):
    """The .kvt of a RoPE spec (the module's for gpu_tests.ROPE), calibrated once per spec."""
    paths = {gpu_tests.ROPE: kvt[0]}

    def of(spec):
        if spec not in paths:
            kv = [gpu_tests.synthetic_kv(600, s) for s in (1, 2)]
            paths[spec] = tmp_path_factory.mktemp("kvt") / "s.kvt"
            save_kvt(calibrate(kv, spec, max_group=2, info={"model": "synthetic"}), paths[spec])
        return paths[spec], None

    return of


class EpilogueCase:
    """Three 64-token chunks (sink tokens in the first, finer-tail scales) of a RoPE spec, decoded on
    the CPU, what the reference kernels restore of them (want) and an epilogue's launch record
    into NaN-filled outputs (got), for its GEMM products x."""

    def __init__(self, kvt_path):  # noqa: ANN001
        from kvcodec.transform import quantize

        _, fast = gpu_tests.codecs(kvt_path, target_ratio=4.0, fine_tokens=100, fine_bits=1)
        r, dec = decoded(fast, fast.encode_chunks(gpu_tests.synthetic_kv(192, 4)))
        h0, cpu = dec[0].h, torch.device("cpu")
        self.plan, rope, self.t = r._batched_plan(h0, cpu), r._rope_tables.get(cpu), h0["tokens"]
        self.samples = torch.stack([c.samples for c in dec])
        self.escapes, self.starts = [c.escapes for c in dec], [c.h["start_token"] for c in dec]
        t = self.t
        self.scales = torch.stack([quantize.token_scales(t, c.h["fine_tokens"], c.h["fine_bits"]) for c in dec])
        self.sinks = [c.sink for c in dec]
        assert self.sinks[0] is not None and any(s is None for s in self.sinks) and self.scales.ne(1).any()
        self.want = torch.empty((len(dec), L, 2, t, H, D), dtype=torch.float16)
        y = tk.restore(self.plan, self.samples, self.escapes, (L, H, D), rope, self.starts, token_scales=self.scales)
        for i, out in enumerate(self.want):
            tk.emit(y, i, t, out)
            if self.sinks[i] is not None:
                out[:, :, : self.sinks[i].shape[2]] = self.sinks[i]
        self.got = torch.full_like(self.want, float("nan"))
        self.cos, self.sin = rope.covering(max(self.starts) + t) if rope is not None else (torch.zeros((1, 1)),) * 2

    def launch(self, x: torch.Tensor) -> tt.Launch:
        outs = list(self.got)
        return tt.Launch(
            x=x, cos=self.cos, sin=self.sin, token_scales=self.scales.float(),
            meta=tt.meta_table(self.starts, outs, list(self.samples), self.sinks), tokens=self.t,
            out_strides=tuple(outs[0].stride()), heads=H, out_dtype=torch.float16, sinks=True,
            regular=tt.regular(self.t, outs),
        )  # fmt: skip

    def restored(self) -> bool:
        return not self.got.isnan().any() and gpu_tests.within_an_ulp(self.got, self.want)


@pytest.mark.parametrize(
    "spec", [gpu_tests.ROPE, None, SPECS[2], SPECS[4]], ids=["half", "none", "interleaved-partial", "partial-6"]
)
@pytest.mark.parametrize("block_n", [32, 128], ids=["regular", "general"])  # tiles within a 64-token chunk, or across
def test_the_epilogue_s_source_restores_what_the_reference_kernels_do(kvt_of, interpreted, spec, block_n, monkeypatch):
    monkeypatch.setattr(tt, "BLOCK_N", block_n)
    case = EpilogueCase(kvt_of(spec))
    slots = tk.escape_slots(case.plan, case.escapes, case.t, case.samples.shape[1])
    run = case.launch(tk._half_products(case.plan, case.samples, slots).contiguous())
    assert run.regular == (case.t % block_n == 0)
    tt._launch(case.plan, run)
    assert case.restored()
    assert torch.equal(case.got[0, :, :, : case.sinks[0].shape[2]], case.sinks[0])


@pytest.mark.parametrize("cols", [32, 128], ids=["tiles-in-a-chunk", "tile-past-the-chunk"])
@pytest.mark.parametrize("aligned", [True, False], ids=["aligned", "general"])
def test_the_gather_s_source_centres_each_block_s_coordinates(kvt, interpreted, aligned, cols, monkeypatch):
    monkeypatch.setattr(tt, "GATHER_COLS", cols)
    _, fast = gpu_tests.codecs(kvt, target_ratio=4.0)
    r, dec = decoded(fast, fast.encode_chunks(gpu_tests.synthetic_kv(192, 4)))
    plan = r._batched_plan(dec[0].h, torch.device("cpu"))
    chunks = [c.samples.contiguous() for c in dec]
    table = torch.tensor([c.data_ptr() for c in chunks], dtype=torch.int64)
    assert tt.gather_aligned(chunks) == (chunks[0].shape[1] % 16 == 0)  # torch allocates 16-byte aligned
    got = tt.gather_centred(table, plan.gather, chunks[0].shape[1], len(chunks), aligned)
    want = tk._centred(plan, torch.stack(chunks), tk.NO_ESCAPES, torch.float32).reshape(got.shape)
    assert tt.FUSED and torch.equal(got.float(), want)


# ----------------------------------------------------------------------------------------- GPU


def _counted(fn, name: str, ran: list):
    def counted(*args, **kwargs):
        ran.append(name)
        return fn(*args, **kwargs)

    return counted


@needs_triton
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize(
    "kw",
    [dict(target_ratio=4.0), dict(target_ratio=4.0, fine_tokens=100, fine_bits=1), dict(theta=1e-2)],
    ids=["ratio4", "finer-tail", "escapes"],
)
def test_fused_kernel_restores_what_the_reference_kernels_do(kvt, kw, dtype, monkeypatch):
    _, fast = gpu_tests.codecs(kvt, **kw)
    kv = gpu_tests.synthetic_kv(300, 9).to(dtype)
    chunks = fast.encode_chunks(kv)
    if "theta" in kw:
        assert sum(fast.header(c.blobs[0])["escapes"] for c in chunks) > 0
    ran = []
    for name in ("launch", "gather_centred"):
        monkeypatch.setattr(tt, name, _counted(getattr(tt, name), name, ran))
    fused = gpu_tests.restore_all(fast, chunks, kv.shape, dtype=dtype, device="cuda")
    assert tt.FUSED, "the fused kernel failed and was turned off"
    assert ran.count("launch") == len(chunks) and ran.count("gather_centred") == len(chunks)
    monkeypatch.setattr(tt, "FUSED", False)
    reference = gpu_tests.restore_all(fast, chunks, kv.shape, dtype=dtype, device="cuda")
    torch.cuda.synchronize()
    assert torch.isfinite(fused.float()).all()
    ulp = max(torch.finfo(dtype).eps, 2.0**-16)  # float32 sums in another order, then one rounding
    assert torch.allclose(fused.cpu().float(), reference.cpu().float(), rtol=ulp, atol=ulp / 4)


@needs_triton
@pytest.mark.parametrize("spec", SPECS[1:], ids=["half", "interleaved-partial", "partial", "partial-6"])
def test_fused_kernel_rotates_every_rope_style(tmp_path, spec, monkeypatch):
    cal = calibrate([gpu_tests.synthetic_kv(600, s) for s in (1, 2)], spec, max_group=2, info={"model": "synthetic"})
    path = tmp_path / "s.kvt"
    save_kvt(cal, path)
    _, fast = gpu_tests.codecs((path, None), target_ratio=4.0)
    kv = gpu_tests.synthetic_kv(200, 5, first=70_000)  # positions past the tables' first size
    chunks = fast.encode_chunks(kv)
    fused = gpu_tests.restore_all(fast, chunks, kv.shape, device="cuda")
    monkeypatch.setattr(tt, "FUSED", False)
    reference = gpu_tests.restore_all(fast, chunks, kv.shape, device="cuda")
    torch.cuda.synchronize()
    assert gpu_tests.within_an_ulp(fused.cpu(), reference.cpu())


@needs_triton
def test_many_chunks_in_one_fused_call_land_in_their_own_outputs(kvt, monkeypatch):
    from kvcodec.codecs.transform.batch import restore_chunks

    _, fast = gpu_tests.codecs(kvt, target_ratio=4.0)
    kv = gpu_tests.synthetic_kv(320, 6)
    chunks = fast.encode_chunks(kv)
    order = [3, 0, 4, 2, 1]
    out = torch.full(kv.shape, float("nan"), dtype=torch.float16, device="cuda")
    outs = [out[:, :, chunks[i].start_token : chunks[i].start_token + chunks[i].tokens] for i in order]
    restore_chunks(fast, [chunks[i].blobs[0] for i in order], outs)
    monkeypatch.setattr(tt, "FUSED", False)
    reference = gpu_tests.restore_all(fast, chunks, kv.shape, device="cuda")
    torch.cuda.synchronize()
    assert gpu_tests.within_an_ulp(out.cpu(), reference.cpu())


def _compiled(fn) -> int:
    """Kernels Triton has compiled (or loaded from its disk cache) for `fn` in this process."""
    return sum(len(entry[0]) for entry in fn.device_caches.values())


@needs_triton
def test_warm_up_compiles_every_kernel_the_first_fetch_needs(kvt):
    from kvcodec.codecs.base import WarmUp

    _, fast = gpu_tests.codecs(kvt, target_ratio=4.0, fine_tokens=40, fine_bits=1)  # plain and finer-tail chunks
    kv = gpu_tests.synthetic_kv(200, 3)
    chunks = fast.encode_chunks(kv)
    kernels = (tt._kernel(), tt._gather_kernel())
    if not all(hasattr(k, "device_caches") for k in kernels):
        pytest.skip("this Triton keeps no per-device kernel caches to count")
    for k in kernels:
        k.device_caches.clear()  # compiled again (from Triton's disk cache): the count starts at zero
    assert isinstance(fast, WarmUp)
    fast.warm_up("cuda", torch.float16)
    warmed = [_compiled(k) for k in kernels]
    assert warmed[0] >= 2 and warmed[1] >= 1  # the epilogue with and without token scales, the gather
    gpu_tests.restore_all(fast, chunks, kv.shape, device="cuda")
    torch.cuda.synchronize()
    assert tt.FUSED
    assert [_compiled(k) for k in kernels] == warmed  # the restore compiled nothing more


def test_warm_up_is_a_no_op_off_cuda_and_for_codecs_without_kernels(kvt):
    from kvcodec.codecs.base import WarmUp
    from kvcodec.codecs.raw import RawCodec
    from kvcodec.fetcher import PrefixCache
    from kvcodec.store import open_store

    _, fast = gpu_tests.codecs(kvt, target_ratio=4.0)
    fast.warm_up("cpu")  # nothing to compile: returns without touching a GPU
    assert not isinstance(RawCodec(), WarmUp)
    assert PrefixCache(open_store("memory://"), "synthetic", fast, "cpu").warm_up() == 0.0


@needs_triton
@pytest.mark.parametrize("kw", [dict(target_ratio=4.0), dict(theta=1e-2)], ids=["ratio4", "escapes"])
def test_fused_batch_reads_each_chunk_where_it_lies_and_keeps_the_sink_exact(kvt, kw, monkeypatch):
    """One finish() of separately decoded chunks (no stacked copy: the kernels read each chunk's
    samples at its own address), chunk 0's sink tokens written by the epilogue, not a copy."""
    _, fast = gpu_tests.codecs(kvt, **kw)
    kv = gpu_tests.synthetic_kv(300, 9)
    chunks = fast.encode_chunks(kv)
    r, cuda = fast._restorer, torch.device("cuda")

    def finish_all() -> torch.Tensor:
        dec = [r.decode_samples(*fast._read(ch.blobs[0]), cuda) for ch in chunks]
        out = torch.full(kv.shape, float("nan"), dtype=torch.float16, device=cuda)
        r.finish(dec, [out[:, :, ch.start_token : ch.start_token + ch.tokens] for ch in chunks])
        return out

    ran = []
    monkeypatch.setattr(tt, "gather_centred", _counted(tt.gather_centred, "gather_centred", ran))
    fused = finish_all()
    assert tt.FUSED and len(ran) == 2  # the 64-token chunks in one batch, the 44-token tail in another
    monkeypatch.setattr(tt, "FUSED", False)
    reference = finish_all()
    torch.cuda.synchronize()
    sink = fast.header(chunks[0].blobs[0])["sink"]
    assert sink > 0 and torch.equal(fused[:, :, :sink].cpu(), kv[:, :, :sink])
    assert torch.isfinite(fused.float()).all() and gpu_tests.within_an_ulp(fused.cpu(), reference.cpu())


def test_regular_launches_need_whole_tiles_aligned_outputs_and_dense_heads():
    prefix = torch.empty((2, 2, 4 * tt.BLOCK_N, 2, 16))
    whole = [prefix[:, :, i * tt.BLOCK_N : (i + 1) * tt.BLOCK_N] for i in range(4)]
    assert tt.regular(tt.BLOCK_N, whole)
    assert not tt.regular(tt.BLOCK_N // 2, [prefix[:, :, : tt.BLOCK_N // 2]])  # tiles would span chunks
    shifted = torch.empty((2, 2, tt.BLOCK_N + 1, 2, 16))[:, :, 1:]  # 2 * 16 * 4 bytes in: aligned
    assert tt.regular(tt.BLOCK_N, [shifted])
    odd = torch.empty(2 * 2 * tt.BLOCK_N * 2 * 16 + 1)[1:].view(2, 2, tt.BLOCK_N, 2, 16)  # 4 bytes in
    assert not tt.regular(tt.BLOCK_N, [odd])
    assert not tt.regular(tt.BLOCK_N, [torch.empty((2, 2, tt.BLOCK_N, 2, 12))])  # strides not multiples of 16
    assert not tt.regular(tt.BLOCK_N, [torch.empty((2, 2, tt.BLOCK_N, 16, 2)).transpose(3, 4)])  # channels strided


def test_aligned_gathers_need_chunks_and_rows_at_multiples_of_16_bytes():
    flat = torch.zeros(4 * 48 * 32 + 16, dtype=torch.uint8)
    chunks = [flat[i * 48 * 32 : (i + 1) * 48 * 32].view(48, 32) for i in range(4)]
    assert tt.gather_aligned(chunks)
    assert not tt.gather_aligned([flat[1 : 1 + 48 * 32].view(48, 32)])  # one byte in
    assert not tt.gather_aligned([flat[: 48 * 24].view(48, 24)])  # rows 24 bytes apart
    assert tt.gather_aligned([flat[16 : 16 + 48 * 32].view(48, 32)])


def test_meta_table_lists_each_chunk_s_position_output_samples_and_sink():
    outs = [torch.empty((2, 2, 4, 1, 8)) for _ in range(3)]
    samples = [torch.zeros((5, 4), dtype=torch.uint8) for _ in range(3)]
    sink = torch.zeros((2, 2, 3, 1, 8), dtype=torch.float16)
    table = tt.meta_table([0, 4, 8], outs, samples, [sink, None, None]).tolist()
    assert table[:3] == [0, 4, 8]
    assert table[3:6] == [o.data_ptr() for o in outs] and table[6:9] == [s.data_ptr() for s in samples]
    assert table[9:12] == [sink.data_ptr(), 0, 0] and table[12:] == [3, 0, 0]


@pytest.mark.parametrize(
    ("casts", "dtype", "warmed"),
    [
        ((), torch.bfloat16, [torch.bfloat16, torch.float16]),
        ((), torch.float16, [torch.float16, torch.bfloat16]),
        (tt.OUT_DTYPES, torch.bfloat16, [torch.bfloat16]),
        (tt.OUT_DTYPES, torch.float16, [torch.float16, torch.bfloat16]),
    ],
    ids=["staging-bf16-engine", "staging-fp16-engine", "casting-bf16-engine", "casting-fp16-engine"],
)
def test_warm_up_also_compiles_for_the_dtypes_chunks_stage_in(casts, dtype, warmed):
    """A chunk a codec cannot restore into the engine's dtype (an HEVC one stored in float16 for a
    bfloat16 engine; a bfloat16 one for a float16 engine, whose range float16 does not hold)
    restores into staging of its stored dtype: the warm-up compiles that too, so no kernel
    compiles during a timed fetch (0.4-0.7 s each on an H200)."""
    from kvcodec.codecs.base import warm_up_codec

    class Recording:
        target_dtypes = casts

        def __init__(self):
            self.dtypes = []

        def warm_up(self, device, dtype):
            self.dtypes.append(dtype)

    codec = Recording()
    warm_up_codec(codec, "cuda", dtype)  # a device name: nothing runs on it
    assert codec.dtypes == warmed
