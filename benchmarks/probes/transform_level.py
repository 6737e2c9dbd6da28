"""`kvcodec encode --transform M.kvt --target-ratio R` before and after a change to the transform
codec's level search (issue 24: the target-ratio search took most of a CPU encode), on the same KV
file and machine: each round runs the command once with kvcodec imported from --a and once from
--b (child processes, interleaved), timing the whole process (wall, and processor time of it and
its threads) and the encode alone (the command's own "in X s"); then decodes every file (with the
current tree) and measures its error against the KV and against A's decoded KV.

    python benchmarks/probes/transform_level.py KV.safetensors --kvt M.kvt --ratio 5 \
        --a OLD/src --b src --rounds 3 --out results/encode-cpu-x.json
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

LINE = re.compile(r": ([\d,]+) bytes for (\d+) tokens in ([\d.]+) s; ([\d.]+)x vs fp16")


def run_once(tree: str, kv: Path, kvt: Path, ratio: float, dst: Path) -> dict:
    """One `kvcodec encode` in a child process importing kvcodec from `tree`."""
    env = {**os.environ, "PYTHONPATH": str(Path(tree).resolve())}
    cmd = [sys.executable, "-c", "import sys; from kvcodec.cli.main import main; sys.exit(main())"]
    cmd += ["encode", str(kv), str(dst), "--transform", str(kvt), "--target-ratio", str(ratio)]
    before, t0 = resource.getrusage(resource.RUSAGE_CHILDREN), time.perf_counter()
    out = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True)
    wall, after = time.perf_counter() - t0, resource.getrusage(resource.RUSAGE_CHILDREN)
    m = LINE.search(out.stdout)
    if m is None:
        raise RuntimeError(f"unexpected output of {cmd}: {out.stdout} {out.stderr}")
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return {
        "process_wall_s": round(wall, 3),
        "process_cpu_s": round(cpu, 3),
        "encode_s": float(m.group(3)),
        "bytes": int(m.group(1).replace(",", "")),
        "ratio_vs_fp16": float(m.group(4)),
    }


def errors(kv_path: Path, kvt: Path, files: dict[str, Path]) -> dict[str, dict]:
    """Relative squared error of each file's decoded K and V against the KV, and against A's decode."""
    import torch
    from safetensors.torch import load_file

    from kvcodec.codecs.transform.codec import open_transform
    from kvcodec.codecs.transform.file import decode_file

    ref = load_file(str(kv_path))["kv"].float()
    codec = open_transform(kvt)
    decoded = {k: decode_file(p.read_bytes(), codec).float() for k, p in files.items()}

    def rel(a: torch.Tensor, b: torch.Tensor) -> float:
        return float((a - b).pow(2).mean() / b.pow(2).mean())

    return {
        k: {
            "rel_mse_k": rel(d[:, 0], ref[:, 0]),
            "rel_mse_v": rel(d[:, 1], ref[:, 1]),
            "rel_mse_vs_a": rel(d, decoded["a"]),
        }
        for k, d in decoded.items()
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("kv", type=Path)
    p.add_argument("--kvt", type=Path, required=True)
    p.add_argument("--ratio", type=float, action="append", help="target ratio (repeatable; default 5)")
    p.add_argument("--a", required=True, help="source tree (the folder holding kvcodec/) before")
    p.add_argument("--b", required=True, help="source tree after")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--out", type=Path, required=True)
    args = p.parse_args()
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from kvbench.results import machine, utc_now

    doc = {
        "command": " ".join(["python", "benchmarks/probes/transform_level.py", *sys.argv[1:]]),
        "date": utc_now(),
        "kv_file": args.kv.name,
        "kvt": args.kvt.name,
        "machine": machine(),
        "cores": os.cpu_count(),
        "gpu": None,
        "cases": [case(args, ratio) for ratio in args.ratio or [5.0]],
    }
    args.out.write_text(json.dumps(doc, indent=1) + "\n")
    args.out.with_suffix(".md").write_text(markdown(doc))
    print(json.dumps(doc["cases"], indent=1))


def case(args: argparse.Namespace, ratio: float) -> dict:
    """Interleaved rounds of A and B at one target ratio, then the decoded files' errors."""
    runs: dict[str, list[dict]] = {"a": [], "b": []}
    with tempfile.TemporaryDirectory() as tmp:
        files = {k: Path(tmp) / f"{k}.kvc" for k in runs}
        for _ in range(args.rounds):
            for k, tree in (("a", args.a), ("b", args.b)):
                runs[k].append(run_once(tree, args.kv, args.kvt, ratio, files[k]))
        errs = errors(args.kv, args.kvt, files)
    return {"target_ratio": ratio, "median": {k: summary(v) for k, v in runs.items()}, "quality": errs, "runs": runs}


def markdown(doc: dict) -> str:
    m = doc["machine"]
    lines = [
        f"# Transform encode at a target ratio, before (A) and after (B): {doc['kv_file']}, {doc['kvt']}",
        "",
        f"`{doc['command']}`",
        "",
        f"{doc['date']}; {m['cpu']}, {doc['cores']} cores, GPU: none, load {m.get('load_avg_1m', '?')}.",
        "",
        "| target | tree | encode s | process wall s | process CPU s | bytes | ratio vs fp16 | bytes vs A "
        "| rel. MSE K | rel. MSE V | rel. MSE vs A's decode |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for c in doc["cases"]:
        a = c["median"]["a"]
        for k in ("a", "b"):
            r, q = c["median"][k], c["quality"][k]
            lines.append(
                f"| {c['target_ratio']:g}x | {k.upper()} | {r['encode_s']:.1f} | {r['process_wall_s']:.1f} "
                f"| {r['process_cpu_s']:.1f} | {r['bytes']:,} | {r['ratio_vs_fp16']:.2f} "
                f"| {r['bytes'] / a['bytes'] - 1:+.2%} | {q['rel_mse_k']:.3g} | {q['rel_mse_v']:.3g} "
                f"| {q['rel_mse_vs_a']:.2g} |"
            )
    lines += [
        "",
        "Medians over the interleaved rounds. encode s: the command's own encode time (KV loaded, file "
        "not yet written); process: the whole `kvcodec encode` process (Python start and imports "
        "included), CPU = user + system of it and its threads. Errors: the decoded KV against the "
        "original (mean squared error over mean square, keys and values apart) and against A's decode.",
        "",
    ]
    return "\n".join(lines)


def summary(rows: list[dict]) -> dict:
    keys = ("process_wall_s", "process_cpu_s", "encode_s")
    out = {k: round(statistics.median(r[k] for r in rows), 3) for k in keys}
    return {**out, "bytes": rows[-1]["bytes"], "ratio_vs_fp16": rows[-1]["ratio_vs_fp16"]}


if __name__ == "__main__":
    main()
