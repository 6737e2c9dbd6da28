import json

import torch
from click.testing import CliRunner
from safetensors.torch import load_file, save_file

from kvcodec.cli.main import cli
from kvcodec.kvspec import GroupedKV, KVSpec, LayerSpec
from kvcodec.kvspec.files import save_kv_file


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
    grouped = tmp_path / "grouped.safetensors"  # as extract writes for a sliding-window model
    spec = KVSpec((LayerSpec("sliding", (2, 8), (2, 8), keep=4), LayerSpec("full", (2, 8), (2, 8))), "float16")
    save_kv_file(grouped, GroupedKV.empty(spec, 8), {})
    out = str(tmp_path / "o.kvc")
    runner = CliRunner()
    cases = [
        (["encode", str(good), out, "--layer-bits", "a,b"], 2, "--layer-bits"),
        (["encode", str(garbage), out], 2, "not a readable safetensors KV file"),
        (["encode", str(grouped), out], 1, "encode it with --transform"),
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


def test_encode_streams_per_chunk_splits_chunks_and_inspect_shows_the_parts(tmp_path):
    kv = (torch.randn(4, 2, 40, 2, 64) * 2).to(torch.float16)
    save_file({"kv": kv}, str(tmp_path / "kv.safetensors"))
    runner = CliRunner()
    assert "slower on the H200" in " ".join(runner.invoke(cli, ["encode", "--help"]).output.split())
    outs = {}
    for n in ("1", "2"):
        dst = str(tmp_path / f"kv{n}.kvc")
        args = ["encode", str(tmp_path / "kv.safetensors"), dst, "--chunk-tokens", "32", "--resolutions", "144x144"]
        r = runner.invoke(cli, [*args, "--streams-per-chunk", n, "--video-bits", "8", "--sample-coder", "hevc"])
        assert r.exit_code == 0, r.output
        info = json.loads(runner.invoke(cli, ["inspect", dst, "--json"]).output)
        res = info["resolutions"]["144x144"]
        assert info["config"].get("streams_per_chunk", 1) == int(n)
        assert [p["layers"] for p in res.get("parts", [{"layers": 4}])] == ([4] if n == "1" else [2, 2])
        text = runner.invoke(cli, ["inspect", dst]).output
        assert ("2 streams per chunk" in text) == (n == "2"), text
        r = runner.invoke(cli, ["decode", dst, str(tmp_path / f"out{n}.safetensors")])
        assert r.exit_code == 0, r.output
        outs[n] = load_file(str(tmp_path / f"out{n}.safetensors"))["kv"]
    assert "part 0: layers 0-1, " in text and "part 1: layers 2-3, " in text and "tiles" in text, text
    assert torch.equal(outs["1"], outs["2"])
    r = runner.invoke(cli, [*args, "--streams-per-chunk", "2", "--sample-coder", "zstd"])
    text = runner.invoke(cli, ["inspect", dst]).output
    assert r.exit_code == 0 and "2 streams per chunk, samples zstd-coded (no video)" in text, text
    assert "part 1: layers 2-3\n" in text and "tiles" not in text and "frames" not in text, text  # no video described
    r = runner.invoke(cli, ["encode", str(tmp_path / "kv.safetensors"), dst, "--streams-per-chunk", "0"])
    assert r.exit_code == 2 and "--streams-per-chunk" in _error_line(r)


def test_inspect_shows_the_layout_when_the_first_chunk_is_stored_plain(tmp_path):
    g = torch.Generator().manual_seed(0)
    kv = torch.zeros(2, 2, 64, 2, 64, dtype=torch.float16)
    noise = torch.randint(-32768, 32767, (2, 2, 32, 2, 64), generator=g, dtype=torch.int16)
    kv[:, :, :32] = noise.view(torch.float16)  # incompressible: the first chunk is stored plain
    kv[:, :, 32:] = torch.linspace(0, 1, 32).view(1, 1, 32, 1, 1).half()
    save_file({"kv": kv}, str(tmp_path / "kv.safetensors"))
    runner = CliRunner()
    dst = str(tmp_path / "kv.kvc")
    args = [
        "encode",
        str(tmp_path / "kv.safetensors"),
        dst,
        "--quant",
        "exact",
        "--chunk-tokens",
        "32",
        "--sample-coder",
        "hevc",
    ]
    assert runner.invoke(cli, [*args, "--resolutions", "144x144"]).exit_code == 0
    res = json.loads(runner.invoke(cli, ["inspect", dst, "--json"]).output)["resolutions"]["144x144"]
    assert res["plain_chunks"] == 1 and res["layout"]["tile_w"] > 0 and res["frames_per_chunk"] >= 1
    text = runner.invoke(cli, ["inspect", dst]).output
    assert "tiles" in text and "1 of 2 chunks plain" in text, text


def test_serve_sdpa_backends_reach_the_engine_config(monkeypatch):
    import kvcodec.engine
    import kvcodec.server
    from kvcodec.engine.config import EngineConfig

    seen = []

    def fake_engine(model, **kwargs):  # noqa: ANN001, ANN202
        seen.append(EngineConfig.from_kwargs(**kwargs).sdpa_backends)  # the config the engine would run with
        return object()

    monkeypatch.setattr(kvcodec.engine, "Engine", fake_engine)
    monkeypatch.setattr(kvcodec.server, "serve", lambda *a, **k: None)
    runner = CliRunner()
    for value, want in (
        (None, ("flash", "efficient", "math")),
        ("default", None),
        ("math", ("math",)),
        ("cudnn, flash", ("cudnn", "flash")),
    ):
        extra = [] if value is None else ["--sdpa-backends", value]
        r = runner.invoke(cli, ["serve", "--store", "memory://", "--device", "cpu", *extra])
        assert r.exit_code == 0, r.output
        assert seen[-1] == want, (value, seen)
    r = runner.invoke(cli, ["serve", "--store", "memory://", "--sdpa-backends", "flash,fast"])
    assert r.exit_code == 2 and "--sdpa-backends" in _error_line(r) and "cudnn" in _error_line(r)
    assert "cuDNN" in runner.invoke(cli, ["serve", "--help"]).output


def test_encode_without_a_sample_coder_uses_the_codec_default_and_inspect_names_what_the_chunks_hold(tmp_path):
    kv = (torch.randn(2, 2, 64, 2, 64) * 2).to(torch.float16)
    save_file({"kv": kv}, str(tmp_path / "kv.safetensors"))
    runner = CliRunner()
    for coder in (None, "hevc"):
        dst = tmp_path / f"kv-{coder}.kvc"
        args = ["encode", str(tmp_path / "kv.safetensors"), str(dst), "--resolutions", "144x144"]
        assert runner.invoke(cli, args + (["--sample-coder", coder] if coder else [])).exit_code == 0
        info = json.loads(runner.invoke(cli, ["inspect", str(dst), "--json"]).output)
        streams = info["resolutions"]["144x144"]["streams"]
        text = runner.invoke(cli, ["inspect", str(dst)]).output
        if coder is None:  # the default, auto: random values are smaller zstd-coded than as video
            assert info["config"]["sample_coder"] == "auto" and "samples" in streams and "video" not in streams
            assert "samples zstd-coded (no video)" in text and "auto, chosen per model" in text
        else:
            assert info["config"]["sample_coder"] == "hevc" and "video" in streams and "in the video" in text


def test_encode_warns_of_resolutions_that_store_the_same_zstd_coded_samples(tmp_path):
    """With zstd-coded samples a frame size changes nothing: a second resolution doubled the file silently."""
    save_file({"kv": (torch.randn(4, 2, 40, 2, 64) * 2).to(torch.float16)}, str(tmp_path / "kv.safetensors"))
    args = ["encode", str(tmp_path / "kv.safetensors"), str(tmp_path / "kv.kvc"), "--sample-coder"]
    r = CliRunner().invoke(cli, [*args, "zstd", "--resolutions", "144x144,256x256"])
    assert r.exit_code == 0 and "the 2 resolutions store them as many times" in r.output, r.output
    r = CliRunner().invoke(cli, [*args, "zstd", "--resolutions", "144x144"])
    assert r.exit_code == 0 and "warning" not in r.output, r.output
