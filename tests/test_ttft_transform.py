"""The TTFT bench's transform methods: bytes from encoding a KV file with a .kvt, the modeled rows,
accuracy read from an rd record (CPU, seconds)."""

from __future__ import annotations

import json
from pathlib import Path

import click
import pytest

torch = pytest.importorskip("torch")
from click.testing import CliRunner  # noqa: E402

from kvbench import ttft  # noqa: E402
from kvbench.methods import (  # noqa: E402
    accuracy_of,
    expand_methods,
    label,
    method_codec,
    transform_codec,
    transform_coder,
    transform_ratio,
)
from kvcodec.config import CodecConfig  # noqa: E402
from kvcodec.errors import ConfigError  # noqa: E402
from kvcodec.kvspec.files import save_kv_file  # noqa: E402
from kvcodec.transform import calibrate, save_kvt  # noqa: E402
from synthetic import ROPE, D, H, L, synthetic_kv  # noqa: E402

RESULTS = Path(__file__).resolve().parents[1] / "benchmarks" / "results"


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("ttft")
    save_kvt(calibrate([synthetic_kv(600, s) for s in (1, 2)], ROPE, info={"model": "syn"}), d / "s.kvt")
    save_kv_file(d / "kv.safetensors", synthetic_kv(300, seed=9), {"model": "syn"})
    return d / "s.kvt", d / "kv.safetensors"


def test_transform_method_names():
    assert expand_methods(["raw", "kvcodec-transform", "kvcodec-int8"], [5, 8]) == [
        "raw",
        "kvcodec-transform-5",
        "kvcodec-transform-8",
        "kvcodec-int8",
    ]
    assert transform_ratio("kvcodec-transform-6.5") == 6.5 and transform_ratio("kvcodec-int8") is None
    assert label("kvcodec-transform-5") == "kvcodec-transform 5x" and label("raw") == "raw fp16 KV"
    assert transform_coder("kvcodec-transform-5") is None and transform_coder("kvcodec-int8") is None
    assert transform_ratio("kvcodec-transform-5-zstd") == 5 and transform_coder("kvcodec-transform-5-zstd") == "zstd"
    assert label("kvcodec-transform-8-zstd") == "kvcodec-transform 8x (zstd)"
    records = {"kvcodec-transform-8-hevc": {"top1_agreement": 0.9}, "raw": {"top1_agreement": 1.0}}
    assert (
        accuracy_of(records, "kvcodec-transform-8")
        == accuracy_of(records, "kvcodec-transform-8-zstd")
        == records["kvcodec-transform-8-hevc"]
    )
    assert accuracy_of(records, "raw") == records["raw"] and accuracy_of(records, "kvcodec-transform-5") == {}
    for bad in ("kvcodec-transform-x", "kvcodec-transform-1", "kvcodec-transform-5-lz4", "kvcodec-transform-5-"):
        with pytest.raises(ConfigError):
            expand_methods([bad], [])
    with pytest.raises(ConfigError, match="needs a .kvt"):
        method_codec("kvcodec-transform-5", CodecConfig())


def test_each_transform_method_codes_with_its_coder(files):
    kvt, _ = files
    default, hevc = (
        transform_codec("kvcodec-transform-5", str(kvt)),
        transform_codec("kvcodec-transform-5-hevc", str(kvt)),
    )
    ans = transform_codec("kvcodec-transform-5-ans", str(kvt), chunk_tokens=128)
    assert default.coder == "zstd" and hevc.coder == "hevc"
    assert ans.coder == "ans" and ans.id.startswith("transform-ans") and ans.chunk_tokens == 128
    assert label("kvcodec-transform-5-ans") == "kvcodec-transform 5x (ans)"
    assert transform_ratio("kvcodec-transform-8-ans") == 8


def test_kv_file_and_kvt_by_path_give_the_transform_bytes(files):
    kvt, kv_path = files
    res = (144, 144)
    first = ttft.kv_statistics("syn", 0, ["raw", "kvcodec-transform-4"], res, "pg", str(kvt), str(kv_path))
    t = first["methods"]["kvcodec-transform-4"]
    assert first["tokens"] == 300 and first["fp16_bytes"] == L * 2 * 300 * H * D * 2
    assert t["chunks"] == 2 and t["target_ratio"] == 4 and len(t["kvt_sha256"]) == 64
    assert 3.5 < t["ratio_vs_fp16"] < 4.5 and t["decode_GBps_fp16"] > 0
    assert first["methods"]["raw"]["ratio_vs_fp16"] == pytest.approx(1, abs=1e-3)


def test_kv_statistics_without_a_resolution_code_at_each_codecs_own_frame_size(files):
    from kvcodec.codecs.transform.codec import FRAME_SIZES

    kvt, kv_path = files
    stats = ttft.kv_statistics(
        "syn", 0, ["kvcodec-transform-4"], None, "pg", str(kvt), str(kv_path), {"kvcodec-transform-4"}
    )
    assert stats["methods"]["kvcodec-transform-4"]["resolution"] == list(FRAME_SIZES[0])


def test_transform_method_stores_and_fetches_through_a_prefix_cache(files):
    from kvcodec.fetcher import PrefixCache
    from kvcodec.store import open_store

    kv = synthetic_kv(300, seed=9)
    cfg = CodecConfig(chunk_tokens=128, resolutions=((144, 144),))
    codec = method_codec("kvcodec-transform-4", cfg, transform=files[0], resolutions=cfg.resolutions)
    pc = PrefixCache(open_store("memory://"), "syn", codec, "cpu", policy="fixed:0")
    ids = list(range(100, 400))
    assert pc.put(ids, kv) == 3
    res = pc.fetch(ids, 300)
    assert res.error is None and res.tokens_restored == 300
    err = float((res.kv.float() - kv.float()).pow(2).mean() / kv.float().pow(2).mean())
    assert err < 0.05


def test_modeled_rows_speedups_and_accuracy():
    p = ttft.ModeledPoint("m", 8192, 10**9, prefill_s=0.3, suffix_prefill_s=0.03, suffix_tokens=32, device="gpu")
    ratios = {"raw": 1.0, "cachegen": 4.0, "kvcodec-transform-5": 5.0}
    decode = {"raw": 50.0, "cachegen": 4.0, "kvcodec-transform-5": 2.5}
    acc = {"kvcodec-transform-5": {"top1_agreement": 0.99, "ppl_delta_pct": 0.1}}
    rows = {(r["bandwidth_gbit"], r["method"]): r for r in ttft.modeled_rows(p, [1.0, 100.0], ratios, decode, acc)}
    t = rows[(1.0, "kvcodec-transform-5")]
    x, d = 0.2e9 * 8 / 1e9, 1e9 / 2.5e9  # link-bound at 1 Gbit/s: the decode hides but for one chunk
    assert t["ttft_s"] == pytest.approx(x + d / 32 + 0.03)
    assert t["speedup_vs_raw"] == pytest.approx(rows[(1.0, "raw")]["ttft_s"] / t["ttft_s"])
    assert t["top1_agreement"] == 0.99 and rows[(1.0, "raw")]["top1_agreement"] is None
    fast = rows[(100.0, "kvcodec-transform-5")]  # decode-bound: slower than the 0.3 s prefill
    assert fast["ttft_s"] == pytest.approx(d + 0.016 / 32 + 0.03) and fast["speedup_vs_prefill"] < 1
    assert rows[(100.0, "prefill")]["ttft_s"] == 0.3


def test_accuracy_from_a_committed_rd_record():
    acc = ttft.load_accuracy((str(RESULTS / "rd-smollm2-135m-cpu-s6.json"),))["smollm2-135m"]
    assert {"raw", "zstd-3", "kvcodec-int8", "cachegen", "kvcodec-transform-5-hevc", "kvcodec-transform-8-hevc"} <= set(
        acc
    )
    assert accuracy_of(acc, "kvcodec-transform-5")["top1_agreement"] == pytest.approx(0.9961, abs=1e-4)  # zstd's own
    assert accuracy_of(acc, "kvcodec-transform-8")["top1_agreement"] == pytest.approx(0.9685, abs=1e-4)  # hevc's
    assert acc["cachegen"]["source"] == "rd-smollm2-135m-cpu-s6.json"
    assert ttft.rd_method("transform-hevc-r5-nosink") is None and ttft.rd_method("transform-zstd-r5-kw2") is None
    assert ttft.rd_method("transform-zstd-r5") == "kvcodec-transform-5"  # the default coder's
    assert ttft.rd_method("transform-mixed-r8") == "kvcodec-transform-8-mixed"


def test_stats_only_command_writes_a_record(files, tmp_path):
    kvt, kv_path = files
    out = tmp_path / "ttft-stats-x.json"
    args = ["--stats-only", "--kv-models", "syn", "--kv-file", f"syn={kv_path}", "--transform", str(kvt)]
    args += ["--methods", "raw,kvcodec-transform", "--target-ratios", "4", "--resolution", "144x144"]
    args += ["--decode-rate", "kvcodec-transform-4=2.5", "--device", "cpu", "--out", str(out)]
    r = CliRunner().invoke(ttft.command, args)
    assert r.exit_code == 0, r.output
    rec = json.loads(out.read_text())
    assert set(rec["kv_stats"]["syn"]["methods"]) == {"raw", "kvcodec-transform-4"}
    assert rec["kv_stats"]["syn"]["methods"]["kvcodec-transform-4"]["decode_s"] is None  # its rate is given
    assert "kvcodec-transform 4x" in out.with_suffix(".md").read_text()
    missing = CliRunner().invoke(ttft.command, ["--stats-only", "--methods", "kvcodec-transform", "--device", "cpu"])
    assert missing.exit_code != 0 and "--transform" in missing.output
    stray = [a if a != f"syn={kv_path}" else f"other={kv_path}" for a in args]  # it was ignored: syn was prefilled
    r = CliRunner().invoke(ttft.command, stray)
    assert r.exit_code != 0 and "other: not among --kv-models" in r.output
    with pytest.raises(click.ClickException, match="no KV statistics for nope .* measured: syn"):
        ttft.target_rows(
            "llama3-8b", rec["kv_stats"], [8], 4, [1.0], ["raw"], {}, 8.0, "cpu", False, 1, {}, None, "nope"
        )


def test_a_transform_method_with_a_coder_codes_its_samples_with_it(files):
    kvt, _ = files
    config = CodecConfig(chunk_tokens=256, resolutions=((256, 256),))
    assert method_codec("kvcodec-transform-5-mixed", config, transform=kvt).coder == "mixed"
    assert method_codec("kvcodec-transform-5-hevc", config, transform=kvt).coder == "hevc"
    assert method_codec("kvcodec-transform-5", config, transform=kvt).coder == "zstd"  # the codec default
    assert method_codec("kvcodec-transform-5-hevc", config, transform=kvt).coder == "hevc"


def test_a_transform_method_codes_at_the_codecs_own_frame_size_unless_one_is_given(files):
    """A benchmark measures what users get: the transform's frames are its FRAME_SIZES, not the
    HEVC codec's CodecConfig default, unless the bench names a size for every method."""
    from kvcodec.codecs.transform.codec import FRAME_SIZES

    kvt, _ = files
    config = CodecConfig(chunk_tokens=256)
    assert tuple(method_codec("kvcodec-transform-5", config, transform=kvt).resolutions) == FRAME_SIZES
    assert tuple(method_codec("kvcodec-int8", config).resolutions) == config.resolutions
    given = ((256, 256),)
    assert tuple(method_codec("kvcodec-transform-5", config, transform=kvt, resolutions=given).resolutions) == given
    assert tuple(method_codec("kvcodec-int8", config, resolutions=given).resolutions) == given


def test_the_benchmarks_default_coder_is_the_codecs():
    import inspect

    from kvbench.methods import DEFAULT_CODER
    from kvcodec.codecs.transform.codec import TransformCodec

    assert inspect.signature(TransformCodec).parameters["coder"].default == DEFAULT_CODER


def test_a_modeled_gpu_fetch_applies_nvdec_only_to_methods_whose_chunks_are_videos():
    methods = ("kvcodec-int8", "kvcodec-transform-5-hevc", "kvcodec-transform-5-zstd")
    stats = {"methods": {m: {"ratio_vs_fp16": 5.0, "decode_GBps_fp16": 0.7} for m in methods}}
    stats["methods"]["kvcodec-transform-5"] = stats["methods"]["kvcodec-transform-5-zstd"]  # the default coder
    rate = {m: ttft.decode_rate(m, stats, 10**9, True, 8.0, {}) for m in stats["methods"]}
    for m in methods[:2]:  # chunks that are videos: 8 Gbit/s of 5x-coded bytes
        assert rate[m]["decode_GBps_fp16"] == pytest.approx(5.0), m
    for m in ("kvcodec-transform-5", "kvcodec-transform-5-zstd"):  # the measured host rate, not NVDEC's
        assert rate[m]["decode_GBps_fp16"] == 0.7 and "NVDEC" not in rate[m]["source"], m


@pytest.mark.parametrize("m", ["kvcodec-transform-5-mixed", "kvcodec-transform-5-ans"])
def test_a_modeled_gpu_fetch_of_the_mixed_or_sm_coder_needs_a_given_rate(m):
    stats = {"methods": {m: {"ratio_vs_fp16": 5.0, "decode_GBps_fp16": 0.7}}}
    with pytest.raises(click.ClickException, match=f"--decode-rate {m}"):
        ttft.decode_rate(m, stats, 10**9, True, 8.0, {})
    assert ttft.decode_rate(m, stats, 10**9, True, 8.0, {m: 3.0})["decode_GBps_fp16"] == 3.0
    assert ttft.decode_rate(m, stats, 10**9, False, 8.0, {})["decode_GBps_fp16"] == 0.7  # a CPU run: as measured


def test_a_kv_file_of_another_model_or_shorter_than_a_chunk_is_refused_before_any_work(files, tmp_path):
    """A review's bench ttft table reported gpt2's KV as llama's, and a 3-token file's ratios (overhead:
    0.48x for int8) for 512-token prompts."""
    kvt, _ = files
    save_kv_file(tmp_path / "other.safetensors", synthetic_kv(300, seed=9), {"model": "other"})
    save_kv_file(tmp_path / "short.safetensors", synthetic_kv(100, seed=9), {"model": "syn"})
    base = ["--stats-only", "--kv-models", "syn", "--transform", str(kvt), "--methods", "raw,kvcodec-transform"]
    base += ["--target-ratios", "4", "--device", "cpu", "--out", str(tmp_path / "x.json")]
    for name, words in (("other", "holds the KV of 'other', not of 'syn'"), ("short", "fewer than one 256-token")):
        r = CliRunner().invoke(ttft.command, [*base, "--kv-file", f"syn={tmp_path / name}.safetensors"])
        assert r.exit_code == 2 and words in r.output, r.output
    assert not (tmp_path / "x.json").exists()


def test_a_kv_file_without_metadata_of_another_shape_than_its_models_is_refused(tmp_path, monkeypatch):
    """The file-vs-model check trusted a file's `model` metadata; one without it (or with a wrong one) is now also
    checked against the model's config: SmolLM2 has 30 layers of 3 KV heads of 64, not synthetic KV's."""
    import kvcodec.models

    if ttft.model_kv_shape("smollm2-135m") is None:
        pytest.skip("smollm2-135m's config cannot be read here")
    assert ttft.model_kv_shape("smollm2-135m") == (30, 3, 64) and ttft.model_kv_shape("no-such-model") is None
    monkeypatch.setattr(kvcodec.models, "load_model", lambda *a, **k: pytest.fail("a model loaded first"))
    save_kv_file(tmp_path / "bare.safetensors", synthetic_kv(300, seed=9), {})
    args = ["--stats-only", "--kv-models", "smollm2-135m", "--kv-file", f"smollm2-135m={tmp_path / 'bare.safetensors'}"]
    r = CliRunner().invoke(
        ttft.command, [*args, "--methods", "raw", "--device", "cpu", "--out", str(tmp_path / "x.json")]
    )
    assert r.exit_code == 2 and f"(layers, kv_heads, head_dim) {(L, H, D)}; 'smollm2-135m''s is (30, 3, 64)" in r.output
    assert not (tmp_path / "x.json").exists()
