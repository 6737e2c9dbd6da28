import json

import torch
from click.testing import CliRunner
from safetensors.torch import load_file, save_file

from kvcodec.cli.main import cli


def test_encode_inspect_decode_round_trip(tmp_path):
    kv = (torch.randn(2, 2, 30, 2, 16) * 3).to(torch.bfloat16)
    save_file({"kv": kv}, str(tmp_path / "kv.safetensors"))
    runner = CliRunner()
    r = runner.invoke(
        cli,
        [
            "encode",
            str(tmp_path / "kv.safetensors"),
            str(tmp_path / "kv.kvc"),
            "--quant",
            "exact",
            "--chunk-tokens",
            "16",
            "--resolutions",
            "144x144,160x144",
        ],
    )
    assert r.exit_code == 0, r.output
    assert "2 chunks x 2 resolutions" in r.output
    r = runner.invoke(cli, ["inspect", str(tmp_path / "kv.kvc"), "--json"])
    assert r.exit_code == 0, r.output
    info = json.loads(r.output)
    assert info["shape"] == [2, 2, 30, 2, 16] and set(info["resolutions"]) == {"144x144", "160x144"}
    r = runner.invoke(cli, ["inspect", str(tmp_path / "kv.kvc")])
    assert "quant       exact" in r.output
    r = runner.invoke(
        cli, ["decode", str(tmp_path / "kv.kvc"), str(tmp_path / "out.safetensors"), "--resolution", "160x144"]
    )
    assert r.exit_code == 0, r.output
    out = load_file(str(tmp_path / "out.safetensors"))["kv"]
    assert torch.equal(out.view(torch.int16), kv.view(torch.int16))


def test_cli_errors_are_one_clear_line(tmp_path):
    bad = tmp_path / "notkv.safetensors"
    save_file({"x": torch.zeros(3)}, str(bad))
    runner = CliRunner()
    r = runner.invoke(cli, ["encode", str(bad), str(tmp_path / "o.kvc")])
    assert r.exit_code == 1 and r.output.startswith("error: ") and "no tensor named 'kv'" in r.output
    junk = tmp_path / "junk.kvc"
    junk.write_bytes(b"KVCF" + b"\x01\x00" + b"\xff" * 20)
    r = runner.invoke(cli, ["inspect", str(junk)])
    assert r.exit_code == 1 and r.output.startswith("error: ") and r.exception.__class__ is SystemExit
    r = runner.invoke(cli, ["encode", str(bad), str(tmp_path / "o.kvc"), "--resolutions", "big"])
    assert r.exit_code == 2 and "WIDTHxHEIGHT" in r.output


def _error_line(r) -> str:  # noqa: ANN001
    """The one line naming what was wrong (click prints usage lines before it, never a traceback)."""
    assert isinstance(r.exception, SystemExit) and "Traceback" not in r.output, r.output
    return [ln for ln in r.output.splitlines() if ln.lower().startswith("error")][-1]


def test_cli_misuse_ends_in_one_line_errors(tmp_path):
    import torch as t

    good = tmp_path / "kv.safetensors"
    save_file({"kv": t.randn(2, 2, 20, 2, 16).half()}, str(good))
    garbage = tmp_path / "garbage.safetensors"
    garbage.write_bytes(b"\x00garbage" * 10)
    out = str(tmp_path / "o.kvc")
    runner = CliRunner()
    cases = [
        (["encode", str(good), out, "--layer-bits", "a,b"], 2, "--layer-bits"),
        (["encode", str(garbage), out], 2, "not a readable safetensors file"),
        (["encode", str(good), str(tmp_path / "missing" / "o.kvc")], 2, "does not exist"),
        (["encode", str(good), out, "--resolutions", "16384x16384"], 2, "8192"),
        (["encode", str(good), out, "--layer-bits", "9,9", "--resolutions", "144x144"], 1, "layer_bits"),
        (["decode", str(good), str(tmp_path / "o.safetensors"), "--device", "banana"], 2, "not a device"),
        (["inspect", str(garbage)], 1, "kvcodec file"),
        (["serve", "--store", "bogus://x"], 2, "unknown scheme"),
        (["serve", "--device", "banana"], 2, "not a device"),
        (["serve", "--fetch-deadline", "-1"], 2, "--fetch-deadline"),
    ]
    if not t.cuda.is_available():
        cases.append((["decode", str(good), str(tmp_path / "o.safetensors"), "--device", "cuda"], 2, "CUDA"))
    for args, code, words in cases:
        r = runner.invoke(cli, args)
        assert r.exit_code == code, (args, r.output)
        assert words in _error_line(r), (args, r.output)


def test_encode_video_bits_option_is_recorded_and_decodes_to_the_same_values(tmp_path):
    kv = (torch.randn(2, 2, 64, 2, 64) * 2).to(torch.float16)
    save_file({"kv": kv}, str(tmp_path / "kv.safetensors"))
    runner = CliRunner()
    outs = {}
    for bits in ("8", "3"):
        r = runner.invoke(
            cli,
            [
                "encode",
                str(tmp_path / "kv.safetensors"),
                str(tmp_path / f"kv{bits}.kvc"),
                "--resolutions",
                "144x144",
                "--video-bits",
                bits,
            ],
        )
        assert r.exit_code == 0, r.output
        info = json.loads(runner.invoke(cli, ["inspect", str(tmp_path / f"kv{bits}.kvc"), "--json"]).output)
        assert info["resolutions"]["144x144"]["video_bits"] == int(bits) and info["format_version"] == 2
        r = runner.invoke(cli, ["decode", str(tmp_path / f"kv{bits}.kvc"), str(tmp_path / f"out{bits}.safetensors")])
        assert r.exit_code == 0, r.output
        outs[bits] = load_file(str(tmp_path / f"out{bits}.safetensors"))["kv"]
    assert torch.equal(outs["8"], outs["3"])
    r = runner.invoke(cli, ["decode", str(tmp_path / "kv3.kvc"), str(tmp_path / "o.safetensors"), "--nvdec-pool", "2"])
    assert r.exit_code != 0 and "--nvdec-pool needs --device cuda" in r.output
