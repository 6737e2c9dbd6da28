"""A transform chunk's or file's header states the settings it was coded with (key weight, sink tokens,
finer tail, reconstruction), and its codec's id names them: a header edited consistently (well-typed,
its checksums made again) to settings its codec does not name is refused, never restored with them
(header.check_named, check_named_settings)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvcodec.codecs.transform.codec import CHUNK_MAGIC, TransformCodec
from kvcodec.codecs.transform.file import decode_file, encode_file
from kvcodec.codecs.transform.header import named_settings
from kvcodec.codecs.transform_ans import make_transform_ans_codec
from kvcodec.codecs.transform_ans.header import CHUNK_MAGIC as ANS_MAGIC
from kvcodec.container.format import crc32, read_object, write_object
from kvcodec.errors import FormatError
from kvcodec.fetcher import PrefixCache, blob_key
from kvcodec.transform.quantize import MAX_FINE_BITS, RECONS
from synthetic import synthetic_kv


def _codec(kvt, **kw) -> TransformCodec:
    return TransformCodec(kvt, **{"chunk_tokens": 64, "resolutions": ((64, 64),), "coder": "zstd", **kw})


@settings(max_examples=25, deadline=None)
@given(
    key_weight=st.floats(1e-6, 1e6),
    sink=st.integers(0, 300),
    chunk=st.integers(1, 1024),
    fine=st.tuples(st.integers(0, 64), st.integers(0, MAX_FINE_BITS)),
    recon=st.sampled_from(RECONS),
)
def test_a_codecs_id_names_its_settings(synthetic_kvt, key_weight, sink, chunk, fine, recon):
    codec = _codec(
        synthetic_kvt, key_weight=key_weight, sink_tokens=sink, chunk_tokens=chunk, fine_tokens=fine[0],
        fine_bits=fine[1], recon=recon,
    )  # fmt: skip
    named = named_settings(codec.id)
    assert named == {
        "key_weight": f"{codec.key_weight:g}",
        "sink_tokens": sink,
        "chunk_tokens": chunk,
        "fine_tokens": codec.fine_tokens,
        "fine_bits": codec.fine_bits,
        "recon": recon,
    }
    assert named_settings(codec.id.rsplit("-", 1)[0]) == named  # as ids without frame sizes ended
    assert named_settings(codec.id.replace("-kw", "-kx")) is None  # an id that names none


def _forged(blob, magic: bytes, **fields) -> bytes:
    """The chunk blob with header fields replaced, its checksum made again."""
    h, payload = read_object(blob, magic, "chunk")
    assert all(h[k] != v for k, v in fields.items())
    return write_object(magic, {**h, **fields}, [bytes(payload)])


@pytest.mark.parametrize(
    "magic, fields",
    [
        (CHUNK_MAGIC, {"key_weight": 2.0}),
        (CHUNK_MAGIC, {"sink": 0}),  # its sink tokens left unrestored
        (CHUNK_MAGIC, {"recon": "laplace"}),
        (ANS_MAGIC, {"key_weight": 2.0}),
    ],
)
def test_a_chunk_stating_settings_its_codec_does_not_name_is_refused(synthetic_kvt, magic, fields):
    make = _codec if magic == CHUNK_MAGIC else make_transform_ans_codec
    codec = make(synthetic_kvt, chunk_tokens=64, resolutions=((64, 64),), bits_per_value=2.0)
    kv = synthetic_kv(100, seed=3)
    blob = codec.encode_chunks(kv)[0].blobs[0]
    out = torch.empty_like(kv[:, :, :64])
    codec.decode_chunk(blob, out)  # as stored: restored
    with pytest.raises(FormatError, match="header was altered"):
        codec.decode_chunk(_forged(blob, magic, **fields), out)


def test_a_fetch_stops_at_a_chunk_whose_settings_were_altered(synthetic_kvt):
    codec = _codec(synthetic_kvt, bits_per_value=2.0)
    kv, ids = synthetic_kv(192, seed=5), list(range(192))
    cache = PrefixCache("memory://altered-settings", "m", codec)
    assert cache.put(ids, kv) == 3
    key = blob_key(cache.keys(ids)[1], 0)
    cache.store.put(key, _forged(cache.store.get(key), CHUNK_MAGIC, key_weight=2.0))  # same length: meta holds
    r = cache.fetch(ids)
    assert not r.ok and r.tokens_restored == 64 and "header was altered" in str(r.error)


def test_a_file_whose_settings_and_chunks_were_altered_together_is_refused(synthetic_kvt):
    """Every chunk and the file's settings edited alike (checksums made again): consistent with each other,
    not with the codec the file and its chunks name."""
    codec = _codec(synthetic_kvt, bits_per_value=2.0)
    kv = synthetic_kv(150, seed=8)
    data = encode_file(kv, codec)
    decode_file(data, codec)  # as stored: restored
    h, payload = read_object(data, b"KVTF", "file")
    blobs, pos = [], 0
    for _, length, _ in h["chunks"]:
        blobs.append(_forged(payload[pos : pos + length], CHUNK_MAGIC, key_weight=2.0))
        pos += length
    h["settings"]["key_weight"] = 2.0
    h["chunks"] = [[e[0], len(b), crc32(b)] for e, b in zip(h["chunks"], blobs, strict=True)]
    with pytest.raises(FormatError, match="header was altered"):
        decode_file(write_object(b"KVTF", h, blobs), codec)
