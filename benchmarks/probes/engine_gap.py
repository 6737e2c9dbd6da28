"""After the fetch (issue 14, target 3): where a request's time goes between its prefix KV being
restored and its first token, on the engine's device.

One engine (as a server keeps one) serves the same long prompt `--repeat` times. Its prefix KV
(the engine's own prefill) is stored once in memory:// with the raw codec, so a fetch is a plain
copy and what is measured is the engine's side. Per request (ms from the KV restored): admitted,
cache ready (begin_prefill returned), prefill forward called, forward returned (host), first token
(its logits on the host). Then a torch.profiler table of one request's engine step (host ops, CUDA
syncs, copies, allocations) and micro-timings of the suffix forward: over the restored cache as
the engine builds it, over a plain DynamicCache (the copy the engine made before), and the suffix
alone (the forward's fixed cost).

    python benchmarks/probes/engine_gap.py --model smollm2-135m --tokens 8000 --repeat 5 --out DIR
    python benchmarks/probes/engine_gap.py --config CONFIG_DIR --save-random DIR ...  # random weights

`--prefill 2048,4096,8192` measures instead a full prefill (no reuse): `Engine.generate(prompt,
max_new_tokens=1)` against one plain forward of the model over the same tokens, interleaved round
by round, in CPU seconds of the process (torch on one thread: a shared CPU's other load barely moves
them; wall seconds are recorded too), for the engine's defaults and for each `--steps` value of
`max_prefill_tokens` (the prompt prefilled in pieces that long); `--tiny` uses a small
random-weight Llama (timing only). It also profiles one piecewise prefill against one forward
(attention kernel and mask-conversion time) and, with `--overlap P`, times a P-token prompt that
arrives while another request decodes, per `--overlap-chunks` value of `prefill_chunk_tokens`:

    python benchmarks/probes/engine_gap.py --tiny --prefill 2048,4096,8192 --steps 8192,2048 \
        --overlap 2048 --out benchmarks/results/engine-prefill-cpu-tiny
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import torch

QUESTION = "\n\nQuestion: In one sentence, what is the text above about?\nAnswer:"


def load(args: argparse.Namespace, device: str):  # noqa: ANN201
    """(model, tokenizer) on `device` in fp16 (GPU) or fp32; random weights from --config."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from kvcodec.models import load_for_device
    from kvcodec.models.placement import place_model

    if args.config:
        torch.manual_seed(0)
        cfg = AutoConfig.from_pretrained(args.config)
        model, tok = AutoModelForCausalLM.from_config(cfg), AutoTokenizer.from_pretrained(args.config)
        if args.save_random:  # a model folder other tools (bench ttft --kv-models DIR) can load
            model.to(torch.float16).save_pretrained(args.save_random)
            tok.save_pretrained(args.save_random)
        return place_model(model, device), tok  # float16 on a GPU, RoPE frequencies kept float32
    return load_for_device(args.model, device)


def prompt_ids(tok, tokens: int) -> tuple[list[int], list[int]]:  # noqa: ANN001
    from kvcodec.models.texts import load_text

    ids = tok(load_text("pg", max_chars=tokens * 12), return_tensors="pt").input_ids[0][:tokens].tolist()
    return ids, ids + tok(QUESTION, add_special_tokens=False)["input_ids"]


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def timed_engine(model, tok, ids: list[int], prompt: list[int], device: str, repeat: int) -> tuple[list, object]:  # noqa: ANN001
    """Per-request time points of `repeat` reuse requests through one engine, and the engine."""
    from kvcodec.codecs import make_codec
    from kvcodec.engine import Engine, SamplingParams, StorePolicy
    from kvcodec.fetcher import PrefixCache
    from kvcodec.integrations.hf import cache_to_tensor, forward_ids
    from kvcodec.models import model_id
    from kvcodec.store import open_store

    pc = PrefixCache(open_store("memory://"), model_id(model), make_codec("raw"), device, policy="fixed:0")
    _, cache = forward_ids(model, torch.tensor(ids))
    pc.put(ids, cache_to_tensor(cache).cpu())
    del cache
    eng = Engine(model, tokenizer=tok, prefix_cache=pc, store_policy=StorePolicy(enabled=False), device=device)
    marks: dict[str, float] = {}
    runner = eng.runner
    for name in ("begin_prefill", "prefill_chunk"):
        fn = getattr(runner, name)

        def wrapped(*a, _fn=fn, _name=name, **k):  # noqa: ANN002, ANN003, ANN202
            marks.setdefault(_name + ">", time.perf_counter())
            try:
                return _fn(*a, **k)
            finally:
                marks.setdefault(_name + "<", time.perf_counter())

        setattr(runner, name, wrapped)
    rows = []
    for _ in range(repeat + 1):  # the first request pays first-use costs: reported apart
        marks.clear()
        req = eng.submit(prompt, SamplingParams(max_new_tokens=2, ignore_eos=True))
        while not req.finished:
            if eng.scheduler.wait_for_work(timeout=0.5):
                eng.step()
        t0 = req.fetch_end
        rows.append(
            {
                "restored_tokens": req.restored_tokens,
                "fetch_ms": 1e3 * (req.fetch_end - req.fetch_start),
                "arrival_to_fetch_ms": 1e3 * (req.fetch_start - req.arrival_time),
                "admitted_ms": 1e3 * (req.scheduled_time - t0),
                "cache_ready_ms": 1e3 * (marks["begin_prefill<"] - t0),
                "prefill_called_ms": 1e3 * (marks["prefill_chunk>"] - t0),
                "forward_returned_ms": 1e3 * (marks["prefill_chunk<"] - t0),
                "first_token_ms": 1e3 * (req.first_token_time - t0),
            }
        )
    return rows, eng


def varied_shapes(model, tok, ids: list[int], prompt: list[int], device: str, count: int) -> dict:  # noqa: ANN001
    """Requests whose suffix (so query and key lengths) differ from every earlier one, as a
    server's do, through one engine per attention setting: torch's own kernel choice and the
    engine's default. Each engine's lengths are its own (torch caches per-shape kernel plans)."""
    from kvcodec.codecs import make_codec
    from kvcodec.engine import Engine, SamplingParams, StorePolicy
    from kvcodec.fetcher import PrefixCache
    from kvcodec.integrations.hf import cache_to_tensor, forward_ids
    from kvcodec.models import model_id
    from kvcodec.store import open_store

    question = prompt[len(ids) :]
    pc = PrefixCache(open_store("memory://"), model_id(model), make_codec("raw"), device, policy="fixed:0")
    _, cache = forward_ids(model, torch.tensor(ids))
    pc.put(ids, cache_to_tensor(cache).cpu())
    del cache
    out = {}
    for slot, (name, backends) in enumerate((("torch_choice", None), ("engine_default", "default"))):
        kw = {} if backends == "default" else {"sdpa_backends": None}
        eng = Engine(
            model, tokenizer=tok, prefix_cache=pc, store_policy=StorePolicy(enabled=False), device=device, **kw
        )
        rows = []
        for k in range(count + 1):  # the first one warms this engine up: left out
            cut = len(ids) - 1 - 2 * (k + (count + 1) * slot)
            req = eng.submit(ids[:cut] + question, SamplingParams(max_new_tokens=2, ignore_eos=True))
            while not req.finished:
                if eng.scheduler.wait_for_work(timeout=0.5):
                    eng.step()
            rows.append(
                {
                    "suffix_tokens": req.prompt_len - req.restored_tokens,
                    "restored_to_prefill_ms": 1e3 * req.restored_to_prefill_s,
                    "prefill_to_first_token_ms": 1e3 * req.prefill_to_first_token_s,
                    "decode_step_ms": 1e3 * (req.token_times[1] - req.token_times[0]),
                }
            )
        eng.close()
        keys = [k for k in rows[0] if k.endswith("_ms")]
        out[name] = {"requests": rows[1:], "median": {k: statistics.median(r[k] for r in rows[1:]) for k in keys}}
    return out


def profile_step(eng, prompt: list[int], device: str) -> str:  # noqa: ANN001
    """The profiler's table of one reuse request's engine steps (fetch excluded)."""
    from torch.profiler import ProfilerActivity, profile

    from kvcodec.engine import SamplingParams

    req = eng.submit(prompt, SamplingParams(max_new_tokens=1, ignore_eos=True))
    eng.scheduler.wait_for_work(timeout=30)
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.startswith("cuda") else [])
    with profile(activities=acts) as prof:
        while not req.finished:
            if eng.scheduler.wait_for_work(timeout=0.5):
                eng.step()
    return prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=30)


def forward_timings(model, ids: list[int], prompt: list[int], device: str, repeat: int) -> dict:  # noqa: ANN001
    """Median ms (host call -> synced) of the suffix forward over the restored cache built as the
    engine builds it (reserved storage), over a plain DynamicCache, and of the suffix alone."""
    from kvcodec.engine.runner import layer_storage, restore_target
    from kvcodec.integrations.hf import cache_to_tensor, forward_ids, make_cache, reserved_cache
    from kvcodec.models.registry import kv_shape

    n = len(ids)
    _, cache = forward_ids(model, torch.tensor(ids))
    kv = cache_to_tensor(cache)
    del cache
    L, H, D = kv_shape(model)
    suffix = torch.tensor([prompt[n:]], device=device)
    dtype = next(model.parameters()).dtype

    def reserved():  # noqa: ANN202
        target = restore_target(L, len(prompt) + 16, H, D, device, dtype)
        target[:, :, :n].copy_(kv)
        return reserved_cache(layer_storage(target), n, model.config)

    def plain():  # noqa: ANN202
        return make_cache(
            [(kv[i, 0].transpose(0, 1)[None], kv[i, 1].transpose(0, 1)[None]) for i in range(L)], model.config
        )

    out = {}
    for name, make in (
        ("over_reserved_cache", reserved),
        ("over_dynamic_cache", plain),
        ("suffix_alone", lambda: None),
    ):
        times = []
        with torch.inference_mode():
            for _ in range(repeat + 1):
                c = make()
                sync(device)
                t0 = time.perf_counter()
                kw = {"cache": c} if c is not None else {}
                model(input_ids=suffix, use_cache=True, logits_to_keep=1, **kw).logits[0, -1].argmax().item()
                times.append(1e3 * (time.perf_counter() - t0))
        out[name + "_ms"] = statistics.median(times[1:])
    return out


TINY = {  # a small Llama (random weights): the shape of attention and caches, on a CPU in seconds
    "vocab_size": 1024,
    "hidden_size": 256,
    "intermediate_size": 768,
    "num_hidden_layers": 4,
    "num_attention_heads": 8,
    "num_key_value_heads": 2,
    "head_dim": 32,
    "max_position_embeddings": 65536,
}


class NoText:
    """The engine's tokenizer for a tiny model: token ids in, no text out."""

    eos_token_id = None

    def decode(self, ids, **kw) -> str:  # noqa: ANN001, ANN003
        return ""


def tiny_model():  # noqa: ANN201
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(0)
    cfg = LlamaConfig(**TINY, attn_implementation="sdpa")
    return AutoModelForCausalLM.from_config(cfg).eval(), NoText()


def full_engine(model, tok, device: str, **kw):  # noqa: ANN001, ANN003, ANN201
    from kvcodec.engine import Engine, StorePolicy

    return Engine(model, tokenizer=tok, reuse=False, store_policy=StorePolicy(enabled=False), device=device, **kw)


def cpu_timed(fn) -> tuple[float, float]:  # noqa: ANN001
    """(CPU seconds of this process, wall seconds) of fn()."""
    c0, w0 = time.process_time(), time.perf_counter()
    fn()
    return time.process_time() - c0, time.perf_counter() - w0


def prefill_gap(model, tok, lengths: list[int], steps: list[int], rounds: int, device: str) -> list[dict]:  # noqa: ANN001
    """Per prompt length: the engine's full prefill (defaults, then max_prefill_tokens = each of
    `steps`) against one plain forward, interleaved per round; medians and ratios to the forward."""
    from kvcodec.engine import EngineConfig, SamplingParams

    engines = {"engine_default": full_engine(model, tok, device)}
    for s in steps:  # pieces of s tokens (below prefill_chunk_tokens the engine would take that many)
        kw = {"max_prefill_tokens": s, "prefill_chunk_tokens": min(s, EngineConfig().prefill_chunk_tokens)}
        engines[f"engine_step_{s}"] = full_engine(model, tok, device, **kw)
    params = SamplingParams(max_new_tokens=1, ignore_eos=True)
    gen = torch.Generator().manual_seed(1)
    rows = []
    for n in lengths:
        ids = torch.randint(1, model.config.vocab_size, (n,), generator=gen).tolist()
        x = torch.tensor([ids], device=device)

        def plain(x=x) -> None:
            with torch.inference_mode():
                model(input_ids=x, use_cache=True, logits_to_keep=1).logits[0, -1].argmax().item()

        runs = {"plain_forward": []} | {k: [] for k in engines}
        for _ in range(rounds + 1):  # the first round warms each up at this length: left out
            runs["plain_forward"].append(cpu_timed(plain))
            for k, eng in engines.items():
                runs[k].append(cpu_timed(lambda eng=eng, ids=ids: eng.generate(ids, params=params)))
        med = {
            k: (statistics.median(c for c, _ in v[1:]), statistics.median(w for _, w in v[1:])) for k, v in runs.items()
        }
        row = {"tokens": n, "cpu_s": {k: round(c, 4) for k, (c, _) in med.items()}}
        row["wall_s"] = {k: round(w, 4) for k, (_, w) in med.items()}
        row["cpu_ratio_to_forward"] = {k: round(c / med["plain_forward"][0], 3) for k, (c, _) in med.items()}
        row["runs_cpu_s"] = {k: [round(c, 4) for c, _ in v] for k, v in runs.items()}
        rows.append(row)
        print(json.dumps({k: row[k] for k in ("tokens", "cpu_s", "cpu_ratio_to_forward")}), flush=True)
    for eng in engines.values():
        eng.close()
    return rows


def profile_pieces(model, tok, n: int, step: int, device: str) -> dict:  # noqa: ANN001
    """CPU ms by operator of one full prefill in `step`-token pieces and of one plain forward."""
    from torch.profiler import ProfilerActivity, profile

    from kvcodec.engine import SamplingParams

    ids = torch.randint(1, model.config.vocab_size, (n,), generator=torch.Generator().manual_seed(2)).tolist()
    out = {}
    with full_engine(model, tok, device, max_prefill_tokens=step, prefill_chunk_tokens=step) as eng:
        eng.generate(ids[:64], max_new_tokens=1)
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            eng.generate(ids, params=SamplingParams(max_new_tokens=1, ignore_eos=True))
        out[f"pieces_of_{step}"] = prof.key_averages()
    with profile(activities=[ProfilerActivity.CPU]) as prof, torch.inference_mode():
        model(input_ids=torch.tensor([ids], device=device), use_cache=True, logits_to_keep=1)
    out["plain_forward"] = prof.key_averages()
    res = {}
    for name, avgs in out.items():
        ops = sorted(avgs, key=lambda e: -e.self_cpu_time_total)[:8]
        res[name] = {"total_ms": round(sum(e.self_cpu_time_total for e in avgs) / 1e3, 1)}
        res[name] |= {e.key: {"self_ms": round(e.self_cpu_time_total / 1e3, 1), "calls": e.count} for e in ops}
    return {"tokens": n, "step": step, "ops": res}


def overlap(model, tok, n: int, chunks: list[int], rounds: int, device: str) -> list[dict]:  # noqa: ANN001
    """An n-token prompt arriving while another request decodes, per prefill_chunk_tokens: CPU
    seconds of the engine steps from its admission to its first token (its TTFT in engine work),
    the steps that took, and the longest of them (how long the decoding request waited)."""
    from kvcodec.engine import SamplingParams

    gen = torch.Generator().manual_seed(3)
    rows = []
    for c in chunks:
        runs = []
        with full_engine(model, tok, device, prefill_chunk_tokens=c) as eng:
            for _ in range(rounds + 1):
                ids = torch.randint(1, model.config.vocab_size, (n,), generator=gen).tolist()
                other = eng.submit(ids[:64], SamplingParams(max_new_tokens=10_000, ignore_eos=True))
                while not other.output_ids:
                    eng.step()
                req = eng.submit(ids, SamplingParams(max_new_tokens=1, ignore_eos=True))
                steps = []
                while not req.finished:
                    steps.append(cpu_timed(eng.step)[0])
                eng.abort(other)
                while not other.finished:
                    eng.step()
                runs.append({"ttft_cpu_s": sum(steps), "steps": len(steps), "longest_step_cpu_s": max(steps)})
        keys = runs[0].keys()
        med = {k: round(statistics.median(r[k] for r in runs[1:]), 4) for k in keys}
        rows.append({"prompt_tokens": n, "prefill_chunk_tokens": c, "median": med, "runs": runs})
        print(json.dumps(rows[-1]["median"] | {"prefill_chunk_tokens": c}), flush=True)
    return rows


def prefill_main(args: argparse.Namespace) -> None:
    """--prefill: the engine's full prefill against one plain forward (module docstring)."""
    import platform
    import shlex
    import sys

    from kvbench.results import write_result

    torch.set_num_threads(1)
    model, tok = tiny_model() if args.tiny else load(args, args.device)
    lengths = [int(v) for v in args.prefill.split(",")]
    steps = [int(v) for v in args.steps.split(",") if v]
    rows = prefill_gap(model, tok, lengths, steps, args.rounds, args.device)
    prof = profile_pieces(model, tok, max(lengths), min(steps), args.device) if steps else {}
    chunks = [int(v) for v in args.overlap_chunks.split(",")]
    over = overlap(model, tok, args.overlap, chunks, args.rounds, args.device) if args.overlap else []
    from kvcodec.engine import EngineConfig

    defaults = {k: getattr(EngineConfig(), k) for k in ("max_prefill_tokens", "prefill_chunk_tokens")}
    command = "python " + shlex.join(["benchmarks/probes/engine_gap.py", *sys.argv[1:]])
    model_name = f"tiny random-weight Llama {TINY}" if args.tiny else (args.config or args.model)
    doc = {"command": command, "model": model_name, "engine_defaults": defaults, "rounds": args.rounds}
    doc |= {"prefill": rows, "profile": prof, "overlap": over}
    md = [f"# Engine full prefill vs one plain forward ({'tiny random Llama' if args.tiny else model_name}, CPU)", ""]
    md += [f"Command: `{command}`", ""]
    md += [
        f"Machine: {platform.machine()}, {os.cpu_count()} shared cores, torch on 1 thread; engine defaults {defaults}."
    ]
    md += [
        "",
        "CPU seconds of the process (median of the rounds after a warm-up round), ratio to the plain forward:",
        "",
    ]
    cols = list(rows[0]["cpu_s"])
    md += ["| tokens | " + " | ".join(cols) + " |", "|---|" + "---|" * len(cols)]
    for r in rows:
        cells = [f"{r['cpu_s'][k]:.3f} ({r['cpu_ratio_to_forward'][k]:.2f}x)" for k in cols]
        md.append(f"| {r['tokens']} | " + " | ".join(cells) + " |")
    if prof:
        md += ["", f"Operators (self CPU ms) of one {prof['tokens']}-token prefill in pieces vs one forward:", ""]
        md += [f"- {name}: " + json.dumps(ops) for name, ops in prof["ops"].items()]
    if over:
        md += ["", f"A {args.overlap}-token prompt arriving while another request decodes (engine CPU s):", ""]
        md += ["| prefill_chunk_tokens | TTFT CPU s | steps | longest step CPU s |", "|---|---|---|---|"]
        md += [
            f"| {r['prefill_chunk_tokens']} | " + " | ".join(str(r["median"][k]) for k in r["median"]) + " |"
            for r in over
        ]
    write_result(Path(args.out), doc, md + [""] + list(args.note))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--config", default=None, help="a model folder's config + tokenizer: random weights")
    ap.add_argument("--save-random", default=None, help="with --config: save the random-weight model here")
    ap.add_argument("--tokens", type=int, default=8000)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--shapes", type=int, default=6, help="requests of distinct suffix lengths per setting")
    ap.add_argument("--out", default=".")
    ap.add_argument("--prefill", default=None, help="prompt lengths: full prefill vs one forward (no reuse)")
    ap.add_argument("--steps", default="", help="with --prefill: max_prefill_tokens values to compare")
    ap.add_argument("--tiny", action="store_true", help="with --prefill: a small random-weight Llama")
    ap.add_argument("--rounds", type=int, default=3, help="with --prefill: timed rounds after a warm-up")
    ap.add_argument("--overlap", type=int, default=0, help="with --prefill: a prompt this long arriving mid-decode")
    ap.add_argument("--overlap-chunks", default="512,1024,2048", help="prefill_chunk_tokens values for --overlap")
    ap.add_argument("--note", action="append", default=[], help="with --prefill: a line for the report")
    args = ap.parse_args()
    if args.prefill:
        return prefill_main(args)
    model, tok = load(args, args.device)
    ids, prompt = prompt_ids(tok, args.tokens)
    with torch.inference_mode():
        rows, eng = timed_engine(model, tok, ids, prompt, args.device, args.repeat)
        table = profile_step(eng, prompt, args.device)
    eng.close()
    fwd = forward_timings(model, ids, prompt, args.device, args.repeat)
    try:
        varied = varied_shapes(model, tok, ids, prompt, args.device, args.shapes) if args.shapes else {}
    except Exception as e:  # noqa: BLE001 - keep the other measurements
        varied = {"error": {"median": f"{type(e).__name__}: {e}"}}
    keys = [k for k in rows[0] if k.endswith("_ms")]
    med = {k: statistics.median(r[k] for r in rows[1:]) for k in keys}
    rec = {
        "args": vars(args),
        "first_request": rows[0],
        "median": med,
        "requests": rows,
        "forward": fwd,
        "varied_shapes": varied,
    }
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "engine-gap.json").write_text(json.dumps(rec, indent=1))
    (out / "engine-gap-profile.txt").write_text(table)
    summary = {k: v["median"] for k, v in varied.items()}
    print(json.dumps({"first_request": rows[0], "median": med, "forward": fwd, "varied_shapes": summary}, indent=1))
    print(table)


if __name__ == "__main__":
    main()
