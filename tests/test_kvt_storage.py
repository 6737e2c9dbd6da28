""".kvt storage (version 3): float16 bases cut to the coordinates a ratio codes, read back exactly
as calibration measured them, and the same bytes (and sha256) for the same content."""

from __future__ import annotations

import pytest
import torch

from kvcodec.errors import FormatError
from kvcodec.transform import calibrate
from kvcodec.transform.kvt import CUT_VERSION, _meta, compact, from_bytes, save_canonical, to_bytes


def _kv(tokens=300, layers=2, heads=2, dim=8, seed=0, constant=True):
    g = torch.Generator().manual_seed(seed)
    d = layers * heads * dim
    x = torch.randn(2, tokens, d, generator=g) @ torch.randn(d, d, generator=g)
    if constant:
        x[:, :, d // 2 :] = 0.5  # constant channels: coordinates of no variance, never coded
    x = x.reshape(2, tokens, layers, heads, dim)
    return x.permute(2, 0, 1, 3, 4).contiguous()  # (layers, 2, tokens, heads, dim)


def test_calibration_is_stored_exactly_in_float16_and_cut():
    cal = calibrate([_kv(seed=s) for s in range(3)], None, tokens_per_dim=4, sink_tokens=0)
    data = to_bytes(cal)
    assert _meta(data)["version"] == str(CUT_VERSION)
    back = from_bytes(data)
    assert to_bytes(back) == data  # deterministic bytes: the same calibration has the same hash
    for key, b in cal.bases.items():
        assert torch.equal(back.bases[key].basis, b.basis) and torch.equal(back.bases[key].variances, b.variances)
        assert torch.equal(b.basis.half().float(), b.basis)
    cut = cal.info["cut"]
    assert 0 < cut["kept"] < cut["of"]  # the steep tail was dropped ...
    full = sum(b.basis.numel() * 4 for b in cal.bases.values())
    assert len(data) < full / 2  # ... and float16 halves the rest


def test_a_cut_basis_with_variance_beyond_its_columns_is_a_format_error():
    cal = calibrate([_kv(seed=s) for s in range(3)], None, tokens_per_dim=4, sink_tokens=0)
    from safetensors.torch import load

    data = to_bytes(cal)
    tensors = load(data)
    tensors["g0.k.variances"][-1] = 1.0  # a coordinate the file holds no basis column for
    with pytest.raises(FormatError):
        from_bytes(save_canonical(tensors, _meta(data)))


def test_compact_keeps_an_uncut_float32_file_readable_and_is_idempotent():
    cal = calibrate([_kv(seed=s) for s in range(3)], None, tokens_per_dim=4, sink_tokens=0)
    again = compact(cal)
    assert all(torch.equal(again.bases[k].basis, b.basis) for k, b in cal.bases.items())


@pytest.mark.parametrize("ratio", [3.0, 8.0])
def test_the_reports_simulation_restores_what_the_codec_decodes_and_estimates_its_size(ratio):
    from kvcodec.codecs.transform.codec import TransformCodec
    from kvcodec.transform import simulate
    from kvcodec.transform.kvt import kvt_hash
    from kvcodec.transform.rope import RopeSpec, apply_rope

    rope = RopeSpec(10000.0, 16)

    def roped(seed):  # chunks of 32 KiB: a chunk header's few hundred bytes stay a small part of each
        kv = _kv(tokens=512, heads=4, dim=16, seed=seed, constant=False)
        kv[:, 0] = apply_rope(kv[:, 0], torch.arange(kv.shape[2]), rope)
        return kv

    cal = calibrate([roped(s) for s in range(4)], rope, tokens_per_dim=4)
    digest = kvt_hash(to_bytes(cal))
    kv = roped(9)
    sim = simulate.simulate(TransformCodec(cal, kvt_hash=digest, coder="zstd", chunk_tokens=128), kv, ratio)
    real = TransformCodec(cal, kvt_hash=digest, coder="zstd", chunk_tokens=128, theta=sim.theta)
    chunks = real.encode_chunks(kv)
    out = torch.empty_like(kv)
    for c in chunks:
        real.decode_chunk(c.blobs[0], out[:, :, c.start_token : c.start_token + c.tokens])
    assert torch.allclose(out, sim.restored, atol=1e-5, rtol=1e-5)  # the coder is lossless: the same KV
    coded = sum(len(c.blobs[0]) for c in chunks)
    assert abs(sim.bytes / coded - 1) < 0.1
    own = TransformCodec(cal, kvt_hash=digest, coder="zstd", chunk_tokens=128, target_ratio=ratio)
    assert abs(sum(len(c.blobs[0]) for c in own.encode_chunks(kv)) / coded - 1) < 0.1  # the codec's own search


@pytest.mark.parametrize("header", [b'{"__metadata__": [1, 2]}', b'{"__metadata__": "kvt"}', b"[1]", b"{nope"])
def test_a_kvt_whose_header_is_no_object_is_a_format_error(header):
    data = len(header).to_bytes(8, "little") + header
    with pytest.raises(FormatError, match="not a .kvt transform file"):
        from_bytes(data)
