"""The engine and `kvcodec serve` with the transform codec (issue 12): a transform calibrated on
SmolLM2's KV of two essays serves a prompt of a third; a stored prefix is fetched and reused by
the next request, and what the engine restored is what the codec itself decodes from the stored
chunks. Also `kvcodec serve --codec/--codec-option/--transform` chosen through the codec registry."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from serve_process import start_serve

torch = pytest.importorskip("torch")

from click.testing import CliRunner  # noqa: E402

from kvcodec.cli.main import cli  # noqa: E402
from kvcodec.codecs import HevcCodec, RawCodec  # noqa: E402
from kvcodec.codecs.transform.codec import TransformCodec  # noqa: E402
from kvcodec.restore.paged import PagedKV  # noqa: E402

CHUNK = 64
CALIBRATION_TEXTS, EVAL_TEXT, EVAL_TOKENS = ("pg/aord", "pg/apple"), "pg/gap", 300


@pytest.fixture(scope="module")
def kvt(smol, tmp_path_factory) -> Path:
    """A transform fitted on KV of texts the tests do not serve."""
    from kvcodec.integrations.hf import extract_kv
    from kvcodec.models.texts import load_text
    from kvcodec.transform import RopeSpec, calibrate, save_kvt

    model, tok = smol
    kvs = [extract_kv(model, tok, load_text(t, max_chars=4000), 400)[1] for t in CALIBRATION_TEXTS]
    path = tmp_path_factory.mktemp("kvt") / "smollm2.kvt"
    save_kvt(calibrate(kvs, RopeSpec.from_hf_config(model.config), info={"model": "smollm2-135m"}), path)
    return path


@pytest.fixture(scope="module")
def prompt(smol) -> tuple[list[int], torch.Tensor]:
    """(token ids, the model's own KV of them) of the served text."""
    from kvcodec.integrations.hf import extract_kv
    from kvcodec.models.texts import load_text

    model, tok = smol
    ids, kv = extract_kv(model, tok, load_text(EVAL_TEXT, max_chars=3000), EVAL_TOKENS)
    return ids.tolist(), kv


def record_fetches(cache) -> list[torch.Tensor]:
    """Copies of the KV each fetch of `cache` restored, taken before the engine writes beyond it."""
    seen: list[torch.Tensor] = []
    fetch = cache.fetch

    def recording(ids, n_tokens=None, *args, **kw):
        res = fetch(ids, n_tokens, *args, **kw)
        n, out = res.tokens_restored, res.kv
        if n:
            seen.append(out.gather(0, n).clone() if isinstance(out, PagedKV) else out[:, :, :n].clone())
        return res

    cache.fetch = recording
    return seen


def stored_decode(cache, ids: list[int], n: int) -> torch.Tensor:
    """What the codec decodes from the chunks stored for the first n tokens of ids."""
    from kvcodec.fetcher import blob_key

    codec, keys = cache.codec, cache.keys(ids)
    parts = []
    for i in range(-(-n // codec.chunk_tokens)):
        blob = cache.store.get(blob_key(keys[i], 0))
        info = codec.inspect_chunk(blob)
        out = torch.empty(info.shape, dtype=getattr(torch, info.dtype))
        parts.append(codec.decode_chunk(blob, out))
    return torch.cat(parts, dim=2)[:, :, :n]


@pytest.mark.slow
def test_engine_reuses_a_transform_coded_prefix(smol, kvt, prompt):
    from kvcodec.engine import Engine

    model, tok = smol
    ids, kv = prompt
    codec = TransformCodec(kvt, chunk_tokens=CHUNK)
    with Engine(model, tokenizer=tok, store_url="memory://", device="cpu", codec=codec, fetch_deadline_s=None) as eng:
        seen = record_fetches(eng.prefix_cache)
        first = eng.generate([ids], max_new_tokens=1, wait_for_store=True)[0]
        again = eng.generate([ids], max_new_tokens=2)[0]
        metrics = eng.metrics.render().decode()
        assert len(seen) == 1
        decoded = stored_decode(eng.prefix_cache, ids, seen[0].shape[2])
    assert first.restored_tokens == 0
    whole = len(ids) - 1  # a last partial chunk is stored too; the last prompt token is recomputed
    assert again.fetch_error is None and again.restored_tokens == whole and again.prefilled_tokens == 1
    assert "kvcodec_reuse_hits_total 1.0" in metrics
    restored, n = seen[0], seen[0].shape[2]
    assert n >= whole  # the fetch may restore the last token too
    assert torch.equal(restored, decoded.to(restored.dtype))
    # lossy, but close to the model's own KV at every position (RoPE removed and re-applied at the
    # right positions; a position error gives errors of the values' own size)
    want = kv[:, :, :n].to(restored.dtype)
    norm = torch.linalg.vector_norm
    rel = (norm(restored - want, dim=(0, 1, 3, 4)) / norm(want, dim=(0, 1, 3, 4)))[4:].max()  # past the sinks
    assert rel < 0.25, rel  # 0.075 measured


# -- `kvcodec serve` codec flags (the engine and server faked: only the codec chosen is checked) ---


@pytest.fixture
def served(monkeypatch) -> list:
    import kvcodec.engine
    import kvcodec.server

    seen: list = []

    def fake_engine(model, **kwargs):  # noqa: ANN001, ANN202
        seen.append(kwargs)
        return object()

    monkeypatch.setattr(kvcodec.engine, "Engine", fake_engine)
    monkeypatch.setattr(kvcodec.server, "serve", lambda *a, **k: None)
    # the CLI tests' .kvt is of a tiny shape, no model's (tests/test_serve.py and the test below cover the checks)
    monkeypatch.setattr("kvcodec.cli.serve._check_codec_fits", lambda codec, engine: None)
    monkeypatch.setattr("kvcodec.cli.serve.check_transform_fits_model", lambda codec, model: None)
    return seen


def serve_cli(*args: str):  # noqa: ANN201
    return CliRunner().invoke(cli, ["serve", "--store", "memory://", "--device", "cpu", *args])


def error_line(r) -> str:  # noqa: ANN001
    lines = [ln for ln in r.output.splitlines() if ln.startswith("Error")]
    assert len(lines) == 1, r.output
    return lines[0]


@pytest.fixture(scope="module")
def small_kvt(tmp_path_factory) -> Path:
    """A transform of a tiny KV shape: the CLI tests need a valid file, not a real model's."""
    from kvcodec.transform import RopeSpec, calibrate, save_kvt

    g = torch.Generator().manual_seed(0)
    path = tmp_path_factory.mktemp("kvt") / "small.kvt"
    save_kvt(calibrate([torch.randn((2, 2, 300, 2, 32), generator=g)], RopeSpec(1e4, 32)), path)
    return path


def test_serve_picks_the_codec_through_the_registry(served, small_kvt):
    assert serve_cli().exit_code == 0
    codec = served[-1]["codec"]
    assert isinstance(codec, HevcCodec) and codec.config.quant == "int8" and codec.chunk_tokens == 256
    assert served[-1]["decode_workers"] is None  # the fetcher's default: 1 on the CPU, one per NVDEC engine on CUDA
    r = serve_cli("--quant", "int4", "--chunk-tokens", "64", "--codec-option", "resolutions=((256, 256),)")
    assert r.exit_code == 0, r.output
    codec = served[-1]["codec"]
    assert (codec.config.quant, codec.chunk_tokens, codec.resolutions) == ("int4", 64, ((256, 256),))
    assert serve_cli("--codec", "raw").exit_code == 0 and isinstance(served[-1]["codec"], RawCodec)
    r = serve_cli("--transform", str(small_kvt), "--preset", "compact", "--decode-workers", "3")
    assert r.exit_code == 0, r.output
    codec = served[-1]["codec"]
    assert isinstance(codec, TransformCodec) and codec.target_ratio == 8.0 and served[-1]["decode_workers"] == 3
    r = serve_cli("--codec", "transform", "--codec-option", f"transform={small_kvt}", "--target-ratio", "6")
    assert r.exit_code == 0, r.output
    assert served[-1]["codec"].target_ratio == 6.0
    r = serve_cli("--codec", "transform", "--codec-option", f"transform='{small_kvt}'", "--codec-option", "coder=zstd")
    assert r.exit_code == 0 and served[-1]["codec"].coder == "zstd", r.output


def test_serve_refuses_another_models_transform_from_its_config_before_the_model_loads(small_kvt, monkeypatch):
    import kvcodec.engine

    def never(*a, **k):  # noqa: ANN002, ANN003, ANN202
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(kvcodec.engine, "Engine", never)
    r = serve_cli("--transform", str(small_kvt))
    assert r.exit_code == 2 and "does not fit smollm2-135m" in error_line(r), r.output


def test_serve_refuses_bad_codec_choices_in_one_line(served, small_kvt, tmp_path):
    garbage = tmp_path / "garbage.kvt"
    garbage.write_bytes(b"not a transform at all")
    for args, needle in (
        (("--codec", "no-such-codec"), "unknown codec"),
        (("--codec-option", "quant"), "KEY=VALUE"),
        (("--codec-option", "quant=int4", "--codec-option", "quant=int8"), "twice"),
        (("--codec-option", "quant=int4", "--quant", "int8"), "alternatives"),
        (("--codec-option", "no_such_option=1"), "refuses"),
        (("--transform", str(small_kvt), "--quant", "int8"), "refuses"),
        (("--preset", "accurate"), "size a transform codec"),  # a transform preset for the hevc codec
        (("--codec", "raw", "--transform", str(small_kvt)), "contradicts"),
        (("--transform", str(tmp_path / "missing.kvt")), "missing.kvt"),
        (("--transform", str(garbage)), "codec 'transform'"),
        (("--transform", str(small_kvt), "--target-ratio", "1"), "--target-ratio"),
    ):
        r = serve_cli(*args)
        assert r.exit_code == 2 and needle in error_line(r), (args, r.output)
    assert not served  # every refusal came before the engine


# -- a real `kvcodec serve --transform` process -----------------------------------------------------


@pytest.mark.slow
def test_kvcodec_serve_transform_reuses_a_prefix(kvt, prompt, tmp_path):
    httpx = pytest.importorskip("httpx")
    ids, _ = prompt
    args = ["--store", f"file://{tmp_path / 'store'}", "--device", "cpu"]
    proc, base = start_serve(*args, "--transform", str(kvt), "--chunk-tokens", str(CHUNK), "--fetch-deadline", "none")
    try:
        body = {"prompt": ids, "max_tokens": 1}
        first = httpx.post(base + "/v1/completions", json=body, timeout=120).json()
        assert first["kvcodec"]["restored_tokens"] == 0
        restored, deadline = 0, time.monotonic() + 60
        while not restored and time.monotonic() < deadline:  # the first prompt's KV is stored in the background
            time.sleep(0.5)
            restored = httpx.post(base + "/v1/completions", json=body, timeout=120).json()["kvcodec"]["restored_tokens"]
        assert restored == len(ids) - 1
        hits = [ln for ln in httpx.get(base + "/metrics").text.splitlines() if ln.startswith("kvcodec_reuse_hits")]
        assert float(hits[0].split()[-1]) >= 1
    finally:
        proc.kill()
        out = proc.communicate()[0]
    assert "codec transform" in out, out[-2000:]


def test_an_engine_given_another_models_kvt_logs_a_warning(tmp_path, caplog, monkeypatch):
    # `serve` and the CLI warned of a .kvt calibrated on another model; an Engine built in Python did not
    from kvcodec.engine import Engine
    from kvcodec.engine import engine as engine_module
    from kvcodec.transform import RopeSpec, calibrate, save_kvt

    class Loaded(Exception):
        """The weights would load now: the warning, if any, is out by then."""

    def load(*_):
        raise Loaded

    monkeypatch.setattr(engine_module, "check_codable", lambda name: None)
    monkeypatch.setattr(engine_module, "_load", load)
    g = torch.Generator().manual_seed(2)
    path = tmp_path / "qwen.kvt"
    save_kvt(calibrate([torch.randn((2, 2, 300, 2, 32), generator=g)], RopeSpec(1e4, 32), info={"model": "qwen"}), path)
    codec = TransformCodec(path)
    with caplog.at_level("WARNING", logger=engine_module.__name__):
        for model, given in (("qwen", codec), ("smollm2-135m", RawCodec())):  # its own model; no .kvt
            with pytest.raises(Loaded):
                Engine(model, store_url="memory://", device="cpu", codec=given)
        assert not caplog.records
        with pytest.raises(Loaded):
            Engine("smollm2-135m", store_url="memory://", device="cpu", codec=codec)
    (record,) = caplog.records
    assert "calibrated on 'qwen'" in record.getMessage() and "'smollm2-135m'" in record.getMessage()
