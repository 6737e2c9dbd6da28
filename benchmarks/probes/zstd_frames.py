"""zstd'd samples as one frame vs independent frames with a seek table (issue 21): on real KV's
chunk samples (the hevc codec's int8 samples, every bit: what sample_coder "zstd" codes), the
stream's bytes at each frame size against one frame, one chunk's decompression time (the frame
pool and the reading thread vs one frame on one thread), and when each of n chunks
decompressed at once on as many threads finishes (the first-begun chunk should finish first).

    python benchmarks/probes/zstd_frames.py --out benchmarks/results/zstd-frames-cpu.json
"""

from __future__ import annotations

import argparse
import statistics
import sys
import threading
import time
from pathlib import Path

import numpy as np
import zstandard

from kvbench.results import machine, write_result
from kvcodec.codecs import zstd_streams as zs
from kvcodec.codecs.hevc.encode import SAMPLES_ZSTD_LEVEL, _symbols
from kvcodec.config import CodecConfig


def chunk_samples(kv, quant: str, chunk: int) -> list[bytes]:
    config = CodecConfig(quant=quant, chunk_tokens=chunk)
    return [
        _symbols(kv[:, :, a : a + chunk].contiguous(), config).samples.cpu().numpy().tobytes()
        for a in range(0, kv.shape[2] - chunk + 1, chunk)
    ]


def timed(fn, repeat: int) -> float:
    """Median seconds of fn() over `repeat` calls (one warm-up)."""
    fn()
    times = []
    for _ in range(repeat):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def one_chunk_ms(stream: bytes, size: int, repeat: int) -> float:
    buf = np.empty(size, dtype=np.uint8)
    return 1e3 * timed(lambda: zs.unzstd_into(stream, buf, "samples"), repeat)


def _work(i, streams, bufs, barrier, begun, ended, lock) -> None:  # noqa: ANN001
    barrier.wait()
    with lock:
        begun.append(i)
    zs.unzstd_into(streams[i], bufs[i], "samples")
    ended[i] = time.perf_counter()


def finishes_ms(streams: list[bytes], sizes: list[int], repeat: int) -> dict[str, float]:
    """Each of len(streams) threads decompresses its stream at once: the median (over repeats) of the
    first-begun call's finish time and of the sorted finish times' first, middle and last."""
    n, rounds = len(streams), []
    for _ in range(repeat + 1):
        bufs = [np.empty(s, dtype=np.uint8) for s in sizes]
        barrier, begun, ended, lock = threading.Barrier(n + 1), [], {}, threading.Lock()

        threads = [
            threading.Thread(target=_work, args=(i, streams, bufs, barrier, begun, ended, lock)) for i in range(n)
        ]
        for t in threads:
            t.start()
        barrier.wait()
        t0 = time.perf_counter()
        for t in threads:
            t.join()
        done = sorted(1e3 * (e - t0) for e in ended.values())
        rounds.append((1e3 * (ended[begun[0]] - t0), done[0], done[n // 2], done[-1]))
    rounds = rounds[1:]
    keys = ("first_begun", "first", "median", "last")
    return {k: round(statistics.median(r[j] for r in rounds), 3) for j, k in enumerate(keys)}


def concurrent(streams: list[bytes], sizes: list[int], args) -> dict[int, dict[str, float]]:
    return {n: finishes_ms(streams[:n], sizes[:n], args.repeat) for n in map(int, args.concurrent.split(","))}


def quant_samples(args, quant: str) -> tuple[list[bytes], str]:
    """Each chunk's samples, from --samples-file (PATH-QUANT.npy: chunks x bytes, written the
    first time, so a machine without the model can run the probe) or the model's prefill."""
    path = Path(f"{args.samples_file}-{quant}.npy") if args.samples_file else None
    source = f"{args.model} prefill of text {args.text!r}"
    if path is not None and path.exists():
        return [row.tobytes() for row in np.load(path)], source
    from kvbench.fetch import _load_kv

    _, kv, source = _load_kv(args.model, None, args.text, args.tokens)
    samples = chunk_samples(kv, quant, args.chunk)
    if path is not None:
        np.save(path, np.stack([np.frombuffer(s, dtype=np.uint8) for s in samples]))
    return samples, source


def frame_overhead_us(frames: int = 2000, frame_bytes: int = 4096) -> float:
    """Microseconds a frame costs beyond its decompression (claim, block walk, reader; holding
    the interpreter lock): frames of zeros read on the calling thread alone (a pool of no threads)."""
    stream = zs.zstd_frames(bytes(frames * frame_bytes), 1, frame_bytes)
    buf = np.empty(frames * frame_bytes, dtype=np.uint8)
    spans, pool = zs._spans(zs.read_seek_table(stream, "s")), zs._FramePool(0)
    read = lambda: pool.read(zs._Read(0, memoryview(stream), memoryview(buf), spans, "s"))  # noqa: E731
    return round(1e6 * timed(read, 5) / frames, 2)


def measure(args) -> dict:
    rows = []
    for quant in args.quant.split(","):
        samples, source = quant_samples(args, quant)
        first = samples[0]
        sizes = [len(s) for s in samples]
        one = [zstandard.ZstdCompressor(level=SAMPLES_ZSTD_LEVEL).compress(s) for s in samples]
        row = {
            "quant": quant,
            "chunks": len(samples),
            "samples_bytes_per_chunk": sizes[0],
            "one_frame": {
                "bytes": sum(map(len, one)),
                "chunk_ms": round(statistics.mean(one_chunk_ms(o, s, args.repeat) for o, s in zip(one, sizes)), 3),
                "compress_ms": round(1e3 * timed(lambda f=first: zstandard.ZstdCompressor(level=1).compress(f), 5), 3),
                "concurrent_ms": concurrent(one, sizes, args),
            },
            "frames": {},
        }
        for kib in map(int, args.frame_kib.split(",")):
            framed = [zs.zstd_frames(s, SAMPLES_ZSTD_LEVEL, kib << 10) for s in samples]
            total = sum(map(len, framed))
            row["frames"][kib] = {
                "frames_per_chunk": len(zs.read_seek_table(framed[0], "s").frames),
                "bytes": total,
                "over_one_frame_pct": round(100 * (total / row["one_frame"]["bytes"] - 1), 4),
                "chunk_ms": round(statistics.mean(one_chunk_ms(f, s, args.repeat) for f, s in zip(framed, sizes)), 3),
                "compress_ms": round(1e3 * timed(lambda k=kib, f=first: zs.zstd_frames(f, 1, k << 10), 5), 3),
                "concurrent_ms": concurrent(framed, sizes, args),
            }
            print(quant, kib, row["frames"][kib], file=sys.stderr)
        rows.append(row)
    return {
        "source": source,
        "tokens": args.tokens,
        "chunk": args.chunk,
        "frame_threads": zs.FRAME_THREADS,
        "frame_overhead_us": frame_overhead_us(),
        "rows": rows,
    }


def _finishes(by_count: dict) -> str:
    return "; ".join(
        f"{n}: {c['first_begun']} / {c['first']} / {c['median']} / {c['last']}" for n, c in by_count.items()
    )


def markdown(doc: dict) -> list[str]:
    lines = [
        "# zstd'd samples: one frame vs frames with a seek table (issue 21)",
        "",
        f"`{doc['command']}`",
        "",
        f"Machine: {doc['machine']['cpu']}, {doc['machine']['cpu_count']} cores (load {doc['machine'].get('load_avg_1m')}),"
        f" frame pool of {doc['frame_threads']} thread(s) + the reading thread. KV: {doc['source']}, {doc['tokens']}"
        f" tokens, chunks of {doc['chunk']}; samples zstd level {SAMPLES_ZSTD_LEVEL}. Times: medians of repeats,"
        " ms; n chunks at once: one thread per chunk, started together, finish times after their common start."
        f" A frame's own cost (claim, block walk, reader set-up; holding the interpreter lock):"
        f" {doc['frame_overhead_us']} us.",
        "",
        "| quant | frame | frames/chunk | bytes | vs one frame | 1 chunk ms | compress ms | n chunks at once: first-begun / first / median / last done, ms |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in doc["rows"]:
        o = r["one_frame"]
        lines.append(
            f"| {r['quant']} | one | 1 | {o['bytes']:,} | - | {o['chunk_ms']} | {o['compress_ms']} |"
            f" {_finishes(o['concurrent_ms'])} |"
        )
        for kib, f in r["frames"].items():
            lines.append(
                f"| {r['quant']} | {kib} KiB | {f['frames_per_chunk']} | {f['bytes']:,} | {f['over_one_frame_pct']:+.3f}% |"
                f" {f['chunk_ms']} | {f['compress_ms']} | {_finishes(f['concurrent_ms'])} |"
            )
    return lines


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--text", default="pg")
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--chunk", type=int, default=256)
    p.add_argument("--quant", default="int8")
    p.add_argument("--frame-kib", default="128,256,512,1024")
    p.add_argument("--repeat", type=int, default=20)
    p.add_argument("--concurrent", default="8,2", help="threads decompressing a chunk each, at once (a list)")
    p.add_argument("--samples-file", default=None, help="PATH: chunk samples kept in PATH-QUANT.npy")
    p.add_argument("--out", default=None)
    args = p.parse_args()
    doc = {"command": "python benchmarks/probes/zstd_frames.py " + " ".join(sys.argv[1:]), **measure(args)}
    doc["machine"] = machine()
    text = markdown(doc)
    if args.out:
        write_result(args.out, doc, text)
    print("\n".join(text))


if __name__ == "__main__":
    main()
