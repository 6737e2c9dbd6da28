"""The calibration report's continuation must run on the restored KV: the cache goes to the model under
the argument name its forward() takes (transformers 5.17 swallowed cache= into **kwargs and ignored it)."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")


def _tiny_llama():
    config = transformers.LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
        num_key_value_heads=1, max_position_embeddings=64,
    )  # fmt: skip
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(config).eval()


def test_report_continuation_depends_on_the_kv():
    from kvcodec.models.quality import _continue

    model = _tiny_llama()
    kv = torch.randn(2, 2, 8, 1, 16)
    cont = torch.tensor([3, 5, 7])
    assert not torch.allclose(_continue(model, kv, cont), _continue(model, kv * 0, cont))


class _OldSignature(torch.nn.Module):
    """A model whose forward() names its cache past_key_values (transformers before `cache=`)."""

    def __init__(self, model):
        super().__init__()
        self.inner, self.config, self.device = model, model.config, model.device

    def forward(self, input_ids, past_key_values=None, use_cache=None, **kwargs):
        assert past_key_values is not None, "the cache came under another name"
        assert "cache" not in kwargs
        return self.inner(input_ids, cache=past_key_values, use_cache=use_cache)


def test_report_continuation_uses_the_models_own_cache_argument():
    from kvcodec.models.quality import _continue

    model = _tiny_llama()
    kv, cont = torch.randn(2, 2, 8, 1, 16), torch.tensor([3, 5, 7])
    assert torch.equal(_continue(_OldSignature(model), kv, cont), _continue(model, kv, cont))
