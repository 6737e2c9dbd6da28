"""`kvcodec calibrate --model --device`: a bad device fails before the model loads, the default is
stated, the model loads through kvcodec.models.load_for_device (float32 weights as float16 for a GPU:
tests/test_models_placement.py), a GPU out-of-memory error names --device cpu, and
KV streamed on a GPU fits what it fits on the CPU. The model runs themselves are in
test_calibration_stream.py (--device cpu there equals the calibration computed in-process)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
from click.testing import CliRunner  # noqa: E402

from kvcodec.cli import calibrate as cal_cli  # noqa: E402
from kvcodec.errors import ConfigError  # noqa: E402


def _no_load(*a, **k):  # noqa: ANN002, ANN003, ANN202
    raise AssertionError("the model must not load")


@pytest.mark.parametrize(
    ("device", "message"),
    [("mps", "only cpu and cuda"), ("gpu0", "is not a device"), ("cuda:7", "CUDA is not available")],
)
def test_a_bad_device_is_a_usage_error_before_the_model_loads(tmp_path, monkeypatch, device, message):
    if device.startswith("cuda") and torch.cuda.is_available():
        pytest.skip("this machine has CUDA")
    monkeypatch.setattr("kvcodec.models.load_for_device", _no_load)
    monkeypatch.setattr("kvcodec.models.check.inspect_model", _no_load)
    args = ["--model", "smollm2-135m", "--device", device, "--out", str(tmp_path / "m.kvt")]
    res = CliRunner().invoke(cal_cli.command, args)
    assert res.exit_code == 2, res.output
    assert "--device" in res.output and message in res.output


def test_device_needs_a_model(tmp_path):
    kv = tmp_path / "a.safetensors"
    kv.write_bytes(b"x")
    res = CliRunner().invoke(cal_cli.command, [str(kv), "--device", "cpu", "--out", str(tmp_path / "m.kvt")])
    assert res.exit_code == 2 and "--device needs --model" in res.output


def test_the_default_device_is_cuda_where_present_else_cpu():
    want = "cuda" if torch.cuda.is_available() else "cpu"
    assert cal_cli.resolve_device(None).type == want
    assert cal_cli.resolve_device("cpu") == torch.device("cpu")


class _Loaded(Exception):
    pass


@pytest.mark.parametrize(
    "device",
    ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"))],
)
def test_the_model_loads_through_load_for_device_on_the_chosen_device(tmp_path, monkeypatch, device):
    """calibrate --model loads as the engine does (kvcodec.models.load_for_device: float32 weights as
    float16 on a GPU, tests/test_models_placement.py), on the --device it resolved."""
    calls = []

    def record(name, device, **kw):  # noqa: ANN003, ANN202
        calls.append((name, device, kw))
        raise _Loaded

    monkeypatch.setattr("kvcodec.models.load_for_device", record)
    args = ["--model", "smollm2-135m", "--device", device, "--out", str(tmp_path / "m.kvt")]
    res = CliRunner().invoke(cal_cli.command, args)
    if not calls and "needs the PyPI package" in str(res.exception):  # the model check runs before the load
        pytest.skip(f"model smollm2-135m unavailable: {res.exception}")
    assert isinstance(res.exception, _Loaded), res.output
    assert calls == [("smollm2-135m", torch.device(device), {})]


def test_a_gpu_out_of_memory_error_names_the_cpu_fix(monkeypatch):
    class Props:
        total_memory = 24 * 2**30

    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda d: Props())
    oom = pytest.raises(ConfigError, match=r"out of memory on cuda:0 \(24 GiB\).*--device cpu")
    with oom, cal_cli.gpu_memory_hint(torch.device("cuda:0"), "m"):
        raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
    with pytest.raises(torch.cuda.OutOfMemoryError), cal_cli.gpu_memory_hint(torch.device("cpu"), "m"):
        raise torch.cuda.OutOfMemoryError("x")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_moments_streamed_on_a_gpu_fit_the_cpu_bases():
    """StreamedCalibration of KV on a GPU (sums and eigendecompositions there) gives the CPU's fit up to
    rounding, with everything it returns on the CPU."""
    from kvcodec.transform.calibration import StreamedCalibration, streamed_token_count
    from kvcodec.transform.rope import RopeSpec

    g = torch.Generator().manual_seed(0)
    layers, heads, dim = 4, 2, 16
    mix = torch.randn(layers * 2 * heads * dim, layers * 2 * heads * dim, generator=g) / 8
    kvs = [
        (torch.randn(t, mix.shape[0], generator=g) @ mix).reshape(t, layers, 2, heads, dim).permute(1, 2, 0, 3, 4)
        for t in (300, 260)
    ]
    held = [kvs[1][:, :, :100].contiguous()]
    w = torch.rand(layers, 2, heads, dim, generator=g) + 0.1
    rope = RopeSpec(10000.0, dim)
    fits = {}
    for dev in ("cpu", "cuda"):
        stream = StreamedCalibration((layers, heads, dim), rope, tokens=streamed_token_count([300, 260]))
        for k in kvs:
            stream.add(k.to(dev, torch.float16))
        fits[dev] = stream.finish(weights=w, held_out=held)
    a, b = fits["cpu"], fits["cuda"]
    assert a.groups == b.groups and a.info["fallback"] == b.info["fallback"]
    for key, x in a.bases.items():
        y = b.bases[key]
        assert y.basis.device.type == "cpu" and y.mean.device.type == "cpu"
        assert torch.allclose(x.variances, y.variances, rtol=1e-3, atol=1e-3 * float(x.variances[0]))
        assert torch.allclose(x.mean, y.mean, atol=1e-3)
