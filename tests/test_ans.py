"""Interleaved rANS (codecs/transform_ans/rans.py): round trips, tables, damage; pure, hypothesis-tested."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcodec.codecs.transform_ans import rans
from kvcodec.errors import ConfigError, CorruptStreamError

SMALL = rans.AnsParams(block=256, lanes=8)


@given(st.lists(st.integers(0, 1000), min_size=256, max_size=256).filter(lambda c: sum(c) > 0))
def test_normalized_frequencies_sum_to_the_scale_and_keep_every_symbol(counts):
    f = rans.normalize_freqs(np.array(counts))
    assert int(f.sum()) == rans.PROB_SCALE
    assert ((f > 0) == (np.array(counts) > 0)).all()


@settings(max_examples=60, deadline=None)
@given(
    st.binary(min_size=1, max_size=2000),
    st.sampled_from([rans.AnsParams(256, 8), rans.AnsParams(64, 64), rans.AnsParams(1024, 32), rans.AnsParams(8, 1)]),
)
def test_any_bytes_round_trip(data, params):
    x = np.frombuffer(data, np.uint8)
    stream = rans.encode(x, params)
    assert (rans.decode(rans.parse(stream, x.size, params), x.size, params) == x).all()


@settings(max_examples=20, deadline=None)
@given(st.integers(1, 5000), st.floats(0.01, 40.0), st.integers(0, 2**32 - 1))
def test_skewed_sources_round_trip_near_their_entropy(n, scale, seed):
    x = np.clip(np.random.default_rng(seed).laplace(128, scale, n), 0, 255).astype(np.uint8)
    stream = rans.encode(x, SMALL)
    assert (rans.decode(rans.parse(stream, n, SMALL), n, SMALL) == x).all()
    if n >= 4096:  # tables and states aside, within a few percent of order-0 entropy per block
        p = np.bincount(x, minlength=256) / n
        bits = -(p[p > 0] * np.log2(p[p > 0])).sum() * n
        overhead = rans.AnsParams.blocks(SMALL, n) * (4 * SMALL.lanes + 4 + 32 + 2 * 256)
        assert len(stream) * 8 <= 1.03 * bits + 8 * overhead + 64


def test_decode_table_names_symbol_frequency_and_offset():
    f = np.zeros(256, np.uint32)
    f[[3, 200]] = [4000, 96]
    t = rans.decode_table(f[None]).view(np.uint32)[0]
    assert (t[:4000] >> 24 == 3).all() and (t[4000:] >> 24 == 200).all()
    assert ((t[4000:] >> 12) & 0xFFF == 95).all() and (t[4000:] & 0xFFF == np.arange(96)).all()


def test_a_constant_block_costs_no_words():
    x = np.full(10_000, 7, np.uint8)
    s = rans.parse(rans.encode(x, SMALL), x.size, SMALL)
    assert s.words.size == 0 and (rans.decode(s, x.size, SMALL) == 7).all()


def _stream(n=3000, seed=1):
    x = np.clip(np.random.default_rng(seed).laplace(128, 4, n), 0, 255).astype(np.uint8)
    return x, bytearray(rans.encode(x, SMALL))


def test_damaged_streams_are_corrupt_stream_errors():
    x, b = _stream()
    nb = SMALL.blocks(x.size)
    with pytest.raises(CorruptStreamError):
        rans.parse(bytes(b[:-2]), x.size, SMALL)  # truncated
    with pytest.raises(CorruptStreamError):
        rans.parse(bytes(b) + b"\0\0", x.size, SMALL)  # trailing bytes
    with pytest.raises(CorruptStreamError):
        rans.parse(bytes(b[:10]), x.size, SMALL)
    bad = bytearray(b)
    bad[0:4] = (5).to_bytes(4, "little")  # a state below 2^16
    with pytest.raises(CorruptStreamError):
        rans.parse(bytes(bad), x.size, SMALL)
    freq_at = nb * SMALL.lanes * 4 + nb * 4 + nb * 32
    bad = bytearray(b)
    bad[freq_at] ^= 0x01  # a table that no longer sums to 4096
    with pytest.raises(CorruptStreamError):
        rans.parse(bytes(bad), x.size, SMALL)
    bad = bytearray(b)
    bad[SMALL.lanes * 4 : SMALL.lanes * 4 + 4] = bytes(4)  # swap the state of lane 1 with lane 0's: wrong end state
    bad[4:8] = b[0:4]
    with pytest.raises(CorruptStreamError):
        rans.decode(rans.parse(bytes(bad), x.size, SMALL), x.size, SMALL)


def test_word_counts_moved_between_blocks_fail_the_end_check():
    x, b = _stream(n=2000, seed=3)
    nb = SMALL.blocks(x.size)
    at = nb * SMALL.lanes * 4
    counts = np.frombuffer(bytes(b[at : at + 4 * nb]), "<u4").copy()
    counts[0] += 1
    counts[1] -= 1  # same total: the layout still adds up
    b[at : at + 4 * nb] = counts.astype("<u4").tobytes()
    with pytest.raises(CorruptStreamError):
        rans.decode(rans.parse(bytes(b), x.size, SMALL), x.size, SMALL)


def test_params_are_checked():
    for block, lanes in ((100, 3), (8, 16), (1 << 25, 32), (64, 0)):
        with pytest.raises(ConfigError):
            rans.AnsParams(block, lanes)
    with pytest.raises(ConfigError):
        rans.encode(np.zeros(0, np.uint8))


SM_DECODER_CHECK = textwrap.dedent(
    """
    import numpy as np, torch
    from kvcodec.codecs.transform_ans import gpu, rans
    params = rans.AnsParams(256, 8)
    rng = np.random.default_rng(0)
    xs = [np.clip(rng.laplace(128, s, n), 0, 255).astype(np.uint8) for n, s in [(1, 1.0), (700, 3.0), (300, 40.0)]]
    xs.append(np.full(260, 7, np.uint8))
    streams = [rans.parse(rans.encode(x, params), x.size, params) for x in xs]
    out, err = gpu.decode_batch(streams, [x.size for x in xs], params, torch.device("cpu"))
    assert int(err.abs().sum()) == 0, err
    assert torch.equal(out, torch.from_numpy(np.concatenate(xs)))
    s = streams[1]
    counts = s.word_counts.copy()
    counts[0], counts[1] = counts[0] + 1, counts[1] - 1
    forged = rans.AnsStream(s.freqs, s.states, counts, s.words)
    _, err = gpu.decode_batch([forged], [700], params, torch.device("cpu"))
    assert int(err[0]) > 0 and int(err[1]) > 0 and int(err[2]) == 0, err
    print("decoded")
    """
)


def test_the_sm_decoder_s_source_decodes_what_the_reference_does():
    """codecs/transform_ans/gpu.py's Triton kernel run by Triton's interpreter on the CPU, so that CI
    checks it: in a fresh process, because the interpreter must be on before Triton is imported for
    the language's own jit functions (tl.sum, tl.cumsum) to be interpreted too."""
    pytest.importorskip("triton")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    r = subprocess.run([sys.executable, "-c", SM_DECODER_CHECK], env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0 and r.stdout.strip() == "decoded", r.stderr[-3000:]
