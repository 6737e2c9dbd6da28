"""The engine's request caches: reserved storage that the restored prefix lives in (no copy) and
that new tokens are written into in place; and the per-request time points after a fetch."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
from hypothesis import given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from kvcodec.engine.runner import layer_storage, restore_target  # noqa: E402
from kvcodec.integrations.hf import cache_to_tensor, forward_ids, layer_pairs, make_cache, reserved_cache  # noqa: E402


@settings(max_examples=50, deadline=None)
@given(
    layers=st.integers(1, 4),
    tokens=st.integers(1, 40),
    heads=st.integers(1, 4),
    dim=st.integers(1, 16),
)
def test_layer_storage_views_restore_targets_only(layers, tokens, heads, dim):
    target = restore_target(layers, tokens, heads, dim, "cpu", torch.float32)
    target.copy_(torch.randn(layers, 2, tokens, heads, dim))
    pairs = layer_storage(target)
    assert pairs is not None and len(pairs) == layers
    for i, (k, v) in enumerate(pairs):
        assert k.shape == (1, heads, tokens, dim)
        assert torch.equal(k[0].transpose(0, 1), target[i, 0]) and torch.equal(v[0].transpose(0, 1), target[i, 1])
        assert k.data_ptr() == target[i, 0].data_ptr()  # a view, not a copy
    if tokens > 1 and heads > 1:  # a canonical contiguous tensor is laid out otherwise
        assert layer_storage(torch.zeros(layers, 2, tokens, heads, dim)) is None


def _prefix_kv(model, tok, text: str, suffix: int = 6):  # noqa: ANN001, ANN202
    ids = tok(text, return_tensors="pt").input_ids[0][:80]
    n = len(ids) - suffix
    _, cache = forward_ids(model, ids[:n])
    return ids, n, cache_to_tensor(cache)


def _reference(model, ids, n: int, kv):  # noqa: ANN001, ANN202
    """Logits of the suffix and two greedy decode steps over a plain DynamicCache of kv."""
    pairs = [(kv[i, 0].transpose(0, 1)[None].clone(), kv[i, 1].transpose(0, 1)[None].clone()) for i in range(len(kv))]
    return _continue(model, ids, n, make_cache(pairs, model.config))


@torch.inference_mode()
def _continue(model, ids, n: int, cache):  # noqa: ANN001, ANN202
    out = model(input_ids=ids[None, n:], cache=cache, use_cache=True)
    logits = [out.logits[0, -1]]
    for _ in range(2):
        nxt = logits[-1].argmax().view(1, 1)
        out = model(input_ids=nxt, cache=out.cache, use_cache=True)
        logits.append(out.logits[0, -1])
    return torch.stack(logits), out.cache


@pytest.mark.parametrize("room", [64, 2])  # room for everything / the cache must grow once
def test_reserved_cache_continues_like_a_dynamic_cache_without_copying_the_prefix(smollm2, short_text, room):
    model, tok = smollm2
    ids, n, kv = _prefix_kv(model, tok, short_text)
    L, _, _, H, D = kv.shape
    target = restore_target(L, n + room, H, D, "cpu", kv.dtype)
    target[:, :, :n].copy_(kv)
    storage = layer_storage(target)
    got, cache = _continue(model, ids, n, reserved_cache(storage, n, model.config))
    want, _ = _reference(model, ids, n, kv)
    assert torch.allclose(got, want, atol=1e-4, rtol=1e-4)
    assert torch.equal(got.argmax(-1), want.argmax(-1))
    total = len(ids) + 2
    fits = total <= n + room
    for (k, v), (ks, vs) in zip(layer_pairs(cache), storage):
        assert k.shape[2] == v.shape[2] == total
        assert (k.data_ptr() == ks.data_ptr()) == fits and (v.data_ptr() == vs.data_ptr()) == fits  # in place
    assert torch.equal(target[:, :, :n], kv)  # the restored prefix was never written


def test_reserved_cache_from_empty_storage_matches_a_fresh_forward(smollm2, short_text):
    model, tok = smollm2
    ids = tok(short_text, return_tensors="pt").input_ids[0][:40]
    L, H, D = 30, 3, 64
    storage = layer_storage(restore_target(L, 48, H, D, "cpu", torch.float32))
    with torch.inference_mode():
        got = model(input_ids=ids[None], cache=reserved_cache(storage, 0, model.config), use_cache=True)
        want = model(input_ids=ids[None], use_cache=True)
    assert torch.allclose(got.logits, want.logits, atol=1e-4, rtol=1e-4)
    assert torch.allclose(cache_to_tensor(got.cache), cache_to_tensor(want.cache), atol=1e-5)
    assert layer_pairs(got.cache)[0][0].data_ptr() == storage[0][0].data_ptr()


def test_engine_prefills_in_the_fetch_target_and_reports_the_gap(smollm2, short_text):
    from kvcodec.codecs import make_codec
    from kvcodec.engine import Engine, SamplingParams, StorePolicy
    from kvcodec.fetcher import PrefixCache
    from kvcodec.models import model_id
    from kvcodec.store import open_store

    model, tok = smollm2
    ids, n, kv = _prefix_kv(model, tok, short_text, suffix=8)
    targets = []

    class RecordingCache(PrefixCache):
        def fetch(self, token_ids, n_tokens=None, out=None, deadline_s=None, **kw):  # noqa: ANN001, ANN003, ANN201
            targets.append(out)
            return super().fetch(token_ids, n_tokens, out=out, deadline_s=deadline_s, **kw)

    pc = RecordingCache(open_store("memory://"), model_id(model), make_codec("raw", chunk_tokens=16), "cpu")
    pc.put(ids[:n].tolist(), kv)
    engine = Engine(  # no fetch deadline: the default's (the measured recompute time) is a race on a loaded machine
        model,
        tokenizer=tok,
        prefix_cache=pc,
        store_policy=StorePolicy(enabled=False),
        device="cpu",
        fetch_deadline_s=None,
    )
    with engine as eng:
        req = eng.submit(ids.tolist(), SamplingParams(max_new_tokens=3, ignore_eos=True))
        while not req.output_ids:
            if eng.scheduler.wait_for_work(timeout=5):
                eng.step()
        restored = (n // 16) * 16
        assert req.restored_tokens == restored and len(targets) == 1
        k0 = layer_pairs(req.cache)[0][0]
        assert k0.data_ptr() == targets[0][0, 0].data_ptr()  # the cache is the fetch's target
        assert torch.equal(k0[0, :, :restored].transpose(0, 1), kv[0, 0, :restored])
        assert 0 <= req.restored_to_prefill_s < req.ttft and 0 < req.prefill_to_first_token_s < req.ttft
        assert req.fetch_end <= req.prefill_start_time <= req.first_token_time
        while not req.finished:
            eng.step()
        out = eng.metrics.render().decode()
    assert "kvcodec_restored_to_prefill_seconds_count 1.0" in out
    assert "kvcodec_prefill_to_first_token_seconds_count 1.0" in out
