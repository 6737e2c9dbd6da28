"""`kvcodec bench fetch --method kvcodec-transform-<r> --transform X.kvt`: any KV file and .kvt by path, fetched
with PrefixCache's defaults (in-process store, token-bucket link: no redis-server needed)."""

from __future__ import annotations

import json

import pytest
import torch
from click.testing import CliRunner

from synthetic import synthetic_kv

TOKENS = 96


@pytest.fixture(scope="module")
def kv_file(tmp_path_factory):
    from safetensors.torch import save_file

    path = tmp_path_factory.mktemp("kv") / "kv.safetensors"
    save_file({"kv": synthetic_kv(TOKENS, 3), "token_ids": torch.arange(TOKENS)}, str(path))
    return path


def _bench(tmp_path, *args: str):
    from kvbench.fetch import command

    base = ["--tokens", str(TOKENS), "--chunk-tokens", "32", "--rates", "4", "--jitter-mean", "0"]
    base += ["--store", "memory", "--repeats", "1", "--out-dir", str(tmp_path / "results")]
    return CliRunner().invoke(command, [*base, *args])


def test_a_transform_method_is_stored_and_fetched_with_the_fetchers_defaults(
    tmp_path, kv_file, synthetic_kvt, monkeypatch
):
    import kvcodec.fetcher.cache as cache

    # the fetcher's defaults, made distinct from the bench's old ones (4 in flight, 1 decode worker)
    monkeypatch.setattr(cache, "default_decode_workers", lambda device: 2)
    monkeypatch.setattr(cache, "default_max_inflight", lambda device, workers: 9)
    res = _bench(tmp_path, "--kv", str(kv_file), "--method", "kvcodec-transform-4", "--transform", str(synthetic_kvt))
    assert res.exit_code == 0, res.output + repr(res.exception)
    (path,) = (tmp_path / "results").glob("fetch-*.json")
    doc = json.loads(path.read_text())
    assert doc["method"] == "kvcodec-transform-4" and doc["codec"].startswith("transform")
    assert doc["transform"] == str(synthetic_kvt) and doc["codec_config"] is None
    recs = {r["policy"]: r for r in doc["records"]}
    assert list(recs) == ["fixed:0", "raw-fp16"]  # one frame size: nothing for the adaptive policy to pick
    coded, raw = recs["fixed:0"], recs["raw-fp16"]
    assert coded["codec"] == doc["codec"] and coded["method"] == "kvcodec-transform-4"
    assert (coded["decode_workers"], coded["max_inflight"], coded["net_workers"]) == (2, 9, 1)
    assert (raw["decode_workers"], raw["max_inflight"]) == (2, 9)
    assert raw["bit_exact"] and raw["bytes"] / coded["bytes"] > 2.5  # the transform's ratio, near its target of 4
    assert "method kvcodec-transform-4: codec `transform" in path.with_suffix(".md").read_text()


def test_a_bad_transform_is_refused_before_any_kv_is_made(tmp_path, kv_file, synthetic_kvt):
    not_kvt = tmp_path / "notes.kvt"
    not_kvt.write_bytes(b"not a transform")
    for args, says in [
        (["--method", "kvcodec-transform-4", "--transform", str(not_kvt)], "--transform"),
        (["--method", "kvcodec-transform-4"], "--transform PATH"),
        (["--method", "kvcodec-int8", "--transform", str(synthetic_kvt)], "kvcodec-transform-<ratio>"),
        (["--method", "kvcodec-transform-4", "--transform", str(synthetic_kvt), "--nvdec-threads", "2"], "HEVC"),
        (["--method", "kvcodec-transform-x", "--transform", str(synthetic_kvt), "--nvdec-threads", "2"], "ratio"),
        (["--method", "kvcodec-transform-4", "--transform", str(synthetic_kvt), "--policies", "fixed:1"], "frame size"),
        (["--policies", "bogus"], "unknown policy"),
        (["--policies", ","], "no policy"),
        (["--decode-workers", "0"], "--decode-workers"),
    ]:
        # a model that is not registered: reaching the prefill would fail otherwise
        res = _bench(tmp_path, "--model", "no-such-model", *args)
        assert res.exit_code == 2, (args, res.output)
        assert says in res.output, (args, res.output)
    assert not (tmp_path / "results").exists()


def test_kv_of_another_shape_than_the_kvts_is_refused(tmp_path, synthetic_kvt):
    from safetensors.torch import save_file

    other = tmp_path / "other.safetensors"
    save_file({"kv": synthetic_kv(TOKENS, 3, layers=2)}, str(other))
    res = _bench(tmp_path, "--kv", str(other), "--method", "kvcodec-transform-4", "--transform", str(synthetic_kvt))
    assert res.exit_code == 2 and "does not fit the .kvt" in res.output, res.output


@pytest.mark.parametrize(
    "args, hint",
    [
        (["--tokens", "0"], "--tokens"),
        (["--tokens", "-5"], "--tokens"),
        (["--repeats", "0"], "--repeats"),
        (["--chunk-tokens", "0"], "--chunk-tokens"),
        (["--jitter-cv", "-1"], "--jitter-cv"),
        (["--rates", "abc"], "--rates"),
        (["--rates", "1,0"], "--rates"),
        (["--rates", ","], "--rates"),
    ],
)
def test_bench_fetch_refuses_a_malformed_count_or_rate_as_a_usage_error(tmp_path, args, hint):
    """Each crashed with a traceback (an IndexError, a ValueError) or ran on silently (a negative --tokens cut
    the KV's end off)."""
    from kvbench.fetch import command

    res = CliRunner().invoke(command, ["--kv", str(tmp_path / "none.safetensors"), *args])
    assert res.exit_code == 2 and hint in res.output, res.output


def test_a_kv_file_of_another_model_than_the_kvts_is_warned_of(tmp_path, synthetic_kvt):
    # the warning was given for a prefilled model only: a KV file's own model (extract's metadata) went unchecked
    from safetensors.torch import save_file

    for model, warned in (("other-model", True), ("synthetic", False)):
        path = tmp_path / f"{model}.safetensors"
        save_file({"kv": synthetic_kv(TOKENS, 3)}, str(path), metadata={"model": model})
        res = _bench(tmp_path, "--kv", str(path), "--method", "kvcodec-transform-4", "--transform", str(synthetic_kvt))
        assert res.exit_code == 0, res.output + repr(res.exception)
        said = "calibrated on 'synthetic'" in res.output and f"file {path.name}'s model is 'other-model'" in res.output
        assert said == warned, res.output
