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
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

QUESTION = "\n\nQuestion: In one sentence, what is the text above about?\nAnswer:"


def load(args: argparse.Namespace, device: str):  # noqa: ANN201
    """(model, tokenizer) on `device` in fp16 (GPU) or fp32; random weights from --config."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    if args.config:
        torch.manual_seed(0)
        cfg = AutoConfig.from_pretrained(args.config)
        model, tok = AutoModelForCausalLM.from_config(cfg), AutoTokenizer.from_pretrained(args.config)
        if args.save_random:  # a model folder other tools (bench ttft --kv-models DIR) can load
            model.to(torch.float16).save_pretrained(args.save_random)
            tok.save_pretrained(args.save_random)
    else:
        from kvcodec.models import load_model

        model, tok = load_model(args.model)
    dtype = torch.float16 if device.startswith("cuda") else torch.float32
    return model.to(device=device, dtype=dtype).eval(), tok


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
    args = ap.parse_args()
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
