"""kvbench.pack: a .kvt cut to the coordinates some chunks code restores those chunks exactly as
the whole .kvt does (narrow or padded back to square), and remembers its widths."""

from __future__ import annotations

import torch

import test_transform_gpu as gpu_tests  # the synthetic transform and KV of the batched-restore tests
from kvbench.pack import pack_widths, read_pack, widest, write_pack
from kvcodec.codecs.transform.codec import TransformCodec

kvt = gpu_tests.kvt  # the module-scoped fixture


def test_a_pack_restores_its_chunks_as_the_kvt_does(kvt, tmp_path):
    full = TransformCodec(kvt[0], target_ratio=6.0, chunk_tokens=64, resolutions=((64, 64),), coder="zstd")
    kv = gpu_tests.synthetic_kv(192, 3)
    chunks = full.encode_chunks(kv)
    widths = widest(full, [full.header(c.blobs[0]) for c in chunks])
    assert sum(widths) < sum(b.basis.shape[1] for b in full.cal.bases.values())  # the pack is cut
    path = tmp_path / "t.pack"
    write_pack(full.cal, full.kvt_hash, widths, path)
    assert pack_widths(path) == widths
    want = gpu_tests.restore_all(full, chunks, kv.shape)
    for square in (False, True):
        cal, kvt_hash = read_pack(path, square=square)
        assert kvt_hash == full.kvt_hash
        packed = TransformCodec(cal, kvt_hash=kvt_hash, chunk_tokens=64, resolutions=((64, 64),), coder="zstd")
        assert torch.equal(gpu_tests.restore_all(packed, chunks, kv.shape), want)
