"""TransformCodec and calibration on synthetic correlated KV (fast), plus the calibrate command."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st
from safetensors.torch import save_file

from kvcodec.codecs.base import ChunkCodec
from kvcodec.codecs.registry import make_codec
from kvcodec.codecs.transform.codec import TransformCodec
from kvcodec.errors import ConfigError, FormatError, KVCodecError, ShapeError
from kvcodec.restore.paged import PagedKV
from kvcodec.restore.transform_kernels import clamp_to_range_
from kvcodec.transform import calibrate, load_kvt, save_kvt
from kvcodec.transform.kvt import kvt_hash
from synthetic import ROPE, D, H, L, rel_mse, synthetic_kv


def codec(synthetic_kvt, **kw):
    kw.setdefault("chunk_tokens", 64)
    kw.setdefault("resolutions", ((64, 64),))
    return TransformCodec(synthetic_kvt, **kw)


def roundtrip(c, kv, first_chunk_index=0):
    chunks = c.encode_chunks(kv, first_chunk_index=first_chunk_index)
    out = torch.empty_like(kv)
    for ch in chunks:
        s = ch.start_token - first_chunk_index * c.chunk_tokens
        c.decode_chunk(ch.blobs[0], out[:, :, s : s + ch.tokens])
    return out, chunks


@pytest.mark.parametrize("coder", ["zstd", "hevc"])
def test_roundtrip_is_close_and_finer_steps_are_closer(synthetic_kvt, coder):
    kv = synthetic_kv(150, seed=7)
    coarse, _ = roundtrip(codec(synthetic_kvt, coder=coder, bits_per_value=0.5), kv)
    fine, chunks = roundtrip(codec(synthetic_kvt, coder=coder, bits_per_value=3.0), kv)
    assert rel_mse(fine, kv) < 1e-3
    assert rel_mse(fine, kv) < rel_mse(coarse, kv) / 4
    assert [c.tokens for c in chunks] == [64, 64, 22]
    assert torch.equal(fine[:, :, :4], kv[:, :, :4])  # sink tokens travel as fp16


def test_hevc_and_zstd_code_the_same_integers(synthetic_kvt):
    kv = synthetic_kv(100, seed=8)
    a, chunks = roundtrip(codec(synthetic_kvt, coder="hevc", bits_per_value=2.0), kv)
    theta = codec(synthetic_kvt).header(chunks[0].blobs[0])["theta"]
    b, _ = roundtrip(codec(synthetic_kvt, coder="zstd", theta=theta), kv)
    assert torch.equal(a, b)


def test_rope_positions_follow_the_chunk_index(synthetic_kvt):
    first = 3 * 64
    kv = synthetic_kv(64, seed=9, first=first)
    # un-RoPE at the wrong positions leaves keys the basis does not decorrelate: at a low rate
    # most of their energy is dropped
    good, _ = roundtrip(codec(synthetic_kvt, bits_per_value=0.5, coder="zstd"), kv, first_chunk_index=3)
    wrong, _ = roundtrip(codec(synthetic_kvt, bits_per_value=0.5, coder="zstd"), kv, first_chunk_index=0)
    assert 5 * rel_mse(good, kv) < rel_mse(wrong, kv)


def test_paged_target_gets_the_same_values(synthetic_kvt):
    c = codec(synthetic_kvt, coder="zstd", bits_per_value=2.0)
    kv = synthetic_kv(128, seed=10)
    dense, chunks = roundtrip(c, kv)
    pages = torch.zeros(L, 2, 20, 16, H, D, dtype=torch.float16)
    table = torch.randperm(20)[:8]
    paged = PagedKV(pages, table)
    for ch in chunks:
        c.decode_chunk(ch.blobs[0], paged)
    assert torch.equal(paged.gather(0, 128), dense)


def test_target_ratio_is_met_within_ten_percent(synthetic_kvt):
    kv = synthetic_kv(512, seed=11)
    for r in (4.0, 8.0):
        chunks = codec(synthetic_kvt, target_ratio=r, coder="zstd").encode_chunks(kv)
        size = sum(len(ch.blobs[0]) for ch in chunks)
        assert abs(kv.numel() * 2 / r / size - 1) < 0.10, (r, kv.numel() * 2 / size)


def test_wrong_transform_is_refused(synthetic_kvt, tmp_path):
    other = calibrate([synthetic_kv(600, s) for s in (3, 4)], ROPE)
    save_kvt(other, tmp_path / "other.kvt")
    blob = codec(synthetic_kvt, coder="zstd").encode_chunks(synthetic_kv(64, seed=12))[0].blobs[0]
    with pytest.raises(ConfigError, match="coded with transform"):
        TransformCodec(tmp_path / "other.kvt").decode_chunk(blob, torch.empty(L, 2, 64, H, D, dtype=torch.float16))
    with pytest.raises(ConfigError):
        TransformCodec(tmp_path / "missing.kvt")


def test_damage_and_bad_input_are_clear_errors(synthetic_kvt):
    c = codec(synthetic_kvt, coder="zstd")
    blob = bytearray(c.encode_chunks(synthetic_kv(64, seed=13))[0].blobs[0])
    blob[-5] ^= 0xFF
    with pytest.raises(KVCodecError):
        c.decode_chunk(bytes(blob), torch.empty(L, 2, 64, H, D, dtype=torch.float16))
    with pytest.raises(ShapeError):
        c.decode_chunk(c.encode_chunks(synthetic_kv(64, seed=13))[0].blobs[0], torch.empty(L, 2, 63, H, D))
    bad = synthetic_kv(64, seed=14)
    bad[0, 0, 3, 0, 0] = float("nan")
    with pytest.raises(ShapeError):
        c.encode_chunks(bad)
    with pytest.raises(ShapeError):
        c.encode_chunks(torch.zeros(L + 1, 2, 8, H, D))


def test_inspect_and_registry(synthetic_kvt):
    c = make_codec("transform", transform=str(synthetic_kvt), coder="zstd", chunk_tokens=64, resolutions=((144, 144),))
    assert isinstance(c, ChunkCodec) and kvt_hash(synthetic_kvt.read_bytes())[:16] in c.id
    chunks = c.encode_chunks(synthetic_kv(100, seed=15), first_chunk_index=2, keys=["a", "b"])
    info = c.inspect_chunk(chunks[1].blobs[0])
    assert (info.index, info.start_token, info.tokens, info.key) == (3, 192, 36, "b")


@pytest.mark.parametrize("sizes", [((64, 64),), ((0, 0),), ((100_000, 100_000),), ((520, 512),), "512x512,512x512"])
def test_the_registered_codec_takes_only_frame_sizes_nvdec_decodes(synthetic_kvt, sizes):
    """make_codec("transform") (the CLI's, serve's and ingest's) refuses, by name, frames NVDEC
    cannot decode; the class itself takes x265's smallest (CPU-only frames for small tests)."""
    with pytest.raises(ConfigError, match="resolutions"):
        make_codec("transform", transform=str(synthetic_kvt), resolutions=sizes)
    if sizes == ((64, 64),):
        assert TransformCodec(synthetic_kvt, resolutions=sizes).resolutions == sizes


@pytest.mark.parametrize("coder", ["zstd", "hevc", "ans"])
def test_inspect_reads_the_header_and_decode_checks_the_streams(synthetic_kvt, coder):
    """inspect_chunk (a fetch's binding check before the decode) parses the header alone; the
    decode's read is the one pass over the streams that catches a damaged byte."""
    from kvcodec.codecs.transform_ans.codec import TransformAnsCodec
    from kvcodec.errors import ChecksumError

    c = (
        TransformAnsCodec(synthetic_kvt, chunk_tokens=64, block=4096)
        if coder == "ans"
        else codec(synthetic_kvt, coder=coder)
    )
    kv = synthetic_kv(64, seed=16)
    blob = bytearray(c.encode_chunks(kv)[0].blobs[0])
    blob[-5] ^= 0x40  # in the last stream
    assert c.inspect_chunk(bytes(blob)).tokens == 64
    with pytest.raises(ChecksumError):
        c.decode_chunk(bytes(blob), torch.empty_like(kv))


def test_kvt_file_round_trip_and_damage(synthetic_kvt, tmp_path):
    cal, digest = load_kvt(synthetic_kvt)
    assert digest == kvt_hash(synthetic_kvt.read_bytes()) and cal.groups and cal.rope == ROPE
    data = bytearray(synthetic_kvt.read_bytes())
    (tmp_path / "cut.kvt").write_bytes(bytes(data[: len(data) // 2]))
    with pytest.raises(FormatError):
        load_kvt(tmp_path / "cut.kvt")


def test_calibration_refuses_small_or_nan_data():
    with pytest.raises(ConfigError, match="too few"):
        calibrate([synthetic_kv(40, 1)], ROPE)
    bad = synthetic_kv(600, 1)
    bad[1, 1, 100, 0, 0] = float("nan")
    with pytest.raises(ConfigError, match="NaN"):
        calibrate([bad], ROPE)


def test_group_size_adapts_to_calibration_size():
    small = calibrate([synthetic_kv(200, 1)], ROPE)
    large = calibrate([synthetic_kv(1200, 1)], ROPE)
    assert max(map(len, small.groups)) < max(map(len, large.groups))


def test_calibrate_command(tmp_path):
    from click.testing import CliRunner

    from kvcodec.cli.calibrate import command

    for s in (1, 2):
        save_file({"kv": synthetic_kv(400, s)}, str(tmp_path / f"k{s}.safetensors"), metadata={"model": "synthetic"})
    args = [str(tmp_path / "k1.safetensors"), str(tmp_path / "k2.safetensors"), "--out", str(tmp_path / "m.kvt")]
    res = CliRunner().invoke(command, [*args, "--rope-theta", "10000"])
    assert res.exit_code == 0, res.output
    cal, _ = load_kvt(tmp_path / "m.kvt")
    assert cal.rope == ROPE and cal.info["tokens"] == 2 * (400 - 4)
    res = CliRunner().invoke(command, args)  # no rope settings anywhere: the model is not registered
    assert res.exit_code != 0


def test_encode_decode_commands_with_transform(synthetic_kvt, tmp_path):
    from click.testing import CliRunner
    from safetensors.torch import load_file

    from kvcodec.cli.codec_cmds import decode_cmd, encode_cmd

    kv = synthetic_kv(256, seed=16)
    save_file({"kv": kv}, str(tmp_path / "in.safetensors"))
    enc = [
        str(tmp_path / "in.safetensors"),
        str(tmp_path / "t.kvc"),
        "--transform",
        str(synthetic_kvt),
        "--target-ratio",
        "5",
        "--sample-coder",
        "zstd",
        "--chunk-tokens",
        "64",
    ]
    res = CliRunner().invoke(encode_cmd, enc)
    assert res.exit_code == 0, res.output
    size = (tmp_path / "t.kvc").stat().st_size
    assert abs(kv.numel() * 2 / 5 / size - 1) < 0.10 and "warning" not in res.output
    far = CliRunner().invoke(encode_cmd, [enc[0], str(tmp_path / "far.kvc"), *enc[2:5], "1e9", *enc[6:]])
    assert far.exit_code == 0 and "warning" in far.output and "misses the 1e+09x asked" in far.output, far.output
    res = CliRunner().invoke(
        decode_cmd, [str(tmp_path / "t.kvc"), str(tmp_path / "out.safetensors"), "--transform", str(synthetic_kvt)]
    )
    assert res.exit_code == 0, res.output
    assert rel_mse(load_file(str(tmp_path / "out.safetensors"))["kv"], kv) < 0.05
    other = calibrate([synthetic_kv(600, s) for s in (5, 6)], ROPE)
    save_kvt(other, tmp_path / "other.kvt")
    res = CliRunner().invoke(
        decode_cmd,
        [str(tmp_path / "t.kvc"), str(tmp_path / "o2.safetensors"), "--transform", str(tmp_path / "other.kvt")],
    )
    assert res.exit_code != 0 and isinstance(res.exception, ConfigError)
    res = CliRunner().invoke(decode_cmd, [str(tmp_path / "t.kvc"), str(tmp_path / "o3.safetensors")])
    assert res.exit_code != 0 and isinstance(res.exception, FormatError)


def test_presets_are_target_ratios(synthetic_kvt):
    assert codec(synthetic_kvt, preset="compact").target_ratio == 8.0
    with pytest.raises(ConfigError, match="one of"):
        codec(synthetic_kvt, preset="nonsense")
    with pytest.raises(ConfigError, match="'compact' is a target ratio") as refused:  # said 'compact' was no preset
        codec(synthetic_kvt, preset="compact", target_ratio=3)
    assert "one of" not in str(refused.value)


def test_key_weight_moves_error_from_keys_to_values(synthetic_kvt):
    kv = synthetic_kv(128, seed=17)
    errs = {}
    for kw in (0.25, 1.0, 4.0):
        out, _ = roundtrip(codec(synthetic_kvt, coder="zstd", theta=0.05, key_weight=kw), kv)
        errs[kw] = [rel_mse(out[:, i], kv[:, i]) for i in (0, 1)]
    assert errs[4.0][0] < errs[1.0][0] < errs[0.25][0]  # finer key steps, smaller key error
    assert errs[4.0][1] == pytest.approx(errs[1.0][1], rel=0.05)  # values coded the same way


def test_calibrate_refuses_a_damaged_kv_file_with_a_clear_error(tmp_path):
    from click.testing import CliRunner

    from kvcodec.cli.main import cli

    junk = tmp_path / "junk.safetensors"
    junk.write_bytes(bytes(range(256)) * 4)
    res = CliRunner().invoke(cli, ["calibrate", str(junk), "--out", str(tmp_path / "m.kvt")])
    assert res.exit_code == 1 and "not a readable safetensors KV file" in res.output
    assert isinstance(res.exception, SystemExit)  # a clean exit, not a traceback


def test_weighted_transform_round_trips_through_the_kvt_and_moves_error(tmp_path):
    kvs = [synthetic_kv(600, s) for s in (1, 2)]
    w = torch.ones(L, 2, H, D)
    w[0] = 50.0  # layer 0 (K and V) matters 50x more
    plain = calibrate(kvs, ROPE)
    weighted = calibrate(kvs, ROPE, weights=w)
    save_kvt(plain, tmp_path / "p.kvt")
    save_kvt(weighted, tmp_path / "w.kvt")
    loaded, _ = load_kvt(tmp_path / "w.kvt")
    assert torch.equal(loaded.basis(0, "k").weights, weighted.basis(0, "k").weights)
    assert load_kvt(tmp_path / "p.kvt")[0].basis(0, "k").weights is None
    kv = synthetic_kv(128, seed=9)
    errs = {}
    for name in ("p", "w"):
        c = TransformCodec(tmp_path / f"{name}.kvt", chunk_tokens=64, resolutions=((64, 64),), coder="zstd", theta=0.05)
        out, _ = roundtrip(c, kv)
        assert rel_mse(out, kv) < 0.05
        errs[name] = (rel_mse(out[0], kv[0]), rel_mse(out[1:], kv[1:]))
    assert errs["w"][0] < errs["p"][0]  # the heavily weighted layer is restored more precisely
    with pytest.raises(ConfigError, match="weights"):
        calibrate(kvs, ROPE, weights=torch.zeros(L, 2, H, D))


def tiny_llama_and_ids():
    """A 2-layer Llama of random weights (seed 0, vocabulary 64) and 48 random token ids drawn
    after it: what the Fisher tests differentiate."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        hidden_size=32,
        intermediate_size=64,
        vocab_size=64,
    )
    return LlamaForCausalLM(cfg).eval(), torch.randint(0, 64, (48,))


def test_fisher_predicts_the_kl_divergence_of_kv_noise():
    """Second order, isotropic KV noise of variance s^2 costs KL = 0.5 s^2 trace(F): the diagonal
    Fisher (its token mean times the tokens it covers) must predict the measured KL."""
    from kvcodec.integrations.hf import cache_kwarg, cache_to_tensor, forward_ids, tensor_to_cache
    from kvcodec.integrations.hf_fisher import fisher_diagonal

    model, ids = tiny_llama_and_ids()
    prefix, sink = 32, 2
    f = fisher_diagonal(model, [ids], prefix, samples=64, sink_tokens=sink)
    assert f.shape == (2, 2, 2, 8) and bool((f >= 0).all()) and float(f.sum()) > 0
    kv = cache_to_tensor(forward_ids(model, ids[:prefix])[1])
    cont = ids[prefix:].unsqueeze(0)

    def logp(x):
        with torch.no_grad():
            out = model(cont, use_cache=True, **{cache_kwarg(model): tensor_to_cache(x, model)})
        return torch.log_softmax(out.logits[0].double(), -1)

    ref, s, kls = logp(kv), 1e-2, []
    for _ in range(16):
        noisy = kv.clone()
        noisy[:, :, sink:] += s * torch.randn_like(noisy[:, :, sink:])
        kls.append(float((ref.exp() * (ref - logp(noisy))).sum()))
    predicted = 0.5 * s**2 * float(f.double().sum()) * (prefix - sink)
    assert sum(kls) / len(kls) == pytest.approx(predicted, rel=0.35)


def test_plans_kept_per_codec_are_bounded(synthetic_kvt):
    """Every chunk names its own distortion level; a stream of chunks with ever new levels (forged or
    not) must not grow the codec's plan cache without bound."""
    from kvcodec.codecs.transform.codec import MAX_PLANS

    c = codec(synthetic_kvt)
    for i in range(MAX_PLANS + 40):
        c.plan(1e-3 * (1 + i))
    assert len(c._plans) == MAX_PLANS
    assert c.plan(1e-3 * (MAX_PLANS + 40)) is c.plan(1e-3 * (MAX_PLANS + 40))  # the latest kept, reused


def test_the_restorer_remembers_more_levels_than_its_device_plans_and_forgets_the_oldest(synthetic_kvt):
    """A fetch's host work begins as a blob arrives only for a level whose coordinate plan the restorer knows
    (known_sample_count): a fetch of more levels than MAX_PLANS (a grouped model's per-chunk levels) must not
    forget them all, and a stream of ever new levels must not grow the memo without bound."""
    from kvcodec.codecs.transform.decode import MAX_COORD_PLANS, MAX_PLANS

    r = codec(synthetic_kvt)._restorer
    heads = [{"theta": 1e-3 * (1 + i), "key_weight": 1.0, "tokens": 8} for i in range(MAX_COORD_PLANS + 3)]
    for h in heads[: MAX_PLANS + 2]:
        r._plan_of(h)
    assert all(r.known_sample_count(h) is not None for h in heads[: MAX_PLANS + 2])
    for h in heads:
        r._plan_of(h)
    assert len(r._coord_plans) == MAX_COORD_PLANS
    assert r.known_sample_count(heads[0]) is None and r.known_sample_count(heads[-1]) is not None


def test_finer_tail_tokens_are_closer_at_the_same_size(synthetic_kvt):
    kv = synthetic_kv(200, seed=31)  # chunks of 64: the last 24 tokens span the last two chunks
    base, _ = roundtrip(codec(synthetic_kvt, coder="zstd", target_ratio=4.0), kv)
    c = codec(synthetic_kvt, coder="zstd", target_ratio=4.0, fine_tokens=24, fine_bits=2)
    fine, chunks = roundtrip(c, kv)
    assert [c.header(ch.blobs[0])["fine_tokens"] for ch in chunks] == [0, 0, 16, 8]
    assert rel_mse(fine[:, :, -24:], kv[:, :, -24:]) < rel_mse(base[:, :, -24:], kv[:, :, -24:]) / 2
    size = sum(len(ch.blobs[0]) for ch in chunks)
    assert abs(kv.numel() * 2 / 4.0 / size - 1) < 0.10
    assert "f24x2" in c.id and "f0x0" in codec(synthetic_kvt, fine_tokens=0).id  # stores never mix the two


def test_chunks_with_and_without_the_new_fields_decode_with_any_codec(synthetic_kvt):
    kv = synthetic_kv(100, seed=32)
    plain = codec(synthetic_kvt, coder="zstd", bits_per_value=2.0)
    special = codec(synthetic_kvt, coder="zstd", bits_per_value=2.0, fine_tokens=50, fine_bits=1, recon="laplace")
    for coded_by in (plain, special):
        chunks = coded_by.encode_chunks(kv)
        want, _ = roundtrip(coded_by, kv)
        for decoder in (plain, special):  # the chunk says how it was coded
            got = torch.empty_like(kv)
            for ch in chunks:
                decoder.decode_chunk(ch.blobs[0], got[:, :, ch.start_token : ch.start_token + ch.tokens])
            assert torch.equal(got, want)
    assert rel_mse(roundtrip(special, kv)[0], kv) < rel_mse(roundtrip(plain, kv)[0], kv)


def test_version_1_chunks_still_decode_at_the_bin_centres(synthetic_kvt):
    from kvcodec.codecs.transform.codec import CHUNK_MAGIC
    from kvcodec.container.format import read_object, write_object

    c = codec(synthetic_kvt, coder="zstd", bits_per_value=2.0, fine_tokens=0)  # version 1 had no finer tail
    kv = synthetic_kv(64, seed=33)
    blob = c.encode_chunks(kv)[0].blobs[0]
    want = c.decode_chunk(blob, torch.empty_like(kv))
    h, payload = read_object(blob, CHUNK_MAGIC, "tc")
    assert (h["transform_version"], h["fine_tokens"], h["recon"], h["pieces"]) == (3, 0, "centre", [])
    del h["pieces"]
    h["transform_version"] = 2  # the header version-2 writers produced
    v2 = write_object(CHUNK_MAGIC, dict(h), [bytes(payload)])
    for field in ("fine_tokens", "fine_bits", "recon"):
        del h[field]
    h["transform_version"] = 1  # the header version-1 writers produced
    old = write_object(CHUNK_MAGIC, h, [bytes(payload)])
    for decoder in (c, codec(synthetic_kvt, recon="laplace", fine_tokens=8, fine_bits=1)):
        assert torch.equal(decoder.decode_chunk(old, torch.empty_like(kv)), want)
        assert torch.equal(decoder.decode_chunk(v2, torch.empty_like(kv)), want)


@pytest.mark.parametrize(
    "edit",
    [
        lambda h: h.__setitem__("fine_tokens", 65),  # more than the chunk's tokens
        lambda h: h.__setitem__("fine_tokens", -1),
        lambda h: h.__setitem__("fine_bits", 7),
        lambda h: h.__setitem__("fine_bits", 1.5),
        lambda h: h.__setitem__("recon", "median"),
        lambda h: h.pop("recon"),  # version 2 needs all three
        lambda h: h.__setitem__("transform_version", 1),  # version 1 has none of them
        lambda h: h.__setitem__("transform_version", 4),
        lambda h: h.__setitem__("transform_version", "2"),
        lambda h: h.__setitem__("transform_version", 2),  # version 2 has no pieces
        lambda h: h.__setitem__("pieces", [5]),  # a zstd chunk has none
        lambda h: h.pop("pieces"),  # version 3 needs them
    ],
)
def test_forged_precision_fields_are_format_errors(synthetic_kvt, edit):
    from kvcodec.codecs.transform.codec import CHUNK_MAGIC
    from kvcodec.container.format import read_object, write_object

    c = codec(synthetic_kvt, coder="zstd", bits_per_value=2.0, fine_tokens=8, fine_bits=1)
    kv = synthetic_kv(64, seed=34)
    h, payload = read_object(c.encode_chunks(kv)[0].blobs[0], CHUNK_MAGIC, "tc")
    edit(h)
    with pytest.raises(FormatError):
        c.decode_chunk(write_object(CHUNK_MAGIC, h, [bytes(payload)]), torch.empty_like(kv))


def test_precision_options_are_checked(synthetic_kvt):
    for kw in (dict(fine_tokens=-1), dict(fine_bits=9), dict(recon="median")):
        with pytest.raises(ConfigError):
            codec(synthetic_kvt, **kw)


def test_coefficients_of_the_coded_coordinates_are_those_of_all(synthetic_kvt):
    """A level known beforehand computes only the coordinates it codes (the default encode): the
    same values as all coefficients cut to the coded columns, and the same chunks."""
    c = codec(synthetic_kvt)
    kv = synthetic_kv(100, seed=5).float()
    theta = c._level(None, kv, 0)
    counts = c.plan(theta).counts
    coded = c.coefficients(kv, 0, counts)
    full = c.coefficients(kv, 0).index_select(1, c.device_plan(theta, kv.device).columns)
    assert coded.shape == (100, sum(counts))
    torch.testing.assert_close(coded, full, rtol=1e-5, atol=1e-5)
    assert torch.equal(c._symbols(coded, theta, 0), c._symbols(full, theta, 0))


def test_encode_samples_are_those_of_to_samples_at_the_extremes():
    """The encoder's samples and escapes (int32, no widening) are quantize.to_samples's."""
    from kvcodec.codecs.transform.codec import _samples
    from kvcodec.transform import quantize

    q = (torch.randn(40, 33, generator=torch.Generator().manual_seed(3)) * 90).round().to(torch.int32)
    q.view(-1)[:8] = torch.tensor([2**31 - 1, -(2**31), 127, -128, 128, -129, 0, 255], dtype=torch.int32)
    got, want = _samples(q), quantize.to_samples(q)
    assert torch.equal(got[0], want[0])
    assert (got[1] == want[1]).all() and (got[2] == want[2]).all() and len(got[1]) == len(want[1]) > 0


def test_a_video_chunk_codes_each_frame_as_a_stream_that_decodes_alone(synthetic_kvt):
    """The header's pieces: one byte length per frame of the video, each piece the frame's own
    stream (what lets a fetch decode one chunk on several NVDEC engines), joined the whole video."""
    from kvcodec.video.registry import get_decoder

    c = codec(synthetic_kvt, coder="hevc")
    blob = c.encode_chunks(synthetic_kv(64, seed=35))[0].blobs[0]
    h, streams = c._read(blob)
    video, (w, hh) = bytes(streams["video"]), h["resolution"]
    assert h["frames"] > 1 and len(h["pieces"]) == h["frames"] and sum(h["pieces"]) == len(video)
    cpu = get_decoder("cpu")
    whole = list(cpu.decode(video, w, hh))
    at = 0
    for size, frame in zip(h["pieces"], whole):
        alone = list(cpu.decode(video[at : at + size], w, hh))
        assert len(alone) == 1 and torch.equal(alone[0], frame)
        at += size


def test_packets_that_are_not_one_per_frame_are_written_as_one_stream(synthetic_kvt, monkeypatch):
    """An encoder whose packets do not map one to a frame (here x265's first packet cut in two)
    writes its video as one stream, without pieces, and the chunk still decodes exactly."""
    from kvcodec.codecs.transform.codec import X265_TUNING
    from kvcodec.video.x265_cpu import X265Encoder

    class CutFirstPacket:
        def __init__(self) -> None:
            self.x265 = X265Encoder(preset="ultrafast", tuning=X265_TUNING)

        def encode_intra(self, frames, width, height):  # noqa: ANN001, ANN202
            first, *rest = self.x265.encode_intra(frames, width, height)
            return [first[:40], first[40:], *rest]

    whole = codec(synthetic_kvt, coder="hevc")
    c = codec(synthetic_kvt, coder="hevc")
    monkeypatch.setattr(c, "_encoder", lambda threads=None: CutFirstPacket())
    kv = synthetic_kv(64, seed=36)
    blob = c.encode_chunks(kv)[0].blobs[0]
    h, streams = c._read(blob)
    assert h["frames"] > 1 and h["pieces"] == []
    assert bytes(streams["video"]) == bytes(whole._read(whole.encode_chunks(kv)[0].blobs[0])[1]["video"])
    assert torch.equal(roundtrip(c, kv)[0], roundtrip(whole, kv)[0])


def test_a_fetch_restores_transform_chunks_straight_into_a_target_of_another_float_dtype(synthetic_kvt):
    """float16-stored chunks into a bfloat16 target: rounded once from the float32 restore, with no
    float16 staging between (which rounds twice); the same fetch into float32 is the reference.
    Chunks that are staged (direct off, a last chunk past n_tokens) are staged in the target's
    dtype: every chunk gets the same values whichever way it went."""
    from kvcodec.fetcher import PrefixCache
    from kvcodec.store import open_store

    c = codec(synthetic_kvt, coder="zstd", bits_per_value=2.0)
    kv = synthetic_kv(150, seed=12)
    ids = list(range(1000, 1150))
    store = open_store("memory://")
    PrefixCache(store, "synthetic", c, "cpu").put(ids, kv)
    reference = torch.empty(kv.shape, dtype=torch.float32)
    assert PrefixCache(store, "synthetic", c, "cpu").fetch(ids, out=reference).tokens_restored == 150
    once = reference.to(torch.bfloat16)
    assert not torch.equal(once, reference.half().to(torch.bfloat16))  # what float16 staging gives
    for direct, n, staged in ((True, 150, 0), (False, 150, 3), (True, 140, 1)):  # 140: the last chunk staged
        into = torch.zeros(kv.shape, dtype=torch.bfloat16)
        res = PrefixCache(store, "synthetic", c, "cpu", direct=direct).fetch(ids, n, out=into)
        assert res.tokens_restored == n and res.kv is into and res.stats.chunks_staged == staged
        assert torch.equal(into[:, :, :n], once[:, :, :n]), (direct, n)


def test_a_target_that_cannot_hold_the_stored_range_is_refused(synthetic_kvt):
    c = codec(synthetic_kvt, coder="zstd", bits_per_value=2.0)
    blob = c.encode_chunks(synthetic_kv(64, seed=13).bfloat16())[0].blobs[0]
    shape = (L, 2, 64, H, D)
    with pytest.raises(ShapeError, match=r"torch.bfloat16, torch.float32 \(stored: torch.bfloat16\)"):
        c.decode_chunk(blob, torch.empty(shape, dtype=torch.float16))  # bfloat16's range turns to inf there
    with pytest.raises(ShapeError):
        c.decode_chunk(blob, torch.empty(shape, dtype=torch.int8))
    assert torch.isfinite(c.decode_chunk(blob, torch.empty(shape, dtype=torch.float32))).all()


@pytest.mark.parametrize("batched", [False, True], ids=["one-chunk", "batched"])
def test_float16_values_at_its_largest_restore_finite_not_inf(synthetic_kvt, batched):
    """A lossy restore of values near float16's largest can overshoot it: clamped, never inf."""
    c = codec(synthetic_kvt, coder="zstd", bits_per_value=2.0)
    kv = synthetic_kv(64, seed=14)
    kv[0, 0, 5] = 65504.0
    kv[1, 1, 9] = -65504.0
    blob = c.encode_chunks(kv)[0].blobs[0]

    def restored(out):
        if batched:  # the staged restore's two halves, as a CUDA fetch runs them
            c.finish([c.stage(blob, out)], [out])
            return out
        return c.decode_chunk(blob, out)

    wide = restored(torch.empty(kv.shape, dtype=torch.float32))
    assert wide.abs().max() > 65520  # an overshoot that a cast would turn to inf
    out = restored(torch.empty(kv.shape, dtype=torch.float16))
    clamped = wide.clamp(-65504, 65504).half()
    over = wide.abs() > 65520
    assert torch.isfinite(out).all() and bool((out[over].float().abs() == 65504).all())
    # the float16 target's path adds the escapes beyond float16 to its GEMM's products, the float32 one has them
    # in its GEMM: float32 sums of +-65504-sized terms in another order (the CPU's vector width decides it)
    assert torch.allclose(out.float(), clamped.float(), rtol=2**-10, atol=65504 * 2**-20)
    pages = torch.zeros((L, 2, 4, 16, H, D), dtype=torch.float16)
    restored(PagedKV(pages, torch.tensor([2, 0, 3, 1])))
    assert torch.isfinite(pages).all()


@given(st.sampled_from([torch.float16, torch.bfloat16, torch.float32]), st.floats(-1e39, 1e39))
def test_clamp_to_range_clamps_only_to_a_narrower_range_and_keeps_nan(dtype, value):
    y = torch.tensor([value], dtype=torch.float32)
    want = y.item()
    got = clamp_to_range_(y, dtype)
    top = torch.finfo(dtype).max
    if want != want:  # NaN
        assert got.isnan().all()
        return
    assert got is y and not got.to(dtype).isinf().any() or abs(want) == float("inf") and dtype == torch.float32
    assert got.item() == (max(-top, min(top, want)) if top < torch.finfo(torch.float32).max else want)


@pytest.mark.parametrize("token", [0, 40])  # a sink token (kept as float16) and a coded one
def test_kv_beyond_float16s_range_is_refused_not_restored_as_inf(synthetic_kvt, token):
    """The transform keeps its sink tokens as float16 and its .kvt's means within float16's range: a finite
    float32 or bfloat16 value beyond it is refused before any work (it restored as inf), as calibration
    refuses such KV (it wrote a .kvt that its reader then refused)."""
    from kvcodec.transform import calibrate

    for dtype in (torch.float32, torch.bfloat16):
        kv = synthetic_kv(64, seed=15).to(dtype)
        kv[2, 1, token, 0, 3] = 1e5
        with pytest.raises(ShapeError, match="beyond float16's range"):
            codec(synthetic_kvt, target_ratio=5.0).encode_chunks(kv)
        with pytest.raises(ShapeError, match="beyond float16's range"):
            calibrate([kv.float()], ROPE)


@pytest.mark.parametrize("tokens", [6, 12, 16])
def test_a_kv_whose_sinks_alone_exceed_the_ratio_codes_its_other_tokens_not_discards_them(synthetic_kvt, tokens):
    """At 5x, 4 fp16 sink tokens take all of a 20-token KV's budget: the others were coded at the coarsest
    level (restored as the calibration's mean, relative error ~0.56); now at the level the ratio gives them
    without the sinks (the file larger than 5x: the target cannot be met)."""
    kv = synthetic_kv(tokens, seed=16)
    c = codec(synthetic_kvt, target_ratio=5.0)
    out = torch.empty(kv.shape, dtype=torch.float32)
    for chunk in c.encode_chunks(kv):
        c.decode_chunk(chunk.blobs[0], out)
    rest = kv[:, :, 4:].float()
    assert float((out[:, :, 4:] - rest).norm() / rest.norm()) < 0.25
