"""Compare two `kvcodec bench ratio` results record by record (same model, text, codec, quant):
sizes and accuracy side by side, as a markdown table on stdout.

    python benchmarks/probes/compare_ratio.py benchmarks/results/NEW.json benchmarks/results/OLD.json
"""

from __future__ import annotations

import json
import sys


def fmt(v: float | None, spec: str) -> str:
    return "" if v is None else format(v, spec)


def rows(new: dict, old: dict) -> list[str]:
    olds = {(r["model"], r["text"], r["codec"], r["quant"]): r for r in old["records"]}
    out = []
    for r in new["records"]:
        o = olds.get((r["model"], r["text"], r["codec"], r["quant"]))
        if o is None:
            continue
        out.append(
            f"| {r['model']} | {r['text']} | {r['codec']} | {r['quant']} | {o['bytes']:,} | {r['bytes']:,} "
            f"| {100 * (r['bytes'] / o['bytes'] - 1):+.3f}% | {fmt(o.get('ppl_delta'), '+.4f')} "
            f"| {fmt(r.get('ppl_delta'), '+.4f')} | {fmt(o.get('token_agreement'), '.3f')} "
            f"| {fmt(r.get('token_agreement'), '.3f')} |"
        )
    return out


def main(new_path: str, old_path: str) -> None:
    with open(new_path) as f:
        new = json.load(f)
    with open(old_path) as f:
        old = json.load(f)
    print(f"`{new['command']}` vs `{(old.get('meta') or old)['command']}`\n")
    print(
        "| model | text | codec | quant | bytes before | bytes now | change | ppl delta before | now "
        "| token agreement before | now |"
    )
    print("|---|---|---|---|---:|---:|---:|---:|---:|---:|---:|")
    print("\n".join(rows(new, old)))


if __name__ == "__main__":
    main(*sys.argv[1:3])
