"""The engine on CUDA (random-weight tiny Llama: the GPU machine has no GGUF loader; this checks
device handling, not model quality): reuse == recompute, fetch-aware admission, fallback."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")

pytestmark = pytest.mark.gpu

if not torch.cuda.is_available():  # pragma: no cover - CPU machines
    pytest.skip("needs CUDA", allow_module_level=True)

from kvcodec.config import CodecConfig  # noqa: E402
from kvcodec.engine import Engine, SamplingParams, StorePolicy  # noqa: E402
from kvcodec.fetcher.rawcodec import RawCodec  # noqa: E402


@pytest.fixture(scope="module")
def tiny():
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(0)
    cfg = LlamaConfig(
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=2,
        vocab_size=1000,
        max_position_embeddings=1024,
    )
    return AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).cuda().eval()


def _engine(model, url="memory://", **kw):  # noqa: ANN001, ANN202
    return Engine(
        model,
        store_url=url,
        device="cuda",
        codec_config=CodecConfig(quant="exact", chunk_tokens=32, resolutions=((256, 256),)),
        resolution_policy="fixed:0",
        codec=RawCodec(),
        **{"fetch_deadline_s": None, **kw},
    )


def test_cuda_reuse_equals_recompute(tiny):
    ids = [int(x) for x in torch.randint(5, 1000, (120,), generator=torch.Generator().manual_seed(1))]
    with _engine(tiny) as eng:
        base = eng.generate(ids, max_new_tokens=6, ignore_eos=True, wait_for_store=True)[0]
        again = eng.generate(ids, max_new_tokens=6, ignore_eos=True)[0]
        assert again.restored_tokens >= 96 and again.fetch_error is None
        assert again.token_ids == base.token_ids


def test_cuda_non_reuse_not_blocked(tiny, tmp_path, monkeypatch):
    import urllib.parse

    from kvcodec.store import base

    if "throttle" not in base.store_schemes():  # benchmarks on the path but not installed: no entry point
        monkeypatch.setitem(base._REGISTRY, "throttle", "kvbench.net.throttle:ThrottledStore.from_url")

    ids = [int(x) for x in torch.randint(5, 1000, (128,), generator=torch.Generator().manual_seed(2))]
    with _engine(tiny, f"file://{tmp_path}") as eng:
        eng.generate(ids, max_new_tokens=1, wait_for_store=True)
        nbytes = eng.generate(ids, max_new_tokens=1, store=False)[0].bytes_fetched
    slow = f"throttle://{nbytes * 8 / 2.0 / 1e9}?inner=" + urllib.parse.quote(f"file://{tmp_path}", safe="")
    with _engine(tiny, slow, store_policy=StorePolicy(enabled=False)) as eng:
        p = SamplingParams(max_new_tokens=4, ignore_eos=True)
        a = eng.submit(ids, p)
        b = eng.submit([7, 8, 9, 10], p, reuse=False)
        while not (a.finished and b.finished):
            if eng.scheduler.wait_for_work(0.5):
                eng.step()
    assert a.restored_tokens > 0
    assert b.finish_time < a.fetch_end < a.first_token_time
