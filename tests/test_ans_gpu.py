"""The Triton rANS decoder (codecs/transform_ans/gpu.py) against the numpy reference, and the
transform-ans codec restoring on the SMs; skipped without CUDA."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvcodec.codecs.transform_ans import gpu, rans
from kvcodec.errors import CorruptStreamError

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not gpu.available(), reason="needs CUDA and Triton"),
]


def _sources(seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    sizes_scales = [(1, 1.0), (33, 3.0), (70_000, 2.0), (200_000, 0.3), (5000, 60.0), (131_072, 5.0)]
    out = [np.clip(rng.laplace(128, s, n), 0, 255).astype(np.uint8) for n, s in sizes_scales]
    return out + [np.full(9000, 200, np.uint8), rng.integers(0, 256, 40_000).astype(np.uint8)]


@pytest.mark.parametrize("params", [rans.AnsParams(), rans.AnsParams(1 << 14, 64), rans.AnsParams(4096, 1)])
def test_triton_decoder_is_bit_exact_with_the_reference(params):
    xs = _sources(0)
    streams = [rans.parse(rans.encode(x, params), x.size, params) for x in xs]
    for s, x in zip(streams, xs):
        assert (rans.decode(s, x.size, params) == x).all()
    out, err = gpu.decode_batch(streams, [x.size for x in xs], params, torch.device("cuda"))
    assert int(err.abs().sum()) == 0
    assert torch.equal(out.cpu(), torch.from_numpy(np.concatenate(xs)))


def test_device_tables_equal_the_reference_tables():
    x = _sources(1)[2]
    s = rans.parse(rans.encode(x), x.size)
    t = gpu.device_tables(torch.from_numpy(s.freqs.astype(np.int32)).cuda()).cpu().numpy()
    assert (t == rans.decode_table(s.freqs)).all()


def test_a_forged_word_count_sets_the_error_count():
    params = rans.AnsParams(4096, 32)
    x = _sources(2)[2]
    s = rans.parse(rans.encode(x, params), x.size, params)
    counts = s.word_counts.copy()
    counts[0], counts[1] = counts[0] + 1, counts[1] - 1
    forged = rans.AnsStream(s.freqs, s.states, counts, s.words)
    _, err = gpu.decode_batch([forged], [x.size], params, torch.device("cuda"))
    assert int(err[0]) > 0 and int(err[1]) > 0 and int(err[2:].abs().sum()) == 0
    with pytest.raises(CorruptStreamError):
        rans.decode(forged, x.size, params)


def test_codec_restores_on_the_sms_as_the_zstd_transform_does(tmp_path):
    import sys

    sys.path.insert(0, str(__import__("pathlib").Path(__file__).parent))
    from kvcodec.codecs.transform.codec import TransformCodec
    from kvcodec.codecs.transform_ans import TransformAnsCodec
    from kvcodec.transform import calibrate, save_kvt
    from synthetic import ROPE, synthetic_kv

    save_kvt(calibrate([synthetic_kv(600, s) for s in (1, 2)], ROPE), tmp_path / "s.kvt")
    kv = synthetic_kv(300, seed=9).cuda()
    ans = TransformAnsCodec(tmp_path / "s.kvt", chunk_tokens=64, bits_per_value=3.0)
    ref = TransformCodec(tmp_path / "s.kvt", chunk_tokens=64, bits_per_value=3.0, coder="zstd")
    chunks, zchunks = ans.encode_chunks(kv), ref.encode_chunks(kv)
    a, b, c = torch.empty_like(kv), torch.empty_like(kv), torch.empty_like(kv)
    outs = [a[:, :, ch.start_token : ch.start_token + ch.tokens] for ch in chunks]
    ans.finish([ans.stage(ch.blobs[0], o) for ch, o in zip(chunks, outs)], outs)
    for ch, zch in zip(chunks, zchunks):
        ans.decode_chunk(ch.blobs[0], b[:, :, ch.start_token : ch.start_token + ch.tokens])
        ref.decode_chunk(zch.blobs[0], c[:, :, ch.start_token : ch.start_token + ch.tokens])
    torch.cuda.synchronize()
    assert torch.equal(a, c) and torch.equal(b, c)
