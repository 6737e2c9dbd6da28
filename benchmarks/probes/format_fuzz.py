"""Fuzzing the formats added after the first reliability run (reliability.py covers .kvc files
and stores): split chunk blobs (magic KVCS), transform-coded chunks (magic KVTC, reference and
batched restore), .kvt calibration files, and stores that serve another TP shard's chunk.

    python benchmarks/probes/reliability.py --formats-seconds 300 ...   (writes the results)
(tests/test_fuzz_formats.py runs the same cases, seeded and time-bounded, in CI)

Outcomes as in reliability.py: "error" (a KVCodecError), "original" (every value exact),
"altered" (decoded completely to other values: allowed only where the mutation rewrites content
together with its checksums, or, for a .kvt, where the file has no checksum of its own and its
sha256 identity changes), "nonfinite" (a .kvt accepted with NaN/inf in its tensors or in what it
restores), "uninitialized", "crash:<type>".

| category | mutation | allowed |
|---|---|---|
| split-bitflip / split-resize | bits flipped / truncated or extended split blob | error, original |
| split-header | one split-header JSON field edited, header CRC recomputed | error, original |
| split-part-header | one part's chunk-header field edited, its CRC and the part length recomputed | error, original, altered |
| split-part-swap | a part replaced by the same-layers part of another chunk, or parts reordered | error, original |
| split-part-payload | bytes of one part's stream changed, every CRC recomputed | error, original, altered |
| tc-bitflip / tc-resize | bits flipped / truncated or extended transform chunk | error, original |
| tc-header | one transform-chunk header field edited, header CRC recomputed | error, original, altered |
| tc-stream | bytes of one stream changed, its CRC recomputed | error, original, altered |
| tc-escapes | the escape list rewritten (indices anywhere, huge values, wrong count), re-coded, CRC recomputed | error, original, altered |
| tc-swap | a chunk of another transform (.kvt) decoded in this chunk's place | error |
| kvt-bitflip / kvt-resize | bits flipped / truncated or extended .kvt | error, original, altered |
| kvt-meta | one metadata field (format, version, shape, rope, groups, info) edited | error, original, altered |
| kvt-tensor | one tensor replaced: NaN / inf / zero / negative / wrong shape / removed / added | error, original, altered |
| shard-* | a store serving another shard's / world size's chunk under this shard's key (fetch) | prefix exact up to the stop, healed by the next put |
"""

from __future__ import annotations

import dataclasses
import json
import random
import time
from collections.abc import Callable

import numpy as np
import torch
import zstandard
from reliability import LOOSE, STRICT, Tally, bits, m_bitflip, m_resize, mutate_json, round_robin

from kvcodec.codecs.hevc.codec import HevcCodec
from kvcodec.codecs.transform.codec import CHUNK_MAGIC as TC_MAGIC
from kvcodec.codecs.transform.codec import TransformCodec
from kvcodec.config import CodecConfig
from kvcodec.container.format import CHUNK_MAGIC, crc32, read_object, write_object
from kvcodec.container.split import SPLIT_MAGIC
from kvcodec.errors import KVCodecError
from kvcodec.transform import calibrate
from kvcodec.transform.kvt import from_bytes, kvt_hash, to_bytes
from kvcodec.transform.rope import RopeSpec

SMOLLM2_ROPE = RopeSpec(100000.0, 64)  # SmolLM2-135M: theta 1e5, HF rotate-half
# a case's cost in CPU seconds of this process: on a shared machine wall time measures the neighbours
clock = time.process_time


# ---------------------------------------------------------------------------- chunk subjects


@dataclasses.dataclass
class ChunkSubject:
    """Real chunk blobs of one codec and what each decodes to (originals[i] for blobs[i])."""

    name: str
    codec: object
    blobs: list[bytes]
    originals: list[torch.Tensor]
    foreign: list[bytes]  # blobs the subject must refuse in any chunk's place (another transform)


def _decode_all(codec, blobs: list[bytes], dtype) -> list[torch.Tensor]:
    outs = []
    for b in blobs:
        info = codec.inspect_chunk(b)
        out = torch.empty((info.layers, 2, info.tokens, info.kv_heads, info.head_dim), dtype=dtype)
        outs.append(codec.decode_chunk(b, out))
    return outs


def chunk_subject(name: str, codec, kv: torch.Tensor, foreign: list[bytes] | None = None) -> ChunkSubject:
    blobs = [c.blobs[0] for c in codec.encode_chunks(kv, keys=[f"k{i}" for i in range(_count(codec, kv))])]
    return ChunkSubject(name, codec, blobs, _decode_all(codec, blobs, kv.dtype), foreign or [])


def _count(codec, kv: torch.Tensor) -> int:
    return -(-kv.shape[2] // codec.chunk_tokens)


def classify_chunk(codec, blob: bytes, original: torch.Tensor) -> str:
    """Decode into two outputs of the original's shape filled with different bit patterns."""
    try:
        outs = []
        for fill in (0x5A, 0xA5):
            out = torch.empty_like(original)
            out.view(torch.uint8).fill_(fill)
            outs.append(codec.decode_chunk(blob, out))
    except KVCodecError:
        return "error"
    except Exception as e:  # noqa: BLE001 - exactly what the fuzzer looks for
        return f"crash:{type(e).__name__}:{str(e)[:80]}"
    if not torch.equal(bits(outs[0]), bits(outs[1])):
        return "uninitialized"
    if torch.equal(bits(outs[0]), bits(original)):
        return "original"
    return "altered"  # finite or not: rewritten content under recomputed checksums


# ---------------------------------------------------------------------------- split mutations


def _split_parts(blob: bytes) -> tuple[dict, list[bytes]]:
    h, payload = read_object(blob, SPLIT_MAGIC, "split")
    parts, pos = [], 0
    for p in h["parts"]:
        parts.append(bytes(payload[pos : pos + p["length"]]))
        pos += p["length"]
    return h, parts


def _join_split(h: dict, parts: list[bytes]) -> bytes:
    for entry, part in zip(h["parts"], parts):
        entry["length"] = len(part)
    return write_object(SPLIT_MAGIC, h, parts)


def _rewrite_stream(rng: random.Random, header: dict, payload: bytes, entries: list, crc_at: int) -> bytes:
    """Flip 1-4 bits in one stream of `payload`; the entry's length and CRC are kept in step."""
    k = rng.randrange(len(entries))
    length = lambda e: e["length"] if isinstance(e, dict) else e[2]  # noqa: E731
    start = sum(length(e) for e in entries[:k])
    stream = bytearray(payload[start : start + length(entries[k])])
    for _ in range(rng.randint(1, 4)):
        if stream:
            stream[rng.randrange(len(stream))] ^= 1 << rng.randrange(8)
    if isinstance(entries[k], dict):
        entries[k]["crc32"] = crc32(bytes(stream))
    else:
        entries[k][crc_at] = crc32(bytes(stream))
    return payload[:start] + bytes(stream) + payload[start + len(stream) :]


def m_split_header(rng, blob: bytes, subject) -> bytes:
    h, payload = read_object(blob, SPLIT_MAGIC, "split")
    mutate_json(rng, h)
    return write_object(SPLIT_MAGIC, h, [bytes(payload)])


def m_split_part_header(rng, blob: bytes, subject) -> bytes:
    h, parts = _split_parts(blob)
    i = rng.randrange(len(parts))
    ph, payload = read_object(parts[i], CHUNK_MAGIC, "chunk")
    mutate_json(rng, ph)
    parts[i] = write_object(CHUNK_MAGIC, ph, [bytes(payload)])
    return _join_split(h, parts)


def m_split_part_swap(rng, blob: bytes, subject) -> bytes:
    h, parts = _split_parts(blob)
    if rng.random() < 0.5 and len(subject.blobs) > 1:
        other = _split_parts(rng.choice([b for b in subject.blobs if b != blob]))[1]
        i = rng.randrange(min(len(parts), len(other)))
        parts[i] = other[i]
    else:
        i, j = rng.sample(range(len(parts)), 2)
        parts[i], parts[j] = parts[j], parts[i]
    return _join_split(h, parts)


def m_split_part_payload(rng, blob: bytes, subject) -> bytes:
    h, parts = _split_parts(blob)
    i = rng.randrange(len(parts))
    ph, payload = read_object(parts[i], CHUNK_MAGIC, "chunk")
    payload = _rewrite_stream(rng, ph, bytes(payload), ph["streams"], 3)
    parts[i] = write_object(CHUNK_MAGIC, ph, [payload])
    return _join_split(h, parts)


# ---------------------------------------------------------------------------- transform mutations


def m_tc_header(rng, blob: bytes, subject) -> bytes:
    h, payload = read_object(blob, TC_MAGIC, "tc")
    mutate_json(rng, h)
    return write_object(TC_MAGIC, h, [bytes(payload)])


def m_tc_stream(rng, blob: bytes, subject) -> bytes:
    h, payload = read_object(blob, TC_MAGIC, "tc")
    payload = _rewrite_stream(rng, h, bytes(payload), h["streams"], 3)
    return write_object(TC_MAGIC, h, [payload])


def m_tc_escapes(rng, blob: bytes, subject) -> bytes:
    """A well-formed, re-coded escape list that lies: indices anywhere (negative as uint32
    wrap-around, past the end), huge values, or a count that disagrees with the header."""
    h, payload = read_object(blob, TC_MAGIC, "tc")
    names = [e[0] for e in h["streams"]]
    k = names.index("escapes")
    n = rng.choice((1, 2, 5, 100))
    idx = np.array(sorted(rng.randrange(-(2**20), 2**32 - 1) for _ in range(n)), dtype=np.int64) % (2**32)
    values = np.array([rng.choice((0, 1, -1, 2**31 - 1, -(2**31), 300, -300)) for _ in range(n)], dtype=np.int64)
    raw = np.uint32(n).tobytes() + idx.astype(np.uint32).tobytes() + values.astype(np.int32).tobytes()
    if rng.random() < 0.3:
        raw = raw[: rng.randrange(len(raw))]
    stream = zstandard.ZstdCompressor().compress(raw)
    if rng.random() < 0.7:
        h["escapes"] = n
    streams, pos = [], 0
    for e in h["streams"]:
        streams.append(bytes(payload[pos : pos + e[2]]))
        pos += e[2]
    streams[k] = stream
    h["streams"][k][2:4] = [len(stream), crc32(stream)]
    return write_object(TC_MAGIC, h, streams)


def m_tc_swap(rng, blob: bytes, subject) -> bytes:
    """A chunk of another transform (the codec must refuse it). A chunk of the same codec in
    another chunk's place is the caller's check (its key, index and start token: the fetcher's)."""
    return rng.choice(subject.foreign)


def _plain(mutate):
    return lambda rng, blob, subject: mutate(rng, blob)


SPLIT_CATEGORIES: dict[str, tuple[Callable, frozenset]] = {
    "split-bitflip": (_plain(m_bitflip), STRICT),
    "split-resize": (_plain(m_resize), STRICT),
    "split-header": (m_split_header, STRICT),
    "split-part-header": (m_split_part_header, LOOSE),
    "split-part-swap": (m_split_part_swap, STRICT),
    "split-part-payload": (m_split_part_payload, LOOSE),
}
TC_CATEGORIES: dict[str, tuple[Callable, frozenset]] = {
    "tc-bitflip": (_plain(m_bitflip), STRICT),
    "tc-resize": (_plain(m_resize), STRICT),
    "tc-header": (m_tc_header, LOOSE),
    "tc-stream": (m_tc_stream, LOOSE),
    "tc-escapes": (m_tc_escapes, LOOSE),
    "tc-swap": (m_tc_swap, STRICT),
}


def fuzz_chunks(
    subjects: list[ChunkSubject], categories: dict, seed: int, seconds: float, tally: Tally, min_rounds: int = 3
) -> None:
    """Each case of round_robin (reliability.py) damages one chunk blob."""
    for subject, category, mutate, allowed, case_seed in round_robin(subjects, categories, seed, seconds, min_rounds):
        crng = random.Random(case_seed)
        i = crng.randrange(len(subject.blobs))
        blob = mutate(crng, subject.blobs[i], subject)
        t0 = clock()
        outcome = classify_chunk(subject.codec, blob, subject.originals[i])
        tally.add(category, outcome, allowed, clock() - t0, f"{subject.name} chunk {i} case seed {case_seed}")


# ---------------------------------------------------------------------------- .kvt files


def _kvt_parts(data: bytes) -> tuple[dict, dict[str, torch.Tensor]]:
    from safetensors.torch import load

    n = int.from_bytes(data[:8], "little")
    return json.loads(data[8 : 8 + n]).get("__metadata__", {}), dict(load(data))


def _kvt_join(meta: dict, tensors: dict[str, torch.Tensor]) -> bytes:
    from safetensors.torch import save

    return save({k: v.contiguous() for k, v in tensors.items()}, metadata=meta)


def m_kvt_meta(rng, data: bytes) -> bytes:
    meta, tensors = _kvt_parts(data)
    key = rng.choice(sorted(meta))
    try:
        value = json.loads(meta[key])
    except ValueError:
        value = meta[key]
    if isinstance(value, (dict, list)) and value and rng.random() < 0.7:
        root = {"v": value}
        mutate_json(rng, root)
        value = root.get("v")
    else:
        value = rng.choice((None, -1, 0, 1, 2**40, 1.5, float("nan"), "", "x", [], {}, [1], True, "2", "3"))
    if rng.random() < 0.1:
        del meta[key]
    else:
        meta[key] = value if isinstance(value, str) and rng.random() < 0.5 else json.dumps(value)
    return _kvt_join(meta, tensors)


def m_kvt_tensor(rng, data: bytes) -> bytes:
    meta, tensors = _kvt_parts(data)
    name = rng.choice(sorted(tensors))
    t = tensors[name].clone()
    how = rng.choice(("nan", "inf", "zero", "negative", "shape", "remove", "add", "huge", "swap"))
    if how in ("nan", "inf", "huge"):
        flat = t.view(-1)
        for _ in range(rng.randint(1, 3)):
            flat[rng.randrange(flat.numel())] = {"nan": float("nan"), "inf": float("-inf"), "huge": 3e38}[how]
    elif how == "zero":
        t.zero_()
    elif how == "negative":
        t = -t.abs()
    elif how == "shape":
        t = t.reshape(-1)[: max(1, t.numel() - rng.choice((1, t.shape[-1])))].clone()
    elif how == "swap":
        same = [k for k in tensors if k != name and k.rsplit(".", 1)[1] == name.rsplit(".", 1)[1]]
        t = tensors[rng.choice(same)].clone() if same else t
    if how == "remove":
        del tensors[name]
    elif how == "add":
        tensors[f"g{rng.randrange(9)}.k.weights"] = torch.rand(t.shape[0]) + 0.5
    else:
        tensors[name] = t
    if rng.random() < 0.3:
        meta["version"] = rng.choice(("1", "2"))
    return _kvt_join(meta, tensors)


KVT_CATEGORIES: dict[str, tuple[Callable, frozenset]] = {
    "kvt-bitflip": (m_bitflip, LOOSE),
    "kvt-resize": (m_resize, STRICT),
    "kvt-meta": (m_kvt_meta, LOOSE),
    "kvt-tensor": (m_kvt_tensor, LOOSE),
}


@dataclasses.dataclass
class KvtSubject:
    name: str
    data: bytes
    kv: torch.Tensor  # KV the codec encodes with a loaded (possibly damaged) calibration
    chunk: bytes  # a chunk coded with the original .kvt: any other .kvt must refuse it


def classify_kvt(data: bytes, subject: KvtSubject, chunk_tokens: int) -> str:
    """error (KVCodecError while loading or coding), original (bytes unchanged), altered (a
    loaded calibration that codes and restores finite KV and refuses the original's chunks)."""
    try:
        cal = from_bytes(data)
        finite = all(bool(torch.isfinite(t).all()) for b in cal.bases.values() for t in (b.mean, b.basis, b.variances))
        if not finite:
            return "nonfinite:calibration tensors hold NaN or infinity"
        codec = TransformCodec(cal, kvt_hash=kvt_hash(data), coder="zstd", chunk_tokens=chunk_tokens)
        if data == subject.data:
            return "original"
        out = torch.empty((subject.kv.shape[0], 2, chunk_tokens, *subject.kv.shape[3:]), dtype=subject.kv.dtype)
        try:
            codec.decode_chunk(subject.chunk, out)
            return "altered:a chunk of the original transform decoded with another"
        except KVCodecError:
            pass
        blob = codec.encode_chunks(subject.kv[:, :, :chunk_tokens])[0].blobs[0]
        codec.decode_chunk(blob, out)
    except KVCodecError:
        return "error"
    except Exception as e:  # noqa: BLE001
        return f"crash:{type(e).__name__}:{str(e)[:80]}"
    return "altered" if bool(torch.isfinite(out.float()).all()) else "nonfinite:restored KV holds NaN or infinity"


def fuzz_kvt(subject: KvtSubject, seed: int, seconds: float, tally: Tally, chunk_tokens: int, min_rounds: int = 3):
    for _, category, mutate, allowed, case_seed in round_robin([subject], KVT_CATEGORIES, seed, seconds, min_rounds):
        data = mutate(random.Random(case_seed), subject.data)
        t0 = clock()
        outcome = classify_kvt(data, subject, chunk_tokens)
        tally.add(category, outcome, allowed, clock() - t0, f"{subject.name} case seed {case_seed}")


# ---------------------------------------------------------------------------- subjects from real KV


def transform_subjects(kv: torch.Tensor, cal_kv: torch.Tensor, chunk_tokens: int) -> tuple[list, KvtSubject]:
    """Transform codecs (zstd and hevc coders, reference and batched restore) over a calibration
    of `cal_kv` (another text), coding `kv`; and the .kvt subject (v2: Fisher-like weights)."""
    cal = calibrate([cal_kv], SMOLLM2_ROPE, info={"model": "smollm2-135m"})
    data = to_bytes(cal)
    g = torch.Generator().manual_seed(5)
    weights = torch.rand((kv.shape[0], 2, kv.shape[3], kv.shape[4]), generator=g) + 0.5
    wcal = calibrate([cal_kv], SMOLLM2_ROPE, weights=weights, info={"model": "smollm2-135m"})
    wdata = to_bytes(wcal)
    other = TransformCodec(wcal, kvt_hash=kvt_hash(wdata), coder="zstd", chunk_tokens=chunk_tokens)
    foreign = [c.blobs[0] for c in other.encode_chunks(kv)]
    subjects = []
    for coder, res in (("zstd", (64, 64)), ("hevc", (144, 144))):
        for batched in (False, True):
            codec = TransformCodec(
                cal, kvt_hash=kvt_hash(data), coder=coder, chunk_tokens=chunk_tokens, resolutions=(res,), theta=None
            )
            codec._restorer.batched = batched  # the batched (GPU) restore, run on the CPU
            subjects.append(chunk_subject(f"transform-{coder}-{'batched' if batched else 'ref'}", codec, kv, foreign))
    kvt_subject = KvtSubject("kvt-v2", wdata, kv, foreign[0])
    return subjects, kvt_subject


def split_subjects(kv: torch.Tensor, chunk_tokens: int) -> list[ChunkSubject]:
    res = ((144, 144),)
    out = []
    for quant, streams in (("int8", 3), ("exact", 2)):
        cfg = CodecConfig(quant=quant, chunk_tokens=chunk_tokens, resolutions=res, streams_per_chunk=streams)
        out.append(chunk_subject(f"split-{quant}-{streams}", HevcCodec(cfg), kv))
    return out


# ---------------------------------------------------------------------------- TP shards in a store


def _shard_cache(store, shard, chunk_tokens: int):
    from kvcodec.fetcher import PrefixCache

    cfg = CodecConfig(quant="int8", chunk_tokens=chunk_tokens, resolutions=((144, 144),))
    return PrefixCache(store, "fuzz-model", HevcCodec(cfg), "cpu", policy="fixed:0", shard=shard)


def _forge_key(blob: bytes, key: str) -> bytes:
    """A chunk blob rebound to `key` (header CRC recomputed); a split blob's parts too."""
    if blob[:4] == SPLIT_MAGIC:
        h, parts = _split_parts(blob)
        parts = [_forge_key(p, key) for p in parts]
        h["key"] = key
        for entry in h["parts"]:
            entry.pop("header_crc32", None)
        h["split_version"] = 1
        return _join_split(h, parts)
    h, payload = read_object(blob, CHUNK_MAGIC, "chunk")
    h["key"] = key
    return write_object(CHUNK_MAGIC, h, [bytes(payload)])


def shard_mutations(keys: dict) -> dict:
    """category -> (allowed, edit(rng, store)): keys[name] = the chunk keys of each stored shard
    ("mine": the fetching rank's heads, "other": another rank's heads of the same world, "full":
    a world-1 producer's every head, "pair": a world-2-like range of two heads)."""
    from kvcodec.fetcher import blob_key, meta_key

    def serve(source: str, with_meta: bool, forge: bool = False):
        def edit(rng, st):
            i = rng.randrange(len(keys["mine"]))
            mine, theirs = keys["mine"][i], keys[source][i]
            blob = st.get(blob_key(theirs, 0))
            st.put(blob_key(mine, 0), _forge_key(blob, mine) if forge else blob)
            if with_meta:
                st.put(meta_key(mine), st.get(meta_key(theirs)))

        return edit

    return {
        "shard-other-heads": (STRICT, serve("other", False)),
        "shard-other-heads+meta": (STRICT, serve("other", True)),
        "shard-other-world": (STRICT, serve("full", False)),
        "shard-other-world+meta": (STRICT, serve("full", True)),
        "shard-forged-key": (LOOSE, serve("other", True, forge=True)),
    }


def fuzz_shards(kv: torch.Tensor, chunk_tokens: int, seed: int, cases: int, streams: int = 1) -> Tally:
    """A store holding rank 0's, rank 1's (of a world of kv_heads ranks) and a world-1 producer's
    chunks of one prefix; each case serves rank 1's or the full chunk under rank 0's key, then
    rank 0 fetches: its restored tokens must be exact, the fetch must stop at the foreign chunk,
    and the next put must heal the store."""
    from kvcodec.fetcher.shards import TPShard
    from kvcodec.store.memory import MemoryStore

    H = kv.shape[3]
    ids = torch.arange(kv.shape[2]) + 2000
    base = MemoryStore()
    full = _shard_cache(base, None, chunk_tokens)
    full.put(ids, kv)
    full.put_sharded(ids, kv, H)
    mine, other = TPShard(0, H, H), TPShard(1, H, H)
    keys = {"mine": _shard_cache(base, mine, chunk_tokens).keys(ids), "full": full.keys(ids)}
    keys["other"] = _shard_cache(base, other, chunk_tokens).keys(ids)
    snapshot = {k: base.get(k) for k in base.list()}
    local = mine.take(kv).contiguous()
    clean = _shard_cache(base, mine, chunk_tokens).fetch(ids).kv.clone()
    mutations = shard_mutations(keys)
    names, rng, tally = list(mutations), random.Random(seed), Tally()
    for n in range(cases):
        category = names[n % len(names)]
        allowed, edit = mutations[category]
        case_seed = rng.randrange(2**32)
        st = MemoryStore()
        st.put_many(snapshot)
        edit(random.Random(case_seed), st)
        t0 = clock()
        outcome = _fetch_shard(_shard_cache(st, mine, chunk_tokens), ids, local, clean)
        tally.add(category, outcome, allowed, clock() - t0, f"case seed {case_seed}")
    return tally


def _fetch_shard(cache, ids, local: torch.Tensor, clean: torch.Tensor) -> str:
    try:
        res = cache.fetch(ids, deadline_s=30.0)
        n = res.tokens_restored
        if res.kv is not None and not torch.equal(bits(res.kv[:, :, :n]), bits(clean[:, :, :n])):
            return "altered"
        if res.kv is None and n:
            return f"altered:{n} tokens reported restored without a result tensor"
        outcome = "original" if n == len(ids) and res.error is None else "error"
        cache.put(ids, local)
        healed = cache.fetch(ids, deadline_s=30.0)
        if healed.tokens_restored != len(ids) or not torch.equal(bits(healed.kv), bits(clean)):
            return f"unhealed:after a put the fetch restored {healed.tokens_restored} of {len(ids)} ({healed.error})"
        return outcome
    except Exception as e:  # noqa: BLE001 - fetch and put must not raise for stored-data damage
        return f"crash:{type(e).__name__}:{str(e)[:80]}"
