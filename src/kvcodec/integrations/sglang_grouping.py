"""How many tokens one coded group needs to keep kvcodec's ratio (SGLang HiCache pages are small).

    python -m kvcodec.integrations.sglang_grouping --out benchmarks/results/sglang-page-grouping-cpu

Codes real KV (each listed model over each listed text, fp16) in consecutive groups of G tokens,
one chunk per group at one frame size, and reports the ratio vs fp16 (every byte of every blob
counted) per G. The choice rule is fixed before looking at the numbers: the smallest G whose
ratio is within 5% of the largest G's, on the calibration text; the other texts only check it.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import torch

from kvcodec.codecs import make_codec

GROUPS = (16, 32, 64, 128, 256, 512)
TOLERANCE = 0.05


def coded_bytes(kv: torch.Tensor, group: int, quant: str, resolution: tuple[int, int]) -> int:
    codec = make_codec("hevc", quant=quant, chunk_tokens=group, resolutions=(resolution,))
    return sum(len(c.blobs[0]) for c in codec.encode_chunks(kv))


def choose(ratios: dict[int, float]) -> int:
    """Smallest group within TOLERANCE of the largest group's ratio."""
    best = ratios[max(ratios)]
    return min(g for g, r in ratios.items() if r >= best * (1 - TOLERANCE))


def measure(models: list[str], texts: list[str], tokens: int, quants: list[str], resolution) -> list[dict]:
    from kvcodec.integrations.hf import extract_kv
    from kvcodec.models import load_model
    from kvcodec.models.texts import load_text

    rows = []
    for name in models:
        model, tok = load_model(name)
        for text in texts:
            _, kv = extract_kv(model, tok, load_text(text), max_tokens=tokens)
            kv = kv.to(torch.float16)
            raw = kv.numel() * 2
            for quant in quants:
                for g in GROUPS:
                    t0 = time.perf_counter()
                    n = coded_bytes(kv, g, quant, resolution)
                    rows.append(
                        {
                            "model": name,
                            "text": text,
                            "tokens": kv.shape[2],
                            "quant": quant,
                            "group_tokens": g,
                            "bytes": n,
                            "ratio": raw / n,
                            "encode_s": time.perf_counter() - t0,
                        }
                    )
                    print(json.dumps(rows[-1]), flush=True)
    return rows


def choices(rows: list[dict], text: str) -> dict[str, int]:
    out = {}
    for key in {(r["model"], r["quant"]) for r in rows if r["text"] == text}:
        ratios = {r["group_tokens"]: r["ratio"] for r in rows if r["text"] == text and (r["model"], r["quant"]) == key}
        out[f"{key[0]} {key[1]}"] = choose(ratios)
    return out


def markdown(result: dict) -> str:
    rows = result["rows"]
    lines = [
        "# SGLang HiCache page grouping: kvcodec ratio vs tokens per coded group (CPU)",
        "",
        f"Command: `{result['command']}`",
        "",
        "Ratio vs fp16 of real KV coded in consecutive groups of G tokens (one chunk per group, "
        f"{result['resolution']} frames). Choice rule (fixed beforehand): smallest G within "
        f"{TOLERANCE:.0%} of the largest G, on the calibration text `{result['calibration_text']}`.",
        "",
        "| model | text | quant | " + " | ".join(f"G={g}" for g in GROUPS) + " |",
        "|---|---|---|" + "---|" * len(GROUPS),
    ]
    for key in sorted({(r["model"], r["text"], r["quant"]) for r in rows}):
        by_g = {r["group_tokens"]: r["ratio"] for r in rows if (r["model"], r["text"], r["quant"]) == key}
        lines.append(f"| {key[0]} | {key[1]} | {key[2]} | " + " | ".join(f"{by_g[g]:.2f}x" for g in GROUPS) + " |")
    lines += [
        "",
        "Choices on the calibration text: " + ", ".join(f"{k}: G={v}" for k, v in sorted(result["choices"].items())),
        "",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default="smollm2-135m,qwen2.5-coder-0.5b")
    p.add_argument("--calibration-text", default="pg/gap")
    p.add_argument("--check-texts", default="pg/love")
    p.add_argument("--tokens", type=int, default=512)
    p.add_argument("--quants", default="int8,exact")
    p.add_argument("--resolution", default="256x256")
    p.add_argument("--out", required=True, help="output path without extension (.json and .md are written)")
    a = p.parse_args(argv)
    resolution = tuple(int(v) for v in a.resolution.split("x"))
    texts = [a.calibration_text, *a.check_texts.split(",")]
    rows = measure(a.models.split(","), texts, a.tokens, a.quants.split(","), resolution)
    result = {
        "command": "python -m kvcodec.integrations.sglang_grouping " + " ".join(sys.argv[1:] if argv is None else argv),
        "machine": f"CPU ({platform.machine()}, {torch.get_num_threads()} threads)",
        "resolution": a.resolution,
        "calibration_text": a.calibration_text,
        "tolerance": TOLERANCE,
        "rows": rows,
        "choices": choices(rows, a.calibration_text),
        "check_choices": {t: choices(rows, t) for t in texts[1:]},
    }
    Path(a.out + ".json").write_text(json.dumps(result, indent=1) + "\n")
    Path(a.out + ".md").write_text(markdown(result))


if __name__ == "__main__":
    main()
