"""Codec option values as callers give them: typed, or as the text of a `--codec-option KEY=VALUE`
(kvcodec.config's whole_number, whole_numbers, real_number, resolution_pairs). A value that is not what
the option takes is one ConfigError naming the option, never a TypeError or ValueError from inside a
codec (those surfaced as a traceback or as "'<' not supported between instances of 'str' and 'int'")."""

from __future__ import annotations

import pytest
from click.testing import CliRunner
from hypothesis import given
from hypothesis import strategies as st

from kvcodec.config import CodecConfig, real_number, resolution_pairs, whole_number, whole_numbers
from kvcodec.errors import ConfigError

sides = st.integers(min_value=1, max_value=8192)


@given(st.lists(st.tuples(sides, sides), min_size=1, max_size=4))
def test_resolution_pairs_read_pairs_and_their_text_alike(pairs):
    text = ",".join(f"{w}x{h}" for w, h in pairs)
    assert (
        resolution_pairs(pairs) == resolution_pairs(text) == resolution_pairs([list(p) for p in pairs]) == tuple(pairs)
    )
    assert resolution_pairs(text.upper().replace(",", " , ")) == tuple(pairs)


@given(st.integers(min_value=-(10**12), max_value=10**12))
def test_whole_numbers_read_ints_and_their_text_alike(n):
    assert whole_number(n, "x") == whole_number(str(n), "x") == whole_number(f" {n} ", "x") == n
    assert whole_numbers(f"{n},{n}", "x") == whole_numbers((n, str(n)), "x") == (n, n)


@pytest.mark.parametrize("value", [True, 2.5, 256.0, "x", "2.5", "", None, [256]])
def test_a_value_that_is_no_integer_is_refused_by_name(value):
    with pytest.raises(ConfigError, match="chunk_tokens must be an integer"):
        whole_number(value, "chunk_tokens")


@pytest.mark.parametrize(
    "value", ["abc", "512", "512x", "x512", "512x512x3", 5, None, [1, 2], [(1, 2, 3)], [("a", "b")]]
)
def test_a_value_that_is_no_frame_size_is_refused_by_name(value):
    with pytest.raises(ConfigError, match="resolutions must be"):
        resolution_pairs(value)


def test_real_numbers_keep_a_number_as_given_and_read_text():
    assert real_number(5, "r") == 5 and isinstance(real_number(5, "r"), int)  # codec ids print it: r5, not r5.0
    assert real_number("5.5", "r") == 5.5 and real_number(0.25, "r") == 0.25
    for bad in (True, "abc", None, [5]):
        with pytest.raises(ConfigError, match="target_ratio must be a number"):
            real_number(bad, "target_ratio")


def test_the_codec_config_takes_the_text_of_its_options():
    c = CodecConfig(chunk_tokens="128", resolutions="256x256,512x512", layer_bits="8,6")
    assert (c.chunk_tokens, c.resolutions, c.layer_bits) == (128, ((256, 256), (512, 512)), (8, 6))
    assert c == CodecConfig(chunk_tokens=128, resolutions=((256, 256), (512, 512)), layer_bits=(8, 6))


@pytest.mark.parametrize(
    "option,says",
    [
        ("resolutions=abc", "resolutions must be"),
        ("chunk_tokens=x", "chunk_tokens must be an integer"),
        ("layer_bits=abc", "layer_bits must be an integer"),
        ("chunk_tokens=1.5", "chunk_tokens must be an integer"),
    ],
)
def test_a_bad_codec_option_is_one_usage_error_line_naming_it(tmp_path, option, says):
    from kvcodec.cli.main import cli

    docs = tmp_path / "docs.txt"
    docs.write_text("one prompt\n")
    args = ["ingest", str(docs), "--model", "smollm2-135m", "--store", f"file://{tmp_path / 's'}"]
    r = CliRunner().invoke(cli, [*args, "--codec-option", option])
    assert r.exit_code == 2 and says in r.output and "Traceback" not in r.output, r.output


def test_the_transform_codec_takes_the_text_of_its_options_and_refuses_other_values(synthetic_kvt):
    from kvcodec.codecs import make_codec

    typed = make_codec("transform", transform=synthetic_kvt, target_ratio=5, chunk_tokens=64, resolutions=((256, 256),))
    text = make_codec("transform", transform=synthetic_kvt, target_ratio="5", chunk_tokens="64", resolutions="256x256")
    assert text.chunk_tokens == 64 and text.resolutions == ((256, 256),) and text.target_ratio == 5.0
    assert typed.id == text.id  # one store key space whichever way the options came
    for option, value in (("target_ratio", "abc"), ("theta", "x"), ("chunk_tokens", 1.5), ("resolutions", "big")):
        with pytest.raises(ConfigError, match=option):
            make_codec("transform", transform=synthetic_kvt, **{option: value})


def test_the_raw_codec_takes_the_text_of_its_options_and_refuses_other_values():
    from kvcodec.codecs import make_codec

    text = make_codec("raw", variants="raw,zstd", zstd_level="5", chunk_tokens="64", resolutions="256x256,512x512")
    typed = make_codec(
        "raw", variants=("raw", "zstd"), zstd_level=5, chunk_tokens=64, resolutions=((256, 256), (512, 512))
    )
    assert text == typed and text.id == typed.id
    assert make_codec("raw", variants="zstd").variants == ("zstd",)  # one variant, not its letters
    for option, value in (("chunk_tokens", 1.5), ("chunk_tokens", "x"), ("zstd_level", "x"), ("zstd_level", 99)):
        with pytest.raises(ConfigError, match=option):
            make_codec("raw", **{option: value})


@pytest.mark.parametrize(
    "name,options,says",
    [
        ("hevc", {"foo": 1}, "unexpected keyword argument 'foo'"),
        ("raw", {"foo": 1}, "unexpected keyword argument 'foo'"),
        ("transform", {}, "missing a required argument: 'transform'"),
        ("transform", {"foo": 1}, "unexpected keyword argument 'foo'"),
        ("transform-ans", {"foo": 1}, "unexpected keyword argument 'foo'"),
        ("grouped", {"inner": "raw", "foo": 1}, "unexpected keyword argument 'foo'"),
        ("hevc", {"restore": "x"}, "restore must be one of"),
        ("hevc", {"pool": "x"}, "pool must be an NvdecPool"),
    ],
)
def test_make_codec_refuses_options_a_codec_does_not_take_by_name(synthetic_kvt, name, options, says):
    """Before, a TypeError (an unknown option), or a codec that failed at its first decode
    (restore="x": ValueError; pool="x": AttributeError)."""
    from kvcodec.codecs import make_codec

    if name.startswith("transform") and options:
        options = {"transform": synthetic_kvt, **options}
    with pytest.raises(ConfigError, match=says):
        make_codec(name, **options)


@pytest.mark.parametrize("value", ["bogus", "meta", 3.5, None, "cuda:x"])
def test_a_device_that_is_no_cpu_or_cuda_device_is_refused_by_name(value):
    from kvcodec.config import torch_device

    with pytest.raises(ConfigError, match="device must be cpu or a CUDA device"):
        torch_device(value)


def test_devices_are_read_and_cuda_without_cuda_is_refused():
    import torch

    from kvcodec.config import torch_device

    assert torch_device("cpu") == torch.device("cpu") == torch_device(torch.device("cpu"))
    if not torch.cuda.is_available():
        with pytest.raises(ConfigError, match="no CUDA device"):
            torch_device("cuda")


@pytest.mark.parametrize("options", [{"head_dim": -64}, {"head_dim": "abc"}, {"head_dim": 0}, {"max_workers": 0}])
def test_the_lmcache_serde_refuses_sizes_below_one_when_lmcache_builds_it(options):
    # head_dim -64 failed at the first object (a RuntimeError), "abc" a ValueError, 0 meant the default
    from kvcodec.integrations.lmcache_serde import SerdeOptions

    (name,) = options
    with pytest.raises(ConfigError, match=f"kvcodec serde {name}"):
        SerdeOptions.from_kwargs(options)
    assert getattr(SerdeOptions.from_kwargs({name: "64"}), name) == 64


@pytest.mark.parametrize(
    "args",
    [
        ["demo", "--gbit", "nan"],  # a nan link rate hung the demo at its first transfer
        ["demo", "--transform-ratio", "inf"],
        ["serve", "--stall-timeout", "nan"],
        ["calibrate", "x.safetensors", "--weight-alpha", "nan"],
        ["calibrate", "x.safetensors", "--tokens-per-dim", "inf"],
    ],
)
def test_a_number_that_is_not_finite_is_a_usage_error_before_any_work(args):
    from kvcodec.cli.main import cli

    r = CliRunner().invoke(cli, args)
    assert r.exit_code == 2 and "is not a finite number" in r.output and "Traceback" not in r.output, r.output


@pytest.mark.parametrize("rate", [float("nan"), float("inf"), 0.0, -1.0])
def test_a_link_trace_refuses_a_rate_that_is_not_finite_and_positive(rate):
    from kvbench.net.trace import JitterTrace

    with pytest.raises(ConfigError, match="finite and > 0"):
        JitterTrace.constant(rate)
