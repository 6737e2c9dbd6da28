"""Covariance estimators of the calibration (sample, Ledoit-Wolf toward the diagonal) and the
calibrate command's default text set."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcodec.errors import ConfigError
from kvcodec.transform import pca


def _intensity_by_definition(c: torch.Tensor) -> float:
    """Schaefer-Strimmer target D, written entry by entry (w_kij = c_ki c_kj)."""
    n, d = c.shape
    w = c[:, :, None] * c[:, None, :]  # (n, d, d)
    w_bar = w.mean(0)
    s = w_bar * n / (n - 1)
    var_s = n / (n - 1) ** 3 * ((w - w_bar) ** 2).sum(0)
    off = ~torch.eye(d, dtype=torch.bool)
    return min(1.0, max(0.0, float(var_s[off].sum() / (s[off] ** 2).sum())))


@settings(max_examples=40, deadline=None)
@given(n=st.integers(3, 40), d=st.integers(2, 12), mix=st.floats(0.0, 2.0), seed=st.integers(0, 2**31))
def test_shrinkage_intensity_matches_its_definition_and_stays_in_0_1(n, d, mix, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d, generator=g, dtype=torch.float64)
    x = x + mix * x[:, :1]  # correlation with the first coordinate
    c = x - x.mean(0)
    lam = pca.shrinkage_intensity(c)
    assert 0.0 <= lam <= 1.0
    assert lam == pytest.approx(_intensity_by_definition(c), rel=1e-9, abs=1e-12)


@settings(max_examples=30, deadline=None)
@given(n=st.integers(3, 60), d=st.integers(1, 16), seed=st.integers(0, 2**31))
def test_ledoit_wolf_keeps_the_variances_and_shrinks_only_covariances(n, d, seed):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, d, generator=g, dtype=torch.float64) @ torch.randn(d, d, generator=g, dtype=torch.float64)
    c = x - x.mean(0)
    s, lw = pca.sample_covariance(c), pca.ledoit_wolf_covariance(c)
    assert torch.allclose(torch.diagonal(lw), torch.diagonal(s))
    assert torch.allclose(lw, lw.T)
    lam = pca.shrinkage_intensity(c) if d > 1 else 0.0
    off = ~torch.eye(d, dtype=torch.bool)
    assert torch.allclose(lw[off], (1 - lam) * s[off])
    assert float(torch.linalg.eigvalsh(lw).min()) >= -1e-9 * float(torch.diagonal(s).max())  # still PSD
    mean, basis, var = pca.fit_pca(x, "ledoit-wolf")
    assert torch.allclose(basis.T @ basis, torch.eye(d, dtype=torch.float64), atol=1e-8)
    assert (var[:-1] >= var[1:] - 1e-9).all()


def test_shrinkage_is_strong_for_independent_data_and_weak_for_correlated_data():
    g = torch.Generator().manual_seed(0)
    indep = torch.randn(50, 40, generator=g, dtype=torch.float64) * torch.linspace(0.5, 2.0, 40, dtype=torch.float64)
    shared = torch.randn(5000, 1, generator=g, dtype=torch.float64)
    corr = shared + 0.3 * torch.randn(5000, 40, generator=g, dtype=torch.float64)
    assert pca.shrinkage_intensity(indep - indep.mean(0)) > 0.5
    assert pca.shrinkage_intensity(corr - corr.mean(0)) < 0.01


def test_ledoit_wolf_is_closer_to_the_true_covariance_when_samples_are_few():
    g = torch.Generator().manual_seed(1)
    d = 60
    a = torch.randn(d, d, generator=g, dtype=torch.float64) * 0.1 + torch.diag(torch.linspace(0.5, 3, d))
    true = a @ a.T
    wins = 0
    for _ in range(5):
        x = torch.randn(40, d, generator=g, dtype=torch.float64) @ a.T
        c = x - x.mean(0)
        wins += float((pca.ledoit_wolf_covariance(c) - true).norm()) < float((pca.sample_covariance(c) - true).norm())
    assert wins == 5


def test_unknown_covariance_estimator_is_refused():
    with pytest.raises(ConfigError, match="covariance estimator"):
        pca.fit_pca(torch.randn(10, 3), "shrunk")


def test_default_calibration_texts_mix_kinds_and_exclude_the_evaluation_texts():
    from kvcodec.cli.calibrate import DEFAULT_TEXTS, HOLDOUT_TEXTS
    from kvcodec.transform import calibration as c

    pools = (*c.CALIBRATION_POOL, *c.CODE_POOL, *c.DOC_POOL)
    assert len(c.HELD_OUT_TEXTS) == 8 and not set(pools) & {*c.HELD_OUT_TEXTS, *c.KIND_EVAL_TEXTS}
    assert len(set(pools)) == len(pools)
    assert set(DEFAULT_TEXTS) <= set(pools) and len(DEFAULT_TEXTS) >= 4 and not set(HOLDOUT_TEXTS) & set(DEFAULT_TEXTS)
    assert [t.split("/")[0] for t in DEFAULT_TEXTS[:3]] == ["pg", "py", "doc"]  # the Fisher's first texts: every kind
    assert c.mixed_texts(3, 1, 0) == ("pg/addiction", "py/textwrap", "pg/aord", "pg/apple")
    with pytest.raises(ConfigError, match="pools hold"):
        c.mixed_texts(0, len(c.CODE_POOL) + 1, 0)


def test_calibrate_command_uses_the_default_texts_without_texts(tmp_path):
    from click.testing import CliRunner

    from kvcodec.cli.calibrate import DEFAULT_TEXTS, HOLDOUT_TEXTS, command
    from kvcodec.transform import load_kvt

    out = tmp_path / "m.kvt"
    args = ["--model", "smollm2-135m", "--max-tokens", "128", "--weights", "mse", "--out", str(out)]
    res = CliRunner().invoke(command, [*args, "--covariance", "ledoit-wolf", "--report-ratios", "5"])
    assert res.exit_code == 0, res.output
    cal, _ = load_kvt(out)
    assert cal.info["sources"] == list(DEFAULT_TEXTS)
    assert cal.info["quality"]["held_out"] == list(HOLDOUT_TEXTS) and not set(HOLDOUT_TEXTS) & set(DEFAULT_TEXTS)
    assert [p["target"] for p in cal.info["quality"]["points"]] == [5.0]
    assert cal.info["covariance"] == "ledoit-wolf"
    assert cal.info["tokens"] == sum(min(128, n) - 4 for n in _token_counts(DEFAULT_TEXTS))


def _token_counts(names):
    from kvcodec.models import load_model
    from kvcodec.models.texts import load_text

    _, tok = load_model("smollm2-135m")
    return [len(tok(load_text(n)).input_ids) for n in names]


def test_calibrate_command_refuses_texts_without_a_model(tmp_path):
    from click.testing import CliRunner
    from safetensors.torch import save_file

    from kvcodec.cli.calibrate import command

    save_file({"kv": torch.randn(2, 2, 300, 1, 8)}, str(tmp_path / "k.safetensors"))
    res = CliRunner().invoke(command, [str(tmp_path / "k.safetensors"), "--texts", "pg/aord", "--out", "x.kvt"])
    assert res.exit_code != 0 and "--texts needs --model" in res.output


def test_the_fisher_on_the_extractions_prefix_kv_is_the_fisher():
    """calibrate --model hands the Fisher the KV its extraction computed for the first 512 tokens
    instead of running them again: the same weights."""
    from kvcodec.integrations.hf_fisher import fisher_diagonal
    from kvcodec.kvspec.hf import split_cache
    from kvcodec.models.extract import prefill_recorded
    from test_transform_codec import tiny_llama_and_ids

    model, ids = tiny_llama_and_ids()
    _, cache = prefill_recorded(model, ids, chunk_tokens=32, all_logits=False)
    kv = split_cache(cache, model.config).tensors[0]
    plain = fisher_diagonal(model, [ids], 32, sink_tokens=2)
    assert torch.equal(fisher_diagonal(model, [ids], 32, sink_tokens=2, prefix_kvs=[kv[:, :, :32].clone()]), plain)
    with pytest.raises(ConfigError, match="positions"):
        fisher_diagonal(model, [ids], 32, prefix_kvs=[kv[:, :, :31]])
    with pytest.raises(ConfigError, match="prefix KVs"):
        fisher_diagonal(model, [ids, ids], 32, prefix_kvs=[kv[:, :, :32]])
