"""KVSpec, its layer groups and GroupedKV: pure split/merge math (hypothesis) and bad input."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcodec.errors import FormatError, KVCodecError, ShapeError
from kvcodec.kvspec import GroupedKV, KVSpec, LayerSpec, pack_groups, unpack_groups

DTYPES = {"float16": torch.float16, "bfloat16": torch.bfloat16, "float32": torch.float32}


@st.composite
def layer_specs(draw):
    kind = draw(st.sampled_from(["full", "sliding", "mla"]))
    heads = draw(st.integers(1, 3))
    dim = draw(st.sampled_from([2, 4, 6, 8]))
    if kind == "mla" or draw(st.booleans()) is False:  # K and V of different shapes
        k = (draw(st.integers(1, 3)), draw(st.sampled_from([2, 4, 8])))
        v = (draw(st.integers(1, 3)), draw(st.sampled_from([2, 4, 6])))
    else:
        k = v = (heads, dim)
    keep = draw(st.integers(1, 12)) if kind == "sliding" else None
    return LayerSpec(kind, k, v, keep)


specs = st.builds(
    lambda layers, dtype: KVSpec(tuple(layers), dtype),
    st.lists(layer_specs(), min_size=1, max_size=6),
    st.sampled_from(sorted(DTYPES)),
)


def _pairs(spec: KVSpec, tokens: int, seed: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    dtype = DTYPES[spec.dtype]
    rnd = lambda shape: torch.randn(tokens, *shape, generator=g).to(dtype)  # noqa: E731
    return [(rnd(layer.k_shape), rnd(layer.v_shape)) for layer in spec.layers]


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view({2: torch.int16, 4: torch.int32}[t.element_size()])


@settings(max_examples=80, deadline=None)
@given(spec=specs, tokens=st.integers(1, 9), seed=st.integers(0, 2**16))
def test_pack_unpack_roundtrip(spec, tokens, seed):
    pairs = _pairs(spec, tokens, seed)
    tensors = pack_groups(spec, pairs)
    for g, t in zip(spec.groups, tensors):
        assert tuple(t.shape) == g.shape(tokens)
    back = unpack_groups(spec, tensors)
    for (k, v), (k2, v2) in zip(pairs, back):
        assert torch.equal(_bits(k), _bits(k2)) and torch.equal(_bits(v), _bits(v2))
    again = pack_groups(spec, back)
    assert all(torch.equal(_bits(a), _bits(b)) for a, b in zip(tensors, again))


@settings(max_examples=80, deadline=None)
@given(spec=specs)
def test_groups_cover_every_stream_once_and_are_uniform(spec):
    seen = {}
    for g in spec.groups:
        for i in g.layers:
            layer = spec.layers[i]
            assert (layer.kind, layer.keep) == (g.kind, g.keep)
            streams = ("k", "v") if g.stream == "kv" else (g.stream,)
            for s in streams:
                assert (i, s) not in seen
                seen[i, s] = g
                shape = layer.k_shape if s == "k" else layer.v_shape
                assert shape == (g.heads, g.stream_dim)
    assert set(seen) == {(i, s) for i in range(len(spec.layers)) for s in ("k", "v")}
    assert len({g.name for g in spec.groups}) == len(spec.groups)


@settings(max_examples=50, deadline=None)
@given(spec=specs)
def test_spec_dict_roundtrip(spec):
    assert KVSpec.from_dict(spec.to_dict()) == spec


@pytest.mark.parametrize(
    "bad",
    [
        None,
        {},
        {"version": 2, "dtype": "float16", "layers": []},
        {"version": 1, "dtype": "float16", "layers": "x"},
        {"version": 1, "dtype": "int8", "layers": [{"kind": "full", "k": [1, 2], "v": [1, 2]}]},
        {"version": 1, "dtype": "float16", "layers": [{"kind": "sliding", "k": [1, 2], "v": [1, 2]}]},
        {"version": 1, "dtype": "float16", "layers": [{"kind": "swa", "k": [1, 2], "v": [1, 2]}]},
        {"version": 1, "dtype": "float16", "layers": [{"kind": "full", "k": [0, 2], "v": [1, 2]}]},
    ],
)
def test_bad_spec_dicts_are_format_errors(bad):
    with pytest.raises(FormatError):
        KVSpec.from_dict(bad)


def test_odd_dim_of_a_lone_stream_is_a_clear_error():
    with pytest.raises(ShapeError, match="odd dim 5"):
        KVSpec((LayerSpec("full", (1, 5), (1, 4)),), "float16")


def test_mla_groups_are_latent_and_rope():
    spec = KVSpec((LayerSpec("mla", (1, 512), (1, 64)),) * 3, "bfloat16")
    assert [g.name for g in spec.groups] == ["mla-latent-1x256", "mla-rope-1x32"]
    assert [g.layers for g in spec.groups] == [(0, 1, 2), (0, 1, 2)]


@st.composite
def held_kv(draw):
    spec = draw(specs)
    stop = draw(st.integers(1, 20))
    full = GroupedKV.empty(spec, stop, window=False)
    for t in full.tensors:
        t.copy_(torch.randn(t.shape).to(t.dtype))
    return full


@settings(max_examples=60, deadline=None)
@given(kv=held_kv(), data=st.data())
def test_views_compose_and_share_storage(kv, data):
    a = data.draw(st.integers(0, kv.stop))
    b = data.draw(st.integers(a, kv.stop))
    c = data.draw(st.integers(a, b))
    d = data.draw(st.integers(c, b))
    assert kv.view(a, b).view(c, d).equal(kv.view(c, d))
    v = kv.view(a, b)
    for t, s, vt, vs in zip(kv.tensors, kv.starts, v.tensors, v.starts):
        assert vt.shape[2] == b - vs
        if vt.numel():
            assert vt.data_ptr() == t[:, :, vs - s].data_ptr()


@settings(max_examples=60, deadline=None)
@given(kv=held_kv(), data=st.data())
def test_prefix_holds_each_groups_window(kv, data):
    n = data.draw(st.integers(1, kv.stop))
    p = kv.prefix(n)
    for g, s, t in zip(kv.spec.groups, p.starts, p.tensors):
        assert s == (0 if g.keep is None else max(0, n - g.keep))
        assert torch.equal(_bits(t), _bits(kv.tensors[kv.spec.groups.index(g)][:, :, s:n]))
    # a windowed copy restores the same prefix of its own length, and refuses shorter ones it lacks
    win = kv.prefix(kv.stop)
    assert win.prefix(kv.stop).equal(p if n == kv.stop else win)
    lacking = [g for g in kv.spec.groups if g.keep is not None and kv.stop - g.keep > 0]
    if lacking and n < kv.stop:  # the window of n ends before the stored one starts to cover it
        with pytest.raises(ShapeError, match="needs them from"):
            win.prefix(n)


def test_grouped_kv_rejects_bad_shapes():
    spec = KVSpec.uniform_spec(2, 1, 4, "float16")
    with pytest.raises(ShapeError):
        GroupedKV(spec, 3, (0,), (torch.zeros(2, 2, 2, 1, 4, dtype=torch.float16),))
    with pytest.raises(ShapeError):
        GroupedKV(spec, 3, (0,), (torch.zeros(2, 2, 3, 1, 4, dtype=torch.float32),))
    with pytest.raises(KVCodecError):
        GroupedKV.from_tensor(torch.zeros(2, 3, 3, 1, 4))
    with pytest.raises(ShapeError):
        GroupedKV.from_tensor(torch.zeros(2, 2, 3, 1, 4)).view(2, 1)


def test_to_changes_dtype_in_spec():
    kv = GroupedKV.from_tensor(torch.randn(2, 2, 3, 1, 4))
    half = kv.to(dtype=torch.bfloat16)
    assert half.spec.dtype == "bfloat16" and half.tensors[0].dtype == torch.bfloat16


def test_kv_of_ids_skips_the_output_layer_but_not_the_kv(smollm2, short_text):
    from kvcodec.kvspec.hf import prefill, split_cache
    from kvcodec.models.check import inspect_model
    from kvcodec.models.extract import kv_of_ids, prefill_recorded

    model, tok = smollm2
    ids = tok(short_text, return_tensors="pt").input_ids[0][:40]
    logits, cache = prefill(model, ids, chunk_tokens=16)
    assert logits.shape[0] == 40
    few, _ = prefill_recorded(model, ids, 16, all_logits=False)
    assert few.shape[0] == 3  # one per chunk: the output layer ran on each chunk's last position only
    assert torch.allclose(few[-1], logits[-1], atol=1e-4)
    kv = kv_of_ids(model, inspect_model("smollm2-135m"), ids, chunk_tokens=16)
    assert torch.equal(kv, split_cache(cache, model.config).tensors[0])
