#!/usr/bin/env python3
"""What `kvcodec calibrate` costs: wall and CPU time, peak memory and .kvt size, per run, from the
`/usr/bin/time -v` output of each run and the .kvt it wrote (its held-out quality report beside).

Each run is `kvcodec calibrate ...` started as
    PYTHONPATH=<tree at REV>/src /usr/bin/time -v python -m cProfile -o prof.out run.py calibrate ... 2> time.txt
(run.py: `from kvcodec.cli.main import main`), so that runs of two revisions share one machine.

    python benchmarks/probes/calibrate_cost.py --run before=33ec5b9:time-before.txt:before.kvt \
        --run after=2e73d34:time-after.txt:after.kvt --out benchmarks/results/calibrate-cost-cpu
"""

from __future__ import annotations

import hashlib
import re
import shlex
import sys
from pathlib import Path

import click

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # kvbench, when not installed

from kvbench.results import write_result  # noqa: E402

FIELDS = {
    "user_s": r"User time \(seconds\): ([\d.]+)",
    "system_s": r"System time \(seconds\): ([\d.]+)",
    "cpu_share_pct": r"Percent of CPU this job got: (\d+)%",
    "elapsed": r"Elapsed \(wall clock\) time \(h:mm:ss or m:ss\): ([\d:.]+)",
    "peak_rss_kb": r"Maximum resident set size \(kbytes\): (\d+)",
}


def _seconds(text: str) -> float:
    out = 0.0
    for part in text.split(":"):
        out = out * 60 + float(part)
    return out


def parse_time(path: str) -> dict:
    text = Path(path).read_text(errors="replace")
    got = {k: m.group(1) for k, rx in FIELDS.items() if (m := re.search(rx, text))}
    return {
        "wall_s": round(_seconds(got["elapsed"]), 1),
        "cpu_s": round(float(got["user_s"]) + float(got["system_s"]), 1),
        "cpu_share_pct": int(got["cpu_share_pct"]),
        "peak_rss_mb": round(int(got["peak_rss_kb"]) / 1024),
        "phases": [  # calibrate_phases.py's lines, where the run printed them
            {"phase": m[0], "at_s": float(m[1]), "peak_rss_mb": int(m[2])}
            for m in re.findall(r"\[phase\] (\w+): ([\d.]+) s, peak RSS (\d+) MB", text)
        ],
    }


@click.command()
@click.option("--run", "runs", multiple=True, required=True, help="LABEL=REV:TIME_FILE:KVT")
@click.option("--note", "notes", multiple=True)
@click.option("--out", "out_stem", required=True)
def main(runs, notes, out_stem):
    from kvcodec.codecs.transform.codec import kvt_info
    from kvcodec.transform.quality import safe_ratio, summary

    records = []
    for spec in runs:
        label, _, rest = spec.partition("=")
        rev, time_file, kvt = rest.split(":")
        info = kvt_info(kvt)
        q = info.get("quality") or {}
        data = Path(kvt).read_bytes()
        rec = dict(label=label, rev=rev, **parse_time(time_file), kvt_mb=round(len(data) / 1e6, 1))
        rec.update(kvt_sha256=hashlib.sha256(data).hexdigest(), held_out=q.get("held_out", []))
        rec.update(
            fallback=info.get("fallback", []),
            report_coder=q.get("coder"),
            safe_ratio=safe_ratio(q),
            report=q.get("points", []),
            report_summary=summary(q),
            cont_tokens=q.get("cont_tokens"),
            groups=len(info.get("groups", [])) if isinstance(info.get("groups"), list) else None,
        )
        records.append(rec)
    cmd = "python benchmarks/probes/calibrate_cost.py " + " ".join(map(shlex.quote, sys.argv[1:]))
    md = ["# `kvcodec calibrate --model smollm2-135m` cost, before / after (issue 23)", "", f"Command: `{cmd}`", ""]
    md += [f"- {n}" for n in notes] + [""]
    md += [
        "| run | rev | wall | CPU (user+sys) | CPU share | peak RSS | .kvt | fallback | safe ratio |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in records:
        md.append(
            f"| {r['label']} | {r['rev']} | {r['wall_s'] / 60:.1f} min | {r['cpu_s'] / 60:.1f} min | "
            f"{r['cpu_share_pct']}% | {r['peak_rss_mb']} MB | {r['kvt_mb']} MB | {', '.join(r['fallback']) or 'none'} | "
            f"{r['safe_ratio']}x |"
        )
    held = ", ".join(records[0]["held_out"])
    same = len({r["kvt_sha256"] for r in records}) == 1
    if len(records) > 1:
        md += ["", f".kvt sha256 {'identical in every run' if same else 'differs between runs'}."]
    md += [""]
    for r in records:
        if r["phases"]:
            md.append(
                f"- {r['label']}, peak RSS after each phase: "
                + ", ".join(f"{x['phase']} {x['peak_rss_mb']} MB ({x['at_s']:.0f} s)" for x in r["phases"])
            )
    cont = records[0].get("cont_tokens") or 128
    md += ["", f"Held-out report ({held}; {cont} scored positions per text):", ""]
    md += [f"- {r['label']} ({r['report_coder']}): {r['report_summary']}" for r in records]
    write_result(out_stem + ".json", dict(command=cmd, notes=list(notes), runs=records), md)
    click.echo("\n".join(md))


if __name__ == "__main__":
    main()
