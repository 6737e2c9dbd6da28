"""The encode fast path: chunks in parallel give the same bytes as one at a time, x265's bitstream
does not depend on its thread count, and per-model decisions made by trial encodes are kept on
disk so that a later process makes none."""

from __future__ import annotations

import functools

import pytest
import torch

from kvcodec import CodecConfig
from kvcodec.codecs.hevc import encode as hevc_encode
from kvcodec.errors import ConfigError
from kvcodec.layout import search
from kvcodec.layout.tiling import frame_blocks, pack_frame
from kvcodec.video.x265_cpu import X265Encoder

RES = ((144, 144),)


def kv_like(layers=2, tokens=72, heads=2, dim=32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(layers, 2, tokens, heads, dim, generator=g) * torch.linspace(0.05, 4.0, dim)).half()


class CountingX265(X265Encoder):
    """Real x265 that counts its encodes (trial encodes included)."""

    calls = 0

    def encode(self, frames, width, height):
        CountingX265.calls += 1
        return super().encode(frames, width, height)

    def with_threads(self, threads):
        return CountingX265(self.preset, threads, self.extra_params, self.tuning)


def staged_on_the_cpu(monkeypatch) -> None:
    """Chunks prepared on the calling thread (as for KV on a GPU) for KV on the CPU too."""
    from kvcodec.codecs.transform import codec as transform

    for module in (hevc_encode, transform):
        monkeypatch.setattr(module, "stage_on_caller", lambda kv, workers: workers > 1)


def test_parallel_chunks_give_the_bytes_of_one_at_a_time_in_order(monkeypatch, fresh_plans):
    kv = kv_like()
    config = CodecConfig(sample_coder="hevc", chunk_tokens=16, resolutions=RES, plain_fallback=False)
    runs = {}
    for workers in ("1", "3", "3 staged"):
        if workers == "3 staged":
            staged_on_the_cpu(monkeypatch)
        monkeypatch.setenv("KVCODEC_ENCODE_WORKERS", workers.split()[0])
        seen: list[int] = []
        chunks = hevc_encode.encode_chunks(kv, config, on_chunk=seen.append)
        seen = [c.index for c in seen]
        assert seen == [c.index for c in chunks] == list(range(5))
        runs[workers] = [c.blobs for c in chunks]
    assert runs["1"] == runs["3"] == runs["3 staged"]


def test_staged_chunks_are_prepared_on_the_calling_thread_in_order():
    import threading

    caller, prepared, ran = threading.get_ident(), [], []

    def prepare(i):
        prepared.append((i, threading.get_ident()))
        return i * 10

    def fn(i, p):
        ran.append(threading.get_ident())
        return (i, p)

    assert list(hevc_encode.in_order(fn, 7, 3, prepare)) == [(i, i * 10) for i in range(7)]
    assert prepared == [(i, caller) for i in range(7)] and caller not in ran
    assert hevc_encode.stage_on_caller(kv_like(), 4) is False  # KV on the CPU: prepared by the chunk threads


@pytest.mark.parametrize("value", ["many", "-1", "0", "1.5"])
def test_bad_worker_count_is_a_config_error(monkeypatch, value):
    monkeypatch.setenv("KVCODEC_ENCODE_WORKERS", value)  # "-1" and "0" once meant one worker, without a word
    with pytest.raises(ConfigError, match="KVCODEC_ENCODE_WORKERS must be an integer >= 1"):
        hevc_encode.encode_workers()


def test_x265_bitstream_does_not_depend_on_threads():
    kv = kv_like(tokens=32)
    config = CodecConfig(sample_coder="hevc", chunk_tokens=32, resolutions=RES, search_layout=False, video_bits=4)
    plan = hevc_encode.plan_coding(kv, config)
    symbols = hevc_encode._symbols(kv, config)
    samples, _ = hevc_encode._split_low_bits(symbols, plan.video_bits)
    frames = [pack_frame(b, plan.layouts[0]).numpy() for _, _, b in frame_blocks(samples, plan.layouts[0])]
    one, four = (X265Encoder(threads=t).encode(frames, 144, 144) for t in (1, 4))
    assert one == four


def test_trial_decisions_are_made_once_and_kept_on_disk(fresh_plans):
    kv = kv_like(tokens=48)
    config = CodecConfig(sample_coder="hevc", chunk_tokens=16, resolutions=RES)  # video_bits "auto", layout searched
    CountingX265.calls = 0
    first = hevc_encode.plan_coding(kv, config, CountingX265())
    trials = CountingX265.calls
    assert trials > 1 and fresh_plans.is_file()
    search._disk, search._cache, search._bits_cache = None, {}, {}  # a new process
    CountingX265.calls = 0
    again = hevc_encode.plan_coding(kv_like(tokens=48, seed=5), config, CountingX265())
    assert again == first and CountingX265.calls == 0
    # other encoder settings are other decisions
    hevc_encode.plan_coding(kv, config, CountingX265(tuning=""))
    assert CountingX265.calls > 0


def test_unreadable_plan_cache_is_ignored(fresh_plans):
    fresh_plans.parent.mkdir(parents=True, exist_ok=True)
    fresh_plans.write_text("{not json")
    plan = hevc_encode.plan_coding(
        kv_like(tokens=16), CodecConfig(sample_coder="hevc", chunk_tokens=16, resolutions=RES)
    )
    assert 1 <= plan.video_bits <= 8


def _transform_codec(tmp_path, **kw):
    from kvcodec.codecs.transform.codec import TransformCodec
    from kvcodec.transform import RopeSpec, calibrate, save_kvt

    g = torch.Generator().manual_seed(3)
    mix = torch.randn(8, 2 * 2 * 2 * 16, generator=g)
    kvs = [(torch.randn(300, 8, generator=g) @ mix).view(300, 2, 2, 2, 16).permute(1, 2, 0, 3, 4) for _ in range(2)]
    cal = calibrate([k.contiguous().half() for k in kvs], RopeSpec(10000.0, 16), info={"model": "synthetic"})
    save_kvt(cal, tmp_path / "s.kvt")
    return TransformCodec(tmp_path / "s.kvt", **{"chunk_tokens": 32, "resolutions": ((64, 64),), **kw}), kvs[0].half()


@pytest.mark.parametrize("coder", ["hevc", "zstd", "mixed"])
def test_transform_chunks_in_parallel_give_the_bytes_of_one_at_a_time(monkeypatch, tmp_path, coder):
    codec, kv = _transform_codec(tmp_path, coder=coder)
    runs = {}
    for workers in ("1", "3", "3 staged"):
        if workers == "3 staged":
            staged_on_the_cpu(monkeypatch)
        monkeypatch.setenv("KVCODEC_ENCODE_WORKERS", workers.split()[0])
        seen: list[int] = []
        chunks = codec.encode_chunks(kv[:, :, :200], keys=[f"k{i}" for i in range(7)], on_chunk=seen.append)
        assert [c.index for c in seen] == [c.index for c in chunks] == list(range(7))
        runs[workers] = [c.blobs for c in chunks]
    assert runs["1"] == runs["3"] == runs["3 staged"]


def test_transform_chunks_prepared_together_are_those_prepared_one_by_one(tmp_path):
    """Whole chunks without sink or fine tokens are prepared in one pass: the same escapes (an
    outlier makes some), counts and frames as each chunk alone."""
    codec, kv = _transform_codec(tmp_path, coder="hevc", resolutions=((64, 64), (32, 32)))
    kv = kv[:, :, :160].clone()
    kv[0, 1, 70, 0, :] = 3000.0  # far outside the calibration: integers beyond a sample's range
    theta = codec._level(None, kv, 0)
    y = codec.coefficients(kv, 0, codec.plan(theta).counts)
    together = codec._prepare_batch(y[32:128], theta, 32, 3)
    escapes = 0
    for k, batched in enumerate(together):
        s = 32 * (k + 1)
        for (streams, counts, frames), alone in zip(
            batched, codec._prepare(y[s : s + 32], kv[:, :, s : s + 32], theta, s, 0)
        ):
            assert (streams, counts) == alone[:2]
            assert [f.tolist() for f in frames] == [f.tolist() for f in alone[2]]
            escapes += counts["escapes"]
    assert escapes > 0


def test_transform_plan_cache_is_safe_on_threads(tmp_path):
    from concurrent.futures import ThreadPoolExecutor

    from kvcodec.codecs.transform import codec as transform

    codec, _ = _transform_codec(tmp_path)
    thetas = [10.0 ** (-k / 20) for k in range(3 * transform.MAX_PLANS)]
    with ThreadPoolExecutor(8) as pool:
        plans = list(pool.map(codec.plan, thetas * 2))
    assert all(p.counts == transform.coord_plan(codec.cal, t, 1.0).counts for p, t in zip(plans, thetas * 2))
    assert len(codec._plans) <= transform.MAX_PLANS


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_transform_encode_of_cuda_kv_decodes_like_the_host_encode(tmp_path):
    """KV in CUDA memory is transformed and quantized there: the chunks decode as close as the
    host encode's (the GPU's float sums may move a coefficient across a rounding boundary)."""
    codec, kv = _transform_codec(tmp_path)
    kv = kv[:, :, :200].contiguous()
    errors = []
    for device in ("cpu", "cuda"):
        chunks = codec.encode_chunks(kv.to(device))
        out = torch.empty_like(kv)
        for c in chunks:
            codec.decode_chunk(c.blobs[0], out[:, :, c.start_token : c.start_token + c.tokens])
        errors.append(float((out.float() - kv.float()).pow(2).mean() / kv.float().pow(2).mean()))
    assert errors[1] <= errors[0] * 1.05 + 1e-6


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_all_finite_finds_a_nan_or_infinity_anywhere(dtype):
    kv = torch.randn(3, 2, 33, 2, 8).to(dtype)
    assert hevc_encode.all_finite(kv)
    for bad in (float("nan"), float("inf"), float("-inf")):
        for index in (0, kv.numel() // 2, kv.numel() - 1):
            damaged = kv.clone()
            damaged.view(-1)[index] = bad
            assert not hevc_encode.all_finite(damaged)
            assert not hevc_encode.all_finite(damaged.transpose(2, 3))  # a strided view


def _same_prepared(a, b) -> None:
    assert a.symbols.side == b.symbols.side and a.symbols.side_payloads == b.symbols.side_payloads
    assert a.symbols.param_dtype == b.symbols.param_dtype
    assert torch.equal(a.symbols.unit_bits, b.symbols.unit_bits) and torch.equal(a.samples, b.samples)
    assert a.low_planes == b.low_planes
    assert [[f.tolist() for f in fs] for fs in a.frames] == [[f.tolist() for f in fs] for fs in b.frames]


@pytest.mark.parametrize(
    "quant, layer_bits, video_bits, dtype",
    [("int8", (), 4, torch.float16), ("int4", (), 8, torch.bfloat16), ("int8", (8, 5, 3), 3, torch.float32)],
)
def test_chunks_prepared_together_are_those_prepared_one_by_one(quant, layer_bits, video_bits, dtype):
    """The staged encode prepares a batch of chunks in one pass: the same side streams, low planes
    and frames as each chunk alone, whatever the bits, split and dtype (frames padded at the end)."""
    from kvcodec.layout.tiling import candidate_plans

    kv = kv_like(layers=3, tokens=60, heads=2, dim=16).to(dtype)
    config = CodecConfig(sample_coder="hevc", chunk_tokens=20, quant=quant, layer_bits=layer_bits, resolutions=RES)
    plans = candidate_plans(144, 144, 12, 16, 20)
    layouts = (plans[0], next(p for p in plans if p.tokens_per_frame < 20))  # the second: 2 frames, one padded
    plan = hevc_encode.CodingPlan(layouts, video_bits)
    together = hevc_encode._prepare_batch(kv, 3, config=config, plan=plan)
    for k, batched in enumerate(together):
        _same_prepared(batched, hevc_encode._prepare_chunk(kv[:, :, 20 * k : 20 * k + 20], config=config, plan=plan))


def test_a_batch_with_values_beyond_fp16_range_is_prepared_chunk_by_chunk():
    """Parameters are fp32 for a chunk whose values leave fp16's range and fp16 for the others: a
    batch cannot decide that for all, so the chunks are prepared alone (the same bytes)."""
    kv = kv_like(layers=2, tokens=48, heads=2, dim=16).float()
    kv[0, 0, 30, 0, 0] = 1e6
    config = CodecConfig(sample_coder="hevc", chunk_tokens=16, resolutions=RES)
    plan = hevc_encode.plan_coding(kv, config)
    assert hevc_encode._prepare_batch(kv, 3, config=config, plan=plan) is None
    prepare = hevc_encode.batched(
        functools.partial(hevc_encode._prepare_from, kv, [0, 16, 32], batch=3, config=config, plan=plan)
    )
    params = [prepare(n).symbols.param_dtype for n in range(3)]
    assert params == ["float16", "float32", "float16"]


def test_a_staged_batch_is_one_chunk_per_thread_within_its_byte_limit(monkeypatch):
    kv = kv_like(layers=2, tokens=64, heads=2, dim=32)  # 16-token chunks of 8 KiB
    assert hevc_encode.stage_batch(kv, 16, workers=3) == 3
    monkeypatch.setattr(hevc_encode, "STAGE_BATCH_BYTES", 17 << 10)
    assert hevc_encode.stage_batch(kv, 16, workers=3) == 2
    monkeypatch.setattr(hevc_encode, "STAGE_BATCH_BYTES", 1)
    assert hevc_encode.stage_batch(kv, 16, workers=3) == 1


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_hevc_encode_of_cuda_kv_gives_the_bytes_of_the_host_encode(monkeypatch, fresh_plans):
    """KV in CUDA memory is quantized, split and packed there, chunks in batches on the calling
    thread: the same chunk blobs as the host's encode, chunk by chunk on one thread."""
    kv = kv_like(layers=3, tokens=100, heads=2, dim=32)
    config = CodecConfig(sample_coder="hevc", chunk_tokens=16, resolutions=RES, plain_fallback=False)
    monkeypatch.setenv("KVCODEC_ENCODE_WORKERS", "1")
    host = [c.blobs for c in hevc_encode.encode_chunks(kv, config)]
    monkeypatch.setenv("KVCODEC_ENCODE_WORKERS", "3")
    assert [c.blobs for c in hevc_encode.encode_chunks(kv.cuda(), config)] == host


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("coder", ["hevc", "mixed"])
def test_transform_encode_of_cuda_kv_in_batches_gives_the_bytes_of_one_at_a_time(monkeypatch, tmp_path, coder):
    codec, kv = _transform_codec(tmp_path, coder=coder)
    runs = []
    for workers in ("1", "3"):  # one thread: chunk by chunk; three: staged on the caller in batches
        monkeypatch.setenv("KVCODEC_ENCODE_WORKERS", workers)
        runs.append([c.blobs for c in codec.encode_chunks(kv[:, :, :200].cuda())])
    assert runs[0] == runs[1]
