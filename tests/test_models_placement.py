"""kvcodec.models.load_for_device: one rule for every loader (the engine, ingest, calibrate): float32
weights run as float16 anywhere but on the CPU, loaded in that dtype (from_pretrained's dtype, not a
cast after loading float32: half the peak host memory), other dtypes stay, RoPE's float32 inv_freq
stays float32. The "meta" device stands in for a GPU (a real device that is not the CPU, no GPU
needed); the CUDA decision itself is checked purely (run_dtype). from_pretrained is wrapped only to
record the dtype it is asked for; the models are real (SmolLM2 from its PyPI package, small
random-weight Llama folders)."""

from __future__ import annotations

import json
import shutil

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
from hypothesis import given  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from kvcodec.models.placement import load_for_device, run_dtype, weights_dtype  # noqa: E402

DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@given(
    own=st.sampled_from((*DTYPES, None)),
    device=st.sampled_from(("cpu", "cuda", "cuda:1", "meta")),
    asked=st.sampled_from((*DTYPES, None)),
)
def test_float32_weights_run_as_float16_off_the_cpu_and_nothing_else_changes(own, device, asked):
    got = run_dtype(own, torch.device(device) if device != "cuda:1" else device, asked)
    if asked is not None:
        assert got == asked  # an explicit dtype always wins
    elif device == "cpu" or own != torch.float32:
        assert got == own  # the CPU, and every dtype but float32, keep the model's own
    else:
        assert got == torch.float16


def test_the_weights_dtype_is_known_before_loading(tmp_path):
    assert weights_dtype("smollm2-135m") == torch.float32  # a dequantized GGUF
    assert weights_dtype(str(tmp_path / "model.Q4_K_M.gguf")) == torch.float32
    assert weights_dtype(str(tmp_path / "absent")) is None  # load_model says what is wrong
    cases = [({"dtype": "float32"}, torch.float32), ({"torch_dtype": "float32"}, torch.float32),
             ({"dtype": "bfloat16"}, torch.bfloat16), ({"dtype": "float16"}, torch.float16),
             ({"dtype": "auto"}, None), ({"dtype": "Size"}, None), ({}, None)]  # fmt: skip
    for i, (config, want) in enumerate(cases):
        folder = tmp_path / f"m{i}"
        folder.mkdir()
        (folder / "config.json").write_text(json.dumps(config))
        assert weights_dtype(str(folder)) == want, config
    (tmp_path / "bad").mkdir()
    (tmp_path / "bad" / "config.json").write_text("[1")
    assert weights_dtype(str(tmp_path / "bad")) is None


@pytest.fixture
def asked(monkeypatch):
    """The dtype argument of every AutoModelForCausalLM.from_pretrained call, in order."""
    calls = []
    real = transformers.AutoModelForCausalLM.from_pretrained

    def record(*args, **kwargs):  # noqa: ANN002, ANN003, ANN202
        calls.append(kwargs.get("dtype"))
        return real(*args, **kwargs)

    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", record)
    return calls


def _rope(model) -> dict:
    return {n: b for n, b in model.named_buffers() if n.endswith("inv_freq")}


def _check(model, device: str, dtype) -> None:
    assert not model.training
    assert {p.dtype for p in model.parameters()} == {dtype}
    assert {p.device.type for p in model.parameters()} == {device}
    rope = _rope(model)
    assert rope and all(b.dtype == torch.float32 and b.device.type == device for b in rope.values())


def test_a_registered_model_loads_as_float16_for_a_gpu_and_as_float32_on_the_cpu(smollm2, asked):
    fp32, _ = smollm2
    model, tok = load_for_device("smollm2-135m", "meta")
    assert asked == [torch.float16]  # loaded as float16, not loaded float32 then cast
    _check(model, "meta", torch.float16)
    assert tok is not None
    model, _ = load_for_device("smollm2-135m", "cpu")
    assert asked[1:] == [torch.float32]  # the CPU: as load_model(name) loads it
    _check(model, "cpu", torch.float32)
    model, _ = load_for_device("smollm2-135m", "cpu", dtype=torch.float16)
    assert asked[2:] == [torch.float16]
    _check(model, "cpu", torch.float16)
    want = _rope(fp32)
    assert all(torch.equal(b, want[n]) for n, b in _rope(model).items())  # exactly the float32 frequencies
    assert any(not torch.equal(b.half().float(), b) for b in want.values())  # which float16 would round


@pytest.fixture(scope="module")
def llama_dir(random_model_dirs):
    """A small random-weight Llama model folder (float32), SmolLM2's tokenizer beside it."""
    config = transformers.LlamaConfig(
        vocab_size=49152,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
    )
    return random_model_dirs({"llama": config}, seed=3000)["llama"]


def _folder(llama_dir, tmp_path, dtype: str | None, weights=None):
    """A copy of llama_dir whose config says `dtype` (None: says none), its weights in `weights`."""
    folder = tmp_path / f"m-{dtype}"
    shutil.copytree(llama_dir, folder)
    if weights is not None:
        transformers.AutoModelForCausalLM.from_pretrained(str(folder), dtype=weights).save_pretrained(str(folder))
    path = folder / "config.json"
    config = json.loads(path.read_text())
    config.pop("torch_dtype", None)
    config.pop("dtype", None)
    if dtype is not None:
        config["dtype"] = dtype
    path.write_text(json.dumps(config))
    return str(folder)


def test_a_model_folder_keeps_its_dtype_and_float32_loads_as_float16_for_a_gpu(llama_dir, tmp_path, asked):
    fp32, bf16 = _folder(llama_dir, tmp_path, "float32"), _folder(llama_dir, tmp_path, "bfloat16", torch.bfloat16)
    asked.clear()
    model, _ = load_for_device(fp32, "meta")
    assert asked == [torch.float16]
    _check(model, "meta", torch.float16)
    model, _ = load_for_device(bf16, "meta")
    assert asked[1:] == ["auto"]  # its own dtype
    _check(model, "meta", torch.bfloat16)
    model, _ = load_for_device(fp32, "cpu")
    assert asked[2:] == ["auto"]  # the CPU: as load_model(folder) loads it
    _check(model, "cpu", torch.float32)


def test_a_folder_whose_config_names_no_dtype_is_cast_after_loading(llama_dir, tmp_path, asked):
    folder = _folder(llama_dir, tmp_path, None)
    want = _rope(transformers.AutoModelForCausalLM.from_pretrained(llama_dir, dtype=torch.float32))
    asked.clear()
    model, _ = load_for_device(folder, "cpu", dtype=None)
    assert asked == ["auto"]
    _check(model, "cpu", torch.float32)
    model, _ = load_for_device(folder, "meta")  # its weights' dtype is known only once loaded
    _check(model, "meta", torch.float16)
    from kvcodec.models.placement import place_model

    model = place_model(transformers.AutoModelForCausalLM.from_pretrained(folder), "cpu", torch.float16)
    _check(model, "cpu", torch.float16)
    assert all(torch.equal(b, want[n]) for n, b in _rope(model).items())


@pytest.mark.slow
def test_a_gguf_file_loads_as_float16_for_a_gpu(asked):
    from kvcodec.errors import ConfigError
    from kvcodec.models import gguf_path

    try:
        path = gguf_path("smollm2-135m")
    except ConfigError as e:
        pytest.skip(str(e))
    model, tok = load_for_device(str(path), "meta")  # dequantized straight to float16 (~30 s)
    assert asked == [torch.float16]
    _check(model, "meta", torch.float16)
    assert tok is not None


def test_the_engine_and_ingest_load_a_name_through_load_for_device(smollm2, asked):
    """A call site that loaded float32 and cast after would ask from_pretrained for float32 here."""
    from kvcodec.engine.engine import _load
    from kvcodec.ingest.run import load_for_ingest

    model, tok = _load("smollm2-135m", None, torch.device("meta"), None)
    assert asked == [torch.float16] and tok is not None
    _check(model, "meta", torch.float16)
    model, _ = _load("smollm2-135m", None, torch.device("cpu"), torch.float16)  # EngineConfig.dtype
    assert asked[1:] == [torch.float16]
    _check(model, "cpu", torch.float16)
    model, tok, dev = load_for_ingest("smollm2-135m", "meta")
    assert asked[2:] == [torch.float16] and dev == torch.device("meta") and tok is not None
    _check(model, "meta", torch.float16)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_on_a_gpu_every_loader_runs_a_registered_model_in_float16_with_float32_rope(smollm2, asked):
    """On CUDA itself: load_for_device, the engine's _load and ingest's default device."""
    from kvcodec.engine.engine import _load
    from kvcodec.ingest.run import load_for_ingest

    want = _rope(smollm2[0])
    for load in (
        lambda: load_for_device("smollm2-135m", "cuda")[0],
        lambda: _load("smollm2-135m", None, torch.device("cuda"), None)[0],
        lambda: load_for_ingest("smollm2-135m")[0],
    ):
        asked.clear()
        model = load()
        assert asked == [torch.float16]
        _check(model, "cuda", torch.float16)
        assert all(torch.equal(b.cpu(), want[n]) for n, b in _rope(model).items())
        del model
