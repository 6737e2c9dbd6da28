"""Container validation: headers edited consistently (checksums recomputed) must give a clear
FormatError naming the problem, never uninitialized, misplaced or huge output."""

import json
import struct

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import kvcodec
from kvcodec import CodecConfig
from kvcodec.container import validate
from kvcodec.container.format import (
    CHUNK_MAGIC,
    FILE_MAGIC,
    ChunkHeader,
    FileHeader,
    check_chunk_against_file,
    crc32,
    parse_file,
    read_object,
    write_object,
)
from kvcodec.errors import FormatError, KVCodecError

CONFIG = CodecConfig(quant="int8", chunk_tokens=32, resolutions=((144, 144),))


def kv_like(layers=4, tokens=96, heads=2, dim=64, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(layers, 2, tokens, heads, dim, generator=g) * torch.linspace(0.1, 3, dim)).half()


@pytest.fixture(scope="module")
def kv():
    return kv_like()


@pytest.fixture(scope="module")
def encoded(kv):
    return kvcodec.encode(kv, CONFIG)


def rewrite(data: bytes, magic: bytes, edit) -> bytes:
    """`data` with its header replaced by edit(header) and every checksum recomputed."""
    header, payload = read_object(data, magic, "object")
    edit(header)
    return write_object(magic, header, [bytes(payload)])


def refused(data: bytes, *words: str) -> str:
    for call in (kvcodec.decode, kvcodec.inspect):
        with pytest.raises(FormatError) as e:
            call(data)
    msg = str(e.value)
    for w in words:
        assert w in msg, msg
    return msg


# ---------------------------------------------------------------------------- JSON depth


def _depth(x) -> int:
    if isinstance(x, list):
        return 1 + max((_depth(i) for i in x), default=0)
    if isinstance(x, dict):
        return 1 + max((_depth(i) for i in x.values()), default=0)
    return 0


_json = st.recursive(
    st.none() | st.integers() | st.text(alphabet='ab[]{}"\\,:'),
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(alphabet='[]{}"x', max_size=3), inner, max_size=3)
    ),
    max_leaves=20,
)


@settings(max_examples=200, deadline=None)
@given(_json)
def test_json_depth_counts_nesting_and_ignores_brackets_in_strings(value):
    assert validate.json_depth(json.dumps(value).encode()) == _depth(value)


@settings(max_examples=300, deadline=None)
@given(
    st.binary(max_size=40).map(lambda b: b.replace(b"\\", b""))
    | st.text(alphabet='[]{}"a,', max_size=200).map(str.encode)
)
def test_json_depth_without_escapes_is_the_string_patterns_depth(text):
    """The fast path (no backslash) gives the string pattern's depth on any text, malformed too."""
    assert validate.json_depth(text) == validate._deepest(validate._STRING.sub(b'""', text))


def test_a_deeply_nested_header_is_refused_before_parsing():
    head = b"[" * 100_000 + b"]" * 100_000
    data = struct.pack("<4sHI", FILE_MAGIC, 2, len(head)) + head + struct.pack("<I", crc32(head))
    with pytest.raises(FormatError, match="nests 100000 levels"):
        kvcodec.decode(data)


# ---------------------------------------------------------------------------- file headers


def test_the_untouched_file_decodes(kv, encoded):
    out = kvcodec.decode(encoded)
    assert out.shape == kv.shape


@pytest.mark.parametrize(
    "field, value, words",
    [
        ("kv_heads", -2, ("kv_heads", "-2")),
        ("layers", 0, ("layers",)),
        ("config", None, ("config",)),
        ("dtype", {"a": 1}, ("dtype",)),
        ("dtype", "float64", ("dtype",)),
        ("tokens", True, ("tokens",)),
        ("chunk_tokens", [], ("chunk_tokens",)),
        ("blobs", [], ("blobs",)),
        ("chunk_tokens", "16", ("chunk_tokens",)),
        ("blobs", [None], ("blobs[0]",)),
        ("head_dim", 2.5, ("head_dim",)),
    ],
)
def test_wrong_types_and_ranges_name_the_field(encoded, field, value, words):
    refused(rewrite(encoded, FILE_MAGIC, lambda h: h.__setitem__(field, value)), *words)


def test_tokens_beyond_what_the_chunks_cover_are_refused(encoded):
    refused(rewrite(encoded, FILE_MAGIC, lambda h: h.__setitem__("tokens", h["tokens"] + 1)), "chunk_tokens")


def test_missing_and_unknown_fields_are_refused(encoded):
    refused(rewrite(encoded, FILE_MAGIC, lambda h: h.pop("blobs")), "blobs")
    refused(rewrite(encoded, FILE_MAGIC, lambda h: h.__setitem__("extra", 1)), "extra")


def test_a_chunk_without_a_blob_is_refused(encoded):
    refused(rewrite(encoded, FILE_MAGIC, lambda h: h["blobs"].pop()), "blobs")


def test_trailing_bytes_after_the_payload_are_refused(encoded):
    refused(encoded + b"\0", "unexpected bytes")


def test_a_tiny_file_announcing_a_huge_output_is_refused_without_allocating():
    # the forgery: a few hundred bytes that used to decode to gigabytes with exit 0
    config = CodecConfig(chunk_tokens=1 << 20, resolutions=((144, 144),)).to_dict()
    header = FileHeader(30, 3, 64, "float16", 400_000, config, (400_000,), ()).to_json()
    header["blobs"] = [{"chunk_index": 0, "resolution": [144, 144], "offset": 0, "length": 100, "crc32": 0}]
    data = write_object(FILE_MAGIC, header, [b"x" * 100])
    assert len(data) < 1000
    refused(data, "decoded bytes")


def test_swapped_chunks_are_refused(encoded):
    def swap(h):
        a, b = h["blobs"][0], h["blobs"][1]
        for k in ("offset", "length", "crc32"):
            a[k], b[k] = b[k], a[k]

    with pytest.raises(FormatError, match="position 0 .* chunk_index=1"):
        kvcodec.decode(rewrite(encoded, FILE_MAGIC, swap))


def test_check_chunk_against_file_names_the_mismatch(kv, encoded):
    fh, payload = parse_file(encoded)
    chunks = [kvcodec.inspect_chunk_blob(payload[b.offset : b.offset + b.length]) for b in fh.blobs]
    for i, ch in enumerate(chunks):
        check_chunk_against_file(fh, i, ch, (144, 144))
    with pytest.raises(FormatError, match="start_token"):
        check_chunk_against_file(fh, 1, _replace(chunks[1], start_token=0), (144, 144))
    with pytest.raises(FormatError, match="tokens"):
        check_chunk_against_file(fh, 2, _replace(chunks[2], tokens=31), (144, 144))
    with pytest.raises(FormatError, match="resolution"):
        check_chunk_against_file(fh, 0, chunks[0], (256, 256))
    with pytest.raises(FormatError, match="coded 'exact'"):
        check_chunk_against_file(fh, 0, _replace(chunks[0], quant="exact"))


def _replace(h: ChunkHeader, **kw) -> ChunkHeader:
    import dataclasses

    return dataclasses.replace(h, **kw)


def test_a_constant_kv_stays_under_the_expansion_limit():
    kv = torch.zeros(2, 2, 256, 2, 32, dtype=torch.float16)
    for quant in ("int8", "exact"):
        data = kvcodec.encode(kv, CodecConfig(quant=quant, chunk_tokens=256, resolutions=((144, 144),)))
        assert torch.equal(kvcodec.decode(data), kv)


# ---------------------------------------------------------------------------- chunk headers


@pytest.fixture(scope="module")
def blob(kv):
    return kvcodec.encode_chunks(kv, CONFIG)[0].blobs[0]


@pytest.mark.parametrize(
    "edit, words",
    [
        (lambda h: h.__setitem__("kv_heads", -1), ("kv_heads",)),
        (lambda h: h.__setitem__("frames", h["frames"] + 1), ("frames",)),
        (lambda h: h.__setitem__("tokens", h["tokens"] * 1000), ("frames",)),
        (lambda h: h.__setitem__("layout", None), ("layout",)),
        (lambda h: h["layout"].__setitem__("tile_w", 0), ("layout.tile_w",)),
        (lambda h: h["layout"].__setitem__("units", 3), ("layout",)),
        (lambda h: h.__setitem__("layer_bits", [8]), ("layer_bits",)),
        (lambda h: h.__setitem__("param_dtype", ""), ("param_dtype",)),
        (lambda h: h["streams"].append(dict(h["streams"][0])), ("repeats",)),
        (lambda h: h["streams"][0].__setitem__("length", -1), ("streams[0].length",)),
        (lambda h: h.__setitem__("quant", ["int8"]), ("quant",)),
        (lambda h: h.__setitem__("video_bits", 9), ("video_bits",)),
        (lambda h: h.__setitem__("key", 5), ("key",)),
        (lambda h: h.__setitem__("resolution", [144]), ("resolution",)),
    ],
)
def test_chunk_header_fields_are_checked(blob, edit, words):
    bad = rewrite(blob, CHUNK_MAGIC, edit)
    for call in (kvcodec.inspect_chunk_blob, kvcodec.decode_chunk_blob):
        with pytest.raises(FormatError) as e:
            call(bad)
        for w in words:
            assert w in str(e.value)


def test_a_bound_key_round_trips_and_unbound_headers_are_unchanged(blob):
    header, _ = read_object(blob, CHUNK_MAGIC, "blob")
    assert "key" not in header
    bound = rewrite(blob, CHUNK_MAGIC, lambda h: h.__setitem__("key", "abc/0"))
    assert kvcodec.inspect_chunk_blob(bound).key == "abc/0"
    assert "key" in kvcodec.inspect_chunk_blob(bound).to_json()


def test_every_error_is_a_kvcodec_error(encoded):
    # a consistent edit of every top-level field to a value of each JSON type
    header, _ = read_object(encoded, FILE_MAGIC, "file")
    for field in header:
        for value in (None, -1, 0, 1 << 62, 2.5, "x", [], {}, [[1]], True):
            data = rewrite(encoded, FILE_MAGIC, lambda h, f=field, v=value: h.__setitem__(f, v))
            for call in (kvcodec.decode, kvcodec.inspect):
                try:
                    call(data)
                except KVCodecError:
                    pass


# ---------------------------------------------------------------------------- plain chunks


@pytest.mark.parametrize("quant", ["int8", "int4", "exact"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_a_one_token_encode_does_not_expand_and_restores_every_bit(quant, dtype):
    kv = kv_like(layers=6, tokens=1, heads=3, dim=64).to(dtype)
    data = kvcodec.encode(kv, CodecConfig(quant=quant, resolutions=((256, 256),)))
    raw = kv.numel() * kv.element_size()
    assert len(data) < raw + 1024  # the values plus headers, not a padded video frame
    out = kvcodec.decode(data)
    assert torch.equal(out, kv)  # one value per channel: exact even when coded
    if dtype == torch.float16:  # fp32 values are large enough for a video to pay
        assert "video" not in kvcodec.inspect(data)["resolutions"]["256x256"]["streams"]  # plain or zstd'd samples


def test_chunks_of_real_length_are_never_stored_plain(kv, encoded):
    fh, payload = parse_file(encoded)
    for b in fh.blobs:
        assert kvcodec.inspect_chunk_blob(payload[b.offset : b.offset + b.length]).quant == "int8"


def test_a_plain_chunk_restores_into_a_paged_cache():
    from kvcodec.container.plain import plain_chunk_blob

    x = kv_like(layers=2, tokens=3, dim=32)
    blob = plain_chunk_blob(x, chunk_index=2, start_token=5, resolution=(144, 144))
    pages = torch.zeros(2, 2, 4, 4, 2, 32, dtype=torch.float16)
    paged = kvcodec.PagedKV(pages, torch.tensor([3, 0, 1]))
    kvcodec.decode_chunk_blob(blob, out=paged)
    assert torch.equal(paged.gather(5, 3), x)
    assert pages[:, :, 2].abs().sum() == 0  # blocks outside the table untouched


@pytest.mark.parametrize(
    "edit, words",
    [
        (lambda h: h.__setitem__("frames", 1), ("plain",)),
        (lambda h: h.__setitem__("layout", {"width": 1}), ("plain",)),
        (lambda h: h["streams"][0].__setitem__("name", "video"), ("plain",)),
        (lambda h: h.__setitem__("tokens", 4), ()),
    ],
)
def test_plain_chunk_headers_are_checked(edit, words):
    from kvcodec.container.plain import plain_chunk_blob

    blob = plain_chunk_blob(kv_like(tokens=3), chunk_index=0, start_token=0, resolution=(144, 144))
    bad = rewrite(blob, CHUNK_MAGIC, edit)
    with pytest.raises(FormatError) as e:
        kvcodec.decode_chunk_blob(bad)
    for w in words:
        assert w in str(e.value)


def test_inspect_reports_the_real_bytes(kv):
    config = CodecConfig(quant="int8", chunk_tokens=32, resolutions=((144, 144), (256, 256)))
    data = kvcodec.encode(kv, config)
    info = kvcodec.inspect(data)
    assert info["file_bytes"] == len(data)
    assert info["fp16_bytes"] == kv.numel() * 2
    per_res = [r["bytes"] for r in info["resolutions"].values()]
    assert sum(per_res) < len(data) < sum(per_res) + 4096  # both resolutions are stored
    assert info["fp16_bytes"] / info["file_bytes"] < min(r["ratio_vs_fp16"] for r in info["resolutions"].values()) / 1.9


def test_the_default_stores_one_resolution(kv):
    assert len(CodecConfig().resolutions) == 1
    data = kvcodec.encode(kv, CodecConfig(chunk_tokens=32))
    assert len(kvcodec.inspect(data)["resolutions"]) == 1


def test_a_config_missing_fields_means_their_defaults(encoded):
    # found by the fuzzer: a config without "quant" passed the config check, then raised KeyError
    for field in ("quant", "resolutions", "chunk_tokens"):
        data = rewrite(encoded, FILE_MAGIC, lambda h, f=field: h["config"].pop(f))
        try:
            out = kvcodec.decode(data)
        except FormatError:
            continue
        assert torch.equal(out, kvcodec.decode(encoded))


def test_a_remembered_chunk_header_keeps_every_check(blob):
    from kvcodec.container.format import parse_chunk
    from kvcodec.errors import ChecksumError

    first, payload = parse_chunk(blob)
    assert parse_chunk(blob)[0] == first and bytes(parse_chunk(blob)[1]) == bytes(payload)
    broken_crc = bytearray(blob)
    head_len = struct.unpack_from("<I", blob, 6)[0]
    broken_crc[10 + head_len] ^= 0xFF  # same header bytes, wrong header checksum
    with pytest.raises(ChecksumError):
        parse_chunk(bytes(broken_crc))
    with pytest.raises(FormatError, match="version"):
        parse_chunk(blob[:4] + struct.pack("<H", 99) + blob[6:])


# ---------------------------------------------------------------------------- split chunks (several streams)

from kvcodec.codecs.hevc.decode import chunk_parts, decode_chunk_blob  # noqa: E402
from kvcodec.container import split  # noqa: E402
from kvcodec.restore.paged import PagedKV  # noqa: E402

SPLIT = CodecConfig(quant="int8", chunk_tokens=32, resolutions=((144, 144),), streams_per_chunk=3)


@given(st.integers(1, 200), st.integers(1, 80))
def test_layer_ranges_cover_every_layer_once_in_near_equal_runs(layers, parts):
    ranges = split.layer_ranges(layers, parts)
    assert len(ranges) == min(layers, parts)
    assert ranges[0][0] == 0 and ranges[-1][1] == layers
    assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))
    sizes = [e - s for s, e in ranges]
    assert min(sizes) >= 1 and max(sizes) - min(sizes) <= 1


@pytest.fixture(scope="module")
def split_encoded(kv):
    return kvcodec.encode(kv, SPLIT)


@pytest.fixture(scope="module")
def split_blob(kv):
    return kvcodec.encode_chunks(kv, SPLIT)[1].blobs[0]


def test_split_chunks_restore_the_same_values_as_one_stream(kv, encoded, split_encoded):
    assert torch.equal(kvcodec.decode(split_encoded), kvcodec.decode(encoded))
    info = kvcodec.inspect(split_encoded)["resolutions"]["144x144"]
    assert [p["layers"] for p in info["parts"]] == [1, 1, 2]


def test_a_split_chunk_restores_into_a_paged_cache_by_layer(kv, split_blob):
    pages = torch.zeros(4, 2, 8, 16, 2, 64, dtype=torch.float16)
    table = torch.tensor([7, 0, 3, 5, 1])  # the chunk's tokens 32..63 live in blocks 3 and 5
    decode_chunk_blob(split_blob, out=PagedKV(pages, table))
    dense = decode_chunk_blob(split_blob)
    assert torch.equal(pages[:, :, 3], dense[:, :, :16]) and torch.equal(pages[:, :, 5], dense[:, :, 16:])
    assert [tuple(t.pages.shape[:1]) for _, t in chunk_parts(split_blob, PagedKV(pages, table))] == [(1,), (1,), (2,)]


def test_split_config_changes_the_codec_id_and_one_stream_keeps_the_old_dict():
    from kvcodec.codecs import HevcCodec

    assert "streams_per_chunk" not in CONFIG.to_dict()
    assert SPLIT.to_dict()["streams_per_chunk"] == 3
    assert HevcCodec(SPLIT).id != HevcCodec(CONFIG).id
    for bad in (0, 65, True, 2.0):
        with pytest.raises(kvcodec.errors.ConfigError):
            CodecConfig(streams_per_chunk=bad)


def _edit_part(blob: bytes, index: int, edit) -> bytes:
    """`blob` with part `index`'s header edited consistently (every checksum recomputed)."""
    h, payload = split.parse_split_header(blob)
    parts, pos = [], 0
    for p in h.parts:
        parts.append(bytes(payload[pos : pos + p.length]))
        pos += p.length
    parts[index] = rewrite(parts[index], CHUNK_MAGIC, edit)
    outer, _ = read_object(blob, split.SPLIT_MAGIC, "split")
    for p, b in zip(outer["parts"], parts):
        p["length"] = len(b)
    return write_object(split.SPLIT_MAGIC, outer, parts)


@pytest.mark.parametrize(
    "edit, words",
    [
        (lambda h: h.__setitem__("chunk_index", 0), ["part 1", "chunk_index"]),
        (lambda h: h.__setitem__("start_token", 0), ["start_token"]),
        (lambda h: h.__setitem__("key", "another-prefix"), ["key"]),
        (
            lambda h: h.update(resolution=[160, 160], layout={**h["layout"], "width": 160, "height": 160}),
            ["resolution"],
        ),
    ],
)
def test_a_part_that_is_not_this_chunk_is_refused(split_blob, edit, words):
    bad = _edit_part(split_blob, 1, edit)
    with pytest.raises(FormatError) as e:
        decode_chunk_blob(bad)
    assert all(w in str(e.value) for w in words), str(e.value)


@pytest.mark.parametrize(
    "edit, words",
    [
        (lambda h: h["parts"][0].__setitem__("layers", 2), ["layers"]),
        (lambda h: h["parts"].pop(), ["parts", "layers=4"]),
        (lambda h: h["parts"][0].__setitem__("length", h["parts"][0]["length"] + 1), ["payload"]),
        (lambda h: h.__setitem__("parts", h["parts"][:1]), ["parts"]),
        (lambda h: h.__setitem__("split_version", 4), ["version"]),
        (lambda h: h.__setitem__("extra", 1), ["unknown"]),
        (lambda h: h.__setitem__("layers", 1 << 20), ["layers"]),
    ],
)
def test_split_header_edits_are_refused_naming_the_problem(split_blob, edit, words):
    bad = rewrite(split_blob, split.SPLIT_MAGIC, edit)
    with pytest.raises(FormatError) as e:
        decode_chunk_blob(bad)
    assert all(w in str(e.value) for w in words), str(e.value)


def test_a_part_with_the_wrong_layer_count_is_refused(split_blob):
    h, _ = read_object(split_blob, split.SPLIT_MAGIC, "split")
    h["parts"][0]["layers"], h["parts"][2]["layers"] = 2, 1  # sums still match, parts do not
    with pytest.raises(FormatError, match="holds 1 layers"):
        decode_chunk_blob(rewrite(split_blob, split.SPLIT_MAGIC, lambda d: d.update(parts=h["parts"])))


def test_every_truncation_and_byte_flip_of_a_split_chunk_is_an_error_or_exact(split_blob):
    want = decode_chunk_blob(split_blob)
    for n in range(0, len(split_blob), max(1, len(split_blob) // 97)):
        with pytest.raises(KVCodecError):
            decode_chunk_blob(split_blob[:n])
    for pos in range(0, len(split_blob), max(1, len(split_blob) // 211)):
        bad = bytearray(split_blob)
        bad[pos] ^= 0x5A
        try:
            got = decode_chunk_blob(bytes(bad))
        except KVCodecError:
            continue
        assert torch.equal(got, want), f"a flip at byte {pos} decoded to other values"


def test_a_chunk_of_another_file_of_the_same_config_is_refused(kv, encoded):
    """Chunks are keyed to their file's content id: another file's chunk 1 (same codec, shape and
    place) in this file's place, its entry's offset, length and CRC recomputed, is refused."""
    other = kvcodec.encode(kv_like(seed=1), CONFIG)
    blob_of = lambda data: (lambda h, p: (h, p))(*read_object(data, FILE_MAGIC, "file"))  # noqa: E731
    (h, payload), (oh, opayload) = blob_of(encoded), blob_of(other)
    blobs = [bytes(payload[b["offset"] : b["offset"] + b["length"]]) for b in h["blobs"]]
    o = oh["blobs"][1]
    blobs[1] = bytes(opayload[o["offset"] : o["offset"] + o["length"]])
    offset = 0
    for entry, blob in zip(h["blobs"], blobs):
        entry.update(offset=offset, length=len(blob), crc32=crc32(blob))
        offset += len(blob)
    assert h["file_id"] != oh["file_id"]
    with pytest.raises(FormatError, match="key"):
        kvcodec.decode(write_object(FILE_MAGIC, h, blobs))


def _with_layout_of_chunk_1(data: bytes, edit) -> bytes:
    """The file with chunk 1's layout edited, every checksum made again."""
    fh, payload = read_object(data, FILE_MAGIC, "file")
    blobs = [bytes(payload[b["offset"] : b["offset"] + b["length"]]) for b in fh["blobs"]]
    ch, pl = read_object(blobs[1], CHUNK_MAGIC, "chunk")
    edit(ch["layout"])
    blobs[1] = write_object(CHUNK_MAGIC, ch, [bytes(pl)])
    offset = 0
    for b, blob in zip(fh["blobs"], blobs, strict=True):
        b["offset"], b["length"], b["crc32"] = offset, len(blob), crc32(blob)
        offset += len(blob)
    return write_object(FILE_MAGIC, fh, blobs)


def _transposed(layout: dict) -> None:
    layout.update(orientation="channel_major" if layout["orientation"] == "token_major" else "token_major")


@pytest.mark.parametrize("edit", [_transposed, lambda lay: lay.update(tile_w=lay["tile_h"], tile_h=lay["tile_w"])])
def test_a_chunk_laid_out_otherwise_than_its_files_others_is_refused(kv, edit):
    """A chunk whose header names another frame layout (its checksums made again) would read its video as
    other values: the file's chunks were coded with one plan, so it is refused."""
    data = kvcodec.encode(
        kv, CodecConfig(quant="int8", chunk_tokens=32, resolutions=((144, 144),), sample_coder="hevc")
    )
    assert (kvcodec.decode(data).float() - kv.float()).abs().max() < 0.1
    with pytest.raises(FormatError, match="header was altered"):
        kvcodec.decode(_with_layout_of_chunk_1(data, edit))


def _without_last_chunk(data: bytes) -> bytes:
    """A file whose header was edited to list one chunk fewer, its payload cut to match, every checksum recomputed."""
    header, payload = read_object(data, b"KVCF", "object")
    last = len(header["chunk_tokens"]) - 1
    kept = [b for b in header["blobs"] if b["chunk_index"] != last]
    header["blobs"], header["tokens"] = kept, header["tokens"] - header["chunk_tokens"][-1]
    header["chunk_tokens"] = header["chunk_tokens"][:-1]
    return write_object(b"KVCF", header, [bytes(payload[: max(b["offset"] + b["length"] for b in kept)])])


def test_a_file_edited_to_lose_its_last_chunk_is_refused_not_read_shorter(encoded):
    # each chunk's key names the file's chunk count: a consistent header edit cannot drop the tail
    refused(_without_last_chunk(encoded), "key", "lost chunks")


def test_files_whose_chunk_keys_name_no_count_still_decode(kv, monkeypatch):
    """Files written before the count was bound carry `<file_id>/<index>`: still read."""
    from kvcodec.codecs.hevc import file as hevc_file

    monkeypatch.setattr(hevc_file, "file_chunk_key", lambda file_id, index, count: f"{file_id}/{index}")
    legacy = kvcodec.encode(kv, CONFIG)
    monkeypatch.undo()
    header, payload = read_object(legacy, b"KVCF", "object")
    assert header["file_id"] and f'{header["file_id"]}/0"'.encode() in bytes(payload)  # the key as written then
    assert torch.equal(kvcodec.decode(legacy), kvcodec.decode(kvcodec.encode(kv, CONFIG)))
