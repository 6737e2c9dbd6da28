"""Host work of one chunk decode around the video decoder (issue 14), on the CPU.

`decode_chunk_blob` is run with a decoder that hands out frames decoded beforehand (the real
FFmpeg decoder, once) and a restorer that does nothing: on the GPU the decoder is NVDEC and the
restore is one asynchronous kernel launch per frame, so what is left is the host work every decoder
thread does per chunk (header, checksums, side streams, uploads, copies of streams), the part that
bounds in-process NVDEC restore when threads share one interpreter.

Measured per case: the median wall and thread-CPU ms per chunk; a phase breakdown (the named
functions of the decode path, timed by wrapping them); and chunks/s with 1 and 2 threads doing
the same work concurrently (this machine's cores): the ratio says how much of the host work runs
outside the GIL. Cases: real SmolLM2-135M KV (an essay, int8 and int4) and a random 7B-shaped
chunk (28 layers x 4 KV heads x 128; timing only), 256-token chunks at the default 512x512.

    python benchmarks/probes/chunk_host_work.py --compare OLD --against NEW --rounds 3 --reps 60 --seconds 3
    # OLD and NEW are commits (NEW left out: the working tree); each round runs both, alternately,
    # in processes of their own on the same blobs; results: benchmarks/results/chunk-host-work-cpu.*
    python benchmarks/probes/chunk_host_work.py --label now   # one run of the working tree
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

from kvcodec.codecs.hevc import decode as hevc_decode
from kvcodec.codecs.hevc.codec import HevcCodec
from kvcodec.config import CodecConfig

RESULTS = Path(__file__).resolve().parents[1] / "results"
# (module, attribute, phase name, enclosing phase or None): wrapped for the breakdown; missing ones
# are skipped, so the same probe runs on the code before and after a change. Nested phases are
# shown under their enclosing one and not subtracted again from the chunk's wall time.
_D = "kvcodec.codecs.hevc.decode"
PHASES = [
    # the decode path since cccf1e9: side streams through one host buffer, centering shift on the host
    (_D, "parse_chunk", "header parse (prefix, CRC, cached JSON + checks)", None),
    ("kvcodec.container.format", "ChunkHeader.from_json", "header validation", "header parse"),
    (_D, "split_streams", "stream split + CRC32", None),
    (_D, "_layout", "layout plan", None),
    (_D, "_chunk_terms", "side terms (streams to the device, gather index)", None),
    (_D, "_upload", "one host buffer: fills + one copy", "side terms"),
    (_D, "_unzstd_into", "zstd into the buffer", "one host buffer"),
    (_D, "_copy_into", "raw copy into the buffer", "one host buffer"),
    (_D, "shift_from_centers", "centering shift (host)", "one host buffer"),
    (_D, "gather_index", "gather index", "side terms"),
    (_D, "_restore_frames", "frames (pre-decoded, restore a no-op)", None),
    # earlier code (kept for --compare against older commits)
    (_D, "read_object", "header read (prefix, CRC, JSON)", None),
    (_D, "_side_params", "side params (zstd, upload)", None),
    (_D, "_centers", "centers (zstd, upload)", None),
    (_D, "_low_bit_planes", "low bit planes (copy, upload)", None),
]


class PredecodedDecoder:
    """Stand-in for NVDEC: the frames of the stream, decoded once beforehand."""

    name = "predecoded"
    device_type = "cpu"

    def __init__(self, frames):
        self.frames = frames
        self.bitstream_types: set[str] = set()

    def decode(self, bitstream, width, height):
        self.bitstream_types.add(type(bitstream).__name__)
        yield from self.frames


class NoRestore:
    name = "none"

    def restore(self, frame, start, n, out):
        pass


def real_kv(tokens: int) -> torch.Tensor:
    from kvcodec.integrations.hf import extract_kv
    from kvcodec.models import load_model
    from kvcodec.models.texts import list_texts, load_text

    model, tok = load_model("smollm2-135m")
    _, kv = extract_kv(model, tok, load_text(list_texts()[0]), max_tokens=tokens)
    return kv.to(torch.float16)


def cases(args) -> dict[str, tuple[torch.Tensor, CodecConfig]]:
    smol = real_kv(args.chunk_tokens)
    gen = torch.Generator().manual_seed(0)
    big = (torch.randn((28, 2, args.chunk_tokens, 4, 128), generator=gen) * 2).to(torch.float16)
    return {
        "smollm2-int8": (smol, CodecConfig(quant="int8")),
        "smollm2-int4": (smol, CodecConfig(quant="int4")),
        "7b-shape-int8": (big, CodecConfig(quant="int8")),
    }


def prepared(args) -> dict:
    """Per case: the config, the chunk blob, its frames (real FFmpeg decode) and the real decode's
    KV; kept in --blobs so that runs of two code versions decode the same blobs."""
    if args.blobs and args.blobs.exists():
        return torch.load(args.blobs, weights_only=False)
    data = {}
    for name, (kv, config) in cases(args).items():
        blob = HevcCodec(config).encode_chunks(kv[:, :, : config.chunk_tokens])[0].blobs[0]
        h = hevc_decode.inspect_chunk_blob(blob)
        frames = list(hevc_decode.get_decoder("cpu").decode(bytes(_video(blob)), *h.resolution))
        reference = hevc_decode.decode_chunk_blob(blob, restore="torch")
        data[name] = {"config": config.to_dict(), "blob": bytes(blob), "frames": frames, "reference": reference}
    if args.blobs:
        torch.save(data, args.blobs)
    return data


def _video(blob):
    from kvcodec.container.format import parse_chunk, split_streams

    h, payload = parse_chunk(blob)
    return split_streams(payload, h.streams, "probe")["video"]


@contextlib.contextmanager
def no_restore():
    saved = hevc_decode.restorer_for
    hevc_decode.restorer_for = lambda terms, prefer="auto": NoRestore()
    try:
        yield
    finally:
        hevc_decode.restorer_for = saved


def one_chunk(codec, blob, out, decoder):
    """What a decoder thread does per chunk: inspect (the fetcher's check), then decode."""
    codec.inspect_chunk(blob)
    hevc_decode.decode_chunk_blob(blob, out=out, decoder=decoder)


def timed_chunks(codec, blob, out, decoder, reps: int) -> tuple[list[float], list[float]]:
    wall, cpu = [], []
    for _ in range(reps):
        t0, c0 = time.perf_counter(), time.thread_time()
        one_chunk(codec, blob, out, decoder)
        wall.append(time.perf_counter() - t0)
        cpu.append(time.thread_time() - c0)
    return wall, cpu


def _resolve(module: str, attr: str):
    owner = importlib.import_module(module)
    *path, name = attr.split(".")
    for p in path:
        owner = getattr(owner, p)
    return owner, name


@contextlib.contextmanager
def phase_timers(totals: dict[str, float]):
    """Wrap every PHASES function present; add its wall time to totals."""
    restore = []
    for module, attr, label, _ in PHASES:
        owner, name = _resolve(module, attr)
        fn = owner.__dict__.get(name) if isinstance(owner, type) else getattr(owner, name, None)
        if fn is None:
            continue
        restore.append((owner, name, fn))
        totals.setdefault(label, 0.0)
        setattr(owner, name, _wrapped(fn, label, totals))
    try:
        yield
    finally:
        for owner, name, fn in restore:
            setattr(owner, name, fn)


def _wrapped(fn, label, totals):
    inner = fn.__func__ if isinstance(fn, classmethod) else fn

    def call(*a, **k):
        t0 = time.perf_counter()
        try:
            return inner(*a, **k)
        finally:
            totals[label] += time.perf_counter() - t0

    return classmethod(call) if isinstance(fn, classmethod) else call


def breakdown(codec, blob, out, decoder, reps: int) -> dict[str, float]:
    totals: dict[str, float] = {}
    with phase_timers(totals):
        wall, _ = timed_chunks(codec, blob, out, decoder, reps)
    per = {_shown(k): 1e3 * v / reps for k, v in totals.items()}
    top = sum(1e3 * v / reps for k, v in totals.items() if _parent(k) is None)
    per["other (rest of decode_chunk_blob + inspect)"] = 1e3 * sum(wall) / reps - top
    return per


def _parent(label: str) -> str | None:
    return next(parent for _, _, name, parent in PHASES if name == label)


def _shown(label: str) -> str:
    """A nested phase's label names the phase it is inside ("zstd into the buffer [in ...]")."""
    parent = _parent(label)
    return label if parent is None else f"{label} [in {parent}]"


def threaded_rate(codec, blob, h, frames, threads: int, seconds: float) -> float:
    """Chunks/s with `threads` threads each decoding chunks into its own output."""
    stop = time.perf_counter() + seconds
    counts = [0] * threads

    def work(i):
        dec = PredecodedDecoder(frames)
        out = torch.empty(h.shape, dtype=torch.float16)
        while time.perf_counter() < stop:
            one_chunk(codec, blob, out, dec)
            counts[i] += 1

    t0 = time.perf_counter()
    ts = [threading.Thread(target=work, args=(i,)) for i in range(threads)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    return sum(counts) / (time.perf_counter() - t0)


def spin_share(work) -> float:
    """This thread's counting rate while a worker runs `work`, against the rate beside a sleeping
    worker: near 1 when `work` releases the GIL, near 0 when it holds it."""

    def rate(fn) -> float:
        done = threading.Event()
        t = threading.Thread(target=lambda: (fn(), done.set()))
        n, t0 = 0, time.perf_counter()
        t.start()
        while not done.is_set():
            n += 1
        t.join()
        return n / (time.perf_counter() - t0)

    seconds = _timed(work)
    idle = rate(lambda: time.sleep(seconds))
    return rate(work) / idle


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def gil_release() -> dict[str, float]:
    """spin_share of the primitives a chunk decode spends its host time in, on 64 MB buffers."""
    import zlib

    import numpy as np
    import zstandard

    data = np.random.default_rng(0).integers(0, 4, 64 << 20, dtype=np.uint8).tobytes()
    into = np.empty(len(data), dtype=np.uint8)
    packed = zstandard.ZstdCompressor(level=1).compress(data)
    work = {
        "zlib.crc32": lambda: zlib.crc32(data),
        "bytes copy": lambda: bytes(memoryview(data)),
        "bytearray copy": lambda: bytearray(data),
        "numpy copy into a buffer": lambda: np.copyto(into, np.frombuffer(data, dtype=np.uint8)),
        "zstd stream_reader.readinto": lambda: zstandard.ZstdDecompressor().stream_reader(packed).readinto(into),
        "json.loads (1 MB header-like)": lambda: json.loads(json.dumps([{"a": i, "b": [i, i]} for i in range(40000)])),
    }
    try:
        from isal.isal_zlib import crc32

        work["isal crc32"] = lambda: crc32(data)
    except ImportError:
        pass
    return {name: spin_share(fn) for name, fn in work.items()}


def measure_case(name, case, args) -> dict:
    codec = HevcCodec(CodecConfig.from_dict(case["config"]))
    blob, frames, reference = case["blob"], case["frames"], case["reference"]
    h = hevc_decode.inspect_chunk_blob(blob)
    dec = PredecodedDecoder(frames)
    out = torch.empty(h.shape, dtype=torch.float16)
    hevc_decode.decode_chunk_blob(blob, out=out, decoder=dec, restore="torch")
    if not torch.equal(out, reference):
        raise SystemExit(f"{name}: decode with the pre-decoded frames differs from the real decode")
    sizes = h.stream_sizes()
    with no_restore():
        timed_chunks(codec, blob, out, dec, 3)  # warm caches
        wall, cpu = timed_chunks(codec, blob, out, dec, args.reps)
        phases = breakdown(codec, blob, out, dec, args.reps)
        rates = {n: threaded_rate(codec, blob, h, frames, n, args.seconds) for n in (1, 2)}
    return {
        "case": name,
        "shape": list(h.shape),
        "quant": h.quant,
        "resolution": list(h.resolution),
        "frames": h.frames,
        "blob_bytes": len(blob),
        "stream_bytes": sizes,
        "host_ms_median": 1e3 * statistics.median(wall),
        "host_ms_min": 1e3 * min(wall),
        "thread_cpu_ms_median": 1e3 * statistics.median(cpu),
        "phases_ms": phases,
        "chunks_per_s": {str(n): r for n, r in rates.items()},
        "scaling_2_threads": rates[2] / rates[1],
        "bitstream_types": sorted(dec.bitstream_types),
    }


def commit() -> str:
    root = Path(__file__).resolve().parents[2]
    return subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], cwd=root, capture_output=True, text=True
    ).stdout.strip()


def run_once(args) -> dict:
    torch.manual_seed(0)
    data = prepared(args)
    return {
        "label": args.label,
        "code": str(Path(hevc_decode.__file__).parents[2]),
        "cases": [measure_case(n, c, args) for n, c in data.items()],
        "gil_release": gil_release(),
    }


def compare(args) -> dict:
    """Rounds of the code at --compare (its src/ unpacked by git archive) and the working tree,
    alternating, each in its own process, on the same blobs: the same load on both."""
    root = Path(__file__).resolve().parents[2]
    old = unpacked(root, args.compare)
    new = unpacked(root, args.against) if args.against else root
    base = [
        sys.executable,
        __file__,
        "--reps",
        str(args.reps),
        "--seconds",
        str(args.seconds),
        "--chunk-tokens",
        str(args.chunk_tokens),
        "--blobs",
        str(args.blobs),
    ]
    rounds: dict[str, list] = {"before": [], "after": []}
    for _ in range(args.rounds):
        for label, path in (("before", old / "src"), ("after", new / "src")):
            out = old / f"{label}.json"
            env = {**os.environ, "PYTHONPATH": str(path)}
            subprocess.run([*base, "--label", label, "--record", str(out)], env=env, check=True)
            rounds[label].append(json.loads(out.read_text()))
    return {label: best_of(rs) for label, rs in rounds.items()}


def unpacked(root: Path, commit: str) -> Path:
    """The src/ folder of `commit`, unpacked into a temporary folder (returned)."""
    folder = Path(tempfile.mkdtemp(prefix=f"kvcodec-{commit}-"))
    archive = subprocess.run(["git", "archive", commit, "src"], cwd=root, capture_output=True, check=True).stdout
    subprocess.run(["tar", "-x", "-C", str(folder)], input=archive, check=True)
    return folder


def best_of(records: list[dict]) -> dict:
    """Per case, the round with the lowest median host time (the least disturbed by other load)."""
    cases = [
        min((r["cases"][i] for r in records), key=lambda c: c["host_ms_median"])
        for i in range(len(records[0]["cases"]))
    ]
    return {**records[0], "cases": cases, "rounds": len(records)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--label", default="after", help="name of this run (e.g. before, after)")
    p.add_argument("--compare", help="a commit: measure its code ('before') against the working tree ('after')")
    p.add_argument("--against", help="with --compare: a commit for 'after' instead of the working tree")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--reps", type=int, default=40)
    p.add_argument("--seconds", type=float, default=4.0, help="per threaded-rate measurement")
    p.add_argument("--chunk-tokens", type=int, default=256)
    p.add_argument("--blobs", type=Path, help="cache of the encoded cases (made when absent)")
    p.add_argument("--record", type=Path, help="write this run's record here (and nothing else)")
    p.add_argument("--out", type=Path, default=RESULTS / "chunk-host-work-cpu.json")
    args = p.parse_args()
    if args.record:
        args.record.write_text(json.dumps(run_once(args)))
        return
    if args.compare:
        args.blobs = args.blobs or Path(tempfile.mkdtemp(prefix="kvcodec-blobs-")) / "cases.pt"
        prepared(args)
        runs = compare(args)
        runs["before"]["commit"] = args.compare
        runs["after"]["commit"] = args.against or commit() + " + working tree"
    else:
        runs = {args.label: {**run_once(args), "commit": commit()}}
    meta = {
        "command": "python benchmarks/probes/chunk_host_work.py " + " ".join(sys.argv[1:]),
        "machine": f"{platform.machine()} CPU x{os.cpu_count()}, {torch.get_num_threads()} torch threads, "
        f"python {platform.python_version()}, shared with other work (load varies)",
        "torch": torch.__version__,
    }
    data = json.loads(args.out.read_text()) if args.out.exists() else {"runs": {}}
    for label, r in runs.items():
        r.pop("code", None)
        data["runs"][label] = {**r, **meta}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(data, indent=1) + "\n")
    args.out.with_suffix(".md").write_text(report(data))
    print(report(data))


def report(data: dict) -> str:
    runs = data["runs"]
    base = runs.get("before")
    lines = ["# Host work per chunk decode, around the video decoder (CPU)", ""]
    lines += [f"- {lab}: commit {r['commit']}, `{r['command']}`, {r['machine']}" for lab, r in runs.items()]
    lines += [
        "",
        "| run | case | blob KB | host ms/chunk (median) | thread CPU ms | chunks/s 1 thread | 2 threads | 2-thread scaling | vs before |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for lab, r in runs.items():
        for c in r["cases"]:
            ref = next((b for b in (base or {}).get("cases", []) if b["case"] == c["case"]), None)
            ratio = f"{ref['host_ms_median'] / c['host_ms_median']:.2f}x faster" if ref and lab != "before" else ""
            lines.append(
                f"| {lab} | {c['case']} | {c['blob_bytes'] / 1e3:.0f} | {c['host_ms_median']:.2f} | "
                f"{c['thread_cpu_ms_median']:.2f} | {c['chunks_per_s']['1']:.0f} | {c['chunks_per_s']['2']:.0f} | "
                f"{c['scaling_2_threads']:.2f} | {ratio} |"
            )
    lines += ["", "## Phases (ms per chunk, wall, wrapped functions; inspect + decode)", ""]
    for lab, r in runs.items():
        for c in r["cases"]:
            parts = ", ".join(f"{k} {v:.2f}" for k, v in c["phases_ms"].items())
            lines.append(f"- {lab} / {c['case']}: {parts}")
    lines += ["", "## GIL release of the primitives (a counting thread's rate beside each: 1 released, 0 held)", ""]
    for lab, r in runs.items():
        if "gil_release" in r:
            lines.append(f"- {lab}: " + ", ".join(f"{k} {v:.2f}" for k, v in r["gil_release"].items()))
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
