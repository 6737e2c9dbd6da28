"""Probe: tensor-parallel restore (issue 14, target 4). Each TP rank fetches and decodes only its
KV heads (PrefixCache(shard=TPShard(r, world, kv_heads))) on its own GPU's NVDEC engines; this
measures aggregate restored GB/s per TP degree against one rank holding every head.

    python benchmarks/probes/tp_restore.py --worlds 1,2 --out OUT.json          # one process per rank

KV: 7B-shaped by default (32 layers, 8 KV heads, head_dim 128, fp16), synthetic (Gaussian with a
per-channel log-normal scale, seeded per chunk: its int8 codes at about 2x vs fp16, as real int8 KV
does; NVDEC time follows coded bits). Chunks are coded with the real HEVC codec (x265 on the CPU,
in `--encode-workers` processes) into a file:// store once per head range; each rank then copies
its own chunks into an in-process memory:// store (so the network is not timed) and restores with
`--sessions` in-process NVDEC sessions (NvcuvidThreads) in one CUDA context per rank process.

Cases per TP degree w (rank r runs in process r on cuda:(r % GPUs)):
  together: all w ranks start at once; aggregate = sum of restored bytes / (last end - first start).
            With >= w GPUs each rank has its own GPU: this is the multi-GPU measurement. With fewer
            GPUs the ranks share a GPU's engines (the "shared-gpu" row), which says nothing about w GPUs.
  alone:    (only when GPUs < w) each rank by itself; "projected" aggregate = sum of bytes / the
            slowest rank's time: what w GPUs give if ranks do not slow each other (separate
            engines, SMs and PCIe links per GPU; host CPU work per rank stays in its own process).
Two timings per case: `fetch` (PrefixCache.fetch, the serving path: metas, pipeline, in-order
restore) and `restore` (every chunk blob handed to the NVDEC threads at once: the engines' rate).
Checks: every rank's chunk 0 is bit-identical to the CPU decoder's restore of the same blob, and
each head of it hashes the same under every TP degree (a shard restores exactly the full KV's heads).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import multiprocessing as mp
import os
import platform
import shlex
import statistics
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import torch

MODEL = "synthetic-7b"


# -- the KV, the codec and the stores (both sides) --------------------------------------------------
def shard_chunk_tokens(a, shard) -> int:
    """Tokens per chunk of a shard: --chunk-tokens, or with --shard-chunks bytes as many more as
    the shard has fewer heads (every chunk then carries the bytes of a full-head chunk)."""
    return a.chunk_tokens * (shard.kv_heads // shard.local_heads if a.shard_chunks == "bytes" else 1)


def config(a, shard):
    from kvcodec.config import CodecConfig

    w, h = map(int, a.resolution.split("x"))
    return CodecConfig(
        quant=a.quant,
        chunk_tokens=shard_chunk_tokens(a, shard),
        resolutions=((w, h),),
        search_layout=False,
        video_bits=a.video_bits,
    )


def base_chunk(a, index: int) -> torch.Tensor:
    """Tokens [index * chunk_tokens, ...) of the synthetic KV (every head), the same in every process."""
    g = torch.Generator().manual_seed(1_000_003)
    scale = torch.exp(0.7 * torch.randn((a.layers, 2, 1, a.kv_heads, a.head_dim), generator=g))
    g.manual_seed(17 + index)
    T = min(a.chunk_tokens, a.tokens - index * a.chunk_tokens)
    return (torch.randn((a.layers, 2, T, a.kv_heads, a.head_dim), generator=g) * scale).half()


def kv_span(a, start: int, stop: int) -> torch.Tensor:
    """Tokens [start, stop) of the synthetic KV; start is a multiple of --chunk-tokens."""
    first, last = start // a.chunk_tokens, -(-stop // a.chunk_tokens)
    return torch.cat([base_chunk(a, i) for i in range(first, last)], dim=2)[:, :, : stop - start]


def token_ids(a) -> list[int]:
    return list(range(1000, 1000 + a.tokens))


def prefix_cache(a, store, shard, device="cpu", codec=None, **kw):
    from kvcodec.codecs.hevc.codec import HevcCodec
    from kvcodec.fetcher import DecodeProfile, PrefixCache

    codec = codec or HevcCodec(config(a, shard))
    kw.setdefault("profile", DecodeProfile.default(codec.resolutions))
    return PrefixCache(store, MODEL, codec, device, shard=shard, policy="fixed:0", **kw)


# -- encode (CPU processes) ---------------------------------------------------------------------
def encode_run(a, world: int, rank: int, first: int, stop: int) -> tuple[int, float]:
    """Encode chunks [first, stop) of one shard into the file store; (blob bytes, seconds)."""
    from kvcodec.codecs.hevc.codec import HevcCodec
    from kvcodec.fetcher.keys import meta_key
    from kvcodec.fetcher.shards import TPShard
    from kvcodec.store import open_store
    from kvcodec.video.x265_cpu import X265Encoder

    torch.set_num_threads(1)
    t0 = time.monotonic()
    shard = TPShard(rank, world, a.kv_heads)
    codec = HevcCodec(config(a, shard), encoder=X265Encoder(threads=2))
    cache = prefix_cache(a, open_store(a.store), shard, codec=codec)
    keys = cache.keys(token_ids(a))[first:stop]
    if all(cache.store.exists_many([meta_key(k) for k in keys])):
        return 0, 0.0
    ct = codec.chunk_tokens
    local = shard.take(kv_span(a, first * ct, min(stop * ct, a.tokens))).contiguous()
    written = 0
    for c in codec.encode_chunks(local, first_chunk_index=first, keys=keys):
        cache.store_chunk(keys[c.index - first], c, (a.layers, shard.local_heads, a.head_dim), "float16")
        written += sum(map(len, c.blobs))
    return written, time.monotonic() - t0


def encode_all(a) -> dict:
    from kvcodec.fetcher.shards import TPShard

    runs, seen = [], set()
    for world in a.worlds:
        for shard in TPShard.all(world, a.kv_heads):
            if shard.key_field in seen:
                continue
            seen.add(shard.key_field)
            n = -(-a.tokens // shard_chunk_tokens(a, shard))
            for first in range(0, n, a.chunks_per_task):
                runs.append((world, shard.rank, first, min(first + a.chunks_per_task, n)))
    t0 = time.monotonic()
    with ProcessPoolExecutor(a.encode_workers, mp_context=mp.get_context("fork")) as ex:
        done = list(ex.map(encode_run, *zip(*[(a, *r) for r in runs])))
    wall = time.monotonic() - t0
    print(f"encoded {len(runs)} runs of up to {a.chunks_per_task} chunks in {wall:.1f} s", flush=True)
    return {"runs": len(runs), "coded_bytes": sum(b for b, _ in done), "wall_s": round(wall, 2)}


# -- rank processes (GPU) -----------------------------------------------------------------------
class Rank:
    """One rank's restore state inside its process: its shard's chunks in memory, its decoders."""

    def __init__(self, a, index: int, gpus: int):
        from kvcodec.codecs.hevc.pool import open_threads

        self.a = a
        if gpus:
            self.device = torch.device("cuda", index % gpus)
            torch.cuda.set_device(self.device)
            self.threads = open_threads(a.sessions, threads=a.threads, device=self.device)
        else:  # a CPU smoke run of the orchestration
            self.device, self.threads = torch.device("cpu"), None
        self.cache = None

    def load(self, world: int, rank: int) -> dict:
        from kvcodec.codecs.hevc.codec import HevcCodec
        from kvcodec.fetcher.keys import blob_key, meta_key
        from kvcodec.fetcher.shards import TPShard
        from kvcodec.store import open_store

        a, ids = self.a, token_ids(self.a)
        self.shard = TPShard(rank, world, a.kv_heads)
        src = prefix_cache(a, open_store(a.store), self.shard)
        mem = open_store("memory://")
        names = [n for k in src.keys(ids) for n in (blob_key(k, 0), meta_key(k))]
        mem.put_many(dict(zip(names, src.store.get_many(names))))
        codec = HevcCodec(config(a, self.shard), pool=self.threads)
        workers = self.threads.threads if self.threads else 1
        self.cache = prefix_cache(
            a, mem, self.shard, self.device, codec, decode_workers=workers, max_inflight=2 * workers
        )
        self.blobs = [mem.get(blob_key(k, 0)) for k in src.keys(ids)]
        self.out = torch.empty(
            (a.layers, 2, a.tokens, self.shard.local_heads, a.head_dim), dtype=torch.float16, device=self.device
        )
        self.fetch()  # warm: sessions opened at this frame size, kernels loaded
        self.restore()
        return {
            "rank": rank,
            "device": str(self.device),
            "heads": [self.shard.heads.start, self.shard.heads.stop],
            "chunk_tokens": self.cache.chunk_tokens,
            "fp16_bytes": self.out.numel() * 2,
            "coded_bytes": sum(map(len, self.blobs)),
        }

    def fetch(self) -> None:
        res = self.cache.fetch(token_ids(self.a), out=self.out)
        if res.error is not None or res.tokens_restored != self.a.tokens:
            raise RuntimeError(f"rank {self.shard}: fetch restored {res.tokens_restored}: {res.error}")
        self._sync()

    def restore(self) -> None:
        from kvcodec.codecs.hevc.pool import restore_chunk, restore_in_pool

        ct = self.cache.chunk_tokens
        outs = [self.out[:, :, i * ct : (i + 1) * ct] for i in range(len(self.blobs))]
        if self.threads is None:
            for b, o in zip(self.blobs, outs):
                restore_chunk(b, o, None)
        else:
            restore_in_pool(self.threads, self.blobs, outs)
        self._sync()

    def _sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def timed(self, what: str, start_at: float) -> tuple[float, float]:
        while time.monotonic() < start_at:
            pass
        t0 = time.monotonic()
        getattr(self, what)()
        return t0, time.monotonic()

    def check(self) -> dict:
        """Chunk 0 against the CPU decoder's restore of the same blob; sha256 of each head of it."""
        from kvcodec.codecs.hevc.decode import decode_chunk_blob

        ct = min(self.cache.chunk_tokens, self.a.tokens)
        got = self.out[:, :, :ct].cpu()
        ref = decode_chunk_blob(self.blobs[0], out=torch.empty_like(got))
        src = self.shard.take(kv_span(self.a, 0, ct)).float()
        base = min(self.a.chunk_tokens, ct)  # the tokens every TP degree's chunk 0 covers
        heads = {
            str(self.shard.heads.start + h): hashlib.sha256(
                got[:, :, :base, h].contiguous().numpy().tobytes()
            ).hexdigest()[:16]
            for h in range(self.shard.local_heads)
        }
        return {
            "exact_vs_cpu": bool(torch.equal(got, ref)),
            "max_abs_err_vs_source": float((got.float() - src).abs().max()),
            "source_max_abs": float(src.abs().max()),
            "head_sha256": heads,
        }


def rank_main(a, index: int, gpus: int, inbox, outbox) -> None:
    try:
        rank = Rank(a, index, gpus)
        outbox.put((index, "started", None))
        for cmd, arg in iter(inbox.get, None):
            if cmd == "load":
                outbox.put((index, cmd, rank.load(*arg)))
            elif cmd in ("fetch", "restore"):
                outbox.put((index, cmd, rank.timed(cmd, arg)))
            elif cmd == "check":
                outbox.put((index, cmd, rank.check()))
    except BaseException as e:  # noqa: BLE001 - the parent reports it
        outbox.put((index, "error", f"{type(e).__name__}: {e}"))


class Ranks:
    """The rank processes (process r runs rank r of every case, on cuda:(r % gpus))."""

    def __init__(self, a, count: int, gpus: int):
        ctx = mp.get_context("spawn")
        self.outbox = ctx.Queue()
        self.inboxes = [ctx.Queue() for _ in range(count)]
        self.procs = [
            ctx.Process(target=rank_main, args=(a, i, gpus, self.inboxes[i], self.outbox), daemon=True)
            for i in range(count)
        ]
        for p in self.procs:
            p.start()
        self.ask(None, dict.fromkeys(range(count)))

    def ask(self, cmd, args: dict) -> dict:
        """Send `cmd` with args[i] to each rank process i in `args`; their replies by index."""
        for i, arg in args.items():
            if cmd is not None:
                self.inboxes[i].put((cmd, arg))
        replies = {}
        while len(replies) < len(args):
            i, kind, value = self.outbox.get(timeout=600)
            if kind == "error":
                raise RuntimeError(f"rank process {i}: {value}")
            replies[i] = value
        return replies

    def close(self) -> None:
        for q in self.inboxes:
            q.put(None)
        for p in self.procs:
            p.join(timeout=30)


# -- cases -------------------------------------------------------------------------------------
def run_case(ranks: Ranks, a, world: int, members: list[int], mode: str) -> dict:
    """Ranks `members` of TP degree `world`, started together `repeats` times per timing."""
    info = ranks.ask("load", {i: (world, i) for i in members})
    rec = {"world": world, "mode": mode, "ranks": [info[i] for i in members], "timings": {}}
    for what in ("fetch", "restore"):
        walls, per_rank = [], {i: [] for i in members}
        for _ in range(a.repeats):
            spans = ranks.ask(what, dict.fromkeys(members, time.monotonic() + 0.05))
            walls.append(max(e for _, e in spans.values()) - min(s for s, _ in spans.values()))
            for i, (s, e) in spans.items():
                per_rank[i].append(e - s)
        rec["timings"][what] = {
            "wall_s": [round(w, 5) for w in walls],
            "rank_s": {str(i): [round(x, 5) for x in v] for i, v in per_rank.items()},
        }
    rec["checks"] = ranks.ask("check", dict.fromkeys(members))
    return rec


def summarize(rec: dict) -> dict:
    """Median rates of one case: aggregate over its ranks as run, or projected (ranks run alone)."""
    fp16 = sum(r["fp16_bytes"] for r in rec["ranks"])
    coded = sum(r["coded_bytes"] for r in rec["ranks"])
    out = {}
    for what, t in rec["timings"].items():
        if rec["mode"] == "alone":  # each rank alone: w GPUs finish when the slowest rank does
            wall = max(statistics.median(v) for v in t["rank_s"].values())
        else:
            wall = statistics.median(t["wall_s"])
        out[what] = {
            "wall_s": round(wall, 5),
            "restored_gb_per_s": round(fp16 / wall / 1e9, 3),
            "coded_gbit_per_s": round(coded * 8 / wall / 1e9, 3),
        }
    return out


def cases_for(a, gpus: int) -> list[tuple[int, list[int], str]]:
    cases = []
    for w in a.worlds:
        members = list(range(w))
        if w == 1 or gpus >= w:
            cases.append((w, members, "own-gpu" if w > 1 else "one-rank"))
        else:
            cases.append((w, members, "alone"))
            if a.shared:
                cases.append((w, members, "shared-gpu"))
    return cases


def run_all(a, gpus: int) -> list[dict]:
    records = []
    ranks = Ranks(a, max(a.worlds), gpus)
    try:
        for world, members, mode in cases_for(a, gpus):
            if mode == "alone":
                parts = [run_case(ranks, a, world, [i], mode) for i in members]
                rec = {**parts[0], "ranks": [p["ranks"][0] for p in parts], "checks": {}}
                rec["timings"] = {
                    w: {"wall_s": [], "rank_s": {k: v for p in parts for k, v in p["timings"][w]["rank_s"].items()}}
                    for w in ("fetch", "restore")
                }
                for p in parts:
                    rec["checks"].update(p["checks"])
            else:
                rec = run_case(ranks, a, world, members, mode)
            rec["summary"] = summarize(rec)
            print(json.dumps({"world": world, "mode": mode, **rec["summary"]}), flush=True)
            records.append(rec)
    finally:
        ranks.close()
    return records


# -- report ------------------------------------------------------------------------------------
def head_agreement(records: list[dict]) -> bool | None:
    """Whether every head's chunk 0 hashes the same under every TP degree that chunks by the same
    tokens (quantization is per chunk: other chunk bounds give other values); None: nothing to compare."""
    seen: dict[tuple, set] = {}
    worlds: dict[int, set] = {}
    for rec in records:
        for info in rec["ranks"]:
            worlds.setdefault(info.get("chunk_tokens"), set()).add(rec["world"])
        for i, check in rec["checks"].items():
            ct = next(r.get("chunk_tokens") for r in rec["ranks"] if str(r["rank"]) == str(i))
            for h, digest in check["head_sha256"].items():
                seen.setdefault((ct, h), set()).add(digest)
    if all(len(w) < 2 for w in worlds.values()):
        return None
    return all(len(v) == 1 for v in seen.values())


def speedups(records: list[dict]) -> dict:
    """Each case's aggregate rate over the TP=1 rate, per timing ("world:mode" -> {timing: ratio})."""
    base = next((r["summary"] for r in records if r["world"] == 1), None)
    if base is None:
        return {}
    return {
        f"{r['world']}:{r['mode']}": {
            w: round(r["summary"][w]["restored_gb_per_s"] / base[w]["restored_gb_per_s"], 3) for w in base
        }
        for r in records
        if r["world"] > 1
    }


def markdown(doc: dict) -> str:
    a = doc["args"]
    lines = [
        "# Tensor-parallel restore: each rank restores only its KV heads (issue 14, target 4)",
        "",
        f"Command: `{doc['command']}`",
        "",
        f"Machine: {doc['machine'].get('gpu', 'no GPU')} x{doc['gpus']}, {doc['machine']['cpu_count']} CPUs. "
        f"KV {a['layers']} layers x {a['kv_heads']} KV heads x {a['head_dim']} dim, {a['tokens']} tokens fp16 "
        f"(synthetic), {a['quant']} at {a['resolution']}, {a['chunk_tokens']}-token chunks; "
        f"{a['sessions']} in-process NVDEC sessions and {a.get('threads') or a['sessions']} decode threads per rank "
        f"process; shard chunks by {a.get('shard_chunks', 'tokens')}; median of {a['repeats']}.",
        "",
        "| TP degree | mode | aggregate | ranks x heads (chunk tokens) | fetch GB/s (fp16-eq) | fetch coded Gbit/s | fetch vs TP=1 "
        "| restore GB/s | restore vs TP=1 | per-rank fetch s (median) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in doc["records"]:
        s, sp = r["summary"], doc["speedup_vs_tp1"].get(f"{r['world']}:{r['mode']}", {})
        heads = r["ranks"][0]["heads"][1] - r["ranks"][0]["heads"][0]
        per_rank = ", ".join(f"{statistics.median(v):.4f}" for v in r["timings"]["fetch"]["rank_s"].values())
        lines.append(
            f"| {r['world']} | {r['mode']} | {'projected' if r['mode'] == 'alone' else 'measured'} | "
            f"{len(r['ranks'])} x {heads} ({r['ranks'][0].get('chunk_tokens', a['chunk_tokens'])}) | {s['fetch']['restored_gb_per_s']} | {s['fetch']['coded_gbit_per_s']} | "
            f"{sp.get('fetch', '-')} | {s['restore']['restored_gb_per_s']} | {sp.get('restore', '-')} | {per_rank} |"
        )
    exact = all(c["exact_vs_cpu"] for r in doc["records"] for c in r["checks"].values())
    lines += [
        "",
        "Modes: `one-rank` every head in one process; `own-gpu` all ranks at once, each on its own GPU "
        "(measured aggregate); `alone` each rank by itself on GPU 0, aggregate projected as all ranks' "
        "bytes / the slowest rank's time (what one GPU per rank gives if ranks do not slow each other); "
        "`shared-gpu` all ranks at once on one GPU (they share its NVDEC engines: not a multi-GPU figure).",
        "",
        f"Checks: chunk 0 of every rank bit-identical to the CPU decoder: {exact}; each head's restored "
        f"chunk 0 identical under every TP degree that chunks alike: {doc['head_agreement']}. Encode: {doc['encode']}.",
    ]
    return "\n".join(lines) + "\n"


def machine_info() -> dict:
    m = {"platform": platform.platform(), "python": platform.python_version(), "cpu_count": os.cpu_count()}
    m["torch"] = torch.__version__
    if torch.cuda.is_available():
        m["gpu"] = torch.cuda.get_device_name(0)
    return m


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--head-dim", type=int, default=128)
    p.add_argument("--tokens", type=int, default=3584)
    p.add_argument("--chunk-tokens", type=int, default=256)
    p.add_argument("--quant", default="int8")
    p.add_argument("--video-bits", type=int, default=3, help="fixed split (no trial encodes): top bits in the video")
    p.add_argument("--resolution", default="512x512")
    p.add_argument("--worlds", default="1,2", help="TP degrees, comma-separated")
    p.add_argument("--gpus", type=int, default=None, help="GPUs to use (default: all visible; 0: CPU smoke run)")
    p.add_argument("--sessions", type=int, default=7, help="NVDEC sessions per rank process")
    p.add_argument("--threads", type=int, default=None, help="decode threads per rank process (default: --sessions)")
    p.add_argument(
        "--shard-chunks",
        choices=("tokens", "bytes"),
        default="tokens",
        help="tokens: every shard chunks by --chunk-tokens; bytes: a shard of 1/k of the heads chunks by k x that",
    )
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--no-shared", dest="shared", action="store_false", help="skip ranks sharing one GPU")
    p.add_argument("--store", default=None, help="file:// store of the encoded chunks (default: a temp dir)")
    p.add_argument("--encode-workers", type=int, default=os.cpu_count())
    p.add_argument("--chunks-per-task", type=int, default=2)
    p.add_argument("--out", default="tp-restore.json")
    a = p.parse_args(argv)
    a.worlds = sorted({int(w) for w in a.worlds.split(",")})
    a.store = a.store or "file://" + tempfile.mkdtemp(prefix="tp-restore-")
    return a


def main(argv=None) -> None:
    a = parse(argv)
    t0 = time.monotonic()
    encode = encode_all(a)  # before any CUDA call in this process: the encoders are forked
    gpus = torch.cuda.device_count() if a.gpus is None else a.gpus
    records = run_all(a, gpus)
    doc = {
        "command": "python benchmarks/probes/tp_restore.py "
        + " ".join(map(shlex.quote, sys.argv[1:] if argv is None else argv)),
        "gpus": gpus,
        "backend": "nvcuvid-threads" if gpus else "ffmpeg-cpu",
        "cuda_contexts_per_rank": 1 if gpus else 0,
        "args": {k: v for k, v in vars(a).items() if k not in ("store", "out")},
        "encode": encode,
        "records": records,
        "head_agreement": head_agreement(records),
        "speedup_vs_tp1": speedups(records),
        "machine": machine_info(),
        "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "wall_s": round(time.monotonic() - t0, 1),
    }
    out = Path(a.out)
    out.write_text(json.dumps(doc, indent=1) + "\n")
    out.with_suffix(".md").write_text(markdown(doc))
    print(markdown(doc))


if __name__ == "__main__":
    main()
