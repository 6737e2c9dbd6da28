#!/usr/bin/env python3
"""A model whose data did not pick the defaults (issue 23 targets 2 and 5): `kvcodec calibrate --model`
with its defaults, then real encodes of the .kvt on evaluation essays it never saw, beside its own report.

    python benchmarks/probes/rd_heldout.py calibrate --device cuda --stats cal.json -- --model M.gguf --out m.kvt
    python benchmarks/probes/rd_heldout.py evaluate --model M.gguf --name qwen2.5-coder-0.5b --kvt m.kvt \
        --calib-stats cal.json --device cuda --out benchmarks/results/rd-qwen2.5-coder-0.5b-h200-heldout

`calibrate` runs the CLI's own command in this process, everything after `--` passed as on the command line;
--device is handed to the CLI's own --device (default: the CLI's, cuda where present; on a GPU float32 weights
load as float16, as the engine runs them), and wall time, peak RSS and peak GPU memory are recorded.
`evaluate` loads the model as the CLI does on its --device (records made before the CLI had --device ran
float32 weights on the GPU). It scores each text the way the
calibration report does (the text's first --prefix tokens' KV coded and restored, the next --cont tokens
teacher-forced on it and on the original KV: top-1 agreement of the next-token argmax over all of them,
perplexity change of the text's own tokens), with real encodes (the codec's own size search and, unless
--coder says otherwise, its default sample coder; the records name the coder) instead
of the report's simulation, and per-channel intN baselines; it writes rd-format records and the report's
prediction beside each measured point.
"""

from __future__ import annotations

import json
import math
import os
import resource
import shlex
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import click
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # kvbench and rd.py, when not installed

from rd_report import report_vs_measured  # noqa: E402 - beside this file

from kvbench.results import write_result  # noqa: E402
from kvcodec.codecs.transform.codec import CODERS, DEFAULT_CODER  # noqa: E402
from kvcodec.models.quality import QUALITY_CONT, QUALITY_PREFIX, _predictions  # noqa: E402

FIRST = 128  # also scored: the continuation's first FIRST tokens (the protocol of the rd-* results before 512)

TARGET_LINES = (
    "Target 2 (issue 23): at 5x top-1 >= 0.99 and ppl <= +0.5 %; at 3x top-1 >= 0.995.",
    "Target 5: the calibration report predicts held-out top-1 within 0.01 and ppl within 0.5 points.",
)


_LOADED: dict = {}  # model argument -> (model, tokenizer) the calibrate step loaded (no second GGUF parse)


def _load(model: str, device: str):
    """The calibrate step's model (on its device) for --then, else the model loaded as the CLI loads it."""
    from kvcodec.cli.calibrate import resolve_device
    from kvcodec.models import load_for_device

    if model in _LOADED:
        return _LOADED[model]
    return load_for_device(model, resolve_device(device))


def _peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


@click.group()
def cli():
    pass


@cli.command(context_settings={"ignore_unknown_options": True})
@click.option("--device", help="The CLI's --device (where the model runs); default: the CLI's (cuda if present).")
@click.option("--stats", "stats_path", required=True, help="JSON to write: time, memory, device, CLI arguments.")
@click.option(
    "--then", "then", multiple=True, help="`evaluate` arguments to run next on the same loaded model (one string each)."
)
@click.argument("args", nargs=-1, type=click.UNPROCESSED)
def calibrate(device, stats_path, then, args):
    """`kvcodec calibrate ARGS [--device DEVICE]`, recording its cost (and its loaded model, for --then)."""
    import kvcodec.models
    from kvcodec.cli.calibrate import command, resolve_device

    args = list(args)
    if device and "--device" not in args:
        args += ["--device", device]
    dev = resolve_device(args[args.index("--device") + 1] if "--device" in args else None)
    load = kvcodec.models.load_model  # the CLI imports it from the package when it runs

    def kept(*a, **k):  # the CLI moves the model with Module.to, in place: this object ends on its device
        _LOADED[a[0] if a else k["name"]] = load(*a, **k)
        return _LOADED[a[0] if a else k["name"]]

    kvcodec.models.load_model = kept
    cuda = dev.type == "cuda"
    if cuda:
        torch.cuda.reset_peak_memory_stats(dev)
    t0 = time.perf_counter()
    command.main(args, standalone_mode=False)
    stats = dict(
        cli_args=args,
        device=str(dev),
        device_name=torch.cuda.get_device_name(dev) if cuda else "cpu",
        cpu_threads=torch.get_num_threads(),
        wall_s=round(time.perf_counter() - t0, 1),
        peak_rss_mb=round(_peak_rss_mb()),
        peak_gpu_mb=round(torch.cuda.max_memory_allocated(dev) / 2**20) if cuda else None,
    )
    if "--out" in args:  # the report as written, should an evaluation fail
        from kvcodec.codecs.transform.codec import kvt_info

        stats["report"] = kvt_info(args[list(args).index("--out") + 1]).get("quality")
    Path(stats_path).write_text(json.dumps(stats, indent=1) + "\n")
    click.echo(json.dumps(stats), err=True)
    for line in then:
        a = shlex.split(line)
        evaluate.main([*a[a[:1] == ["evaluate"] :], "--calib-stats", stats_path], standalone_mode=False)


def _continue(model, kv: torch.Tensor, cont: torch.Tensor) -> torch.Tensor:
    """Logits [len(cont), vocab] (float32, CPU) of cont teacher-forced on the prefix KV."""
    from kvcodec.kvspec.hf import build_cache, cache_kwarg
    from kvcodec.kvspec.tensors import GroupedKV

    param = next(model.parameters())
    gkv = GroupedKV.from_tensor(kv.to(param.dtype))
    with torch.inference_mode():
        cache = {cache_kwarg(model): build_cache(gkv, model)}  # transformers 5.17 takes past_key_values
        out = model(cont.unsqueeze(0).to(param.device), use_cache=True, **cache)
    return out.logits[0].float().cpu()


def _roundtrip(codec, kv16: torch.Tensor) -> tuple[torch.Tensor, int, float | None]:
    chunks = codec.encode_chunks(kv16)
    out = torch.empty_like(kv16)
    for c in chunks:
        codec.decode_chunk(c.blobs[0], out[:, :, c.start_token : c.start_token + c.tokens])
    theta = codec.header(chunks[0].blobs[0]).get("theta") if hasattr(codec, "header") else None
    return out, sum(len(c.blobs[0]) for c in chunks), theta


def _codecs(kvt: str, ratios: list[float], baselines: list[str], coder: str) -> dict:
    """name -> factory of a fresh codec (one per job: the codecs are not shared across threads)."""
    from kvcodec.codecs import make_codec
    from kvcodec.codecs.transform.codec import TransformCodec
    from kvcodec.transform.kvt import load_kvt

    cal, digest = load_kvt(kvt)
    out = {
        f"transform-{coder}-r{r:g}": (lambda r=r: TransformCodec(cal, kvt_hash=digest, target_ratio=r, coder=coder))
        for r in ratios
    }
    for b in baselines:
        out[b] = lambda b=b: make_codec("hevc", quant=b)
    return out


def _score(ref: tuple, got: tuple) -> dict:
    """As models/quality.measure_model, from (argmax, NLL) pairs: top-1 over every position, NLL of the
    text's tokens 1..; the same over the first FIRST positions (keys ending in _first)."""
    (ref_top, ref_nll), (top, nll) = ref, got
    out = {}
    for suffix, k in (("", len(top)), ("_first", min(FIRST, len(top)))):
        out.update(
            {
                f"agree{suffix}": int((top[:k] == ref_top[:k]).sum()),
                f"n{suffix}": k,
                f"nll{suffix}": float(nll[: k - 1].sum()),
                f"ref_nll{suffix}": float(ref_nll[: k - 1].sum()),
                f"m{suffix}": k - 1,
            }
        )
    return out


def _aggregate(name: str, method: str, rows: list[dict]) -> dict:
    size, values = sum(r["bytes"] for r in rows), sum(r["values"] for r in rows)
    n, m = sum(r["n"] for r in rows), sum(r["m"] for r in rows)
    nll, ref = sum(r["nll"] for r in rows), sum(r["ref_nll"] for r in rows)
    n1, m1 = sum(r["n_first"] for r in rows), sum(r["m_first"] for r in rows)
    d1 = sum(r["nll_first"] - r["ref_nll_first"] for r in rows)
    rec = dict(
        model=name,
        method=method,
        bits_per_value=round(8 * size / values, 4),
        ratio_vs_fp16=round(2 * values / size, 3),
        top1_agreement=round(sum(r["agree"] for r in rows) / n, 4),
        ppl=round(math.exp(nll / m), 4),
        ppl_ref=round(math.exp(ref / m), 4),
        ppl_delta_pct=round(100 * (math.exp((nll - ref) / m) - 1), 3),
        top1_agreement_first=round(sum(r["agree_first"] for r in rows) / n1, 4),
        ppl_delta_pct_first=round(100 * (math.exp(d1 / m1) - 1), 3),
        first_tokens=FIRST,
        bytes=size,
        tokens_scored=n,
        encode_decode_s=round(sum(r["seconds"] for r in rows), 1),
    )
    if rows[0].get("theta") is not None:
        rec["theta"] = [r["theta"] for r in rows]
    return rec


def _report_points(kvt: str) -> tuple[dict, dict]:
    from kvcodec.codecs.transform.codec import kvt_info

    info = kvt_info(kvt)
    q = info.get("quality") or {}
    keep = ("sources", "tokens", "weights", "weight_alpha", "fisher_texts", "fallback", "calibration_cost")
    return q, {k: info.get(k) for k in keep}


def _checks(records: list[dict], report: dict) -> list[dict]:
    out = []
    points = {float(p["target"]): p for p in report.get("points", []) if "top1" in p}
    for r in records:
        if not r["method"].startswith("transform-"):
            continue
        target = float(r["method"].split("-r", 1)[1])
        p = points.get(target)
        if p is None:
            continue
        out.append(
            dict(
                ratio=target,
                ratio_report=p["ratio"],
                ratio_measured=r["ratio_vs_fp16"],
                **report_vs_measured(p["top1"], p["ppl_delta_pct"], r),
            )
        )
    return out


def _target2(records: list[dict]) -> list[str]:
    by = {r["method"]: r for r in records}
    out = []
    for target, top1, ppl in ((5, 0.99, 0.5), (3, 0.995, None)):
        r = next((r for m, r in by.items() if m.startswith("transform-") and m.endswith(f"-r{target}")), None)
        if r is None:
            continue
        ok = r["top1_agreement"] >= top1 and (ppl is None or r["ppl_delta_pct"] <= ppl)
        need = f"top-1 >= {top1}" + (f", ppl <= +{ppl} %" if ppl is not None else "")
        out.append(
            f"- {target}x ({r['ratio_vs_fp16']:.2f}x): top-1 {r['top1_agreement']:.4f}, ppl {r['ppl_delta_pct']:+.2f} % "
            f"(needs {need}): {'MET' if ok else 'MISSED'}"
        )
    return out


def markdown(doc: dict) -> list[str]:
    cal = doc["calibration"]
    stats = cal.get("run") or {}
    tuned_on = (doc.get("records") or [{}])[0].get("defaults_tuned_on") or []
    role = "The defaults' own model" if doc["model"] in tuned_on else "Held-out model"
    lines = [
        f"# {role}: `kvcodec calibrate --model` defaults, real encodes on unseen essays ({doc['model']})",
        "",
        f"Command: `{doc['command']}`",
        "",
        *[f"- {n}" for n in doc["notes"]],
        f"- Calibration: `kvcodec calibrate {' '.join(map(shlex.quote, stats.get('cli_args', [])))}` at commit "
        f"{doc['commit']}, model on {stats.get('device_name', '?')} ({stats.get('device', '?')}); "
        f"{stats.get('wall_s', '?')} s wall incl. loading, peak RSS {stats.get('peak_rss_mb', '?')} MB, peak GPU "
        f"memory {stats.get('peak_gpu_mb', '-')} MB; .kvt {cal.get('kvt_mb', '?')} MB; fitted on "
        f"{len(cal['info'].get('sources') or [])} texts ({cal['info'].get('tokens')} tokens), weights "
        f"{cal['info'].get('weights')}, fallback {cal['info'].get('fallback') or 'none'}; report held out "
        f"{', '.join(doc['report'].get('held_out', []))} ({doc['report'].get('coder')}; "
        f"{doc['report'].get('prefix_tokens', 512)}-token prefixes, {doc['report'].get('cont_tokens', 128)} tokens "
        "scored each), safe ratio "
        f"{doc['report'].get('safe_ratio')}",
        f"- Evaluated on {', '.join(doc['eval_texts'])}: {doc['prefix_tokens']}-token prefix coded, "
        f"{doc['cont_tokens']} tokens teacher-forced (as the report scores its held-out texts); real encode + "
        "decode of every chunk, the codec's own size search; ratios count every byte of every chunk blob.",
        "",
        f"| method | bits/value | ratio vs fp16 | top-1 agreement | ppl delta % | tokens | first {FIRST}: top-1 | "
        f"first {FIRST}: ppl % | encode+decode s |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in doc["records"]:
        first = (
            f"{r['top1_agreement_first']:.4f} | {r['ppl_delta_pct_first']:+.2f}"
            if "top1_agreement_first" in r
            else "- | -"
        )
        lines.append(
            f"| {r['method']} | {r['bits_per_value']:.2f} | {r['ratio_vs_fp16']:.2f}x | {r['top1_agreement']:.4f} | "
            f"{r['ppl_delta_pct']:+.2f} | {r['tokens_scored']} | {first} | {r['encode_decode_s']} |"
        )
    lines += ["", TARGET_LINES[0], "", *_target2(doc["records"]), "", TARGET_LINES[1], ""]
    lines += [
        "| target | ratio report / measured | top-1 report / measured | ppl report / measured | within |",
        "|---|---|---|---|---|",
    ]
    for c in doc["checks"]:
        lines.append(
            f"| {c['ratio']:g}x | {c['ratio_report']:.2f}x / {c['ratio_measured']:.2f}x | {c['top1_report']:.4f} / "
            f"{c['top1_measured']:.4f} | {c['ppl_report']:+.2f} / {c['ppl_measured']:+.2f} | "
            f"{'yes' if c['within_target'] else 'no'} |"
        )
    pts = doc["report"].get("points", [])
    lines += [
        "",
        "The .kvt's own report (all points): "
        + "; ".join(
            f"{p['target']:g}x ({p['ratio']:.2f}x) top-1 {p.get('top1')} ppl {p.get('ppl_delta_pct')}" for p in pts
        ),
    ]
    return lines


@cli.command()
@click.option("--model", "model_path", required=True, help="Model to load (name, directory or .gguf).")
@click.option("--name", "model_name", required=True, help="The model's name in the records.")
@click.option("--kvt", required=True, type=click.Path(exists=True))
@click.option("--calib-stats", type=click.Path(exists=True), help="The calibrate step's --stats JSON.")
@click.option("--device", help="Where the model runs; default: cuda if present (loaded as the CLI's calibrate does).")
@click.option("--eval", "eval_texts", default="", help="Evaluation texts; default the project's held-out essays.")
@click.option("--prefix", "prefix_tokens", default=QUALITY_PREFIX, show_default=True, help="As the report.")
@click.option("--cont", "cont_tokens", default=QUALITY_CONT, show_default=True, help="As the report.")
@click.option("--ratios", default="3,5,8", show_default=True)
@click.option("--baselines", default="int8,int4", show_default=True)
@click.option("--coder", type=click.Choice(CODERS), default=DEFAULT_CODER, show_default=True, help="Transform coder.")
@click.option("--jobs", default=8, show_default=True, help="Encodes (text x method) at once (threads).")
@click.option("--defaults-tuned-on", default="smollm2-135m", show_default=True)
@click.option("--note", "notes", multiple=True)
@click.option("--out", "out_stem", required=True)
def evaluate(
    model_path,
    model_name,
    kvt,
    calib_stats,
    device,
    eval_texts,
    prefix_tokens,
    cont_tokens,
    ratios,
    baselines,
    coder,
    jobs,
    defaults_tuned_on,
    notes,
    out_stem,
):
    from kvcodec.cli.calibrate import resolve_device
    from kvcodec.models.check import inspect_model
    from kvcodec.models.extract import kv_of_ids
    from kvcodec.models.texts import load_text
    from kvcodec.transform.calibration import HELD_OUT_TEXTS

    texts = [t for t in eval_texts.split(",") if t] or list(HELD_OUT_TEXTS)
    report, info = _report_points(kvt)
    overlap = set(texts) & set(info.get("sources") or []) | set(texts) & set(report.get("held_out") or [])
    if overlap:
        raise click.BadParameter(f"evaluation texts {sorted(overlap)} were calibration or report texts")
    layout = inspect_model(model_path)
    model, tok = _load(model_path, device)
    ratio_list = [float(r) for r in ratios.split(",") if r]
    factories = {"fp16": None, **_codecs(kvt, ratio_list, [b for b in baselines.split(",") if b], coder)}
    prepared = []  # (text, cont, reference predictions, fp16 KV): model work first, then all encodes at once
    for name in texts:
        ids = tok(load_text(name), return_tensors="pt").input_ids[0][: prefix_tokens + cont_tokens]
        kv = kv_of_ids(model, layout, ids[:prefix_tokens])
        cont = ids[prefix_tokens:]
        prepared.append((name, cont, _predictions(_continue(model, kv, cont), cont), kv.to(torch.float16)))

    def job(item):
        (_, _, _, kv16), method = item
        if factories[method] is None:
            return kv16, 2 * kv16.numel(), None, 0.0
        t0 = time.perf_counter()
        restored, size, theta = _roundtrip(factories[method](), kv16)
        return restored, size, theta, time.perf_counter() - t0

    items = [(p, m) for p in prepared for m in factories]
    t0 = time.perf_counter()
    with ThreadPoolExecutor(max(1, jobs)) as pool:
        results = list(pool.map(job, items))
    click.echo(f"{len(items)} encode+decode jobs in {time.perf_counter() - t0:.1f} s", err=True)
    rows: dict[str, list[dict]] = {k: [] for k in factories}
    for ((name, cont, ref, kv16), method), (restored, size, theta, secs) in zip(items, results):
        row = _score(ref, _predictions(_continue(model, restored.float(), cont), cont))
        row.update(bytes=size, values=kv16.numel(), theta=theta, seconds=secs)
        rows[method].append(row)
        click.echo(
            f"{name} {method}: {2 * kv16.numel() / size:.2f}x top1 {row['agree'] / row['n']:.3f} "
            f"dnll {row['nll'] - row['ref_nll']:+.3f} {secs:.1f} s",
            err=True,
        )
    records = [_aggregate(model_name, k, v) for k, v in rows.items()]
    for r in records:
        r.update(
            eval_texts=texts,
            calibrated_on=list(info.get("sources") or []),
            defaults_tuned_on=[m for m in defaults_tuned_on.split(",") if m],
        )
    commit = (
        os.environ.get("RD_SRC_COMMIT")
        or subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True).stdout.strip()
    )
    stats = json.loads(Path(calib_stats).read_text()) if calib_stats else {}
    doc = dict(
        command="python benchmarks/probes/rd_heldout.py " + " ".join(map(shlex.quote, sys.argv[1:])),
        commit=commit,
        model=model_name,
        device=str(resolve_device(device)),
        eval_texts=texts,
        prefix_tokens=prefix_tokens,
        cont_tokens=cont_tokens,
        calibration=dict(info=info, run=stats, kvt_mb=round(Path(kvt).stat().st_size / 1e6, 1)),
        report=report,
        records=records,
        checks=_checks(records, report),
        notes=list(notes),
    )
    write_result(out_stem + ".json", doc, markdown(doc))
    click.echo("\n".join(markdown(doc)))


@cli.command()
@click.argument("result", type=click.Path(exists=True))
@click.option("--note", "notes", multiple=True, help="Lines added to the result's notes.")
@click.option("--out", "out_stem", help="Write here instead of in place (stem).")
def render(result, notes, out_stem):
    """Rewrite RESULT (.json) and its markdown with NOTES added (e.g. what the device run's command was)."""
    doc = json.loads(Path(result).read_text())
    doc["notes"] = [*doc.get("notes", []), *notes]
    write_result((out_stem or result.removesuffix(".json")) + ".json", doc, markdown(doc))


if __name__ == "__main__":
    cli()
