"""Seeded, time-bounded fuzzing of the formats added after the first reliability run (split chunk
blobs, transform-coded chunks on the reference and the batched restore path, .kvt calibration
files, stores serving another TP shard's chunk), on real SmolLM2 KV; plus regression tests for
what the fuzzer found. The cases live in benchmarks/probes/format_fuzz.py (the big run:
benchmarks/probes/reliability.py, results benchmarks/results/reliability-cpu-v2.md).
KVCODEC_FUZZ_SECONDS (default 4 per test here; 3 seeded rounds per category always run) and
KVCODEC_FUZZ_SEED set the budget."""

from __future__ import annotations

import dataclasses
import json
import os
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks" / "probes"))
import format_fuzz  # noqa: E402
import reliability  # noqa: E402

from kvcodec.codecs.transform.codec import CHUNK_MAGIC as TC_MAGIC  # noqa: E402
from kvcodec.codecs.transform.codec import TransformCodec  # noqa: E402
from kvcodec.container import split  # noqa: E402
from kvcodec.container.format import read_object, write_object  # noqa: E402
from kvcodec.errors import FormatError, KVCodecError  # noqa: E402
from kvcodec.transform.kvt import from_bytes, kvt_hash  # noqa: E402

SECONDS = float(os.environ.get("KVCODEC_FUZZ_SECONDS", "4"))
SEED = int(os.environ.get("KVCODEC_FUZZ_SEED", "20261201"))
CHUNK = 32
HANG_CPU_S = 60  # CPU seconds of one case; cases take ~2 s, 10 s failed once on a loaded 2-core machine


@pytest.fixture(scope="module")
def kvs(smollm2):
    torch.manual_seed(0)
    kv = reliability.real_kv(2 * CHUNK, smollm2)
    cal_kv = reliability.real_kv(400, smollm2, text="pg/apple")  # calibrated on another essay
    return kv, cal_kv


@pytest.fixture(scope="module")
def transform(kvs):
    return format_fuzz.transform_subjects(*kvs, CHUNK)


@pytest.fixture(scope="module")
def splits(kvs):
    return format_fuzz.split_subjects(kvs[0], CHUNK)


def _check(tally, categories, undetectable=()):
    assert not tally.violations, tally.violations[:5]
    assert tally.max_case_s < HANG_CPU_S  # a case that loops or inflates is caught, not a speed check
    for category in categories:
        counts = tally.outcomes[category]
        assert sum(counts.values()) >= 3, (category, counts)
        if category not in undetectable:
            assert counts["error"] > 0, (category, counts)  # the mutations do bite


def test_fuzzed_split_chunks_give_a_clear_error_or_the_original(splits):
    tally = reliability.Tally()
    format_fuzz.fuzz_chunks(splits, format_fuzz.SPLIT_CATEGORIES, SEED, SECONDS, tally, min_rounds=2)
    _check(tally, format_fuzz.SPLIT_CATEGORIES)


def test_fuzzed_transform_chunks_give_a_clear_error_or_consistent_values(transform):
    tally = reliability.Tally()
    format_fuzz.fuzz_chunks(transform[0], format_fuzz.TC_CATEGORIES, SEED, SECONDS, tally, min_rounds=1)
    _check(tally, format_fuzz.TC_CATEGORIES)


def test_fuzzed_kvt_files_are_refused_or_code_finite_kv(transform):
    tally = reliability.Tally()
    format_fuzz.fuzz_kvt(transform[1], SEED, SECONDS, tally, CHUNK)
    _check(tally, format_fuzz.KVT_CATEGORIES, undetectable={"kvt-bitflip"})  # no checksum: its hash is its identity


def test_a_store_serving_another_shards_chunk_never_yields_its_heads(kvs):
    tally = format_fuzz.fuzz_shards(kvs[0][:, :, : CHUNK + 1].contiguous(), CHUNK, SEED, cases=10)
    assert not tally.violations, tally.violations[:5]
    for category, counts in tally.outcomes.items():
        if category != "shard-forged-key":  # a rewritten key under recomputed CRCs: a forgery
            assert counts == {"error": 2}, (category, counts)


# -- regressions: what the fuzzer found ----------------------------------------------------------


def test_split_parts_reordered_are_refused_and_v1_blobs_still_decode(splits):
    subject, blob = splits[1], splits[1].blobs[0]  # exact, 2 parts of 15 layers
    h, parts = format_fuzz._split_parts(blob)
    with pytest.raises(FormatError, match="reordered or exchanged"):
        subject.codec.decode_chunk(
            format_fuzz._join_split(json.loads(json.dumps(h)), parts[::-1]), subject.originals[0].clone()
        )
    for p in h["parts"]:
        del p["header_crc32"]
    h["split_version"] = 1
    old = format_fuzz._join_split(h, parts)
    assert split.parse_split_header(old)[0].parts[0].header_crc32 is None
    got = subject.codec.decode_chunk(old, torch.empty_like(subject.originals[0]))
    assert torch.equal(got, subject.originals[0])


@pytest.mark.parametrize(
    "edit",
    [
        lambda h: h.pop("escapes"),
        lambda h: h.__setitem__("sink", "x"),
        lambda h: h.__setitem__("sink", 10**6),
        lambda h: h.__setitem__("theta", float("nan")),
        lambda h: h.__setitem__("key_weight", -1),
        lambda h: h.__setitem__("resolution", [0, 0]),
        lambda h: h.__setitem__("shape", [30.0, 3, 64]),
        lambda h: h.__setitem__("start_token", None),
        lambda h: h.__setitem__("streams", h["streams"] + h["streams"][:1]),
        lambda h: h.__setitem__("streams", [s for s in h["streams"] if s[0] != "escapes"]),
        lambda h: h.__setitem__("escapes", 2**30),
        lambda h: h.__setitem__("extra", 1),
    ],
)
def test_a_forged_transform_header_is_a_format_error(transform, edit):
    subject = transform[0][0]
    h, payload = read_object(subject.blobs[0], TC_MAGIC, "tc")
    edit(h)
    with pytest.raises(FormatError):
        subject.codec.decode_chunk(write_object(TC_MAGIC, h, [bytes(payload)]), subject.originals[0].clone())


@pytest.mark.parametrize(
    "meta, tensor",
    [
        ({"rope": "5"}, None),
        ({"shape": json.dumps([2**40, 3, 64])}, None),
        ({"groups": json.dumps([[0.5]])}, None),
        ({"info": "[1]"}, None),
        (None, ("basis", float("nan"))),
        (None, ("mean", float("inf"))),
        (None, ("variances", -1.0)),
    ],
)
def test_a_damaged_kvt_is_a_format_error(transform, meta, tensor):
    m, tensors = format_fuzz._kvt_parts(transform[1].data)
    m.update(meta or {})
    if tensor:
        tensors["g0.k." + tensor[0]].view(-1)[0] = tensor[1]
    with pytest.raises(FormatError):
        from_bytes(format_fuzz._kvt_join(m, tensors))


def test_a_kvt_that_maps_kv_beyond_the_integer_range_is_refused_at_load_and_at_encode(transform):
    m, tensors = format_fuzz._kvt_parts(transform[1].data)
    tensors["g0.k.basis"] = tensors["g0.k.basis"].float()  # a version-3 .kvt may store it as float32 too
    tensors["g0.k.basis"][:, 0] = 1e30  # finite, but the first coefficient overflows int32
    with pytest.raises(FormatError, match="basis column of norm"):
        from_bytes(format_fuzz._kvt_join(m, tensors))
    cal = from_bytes(transform[1].data)  # a calibration built in memory, past the loader's checks
    b = cal.bases[(0, "k")]
    basis = b.basis.clone()
    basis[:, 0] = 1e30
    cal.bases[(0, "k")] = dataclasses.replace(b, basis=basis)
    codec = TransformCodec(cal, kvt_hash=kvt_hash(transform[1].data), coder="zstd", chunk_tokens=CHUNK)
    with pytest.raises(KVCodecError, match="integer range"):
        codec.encode_chunks(transform[1].kv)


def test_a_kvt_whose_mean_leaves_the_float16_range_is_refused(transform):
    m, tensors = format_fuzz._kvt_parts(transform[1].data)
    tensors["g0.v.mean"][0] = 2.0**67  # a flipped exponent bit: finite, but restored KV would overflow
    with pytest.raises(FormatError, match="mean beyond"):
        from_bytes(format_fuzz._kvt_join(m, tensors))


@pytest.mark.parametrize(
    "field, value",
    [("start_token", 2**31 - 64), ("theta", 2.0**31)],  # RoPE tables sized by the position; nothing coded
)
def test_batched_restore_of_a_far_position_or_an_empty_plan_matches_the_reference(transform, field, value):
    by_name = {s.name: s for s in transform[0]}
    ref, batched = by_name["transform-hevc-ref"], by_name["transform-hevc-batched"]
    plain = TransformCodec(  # no finer tail (its escapes would name samples an empty plan lacks)
        ref.codec.cal,
        kvt_hash=ref.codec.kvt_hash,
        chunk_tokens=CHUNK,
        resolutions=ref.codec.resolutions,
        fine_tokens=0,
        coder="hevc",
    )
    tail = plain.encode_chunks(transform[1].kv[:, :, CHUNK : CHUNK + 1], first_chunk_index=1)[0].blobs[0]
    h, payload = read_object(tail, TC_MAGIC, "tc")  # one token past the sinks: one frame at any level
    h[field] = value
    blob = write_object(TC_MAGIC, h, [bytes(payload)])
    rss0 = reliability.peak_rss_mb()
    want = ref.codec.decode_chunk(blob, torch.empty(transform[1].kv[:, :, :1].shape, dtype=transform[1].kv.dtype))
    got = batched.codec.decode_chunk(blob, torch.empty(transform[1].kv[:, :, :1].shape, dtype=transform[1].kv.dtype))
    assert reliability.peak_rss_mb() - rss0 < 512
    assert torch.isfinite(got.float()).all()
    torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=2e-2)
