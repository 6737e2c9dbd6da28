"""The RoPE kvcodec removes from a model's keys is the one the model applied: for each family (RoPE
named in the config, partial, interleaved, fixed in code as GPT-J's; none at all), keys captured
before the rotation (the key projection's output, by a forward hook) equal the cache's keys with
kvcodec's remove_rope at their positions. A wrong spec would still decode losslessly, but would
code rotated keys with a basis fitted for unrotated ones."""

from __future__ import annotations

import pytest
import torch

from kvcodec.models.check import layout_from_config
from kvcodec.transform.rope import remove_rope

transformers = pytest.importorskip("transformers")

VOCAB, TOKENS = 500, 40
SMALL = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_attention_heads=4, max_position_embeddings=512)


def _configs() -> dict[str, tuple[object, str]]:
    """family -> (a one-layer config, the name of the module whose output is the keys before RoPE)."""
    t = transformers
    return {
        "llama": (t.LlamaConfig(num_hidden_layers=1, num_key_value_heads=2, **SMALL), "k_proj"),
        "phi (partial rotary)": (t.PhiConfig(num_hidden_layers=1, partial_rotary_factor=0.5, **SMALL), "k_proj"),
        "stablelm (partial)": (
            t.StableLmConfig(num_hidden_layers=1, num_key_value_heads=4, partial_rotary_factor=0.25, **SMALL),
            "k_proj",
        ),
        "cohere (interleaved)": (t.CohereConfig(num_hidden_layers=1, num_key_value_heads=2, **SMALL), "k_proj"),
        "olmo2 (normed keys)": (t.Olmo2Config(num_hidden_layers=1, num_key_value_heads=2, **SMALL), "k_norm"),
        "gptj (fixed in code)": (
            t.GPTJConfig(vocab_size=VOCAB, n_embd=64, n_head=4, n_layer=1, rotary_dim=8, n_positions=512),
            "k_proj",
        ),
    }


@pytest.mark.parametrize("family", sorted(_configs()))
def test_the_rope_removed_is_the_one_the_model_applied(family):
    config, pre_rope = _configs()[family]
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    spec = layout_from_config(config, family).ropes[0]
    assert spec is not None
    captured = {}
    module = next(m for name, m in model.named_modules() if name.endswith(pre_rope))
    module.register_forward_hook(lambda _m, _i, out: captured.setdefault("keys", out))
    with torch.inference_mode():
        cache = model(torch.randint(0, VOCAB, (1, TOKENS)), use_cache=True).cache
    keys = cache.layers[0].keys[0].transpose(0, 1)  # (tokens, heads, head_dim)
    before = captured["keys"][0].reshape(TOKENS, keys.shape[1], keys.shape[2])
    assert not torch.allclose(keys, before, atol=1e-3)  # the model rotated them
    torch.testing.assert_close(remove_rope(keys, torch.arange(TOKENS), spec), before, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize(
    ("config", "kv_heads"),
    [
        (dict(cls="GPT2Config", n_layer=2, n_head=4, n_embd=64), 4),
        (dict(cls="OPTConfig", num_hidden_layers=2, num_attention_heads=4, hidden_size=64, ffn_dim=96), 4),
        (dict(cls="BloomConfig", n_layer=2, n_head=4, hidden_size=64), 4),
        (dict(cls="MptConfig", n_layers=2, n_heads=4, d_model=64), 4),
        (dict(cls="FalconConfig", num_hidden_layers=2, num_attention_heads=4, hidden_size=64, alibi=True), 1),
    ],
    ids=lambda c: c["cls"] if isinstance(c, dict) else "",
)
def test_a_family_without_rope_is_coded_with_nothing_removed(config, kv_heads):
    kw = dict(config)
    layout = layout_from_config(getattr(transformers, kw.pop("cls"))(**kw))
    assert layout.ropes == (None, None) and layout.spec.layers[0].k_shape == (kv_heads, 16)
