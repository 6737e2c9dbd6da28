#!/usr/bin/env python3
"""Does the calibration's quality report predict held-out quality? For each model: the per-ratio table
`kvcodec calibrate` wrote into its .kvt (measured on its own held-out texts) beside rd.py results of the
same .kvt on other texts (essays, code, documentation), with the differences (issue 23 target 5:
top-1 within 0.01, ppl within 0.5 points).

    python benchmarks/probes/rd_report.py --kvt smollm2-135m=smol.kvt --rd benchmarks/results/rd-x-essays.json \
        --rd benchmarks/results/rd-x-code-docs.json --out benchmarks/results/rd-report-check-cpu
"""

from __future__ import annotations

import json
import re
import shlex
import sys
from pathlib import Path

import click

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # kvbench, when not installed

from kvbench.results import write_result  # noqa: E402
from kvcodec.codecs.transform.codec import CODERS  # noqa: E402

TOP1_WITHIN, PPL_WITHIN = 0.01, 0.5  # issue 23 target 5: the report within these of the measurement


def report_vs_measured(top1_report: float, ppl_report: float, measured: dict) -> dict:
    """A calibration report's top-1 and ppl delta beside an rd.py record's, their differences and
    whether both are within the target."""
    top1, ppl = measured["top1_agreement"], measured["ppl_delta_pct"]
    return dict(
        top1_report=top1_report,
        top1_measured=top1,
        top1_diff=round(top1 - top1_report, 4),
        ppl_report=ppl_report,
        ppl_measured=ppl,
        ppl_diff=round(ppl - ppl_report, 3),
        within_target=abs(top1 - top1_report) <= TOP1_WITHIN and abs(ppl - ppl_report) <= PPL_WITHIN,
    )


def report_records(model: str, kvt: str) -> tuple[list[dict], dict]:
    from kvcodec.codecs.transform.codec import kvt_info

    info = kvt_info(kvt)
    q = info.get("quality") or {}
    recs = [
        dict(
            model=model,
            method=f"transform-report-r{p['target']:g}",
            ratio_vs_fp16=p["ratio"],
            top1_agreement=p["top1"],
            ppl_delta_pct=p["ppl_delta_pct"],
            tokens_scored=p.get("tokens"),
            eval_texts=q.get("held_out", []),
            calibrated_on=info.get("sources", []),
            defaults_tuned_on=["smollm2-135m", "qwen2.5-coder-0.5b"],
            coder=q.get("coder"),
        )
        for p in q.get("points", [])
        if "top1" in p
    ]
    extra = {k: info.get(k) for k in ("fallback", "calibration_cost", "weights")}
    extra["safe_ratio"] = q.get("safe_ratio")
    return recs, extra


@click.command()
@click.option("--kvt", "kvts", multiple=True, required=True, help="MODEL=PATH of a .kvt with a quality report.")
@click.option("--rd", "rds", multiple=True, help="rd.py result JSONs of the same .kvt on other texts.")
@click.option("--out", "out_stem", required=True)
@click.option("--note", "notes", multiple=True, help="A line for the result (e.g. the calibrate command, the machine).")
def main(kvts, rds, out_stem, notes):
    records, calib = [], {}
    for item in kvts:
        model, _, path = item.partition("=")
        recs, extra = report_records(model, path)
        records += recs
        calib[model] = extra
    checks = []
    for path in rds:
        doc = json.loads(Path(path).read_text())
        for r in doc["records"]:
            point = re.fullmatch(rf"transform-(?:{'|'.join(CODERS)})-r([0-9.]+)", r["method"])
            if point is None:  # a baseline, or a variant of a point (-nosink, -kw...)
                records.append(dict(r, eval_texts=doc["eval_texts"]))
                continue
            target = float(point.group(1))
            pred = next(
                (x for x in records if x["model"] == r["model"] and x["method"] == f"transform-report-r{target:g}"),
                None,
            )
            rec = dict(r, eval_texts=doc["eval_texts"])
            records.append(rec)
            if pred:
                checks.append(
                    dict(
                        model=r["model"],
                        ratio=target,
                        eval_texts=doc["eval_texts"],
                        **report_vs_measured(pred["top1_agreement"], pred["ppl_delta_pct"], r),
                    )
                )
    command = "python benchmarks/probes/rd_report.py " + " ".join(shlex.quote(a) for a in sys.argv[1:])
    doc = dict(command=command, records=records, checks=checks, calibration=calib, notes=list(notes))
    md = [
        "# Calibration quality report vs held-out measurements (issue 23)",
        "",
        f"Command: `{doc['command']}`",
        "",
        *[f"- {n}" for n in notes],
        "",
        "| model | method | eval texts | ratio vs fp16 | top-1 | ppl delta | calibrated on |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in records:
        md.append(
            f"| {r['model']} | {r['method']} | {', '.join(r.get('eval_texts', []))} | {r['ratio_vs_fp16']:.2f}x | "
            f"{r['top1_agreement']:.4f} | {r['ppl_delta_pct']:+.2f}% | {len(r.get('calibrated_on', []))} texts |"
        )
    md += ["", "Report vs measured (target: top-1 within 0.01, ppl within 0.5 points):", ""]
    md += [
        "| model | ratio | eval texts | top-1 report / measured | ppl report / measured | within |",
        "|---|---|---|---|---|---|",
    ]
    for c in checks:
        md.append(
            f"| {c['model']} | {c['ratio']:g}x | {', '.join(c['eval_texts'])} | {c['top1_report']:.4f} / "
            f"{c['top1_measured']:.4f} | {c['ppl_report']:+.2f}% / {c['ppl_measured']:+.2f}% | {'yes' if c['within_target'] else 'no'} |"
        )
    md += ["", "Calibration: " + json.dumps(calib)]
    write_result(out_stem + ".json", doc, md)
    click.echo("\n".join(md))


if __name__ == "__main__":
    main()
