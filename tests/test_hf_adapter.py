"""transformers cache <-> canonical KV tensor adapters, checked against real forward passes."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcodec.errors import ShapeError
from kvcodec.integrations.hf import (
    cache_to_tensor,
    check_kv,
    continue_from_kv,
    extract_kv,
    forward_ids,
    greedy_from_kv,
    tensor_to_cache,
)
from kvcodec.models import kv_shape


def _tiny_config(layers=2, heads=4, kv_heads=2, head_dim=8, **extra):
    from transformers import LlamaConfig

    return LlamaConfig(
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        hidden_size=heads * head_dim,
        intermediate_size=16,
        vocab_size=32,
        **extra,
    )


# ----------------------------------------------------------------------------- pure shape handling


@settings(max_examples=25, deadline=None)
@given(
    layers=st.integers(1, 4),
    tokens=st.integers(1, 9),
    kv_heads=st.sampled_from([1, 2, 4]),
    head_dim=st.sampled_from([4, 8]),
    dtype=st.sampled_from([torch.float16, torch.bfloat16, torch.float32]),
    seed=st.integers(0, 2**16),
)
def test_tensor_cache_round_trip_is_bit_exact(layers, tokens, kv_heads, head_dim, dtype, seed):
    config = _tiny_config(layers=layers, heads=kv_heads * 2, kv_heads=kv_heads, head_dim=head_dim)
    g = torch.Generator().manual_seed(seed)
    kv = torch.randn(layers, 2, tokens, kv_heads, head_dim, generator=g).to(dtype)
    cache = tensor_to_cache(kv, config)
    assert cache.layers[0].keys.shape == (1, kv_heads, tokens, head_dim)
    assert torch.equal(cache.layers[layers - 1].values[0, :, -1], kv[layers - 1, 1, -1])
    back = cache_to_tensor(cache)
    assert back.dtype == dtype and back.shape == kv.shape
    assert torch.equal(
        back.view(torch.uint8) if dtype != torch.float32 else back,
        kv.view(torch.uint8) if dtype != torch.float32 else kv,
    )


def test_cache_to_tensor_accepts_legacy_tuples():
    k = torch.randn(1, 2, 5, 8)
    v = torch.randn(1, 2, 5, 8)
    kv = cache_to_tensor(((k, v), (k + 1, v + 1)))
    assert kv.shape == (2, 2, 5, 2, 8)
    assert torch.equal(kv[1, 1, 3], v[0, :, 3] + 1)


def test_shape_errors_name_expected_and_got():
    config = _tiny_config()  # 2 layers, 2 kv heads, head_dim 8
    good = torch.zeros(2, 2, 3, 2, 8)
    check_kv(good, config)
    with pytest.raises(ShapeError, match=r"\(3, 2, 8\).*\(2, 2, 8\)"):
        tensor_to_cache(torch.zeros(3, 2, 3, 2, 8), config)
    with pytest.raises(ShapeError, match=r"\(2, 3, 8\).*\(2, 2, 8\)"):
        tensor_to_cache(torch.zeros(2, 2, 3, 3, 8), config)
    with pytest.raises(ShapeError, match="got \\(2, 3, 3, 2, 8\\)"):
        tensor_to_cache(torch.zeros(2, 3, 3, 2, 8), config)
    with pytest.raises(ShapeError, match="float16, bfloat16 or float32"):
        tensor_to_cache(torch.zeros(2, 2, 3, 2, 8, dtype=torch.float64), config)
    with pytest.raises(ShapeError, match="holds 3 tokens, expected 4"):
        check_kv(good, config, tokens=4)
    with pytest.raises(ShapeError, match="batch|\\[1, kv_heads"):
        k = torch.zeros(2, 2, 3, 8)
        cache_to_tensor(((k, k),))
    with pytest.raises(ShapeError, match="layer 1"):
        k = torch.zeros(1, 2, 3, 8)
        cache_to_tensor(((k, k), (k[:, :, :2], k[:, :, :2])))


# ----------------------------------------------------------------------------- real models


def _serialize(kv: torch.Tensor) -> torch.Tensor:
    """A real storage round trip of the tensor (safetensors bytes), as the store does."""
    from safetensors.torch import load, save

    return load(save({"kv": kv}))["kv"]


@pytest.mark.slow
def test_extract_kv_shape_and_dtype(real_model, short_text):
    name, model, tokenizer = real_model
    ids, kv = extract_kv(model, tokenizer, short_text, max_tokens=40)
    layers, kv_heads, head_dim = kv_shape(model)
    assert ids.shape == (40,)
    assert kv.shape == (layers, 2, 40, kv_heads, head_dim)
    assert kv.dtype == torch.float32
    assert kv.abs().sum() > 0
    # keys and values are different tensors (index 0 = K, 1 = V)
    assert not torch.equal(kv[:, 0], kv[:, 1])


@pytest.mark.slow
def test_restored_prefix_continues_like_uninterrupted_pass(real_model, short_text):
    """prefix KV -> canonical tensor -> bytes -> DynamicCache -> continuation == one full pass."""
    name, model, tokenizer = real_model
    ids = tokenizer(short_text, return_tensors="pt").input_ids[0][:96]
    full_logits, full_cache = forward_ids(model, ids)
    P = 64
    prefix_ids, prefix_kv = extract_kv(model, tokenizer, short_text, max_tokens=P)
    assert torch.equal(prefix_ids, ids[:P])
    restored = _serialize(prefix_kv)
    out = continue_from_kv(model, prefix_ids, restored, ids[P:])
    torch.testing.assert_close(out.logits[0], full_logits[P:], rtol=1e-4, atol=1e-4)
    assert torch.equal(out.logits[0].argmax(-1), full_logits[P:].argmax(-1))
    # the continued cache holds the same KV as the uninterrupted pass
    torch.testing.assert_close(cache_to_tensor(out.cache), cache_to_tensor(full_cache), rtol=1e-4, atol=1e-4)
    assert torch.equal(restored, prefix_kv)  # running the model did not modify the input KV


@pytest.mark.slow
def test_greedy_generation_from_restored_kv_matches_generate(real_model, short_text):
    name, model, tokenizer = real_model
    ids = tokenizer(short_text, return_tensors="pt").input_ids[0][:48]
    ref = model.generate(
        ids.unsqueeze(0), max_new_tokens=8, do_sample=False, attention_mask=torch.ones(1, 48, dtype=torch.long)
    )
    ref_tokens = ref[0, 48:].tolist()
    _, kv = extract_kv(model, tokenizer, short_text, max_tokens=47)
    got = greedy_from_kv(model, ids[:47], _serialize(kv), ids[47:48], 8)
    assert got == ref_tokens


@pytest.mark.slow
def test_corrupted_kv_changes_the_continuation(real_model, short_text):
    """The continuation really reads the given KV: damaging it changes the logits."""
    name, model, tokenizer = real_model
    ids, kv = extract_kv(model, tokenizer, short_text, max_tokens=64)
    cont = tokenizer(" and so on", add_special_tokens=False, return_tensors="pt").input_ids[0]
    good = continue_from_kv(model, ids, kv, cont).logits
    bad_kv = kv.clone()
    bad_kv[:, 1] = torch.flip(bad_kv[:, 1], dims=[1])  # values in reverse token order
    bad = continue_from_kv(model, ids, bad_kv, cont).logits
    assert (good - bad).abs().max() > 1e-2


@pytest.mark.slow
def test_model_shape_and_dtype_mismatches(smollm2, qwen25, short_text):
    s_model, s_tok = smollm2
    q_model, _ = qwen25
    ids, kv = extract_kv(s_model, s_tok, short_text, max_tokens=16)
    with pytest.raises(ShapeError, match=r"\(30, 3, 64\).*\(24, 2, 64\)"):
        continue_from_kv(q_model, ids, kv, ids[:2])
    with pytest.raises(ShapeError, match="float16.*float32"):
        continue_from_kv(s_model, ids, kv.half(), ids[:2])
    with pytest.raises(ShapeError, match="holds 16 tokens, expected 15"):
        continue_from_kv(s_model, ids[:15], kv, ids[:2])


@pytest.mark.slow
def test_extract_command_saves_canonical_kv(smollm2, short_text, tmp_path):
    import json

    from click.testing import CliRunner
    from safetensors import safe_open

    from kvcodec.cli.extract import command
    from kvcodec.models import model_id

    model, tok = smollm2
    src = tmp_path / "doc.txt"
    src.write_text(short_text, encoding="utf-8")
    out = tmp_path / "kv.safetensors"
    res = CliRunner().invoke(command, ["--text", str(src), "--max-tokens", "32", "--chunk-tokens", "10", str(out)])
    assert res.exit_code == 0, res.output
    with safe_open(str(out), "pt") as f:
        meta = f.metadata()
        kv = f.get_tensor("kv")
        assert list(f.keys()) == ["kv"]
    ids, ref = extract_kv(model, tok, short_text, max_tokens=32)
    assert kv.dtype == torch.float16 and kv.shape == (30, 2, 32, 3, 64)
    torch.testing.assert_close(kv, ref.half(), rtol=1e-3, atol=1e-3)  # chunked prefill: float rounding only
    assert meta["model"] == "smollm2-135m" and meta["tokens"] == "32" and meta["model_id"] == model_id(model)
    assert json.loads(meta["input_ids"]) == ids.tolist()

    bad = CliRunner().invoke(command, ["--text", str(tmp_path / "missing.txt"), str(out)])
    assert bad.exit_code != 0 and "neither a file nor a text name" in str(bad.exception)


def test_a_model_of_another_config_gets_another_id_with_the_same_weights():
    """RoPE's base changes every key, not a weight: the id once left it out, so a store served one
    model's KV to the other. What only names or runs a model (its path, use_cache, pad token) keeps the id."""
    from transformers import LlamaForCausalLM

    from kvcodec.models import model_id

    torch.manual_seed(0)
    base = LlamaForCausalLM(_tiny_config())
    other_rope = LlamaForCausalLM(_tiny_config(rope_theta=5e5))
    other_rope.load_state_dict(base.state_dict())
    renamed = LlamaForCausalLM(_tiny_config())
    renamed.load_state_dict(base.state_dict())
    renamed.config._name_or_path, renamed.config.use_cache, renamed.config.pad_token_id = "elsewhere/model", False, 7
    assert model_id(other_rope) != model_id(base) == model_id(renamed)


def test_extracted_kv_never_goes_beyond_the_models_context(caplog):
    """extract and calibrate once prefilled 500 tokens through a model of 64 positions (KV of
    positions it was never trained on); ingest and the server already stopped at the context."""
    from transformers import LlamaForCausalLM

    from kvcodec.models.check import layout_from_config
    from kvcodec.models.extract import extract_text_kv

    class Tokenizer:  # every character a token: any text is as long as asked for
        def __call__(self, text, return_tensors=None):  # noqa: ANN001, ANN204
            return SimpleNamespace(input_ids=torch.tensor([[ord(c) % 32 for c in text]]))

    torch.manual_seed(0)
    model = LlamaForCausalLM(_tiny_config(max_position_embeddings=64)).eval()
    layout = layout_from_config(model.config)
    ids, kv = extract_text_kv(model, Tokenizer(), layout, "x" * 500, 500)
    assert len(ids) == 64 and kv.shape[2] == 64 and "the model's context is 64" in caplog.text
    assert len(extract_text_kv(model, Tokenizer(), layout, "x" * 500)[0]) == 64
    assert len(extract_text_kv(model, Tokenizer(), layout, "x" * 500, 40)[0]) == 40
