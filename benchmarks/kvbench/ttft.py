"""`kvcodec bench ttft`: time to first token vs link bandwidth, for full prefill and the ways of
reusing a stored prefix (raw fp16 KV, zstd, CacheGen-style, kvcodec's HEVC quant codec, kvcodec's
transform codec: `--methods ...,kvcodec-transform --transform PATH.kvt --target-ratios 5,8`).

TTFT of a reuse method = fetch + prefill of the request's new (suffix) tokens, where the fetch is
chunk-pipelined: with n chunks, transfer time X = bytes / bandwidth and decode time D,
fetch = max(X, D) + min(X, D) / n. Full prefill = one forward over prefix + suffix. Every input is
measured, and the record says where:

- bytes per method: each codec encodes a REAL KV cache (a real model over a real essay, fp16) and
  the ratio to fp16 is applied to the target model's fp16 KV size (layers x 2 x kv_heads x head_dim
  x 2 bytes per token): the target's KV is assumed to compress like the real small model's of the
  same family (llama-like <- smollm2-135m, qwen2 <- qwen2.5-coder-0.5b). For the small real
  models themselves nothing is scaled. `--kv-file MODEL=PATH` measures on a saved KV cache instead;
  kvcodec-transform-<ratio> encodes it chunk by chunk with the .kvt given by `--transform`.
  `--stats-only` writes these statistics alone, for a later `--stats` run (e.g. on a GPU machine).
- accuracy per method: read from benchmarks/rd.py records (`--accuracy rd-*.json`) of the
  statistics model, shown beside the TTFT.
- decode speed per method: measured on this machine on the same real KV (CPU: zstd / CacheGen rANS
  / software HEVC; raw = a copy). On a GPU: raw = host-to-device copy, measured; kvcodec methods
  whose chunks are videos = the NVDEC pool restoring `--nvdec-gbit` of stored bytes per second
  (default from `kvcodec bench decode` on an H200); a transform method with the zstd coder keeps its
  measured host decode rate (its chunks never reach NVDEC); the mixed coder, half of its chunks on each,
  needs a given rate; any rate can be set with
  --decode-rate METHOD=GB/s (of fp16 KV), as the committed GPU runs do. `bench ttft-engine` measures
  the whole fetch instead of modeling it.
- prefill times: real forward passes on this machine; for 7B/8B-class targets ("llama3-8b",
  "qwen2.5-7b") full-size architectures with RANDOM weights (timing only, never KV statistics).
"""

from __future__ import annotations

import dataclasses
import os
import statistics

import click

from kvbench.methods import (
    SM_CODER,
    STATS_CHUNK_TOKENS,
    accuracy_of,
    chunk_bytes,
    chunked_transform_codec,
    decode_chunks_into,
    encode_in_chunks,
    expand_methods,
    frame_sizes,
    method_codec,
    rd_name,
    resolution_option,
    transform_coder,
    transform_ratio,
)
from kvbench.methods import label as method_label
from kvbench.results import command_line, machine, result_path, utc_now, write_result
from kvbench.workloads import LARGE, build_model
from kvcodec.codecs.transform.codec import DEFAULT_CODER, VIDEO_CODERS


def kv_statistics(
    kv_model: str,
    tokens: int,
    methods: list[str],
    resolution: tuple[int, int] | None,
    text: str,
    transform: str | None = None,
    kv_file: str | None = None,
    skip_decode: frozenset[str] = frozenset(),
) -> dict:
    """Ratio to fp16 and CPU decode speed of each method on a real KV cache: `kv_model`'s prefill
    of `text`, or the KV saved in `kv_file` (any safetensors file holding a `kv` tensor).
    `transform`: the .kvt of the kvcodec-transform-<ratio> methods. Methods in `skip_decode` (their
    decode rate is given) are only encoded."""
    import torch

    kv, desc = load_kv(kv_file) if kv_file else real_kv_of(kv_model, tokens, text)
    kv = kv.to(torch.float16).contiguous()
    out = {
        "model": kv_model,
        "text": None if kv_file else text,
        "kv_file": kv_file,
        "tokens": int(kv.shape[2]),
        "shape": list(kv.shape),
        "source": desc.get("source"),
        "fp16_bytes": kv.numel() * 2,
        "methods": {},
    }
    for m in methods:
        row = measure_method(m, kv, resolution, transform, m not in skip_decode)
        row["ratio_vs_fp16"] = out["fp16_bytes"] / row["bytes"]
        row["decode_GBps_fp16"] = out["fp16_bytes"] / row["decode_s"] / 1e9 if row["decode_s"] else None
        out["methods"][m] = row
        rate = f"decode {row['decode_GBps_fp16']:.3f} GB/s (cpu)" if row["decode_s"] else "decode not timed"
        click.echo(f"  {kv_model} {m}: {row['ratio_vs_fp16']:.2f}x, {rate}", err=True)
    return out


def real_kv_of(kv_model: str, tokens: int, text: str):  # noqa: ANN201
    from kvbench.baselines.measure import real_kv

    return real_kv(kv_model, tokens, text)


def load_kv(path: str):  # noqa: ANN201
    """(kv, description) of a KV file: one (layers, 2, tokens, kv_heads, head_dim) tensor."""
    import torch

    from kvcodec.errors import ShapeError
    from kvcodec.kvspec.files import load_kv_file

    kv, meta = load_kv_file(path)
    if not isinstance(kv, torch.Tensor) or kv.dim() != 5 or kv.shape[1] != 2:
        raise ShapeError(f"{path}: the TTFT bench needs one (layers, 2, tokens, kv_heads, head_dim) KV tensor")
    return kv, {"source": "kv file", **{k: v for k, v in meta.items() if k in ("model", "text")}}


def measure_method(m: str, kv, resolution: tuple[int, int] | None, transform: str | None, decode: bool) -> dict:  # noqa: ANN001
    """Bytes, encode and (if `decode`) CPU decode seconds of method `m` on the fp16 `kv`."""
    import time

    if transform_ratio(m) is not None:
        # chunk by chunk, as a store holds it: every byte of every chunk blob counts
        codec = chunked_transform_codec(m, transform, frame_sizes(resolution))
        chunks, enc = encode_in_chunks(codec, kv)
        dec = decode_chunks_into(codec, chunks, kv.new_empty(kv.shape)) if decode else None
        return {
            "bytes": chunk_bytes(chunks),
            "encode_s": enc,
            "decode_s": dec,
            "resolution": list(codec.resolutions[0]),
            "chunks": len(chunks),
            "kvt_sha256": codec.kvt_hash,
            "target_ratio": transform_ratio(m),
        }
    if m.startswith("kvcodec-"):
        from kvbench.baselines import get_codec

        # one stored resolution (what one fetch moves), not the sum of all of them
        codec = get_codec(m, **({} if resolution is None else {"resolutions": (resolution,)}))
        t0 = time.perf_counter()
        data = codec.encode(kv)
        enc = time.perf_counter() - t0
        dec = []
        for _ in range(2 if decode else 0):
            t0 = time.perf_counter()
            codec.decode(data, device="cpu")
            dec.append(time.perf_counter() - t0)
        from kvcodec.config import CodecConfig

        size = resolution or codec.config.get("resolutions", CodecConfig().resolutions)[0]  # the adapter's overrides
        return {"bytes": len(data), "encode_s": enc, "decode_s": min(dec, default=None), "resolution": list(size)}
    from kvbench.baselines.measure import measure_codec

    r = measure_codec(m, kv, "cpu", repeat=2)
    return {"bytes": r["bytes"], "encode_s": r["encode_s"], "decode_s": r["decode_s"]}


def time_prefill(model, tokens: int, suffix: int, device: str, repeat: int) -> tuple[float, float]:  # noqa: ANN001
    """(full prefill of tokens+suffix, suffix prefill on top of a `tokens` cache), median seconds."""
    import statistics
    import time

    import torch

    vocab = model.config.vocab_size
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(100, min(vocab, 30000), (1, tokens + suffix), generator=g).to(device)

    def sync() -> None:
        if device.startswith("cuda"):
            torch.cuda.synchronize()

    full, part = [], []
    with torch.inference_mode():
        model(input_ids=ids[:, :64])  # warm-up
        for _ in range(repeat):
            sync()
            t0 = time.perf_counter()
            model(input_ids=ids, logits_to_keep=1)
            sync()
            full.append(time.perf_counter() - t0)
            out = model(input_ids=ids[:, :tokens], use_cache=True, logits_to_keep=1)
            cache = out.cache if hasattr(out, "cache") else out.past_key_values
            sync()
            t0 = time.perf_counter()
            model(input_ids=ids[:, tokens:], cache=cache, use_cache=True, logits_to_keep=1)
            sync()
            part.append(time.perf_counter() - t0)
            del out, cache
    return statistics.median(full), statistics.median(part)


def h2d_GBps(nbytes: int) -> float:
    import time

    import torch

    x = torch.empty(nbytes, dtype=torch.uint8).pin_memory()
    x.to("cuda")
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(3):
        x.to("cuda", non_blocking=True)
    torch.cuda.synchronize()
    return 3 * nbytes / (time.perf_counter() - t0) / 1e9


def fetch_time(
    nbytes: float, fp16_bytes: float, gbit: float, decode_GBps: float, chunks: int
) -> tuple[float, float, float]:
    x = nbytes * 8 / (gbit * 1e9)
    d = fp16_bytes / (decode_GBps * 1e9) if decode_GBps > 0 else 0.0
    return max(x, d) + min(x, d) / max(1, chunks), x, d


E2E_QUESTION = "\n\nQuestion: In one sentence, what is the text above about?\nAnswer:"


class _CapturedKV:
    """A prefix cache that stores nothing: it keeps the last KV an engine hands it to store."""

    def __init__(self, chunk_tokens: int) -> None:
        from kvcodec.config import CodecConfig

        self.config = CodecConfig(chunk_tokens=chunk_tokens)
        self.kv = None

    def lookup(self, token_ids, deadline_s=None) -> int:  # noqa: ANN001
        return 0

    def put(self, token_ids, kv) -> int:  # noqa: ANN001
        self.kv = kv
        return 0


def e2e(
    kv_model: str,
    tokens: int,
    new_tokens: int,
    bws: list[float],
    meths: list[str],
    resolution: tuple[int, int] | None,
    text: str,
    device: str,
    pool=None,  # noqa: ANN001
    repeat: int = 1,
    transform: str | None = None,
) -> list[dict]:
    """Measured end to end: the engine restores the real prefix KV over a token-bucket link and
    prefills the suffix; TTFT is the engine's (arrival -> first token), one request at a time.
    With an NVDEC `pool` (kvcodec.video.nvdec_pool.NvdecPool) kvcodec chunks are decoded and
    restored in its workers; otherwise the fetcher's own decoder (in-process NVDEC on a GPU)."""
    import tempfile

    from kvcodec.models import load_model
    from kvcodec.models.texts import load_text

    model, tok = load_model(kv_model)
    ids = tok(load_text(text, max_chars=tokens * 12), return_tensors="pt").input_ids[0][:tokens].tolist()
    # a real question after the document; greedy answers of every method are compared with full prefill's
    prompt = ids + tok(E2E_QUESTION, add_special_tokens=False)["input_ids"]
    rows = []
    with tempfile.TemporaryDirectory(prefix="kvcodec-ttft-") as tmp:
        run = E2ERun(model, tok, ids, prompt, new_tokens, device, pool, repeat)
        run.transform = transform
        for m in meths:
            run.store(m, f"file://{tmp}/{m}", resolution)
        full, ref = run.full_prefill()
        for (
            m
        ) in meths:  # first use of a decoder (sessions, kernels, pool workers) is not what a server pays per request
            run.reuse(m, max(bws))
        for bw in bws:
            res = {"prefill": {"ttft_s": full, "bytes": 0, "restored": 0, "error": None, "ids": ref}}
            for m in meths:
                res[m] = method_result([run.reuse(m, bw) for _ in range(repeat)])
                click.echo(
                    f"  e2e {bw:g} Gbit/s {m}: {res[m]['ttft_s']:.3f} s ({res[m]['restored']} restored)", err=True
                )
            common = {
                "model": kv_model,
                "tokens": tokens,
                "bandwidth_gbit": bw,
                "mode": "measured end to end",
                "device": device,
                "suffix_tokens": len(prompt) - len(ids),
                "new_tokens": new_tokens,
            }
            rows += [e2e_row(common, m, r, res, ref) for m, r in res.items()]
    return rows


class E2ERun:
    """One model and prompt: the prefix KV stored once per method, then fetched through engines."""

    def __init__(
        self,
        model,
        tok,
        ids: list[int],
        prompt: list[int],
        new_tokens: int,
        device: str,
        pool,  # noqa: ANN001
        repeat: int,
    ) -> None:
        from kvcodec.models import model_id

        self.model, self.tok, self.ids, self.prompt = model, tok, ids, prompt
        self.new_tokens, self.device, self.pool, self.repeat = new_tokens, device, pool, repeat
        self.kv = engine_prefix_kv(model, tok, len(ids), prompt, device)
        self.model_id = model_id(model)
        self.stores: dict[str, tuple[str, object]] = {}
        self.transform: str | None = None  # the .kvt of kvcodec-transform-<ratio> methods

    def store(self, method: str, url: str, resolution: tuple[int, int] | None) -> None:
        """Store the prefix KV with the method's codec (the CPU encoder; a pool only decodes)."""
        import torch

        from kvcodec.config import CodecConfig
        from kvcodec.fetcher import PrefixCache
        from kvcodec.store import open_store

        cfg, sizes = CodecConfig(quant="int8", chunk_tokens=256), frame_sizes(resolution)
        codec = method_codec(method, cfg, transform=self.transform, resolutions=sizes)
        pc = PrefixCache(open_store(url), self.model_id, codec, "cpu", policy="fixed:0")
        pc.put(self.ids, self.kv.to(torch.float16))
        pooled = self.pool is not None and method.startswith("kvcodec-") and transform_ratio(method) is None
        options = {"pool": self.pool} if pooled else {}
        self.stores[method] = (
            url,
            method_codec(method, cfg, transform=self.transform, resolutions=sizes, **options),
        )
        click.echo(f"  e2e: stored {method}", err=True)

    def full_prefill(self) -> tuple[float, list[int]]:
        """(median TTFT of full prefill, its answer's token ids)."""
        from kvcodec.engine import Engine, StorePolicy

        with Engine(
            self.model, tokenizer=self.tok, reuse=False, store_policy=StorePolicy(enabled=False), device=self.device
        ) as eng:
            eng.generate(self.prompt[:64], max_new_tokens=1)
            runs = [
                eng.generate(self.prompt, max_new_tokens=self.new_tokens, ignore_eos=True)[0]
                for _ in range(self.repeat)
            ]
        full = statistics.median(o.ttft_s for o in runs)
        click.echo(f"  e2e: full prefill {full:.3f} s", err=True)
        return full, runs[0].token_ids

    def reuse(self, method: str, gbit: float):  # noqa: ANN201
        """One request that restores the prefix over a `gbit` link: the engine's output."""
        from kvbench.net import ThrottledStore
        from kvcodec.engine import Engine, StorePolicy
        from kvcodec.fetcher import PrefixCache
        from kvcodec.store import open_store

        url, codec = self.stores[method]
        workers = self.pool.workers if self.pool is not None else 1  # every method decodes with as many threads
        pc = PrefixCache(
            ThrottledStore(open_store(url), rate_gbit=gbit),
            self.model_id,
            codec,
            self.device,
            policy="fixed:0",
            decode_workers=workers,
        )
        with Engine(
            self.model, tokenizer=self.tok, prefix_cache=pc, store_policy=StorePolicy(enabled=False), device=self.device
        ) as eng:
            return eng.generate(self.prompt, max_new_tokens=self.new_tokens, ignore_eos=True)[0]


def engine_prefix_kv(model, tok, tokens: int, prompt: list[int], device: str):  # noqa: ANN001, ANN201
    """The KV this engine's own prefill computes for the prompt's first `tokens` tokens on this
    device: what a server would store."""
    from kvcodec.engine import Engine, StorePolicy

    capture = _CapturedKV(chunk_tokens=256)
    with Engine(
        model,
        tokenizer=tok,
        prefix_cache=capture,
        reuse=False,
        device=device,
        store_policy=StorePolicy(max_tokens=tokens, skip_if_restored=False),
    ) as eng:
        eng.generate(prompt, max_new_tokens=1)
        eng.storer.flush()
    if capture.kv is None or capture.kv.shape[2] != tokens:
        raise click.ClickException(f"the engine stored no KV for the {tokens}-token prefix")
    return capture.kv


GAP_FIELDS = ("restored_to_prefill_s", "prefill_to_first_token_s")


def _median(values: list) -> float | None:
    return statistics.median(values) if values and None not in values else None


def method_result(runs: list) -> dict:
    """Median TTFT, fetch time and the engine's split after the fetch (restored KV -> suffix
    prefill started -> first token) of repeated runs of one method; the first run's details."""
    o = runs[0]
    fetch = [r.fetch_s for r in runs]
    after = [r.ttft_s - r.fetch_s if r.fetch_s is not None else None for r in runs]
    return {
        "ttft_s": statistics.median(r.ttft_s for r in runs),
        "bytes": o.bytes_fetched,
        "restored": o.restored_tokens,
        "error": o.fetch_error,
        "ids": o.token_ids,
        "fetch_s": _median(fetch),
        "ttft_minus_fetch_s": _median(after),
        # engines before these time points existed report None
        **{f: _median([getattr(r, f, None) for r in runs]) for f in GAP_FIELDS},
    }


def e2e_row(common: dict, m: str, r: dict, res: dict, ref_ids: list[int]) -> dict:
    return {
        **common,
        "method": m,
        "ttft_s": r["ttft_s"],
        "speedup_vs_raw": res["raw"]["ttft_s"] / r["ttft_s"] if "raw" in res else None,
        "speedup_vs_cachegen": res["cachegen"]["ttft_s"] / r["ttft_s"] if "cachegen" in res else None,
        "speedup_vs_prefill": res["prefill"]["ttft_s"] / r["ttft_s"],
        "bytes": r["bytes"],
        "restored_tokens": r["restored"],
        "fetch_error": r["error"],
        "fetch_s": r.get("fetch_s"),
        "ttft_minus_fetch_s": r.get("ttft_minus_fetch_s"),
        **{f: r.get(f) for f in GAP_FIELDS},
        "answer_identical_to_prefill": r["ids"] == ref_ids,
        "token_agreement_with_prefill": sum(a == b for a, b in zip(r["ids"], ref_ids)) / max(1, len(ref_ids)),
    }


@click.command("ttft")
@click.option(
    "--targets",
    default=None,
    help="Models to time prefill for (comma list). Default: the KV models on CPU; "
    "llama3-8b,qwen2.5-7b (random weights, full size) on a GPU. TARGET=KVMODEL takes the target's KV "
    "statistics from KVMODEL (one of --kv-models; by default a full-size target's are its family's small model's).",
)
@click.option(
    "--kv-models",
    default="smollm2-135m,qwen2.5-coder-0.5b",
    show_default=True,
    help="Real models whose KV statistics are measured.",
)
@click.option("--text", default="pg", show_default=True, help="Text for the real KV (kvcodec.models.texts).")
@click.option(
    "--tokens",
    "tokens_list",
    default="2048",
    show_default=True,
    help="Reused prefix length(s), comma list; KV statistics are measured at the first.",
)
@click.option("--suffix-tokens", default=32, show_default=True, type=int, help="New tokens after the prefix.")
@click.option("--bandwidths", default="1,2,5,10,20,40", show_default=True, help="Gbit/s, comma list.")
@click.option("--methods", default="raw,zstd-3,cachegen,kvcodec-int8", show_default=True)
@click.option(
    "--resolution", default=None, help="WxH: every kvcodec method's frames at this size (default: each codec's own)."
)
@click.option(
    "--stats",
    "stats_file",
    type=click.Path(exists=True, dir_okay=False),
    default=None,
    help="Read KV statistics from an earlier record instead of measuring (the GPU machine has no GGUF loader).",
)
@click.option(
    "--nvdec-gbit",
    default=6.0,
    show_default=True,
    type=float,
    help="kvcodec restore rate on a GPU when no --decode-rate is given: Gbit/s of stored chunk bytes "
    "restored through the NVDEC pool (measured 6.8 for int8 and 5.6 for int4 in "
    "benchmarks/results/decode-h200-v3.md).",
)
@click.option("--decode-rate", multiple=True, help="METHOD=GB/s of fp16 KV: override a decode rate (e.g. cachegen=40).")
@click.option("--device", default=None, help="cpu or cuda (default: cuda if available).")
@click.option(
    "--repeat",
    default=3,
    show_default=True,
    type=int,
    help="Timed runs per point (median); --e2e: per method and bandwidth.",
)
@click.option("--threads", default=None, type=int, help="torch CPU threads (1 is faster on a loaded shared CPU).")
@click.option(
    "--e2e-new-tokens",
    default=16,
    show_default=True,
    type=int,
    help="--e2e: greedy answer tokens generated and compared with full prefill's.",
)
@click.option(
    "--e2e",
    "e2e_mode",
    is_flag=True,
    help="Measure TTFT end to end instead (real models only): the engine fetches the real "
    "prefix KV of each --kv-models model over a token-bucket link at each bandwidth.",
)
@click.option(
    "--nvdec-pool",
    default=0,
    show_default=True,
    type=int,
    help="--e2e on a GPU: decode and restore kvcodec chunks in an NVDEC pool of this many worker processes "
    "(0: the fetcher's in-process decoder).",
)
@click.option(
    "--transform",
    "transforms",
    multiple=True,
    help="The .kvt the kvcodec-transform methods code with: PATH (every KV model) or MODEL=PATH.",
)
@click.option(
    "--target-ratios",
    default="5,8",
    show_default=True,
    help="Target ratios vs fp16 that the method 'kvcodec-transform' stands for (one method each, "
    "kvcodec-transform-<ratio>).",
)
@click.option(
    "--kv-file",
    "kv_files",
    multiple=True,
    help="MODEL=PATH: measure MODEL's KV statistics on the KV saved in PATH (a safetensors file with a "
    "(layers, 2, tokens, kv_heads, head_dim) 'kv' tensor, as `kvcodec extract` writes) instead of a prefill.",
)
@click.option(
    "--accuracy",
    "accuracy_files",
    multiple=True,
    type=click.Path(exists=True, dir_okay=False),
    help="A benchmarks/rd.py record (rd-*.json): its accuracy per method (top-1 agreement, perplexity "
    "change, Quoref same answer) goes beside the TTFT of the targets whose KV statistics are its model's.",
)
@click.option(
    "--stats-only",
    is_flag=True,
    help="Only measure the KV statistics (bytes per method) and write them; a later run reads them with --stats.",
)
@click.option(
    "--note", default="", help="Text added to the record's notes (e.g. where --decode-rate values come from)."
)
@click.option("--out", "out_path", default=None, help="JSON path (default benchmarks/results/ttft-<device>.json).")
def command(
    targets,
    kv_models,
    text,
    tokens_list,
    suffix_tokens,
    bandwidths,
    methods,
    resolution,
    stats_file,
    nvdec_gbit,
    decode_rate,
    device,
    repeat,
    out_path,
    threads,
    e2e_new_tokens,
    e2e_mode,
    nvdec_pool,
    transforms,
    target_ratios,
    kv_files,
    accuracy_files,
    stats_only,
    note,
) -> None:  # noqa: ANN001
    """TTFT vs bandwidth: full prefill vs raw / zstd / CacheGen-style / kvcodec (HEVC quant or transform)
    prefix reuse."""

    import torch

    if threads:
        torch.set_num_threads(threads)
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    gpu = device.startswith("cuda")
    bws = [float(b) for b in bandwidths.split(",")]
    ratios = [float(r) for r in target_ratios.split(",") if r.strip()]
    meths = expand_methods([m.strip() for m in methods.split(",") if m.strip()], ratios)
    kvts = per_model(transforms, "--transform", kv_models.split(","))
    if any(transform_ratio(m) for m in meths) and not (kvts or stats_file):
        raise click.ClickException("the kvcodec-transform methods need --transform PATH.kvt")
    size = resolution_option(resolution)
    overrides = {k: float(v) for k, v in (o.split("=", 1) for o in decode_rate)}
    token_counts = [int(t) for t in str(tokens_list).split(",") if t.strip()]
    if e2e_mode:
        return e2e_command(
            kv_models,
            token_counts,
            e2e_new_tokens,
            bws,
            meths,
            size,
            text,
            device,
            gpu,
            nvdec_pool,
            repeat,
            out_path,
            kvts,
        )
    kv_by_model = dict(kv_pair(o, "--kv-file") for o in kv_files)
    if stray := sorted(set(kv_by_model) - set(kv_models.split(","))):  # it was ignored: the model was prefilled instead
        raise click.BadParameter(f"{', '.join(stray)}: not among --kv-models {kv_models}", param_hint="--kv-file")
    src = KVSources(kv_models.split(","), text, kvts, kv_by_model)
    src.check()  # before any model loads: a foreign or grouped .kvt, a KV file of another model
    if stats_only:
        return stats_command(src, token_counts[0], meths, size, overrides, out_path)
    return modeled_command(
        targets,
        src,
        token_counts,
        suffix_tokens,
        bws,
        meths,
        size,
        stats_file,
        overrides,
        nvdec_gbit,
        device,
        gpu,
        repeat,
        out_path,
        accuracy_files,
        note,
    )


def kv_pair(option: str, name: str) -> tuple[str, str]:
    if "=" not in option:
        raise click.ClickException(f"{name} takes MODEL=PATH; got {option!r}")
    model, path = option.split("=", 1)
    return model, path


def model_kv_shape(model: str) -> tuple[int, int, int] | None:
    """(layers, kv_heads, head_dim) of a model's KV from its config; None where its config cannot be read here or
    its KV is not one tensor."""
    from kvcodec.errors import KVCodecError
    from kvcodec.models.check import inspect_model

    try:
        spec = inspect_model(model).spec
    except (KVCodecError, OSError, ValueError):
        return None
    if not spec.uniform:
        return None
    layers, _, _, heads, dim = spec.groups[0].shape(1)
    return layers, heads, dim


def per_model(options: tuple[str, ...], name: str, models: list[str]) -> dict[str, str]:
    """{model: path} of PATH (every model) / MODEL=PATH options."""
    out: dict[str, str] = {}
    for o in options:
        model, path = kv_pair(o, name) if "=" in o and o.split("=", 1)[0] in models else ("", o)
        if not model and "=" in o and not os.path.exists(o):  # MODEL=PATH of a model not among them
            raise click.BadParameter(f"{o.split('=', 1)[0]}: not among the models {', '.join(models)}", param_hint=name)
        out.update({model: path} if model else dict.fromkeys(models, path))
    return out


@dataclasses.dataclass(frozen=True)
class KVSources:
    """Where the KV statistics come from: each model's prefill of `text` or its saved KV file, and
    the .kvt its transform methods code with."""

    models: list[str]
    text: str
    transforms: dict[str, str]
    kv_files: dict[str, str]

    def stats(
        self, model: str, tokens: int, meths: list[str], resolution: tuple[int, int] | None, skip: frozenset
    ) -> dict:
        return kv_statistics(
            model,
            tokens,
            meths,
            resolution,
            self.text,
            self.transforms.get(model),
            self.kv_files.get(model),
            skip,
        )

    def check(self) -> None:
        """Each model's KV file is that model's, of at least one chunk, and fits its .kvt (a plain
        one: this bench codes one KV tensor); a .kvt calibrated on another model is warned of."""
        import kvcodec
        from kvcodec.cli.transform_io import warn_if_other_model
        from kvcodec.models.local import same_model

        for model in self.models:
            kv = meta = None
            if path := self.kv_files.get(model):
                kv, meta = load_kv(path)
                if meta.get("model") and not same_model(meta["model"], model):
                    raise click.BadParameter(
                        f"{path} holds the KV of {meta['model']!r}, not of {model!r}", param_hint="--kv-file"
                    )
                want = model_kv_shape(model)  # a file's metadata may be missing or wrong: its shape is checked too
                if want is not None and (kv.shape[0], kv.shape[3], kv.shape[4]) != want:
                    raise click.BadParameter(
                        f"{path} holds KV of (layers, kv_heads, head_dim) {(kv.shape[0], kv.shape[3], kv.shape[4])}; "
                        f"{model!r}'s is {want}",
                        param_hint="--kv-file",
                    )
                if kv.shape[2] < STATS_CHUNK_TOKENS:  # its ratios would be those of one short chunk's overhead
                    raise click.BadParameter(
                        f"{path} holds {kv.shape[2]} tokens, fewer than one {STATS_CHUNK_TOKENS}-token chunk: its "
                        "ratios and rates would not be those of the table's prompts",
                        param_hint="--kv-file",
                    )
            if kvt := self.transforms.get(model):
                codec = kvcodec.make_codec("transform", transform=kvt)
                if getattr(codec, "cal", None) is None:
                    raise click.BadParameter(
                        f"{kvt} is a grouped .kvt; the TTFT bench codes one KV tensor", param_hint="--transform"
                    )
                if kv is not None:
                    codec.cal.check_shape(tuple(kv.shape))
                warn_if_other_model(codec, model, "the KV model")

    def all_stats(self, tokens: int, meths: list[str], resolution: tuple[int, int] | None, overrides: dict) -> dict:
        click.echo("measuring codecs on real KV caches (cpu) ...", err=True)
        skip = frozenset(m for m in overrides if transform_ratio(m) is not None)
        return {m: self.stats(m, tokens, meths, resolution, skip) for m in self.models}


def stats_command(
    src: KVSources, tokens: int, meths: list[str], resolution: tuple[int, int] | None, overrides: dict, out_path
) -> None:  # noqa: ANN001
    """--stats-only: the KV statistics alone, as a record a later (GPU) run reads with --stats."""
    stats = src.all_stats(tokens, meths, resolution, overrides)
    rec = {
        "benchmark": "ttft-stats",
        "command": command_line("ttft"),
        "machine": machine(),
        "time": utc_now(),
        "notes": "bytes of each method on real KV, every chunk blob counted (256-token chunks); kvcodec-transform: "
        "TransformCodec of the .kvt whose sha256 is kvt_sha256, at the target ratio",
        "kv_stats": stats,
    }
    md = [
        "# KV statistics for the TTFT bench",
        "",
        f"`{rec['command']}`",
        "",
        rec["notes"],
        "",
        "| KV model | tokens | method | bytes | ratio vs fp16 | CPU decode GB/s |",
        "|---|---|---|---|---|---|",
    ]
    for km, st in stats.items():
        for m, r in st["methods"].items():
            dec = f"{r['decode_GBps_fp16']:.3f}" if r.get("decode_GBps_fp16") else "-"
            md.append(
                f"| {km} | {st['tokens']} | {method_label(m)} | {r['bytes']} | {r['ratio_vs_fp16']:.3f} | {dec} |"
            )
    path = write_result(result_path(out_path, "ttft-stats"), rec, md)
    click.echo("\n".join(md))
    click.echo(f"wrote {path}", err=True)


def e2e_command(
    kv_models: str,
    token_counts: list[int],
    e2e_new_tokens: int,
    bws: list[float],
    meths: list[str],
    size: tuple[int, int] | None,
    text: str,
    device: str,
    gpu: bool,
    nvdec_pool: int,
    repeat: int,
    out_path,
    transforms: dict[str, str] | None = None,
) -> None:  # noqa: ANN001
    """--e2e: TTFT measured through the engine for every model, prefix length, bandwidth and method."""
    rows = []
    pool = None
    if nvdec_pool:
        if not gpu:
            raise click.ClickException("--nvdec-pool needs --device cuda")
        from kvcodec.video.nvdec_pool import NvdecPool

        pool = NvdecPool(workers=nvdec_pool)
    try:
        for km in kv_models.split(","):
            for n in token_counts:
                rows += e2e(
                    km, n, e2e_new_tokens, bws, meths, size, text, device, pool, repeat, (transforms or {}).get(km)
                )
    finally:
        if pool is not None:
            pool.close()
    label = ("gpu" if gpu else "cpu") + "-e2e"
    rec = {
        "benchmark": "ttft",
        "mode": "measured end to end",
        "command": command_line("ttft"),
        "machine": machine(),
        "device": device,
        "label": label,
        "time": utc_now(),
        "nvdec_pool_workers": nvdec_pool or None,
        "notes": "engine TTFT (arrival -> first token), one request at a time, prefix KV restored through the "
        "fetcher over an in-process token-bucket link, median of --repeat runs after one warm-up fetch per "
        "method; the stored KV is the engine's own prefill of the prefix on this device; decoders run on "
        + device
        + (
            f" (kvcodec: an NVDEC pool of {nvdec_pool} worker processes; every method fetches with "
            f"{nvdec_pool} decode threads)"
            if nvdec_pool
            else ""
        )
        + ". 'same answer': "
        f"the {e2e_new_tokens} greedy answer tokens equal full prefill's, at every bandwidth",
        "rows": rows,
    }
    md = e2e_markdown(rec, kv_models.split(","), token_counts, bws, meths)
    path = write_result(result_path(out_path, f"ttft-{label}"), rec, md)
    click.echo("\n".join(md))
    click.echo(f"wrote {path}", err=True)


def e2e_markdown(
    rec: dict, models: list[str], token_counts: list[int], bws: list[float], meths: list[str]
) -> list[str]:
    """TTFT per model, prefix length and bandwidth (one column per method), and whether each method's
    answers equal full prefill's."""
    rows, cols = rec["rows"], ["prefill"] + meths
    md = [
        f"# TTFT vs bandwidth, measured end to end ({rec['label']})",
        "",
        f"`{rec['command']}`",
        "",
        rec["notes"],
        "",
        "TTFT in seconds. Full prefill is measured here; each reuse method's is modelled from measured inputs "
        "(below): fetch = max(X, D) + min(X, D) / chunks, X = its bytes at the link's rate, D = its bytes' decode "
        "at its decode rate, plus the suffix's measured prefill. Speedups: that method's TTFT against each baseline's.",
        "",
        "| model | tokens | Gbit/s | " + " | ".join(method_label(m) for m in cols) + " |",
        "|---|---|---|" + "---|" * len(cols),
    ]
    for km in models:
        for n in token_counts:
            for bw in bws:
                sel = {r["method"]: r for r in rows if (r["model"], r["tokens"], r["bandwidth_gbit"]) == (km, n, bw)}
                md.append(f"| {km} | {n} | {bw:g} | " + " | ".join(f"{sel[m]['ttft_s']:.3f}" for m in cols) + " |")
        same = {
            m: all(r["answer_identical_to_prefill"] for r in rows if (r["model"], r["method"]) == (km, m))
            for m in meths
        }
        md.append(f"| {km} | same answer | | yes | " + " | ".join("yes" if same[m] else "NO" for m in meths) + " |")
    return md + gap_markdown(rows, meths)


def _ms(v: float | None) -> str:
    return "-" if v is None else f"{1e3 * v:.1f}"


def gap_markdown(rows: list[dict], meths: list[str]) -> list[str]:
    """After the fetch, per request (ms): restored KV -> suffix prefill started -> first token, and
    TTFT minus fetch (which also holds the lookup before the fetch)."""
    md = [
        "",
        "After the fetch, in ms (median per point): restored KV -> suffix prefill started / prefill started -> "
        "first token / TTFT - fetch_s (also holds arrival -> fetch start: tokens check and lookup)",
        "",
        "| model | tokens | Gbit/s | method | restored -> prefill | prefill -> first token | TTFT - fetch |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if r["method"] in meths:
            md.append(
                f"| {r['model']} | {r['tokens']} | {r['bandwidth_gbit']:g} | {method_label(r['method'])} | "
                f"{_ms(r.get('restored_to_prefill_s'))} | {_ms(r.get('prefill_to_first_token_s'))} | "
                f"{_ms(r.get('ttft_minus_fetch_s'))} |"
            )
    return md


def modeled_command(
    targets,
    src: KVSources,
    token_counts: list[int],
    suffix_tokens: int,
    bws: list[float],
    meths: list[str],
    size: tuple[int, int] | None,
    stats_file,
    overrides: dict,
    nvdec_gbit: float,
    device: str,
    gpu: bool,
    repeat: int,
    out_path,
    accuracy_files: tuple[str, ...] = (),
    note: str = "",
) -> None:  # noqa: ANN001
    """TTFT modeled from measured parts (see the module's docstring)."""
    import json

    tokens = token_counts[0]
    if stats_file:
        with open(stats_file) as f:
            stats = json.load(f)["kv_stats"]
        missing = [(km, m) for km, st in stats.items() for m in meths if m not in st["methods"]]
        if missing:
            raise click.ClickException(f"{stats_file} has no statistics for {missing}")
    else:
        stats = src.all_stats(tokens, meths, size, overrides)
    accuracy = load_accuracy(accuracy_files)
    tlist = targets.split(",") if targets else (["llama3-8b", "qwen2.5-7b"] if gpu else list(stats))
    rows, targets_info = [], {}
    for item in tlist:
        target, _, kv_model = item.partition("=")
        rows += target_rows(
            target,
            stats,
            token_counts,
            suffix_tokens,
            bws,
            meths,
            overrides,
            nvdec_gbit,
            device,
            gpu,
            repeat,
            targets_info,
            accuracy,
            kv_model or None,
        )
    label = "gpu" if gpu else "cpu"
    rec = {
        "benchmark": "ttft",
        "command": command_line("ttft"),
        "machine": machine(),
        "device": device,
        "label": label,
        "time": utc_now(),
        "model_of_ttft": "fetch = max(X, D) + min(X, D)/chunks (256-token chunks), X = bytes/bandwidth, D = decode; "
        "TTFT = fetch + suffix prefill; full prefill measured directly",
        "notes": (
            "prefill of llama3-8b/qwen2.5-7b: full-size architectures with random weights, timing only; bytes "
            "scaled from real KV of the small model of the same family by fp16 KV size"
            if gpu
            else "CPU run: small real models, their own real KV (no scaling); all decoders run on the CPU "
            "(kvcodec = software HEVC decode, which is what makes it slow here; NVDEC is the design point)"
        )
        + (f". {note}" if note else ""),
        "kv_stats": stats,
        "targets": targets_info,
        "accuracy": accuracy,
        "rows": rows,
    }
    md = modeled_markdown(rec)
    path = write_result(result_path(out_path, f"ttft-{label}"), rec, md)
    click.echo("\n".join(md))
    click.echo(f"wrote {path}", err=True)


def target_rows(
    target: str,
    stats: dict,
    token_counts: list[int],
    suffix_tokens: int,
    bws: list[float],
    meths: list[str],
    overrides: dict,
    nvdec_gbit: float,
    device: str,
    gpu: bool,
    repeat: int,
    targets_info: dict,
    accuracy: dict | None = None,
    kv_model: str | None = None,
) -> list[dict]:
    """Modeled TTFT rows of one target model: its prefill timed here, fetch from the KV statistics
    (of `kv_model`; default: a full-size target's family's small model, any other target's own)."""
    import torch

    rows = []
    src = kv_model or (LARGE[target][2] if target in LARGE else target)
    if src not in stats:
        raise click.ClickException(
            f"no KV statistics for {src} (needed by {target}); measured: {', '.join(stats)} (TARGET=KVMODEL picks one)"
        )
    st = stats[src]
    click.echo(f"timing prefill of {target} on {device} ...", err=True)
    model, per_token, random = build_model(target, device)
    timings = {n: time_prefill(model, n, suffix_tokens, device, repeat) for n in token_counts}
    del model
    if gpu:
        torch.cuda.empty_cache()
    targets_info[target] = {
        "kv_stats_from": src,
        "random_weights": random,
        "kv_fp16_bytes_per_token": per_token,
        "bytes_scaled_from_real_kv": src != target,
        "by_tokens": {},
    }
    for n, (full_s, suffix_s) in timings.items():
        fp16 = per_token * n
        rates = {m: decode_rate(m, st, fp16, gpu, nvdec_gbit, overrides) for m in meths}
        targets_info[target]["by_tokens"][str(n)] = {
            "prefill_s": full_s,
            "suffix_prefill_s": suffix_s,
            "decode_rates": rates,
        }
        click.echo(f"  prefill {n}+{suffix_tokens} tokens: {full_s:.3f} s; suffix only: {suffix_s:.3f} s", err=True)
        point = ModeledPoint(target, n, fp16, full_s, suffix_s, suffix_tokens, "gpu" if gpu else "cpu")
        ratios = {m: st["methods"][m]["ratio_vs_fp16"] for m in meths}
        decode = {m: rates[m]["decode_GBps_fp16"] for m in meths}
        rows += modeled_rows(point, bws, ratios, decode, (accuracy or {}).get(src, {}))
    return rows


@dataclasses.dataclass(frozen=True)
class ModeledPoint:
    """One target and prefix length: its fp16 KV bytes and measured prefill times."""

    model: str
    tokens: int
    fp16_bytes: int
    prefill_s: float
    suffix_prefill_s: float
    suffix_tokens: int
    device: str


ACCURACY_FIELDS = ("top1_agreement", "ppl_delta_pct", "quoref_same_answer_rate")


def modeled_rows(
    p: ModeledPoint, bws: list[float], ratios: dict[str, float], decode: dict[str, float], accuracy: dict
) -> list[dict]:
    """TTFT rows of full prefill and every method (ratio vs fp16, decode GB/s of fp16 KV) at each
    bandwidth, with each method's speedups and its accuracy where `accuracy` ({method: record}) has it."""
    chunks = max(1, p.tokens // 256)
    rows = []
    for bw in bws:
        res = {"prefill": {"ttft_s": p.prefill_s, "bytes": 0, "transfer_s": 0.0, "decode_s": 0.0}}
        for m, ratio in ratios.items():
            nbytes = p.fp16_bytes / ratio
            f, x, d = fetch_time(nbytes, p.fp16_bytes, bw, decode[m], chunks)
            res[m] = {"ttft_s": f + p.suffix_prefill_s, "bytes": int(nbytes), "transfer_s": x, "decode_s": d}
        for m, r in res.items():
            acc = accuracy_of(accuracy, m)
            rows.append(
                {
                    "model": p.model,
                    "tokens": p.tokens,
                    "bandwidth_gbit": bw,
                    "method": m,
                    "ttft_s": r["ttft_s"],
                    "speedup_vs_raw": res["raw"]["ttft_s"] / r["ttft_s"] if "raw" in res else None,
                    "speedup_vs_cachegen": res["cachegen"]["ttft_s"] / r["ttft_s"] if "cachegen" in res else None,
                    "speedup_vs_prefill": p.prefill_s / r["ttft_s"],
                    "bytes": r["bytes"],
                    "transfer_s": r["transfer_s"],
                    "decode_s": r["decode_s"],
                    "device": p.device,
                    "suffix_tokens": p.suffix_tokens,
                    **{f: acc.get(f) for f in ACCURACY_FIELDS},
                }
            )
    return rows


RD_METHODS = {"fp16": "raw", "int8": "kvcodec-int8", "int4": "kvcodec-int4", "cachegen": "cachegen"}


def rd_method(name: str) -> str | None:
    """The TTFT method a benchmarks/rd.py method name measures ("transform-zstd-r5" ->
    "kvcodec-transform-5", methods.rd_name); None for variants the TTFT bench does not fetch."""
    return rd_name(name) or RD_METHODS.get(name)


def load_accuracy(paths: tuple[str, ...]) -> dict:
    """{KV model: {method: accuracy record}} from benchmarks/rd.py records; a later file wins."""
    import json
    import os

    out: dict[str, dict] = {}
    for path in paths:
        with open(path) as f:
            rec = json.load(f)
        if "records" not in rec:
            raise click.ClickException(f"{path} is not a benchmarks/rd.py record (no 'records')")
        for r in rec["records"]:
            m = rd_method(r.get("method", ""))
            if m is None:
                continue
            row = {k: r.get(k) for k in ("ratio_vs_fp16", "tokens_scored", "quoref_n", *ACCURACY_FIELDS)}
            row["source"] = os.path.basename(path)
            out.setdefault(r["model"], {})[m] = row
            if m == "raw":  # zstd is lossless: the same KV as fp16
                out[r["model"]]["zstd-3"] = row
    return out


def decode_rate(m: str, st: dict, fp16: int, gpu: bool, nvdec_gbit: float, overrides: dict) -> dict:
    """The decode rate (GB/s of fp16 KV) a modeled fetch of method `m` uses, and where it comes from."""
    if m in overrides:
        return {"decode_GBps_fp16": overrides[m], "source": "--decode-rate override"}
    if gpu and m == "raw":
        return {"decode_GBps_fp16": h2d_GBps(min(fp16, 1 << 30)), "source": "host-to-device copy (measured)"}
    if gpu and m.startswith("kvcodec") and _splits_decode(m):
        raise click.ClickException(
            f"{m} codes every other chunk as video and the rest with zstd, so neither NVDEC's rate nor the host's"
            f" alone models its fetch: give --decode-rate {m}=GB/s (or measure it with `kvcodec bench ttft-engine`)"
        )
    if gpu and transform_coder(m) == SM_CODER:
        raise click.ClickException(
            f"{m} decodes its samples on the GPU's SMs, whose rate the KV-statistics machine's CPU decode does not"
            f" model: give --decode-rate {m}=GB/s (or measure it with `kvcodec bench ttft-engine`)"
        )
    if gpu and m.startswith("kvcodec") and _decodes_on_nvdec(m):
        coded = fp16 / st["methods"][m]["ratio_vs_fp16"]
        return {
            "decode_GBps_fp16": fp16 / (coded * 8 / (nvdec_gbit * 1e9)) / 1e9,
            "source": f"NVDEC at {nvdec_gbit:g} Gbit/s coded (--nvdec-gbit)",
        }
    rate = st["methods"][m].get("decode_GBps_fp16")
    if not rate:
        raise click.ClickException(f"no decode rate for {m}: its CPU decode was not timed; give --decode-rate {m}=GB/s")
    return {"decode_GBps_fp16": rate, "source": "cpu (measured on the KV-statistics machine)"}


def _splits_decode(method: str) -> bool:
    """Whether a kvcodec transform method's chunks are decoded partly on NVDEC and partly on the host."""
    return transform_ratio(method) is not None and (transform_coder(method) or DEFAULT_CODER) == "mixed"


def _decodes_on_nvdec(method: str) -> bool:
    """Whether a kvcodec method's chunks are videos (NVDEC's rate applies); a transform method whose
    coder is zstd decodes on the host, so its measured decode rate stands (a --decode-rate sets it)."""
    if transform_ratio(method) is None:
        return True
    return (transform_coder(method) or DEFAULT_CODER) in VIDEO_CODERS


def modeled_markdown(rec: dict) -> list[str]:
    """The report of a modeled TTFT record: TTFT per method, then each kvcodec method's speedup
    over raw KV reuse, CacheGen-style reuse and full prefill."""
    rows = rec["rows"]
    meths = list(dict.fromkeys(r["method"] for r in rows if r["method"] != "prefill"))
    kvms = [m for m in meths if m.startswith("kvcodec")]
    targets = list(dict.fromkeys(r["model"] for r in rows))
    tokens = sorted({r["tokens"] for r in rows})
    bws = sorted({r["bandwidth_gbit"] for r in rows})
    speed_cols = [f"{method_label(k)} vs {b}" for k in kvms for b in ("raw", "CacheGen", "prefill")]
    md = [
        f"# TTFT vs bandwidth ({rec['label']})",
        "",
        f"`{rec['command']}`",
        "",
        rec["notes"],
        "",
        "| model | tokens | Gbit/s | "
        + " | ".join(method_label(m) for m in ["prefill"] + meths)
        + "".join(f" | {c}" for c in speed_cols)
        + " |",
        "|---|---|---|" + "---|" * (len(meths) + 1 + len(speed_cols)),
    ]

    def x(v) -> str:
        return f"{v:.2f}x" if v else "-"

    for target in targets:
        for n in tokens:
            for bw in bws:
                sel = {
                    r["method"]: r
                    for r in rows
                    if r["model"] == target and r["tokens"] == n and r["bandwidth_gbit"] == bw
                }
                if not sel:
                    continue
                cells = [f"{sel[m]['ttft_s']:.3f}" for m in ["prefill"] + meths]
                for k in kvms:
                    cells += [
                        x(sel[k]["speedup_vs_raw"]),
                        x(sel[k]["speedup_vs_cachegen"]),
                        x(sel[k]["speedup_vs_prefill"]),
                    ]
                md.append(f"| {target} | {n} | {bw:g} | " + " | ".join(cells) + " |")
    return md + inputs_markdown(rec, meths)


def inputs_markdown(rec: dict, meths: list[str]) -> list[str]:
    """What the modeled TTFT of each method rests on: its measured ratio, decode rate (and where that
    comes from) and, where an rd record gave it, its accuracy on the real model."""
    acc = rec.get("accuracy") or {}
    md = [
        "",
        "Inputs per target and method: ratio vs fp16 (real KV of the statistics model), decode rate (GB/s of "
        "fp16 KV) and its source, accuracy on the statistics model (benchmarks/rd.py record named).",
        "",
        "| target | tokens | prefill s | suffix prefill s | method | ratio vs fp16 | decode GB/s | decode source "
        "| top-1 agreement | ppl change % | Quoref same answer | accuracy from |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]

    def f(v, fmt: str) -> str:  # noqa: ANN001
        return "-" if v is None else format(v, fmt)

    for target, info in rec.get("targets", {}).items():
        st = rec["kv_stats"][info["kv_stats_from"]]
        a = acc.get(info["kv_stats_from"], {})
        for n, t in info["by_tokens"].items():
            for m in meths:
                r, x = t["decode_rates"][m], accuracy_of(a, m)
                md.append(
                    f"| {target} | {n} | {t['prefill_s']:.3f} | {t['suffix_prefill_s']:.3f} | {method_label(m)} | "
                    f"{st['methods'][m]['ratio_vs_fp16']:.2f} | {r['decode_GBps_fp16']:.2f} | {r['source']} | "
                    f"{f(x.get('top1_agreement'), '.4f')} | {f(x.get('ppl_delta_pct'), '+.2f')} | "
                    f"{f(x.get('quoref_same_answer_rate'), '.3f')} | {x.get('source', '-')} |"
                )
    return md
