"""Fuzzing real kvcodec containers and store entries: every damaged or forged input must give a
KVCodecError or exactly the original data (never another exception, never uninitialized or
foreign data, never a huge allocation).

    python benchmarks/probes/reliability.py --seconds 300 --seed 1 --out benchmarks/results/reliability-cpu
    python benchmarks/probes/reliability.py ... --formats-seconds 200 --out benchmarks/results/reliability-cpu-v2
(tests/test_fuzz.py runs the same cases, seeded and time-bounded, in CI; --formats-seconds adds the
split, transform, .kvt and TP-shard cases of format_fuzz.py, tests/test_fuzz_formats.py in CI)

Categories (a mutation each; "altered" = decoded completely but to other values, allowed only
where the mutation rewrites content together with its checksums, which no checksum can catch):

| category | mutation | allowed |
|---|---|---|
| bitflip | 1-8 random bits of the file flipped | error, original |
| resize | truncated anywhere, or bytes appended | error, original |
| file-header | one file-header JSON field edited (type, value, removed, added), header CRC recomputed | error, original |
| chunk-header | one chunk blob's header field edited, every CRC recomputed | error, original, altered |
| blob-swap | blob index entries swapped or duplicated between chunks / resolutions | error, original |
| stream-payload | bytes of one stream changed, every CRC recomputed | error, original, altered |
| store-* | a stored chunk blob or meta object damaged, swapped or replaced by another prefix's (fetch) | prefix restored exactly up to the stop, then healed by the next put |
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import json
import random
import resource
import sys
import time
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

import kvcodec
from kvcodec.container.format import CHUNK_MAGIC, FILE_MAGIC, crc32, parse_file, read_object, write_object
from kvcodec.dtypes import SAME_SIZE_INT
from kvcodec.errors import KVCodecError

STRICT = frozenset({"error", "original"})
LOOSE = STRICT | {"altered"}
ODD_VALUES = (None, -1, 0, 1, 3, 2**31, 2**63, -(2**40), 1.5, float("nan"), "", "x", "int8", [], {}, [1], True)


# ---------------------------------------------------------------------------- subjects


@dataclasses.dataclass
class Subject:
    """A real encoded file and what it decodes to."""

    name: str
    data: bytes
    original: torch.Tensor


def make_subject(name: str, kv: torch.Tensor, config: kvcodec.CodecConfig) -> Subject:
    data = kvcodec.encode(kv, config)
    return Subject(name, data, kvcodec.decode(data))


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(SAME_SIZE_INT[t.dtype])


def classify(data: bytes, original: torch.Tensor) -> tuple[str, int]:
    """(outcome, decoded bytes announced): decode twice into outputs pre-filled with different
    bit patterns; any value left unwritten shows up as a difference between the two."""
    try:
        fh, _ = parse_file(data)
        outs = []
        for fill in (0x5A, 0xA5):
            out = torch.full(fh.shape, 0, dtype=original.dtype)
            out.view(torch.uint8).fill_(fill)
            outs.append(kvcodec.decode(data, out=out))
    except KVCodecError:
        return "error", 0
    except Exception as e:  # noqa: BLE001 - exactly what the fuzzer looks for
        return f"crash:{type(e).__name__}:{str(e)[:80]}", 0
    if not torch.equal(bits(outs[0]), bits(outs[1])):
        return "uninitialized", fh.decoded_bytes
    if outs[0].shape == original.shape and torch.equal(bits(outs[0]), bits(original)):
        return "original", fh.decoded_bytes
    return "altered", fh.decoded_bytes


# ---------------------------------------------------------------------------- file rebuilding


def split_file(data: bytes) -> tuple[dict, list[bytes]]:
    """(file header dict, blobs in payload order) of a well-formed file."""
    header, payload = read_object(data, FILE_MAGIC, "file")
    blobs = [bytes(payload[b["offset"] : b["offset"] + b["length"]]) for b in header["blobs"]]
    return header, blobs


def join_file(header: dict, blobs: list[bytes]) -> bytes:
    """A file from a header and one blob per entry, offsets, lengths and CRCs recomputed."""
    offset = 0
    for entry, blob in zip(header["blobs"], blobs):
        entry.update(offset=offset, length=len(blob), crc32=crc32(blob))
        offset += len(blob)
    return write_object(FILE_MAGIC, header, blobs)


def chunk_parts(blob: bytes) -> tuple[dict, bytes]:
    header, payload = read_object(blob, CHUNK_MAGIC, "chunk")
    return header, bytes(payload)


# ---------------------------------------------------------------------------- JSON mutation


def _paths(node: Any, prefix: tuple = ()) -> list[tuple]:
    out = [prefix] if prefix else []
    if isinstance(node, dict):
        for k, v in node.items():
            out += _paths(v, prefix + (k,))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            out += _paths(v, prefix + (i,))
    return out


def mutate_json(rng: random.Random, root: dict) -> str:
    """Edit one node of `root` in place; returns what was done."""
    path = rng.choice(_paths(root))
    parent = root
    for p in path[:-1]:
        parent = parent[p]
    last, value = path[-1], parent[path[-1]]
    action = rng.choice(("odd", "odd", "nudge", "remove", "add", "dup", "swap"))
    if action == "nudge" and isinstance(value, int) and not isinstance(value, bool):
        parent[last] = value + rng.choice((-(2**20), -2, -1, 1, 2, value, 2**20))
    elif action == "remove" and isinstance(parent, (dict, list)):
        del parent[last]
    elif action == "add" and isinstance(parent, dict):
        parent[f"extra{rng.randrange(9)}"] = rng.choice(ODD_VALUES)
    elif action in ("dup", "swap") and isinstance(parent, list) and len(parent) > 1:
        j = rng.randrange(len(parent))
        if action == "dup":
            parent[last] = copy.deepcopy(parent[j])
        else:
            parent[last], parent[j] = parent[j], parent[last]
    else:
        action = "odd"
        parent[last] = copy.deepcopy(rng.choice(ODD_VALUES))
    return f"{action} {'.'.join(map(str, path))}"


# ---------------------------------------------------------------------------- file mutations


def m_bitflip(rng: random.Random, data: bytes) -> bytes:
    buf = bytearray(data)
    for _ in range(rng.randint(1, 8)):
        buf[rng.randrange(len(buf))] ^= 1 << rng.randrange(8)
    return bytes(buf)


def m_resize(rng: random.Random, data: bytes) -> bytes:
    if rng.random() < 0.7:
        return data[: rng.randrange(len(data))]
    return data + rng.randbytes(rng.choice((1, 3, 100, 5000)))


def m_file_header(rng: random.Random, data: bytes) -> bytes:
    header, payload = read_object(data, FILE_MAGIC, "file")
    mutate_json(rng, header)
    return write_object(FILE_MAGIC, header, [bytes(payload)])


def m_chunk_header(rng: random.Random, data: bytes) -> bytes:
    header, blobs = split_file(data)
    i = rng.randrange(len(blobs))
    ch, payload = chunk_parts(blobs[i])
    mutate_json(rng, ch)
    blobs[i] = write_object(CHUNK_MAGIC, ch, [payload])
    return join_file(header, blobs)


def m_blob_swap(rng: random.Random, data: bytes) -> bytes:
    header, blobs = split_file(data)
    i, j = rng.sample(range(len(blobs)), 2) if len(blobs) > 1 else (0, 0)
    if rng.random() < 0.5:
        blobs[i], blobs[j] = blobs[j], blobs[i]
    else:
        blobs[i] = blobs[j]
    return join_file(header, blobs)


def m_stream_payload(rng: random.Random, data: bytes) -> bytes:
    header, blobs = split_file(data)
    i = rng.randrange(len(blobs))
    ch, payload = chunk_parts(blobs[i])
    k = rng.randrange(len(ch["streams"]))
    start = sum(s["length"] for s in ch["streams"][:k])
    stream = bytearray(payload[start : start + ch["streams"][k]["length"]])
    for _ in range(rng.randint(1, 4)):
        if stream:
            stream[rng.randrange(len(stream))] ^= 1 << rng.randrange(8)
    ch["streams"][k].update(length=len(stream), crc32=crc32(bytes(stream)))
    payload = payload[:start] + bytes(stream) + payload[start + len(stream) :]
    blobs[i] = write_object(CHUNK_MAGIC, ch, [payload])
    return join_file(header, blobs)


FILE_CATEGORIES: dict[str, tuple[Callable[[random.Random, bytes], bytes], frozenset]] = {
    "bitflip": (m_bitflip, STRICT),
    "resize": (m_resize, STRICT),
    "file-header": (m_file_header, STRICT),
    "chunk-header": (m_chunk_header, LOOSE),
    "blob-swap": (m_blob_swap, STRICT),
    "stream-payload": (m_stream_payload, LOOSE),
}


# ---------------------------------------------------------------------------- the run


@dataclasses.dataclass
class Tally:
    """Outcomes per category, the violations seen, and resource peaks."""

    outcomes: dict[str, Counter] = dataclasses.field(default_factory=dict)
    violations: list[dict] = dataclasses.field(default_factory=list)
    max_case_s: float = 0.0
    max_announced_bytes: int = 0

    def add(self, category: str, outcome: str, allowed: frozenset, seconds: float, detail: str = "") -> None:
        self.outcomes.setdefault(category, Counter())[outcome.split(":")[0]] += 1
        self.max_case_s = max(self.max_case_s, seconds)
        if outcome not in allowed:
            self.violations.append({"category": category, "outcome": outcome, "detail": detail})


def round_robin(
    subjects: list, categories: dict[str, tuple[Callable, frozenset]], seed: int, seconds: float, min_rounds: int
) -> Iterator[tuple[Any, str, Callable, frozenset, int]]:
    """(subject, category, mutate, allowed, case seed) round-robin over subjects and categories: at
    least `min_rounds` cases of each pair (the same seeded cases every run), then more until
    `seconds` have passed."""
    rng = random.Random(seed)
    names = list(categories)
    end, n, minimum = time.monotonic() + seconds, 0, min_rounds * len(names) * len(subjects)
    while n < minimum or time.monotonic() < end:
        subject = subjects[n % len(subjects)]
        category = names[(n // len(subjects)) % len(names)]
        mutate, allowed = categories[category]
        yield subject, category, mutate, allowed, rng.randrange(2**32)
        n += 1


def fuzz_files(subjects: list[Subject], seed: int, seconds: float, tally: Tally, min_rounds: int = 3) -> None:
    """Each file case of round_robin: a damaged container, classified."""
    cases = round_robin(subjects, FILE_CATEGORIES, seed, seconds, min_rounds)
    for subject, category, mutate, allowed, case_seed in cases:
        data = mutate(random.Random(case_seed), subject.data)
        t0 = time.monotonic()
        outcome, announced = classify(data, subject.original)
        tally.max_announced_bytes = max(tally.max_announced_bytes, announced)
        tally.add(category, outcome, allowed, time.monotonic() - t0, f"{subject.name} case seed {case_seed}")


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


# ---------------------------------------------------------------------------- real KV


def real_kv(tokens: int, model_and_tokenizer=None, text: str = "pg/addiction") -> torch.Tensor:
    """The KV of SmolLM2-135M over the first `tokens` tokens of a real essay, fp16."""
    from kvcodec.integrations.hf import extract_kv
    from kvcodec.models import load_model
    from kvcodec.models.texts import load_text

    m, tok = model_and_tokenizer or load_model("smollm2-135m")
    _, kv = extract_kv(m, tok, load_text(text, max_chars=20 * tokens), max_tokens=tokens)
    return kv.to(torch.float16)


def subjects_from(kv: torch.Tensor, chunk_tokens: int) -> list[Subject]:
    """int8 and exact files at two resolutions; the last chunk is short (one token: plain)."""
    res = ((144, 144), (256, 256))
    return [
        make_subject(f"{quant}", kv, kvcodec.CodecConfig(quant=quant, chunk_tokens=chunk_tokens, resolutions=res))
        for quant in ("int8", "exact")
    ]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--seconds", type=float, default=300.0, help="file fuzzing time; the store fuzzing is extra")
    ap.add_argument("--store-cases", type=int, default=200)
    ap.add_argument("--seed", type=int, default=1)
    ap.add_argument("--tokens", type=int, default=65)
    ap.add_argument("--chunk-tokens", type=int, default=32)
    ap.add_argument("--formats-seconds", type=float, default=0.0, help="per format family (format_fuzz.py)")
    ap.add_argument("--shard-cases", type=int, default=60)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    torch.set_num_threads(1)
    kv = real_kv(args.tokens)
    subjects = subjects_from(kv, args.chunk_tokens)
    rss0 = peak_rss_mb()
    tally = Tally()
    t0 = time.monotonic()
    fuzz_files(subjects, args.seed, args.seconds, tally)
    from store_fuzz import fuzz_store  # noqa: E402 - the store half, beside this file

    store_tally = fuzz_store(kv, args.chunk_tokens, args.seed, args.store_cases)
    if args.formats_seconds > 0:
        fuzz_formats(kv, args, tally, store_tally)
    write_results(args, tally, store_tally, time.monotonic() - t0, rss0, kv)


def fuzz_formats(kv: torch.Tensor, args, tally: Tally, store_tally: Tally) -> None:
    """The format_fuzz.py families into the same tallies (chunk and .kvt cases with the file
    cases, shard cases with the store cases). The transform is calibrated on another essay."""
    import format_fuzz as ff

    s, ct = args.formats_seconds, args.chunk_tokens
    whole = kv[:, :, : (kv.shape[2] // ct) * ct].contiguous()  # full chunks: every one split
    ff.fuzz_chunks(ff.split_subjects(whole, ct), ff.SPLIT_CATEGORIES, args.seed, s, tally)
    subjects, kvt_subject = ff.transform_subjects(kv, real_kv(400, text="pg/apple"), ct)
    ff.fuzz_chunks(subjects, ff.TC_CATEGORIES, args.seed, s, tally)
    ff.fuzz_kvt(kvt_subject, args.seed, s, tally, ct)
    shards = ff.fuzz_shards(kv, ct, args.seed, args.shard_cases)
    for category, counts in shards.outcomes.items():
        store_tally.outcomes[category] = counts
    store_tally.violations += shards.violations
    store_tally.max_case_s = max(store_tally.max_case_s, shards.max_case_s)


def write_results(args, tally: Tally, store_tally: Tally, wall_s: float, rss0: float, kv: torch.Tensor) -> None:
    record = {
        "command": "python benchmarks/probes/reliability.py " + " ".join(sys.argv[1:]),
        "machine": "CPU development VM (2 cores), torch threads 1",
        "kv": {"model": "smollm2-135m", "text": "pg/addiction", "shape": list(kv.shape), "dtype": "float16"},
        "transform_calibration": "smollm2-135m over 400 tokens of pg/apple" if args.formats_seconds else None,
        "wall_s": round(wall_s, 1),
        "file_cases": {k: dict(v) for k, v in tally.outcomes.items()},
        "store_cases": {k: dict(v) for k, v in store_tally.outcomes.items()},
        "violations": tally.violations + store_tally.violations,
        "max_case_s": round(max(tally.max_case_s, store_tally.max_case_s), 3),
        "max_announced_output_bytes": tally.max_announced_bytes,
        "original_output_bytes": kv.numel() * kv.element_size(),
        "peak_rss_growth_mb": round(peak_rss_mb() - rss0, 1),
    }
    out = Path(args.out)
    out.with_suffix(".json").write_text(json.dumps(record, indent=1) + "\n")
    out.with_suffix(".md").write_text(render(record))


def render(r: dict) -> str:
    kinds = ["error", "original", "altered", "uninitialized", "nonfinite", "unhealed", "crash"]
    lines = [
        "# Reliability: fuzzed real containers and store entries",
        "",
        f"`{r['command']}` on {r['machine']}; KV {r['kv']['model']} {r['kv']['shape']} {r['kv']['dtype']}; "
        f"{r['wall_s']} s.",
        "",
        "| category | cases | " + " | ".join(kinds) + " |",
        "|---|---|" + "---|" * len(kinds),
    ]
    for cat, counts in {**r["file_cases"], **r["store_cases"]}.items():
        lines.append(f"| {cat} | {sum(counts.values())} | " + " | ".join(str(counts.get(k, 0)) for k in kinds) + " |")
    lines += [
        "",
        f"Violations (an outcome not allowed for its category): **{len(r['violations'])}**.",
        f"Slowest case {r['max_case_s']} s (wall clock for .kvc and store cases, CPU time of the process for the "
        "format_fuzz.py cases: the machine was shared); largest output any accepted file announced "
        f"{r['max_announced_output_bytes']:,} bytes (the original: {r['original_output_bytes']:,}); "
        f"peak RSS grew {r['peak_rss_growth_mb']} MB over the run.",
        "",
        "Store categories count fetch outcomes: `original` = the whole prefix restored bit for bit, "
        "`error` = the fetch stopped at the damaged chunk with every earlier token exact and the next "
        "`put` healed it (a fetch after it restored everything).",
    ]
    for v in r["violations"][:20]:
        lines.append(f"- {v['category']}: {v['outcome']} ({v['detail']})")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
