"""calibrate --model fits on the running moments of each text's KV as it is extracted (the KV is not
held): the streamed fit must be the fit on all the KV at once, byte for byte."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

from kvcodec.errors import ConfigError, ShapeError  # noqa: E402
from kvcodec.transform import calibrate  # noqa: E402
from kvcodec.transform.calibration import StreamedCalibration, streamed_token_count  # noqa: E402
from kvcodec.transform.kvt import to_bytes  # noqa: E402
from kvcodec.transform.rope import RopeSpec  # noqa: E402

L, H, D = 4, 2, 8


def _kvs(lengths, seed):
    g = torch.Generator().manual_seed(seed)
    mix = torch.randn(L * 2 * H * D, L * 2 * H * D, generator=g) / 8
    return [
        (torch.randn(t, L * 2 * H * D, generator=g) @ mix).reshape(t, L, 2, H, D).permute(1, 2, 0, 3, 4)
        for t in lengths
    ]


@pytest.mark.parametrize("weighted", [False, True])
def test_streamed_calibration_is_the_calibration_on_all_the_kv(weighted):
    rope = RopeSpec(10000.0, D)
    kvs, held = _kvs([300, 170, 260], 0), _kvs([120], 1)
    w = torch.rand(L, 2, H, D, generator=torch.Generator().manual_seed(2)) + 0.1 if weighted else None
    settings = dict(sink_tokens=4, tokens_per_dim=20.0)
    whole = calibrate(kvs, rope, weights=w, info={"model": "m"}, held_out=held, **settings)
    tokens = streamed_token_count([k.shape[2] for k in kvs], 4)
    stream = StreamedCalibration((L, H, D), rope, tokens=tokens, **settings)
    for k in kvs:
        stream.add(k)
    streamed = stream.finish(weights=w, info={"model": "m"}, held_out=held)
    assert streamed.groups == whole.groups and len(whole.groups) > 1
    assert streamed.info == whole.info
    assert to_bytes(streamed) == to_bytes(whole)


def test_streamed_calibration_refuses_a_miscount_and_other_shapes():
    kvs = _kvs([100, 100], 3)
    stream = StreamedCalibration((L, H, D), None, tokens=streamed_token_count([100, 100]) + 1)
    with pytest.raises(ShapeError):
        stream.add(kvs[0][:, :, :, :1])
    for k in kvs:
        stream.add(k)
    with pytest.raises(ConfigError, match="counted"):
        stream.finish()


TEXTS = ["pg/aord", "py/textwrap", "doc/pathlib"]


def _calibrate_cli(tmp_path, max_tokens: int, *options: str, name: str = "m"):  # noqa: ANN202 - a Calibration
    """The calibration `kvcodec calibrate --model smollm2-135m` (streamed) fits on TEXTS with `options`
    (cal.info["output"]: what the command printed)."""
    from click.testing import CliRunner

    from kvcodec.cli.calibrate import command
    from kvcodec.transform import load_kvt

    out = tmp_path / f"{name}.kvt"
    args = ["--model", "smollm2-135m", "--texts", ",".join(TEXTS), "--holdout", "0", "--max-tokens", str(max_tokens)]
    res = CliRunner().invoke(command, [*args, *options, "--tokens-per-dim", "2", "--out", str(out)])
    assert res.exit_code == 0, res.output
    cal = load_kvt(out)[0]
    cal.info["output"] = res.output
    return cal


def test_calibrate_model_streams_the_same_transform_as_the_held_kv(tmp_path):
    """`calibrate --model --device cpu` (streamed moments) writes the bases calibrate() fits on the KV held
    whole, with the model as load_model gives it (on the CPU, as calibrate ran before --device)."""
    from kvcodec.cli.calibrate import _kv_from_model
    from kvcodec.models import load_model
    from kvcodec.models.check import inspect_model

    streamed = _calibrate_cli(tmp_path, 256, "--weights", "mse", "--device", "cpu")
    assert "s on cpu (float32)" in streamed.info["output"]
    layout = inspect_model("smollm2-135m")
    model, tok = load_model("smollm2-135m")
    kvs = _kv_from_model(model, tok, layout, TEXTS, 256)[0]
    whole = calibrate(kvs, layout.uniform_rope, tokens_per_dim=2.0)
    assert streamed.groups == whole.groups and streamed.info["tokens"] == whole.info["tokens"]
    for key, b in whole.bases.items():
        assert torch.equal(streamed.bases[key].basis, b.basis) and torch.equal(streamed.bases[key].mean, b.mean)


def test_streamed_calibration_with_fisher_weights_is_the_held_one(tmp_path):
    """The streamed path runs the Fisher first, on prefixes it prefills itself (the held path hands it
    the extraction's prefix KV): the same weights, so the same bases."""
    from kvcodec.cli.calibrate import _fisher, _kv_from_model
    from kvcodec.models import load_model
    from kvcodec.models.check import inspect_model
    from kvcodec.transform.weights import channel_weights

    streamed = _calibrate_cli(tmp_path, 600, "--fisher-texts", "1", "--device", "cpu")
    layout = inspect_model("smollm2-135m")
    rope = layout.uniform_rope
    model, tok = load_model("smollm2-135m")
    kvs, _, ids, prefixes = _kv_from_model(model, tok, layout, TEXTS, 600, keep=1)
    w = channel_weights(
        _fisher(model, ids, 4, 1, prefixes), rope_style=rope.style, rotary_dim=rope.rotary_dim, alpha=1.0
    )
    whole = calibrate(kvs, rope, weights=w, tokens_per_dim=2.0)
    assert streamed.info["weights"] == "fisher"
    for key, b in whole.bases.items():
        assert torch.equal(streamed.bases[key].basis, b.basis) and torch.equal(streamed.bases[key].weights, b.weights)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the default device is the GPU here")
def test_calibrate_model_runs_on_the_cpu_by_default_without_cuda_and_says_so(tmp_path):
    """No --device and no CUDA: the CPU, stated in the result line and the .kvt, the same bases as --device cpu."""
    default = _calibrate_cli(tmp_path, 256, "--weights", "mse", name="default")
    cpu = _calibrate_cli(tmp_path, 256, "--weights", "mse", "--device", "cpu", name="cpu")
    assert "s on cpu (float32), peak RSS" in default.info["output"]
    assert default.info["calibration_cost"]["device"] == "cpu"
    assert default.info["calibration_cost"]["dtype"] == "float32"
    assert default.groups == cpu.groups
    for key, b in cpu.bases.items():
        assert torch.equal(default.bases[key].basis, b.basis) and torch.equal(default.bases[key].mean, b.mean)
