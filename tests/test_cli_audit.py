"""The `kvcodec` command as a first-time user meets it: exit codes, outputs that must not be lost or
clobbered, flags that must not be silently ignored, and bad input refused before the slow work."""

import importlib.util
import json
import os
import sys

import click
import pytest
import torch
from click.testing import CliRunner
from safetensors.torch import save_file

from kvcodec.cli.main import cli
from kvcodec.cli.program import run_program
from synthetic import ROPE, synthetic_kv


def _kv_file(tmp_path, tokens: int = 40):  # noqa: ANN001, ANN202
    path = tmp_path / "kv.safetensors"
    save_file({"kv": synthetic_kv(tokens, 3)}, str(path))
    return path


def _one_line_error(r, code: int) -> str:  # noqa: ANN001
    """The run ended with `code` and printed no traceback; its output (the error line)."""
    assert isinstance(r.exception, SystemExit) and r.exit_code == code, (r.exit_code, r.output, r.exception)
    assert "Traceback" not in r.output
    return r.output


def test_a_commands_own_exit_code_is_the_programs(monkeypatch):
    # click returns (does not raise) a command's Exit outside standalone mode: ingest's "exit 1 if any
    # document failed" and its Ctrl-C 130 ended as exit 0
    @click.group()
    def group() -> None:
        pass

    @group.command("fail")
    def fail() -> None:
        raise click.exceptions.Exit(3)

    @group.command("ok")
    def ok() -> None:
        pass

    monkeypatch.setattr(sys, "argv", ["prog", "fail"])
    with pytest.raises(SystemExit) as e:
        run_program(group, error_prefix="error: ", error_code=1)
    assert e.value.code == 3
    monkeypatch.setattr(sys, "argv", ["prog", "ok"])
    run_program(group, error_prefix="error: ", error_code=1)  # exit 0: returns


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs FIFOs")
def test_an_output_that_exists_and_is_not_a_regular_file_is_refused(tmp_path):
    # outputs are written beside the path and renamed over it: `encode kv /dev/null` replaced the device
    src, fifo = _kv_file(tmp_path), tmp_path / "fifo"
    os.mkfifo(fifo)
    runner = CliRunner()
    out = _one_line_error(runner.invoke(cli, ["encode", str(src), str(fifo)]), 2)
    assert "not a regular file" in out
    out = _one_line_error(runner.invoke(cli, ["extract", "--model", "no-such-model", "--text", "pg", str(fifo)]), 2)
    assert "not a regular file" in out
    out = _one_line_error(runner.invoke(cli, ["calibrate", str(src), "--out", str(fifo)]), 2)
    assert "not a regular file" in out
    assert not fifo.is_file() and fifo.exists()


def test_output_directories_are_checked_before_the_work(tmp_path, monkeypatch):
    # calibrate fitted (minutes with --model) and ingest stored everything, then failed to write
    src = _kv_file(tmp_path)
    runner = CliRunner()
    out = _one_line_error(runner.invoke(cli, ["calibrate", str(src), "--out", str(tmp_path / "no" / "m.kvt")]), 2)
    assert "--out" in out and "does not exist" in out
    docs = tmp_path / "docs.txt"
    docs.write_text("one prompt\n")
    args = ["ingest", str(docs), "--model", "no-such-model", "--store", "memory://"]
    out = _one_line_error(runner.invoke(cli, [*args, "--report", str(tmp_path / "no" / "r.json")]), 2)
    assert "--report" in out and "does not exist" in out


@pytest.fixture
def transform_file(tmp_path, synthetic_kvt):  # noqa: ANN001, ANN201
    src, dst = _kv_file(tmp_path), tmp_path / "t.kvc"
    r = CliRunner().invoke(
        cli, ["encode", str(src), str(dst), "--transform", str(synthetic_kvt), "--sample-coder", "zstd"]
    )
    assert r.exit_code == 0, r.output
    return dst


def test_decoding_a_transform_file_without_its_kvt_says_to_give_it(tmp_path, transform_file):
    out = _one_line_error(CliRunner().invoke(cli, ["decode", str(transform_file), str(tmp_path / "o.safetensors")]), 1)
    assert out.startswith("error: ") and "--transform" in out
    assert not (tmp_path / "o.safetensors").exists()


def test_decode_transform_refuses_the_hevc_flags_it_would_ignore(tmp_path, transform_file, synthetic_kvt):
    base = ["decode", str(transform_file), str(tmp_path / "o.safetensors"), "--transform", str(synthetic_kvt)]
    for flags in (["--resolution", "999x1"], ["--nvdec-pool", "3"]):
        out = _one_line_error(CliRunner().invoke(cli, [*base, *flags]), 2)
        assert flags[0] in out
    assert not (tmp_path / "o.safetensors").exists()


def test_encode_transform_refuses_the_hevc_flags_it_would_ignore(tmp_path, synthetic_kvt):
    src, dst = _kv_file(tmp_path), tmp_path / "e.kvc"
    base = ["encode", str(src), str(dst), "--transform", str(synthetic_kvt), "--sample-coder", "zstd"]
    for flags in (
        ["--quant", "int4"],
        ["--quant", "int8"],
        ["--video-bits", "3"],
        ["--layer-bits", "2,2,2,2"],
        ["--streams-per-chunk", "2"],
        ["--resolutions", "256x256,512x512"],
    ):
        out = _one_line_error(CliRunner().invoke(cli, [*base, *flags]), 2)
        assert flags[0] in out
    assert not dst.exists()


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="needs /proc")
def test_decode_to_a_place_it_cannot_write_is_one_error_line_before_the_work(tmp_path):
    src, kvc = _kv_file(tmp_path), tmp_path / "kv.kvc"
    r = CliRunner().invoke(cli, ["encode", str(src), str(kvc), "--quant", "exact", "--sample-coder", "zstd"])
    assert r.exit_code == 0, r.output
    out = _one_line_error(CliRunner().invoke(cli, ["decode", str(kvc), "/proc/kvcodec-audit.safetensors"]), 2)
    assert "cannot write in '/proc'" in out


@pytest.fixture
def no_model_load(monkeypatch):  # noqa: ANN001, ANN201
    """Ingest must refuse bad input before the model loads: loading it fails the test."""
    import kvcodec.ingest.run

    def load(*a, **k):  # noqa: ANN002, ANN003, ANN202
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(kvcodec.ingest.run, "load_for_ingest", load)


def test_ingest_refuses_an_empty_corpus_and_a_bad_store_before_the_model_loads(tmp_path, no_model_load):
    runner = CliRunner()
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    out = _one_line_error(
        runner.invoke(cli, ["ingest", str(empty), "--model", "smollm2-135m", "--store", "memory://"]), 1
    )
    assert "no documents" in out
    docs = tmp_path / "docs.txt"
    docs.write_text("one prompt\n")
    args = ["ingest", str(docs), "--model", "smollm2-135m", "--store"]
    out = _one_line_error(runner.invoke(cli, [*args, "bogus://x"]), 2)
    assert "unknown scheme 'bogus'" in out
    out = _one_line_error(runner.invoke(cli, [*args, "redis://127.0.0.1:1/0"]), 1)  # nothing listens on port 1
    assert out.startswith("error: ") and "127.0.0.1:1" in out


def test_ingest_refuses_an_unsupported_model_before_it_loads(tmp_path, no_model_load):
    model = tmp_path / "bert"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"model_type": "bert", "architectures": ["BertModel"]}))
    docs = tmp_path / "docs.txt"
    docs.write_text("one prompt\n")
    r = CliRunner().invoke(cli, ["ingest", str(docs), "--model", str(model), "--store", f"file://{tmp_path / 's'}"])
    assert "--model" in _one_line_error(r, 2)


def test_a_jsonl_corpus_is_read_as_jsonl_whatever_the_case_of_its_suffix(tmp_path):
    from kvcodec.ingest import read_documents

    path = tmp_path / "DOCS.JSONL"
    path.write_text(json.dumps({"id": "a", "text": "hello"}) + "\n")
    assert [(d.id, d.text) for d in read_documents(path)] == [("a", "hello")]


def test_an_output_that_is_its_own_input_is_refused(tmp_path):
    # `encode kv.safetensors ./kv.safetensors` replaced the input with the .kvc
    src = _kv_file(tmp_path)
    before = src.read_bytes()
    out = _one_line_error(CliRunner().invoke(cli, ["encode", str(src), str(tmp_path / "." / src.name)]), 2)
    assert "SRC itself" in out and src.read_bytes() == before
    kvc = tmp_path / "kv.kvc"
    assert CliRunner().invoke(cli, ["encode", str(src), str(kvc), "--sample-coder", "zstd"]).exit_code == 0
    link = tmp_path / "link.safetensors"
    link.symlink_to(kvc)
    assert "SRC itself" in _one_line_error(CliRunner().invoke(cli, ["decode", str(kvc), str(link)]), 2)
    assert kvc.read_bytes()[:4] == b"KVCF"


def test_encode_and_decode_refuse_output_names_of_the_other_kind(tmp_path):
    # a coded file named .safetensors passed for a KV file (bench --kv, extract's output), a decoded one
    # named .kvc for a coded file; extract and calibrate already checked theirs
    src = _kv_file(tmp_path)
    for name in ("coded.safetensors", "coded.kvt"):
        out = _one_line_error(CliRunner().invoke(cli, ["encode", str(src), str(tmp_path / name)]), 2)
        assert "name it .kvc" in out and not (tmp_path / name).exists()
    kvc = tmp_path / "kv.kvc"
    assert CliRunner().invoke(cli, ["encode", str(src), str(kvc), "--sample-coder", "zstd"]).exit_code == 0
    out = _one_line_error(CliRunner().invoke(cli, ["decode", str(kvc), str(tmp_path / "back.kvc")]), 2)
    assert "must end in .safetensors" in out and not (tmp_path / "back.kvc").exists()


def test_calibrate_refuses_a_misspelt_text_before_the_model_loads(tmp_path, monkeypatch):
    # a held-out text (the last ones) was read only after the model had loaded and extracted the others
    import kvcodec.models

    def load(*a, **k):  # noqa: ANN002, ANN003, ANN202
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(kvcodec.models, "load_for_device", load)
    args = ["calibrate", "--model", "smollm2-135m", "--texts", "pg/apple,pg/no-such-essay", "--device", "cpu"]
    out = _one_line_error(CliRunner().invoke(cli, [*args, "--out", str(tmp_path / "m.kvt")]), 1)
    assert "pg/no-such-essay" in out


def test_inspect_of_a_foreign_safetensors_file_says_what_it_lacks(tmp_path):
    # was: not a kvcodec file: magic b'\xe8:\x00\x00' (a KV file and a .kvt are now described: test_inspect.py)
    path = tmp_path / "weights.safetensors"
    save_file({"lm_head.weight": torch.zeros(4, 4)}, str(path))
    out = _one_line_error(CliRunner().invoke(cli, ["inspect", str(path)]), 1)
    assert out.startswith("error: ") and "no tensor named 'kv'" in out and "lm_head.weight" in out


def test_serve_refuses_a_busy_port_before_the_model_loads(monkeypatch):
    import socket

    import kvcodec.engine

    def engine(*a, **k):  # noqa: ANN002, ANN003, ANN202
        raise AssertionError("the engine (and its model) was started")

    monkeypatch.setattr(kvcodec.engine, "Engine", engine)
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        args = ["serve", "--host", "127.0.0.1", "--port", str(port), "--store", "memory://", "--device", "cpu"]
        out = _one_line_error(CliRunner().invoke(cli, args), 2)
    assert "--port" in out and str(port) in out


def test_a_line_that_is_not_utf8_is_reported_not_ingested_with_its_bytes_replaced(tmp_path):
    from kvcodec.ingest import read_documents

    jsonl, prompts = tmp_path / "d.jsonl", tmp_path / "p.txt"
    jsonl.write_bytes(b'{"id": "a", "text": "caf\xe9"}\n{"id": "b", "text": "fine"}\n')
    prompts.write_bytes(b"caf\xe9\r\nfine\r\n")
    for path in (jsonl, prompts):
        docs = list(read_documents(path))
        assert docs[0].id == "line 1" and "not UTF-8" in docs[0].error, docs
        assert docs[1].error is None and docs[1].text == "fine"


def test_numbers_that_are_not_finite_or_in_range_are_refused(tmp_path, synthetic_kvt):
    src = _kv_file(tmp_path)
    runner = CliRunner()
    encode = ["encode", str(src), str(tmp_path / "e.kvc"), "--transform", str(synthetic_kvt), "--target-ratio"]
    for value in ("inf", "nan"):  # inf coded a file named ...-rinf-... at 76x
        assert "--target-ratio" in _one_line_error(runner.invoke(cli, [*encode, value]), 2)
    calibrate = ["calibrate", str(src), "--out", str(tmp_path / "m.kvt")]
    for flags in (
        ["--rope-theta", "0"],  # was ignored, as -5 and --rotary-dim 0
        ["--rope-theta", "-5"],
        ["--rotary-dim", "0"],
        ["--report-ratios", "3,nan"],  # failed after the fit
        ["--report-ratios", "3,inf"],  # measured "infx"
    ):
        assert flags[0] in _one_line_error(runner.invoke(cli, [*calibrate, *flags]), 2)
    assert not (tmp_path / "e.kvc").exists() and not (tmp_path / "m.kvt").exists()


def test_rotary_flags_that_would_be_ignored_are_refused(tmp_path):
    # files that carry their rotary settings (as extract writes them), or --model: the flags were ignored
    for s in (1, 2):
        meta = {"rope": json.dumps(ROPE.to_dict())}
        save_file({"kv": synthetic_kv(400, s)}, str(tmp_path / f"k{s}.safetensors"), metadata=meta)
    files = [str(tmp_path / "k1.safetensors"), str(tmp_path / "k2.safetensors")]
    r = CliRunner().invoke(cli, ["calibrate", *files, "--out", str(tmp_path / "m.kvt"), "--rope-theta", "500"])
    assert "--rope-theta" in _one_line_error(r, 1)
    r = CliRunner().invoke(cli, ["calibrate", "--model", "smollm2-135m", "--rotary-dim", "8", "--out", "m.kvt"])
    assert "--rotary-dim" in _one_line_error(r, 2)
    for flags, code in (  # --rope-style was ignored in all three: the files', the model's or no --rope-theta
        ([*files, "--rope-style", "interleaved"], 2),
        ([*files, "--rope-style", "interleaved", "--rope-theta", "500"], 1),
        (["--model", "smollm2-135m", "--rope-style", "half"], 2),
    ):
        r = CliRunner().invoke(cli, ["calibrate", *flags, "--out", str(tmp_path / "m.kvt")])
        assert "--rope-style" in _one_line_error(r, code)
    assert not (tmp_path / "m.kvt").exists()


def test_calibrate_names_a_kv_file_of_the_wrong_shape_before_asking_for_its_rotary_settings(tmp_path):
    # a 4-D tensor without metadata was refused for its missing rotary settings; --no-rope then said the shape
    path = tmp_path / "kv4d.safetensors"
    save_file({"kv": synthetic_kv(40, 3)[0]}, str(path))
    out = _one_line_error(CliRunner().invoke(cli, ["calibrate", str(path), "--out", str(tmp_path / "m.kvt")]), 1)
    assert "kv4d.safetensors holds KV of shape" in out and "rotary" not in out


def test_demo_refuses_bad_options_before_the_model_loads(monkeypatch):
    # an unknown text or quant failed after the model loaded; --doc-tokens below --chunk-tokens ran the
    # story and ended in "the stored fp16 KV could not be read back for the transform codec: None"
    import kvcodec.models

    def load(*a, **k):  # noqa: ANN002, ANN003, ANN202
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(kvcodec.models, "load_model", load)
    for flags, code, needle in (
        (["--text", "pg/no-such-essay"], 1, "pg/no-such-essay"),
        (["--quant", "int9"], 2, "--quant"),
        (["--doc-tokens", "64", "--chunk-tokens", "128"], 2, "--doc-tokens"),
    ):
        out = _one_line_error(CliRunner().invoke(cli, ["demo", "--device", "cpu", *flags]), code)
        assert needle in out, out


def test_decode_resolution_must_be_one_that_the_file_stores(tmp_path):
    # was: "error: file has no blob for chunk 0 at 256x144"; and of "a,b" the first was decoded silently
    src, kvc = _kv_file(tmp_path), tmp_path / "kv.kvc"
    args = ["encode", str(src), str(kvc), "--resolutions", "144x144,160x144", "--sample-coder", "zstd"]
    assert CliRunner().invoke(cli, args).exit_code == 0
    dst = str(tmp_path / "o.safetensors")
    out = _one_line_error(CliRunner().invoke(cli, ["decode", str(kvc), dst, "--resolution", "256x144"]), 2)
    assert "144x144, 160x144" in out
    out = _one_line_error(CliRunner().invoke(cli, ["decode", str(kvc), dst, "--resolution", "144x144,160x144"]), 2)
    assert "one resolution" in out
    assert CliRunner().invoke(cli, ["decode", str(kvc), dst, "--resolution", "160x144"]).exit_code == 0


def test_ingest_refuses_a_memory_store_whose_kv_would_end_with_it(tmp_path, no_model_load):
    # "1 documents: 1 stored" into a store that is gone when the command exits
    docs = tmp_path / "docs.txt"
    docs.write_text("one prompt\n")
    r = CliRunner().invoke(cli, ["ingest", str(docs), "--model", "smollm2-135m", "--store", "memory://"])
    assert "--store" in _one_line_error(r, 2)


def test_a_refused_serve_start_leaves_no_temp_store_behind(tmp_path, monkeypatch):
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    r = CliRunner().invoke(cli, ["serve", "--device", "cpu", "--quant", "int9"])
    assert "--codec" in _one_line_error(r, 2) and not list(tmp_path.iterdir())


@pytest.mark.parametrize(
    "args,names",
    [
        (["--preset", "compact"], "--preset"),  # was: "Invalid value for --codec: ... unexpected keyword 'preset'"
        (["--target-ratio", "5"], "--target-ratio"),
        (["--quant", "int99"], "--quant"),
        (["--codec-option", "nope=1"], "--codec-option nope"),
    ],
)
def test_a_serve_codec_refusal_names_the_flag_that_was_wrong(args, names):
    out = _one_line_error(CliRunner().invoke(cli, ["serve", "--device", "cpu", *args]), 2)
    assert names in out and "Invalid value for --codec:" not in out, out


@pytest.mark.skipif(importlib.util.find_spec("ray") is not None, reason="needs Ray not installed")
def test_ingest_ray_without_ray_is_refused_first(tmp_path, monkeypatch):
    # was refused only after the model check and the store had been opened
    import kvcodec.cli.serve

    def check(*a, **k):  # noqa: ANN002, ANN003, ANN202
        raise AssertionError("the model was checked first")

    monkeypatch.setattr(kvcodec.cli.serve, "check_model", check)
    docs = tmp_path / "docs.txt"
    docs.write_text("one prompt\n")
    args = ["ingest", str(docs), "--model", "smollm2-135m", "--store", f"file://{tmp_path / 's'}", "--ray", "auto"]
    assert "kvcodec[ray]" in _one_line_error(CliRunner().invoke(cli, args), 1)
    assert not (tmp_path / "s").exists()


def test_a_benchmark_given_a_damaged_or_grouped_kv_file_says_so_in_one_line(tmp_path):
    from kvcodec.kvspec.files import save_kv_file
    from kvcodec.kvspec.spec import KVSpec, LayerSpec
    from kvcodec.kvspec.tensors import GroupedKV

    damaged = tmp_path / "damaged.safetensors"
    damaged.write_bytes(_kv_file(tmp_path).read_bytes()[:100])
    out = _one_line_error(CliRunner().invoke(cli, ["bench", "encode", str(damaged)]), 1)
    assert "damaged.safetensors: not a readable safetensors KV file" in out
    spec = KVSpec((LayerSpec("full", (2, 8), (2, 8)), LayerSpec("sliding", (1, 8), (1, 8), keep=4)), "float16")
    save_kv_file(tmp_path / "grouped.safetensors", GroupedKV.empty(spec, 8, window=False), {})
    out = _one_line_error(CliRunner().invoke(cli, ["bench", "encode", str(tmp_path / "grouped.safetensors")]), 1)
    assert "a grouped KV file" in out and "give a plain KV file" in out


@pytest.mark.parametrize("rope", ["x", "[]", "{}", "null", "-1", '{"theta": 10000}', '{"theta": "a", "head_dim": 16}'])
def test_calibrate_from_kv_files_with_damaged_rope_metadata_is_one_error_line(tmp_path, rope):
    # was: a JSONDecodeError / TypeError traceback from the KV file's 'rope' metadata
    paths = []
    for seed in range(3):
        path = tmp_path / f"kv{seed}.safetensors"
        save_file({"kv": synthetic_kv(40, seed)}, str(path), metadata={"rope": rope})
        paths.append(str(path))
    r = CliRunner().invoke(cli, ["calibrate", *paths, "--out", str(tmp_path / "m.kvt"), "--report-ratios", "5"])
    out = _one_line_error(r, 1)
    assert out.startswith("error: ") and "rope" in out and not (tmp_path / "m.kvt").exists(), out


@pytest.mark.parametrize("ropes", ["x", "{}", "[]", "[null]"])
def test_calibrate_from_grouped_kv_files_with_damaged_ropes_metadata_is_one_error_line(tmp_path, ropes):
    # was: an IndexError traceback for a 'ropes' list shorter than the layers
    from kvcodec.kvspec.files import save_kv_file
    from test_grouped_file import _kv as grouped_kv

    paths = []
    for stop in (40, 41, 42):
        path = tmp_path / f"kv{stop}.safetensors"
        save_kv_file(path, grouped_kv(stop), {"ropes": ropes})
        paths.append(str(path))
    r = CliRunner().invoke(cli, ["calibrate", *paths, "--out", str(tmp_path / "m.kvt"), "--report-ratios", "5"])
    out = _one_line_error(r, 1)
    assert out.startswith("error: ") and "ropes" in out and not (tmp_path / "m.kvt").exists(), out


@pytest.mark.parametrize(
    "args,names",
    [
        (["ratio", "--chunk-tokens", "0"], "--chunk-tokens"),  # was a ValueError traceback from range()
        (["ratio", "--quants", "int99"], "--quants"),  # refused only after the whole measurement
        (["ratio", "--tag", "../../escape"], "--tag"),  # wrote outside --out
        (["baselines", "--codecs", "nosuch"], "--codecs"),  # a row of errors and exit 0
        (["baselines", "--repeat", "0"], "--repeat"),
        (["encode", "KV", "--device", "bogus"], "--device"),  # cuda without CUDA: an AssertionError traceback
        (["encode", "KV", "--tokens", "100000"], "--tokens"),  # encoded what there was and recorded 100000
    ],
)
def test_bench_refuses_bad_values_before_any_work(tmp_path, args, names):
    src = _kv_file(tmp_path)
    args = [str(src) if a == "KV" else a for a in args]
    out = _one_line_error(CliRunner().invoke(cli, ["bench", *args, "--out", str(tmp_path / "out")]), 2)
    assert names in out and not (tmp_path / "out").exists()


def test_bench_ttft_engine_prep_refuses_a_calibration_file_of_too_few_tokens(tmp_path):
    # tiled into the target's shape, 40 tokens became 4096 that held 40 distinct ones: a .kvt fitted on them
    src = _kv_file(tmp_path)
    args = ["--kv-file", str(src), "--calibrate-kv-file", str(src), "--target", "llama3-8b"]
    args += ["--methods", "kvcodec-transform-5", "--dir", str(tmp_path / "d")]
    out = _one_line_error(CliRunner().invoke(cli, ["bench", "ttft-engine", "prep", *args]), 2)
    assert "--calibrate-kv-file" in out and "40 tokens" in out and not (tmp_path / "d" / "target.kvt").exists()


def test_bench_ttft_engine_calibration_check_counts_sinks_and_warns_below_the_targets_need(capsys):
    from kvbench.ttft_engine import check_calibration_tokens, target_shape

    shape = target_shape("llama3-8b")
    kv = synthetic_kv(64, 3)  # 2 x 16 = 32 dimensions a layer: calibrate asks 64 tokens past the 4 sinks
    with pytest.raises(click.BadParameter, match="at least 68"):
        check_calibration_tokens(kv, "kv", "llama3-8b", shape)
    check_calibration_tokens(synthetic_kv(68, 3), "kv", "llama3-8b", shape)  # enough for its own, not llama3-8b's
    err = capsys.readouterr().err
    assert "warning" in err and "2052" in err


def test_an_output_over_the_kvt_or_the_corpus_is_refused(tmp_path, synthetic_kvt):
    # `decode --transform v.kvt a.kvc v.kvt` replaced the calibration every file coded with it needs;
    # `ingest corpus.jsonl --report corpus.jsonl` replaced the corpus with the summary
    kvt = tmp_path / "v.kvt"
    kvt.write_bytes(synthetic_kvt.read_bytes())
    before, src = kvt.read_bytes(), _kv_file(tmp_path)
    out = _one_line_error(CliRunner().invoke(cli, ["encode", str(src), str(kvt), "--transform", str(kvt)]), 2)
    assert "--transform" in out and kvt.read_bytes() == before
    docs = tmp_path / "corpus.jsonl"
    docs.write_text(json.dumps({"text": "hello"}) + "\n")
    args = ["ingest", str(docs), "--model", "no-such-model", "--store", "memory://", "--report", str(docs)]
    out = _one_line_error(CliRunner().invoke(cli, args), 2)
    assert "DOCS" in out and json.loads(docs.read_text()) == {"text": "hello"}


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes in read-only folders")
def test_an_output_folder_that_takes_no_files_is_refused_before_the_work(tmp_path):
    folder = tmp_path / "ro"
    folder.mkdir()
    folder.chmod(0o500)
    try:
        out = _one_line_error(
            CliRunner().invoke(cli, ["calibrate", str(_kv_file(tmp_path)), "--out", str(folder / "m.kvt")]), 2
        )
        assert "cannot write in" in out
    finally:
        folder.chmod(0o700)


def test_the_output_folder_probe_names_why_it_failed(tmp_path, monkeypatch):
    # the same check where the test runs as root (who writes anywhere): a folder whose files cannot be made
    import tempfile

    from kvcodec.cli import options

    def refuse(*a, **k):  # noqa: ANN002, ANN003, ANN202
        raise OSError(30, "Read-only file system")

    monkeypatch.setattr(tempfile, "TemporaryFile", refuse)
    with pytest.raises(click.BadParameter, match="cannot write in .*Read-only file system"):
        options.check_output_path(None, None, tmp_path / "m.kvt")


def test_fisher_options_with_kv_files_are_refused_not_ignored(tmp_path):
    src = _kv_file(tmp_path)
    for flags in (["--weights", "fisher"], ["--fisher-texts", "2"], ["--weight-alpha", "0.3"]):
        out = _one_line_error(
            CliRunner().invoke(cli, ["calibrate", str(src), "--out", str(tmp_path / "m.kvt"), *flags]), 2
        )
        assert flags[0] in out and "--model" in out
    assert not (tmp_path / "m.kvt").exists()
    files = []  # plain squared error is what KV files are fitted with: --weights mse calibrates
    for seed in (1, 2, 3):
        files.append(tmp_path / f"kv{seed}.safetensors")
        save_file({"kv": synthetic_kv(300, seed)}, str(files[-1]))
    args = ["calibrate", *map(str, files), "--out", str(tmp_path / "m.kvt"), "--weights", "mse", "--no-rope"]
    r = CliRunner().invoke(cli, [*args, "--report-ratios", "4"])
    assert r.exit_code == 0 and (tmp_path / "m.kvt").is_file(), r.output


def test_the_api_refuses_what_is_not_a_kv_tensor_with_its_own_error():
    import numpy as np

    import kvcodec
    from kvcodec.errors import ShapeError

    for kv in ([1, 2], np.zeros((2, 2, 4, 2, 8), np.float16), torch.zeros((2, 2, 4, 2, 8), device="meta")):
        with pytest.raises(ShapeError):
            kvcodec.encode(kv)
        with pytest.raises(ShapeError):
            kvcodec.make_codec("raw").encode_chunks(kv)


def test_a_huge_chunk_size_encodes_as_fast_as_the_kv_allows():
    # the frame layout counted tokens per frame down one by one from chunk_tokens: 10^8 took 147 s
    import kvcodec

    kv = synthetic_kv(32, 2).to(torch.float16)
    data = kvcodec.encode(kv, kvcodec.CodecConfig(quant="exact", chunk_tokens=10**8, sample_coder="zstd"))
    assert torch.equal(kvcodec.decode(data), kv)


def test_a_kvt_of_another_model_is_named_in_a_warning(tmp_path, synthetic_kvt):
    # a .kvt from another model of the same KV shape coded at 2.7x the error, without a word
    for model, warned in (("other-model", True), ("synthetic", False)):
        src = tmp_path / f"{model}.safetensors"
        save_file({"kv": synthetic_kv(40, 3)}, str(src), metadata={"model": model})
        r = CliRunner().invoke(cli, ["encode", str(src), str(tmp_path / "o.kvc"), "--transform", str(synthetic_kvt)])
        assert r.exit_code == 0, r.output
        assert ("calibrated on 'synthetic'" in r.output and "'other-model'" in r.output) == warned, r.output


def test_a_coded_file_given_as_the_kvt_and_a_cut_safetensors_file_say_what_they_are(tmp_path, transform_file):
    # "'utf-32-be' codec can't decode bytes"; "not a kvcodec file: magic b'p\x04\x00\x00'"
    out = _one_line_error(
        CliRunner().invoke(
            cli, ["decode", str(transform_file), str(tmp_path / "o.safetensors"), "--transform", str(transform_file)]
        ),
        1,
    )
    assert "not a .kvt transform file: it is a kvcodec KVTF object" in out
    cut = tmp_path / "cut.safetensors"
    cut.write_bytes(_kv_file(tmp_path).read_bytes()[:12])  # inside its header
    assert "a safetensors file cut short" in _one_line_error(CliRunner().invoke(cli, ["inspect", str(cut)]), 1)


@pytest.mark.skipif(importlib.util.find_spec("resource") is None, reason="needs resource limits (POSIX)")
def test_a_write_cut_short_by_the_disk_names_the_output(tmp_path):
    # "error: [Errno 27] File too large", and no word of which file
    import subprocess

    code = (
        "import resource, signal; signal.signal(signal.SIGXFSZ, signal.SIG_IGN); "
        "resource.setrlimit(resource.RLIMIT_FSIZE, (1000, 1000)); "
        "from kvcodec.atomic import write_atomic; import sys; write_atomic(sys.argv[1], b'x' * 5000)"
    )
    out = tmp_path / "big.kvc"
    r = subprocess.run([sys.executable, "-c", code, str(out)], capture_output=True, text=True, timeout=120)
    assert r.returncode != 0 and f"(writing {out})" in r.stderr, r.stderr
    assert list(tmp_path.iterdir()) == []  # nothing half-written left behind


def test_calibrate_refuses_a_holdout_it_cannot_give_instead_of_shrinking_it(tmp_path):
    # was: --holdout 5 with two KV files held out one, and with the default texts at most three, without a word
    kv, kvt = _kv_file(tmp_path), str(tmp_path / "t.kvt")
    unread = tmp_path / "unread.safetensors"
    unread.write_bytes(b"not read: the holdout is refused before the files load")
    args = ["calibrate", str(kv), str(unread), "--no-rope", "--holdout", "5", "--out", kvt]
    out = _one_line_error(CliRunner().invoke(cli, args), 2)
    assert "--holdout" in out and "at least one must be fitted" in out
    args = ["calibrate", "--model", "smollm2-135m", "--holdout", "4", "--out", kvt]
    out = _one_line_error(CliRunner().invoke(cli, args), 2)
    assert "--holdout" in out and "give --texts" in out


def test_a_usage_error_imports_neither_torch_nor_other_subcommands():
    """`kvcodec encode --nope` imported every subcommand's module and, through the package root,
    torch: seconds for a one-line error (tens of seconds on a loaded machine)."""
    import subprocess
    import sys

    script = (
        "import sys\n"
        "from kvcodec.cli.main import main\n"
        "sys.argv = ['kvcodec', 'encode', '--nope']\n"
        "try:\n    main()\nexcept SystemExit as e:\n    code = e.code\n"
        "print(code, 'torch' in sys.modules, 'kvcodec.cli.calibrate' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert out.stdout.split() == ["2", "False", "False"], (out.stdout, out.stderr)


def test_the_command_listing_is_each_commands_own_short_help_and_imports_none_of_them():
    import subprocess
    import sys

    import click

    from kvcodec.cli.main import SUBCOMMANDS, SUMMARIES

    ctx = click.Context(cli)
    assert set(SUMMARIES) == set(SUBCOMMANDS)
    for name, summary in SUMMARIES.items():
        assert summary == cli.get_command(ctx, name).get_short_help_str(limit=10**6), name
    code = (
        "import sys; from click.testing import CliRunner; from kvcodec.cli.main import cli; "
        "out = CliRunner().invoke(cli, ['--help']).output; "
        "assert 'calibrate' in out and 'serve' in out, out; "
        "print(sorted(m for m in sys.modules if m == 'torch' or m.startswith('kvcodec.cli.') or m == 'kvbench.cli'))"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "['kvcodec.cli.main', 'kvcodec.cli.program']", r.stdout + r.stderr


def test_a_kvt_given_as_the_kv_to_encode_is_named_as_such(tmp_path, synthetic_kvt):
    r = CliRunner().invoke(cli, ["encode", str(synthetic_kvt), str(tmp_path / "o.kvc")])
    assert r.exit_code != 0 and "transform calibration (.kvt), not a KV file" in r.output, r.output
    assert "Traceback" not in r.output and "g0." not in r.output  # not its tensors' names
