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


class _Kept:
    """A codec that restores what it was given times `scale` (1: lossless), in one chunk."""

    def __init__(self, scale):
        self.scale = scale

    def encode_chunks(self, kv):
        from types import SimpleNamespace

        self.kv = kv
        return [SimpleNamespace(blobs=[b"x" * (kv.numel() // 2)], start_token=0, tokens=kv.shape[2])]

    def decode_chunk(self, blob, out):
        out.copy_(self.kv * self.scale)


def test_report_scores_the_whole_continuation_from_predictions_alone(tmp_path):
    from kvcodec.models.check import inspect_model
    from kvcodec.models.quality import QUALITY_CONT, measure_model

    assert QUALITY_CONT >= 512  # 3 held-out texts x 128 tokens could not resolve top-1 to 0.01 (issue 23)
    model = _tiny_llama()
    model.save_pretrained(tmp_path)
    layout = inspect_model(str(tmp_path))
    ids = [torch.arange(40) % 64, (torch.arange(36) * 7) % 64]
    lossless = measure_model(model, layout, ids, lambda r: _Kept(1.0), [4.0], prefix=16, cont=20)
    assert lossless == [{"target": 4.0, "ratio": 4.0, "top1": 1.0, "ppl_delta_pct": 0.0, "tokens": 40}]
    lost = measure_model(model, layout, ids, lambda r: _Kept(0.0), [4.0], prefix=16, cont=20)[0]
    assert lost["tokens"] == 40 and (lost["top1"] < 1.0 or lost["ppl_delta_pct"] != 0.0)
