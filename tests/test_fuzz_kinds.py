"""Every container kind (KVCF, KVCS, KVGF, KVTF, .kvt) fuzzed the same way, seeded from real files
of every codec on real SmolLM2 KV: consistent edits (checksums recomputed), chunk and part swaps,
drops, duplicates, foreign chunks, truncations and flips must give a KVCodecError or exactly the
original values (never other values, a crash or an allocation past the expansion limit); plus the
defects of issue 22 as regression tests. The cases live in benchmarks/probes/kinds_fuzz.py (the
big run: benchmarks/results/reliability-kinds-cpu.md). KVCODEC_FUZZ_SEED changes the seed."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks" / "probes"))
import kinds_fuzz as kf  # noqa: E402

from kvcodec.codecs.grouped_file import decode_grouped  # noqa: E402
from kvcodec.codecs.transform.file import decode_file, read_header  # noqa: E402
from kvcodec.container.format import read_object, write_object  # noqa: E402
from kvcodec.errors import FormatError, KVCodecError, TruncatedError  # noqa: E402

SEED = int(os.environ.get("KVCODEC_FUZZ_SEED", "20261202"))
CHUNK = 16


@pytest.fixture(scope="module")
def kinds(smollm2):
    torch.manual_seed(0)
    kv = kf.real_kv(2 * CHUNK + 1, smollm2)
    cal_kv = kf.real_kv(400, smollm2, text="pg/apple")
    return kf.all_subjects(kv, cal_kv, CHUNK, small=True)


def test_every_kind_fuzzed_gives_an_error_or_the_original(kinds):
    rounds = len(kf.MUTATIONS) * 4 + len(kf.KVT_MUTATIONS)
    tallies = kf.fuzz(kinds, 2 * rounds, SEED, CHUNK)
    for kind, t in tallies.items():
        row = t.row(kind)
        assert row["wrong_data"] == 0 and row["crashes"] == 0, (kind, row["failures"])
        assert row["over_expansion_limit"] == 0, (kind, row["failures"])
        assert row["errors"] > 0, (kind, row)  # the mutations do bite
    assert set(tallies) == set(kf.KINDS)


def _file(kinds, name):
    return next(s for v in kinds.values() for s in v if s.name == name)


def _decode(subject, data):
    return subject.decode(data)


def _rewrite(data: bytes, edit) -> bytes:
    """`data` (any container) with edit(magic, header, blobs) applied, checksums recomputed."""
    return kf.edit_at(data, (), lambda m, h, b: edit(m, h, b) or (h, b))


@pytest.mark.parametrize(
    "edit",
    [
        lambda m, h, b: (h, b[::-1]) if h["chunks"].reverse() is None else None,  # chunks and entries reversed
        lambda m, h, b: (h, [b[1], b[0], *b[2:]]),  # two chunks swapped, entries kept
        lambda m, h, b: (h, [b[0], b[0], *b[2:]]),  # a chunk duplicated over the next
        lambda m, h, b: (
            dict(h, chunks=h["chunks"][1:], shape=[*h["shape"][:2], h["shape"][2] - 16, *h["shape"][3:]]),
            b[1:],
        ),
        lambda m, h, b: (dict(h, chunks=[]), []),  # empty chunk list (returned a freed buffer)
        lambda m, h, b: (dict(h, kvt=7), b),  # a non-string kvt (TypeError)
        lambda m, h, b: (dict(h, shape=[30, 2, 2**40, 3, 64]), b),  # 2^40 tokens (allocation error)
        lambda m, h, b: (dict(h, settings=dict(h["settings"], theta=h["settings"]["theta"] * 2)), b),
        lambda m, h, b: (dict(h, settings=dict(h["settings"], coder="hevc")), b),  # its chunks say zstd or mixed
    ],
)
@pytest.mark.parametrize("kind", ["kvtf-zstd", "kvtf-mixed"])
def test_transform_file_edits_are_refused(kinds, edit, kind):
    subject = _file(kinds, kind)
    with pytest.raises(KVCodecError):
        _decode(subject, _rewrite(subject.data, edit))


@pytest.mark.parametrize(
    "field,value",
    [
        ("start_token", 1),
        ("theta", None),
        ("key_weight", 2.0),
        ("recon", "laplace"),
        ("index", 2),
        ("sink", 5),
        ("coder", "hevc"),
    ],
)
@pytest.mark.parametrize("kind", ["kvtf-zstd", "kvtf-mixed"])
def test_transform_chunk_header_edits_inside_a_file_are_refused(kinds, field, value, kind):
    subject = _file(kinds, kind)

    def edit(m, h, blobs):
        ch, payload = read_object(blobs[1], blobs[1][:4], "chunk")
        ch[field] = ch["theta"] * 1.01 if value is None else value
        blobs[1] = write_object(blobs[1][:4], ch, [bytes(payload)])

    with pytest.raises(FormatError):
        _decode(subject, _rewrite(subject.data, edit))


def test_transform_file_trailing_bytes_and_truncation_are_refused(kinds):
    subject = _file(kinds, "kvtf-zstd")
    with pytest.raises(FormatError, match="unexpected bytes"):
        read_header(subject.data + b"\0")
    with pytest.raises(TruncatedError):
        read_header(subject.data[:-1])


def test_transform_file_version_1_still_decodes(kinds):
    subject = _file(kinds, "kvtf-zstd")

    def downgrade(m, h, b):
        for name in ("format", "kvtf_version", "settings", "file_id"):
            del h[name]
        for i, blob in enumerate(b):  # version 1 chunks carry no key
            ch, payload = read_object(blob, blob[:4], "chunk")
            b[i] = write_object(blob[:4], {**ch, "key": None}, [bytes(payload)])

    old = _rewrite(subject.data, downgrade)
    assert read_header(old)[0]["kvtf_version"] == 1
    assert torch.equal(kf.bits(_decode(subject, old)[0]), kf.bits(subject.original[0]))
    with pytest.raises(FormatError):  # version 1 chunks must still agree with each other
        _decode(subject, _rewrite(old, lambda m, h, b: (h, [b[1], b[0], *b[2:]])))


def test_split_parts_swapped_with_their_entries_are_refused(kinds):
    subject = next(s for s in kinds["KVCS"] if len(kf.open_container(s.data)[2]) >= 2)

    def swap(m, h, b):
        h["parts"][0], h["parts"][1] = h["parts"][1], h["parts"][0]
        return h, [b[1], b[0], *b[2:]]

    with pytest.raises(FormatError, match="reordered or exchanged"):
        _decode(subject, _rewrite(subject.data, swap))


def test_grouped_same_shape_parts_swapped_are_refused(kinds):
    subject = _file(kinds, "kvgf-raw")
    chunks = [kf.open_container(b)[1]["parts"] for b in kf.open_container(subject.data)[2]]
    c, i, j = next(  # a chunk where two groups of one shape hold as many tokens
        (c, i, j)
        for c, parts in enumerate(chunks)
        for i in range(len(parts))
        for j in range(i)
        if parts[i]["tokens"] == parts[j]["tokens"]
    )

    def swap(m, h, b):
        b[i], b[j] = b[j], b[i]
        return h, b

    with pytest.raises(FormatError, match="parts exchanged or moved"):
        _decode(subject, kf.edit_at(subject.data, (c,), swap))


@pytest.mark.parametrize("stop,chunk_tokens", [(1e308, 16), (2**31 - 1, 1), (-1, 16), (33, 2**40)])
def test_grouped_file_absurd_sizes_are_refused_before_allocation(kinds, stop, chunk_tokens):
    subject = _file(kinds, "kvgf-raw")

    def edit(m, h, b):
        h.update(stop=stop, chunk_tokens=chunk_tokens)

    data = kf.edit_at(subject.data, (), lambda m, h, b: edit(m, h, b) or (h, b), recompute=False)
    with pytest.raises(FormatError):
        decode_grouped(data, subject.decode.__defaults__[0])


def test_transform_file_decodes_only_with_its_own_transform(kinds):
    subject = _file(kinds, "kvtf-zstd")
    codec = subject.decode.__defaults__[0]
    assert torch.equal(kf.bits(decode_file(subject.data, codec)), kf.bits(subject.original[0]))


def test_cli_refuses_a_damaged_transform_file_in_one_line(kinds, tmp_path):
    """The CLI printed a 34-line traceback for a mistyped header field; now one line, exit 1."""
    from click.testing import CliRunner

    from kvcodec.cli.main import cli

    subject = _file(kinds, "kvtf-zstd")
    (tmp_path / "m.kvt").write_bytes(kinds["kvt"][0].data)
    bad = _rewrite(subject.data, lambda m, h, b: (dict(h, kvt=7), b))
    (tmp_path / "bad.kvc").write_bytes(bad)
    args = ["decode", str(tmp_path / "bad.kvc"), str(tmp_path / "out.safetensors"), "--transform"]
    res = CliRunner().invoke(cli, [*args, str(tmp_path / "m.kvt")])
    assert res.exit_code == 1 and "kvt" in res.output and "Traceback" not in res.output
    assert len(res.output.strip().splitlines()) == 1, res.output
