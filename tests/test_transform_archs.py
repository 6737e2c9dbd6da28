"""The transform codec for the model a user brings: random-weight model directories of every
architecture the engine serves (Llama, Qwen2, Qwen3, Mistral with a sliding window, Gemma-2 and
Gemma-3 with RoPE per layer type, DeepSeek-V2 MLA, GPT-2 without RoPE, GPT-J with RoPE its config
does not name), each with a real tokenizer. For each:
`extract`, `calibrate --model DIR`, `encode --transform`, `decode --transform` through the CLI; a
model kvcodec cannot code fails from its config, before any weights load."""

from __future__ import annotations

import json
import math

import pytest
from click.testing import CliRunner

from kvcodec.errors import ConfigError, FormatError, ShapeError

transformers = pytest.importorskip("transformers")
from test_model_archs import conv_config, mla_config  # noqa: E402

pytestmark = pytest.mark.slow  # a real tokenizer and tiny models (about a minute on 2 CPUs)

WINDOW = 24
SMALL = dict(hidden_size=64, intermediate_size=96, num_attention_heads=4, max_position_embeddings=2048)
TEXTS = "pg/addiction,pg/aord,pg/apple,pg/avg"  # three fitted, the last held out (one in eight, at least one)
RATIOS = ("--report-ratios", "3,5")  # the quality report at two ratios keeps each calibration to seconds


def _configs(vocab: int) -> dict[str, object]:
    kw = dict(vocab_size=vocab, **SMALL)
    return {
        "llama": transformers.LlamaConfig(num_hidden_layers=2, num_key_value_heads=2, **kw),
        "qwen2": transformers.Qwen2Config(num_hidden_layers=2, num_key_value_heads=2, **kw),
        "qwen3": transformers.Qwen3Config(num_hidden_layers=2, num_key_value_heads=2, head_dim=16, **kw),
        "mistral": transformers.MistralConfig(num_hidden_layers=2, num_key_value_heads=2, sliding_window=WINDOW, **kw),
        "gemma2": transformers.Gemma2Config(
            num_hidden_layers=2,
            num_key_value_heads=2,
            head_dim=16,
            query_pre_attn_scalar=16,
            sliding_window=WINDOW,
            **kw,
        ),
        "gemma3": transformers.Gemma3TextConfig(
            num_hidden_layers=3,
            num_key_value_heads=1,
            head_dim=32,
            query_pre_attn_scalar=32,
            sliding_window=WINDOW,
            layer_types=["sliding_attention", "sliding_attention", "full_attention"],
            rope_parameters={
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
                "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1000000.0},
            },
            **kw,
        ),
        "deepseek_v2": mla_config(**kw),
        "lfm2": conv_config(**kw),
        "gpt2": transformers.GPT2Config(vocab_size=vocab, n_embd=64, n_head=4, n_layer=2, n_positions=2048),
        "gptj": transformers.GPTJConfig(
            vocab_size=vocab, n_embd=64, n_head=4, n_layer=2, rotary_dim=8, n_positions=2048
        ),
    }


GROUPS = {
    "llama": ["full-kv-2x16"],
    "qwen2": ["full-kv-2x16"],
    "qwen3": ["full-kv-2x16"],
    "mistral": [f"sliding{WINDOW - 1}-kv-2x16"],
    "gemma2": [f"sliding{WINDOW - 1}-kv-2x16", "full-kv-2x16"],
    "gemma3": [f"sliding{WINDOW - 1}-kv-1x32", "full-kv-1x32"],
    "deepseek_v2": ["mla-latent-1x16", "mla-rope-1x4"],
    "gpt2": ["full-kv-4x16"],  # learned absolute positions: no RoPE to remove
    "gptj": ["full-kv-4x16"],  # RoPE fixed in transformers' code (base 10000, interleaved, rotary_dim)
}


@pytest.fixture(scope="module")
def tokenizer(smollm2_tokenizer):
    return smollm2_tokenizer


@pytest.fixture(scope="module")
def model_dirs(random_model_dirs, tokenizer):
    """arch -> a local model directory (random weights, seeded) with the tokenizer saved beside."""
    return random_model_dirs(_configs(len(tokenizer)), seed=2000)


@pytest.fixture(scope="module")
def gemma3_kvt(model_dirs, tmp_path_factory):
    """A grouped .kvt of the Gemma-3-style model (sliding and full layers, RoPE per layer type)."""
    kvt = tmp_path_factory.mktemp("gemma3") / "g.kvt"
    res = _cli(
        "calibrate", "--model", model_dirs["gemma3"], "--texts", TEXTS, "--max-tokens", 200, "--out", kvt, *RATIOS
    )
    assert res.exit_code == 0, res.output
    return kvt


def _cli(*args):
    from kvcodec.cli.main import cli

    return CliRunner().invoke(cli, [str(a) for a in args])


def test_layouts_come_from_the_config_with_rope_per_layer_type(model_dirs):
    from kvcodec.models.check import inspect_model

    for arch, names in GROUPS.items():
        layout = inspect_model(str(model_dirs[arch]))
        assert [g.name for g in layout.spec.groups] == names, arch
    gemma = inspect_model(str(model_dirs["gemma3"]))
    local, glob = gemma.ropes[0], gemma.ropes[2]
    assert (local.theta, local.scaling) == (10000.0, "default")
    assert (glob.theta, glob.scaling, glob.factor) == (1000000.0, "linear", 8.0)
    assert [gemma.group_rope(g) for g in gemma.spec.groups] == [local, glob]
    assert inspect_model(str(model_dirs["deepseek_v2"])).ropes == (None, None)


def test_a_model_kvcodec_cannot_code_fails_from_its_config_before_loading(model_dirs, tmp_path):
    from kvcodec.models.check import inspect_model

    folder = model_dirs["lfm2"]
    with pytest.raises(ShapeError, match="cache layer 0 is a LinearAttentionLayer"):
        inspect_model(str(folder))
    broken = tmp_path / "lfm2-no-weights"  # the config alone: loading weights would fail differently
    broken.mkdir()
    (broken / "config.json").write_text((folder / "config.json").read_text())
    for args in (
        ["calibrate", "--model", broken, "--out", tmp_path / "m.kvt"],
        ["extract", "--model", broken, "--text", "pg/addiction", tmp_path / "kv.safetensors"],
    ):
        res = _cli(*args)
        assert res.exit_code != 0 and "LinearAttentionLayer" in res.output, res.output
    with pytest.raises(ConfigError, match="neither a registered name"):
        inspect_model(str(tmp_path / "missing.gguf"))
    with pytest.raises(ConfigError, match="no config.json"):
        inspect_model(str(tmp_path))
    bad = json.loads((model_dirs["llama"] / "config.json").read_text())
    bad["rope_parameters"] = {"rope_type": "no-such-scaling", "rope_theta": 10000.0}
    (tmp_path / "config.json").write_text(json.dumps(bad))
    with pytest.raises(ConfigError, match="no-such-scaling"):
        inspect_model(str(tmp_path))


@pytest.mark.parametrize("arch", sorted(GROUPS))
def test_extract_calibrate_encode_decode(arch, model_dirs, tmp_path):
    from kvcodec.codecs.transform.codec import kvt_info
    from kvcodec.kvspec.files import load_kv_file

    folder, kvt, kv_file = model_dirs[arch], tmp_path / "m.kvt", tmp_path / "kv.safetensors"
    res = _cli("extract", "--model", folder, "--text", "pg/web20", "--max-tokens", 160, kv_file)
    assert res.exit_code == 0, res.output
    res = _cli("calibrate", "--model", folder, "--texts", TEXTS, "--max-tokens", 200, "--out", kvt, *RATIOS)
    assert res.exit_code == 0, res.output
    assert "held-out quality (pg/avg)" in res.output and "per-channel fallback" in res.output
    assert "calibrate: fitting the bases" in res.output and " held out (" in res.output  # progress of a long job
    report = kvt_info(kvt)["quality"]
    assert report["metric"] == "model" and [p["target"] for p in report["points"]] == [3.0, 5.0]
    assert all(0 <= p["top1"] <= 1 and math.isfinite(p["ppl_delta_pct"]) for p in report["points"])
    res = _cli(
        "encode", kv_file, tmp_path / "kv.kvc", "--transform", kvt, "--target-ratio", 4, "--sample-coder", "zstd"
    )
    assert res.exit_code == 0, res.output
    res = _cli("decode", tmp_path / "kv.kvc", tmp_path / "out.safetensors", "--transform", kvt)
    assert res.exit_code == 0, res.output
    kv, _ = load_kv_file(kv_file)
    out, _ = load_kv_file(tmp_path / "out.safetensors")
    pairs = zip(kv.tensors, out.tensors) if hasattr(kv, "spec") else [(kv, out)]
    if hasattr(kv, "spec"):
        assert [g.name for g in kv.spec.groups] == GROUPS[arch] and out.spec == kv.spec
    for a, b in pairs:
        a, b = a.float(), b.float()
        assert a.shape == b.shape and (a - b).pow(2).mean() < 0.1 * a.pow(2).mean(), arch  # ~4 bits per value


def test_target_quality_picks_the_highest_ratio_that_met_it_and_a_ratio_beyond_warns(model_dirs, tmp_path):
    from kvcodec.codecs.transform.codec import kvt_info
    from kvcodec.transform.quality import ratio_for

    folder, kvt = model_dirs["gemma3"], tmp_path / "g.kvt"
    assert _cli("calibrate", "--model", folder, "--texts", TEXTS, "--max-tokens", 200, "--out", kvt).exit_code == 0
    assert (
        _cli(
            "extract", "--model", folder, "--text", "pg/web20", "--max-tokens", 120, tmp_path / "kv.safetensors"
        ).exit_code
        == 0
    )
    report = kvt_info(kvt)["quality"]
    worst = min(p["ppl_delta_pct"] for p in report["points"])
    want = ratio_for(report, f"ppl={max(worst, 0) + 100}")  # every ratio meets a loose bound: the highest
    assert want == max(p["target"] for p in report["points"])
    res = _cli(
        "encode", tmp_path / "kv.safetensors", tmp_path / "a.kvc", "--transform", kvt, "--sample-coder", "zstd",
        "--target-quality", f"ppl={max(worst, 0) + 100}",
    )  # fmt: skip
    assert res.exit_code == 0 and f"ratio {want:g}" in res.output, res.output
    res = _cli(
        "encode", tmp_path / "kv.safetensors", tmp_path / "b.kvc", "--transform", kvt, "--sample-coder", "zstd",
        "--target-quality", "top1=1.01",
    )  # fmt: skip
    assert res.exit_code != 0 and "no calibrated ratio met top1" in res.output, res.output
    safe = report.get("safe_ratio") or 0
    res = _cli(
        "encode", tmp_path / "kv.safetensors", tmp_path / "c.kvc", "--transform", kvt, "--sample-coder", "zstd",
        "--target-ratio", max(safe, 10) + 2,
    )  # fmt: skip
    assert res.exit_code == 0 and "warning: --target-ratio" in res.output, res.output


def test_grouped_kvt_parts_are_checked(model_dirs, tmp_path):
    from kvcodec.transform.grouped_kvt import grouped_from_bytes

    kvt = tmp_path / "m.kvt"
    assert (
        _cli(
            "calibrate", "--model", model_dirs["deepseek_v2"], "--texts", TEXTS, "--max-tokens", 200, "--out", kvt
        ).exit_code
        == 0
    )
    data = bytearray(kvt.read_bytes())
    spec, parts, info = grouped_from_bytes(bytes(data))
    assert list(parts) == GROUPS["deepseek_v2"] and len({h for _, h in parts.values()}) == 2 and "quality" in info
    shown = json.loads(_cli("inspect", kvt, "--json").output)
    assert shown["format"] == "kvcodec-transform-grouped" and list(shown["parts"]) == GROUPS["deepseek_v2"]
    assert [p["sha256"] for p in shown["parts"].values()] == [h for _, h in parts.values()]
    assert "kv          part " in _cli("inspect", kvt).output
    data[-20] ^= 0xFF  # inside the last part's bytes
    with pytest.raises(FormatError, match="sha256|damaged"):
        grouped_from_bytes(bytes(data))


def test_engine_stores_and_restores_grouped_kv_with_the_grouped_transform(model_dirs, gemma3_kvt):
    """Gemma-3 style (sliding + full layers, RoPE per layer type): the engine stores prefixes with the
    grouped .kvt's transforms and a later prompt restores them; a .kvt of another model is refused."""
    from kvcodec.codecs import make_codec
    from kvcodec.engine import Engine

    codec = make_codec("transform", transform=str(gemma3_kvt), target_quality="ppl=100", coder="zstd", chunk_tokens=16)
    assert codec.per_group["full-kv-1x32"].target_ratio == 5.0  # the highest reported ratio meeting the bound
    tok = transformers.AutoTokenizer.from_pretrained(str(model_dirs["gemma3"]))
    from kvcodec.models.texts import load_text

    ids = tok(load_text("pg/web20", max_chars=800)).input_ids[:60]
    with Engine(
        str(model_dirs["gemma3"]), store_url="memory://", device="cpu", codec=codec, fetch_deadline_s=None
    ) as eng:
        eng.generate(ids, max_new_tokens=4, wait_for_store=True)
        again = eng.generate(ids[:40] + [ids[3]], max_new_tokens=4)[0]
    assert again.restored_tokens == 32 and again.fetch_error is None and len(again.token_ids) == 4
    with pytest.raises(ShapeError, match="not for KV group"):
        codec.codec_for(inspect_groups(model_dirs["mistral"])[0])


def inspect_groups(folder):
    from kvcodec.models.check import inspect_model

    return inspect_model(str(folder)).spec.groups


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_a_grouped_transform_fetch_stages_each_group_and_finishes_it_once_for_many_chunks(
    model_dirs, gemma3_kvt, tmp_path, device
):
    """Gemma-3 style KV through GroupedPrefixCache with the grouped .kvt: staged (on CUDA by default, asked for
    on the CPU), each group's chunks are finished in one call of its codec, and the KV equals the CPU's
    unstaged fetch's, a last chunk reaching past the target included (decoded whole, copied by the finish)."""
    import torch

    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")

    from kvcodec.codecs import make_codec
    from kvcodec.codecs.transform.codec import TransformCodec
    from kvcodec.fetcher.grouped import GroupedPrefixCache
    from kvcodec.kvspec.files import load_kv_file
    from kvcodec.store import open_store

    kv_file = tmp_path / "kv.safetensors"
    assert (
        _cli("extract", "--model", model_dirs["gemma3"], "--text", "pg/web20", "--max-tokens", 80, kv_file).exit_code
        == 0
    )
    kv, _ = load_kv_file(kv_file)
    codec = make_codec("transform", transform=str(gemma3_kvt), target_ratio=4.0, coder="zstd", chunk_tokens=16)
    assert codec.stages
    store, ids = open_store("memory://"), list(range(500, 580))

    def cache(batched, on="cpu"):
        return GroupedPrefixCache(store, "gemma3", codec, on, spec=kv.spec, batched_restore=batched)

    cache(False).put(ids, kv)
    finishes = []
    finish = TransformCodec.finish

    def counted(self, staged, outs):
        finishes.append(len(staged))
        return finish(self, staged, outs)

    for n in (80, 40):  # 40: chunk 2 holds tokens 32..47
        TransformCodec.finish = counted
        try:
            staged = cache(True if device == "cpu" else None, device).fetch(ids, n)
        finally:
            TransformCodec.finish = finish
        plain = cache(False).fetch(ids, n)
        assert staged.ok and plain.ok and staged.tokens_restored == plain.tokens_restored == n
        # both groups' chunks within the target staged and finished; on CUDA (driven) the chunk reaching past it
        # too, into memory of its own whose fitting positions the finish copies
        assert sum(finishes) == 2 * (-(-n // 16) if device == "cuda" else n // 16), finishes
        finishes.clear()
        for a, b, c in zip(staged.kv.tensors, plain.kv.tensors, kv.view(0, n).tensors):
            assert torch.allclose(a.float().cpu(), b.float(), atol=1e-3, rtol=1e-3)
            assert (a.float().cpu() - c.float()).pow(2).mean() < 0.1 * c.float().pow(2).mean()
