"""Pure parts of the engine and server: EngineConfig, the fetch deadline, request checks."""

from __future__ import annotations

import math

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvcodec.engine import EngineConfig, SamplingParams
from kvcodec.engine.deadline import MIN_SAMPLE_TOKENS, PrefillRate, ema, recompute_seconds
from kvcodec.engine.validate import check_context, check_sampling, check_token_ids
from kvcodec.errors import ConfigError
from kvcodec.server.schema import BadRequestError, parse_chat, parse_completion


def test_config_from_kwargs_replaces_fields_and_refuses_unknown_names():
    cfg = EngineConfig.from_kwargs(None, max_batch=3, fetch_deadline_s=0.5)
    assert cfg.max_batch == 3 and cfg.fetch_deadline_s == 0.5 and cfg.policy == "fetch-aware"
    assert EngineConfig.from_kwargs(cfg, policy="blocking").max_batch == 3
    with pytest.raises(ConfigError, match="prefix_cache_options"):
        EngineConfig.from_kwargs(None, prefix_cache_options={})
    with pytest.raises(AttributeError):
        cfg.max_batch = 4  # frozen


@pytest.mark.parametrize(
    "kw",
    [
        {"policy": "lifo"},
        {"max_batch": 0},
        {"prefill_chunk_tokens": 0},
        {"store_queue": 0},
        {"fetch_deadline_s": -1},
        {"fetch_deadline_s": "soon"},
        {"max_context": 1},
        {"stall_s": 0},
        {"sdpa_backends": ()},
        {"sdpa_backends": ("flash", "fast")},
        {"sdpa_backends": "flash"},
        {"store_policy": "off"},  # failed later, deep in Engine, as an AttributeError
        {"store_policy": None},
    ],
)
def test_config_refuses_bad_values(kw):
    with pytest.raises(ConfigError):
        EngineConfig(**kw)


@pytest.mark.parametrize("writable", [True, False])
def test_the_engines_prefix_cache_drops_damaged_chunks_only_where_the_store_takes_writes(writable):
    from types import SimpleNamespace

    import torch

    from kvcodec.engine.prefix import open_prefix_cache

    model = SimpleNamespace(_kvcodec_model_id="m")  # the id is all the cache needs of a model
    store, cache = open_prefix_cache(EngineConfig(store_writable=writable, codec="raw"), model, torch.device("cpu"))
    assert cache.drop_damaged is writable


def test_a_lone_long_prompt_is_prefilled_in_one_forward_by_default():
    """Pieces of a prompt attend to the cache through a dense mask (no causal kernel): the default
    lets a prompt as long as a 32k-context model's whole window through in one forward."""
    cfg = EngineConfig()
    assert cfg.max_prefill_tokens >= 32768 + 512 and cfg.prefill_chunk_tokens <= cfg.max_prefill_tokens


def test_attention_leaves_out_cudnn_by_default_and_restricts_torch_inside_forwards():
    torch = pytest.importorskip("torch")
    from kvcodec.engine.runner import sdpa_context

    assert "cudnn" not in EngineConfig().sdpa_backends
    assert EngineConfig(sdpa_backends=None).sdpa_backends is None
    before = torch.backends.cuda.flash_sdp_enabled(), torch.backends.cuda.math_sdp_enabled()
    with sdpa_context(("math",))():
        assert torch.backends.cuda.math_sdp_enabled() and not torch.backends.cuda.flash_sdp_enabled()
        assert not torch.backends.cuda.cudnn_sdp_enabled()
    assert (torch.backends.cuda.flash_sdp_enabled(), torch.backends.cuda.math_sdp_enabled()) == before
    with sdpa_context(None)():
        assert (torch.backends.cuda.flash_sdp_enabled(), torch.backends.cuda.math_sdp_enabled()) == before


@given(st.integers(0, 10**6), st.floats(1e-3, 1e6))
def test_recompute_seconds_is_tokens_over_rate(tokens, rate):
    s = recompute_seconds(tokens, rate)
    assert s >= 0 and math.isclose(s * rate, tokens, rel_tol=1e-9, abs_tol=1e-9)


@given(st.floats(0, 1e6), st.floats(0, 1e6), st.floats(0, 1))
def test_ema_stays_between_previous_and_sample(prev, sample, alpha):
    v = ema(prev, sample, alpha)
    assert min(prev, sample) - 1e-6 <= v <= max(prev, sample) + 1e-6
    assert ema(None, sample, alpha) == sample


def test_prefill_rate_gives_the_recompute_time_as_deadline():
    rate = PrefillRate(min_deadline_s=0.01)
    assert rate.deadline_s(1000) is None  # nothing measured yet
    rate.observe(MIN_SAMPLE_TOKENS - 1, 0.001)  # too short to say anything
    assert rate.deadline_s(1000) is None
    rate.observe(200, 1.0)  # 200 tokens/s
    assert math.isclose(rate.deadline_s(1000), 5.0)
    assert rate.deadline_s(1) == 0.01  # floor
    rate.observe(400, 1.0)
    assert 200 < rate.tokens_per_s < 400


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(max_new_tokens=0),
        SamplingParams(temperature=-0.1),
        SamplingParams(temperature=float("nan")),
        SamplingParams(top_p=0.0),
        SamplingParams(top_p=1.01),
        SamplingParams(seed=-1),
    ],
)
def test_check_sampling_refuses(params):
    with pytest.raises(ConfigError):
        check_sampling(params)


@settings(max_examples=60, deadline=None)
@given(
    st.floats(1e-45, 1e3),
    st.one_of(st.just(1.0), st.floats(1e-50, 1.0, exclude_min=False)),
    st.integers(0, 2**31 - 1),
)
def test_sampling_draws_a_token_at_any_temperature_and_top_p_the_checks_pass(temperature, top_p, seed):
    """A temperature of 1e-39 overflowed logits / T to inf (NaN probabilities) and a top_p below
    float32's least value kept no token: torch.multinomial raised inside the engine's step."""
    import torch

    from kvcodec.engine.runner import sample

    params = SamplingParams(temperature=temperature, top_p=top_p)
    check_sampling(params)
    logits = torch.randn(50, generator=torch.Generator().manual_seed(seed)) * 30
    token = sample(logits, params, torch.Generator().manual_seed(seed))
    assert 0 <= token < 50
    if temperature < 1e-30 or top_p < 1e-30:
        assert token == int(torch.argmax(logits))


def test_check_tokens_and_context():
    check_token_ids([0, 5, 9], 10)
    for bad in ([10], [-1], [1.0], [True]):
        with pytest.raises(ConfigError, match="token 0"):
            check_token_ids(bad, 10)
    check_context(10, 6, 16)
    for n, m in ((0, 1), (16, 1), (10, 7)):
        with pytest.raises(ConfigError):
            check_context(n, m, 16)


TOKEN_LIKE = st.one_of(st.integers(-3, 12), st.booleans(), st.floats(0, 9), st.sampled_from(["a", None]))


@given(ids=st.lists(TOKEN_LIKE, max_size=12), vocab=st.one_of(st.none(), st.integers(1, 12)))
def test_check_token_ids_refuses_exactly_the_first_bad_id(ids, vocab):
    first_bad = next(
        (i for i, t in enumerate(ids) if type(t) is not int or t < 0 or (vocab is not None and t >= vocab)), None
    )
    if first_bad is None:
        check_token_ids(ids, vocab)
    else:
        with pytest.raises(ConfigError, match=f"token {first_bad} "):
            check_token_ids(ids, vocab)


_json = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=5),
    lambda c: st.lists(c, max_size=3) | st.dictionaries(st.text(max_size=5), c, max_size=3),
    max_leaves=8,
)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.dictionaries(
        st.sampled_from(
            ["prompt", "messages", "max_tokens", "temperature", "top_p", "stop", "seed", "stream", "n", "model"]
        ),
        _json,
        max_size=6,
    )
)
def test_parsers_accept_or_raise_bad_request_only(body):
    for parse in (parse_completion, parse_chat):
        try:
            g = parse(body)
        except BadRequestError as e:
            assert str(e)
            continue
        p = g.params
        assert p.max_new_tokens >= 1 and p.temperature >= 0 and 0 < p.top_p <= 1
        assert all(isinstance(s, str) and s for s in g.stop)
        if not g.chat:
            assert isinstance(g.prompt, str) and g.prompt or all(type(t) is int for t in g.prompt)
        else:
            assert g.messages and all(isinstance(c, str) for _, c in g.messages)


@pytest.mark.parametrize(
    "field,asks,asks_nothing",
    [
        ("logprobs", 5, False),
        ("logprobs", 0, None),
        ("echo", True, False),
        ("best_of", 3, 1),
        ("suffix", "end", ""),
        ("presence_penalty", 0.5, 0.0),
        ("response_format", {"type": "json_object"}, {"type": "text"}),
    ],
)
def test_fields_the_server_would_ignore_are_refused_unless_they_ask_for_nothing(field, asks, asks_nothing):
    # logprobs: 5 was answered with "logprobs": null and a 200; echo, best_of and suffix had no effect
    for parse, body in ((parse_completion, {"prompt": "Hi"}), (parse_chat, {"messages": [{"content": "Hi"}]})):
        with pytest.raises(BadRequestError, match=f"{field} is not supported") as e:
            parse({**body, field: asks})
        assert e.value.param == field
        parse({**body, field: asks_nothing})
