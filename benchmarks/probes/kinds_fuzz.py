"""Every container kind fuzzed the same way (issue 22): .kvc files (KVCF), split chunk blobs
(KVCS), grouped files (KVGF), transform-coded files (KVTF) and .kvt calibrations, seeded from real
files of every codec (HEVC int8 / exact / split streams, raw, grouped over raw and HEVC, transform
over zstd, HEVC and mixed coders) on real SmolLM2 KV.

    python benchmarks/probes/kinds_fuzz.py --cases 20000 --seed 1 --out benchmarks/results/reliability-kinds-cpu
(tests/test_fuzz_kinds.py runs a small seeded set of the same cases in CI)

Mutations work on every nesting level of a container (a file's chunks, a split chunk's parts, a
grouped chunk's group parts), always with every checksum recomputed (CRC32 of a header, of an
entry's blob, a split part's header CRC), so only the validation layer can refuse them:

| mutation | what |
|---|---|
| bitflip | 1-8 random bits flipped anywhere |
| resize | truncated anywhere, or bytes appended |
| header | one header JSON field edited (type, value, removed, added, list items swapped/duplicated) |
| inner-header | one field of a chunk's / part's own header edited |
| swap | two chunks / parts swapped (alone, or with their index entries), or all reversed |
| drop | a chunk / part removed with its entry (sometimes with the totals made to agree) |
| duplicate | a chunk / part copied over another, or inserted twice (totals made to agree) |
| foreign | a chunk / part of another real file (other codec settings) in its place |
| kvt-* | a .kvt's bits, size, metadata or tensors changed (format_fuzz.py) |

Outcomes: `error` (a KVCodecError), `original` (every value bit for bit), `wrong_data` (decoded
without an error to other values, or values left unwritten: outputs start as a 0x5A pattern), a
`crash` (any other exception). For a .kvt, which has no checksum (its sha256 is its identity),
`wrong_data` is a chunk of the original transform decoded with the changed file, or NaN/inf
accepted. Each case's allocations are tracked (tracemalloc for Python and numpy, the sizes of the
tensors torch factories create): `max_alloc_mb`, and how many cases allocated more than the file's
stated expansion limit (container/validate.py: MAX_EXPANSION x its size).
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import dataclasses
import json
import random
import sys
import time
import tracemalloc
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
import format_fuzz as ff  # noqa: E402
from reliability import bits, m_bitflip, m_resize, mutate_json, real_kv  # noqa: E402

import kvcodec  # noqa: E402
from kvcodec.container import split  # noqa: E402
from kvcodec.container.format import crc32, read_object, write_object  # noqa: E402
from kvcodec.container.validate import MAX_EXPANSION  # noqa: E402
from kvcodec.errors import KVCodecError  # noqa: E402

KINDS = ("KVCF", "KVCS", "KVGF", "KVTF", "kvt")
# the entry list of each nested container and how an entry names its blob's length and checksum
ENTRIES = {b"KVCF": "blobs", b"KVGF": "blobs", b"KVTF": "chunks", b"KVCS": "parts", b"KVCG": "parts"}
PATTERN = 0x5A
clock = time.process_time  # CPU seconds of this process: wall time on a shared machine measures the neighbours


# ---------------------------------------------------------------------------- nested containers


def open_container(blob: bytes) -> tuple[bytes, dict, list[bytes]] | None:
    """(magic, header, blobs in entry order) of a container blob; None for a leaf (KVCC, KVTC, ...)."""
    magic = blob[:4]
    if magic not in ENTRIES:
        return None
    h, payload = read_object(blob, magic, "container")
    out, pos = [], 0
    for e in h[ENTRIES[magic]]:
        if isinstance(e, dict) and "offset" in e:
            out.append(bytes(payload[e["offset"] : e["offset"] + e["length"]]))
        else:
            n = e[1] if isinstance(e, list) else e["length"]
            out.append(bytes(payload[pos : pos + n]))
            pos += n
    return magic, h, out


def close_container(magic: bytes, h: dict, blobs: list[bytes], recompute: bool = True) -> bytes:
    """The container with every entry's offset, length and checksums recomputed for `blobs`
    (entries an edit left malformed stay as they are)."""
    offset = 0
    entries = h.get(ENTRIES[magic]) if recompute else None
    for e, b in zip(entries if isinstance(entries, list) else [], blobs):
        if isinstance(e, list) and len(e) == 3:
            e[1:3] = [len(b), crc32(b)]
        elif isinstance(e, dict):
            e["length"] = len(b)
            if "offset" in e:
                e["offset"] = offset
            if "crc32" in e:
                e["crc32"] = crc32(b)
            if "header_crc32" in e:
                e["header_crc32"] = split.header_crc(b)
        offset += len(b)
    return write_object(magic, h, blobs)


def containers(blob: bytes, path: tuple = ()) -> list[tuple]:
    """Paths (indices of nested blobs) of every container inside `blob`, itself first."""
    opened = open_container(blob)
    if opened is None:
        return []
    out = [path]
    for i, b in enumerate(opened[2]):
        out += containers(b, path + (i,))
    return out


def edit_at(blob: bytes, path: tuple, edit: Callable, recompute: bool = True) -> bytes:
    """`blob` with the container at `path` edited by edit(magic, header, blobs) -> (header, blobs),
    every enclosing container's entries and checksums recomputed (the edited one's too, unless
    `recompute` is False: a header edit is itself the mutation)."""
    magic, h, blobs = open_container(blob)
    if path:
        blobs[path[0]] = edit_at(blobs[path[0]], path[1:], edit, recompute)
        return close_container(magic, h, blobs)
    h, blobs = edit(magic, h, blobs)
    return close_container(magic, h, blobs, recompute)


def _entries(magic: bytes, h: dict) -> list:
    return h[ENTRIES[magic]]


def _fix_totals(magic: bytes, h: dict, entry, sign: int) -> None:
    """Make a file's totals agree with one entry added (+1) or removed (-1), where a total exists."""
    if magic == b"KVTF" and isinstance(entry, list):
        h["shape"][2] += sign * entry[0]
    elif magic == b"KVCS" and isinstance(entry, dict):
        h["layers"] += sign * entry["layers"]


# ---------------------------------------------------------------------------- mutations


def _pick(rng: random.Random, data: bytes, min_blobs: int = 1) -> tuple | None:
    paths = [p for p in containers(data) if len(_entries(*_head(data, p))) >= min_blobs]
    return rng.choice(paths) if paths else None


def _head(data: bytes, path: tuple) -> tuple[bytes, dict]:
    blob = data
    for i in path:
        blob = open_container(blob)[2][i]
    magic, h, _ = open_container(blob)
    return magic, h


def m_header(rng, data: bytes, subject) -> bytes:
    path = _pick(rng, data)

    def edit(magic, h, blobs):
        mutate_json(rng, h)
        return h, blobs

    return edit_at(data, path, edit, recompute=False)


def m_inner_header(rng, data: bytes, subject) -> bytes:
    """One field of a leaf chunk's (or nested container's) own header, its CRC recomputed."""
    path = _pick(rng, data)

    def edit(magic, h, blobs):
        i = rng.randrange(len(blobs))
        inner, payload = read_object(blobs[i], blobs[i][:4], "inner")
        mutate_json(rng, inner)
        blobs[i] = write_object(blobs[i][:4], inner, [bytes(payload)])
        return h, blobs

    return edit_at(data, path, edit)


def m_swap(rng, data: bytes, subject) -> bytes:
    path = _pick(rng, data, 2) or _pick(rng, data)

    def edit(magic, h, blobs):
        entries = _entries(magic, h)
        how = rng.choice(("blobs", "with-entries", "reverse"))
        if how == "reverse" or len(blobs) < 2:
            blobs.reverse()
            if rng.random() < 0.5:
                entries.reverse()
            return h, blobs
        i, j = rng.sample(range(len(blobs)), 2)
        blobs[i], blobs[j] = blobs[j], blobs[i]
        if how == "with-entries":
            entries[i], entries[j] = entries[j], entries[i]
        return h, blobs

    return edit_at(data, path, edit)


def m_drop(rng, data: bytes, subject) -> bytes:
    path = _pick(rng, data)

    def edit(magic, h, blobs):
        entries = _entries(magic, h)
        i = rng.randrange(len(blobs))
        del blobs[i]
        entry = entries.pop(i)
        if rng.random() < 0.5:
            _fix_totals(magic, h, entry, -1)
        return h, blobs

    return edit_at(data, path, edit)


def m_duplicate(rng, data: bytes, subject) -> bytes:
    path = _pick(rng, data)

    def edit(magic, h, blobs):
        entries = _entries(magic, h)
        i = rng.randrange(len(blobs))
        if rng.random() < 0.5 and len(blobs) > 1:
            blobs[rng.choice([j for j in range(len(blobs)) if j != i])] = blobs[i]
        else:
            j = rng.randrange(len(blobs) + 1)
            blobs.insert(j, blobs[i])
            entries.insert(j, copy.deepcopy(entries[i]))
            _fix_totals(magic, h, entries[j], +1)
        return h, blobs

    return edit_at(data, path, edit)


def m_foreign(rng, data: bytes, subject) -> bytes:
    """A chunk (top level) of another real file of the same kind in one chunk's place."""
    others = [o for o in subject.siblings if o != data]
    if not others:
        return m_swap(rng, data, subject)
    other = open_container(rng.choice(others))[2]

    def edit(magic, h, blobs):
        i = rng.randrange(len(blobs))
        blobs[i] = other[min(i, len(other) - 1)]
        return h, blobs

    return edit_at(data, (), edit)


def _plain(mutate):
    return lambda rng, data, subject: mutate(rng, data)


MUTATIONS: dict[str, Callable] = {
    "bitflip": _plain(m_bitflip),
    "resize": _plain(m_resize),
    "header": m_header,
    "inner-header": m_inner_header,
    "swap": m_swap,
    "drop": m_drop,
    "duplicate": m_duplicate,
    "foreign": m_foreign,
}
KVT_MUTATIONS = {name: m for name, (m, _) in ff.KVT_CATEGORIES.items()}


# ---------------------------------------------------------------------------- allocation tracking


class AllocTrack:
    """The largest single tensor torch factories create (empty ones filled with PATTERN, so a
    value a decoder leaves unwritten shows) plus the peak of Python/numpy allocations, per case."""

    FACTORIES = ("empty", "zeros", "ones", "full", "empty_like", "zeros_like", "full_like")

    def __init__(self) -> None:
        self.torch_peak = 0
        self._orig = {name: getattr(torch, name) for name in self.FACTORIES}

    def _wrap(self, name: str):
        orig = self._orig[name]

        def factory(*args, **kwargs):
            t = orig(*args, **kwargs)
            self.torch_peak = max(self.torch_peak, t.numel() * t.element_size())
            if name in ("empty", "empty_like") and t.is_floating_point() and t.numel() and t.is_contiguous():
                t.view(-1).view(torch.uint8).fill_(PATTERN)
            return t

        return factory

    @contextlib.contextmanager
    def case(self):
        self.torch_peak = 0
        base = tracemalloc.get_traced_memory()[0]
        tracemalloc.reset_peak()
        for name in self.FACTORIES:
            setattr(torch, name, self._wrap(name))
        try:
            yield
        finally:
            for name, f in self._orig.items():
                setattr(torch, name, f)
            self.py_peak = max(0, tracemalloc.get_traced_memory()[1] - base)

    @property
    def peak(self) -> int:
        return self.torch_peak + self.py_peak


# ---------------------------------------------------------------------------- subjects


@dataclasses.dataclass
class Subject:
    """A real container and what it decodes to (a list of tensors)."""

    kind: str
    name: str
    data: bytes
    decode: Callable[[bytes], list[torch.Tensor]]
    original: list[torch.Tensor] = dataclasses.field(default_factory=list)
    siblings: list[bytes] = dataclasses.field(default_factory=list)  # other files of the same kind

    def __post_init__(self) -> None:
        if not self.original and self.kind != "kvt":
            self.original = [t.clone() for t in self.decode(self.data)]


def kvcf_subjects(kv: torch.Tensor, ct: int, small: bool = False) -> list[Subject]:
    res = ((144, 144),) if small else ((144, 144), (256, 256))
    configs = {
        "int8-split2": dict(quant="int8", streams_per_chunk=2),
        "exact": dict(quant="exact"),
        "int8": dict(quant="int8"),
        "int4-zstd": dict(quant="int4", sample_coder="zstd"),
    }
    if small:
        configs = dict(list(configs.items())[:2])
    out = []
    for name, kw in configs.items():
        data = kvcodec.encode(kv, kvcodec.CodecConfig(chunk_tokens=ct, resolutions=res, **kw))
        out.append(Subject("KVCF", f"kvcf-{name}", data, lambda d: [kvcodec.decode(d)]))
    return out


def kvcs_subjects(kv: torch.Tensor, ct: int, small: bool = False) -> list[Subject]:
    whole = kv[:, :, : (kv.shape[2] // ct) * ct].contiguous()
    out = []
    for cs in ff.split_subjects(whole[:, :, : ct if small else None], ct):
        for i, blob in enumerate(cs.blobs):
            shape = cs.originals[i].shape

            def decode(d, codec=cs.codec, shape=shape):
                return [codec.decode_chunk(d, torch.empty(shape, dtype=torch.float16))]

            out.append(Subject("KVCS", f"kvcs-{cs.name}-chunk{i}", blob, decode))
    return out


def grouped_kv(kv: torch.Tensor):
    """Real KV as a model of alternating sliding-window and full layers (two groups of the same
    shape, so their parts can be exchanged) plus one more full layer."""
    from kvcodec.kvspec import GroupedKV, KVSpec, LayerSpec

    L, _, T, H, D = kv.shape
    layers = tuple(
        LayerSpec("sliding", (H, D), (H, D), keep=T - 20) if i % 2 == 0 else LayerSpec("full", (H, D), (H, D))
        for i in range(min(L, 5))
    )
    spec = KVSpec(layers, "float16")
    g = GroupedKV.empty(spec, T, window=False)
    for group, t in zip(spec.groups, g.tensors):
        t.copy_(kv[list(group.layers)])
    return g.prefix(T)


def kvgf_subjects(kv: torch.Tensor, ct: int, small: bool = False) -> list[Subject]:
    from kvcodec.codecs import make_codec
    from kvcodec.codecs.grouped import GroupedCodec
    from kvcodec.codecs.grouped_file import decode_grouped, encode_grouped

    gkv = grouped_kv(kv)
    codecs = {
        "raw": make_codec("raw", chunk_tokens=ct),
        "hevc-exact": make_codec("hevc", chunk_tokens=ct, quant="exact", resolutions=((144, 144),)),
        "hevc-int8": make_codec("hevc", chunk_tokens=ct, quant="int8", resolutions=((144, 144), (256, 256))),
    }
    if small:
        codecs.pop("hevc-int8")
    out = []
    for name, inner in codecs.items():
        codec = GroupedCodec(inner)
        data = encode_grouped(gkv, codec)
        out.append(Subject("KVGF", f"kvgf-{name}", data, lambda d, c=codec: list(decode_grouped(d, c).tensors)))
    return out


def kvtf_subjects(kv: torch.Tensor, cal_kv: torch.Tensor, ct: int, small: bool = False) -> tuple[list, Subject]:
    from kvcodec.codecs.transform.codec import TransformCodec
    from kvcodec.codecs.transform.file import decode_file, encode_file
    from kvcodec.transform import calibrate
    from kvcodec.transform.kvt import kvt_hash, to_bytes

    g = torch.Generator().manual_seed(5)
    weights = torch.rand((kv.shape[0], 2, kv.shape[3], kv.shape[4]), generator=g) + 0.5
    cal = calibrate([cal_kv], ff.SMOLLM2_ROPE, weights=weights, info={"model": "smollm2-135m"})
    data = to_bytes(cal)
    out = []
    setups = (
        ("zstd", (64, 64), {}),
        ("hevc", (144, 144), {}),
        ("mixed", (144, 144), {}),  # HEVC and zstd chunks in turn (the default until session 53)
        ("zstd", (64, 64), {"recon": "laplace"}),
    )
    for coder, res, kw in setups[:3] if small else setups:
        codec = TransformCodec(cal, kvt_hash=kvt_hash(data), coder=coder, chunk_tokens=ct, resolutions=(res,), **kw)
        name = f"kvtf-{coder}" + ("-laplace" if kw else "")
        out.append(Subject("KVTF", name, encode_file(kv, codec), lambda d, c=codec: [decode_file(d, c)]))
    chunk = out[0].data  # a file of the original transform: any changed .kvt must refuse its chunks
    first = open_container(chunk)[2][0]
    kvt = Subject("kvt", "kvt-v2", data, None)
    kvt.chunk, kvt.kv = first, kv
    return out, kvt


def all_subjects(kv: torch.Tensor, cal_kv: torch.Tensor, ct: int, small: bool = False) -> dict[str, list[Subject]]:
    """Real files of every kind and codec (`small`: fewer of them, one resolution: CI)."""
    kvtf, kvt = kvtf_subjects(kv, cal_kv, ct, small)
    kinds = {
        "KVCF": kvcf_subjects(kv, ct, small),
        "KVCS": kvcs_subjects(kv, ct, small),
        "KVGF": kvgf_subjects(kv, ct, small),
        "KVTF": kvtf,
        "kvt": [kvt],
    }
    for subjects in kinds.values():
        for s in subjects:
            s.siblings = [o.data for o in subjects if o is not s]
    return kinds


# ---------------------------------------------------------------------------- classification


def classify(subject: Subject, data: bytes, track: AllocTrack, ct: int) -> str:
    if subject.kind == "kvt":
        with track.case():
            outcome = ff.classify_kvt(data, ff.KvtSubject(subject.name, subject.data, subject.kv, subject.chunk), ct)
        if outcome.startswith("altered:") or outcome.startswith("nonfinite"):
            return "wrong_data:" + outcome
        return "crash:" + outcome[6:] if outcome.startswith("crash") else outcome.split(":")[0]
    try:
        with track.case():
            outs = subject.decode(data)
    except KVCodecError:
        return "error"
    except Exception as e:  # noqa: BLE001 - exactly what the fuzzer looks for
        return f"crash:{type(e).__name__}:{str(e)[:100]}"
    same = len(outs) == len(subject.original) and all(
        a.shape == b.shape and a.dtype == b.dtype and torch.equal(bits(a.cpu()), bits(b))
        for a, b in zip(outs, subject.original)
    )
    return "original" if same else "wrong_data"


@dataclasses.dataclass
class KindTally:
    cases: int = 0
    outcomes: Counter = dataclasses.field(default_factory=Counter)
    by_mutation: dict = dataclasses.field(default_factory=dict)
    max_alloc: int = 0
    max_alloc_ratio: float = 0.0
    over_limit: int = 0
    max_case_s: float = 0.0
    failures: list = dataclasses.field(default_factory=list)

    def add(self, mutation: str, outcome: str, alloc: int, size: int, seconds: float, detail: str) -> None:
        head = outcome.split(":")[0]
        self.cases += 1
        self.outcomes[head] += 1
        self.by_mutation.setdefault(mutation, Counter())[head] += 1
        self.max_alloc = max(self.max_alloc, alloc)
        self.max_alloc_ratio = max(self.max_alloc_ratio, alloc / max(size, 1))
        self.max_case_s = max(self.max_case_s, seconds)
        if alloc > MAX_EXPANSION * max(size, 1):
            self.over_limit += 1
            self.failures.append({"mutation": mutation, "outcome": f"over limit: {alloc} bytes", "detail": detail})
        if head in ("wrong_data", "crash") and len(self.failures) < 50:
            self.failures.append({"mutation": mutation, "outcome": outcome, "detail": detail})

    def row(self, kind: str) -> dict:
        return {
            "kind": kind,
            "cases": self.cases,
            "wrong_data": self.outcomes["wrong_data"],
            "crashes": self.outcomes["crash"],
            "errors": self.outcomes["error"],
            "original": self.outcomes["original"],
            "max_alloc_mb": round(self.max_alloc / 2**20, 2),
            "max_alloc_per_file_byte": round(self.max_alloc_ratio, 1),
            "over_expansion_limit": self.over_limit,
            "max_case_cpu_s": round(self.max_case_s, 3),
            "by_mutation": {k: dict(v) for k, v in self.by_mutation.items()},
            "failures": self.failures[:20],
        }


def fuzz(kinds: dict[str, list[Subject]], cases: int, seed: int, ct: int, progress=None, every: int = 500) -> dict:
    """`cases` seeded cases, round-robin over kinds, their mutations and subjects; returns a
    KindTally per kind (progress(tallies, n) is called every `every` cases)."""
    rng = random.Random(seed)
    tallies = {k: KindTally() for k in kinds}
    plan = [(k, m) for k in kinds for m in (KVT_MUTATIONS if k == "kvt" else MUTATIONS)]
    track = AllocTrack()
    tracemalloc.start()
    try:
        for n in range(cases):
            kind, mname = plan[n % len(plan)]
            subjects = kinds[kind]
            subject = subjects[(n // len(plan)) % len(subjects)]
            case_seed = rng.randrange(2**32)
            crng = random.Random(case_seed)
            if kind == "kvt":
                data = KVT_MUTATIONS[mname](crng, subject.data)
            else:
                data = MUTATIONS[mname](crng, subject.data, subject)
            t0 = clock()
            outcome = classify(subject, data, track, ct)
            tallies[kind].add(mname, outcome, track.peak, len(data), clock() - t0, f"{subject.name} seed {case_seed}")
            if progress is not None and (n + 1) % every == 0:
                progress(tallies, n + 1)
    finally:
        tracemalloc.stop()
    return tallies


# ---------------------------------------------------------------------------- the run


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", type=int, default=20000)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--tokens", type=int, default=65)
    ap.add_argument("--chunk-tokens", type=int, default=32)
    ap.add_argument("--out", required=True)
    ap.add_argument("--merge", nargs="+", help="JSON results of runs with other seeds: write their sum to --out")
    ap.add_argument("--note", default="", help="a sentence the result carries (e.g. which commit each run tested)")
    args = ap.parse_args()
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from kvbench.results import write_result

    if args.merge:
        doc = merge([json.loads(Path(p).read_text()) for p in args.merge])
        doc["command"] = "python benchmarks/probes/kinds_fuzz.py " + " ".join(sys.argv[1:])
        doc["note"] = args.note
        write_result(args.out, doc, render(doc))
        return
    torch.set_num_threads(1)
    t0 = time.monotonic()
    kv = real_kv(args.tokens)
    kinds = all_subjects(kv, real_kv(400, text="pg/apple"), args.chunk_tokens)

    def write(tallies: dict, n: int) -> None:
        doc = summary(kinds, tallies, kv, time.monotonic() - t0, complete=n >= args.cases)
        doc["command"] = "python benchmarks/probes/kinds_fuzz.py " + " ".join(sys.argv[1:])
        write_result(args.out, doc, render(doc))

    write(fuzz(kinds, args.cases, args.seed, args.chunk_tokens, progress=write), args.cases)


def summary(kinds: dict, tallies: dict, kv: torch.Tensor, wall_s: float, complete: bool) -> dict:
    rows = [tallies[k].row(k) for k in kinds]
    return {
        "machine": "CPU development VM (2 cores shared with other work), torch threads 1, nice",
        "kv": {"model": "smollm2-135m", "text": "pg/addiction", "shape": list(kv.shape), "dtype": "float16"},
        "subjects": {k: [s.name for s in v] for k, v in kinds.items()},
        "max_expansion": MAX_EXPANSION,
        "complete": complete,
        "wall_s": round(wall_s, 1),
        **totals(rows),
        "kinds": rows,
    }


def totals(rows: list[dict]) -> dict:
    return {
        "cases": sum(r["cases"] for r in rows),
        "wrong_data": sum(r["wrong_data"] for r in rows),
        "crashes": sum(r["crashes"] for r in rows),
        "max_alloc_mb": max(r["max_alloc_mb"] for r in rows),
    }


def merge(docs: list[dict]) -> dict:
    """The sum of runs with other seeds (same subjects)."""
    rows = []
    for i, first in enumerate(docs[0]["kinds"]):
        group = [d["kinds"][i] for d in docs]
        row = {"kind": first["kind"]}
        for key in ("cases", "wrong_data", "crashes", "errors", "original", "over_expansion_limit"):
            row[key] = sum(r[key] for r in group)
        for key in ("max_alloc_mb", "max_alloc_per_file_byte", "max_case_cpu_s"):
            row[key] = max(r[key] for r in group)
        row["by_mutation"] = {}
        for r in group:
            for m, counts in r["by_mutation"].items():
                into = row["by_mutation"].setdefault(m, {})
                for k, v in counts.items():
                    into[k] = into.get(k, 0) + v
        row["failures"] = [f for r in group for f in r["failures"]][:20]
        rows.append(row)
    return {
        **{k: docs[0][k] for k in ("machine", "kv", "subjects", "max_expansion")},
        "runs": [
            {"command": d["command"], "cases": d["cases"], "complete": d["complete"], "wall_s": d["wall_s"]}
            for d in docs
        ],
        "complete": all(d["complete"] for d in docs),
        "wall_s": max(d["wall_s"] for d in docs),
        **totals(rows),
        "kinds": rows,
    }


def render(doc: dict) -> str:
    lines = [
        "# Reliability: every container kind fuzzed (issue 22)",
        "",
        f"`{doc['command']}` on {doc['machine']}; KV {doc['kv']['model']} {doc['kv']['shape']}; {doc['wall_s']} s"
        + ("" if doc["complete"] else " (PARTIAL: the run was still going)")
        + ".",
        *[f"- run: `{r['command']}`: {r['cases']} cases, {r['wall_s']} s" for r in doc.get("runs", [])],
        "",
        "| kind | cases | wrong_data | crashes | errors | original | max_alloc_mb | max alloc / file byte | over limit |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in doc["kinds"]:
        lines.append(
            f"| {r['kind']} | {r['cases']} | {r['wrong_data']} | {r['crashes']} | {r['errors']} | {r['original']} | "
            f"{r['max_alloc_mb']} | {r['max_alloc_per_file_byte']} | {r['over_expansion_limit']} |"
        )
    lines += [
        "",
        f"Total: {doc['cases']} cases, **{doc['wrong_data']} wrong data, {doc['crashes']} crashes**; the largest "
        f"allocation of any case {doc['max_alloc_mb']} MB (limit: {doc['max_expansion']}x the file's size).",
        "",
        "A .kvt has no checksum (its sha256 is its identity): the kvt cases that are neither errors nor the "
        "original are changed calibrations that load, code and restore finite KV and refuse every chunk of the "
        "original (wrong_data would be one of its chunks decoded with them, or NaN/inf accepted).",
        "",
        *([doc["note"], ""] if doc.get("note") else []),
        "Subjects (real files): " + "; ".join(f"{k}: {', '.join(v)}" for k, v in doc["subjects"].items()) + ".",
        "",
        "Outcomes per mutation:",
        "",
    ]
    for r in doc["kinds"]:
        for m, counts in r["by_mutation"].items():
            lines.append(f"- {r['kind']} {m}: " + ", ".join(f"{k} {v}" for k, v in sorted(counts.items())))
    for r in doc["kinds"]:
        for f in r["failures"][:10]:
            lines.append(f"- FAILURE {r['kind']} {f['mutation']}: {f['outcome']} ({f['detail']})")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
