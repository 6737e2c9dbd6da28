"""`kvcodec bench ttft-engine`: time to first token measured through the engine, for a large
model of which no real KV exists here (a random-weight Llama-3-8B-shaped model on a GPU).

Two steps, because the coded chunks are made on a CPU machine and the timing runs on a GPU one:

    # CPU: real KV (any `kvcodec extract` file) tiled into the target's shape, coded by every method
    kvcodec bench ttft-engine prep --kv-file KV.safetensors --target llama3-8b \\
        --transform LLAMA-SHAPED.kvt --methods raw,cachegen,kvcodec-int8,kvcodec-transform --dir D
    # GPU: stores of the full prefix built from those chunks, each request through Engine + PrefixCache
    kvcodec bench ttft-engine run --dir D --tokens 8192,32768 --bandwidths 1,5,10,25,40,100
    # anywhere: the markdown (and derived rows) again from a run's JSON
    kvcodec bench ttft-engine report RESULT.json

What is measured (run): every TTFT is `Engine.generate`'s own (arrival -> first token) of a prompt
whose prefix is stored: the engine's lookup, `PrefixCache.fetch` with its defaults (the CUDA fetch
path the server uses; `policy="fixed:0"`, the one stored resolution) reading every chunk through a
token-bucket link (kvbench.net.throttle) from an in-memory store, real decoding (NVDEC for the HEVC
codecs, the CuPy/torch decoders of the baselines) of real coded chunks into the engine's KV, then the
suffix prefill. The engine's fetch deadline is off (`fetch_deadline_s=None`): each method's own TTFT,
not the engine's fallback to recomputation. Full prefill is `Engine.generate` without reuse.
With `--busy-seconds S` (CUDA) each method's fetches at the fastest link are also timed beside a bf16
matmul looping on its own stream (kvbench.busy), with the matmul's slowdown: what restoring costs a
serving GPU's compute. Every method codes at its codec's own default frame size unless prep names one
(`--resolution`).

What is not real, and said in every record:
- the model has random weights (timing only); its KV would not compress like a trained model's, so
  the chunks code REAL KV values (the KV file's, tiled into the target's shape: workloads.tiled_kv);
- the stores hold the prep's few coded chunks (`SEED_CHUNKS`) relocated to every chunk position of
  the prefix (header index, start token and prefix key rewritten, payload unchanged: `relocate`), so
  a 32k-token prefix decodes the same chunk streams many times; raw fp16 chunks are coded on the GPU
  machine from random values (raw decoding does not depend on them);
- links too slow to measure in the time given (a point whose bytes need more than
  `--max-transfer-s` on the link) are modelled from the measured parts of the same method and prefix:
  fetch = max(X, D) + min(X, D) / chunks with X the transfer time and D the fetch time measured at the
  fastest link, plus the engine's time after the fetch measured there. Rows say `measured` or not.
"""

from __future__ import annotations

import dataclasses
import json
import pathlib
import statistics
import struct
import time
from collections.abc import Callable

import click

from kvbench.methods import (
    accuracy_of,
    expand_methods,
    frame_sizes,
    method_codec,
    resolution_option,
    transform_codec,
    transform_ratio,
)
from kvbench.methods import label as method_label
from kvbench.pack import PACK, read_pack, widest
from kvbench.pack import write_pack as save_pack
from kvbench.results import command_line, machine, result_path, utc_now, write_result

CHUNK = 256
SEED_CHUNKS = 3  # transform: chunk 0 (its sink tokens), chunks 1 and 2 (relocated in turn to the later positions)
MANIFEST = "manifest.json"
MODEL_ID = "ttft-engine"  # the prefix-key namespace of the stores the run builds
SUFFIX_TOKENS = 32
_PREFIX = struct.Struct("<4sHI")  # kvcodec container: magic, version, header length (container/format.py)


# ------------------------------------------------------------------------------ the target model


def target_shape(target: str) -> tuple[int, int, int]:
    """(layers, kv_heads, head_dim) of a LARGE target name or of a transformers config (a model
    folder or its config.json)."""
    cfg = _config(target)
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    return cfg.num_hidden_layers, cfg.num_key_value_heads, head_dim


def _config(target: str):  # noqa: ANN202
    import transformers

    from kvbench.workloads import LARGE

    if target in LARGE:
        cls, kw, _ = LARGE[target]
        return getattr(transformers, cls)(**kw)
    path = pathlib.Path(target)
    if not path.exists():
        raise click.ClickException(f"--target {target!r}: neither a known architecture ({', '.join(LARGE)}) nor a path")
    return transformers.AutoConfig.from_pretrained(str(path if path.is_dir() else path.parent))


def build_target(target: str, device: str):  # noqa: ANN201
    """(model, random_weights): a LARGE name or a config without weights -> random weights (bf16 on a
    GPU); a model folder with weights -> those weights."""
    import torch
    import transformers

    from kvbench.workloads import LARGE, build_model

    if target in LARGE:
        return build_model(target, device)[0], True
    path = pathlib.Path(target)
    folder = path if path.is_dir() else path.parent
    dtype = torch.bfloat16 if device.startswith("cuda") else torch.float32
    weights = any(folder.glob("*.safetensors")) or any(folder.glob("*.bin"))
    if weights and path.is_dir():
        model = transformers.AutoModelForCausalLM.from_pretrained(str(folder), dtype=dtype).to(device)
        return model.eval(), False
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(_config(target), dtype=dtype)
    return model.eval(), True


# ------------------------------------------------------------------------------ chunks and stores


def relocate(blob: bytes, index: int, start_token: int, key: str) -> bytes:
    """A chunk blob of any kvcodec container codec as chunk `index` (first token `start_token`) of
    the prefix `key` names: its header's position fields and key rewritten, its header checksum
    recomputed, its payload (the coded streams) unchanged. Its codec field stays: the seeds are coded
    by the run's codec (seed_blobs checks), and a baseline's names the baseline, not a codec id."""
    from kvcodec.container.format import crc32

    magic, version, n = _PREFIX.unpack_from(blob, 0)
    header = json.loads(bytes(blob[_PREFIX.size : _PREFIX.size + n]))
    field = "index" if "index" in header else "chunk_index"
    if field not in header or "start_token" not in header:
        raise click.ClickException(f"a {magic!r} chunk header has no index/start_token to relocate")
    if header.get("sink", 0) and start_token:
        raise click.ClickException("a chunk with sink tokens can only stay at the start of a prefix")
    header.update({field: index, "start_token": start_token, "key": key})
    head = json.dumps(header, separators=(",", ":"), sort_keys=True).encode()
    payload = blob[_PREFIX.size + n + 4 :]
    return b"".join([_PREFIX.pack(magic, version, len(head)), head, struct.pack("<I", crc32(head)), payload])


def real_kv(kv_file: str):  # noqa: ANN201
    """The KV tensor of a `kvcodec extract` file."""
    from kvbench.ttft import load_kv

    return load_kv(kv_file)[0]


def seed_kv(real, shape: tuple[int, int, int], tokens: int):  # noqa: ANN001, ANN201
    """fp16 KV of the target's shape holding `real`'s values (a KV file's, tiled)."""
    import torch

    from kvbench.workloads import tiled_kv

    return tiled_kv(real.to(torch.float16), *shape, tokens)


def check_calibration_tokens(real, kv_file: str, target: str, shape: tuple[int, int, int]) -> None:  # noqa: ANN001
    """Refuse a calibration KV file with fewer tokens (past the sinks) than `kvcodec calibrate`
    asks for its own layers (pca.MIN_TOKENS_PER_DIM), and warn when it has fewer than the target's
    layers need: tiling into the target's shape repeats tokens and adds none, so the .kvt is fitted
    on that many distinct samples of the target's wider layers. `shape`: the target's."""
    from kvcodec.transform.calibration import DEFAULT_SINK_TOKENS
    from kvcodec.transform.pca import MIN_TOKENS_PER_DIM

    tokens = real.shape[2] - DEFAULT_SINK_TOKENS
    own, wide = real.shape[3] * real.shape[4], shape[1] * shape[2]
    if tokens < MIN_TOKENS_PER_DIM * own:
        raise click.BadParameter(
            f"{kv_file} holds {real.shape[2]} tokens ({DEFAULT_SINK_TOKENS} of them sinks); its layers have {own} "
            f"dimensions, so a calibration needs at least {int(MIN_TOKENS_PER_DIM * own) + DEFAULT_SINK_TOKENS}",
            param_hint="--calibrate-kv-file",
        )
    if tokens < MIN_TOKENS_PER_DIM * wide:
        click.echo(
            f"  warning: {kv_file} holds {real.shape[2]} tokens; {target}'s layers have {wide} dimensions and a "
            f"calibration on its own KV would need {int(MIN_TOKENS_PER_DIM * wide) + DEFAULT_SINK_TOKENS}: the .kvt "
            "is fitted on fewer distinct samples than that (rates and SM costs may differ from a real fit)",
            err=True,
        )


CAL_TOKENS = 4096  # tokens of the calibration KV (tiled into the target's shape) prep --calibrate-kv-file fits on


def calibrate_target(kv_file: str, target: str, d: pathlib.Path) -> pathlib.Path:
    """A .kvt of the target's shape (the default sample covariance, the target's RoPE) fitted on
    `kv_file`'s real values tiled into that shape, CAL_TOKENS tokens: a calibration of the same
    kind of values the seed chunks hold, from another text's KV. Written to d/target.kvt."""
    from kvcodec.transform import RopeSpec, calibrate, save_kvt

    real, shape = real_kv(kv_file), target_shape(target)
    check_calibration_tokens(real, kv_file, target, shape)
    kv = seed_kv(real, shape, CAL_TOKENS)
    rope = RopeSpec.from_hf_config(_config(target))
    d.mkdir(parents=True, exist_ok=True)
    path = d / "target.kvt"
    save_kvt(calibrate([kv], rope, info={"target": target, "calibration_kv_file": kv_file}), path)
    return path


def fp16_token_bytes(shape: tuple[int, int, int]) -> int:
    """Bytes of one token's fp16 KV (keys and values) in the target's (layers, kv heads, head dim)."""
    L, H, D = shape
    return 2 * L * H * D * 2


def codec_config():  # noqa: ANN201
    from kvcodec.config import CodecConfig

    return CodecConfig(quant="int8", chunk_tokens=CHUNK)


def prep(kv_file: str, target: str, transform: str | None, meths: list[str], d: pathlib.Path, resolution) -> dict:
    """Code the seed chunks of every method (raw is coded on the run's machine) into `d`, with the
    transform's calibration cut to the coordinates they code (the pack, which travels light)."""
    shape = target_shape(target)
    kv = seed_kv(real_kv(kv_file), shape, SEED_CHUNKS * CHUNK)
    d.mkdir(parents=True, exist_ok=True)
    fixed = None if resolution is None else list(resolution)
    man = {"target": target, "shape": list(shape), "kv_file": kv_file, "resolution": fixed, "methods": {}}
    for m in meths:
        if m == "raw":
            continue
        t0 = time.perf_counter()
        codec, blobs = seed_chunks(m, kv, resolution, transform)
        enc = time.perf_counter() - t0
        files = []
        for i, blob in enumerate(blobs):
            (d / f"{m}-{i}.blob").write_bytes(blob)
            files.append({"file": f"{m}-{i}.blob", "bytes": len(blob)})
        coded = sum(f["bytes"] for f in files)
        man["methods"][m] = {
            "codec_id": codec.id,
            "resolutions": [list(r) for r in codec.resolutions],
            "chunks": files,
            "encode_s": round(enc, 2),
            "ratio_vs_fp16": kv[:, :, :CHUNK].numel() * 2 * len(blobs) / coded,
            "kvt_sha256": getattr(codec, "kvt_hash", None),
        }
        if transform_ratio(m):  # the frames the codec chose for these chunks (its resolutions are the largest)
            h = codec.header(blobs[0])
            man["methods"][m] |= {"frame": list(h["resolution"]), "frames": h["frames"]}
        click.echo(f"  {m}: {len(blobs)} chunk(s), {coded} bytes, {man['methods'][m]['ratio_vs_fp16']:.2f}x", err=True)
    if transform and any(transform_ratio(m) for m in man["methods"]):
        write_pack(d, man, transform, resolution)
    (d / MANIFEST).write_text(json.dumps(man, indent=1) + "\n")
    return man


def seed_chunks(m: str, kv, resolution, transform: str | None) -> tuple:  # noqa: ANN001
    """(codec, seed chunk blobs) of method `m` from the seed KV: SEED_CHUNKS for the transform, one
    for the others. build_store cycles seeds 1.. over the later positions, so a mixed coder's chunks
    (HEVC and zstd in turn by index) keep their turn."""
    n = SEED_CHUNKS if transform_ratio(m) else 1
    codec = method_codec(m, codec_config(), transform=transform, resolutions=frame_sizes(resolution))
    return codec, [c.blobs[0] for c in codec.encode_chunks(kv[:, :, : n * CHUNK], keys=[f"seed-{i}" for i in range(n)])]


def write_pack(d: pathlib.Path, man: dict, transform: str, resolution) -> None:
    """The .kvt cut to the widest coordinates any seed chunk codes (kvbench.pack)."""
    codec, headers = None, []
    for m, info in man["methods"].items():
        if transform_ratio(m) is None:
            continue
        codec = method_codec(m, codec_config(), transform=transform, resolutions=frame_sizes(resolution))
        headers += [codec.header((d / f["file"]).read_bytes()) for f in info["chunks"]]
    save_pack(codec.cal, codec.kvt_hash, widest(codec, headers), d / PACK)


def run_codec(m: str, d: pathlib.Path, man: dict, pack: pathlib.Path | None = None):  # noqa: ANN201
    """The codec a run stores and fetches method `m` with (the transform's over the pack: `pack`, else
    the prep folder's)."""
    frames = frame_sizes(man.get("resolution"))
    r = transform_ratio(m)
    if r is None:
        return method_codec(m, codec_config(), resolutions=frames)
    cal, kvt_hash = read_pack(pack or d / PACK, square=True)
    return transform_codec(
        m, cal, kvt_hash=kvt_hash, chunk_tokens=CHUNK, **({} if frames is None else {"resolutions": frames})
    )


def seed_blobs(m: str, d: pathlib.Path, man: dict, codec) -> list[bytes]:  # noqa: ANN001
    """The method's seed chunk blobs; raw's coded here from random fp16 values."""
    import torch

    if m == "raw":
        L, H, D = man["shape"]
        g = torch.Generator().manual_seed(0)
        kv = (torch.randn((L, 2, CHUNK, H, D), generator=g) * 0.5).to(torch.float16)
        return [codec.encode_chunks(kv, keys=["seed-0"])[0].blobs[0]]
    info = man["methods"].get(m)
    if info is None:
        raise click.ClickException(f"{d} has no chunks of {m}: prep it with --methods ...,{m}")
    if info["codec_id"] != codec.id:
        raise click.ClickException(f"{m}: prepared with codec {info['codec_id']}, this run codes {codec.id}")
    return [(d / f["file"]).read_bytes() for f in info["chunks"]]


def seed_at(seeds: list[bytes], i: int) -> bytes:
    """The seed stored at chunk position i: seed i where there is one, then seeds 1.. in turn
    (seed 0 holds the sink tokens: only at position 0)."""
    if i < len(seeds):
        return seeds[i]
    later = seeds[1:] or seeds
    return later[(i - 1) % len(later)]


def build_store(pc, ids: list[int], seeds: list[bytes], shape: tuple[int, int, int]) -> int:  # noqa: ANN001
    """Store every chunk of `ids` through PrefixCache `pc`: seed i at position i, then seeds 1.. in
    turn at the later positions (relocated). Returns the coded bytes stored."""
    from kvcodec.codecs.base import EncodedChunk

    res = tuple(pc.codec.resolutions)
    total = 0
    for i, k in enumerate(pc.keys(ids)):
        blob = relocate(seed_at(seeds, i), i, i * CHUNK, k)
        pc.store_chunk(k, EncodedChunk(i, i * CHUNK, CHUNK, res, (blob,)), shape, "float16")
        total += len(blob)
    return total


# ------------------------------------------------------------------------------ the measurement


@dataclasses.dataclass(frozen=True)
class Point:
    """One request's measurement: the engine's TTFT and fetch time, what it restored."""

    ttft_s: float
    fetch_s: float | None
    bytes: int
    restored: int
    error: str | None


def point_of(out) -> Point:  # noqa: ANN001
    return Point(out.ttft_s, out.fetch_s, out.bytes_fetched, out.restored_tokens, out.fetch_error)


def median_point(points: list[Point]) -> dict:
    fetch = [p.fetch_s for p in points if p.fetch_s is not None]
    return {
        "ttft_s": statistics.median(p.ttft_s for p in points),
        "fetch_s": statistics.median(fetch) if len(fetch) == len(points) else None,
        "bytes": points[0].bytes,
        "restored_tokens": min(p.restored for p in points),
        "fetch_error": next((p.error for p in points if p.error), None),
        "ttft_runs_s": [p.ttft_s for p in points],
        "fetch_runs_s": fetch if len(fetch) == len(points) else None,  # a stalled request shows here
        "measured": True,
    }


def modelled(fast: dict, nbytes: int, gbit: float, chunks: int) -> dict:
    """A point too slow to measure, from the same method's point at the fastest link: its fetch
    time D and the engine's time after the fetch, with this link's transfer time X."""
    x = nbytes * 8 / (gbit * 1e9)
    d = fast["fetch_s"]
    fetch = max(x, d) + min(x, d) / max(1, chunks)
    return {
        "ttft_s": fetch + fast["ttft_s"] - d,
        "fetch_s": fetch,
        "bytes": nbytes,
        "restored_tokens": fast["restored_tokens"],
        "fetch_error": None,
        "ttft_runs_s": [],
        "measured": False,
        "transfer_s": x,
    }


@dataclasses.dataclass(frozen=True)
class RunSpec:
    """The run's grid and how hard it measures."""

    tokens: tuple[int, ...]
    bws: tuple[float, ...]
    repeat: int
    max_transfer_s: float
    device: str
    busy_s: float = 0.0  # > 0 (CUDA): each method's fetches also beside a looping bf16 matmul, this long
    busy_queued: tuple[int, ...] = (
        1,
    )  # the matmul's queue depths (kvbench.busy.matmul_tflops), the first the record's


def engine_for(model, pc, device: str):  # noqa: ANN001, ANN201
    from kvcodec.engine import Engine, StorePolicy

    return Engine(
        model,
        prefix_cache=pc,
        reuse=pc is not None,
        store_policy=StorePolicy(enabled=False),
        device=device,
        fetch_deadline_s=None,
    )


def full_prefill(model, prompts: dict[int, list[int]], spec: RunSpec) -> dict[int, dict]:  # noqa: ANN001
    with engine_for(model, None, spec.device) as eng:
        eng.generate(prompts[min(prompts)][:64], max_new_tokens=1)
        out = {}
        for n, prompt in prompts.items():
            eng.generate(prompt, max_new_tokens=1)  # warm-up at this length
            pts = [point_of(eng.generate(prompt, max_new_tokens=1)[0]) for _ in range(spec.repeat)]
            out[n] = median_point(pts)
            click.echo(f"  full prefill {n}: {out[n]['ttft_s']:.3f} s", err=True)
    return out


def first_request(eng, prompt: list[int], device) -> dict:  # noqa: ANN001 - an Engine, a device
    """The first request of a prefix length, kept out of the medians: its TTFT and fetch time, and (CUDA)
    what the pinned host allocator grew by during it, what a server's first long fetch pays."""
    before = _pinned(device)
    out = eng.generate(prompt, max_new_tokens=1)[0]
    after = _pinned(device)
    grew = {f"first_{k}": after[k] - before[k] for k in after if after[k] is not None and before[k] is not None}
    return {"first_ttft_s": out.ttft_s, "first_fetch_s": out.fetch_s, **grew}


def _pinned(device) -> dict:  # noqa: ANN001
    """The pinned host allocator's blocks made, seconds spent making them and bytes held, each None where
    this torch does not count it; empty off CUDA."""
    import torch

    if torch.device(device).type != "cuda" or not hasattr(torch.cuda, "host_memory_stats"):
        return {}
    stats = torch.cuda.host_memory_stats()
    alloc_us = stats.get("host_alloc_time.total")
    return {
        "pinned_blocks": stats.get("num_host_alloc"),
        "pinned_alloc_s": None if alloc_us is None else alloc_us / 1e6,
        "pinned_bytes": stats.get("allocated_bytes.current"),
    }


def method_points(model, m: str, pc, link_store, prompts: dict[int, list[int]], spec: RunSpec) -> dict:  # noqa: ANN001
    """{(tokens, gbit): point} of one method: per prefix length a first request at the fastest link (kept
    apart in that row: first_request), then every link from the fastest down, measured or (too slow) modelled."""
    from kvbench.net.throttle import TokenBucketLink
    from kvbench.net.trace import JitterTrace

    out = {}
    with engine_for(model, pc, spec.device) as eng:
        for n, prompt in prompts.items():
            fast = None
            for bw in sorted(spec.bws, reverse=True):
                link_store.link = TokenBucketLink(JitterTrace.constant(bw))
                nbytes = fast["bytes"] if fast else 0
                if fast is not None and nbytes * 8 / (bw * 1e9) > spec.max_transfer_s:
                    out[(n, bw)] = modelled(fast, nbytes, bw, n // CHUNK)
                else:
                    first = first_request(eng, prompt, spec.device) if fast is None else {}  # not in the medians
                    pts = [point_of(eng.generate(prompt, max_new_tokens=1)[0]) for _ in range(spec.repeat)]
                    out[(n, bw)] = median_point(pts) | first
                    fast = fast or out[(n, bw)]
                r = out[(n, bw)]
                click.echo(
                    f"  {m} {n} {bw:g} Gbit/s: {r['ttft_s']:.3f} s"
                    f"{'' if r['measured'] else ' (modelled)'}, {r['restored_tokens']} restored",
                    err=True,
                )
    return out


def busy_points(pc, ids: list[int], spec: RunSpec, fp16_per_token: int) -> list[dict]:  # noqa: ANN001
    """Per prefix length: PrefixCache.fetch alone (looped back to back for at least max(3, repeat)
    calls and busy_s seconds: calls x GB / seconds, as beside the matmul) and looping
    beside a bf16 matmul (kvbench.busy) at each of spec.busy_queued's queue depths (the first's
    numbers are the record's, the others' are suffixed _queued_N), each fetch until the KV is ready
    on the fetching thread's own stream (as an engine's request thread waits; a device-wide sync
    would wait for the matmul too)."""
    import torch

    out = []
    for n in spec.tokens:
        prefix, caller = ids[:n], torch.cuda.Stream(spec.device)

        def fetch(prefix=prefix, caller=caller, n=n) -> None:  # noqa: ANN001
            with torch.cuda.stream(caller):
                r = pc.fetch(prefix, deadline_s=None)
            caller.synchronize()
            if r.tokens_restored != n:
                raise RuntimeError(f"restored {r.tokens_restored} of {n} tokens: {r.error}")

        # its float16 target's kernels, every variant (one fetch compiles only those its batches meet: session 58's
        # first timed fetch compiled one more), then one untimed fetch (allocator, pools)
        pc.warm_up(torch.float16)
        fetch()
        calls, seconds, cores = _looped(fetch, max(3, spec.repeat), spec.busy_s)
        gb = n * fp16_per_token / 1e9
        first, *others = [_beside(fetch, spec, q, gb) for q in spec.busy_queued]
        rec = {
            "tokens": n,
            "restored_gb_per_s_alone": calls * gb / seconds,  # calls over a busy_s window, as beside the matmul
            "calls_alone": calls,
            "host_cores_alone": cores,
            **first,
        }
        for q, other in zip(spec.busy_queued[1:], others, strict=True):
            rec[f"matmul_slowdown_queued_{q}"] = other["matmul_slowdown"]
            rec[f"restored_gb_per_s_beside_queued_{q}"] = other["restored_gb_per_s_beside"]
        out.append(rec)
        click.echo(
            f"  busy {n}: matmul slowed {rec['matmul_slowdown']:.1%}, {rec['restored_gb_per_s_beside']}", err=True
        )
    return out


def _looped(
    fetch: Callable[[], None], least_calls: int, least_s: float, clock: Callable[[], float] = time.perf_counter
) -> tuple[int, float, float]:
    """(calls, seconds, host cores) of `fetch` called back to back for at least `least_calls` calls and
    `least_s` seconds, as it loops beside the matmul: a few calls on an idle GPU (its clocks low)
    read slower than the same fetch looping. Host cores: every thread of the process's CPU seconds
    per second (host decoding counts)."""
    calls, cpu0, t0 = 0, time.process_time(), clock()
    while calls < least_calls or clock() - t0 < least_s:
        fetch()
        calls += 1
    seconds = max(clock() - t0, 1e-9)
    return calls, seconds, (time.process_time() - cpu0) / seconds


def _beside(fetch, spec: RunSpec, queued: int, gb: float) -> dict:  # noqa: ANN001
    """`fetch` looping beside the matmul kept `queued` batches deep (kvbench.busy), against the
    matmul's rate alone right before and after (a GPU's clocks drift as it heats): their mean."""
    from kvbench.busy import beside_matmul, matmul_tflops

    before = matmul_tflops(spec.device, spec.busy_s, queued=queued)
    rec = beside_matmul(fetch, spec.device, spec.busy_s, before, queued=queued)
    after = matmul_tflops(spec.device, spec.busy_s, queued=queued)
    alone = (before + after) / 2
    rec |= {"matmul_queued": queued, "matmul_tflops_alone": alone, "matmul_tflops_alone_before_after": [before, after]}
    rec["matmul_slowdown"] = 1.0 - rec["matmul_tflops_during"] / alone
    rec["restored_gb_per_s_beside"] = gb / rec["call_s_during"] if rec["calls_during"] else None
    return rec


def run(
    d: pathlib.Path, meths: list[str], spec: RunSpec, target: str | None, pack: pathlib.Path | None = None
) -> tuple[dict, list[dict]]:
    """(inputs, rows): the model timed through the engine on stores built from the seed chunks."""
    import torch

    from kvbench.net.throttle import ThrottledStore
    from kvcodec.fetcher import PrefixCache
    from kvcodec.store import open_store

    man = json.loads((d / MANIFEST).read_text())
    target = target or man["target"]
    shape = tuple(man["shape"])
    if target_shape(target) != shape:
        raise click.ClickException(f"{target}'s KV shape {target_shape(target)} is not the prepared {shape}")
    click.echo(f"building {target} on {spec.device} ...", err=True)
    model, random_weights = build_target(target, spec.device)
    n_max = max(spec.tokens)
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(100, min(model.config.vocab_size, 30000), (n_max + SUFFIX_TOKENS,), generator=g).tolist()
    prompts = {n: ids[:n] + ids[n_max : n_max + SUFFIX_TOKENS] for n in spec.tokens}
    inputs = {"target": target, "random_weights": random_weights, "shape": list(shape), "methods": {}}
    points = {"prefill": full_prefill(model, prompts, spec)}
    busy = spec.busy_s > 0 and spec.device.startswith("cuda")
    fp16_per_token = fp16_token_bytes(shape)
    for m in meths:
        codec = run_codec(m, d, man, pack)
        seeds = seed_blobs(m, d, man, codec)
        mem = open_store("memory://")
        stored = build_store(PrefixCache(mem, MODEL_ID, codec, "cpu", policy="fixed:0"), ids[:n_max], seeds, shape)
        link_store = ThrottledStore(mem, rate_gbit=max(spec.bws))
        pc = PrefixCache(link_store, MODEL_ID, codec, spec.device, policy="fixed:0")
        fp16 = n_max * fp16_per_token
        inputs["methods"][m] = {
            "codec_id": codec.id,
            "ratio_vs_fp16": fp16 / stored,
            "frames": "+".join(f"{w}x{h}" for w, h in getattr(codec, "resolutions", ())) or None,
            "seed_chunks": len(seeds),
            "prep": {k: v for k, v in man["methods"].get(m, {}).items() if k != "chunks"},
        }
        click.echo(f"  {m}: {stored / 1e6:.1f} MB stored ({fp16 / stored:.2f}x)", err=True)
        points[m] = method_points(model, m, pc, link_store, prompts, spec)
        if busy:
            from kvbench.net.throttle import TokenBucketLink
            from kvbench.net.trace import JitterTrace

            link_store.link = TokenBucketLink(JitterTrace.constant(max(spec.bws)))  # method_points ends at the slowest
            inputs["methods"][m]["busy"] = busy_points(pc, ids, spec, fp16_per_token)
        del mem, link_store, pc
        torch.cuda.empty_cache() if spec.device.startswith("cuda") else None
    return inputs, rows_of(points, target, spec, shape)


def rows_of(points: dict, target: str, spec: RunSpec, shape: tuple[int, int, int]) -> list[dict]:
    rows, fp16_per_token = [], fp16_token_bytes(shape)
    for n in spec.tokens:
        for bw in spec.bws:
            res = {"prefill": points["prefill"][n]} | {m: p[(n, bw)] for m, p in points.items() if m != "prefill"}
            for m, r in res.items():
                rows.append(
                    {
                        "model": target,
                        "tokens": n,
                        "bandwidth_gbit": bw,
                        "method": m,
                        **r,
                        "fp16_bytes": n * fp16_per_token,
                        "speedup_vs_raw": res["raw"]["ttft_s"] / r["ttft_s"] if "raw" in res else None,
                        "speedup_vs_cachegen": res["cachegen"]["ttft_s"] / r["ttft_s"] if "cachegen" in res else None,
                        "speedup_vs_prefill": res["prefill"]["ttft_s"] / r["ttft_s"],
                        "device": spec.device,
                        "suffix_tokens": SUFFIX_TOKENS,
                    }
                )
    return rows


# ------------------------------------------------------------------------------ the report

RAW_BOUND = "raw-link-bound"


def with_raw_bound(rows: list[dict]) -> list[dict]:
    """`rows` plus, where raw was measured, raw fp16 KV as a fetch bound only by the link would deliver
    it (modelled): its bytes over the link plus the engine's measured time after the raw fetch at the
    same point (the host-to-device copy of the last chunk, under a millisecond, left out); and every row's
    speedup over it. The fetcher's own raw path was restore-bound on a GPU (0.7 GB/s before 02168a9); it now
    runs within tens of ms of this bound (ttft-h200-engine-v2), which stays as the link's limit."""
    rows = [r for r in rows if r["method"] != RAW_BOUND]
    raw = {(r["model"], r["tokens"], r["bandwidth_gbit"]): r for r in rows if r["method"] == "raw"}
    fastest = {}
    for k, r in raw.items():
        if r["measured"] and r.get("fetch_s") is not None and (k[:2] not in fastest or k[2] > fastest[k[:2]][2]):
            fastest[k[:2]] = k
    bound = {}
    for k, r in raw.items():
        ref = r if r["measured"] and r.get("fetch_s") is not None else raw[fastest[k[:2]]]
        x = r["bytes"] * 8 / (k[2] * 1e9)
        bound[k] = {
            **{name: v for name, v in r.items() if not name.startswith("first_")},  # the raw fetcher's own
            "method": RAW_BOUND,
            "ttft_s": x + ref["ttft_s"] - ref["fetch_s"],
            "fetch_s": x,
            "transfer_s": x,
            "ttft_runs_s": [],
            "measured": False,
        }
    out = []
    for r in rows + list(bound.values()):
        b = bound.get((r["model"], r["tokens"], r["bandwidth_gbit"]))
        out.append({**r, "speedup_vs_raw_link_bound": b["ttft_s"] / r["ttft_s"] if b else None})
    return out


def _span(mine: list[dict], key: str, ok, sel) -> str:  # noqa: ANN001
    """'met' / 'NOT met' with the range of `key` over the rows `sel` picks."""
    vals = [r[key] for r in mine if sel(r) and r.get(key)]
    if not vals:
        return "-"
    return f"{'met' if all(ok(v) for v in vals) else 'NOT met'} ({min(vals):.2f}x-{max(vals):.2f}x)"


def targets_check(rows: list[dict], meths: list[str]) -> list[str]:
    """Issue 21 target 4 per transform method: faster than full prefill at every link >= 10 Gbit/s,
    >= 2x faster than raw fp16 at every link <= 25, >= 1.5x faster than CacheGen-style."""
    out = []
    for m in (m for m in meths if transform_ratio(m)):
        mine = [r for r in rows if r["method"] == m]
        out.append(
            f"- {method_label(m)}: faster than full prefill at >= 10 Gbit/s: "
            f"{_span(mine, 'speedup_vs_prefill', lambda v: v > 1, lambda r: r['bandwidth_gbit'] >= 10)}; "
            f">= 2x raw fp16 at <= 25 Gbit/s: through the fetcher "
            f"{_span(mine, 'speedup_vs_raw', lambda v: v >= 2, lambda r: r['bandwidth_gbit'] <= 25)}, link-bound "
            f"{_span(mine, 'speedup_vs_raw_link_bound', lambda v: v >= 2, lambda r: r['bandwidth_gbit'] <= 25)}; "
            f">= 1.5x CacheGen-style at every link: "
            f"{_span(mine, 'speedup_vs_cachegen', lambda v: v >= 1.5, lambda r: True)}"
        )
    return out or ["- no transform method in this run"]


SPEEDUPS = {
    "speedup_vs_prefill": "prefill",
    "speedup_vs_raw": "raw",
    "speedup_vs_raw_link_bound": "raw link-bound",
    "speedup_vs_cachegen": "CacheGen",
}


def markdown(rec: dict) -> list[str]:
    rows, meths = rec["rows"], rec["methods"]
    cols = ["prefill"] + meths
    if any(r["method"] == RAW_BOUND for r in rows):
        cols.insert(cols.index("raw") + 1, RAW_BOUND)
    md = [
        f"# TTFT vs bandwidth through the engine ({rec['label']})",
        "",
        f"`{rec['command']}`",
        "",
        rec["notes"],
        "",
        "Seconds, median of the runs; `*` = modelled from the same method's measured point at the fastest link "
        "(too slow to measure in the run's time); raw-link-bound = raw fp16 KV moved at the link's rate, then the "
        "engine's measured time after the raw fetch (modelled: what a raw path that is not restore-bound would give).",
        "",
        "| model | tokens | Gbit/s | " + " | ".join(method_label(m) for m in cols) + " |",
        "|---|---|---|" + "---|" * len(cols),
    ]
    keyed = {(r["model"], r["tokens"], r["bandwidth_gbit"], r["method"]): r for r in rows}
    grid = sorted({(r["model"], r["tokens"], r["bandwidth_gbit"]) for r in rows})
    for model, n, bw in grid:
        cells = []
        for m in cols:
            r = keyed[(model, n, bw, m)]
            bad = "" if r["restored_tokens"] >= n or m == "prefill" else f" (restored {r['restored_tokens']})"
            cells.append(f"{r['ttft_s']:.3f}{'' if r['measured'] else '*'}{bad}")
        md.append(f"| {model} | {n} | {bw:g} | " + " | ".join(cells) + " |")
    md += _speedups_markdown(keyed, grid, [m for m in meths if m.startswith("kvcodec-")])
    md += ["", "Issue 21 target 4 (computed from the table):", "", *targets_check(rows, meths)]
    return md + inputs_markdown(rec) + busy_markdown(rec)


def busy_markdown(rec: dict) -> list[str]:
    """The fetches beside a busy GPU (run --busy-seconds), where measured: a column pair per further
    queue depth of the matmul (--busy-queued)."""
    meths = {m: info["busy"] for m, info in rec["inputs"]["methods"].items() if info.get("busy")}
    if not meths:
        return []
    first = next(iter(meths.values()))[0]
    depth = first.get("matmul_queued", 1)
    more = sorted(int(k.rsplit("_", 1)[1]) for k in first if k.startswith("matmul_slowdown_queued_"))
    # records before calls_alone: the median of 3+ fetches (on an idle GPU, its clocks low, they read slower)
    alone = "looping as long as beside the matmul" if "calls_alone" in first else "median"
    md = [
        "",
        "Beside a busy GPU (a bf16 8192^3 matmul looping on its own stream): PrefixCache.fetch at the fastest link, "
        f"GB/s of fp16 KV restored alone ({alone}; host cores: the process's CPU seconds per second of those fetches) "
        "and looping beside the matmul, and the matmul's slowdown against "
        f"its rate alone (the mean of its rates right before and after). The matmul keeps {depth} batch(es) of 20 "
        "queued while its thread waits (1: its stream idles while the thread waits for the interpreter lock"
        + (f"; also measured with {', '.join(map(str, more))} queued: the GPU's sharing alone)." if more else ")."),
        "",
        "| method | tokens | restored alone, GB/s | host cores alone | beside the matmul, GB/s | matmul TFLOP/s alone "
        "| matmul slowed |" + "".join(f" beside, {q} queued, GB/s | slowed, {q} queued |" for q in more),
        "|---|---|---|---|---|---|---|" + "---|---|" * len(more),
    ]
    for m, recs in meths.items():
        for b in recs:
            md.append(
                f"| {method_label(m)} | {b['tokens']} | {_f(b['restored_gb_per_s_alone'], '.2f')} | "
                f"{_f(b.get('host_cores_alone'), '.1f')} | {_f(b['restored_gb_per_s_beside'], '.2f')} | {b['matmul_tflops_alone']:.0f} | {b['matmul_slowdown']:.1%} |"
                + "".join(
                    f" {_f(b.get(f'restored_gb_per_s_beside_queued_{q}'), '.2f')} | "
                    f"{_f(b.get(f'matmul_slowdown_queued_{q}'), '.1%')} |"
                    for q in more
                )
                + (f" error: {b['error']}" if b.get("error") else "")
            )
    return md


def _speedups_markdown(keyed: dict, grid: list, kms: list[str]) -> list[str]:
    """The speedups of kvcodec's methods (none: no table)."""
    if not kms:
        return []
    md = ["", "Speedups of kvcodec (TTFT of the other / TTFT of the kvcodec method):", ""]
    md += [
        "| tokens | Gbit/s | " + " | ".join(f"{method_label(m)} vs {b}" for m in kms for b in SPEEDUPS.values()) + " |",
        "|---|---|" + "---|" * (len(SPEEDUPS) * len(kms)),
    ]
    for model, n, bw in grid:
        cells = [_x(keyed[(model, n, bw, m)][k]) for m in kms for k in SPEEDUPS]
        md.append(f"| {n} | {bw:g} | " + " | ".join(cells) + " |")
    return md


def inputs_markdown(rec: dict) -> list[str]:
    acc = rec.get("accuracy") or {}
    md = [
        "",
        "Per method: ratio vs fp16 of the stored chunks (real KV values in the target's shape), fetch time at the "
        "fastest link (GB/s of fp16 KV restored, the transfer at that link included), the first request's fetch "
        "at that length (not in the medians: pools, kernels, pinned host memory made for it), accuracy from the rd "
        "record of the KV's model.",
        "",
        "| method | ratio vs fp16 | frames | tokens | fetch s (fastest link) | GB/s | first request's fetch s "
        "| top-1 agreement | ppl change % | Quoref same answer | accuracy from |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    fastest = max(r["bandwidth_gbit"] for r in rec["rows"])
    for m, info in rec["inputs"]["methods"].items():
        a = accuracy_of(acc, m)
        for r in (r for r in rec["rows"] if r["method"] == m and r["bandwidth_gbit"] == fastest):
            gbs = r["fp16_bytes"] / r["fetch_s"] / 1e9 if r.get("fetch_s") else None
            md.append(
                f"| {method_label(m)} | {info['ratio_vs_fp16']:.2f} | {info.get('frames') or '-'} | {r['tokens']} | "
                f"{_f(r.get('fetch_s'), '.3f')} | {_f(gbs, '.2f')} | {_f(r.get('first_fetch_s'), '.3f')} | "
                f"{_f(a.get('top1_agreement'), '.4f')} | "
                f"{_f(a.get('ppl_delta_pct'), '+.2f')} | {_f(a.get('quoref_same_answer_rate'), '.3f')} | "
                f"{a.get('source', '-')} |"
            )
    return md


def _x(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f}x"


def _f(v, fmt: str) -> str:  # noqa: ANN001
    return "-" if v is None else format(v, fmt)


# ------------------------------------------------------------------------------ the commands


@click.group("ttft-engine")
def command() -> None:
    """TTFT measured through the engine for a large (random-weight) model: prep codes real KV in its
    shape on a CPU machine, run times every request through Engine + PrefixCache on a GPU."""


@command.command("prep")
@click.option(
    "--kv-file", required=True, type=click.Path(exists=True, dir_okay=False), help="Real KV (kvcodec extract)."
)
@click.option("--target", default="llama3-8b", show_default=True, help="A kvbench architecture or a config path.")
@click.option(
    "--transform", default=None, type=click.Path(exists=True, dir_okay=False), help="A .kvt of the target's shape."
)
@click.option(
    "--calibrate-kv-file",
    default=None,
    type=click.Path(exists=True, dir_okay=False),
    help="Instead of --transform: fit DIR/target.kvt on this real KV (another text's) tiled into the target's shape.",
)
@click.option("--methods", default="raw,cachegen,kvcodec-int8,kvcodec-transform", show_default=True)
@click.option("--target-ratios", default="5,8", show_default=True)
@click.option(
    "--resolution", default=None, help="WxH: every method's frames at this size (default: each codec's own default)."
)
@click.option("--dir", "out_dir", required=True, type=click.Path(file_okay=False))
def prep_command(kv_file, target, transform, calibrate_kv_file, methods, target_ratios, resolution, out_dir) -> None:  # noqa: ANN001
    """Code seed chunks of every method from real KV tiled into the target's shape."""
    meths = expand_methods([m.strip() for m in methods.split(",") if m.strip()], _floats(target_ratios))
    if transform and calibrate_kv_file:
        raise click.ClickException("give --transform or --calibrate-kv-file, not both")
    if any(transform_ratio(m) for m in meths) and not (transform or calibrate_kv_file):
        raise click.ClickException(
            "the kvcodec-transform methods need --transform PATH.kvt (of the target's shape) or --calibrate-kv-file KV"
        )
    if calibrate_kv_file:
        transform = str(calibrate_target(calibrate_kv_file, target, pathlib.Path(out_dir)))
        click.echo(f"  calibrated {transform} on {calibrate_kv_file}", err=True)
    size = resolution_option(resolution)
    prep(kv_file, target, transform, meths, pathlib.Path(out_dir), size)


@command.command("run")
@click.option("--dir", "prep_dir", required=True, type=click.Path(exists=True, file_okay=False))
@click.option("--target", default=None, help="Default: the prepared target.")
@click.option("--methods", default="raw,cachegen,kvcodec-int8,kvcodec-transform", show_default=True)
@click.option("--target-ratios", default="5,8", show_default=True)
@click.option("--tokens", "tokens_list", default="8192,32768", show_default=True)
@click.option("--bandwidths", default="1,5,10,25,40,100", show_default=True, help="Gbit/s, comma list.")
@click.option("--repeat", default=1, show_default=True, type=int, help="Timed requests per point (median).")
@click.option(
    "--max-transfer-s",
    default=4.0,
    show_default=True,
    type=float,
    help="Points whose bytes need longer on the link are modelled from the measured ones.",
)
@click.option(
    "--busy-seconds",
    default=0.0,
    show_default=True,
    type=click.FloatRange(min=0),
    help="CUDA: also time each method's fetches beside a looping bf16 matmul for this long (0: off).",
)
@click.option(
    "--busy-queued",
    default="1",
    show_default=True,
    help="The matmul's queue depths, comma-separated (the first the table's): 1 lets its stream idle while its "
    "thread waits for the interpreter lock, 2 or more measure the GPU's sharing alone.",
)
@click.option("--pack", default=None, type=click.Path(exists=True, dir_okay=False), help="Default: DIR's pack.")
@click.option("--accuracy", "accuracy_files", multiple=True, type=click.Path(exists=True, dir_okay=False))
@click.option("--accuracy-model", default="smollm2-135m", show_default=True, help="The rd records' model to show.")
@click.option("--device", default=None)
@click.option("--note", default="")
@click.option("--out", "out_path", default=None)
def run_command(
    prep_dir,
    target,
    methods,
    target_ratios,
    tokens_list,
    bandwidths,
    repeat,
    max_transfer_s,
    busy_seconds,
    busy_queued,
    pack,
    accuracy_files,
    accuracy_model,
    device,
    note,
    out_path,
) -> None:  # noqa: ANN001
    """Time full prefill and every method's reuse through the engine at every link."""
    import torch

    from kvbench.ttft import load_accuracy

    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    meths = expand_methods([m.strip() for m in methods.split(",") if m.strip()], _floats(target_ratios))
    spec = RunSpec(
        tuple(int(t) for t in tokens_list.split(",")),
        tuple(_floats(bandwidths)),
        repeat,
        max_transfer_s,
        device,
        busy_seconds,
        tuple(_queue_depths(busy_queued)),
    )
    if any(n % CHUNK for n in spec.tokens):
        raise click.ClickException(f"--tokens must be multiples of {CHUNK}")
    t0 = time.perf_counter()
    inputs, rows = run(pathlib.Path(prep_dir), meths, spec, target, pathlib.Path(pack) if pack else None)
    label = ("gpu" if device.startswith("cuda") else "cpu") + "-engine"
    rec = {
        "benchmark": "ttft",
        "mode": "through the engine",
        "command": command_line("ttft-engine"),
        "machine": machine(),
        "device": device,
        "label": label,
        "time": utc_now(),
        "wall_s": round(time.perf_counter() - t0, 1),
        "methods": meths,
        "notes": notes(inputs.get("random_weights", True), note),
        "inputs": inputs,
        "accuracy": load_accuracy(tuple(accuracy_files)).get(accuracy_model, {}),
        "rows": with_raw_bound(rows),
    }
    md = markdown(rec)
    path = write_result(result_path(out_path, f"ttft-{label}"), rec, md)
    click.echo("\n".join(md))
    click.echo(f"wrote {path}", err=True)


@command.command("report")
@click.argument("result", type=click.Path(exists=True, dir_okay=False))
@click.option("--note", default=None, help="Replace the record's notes' run note (text after the standard notes).")
def report_command(result, note) -> None:  # noqa: ANN001
    """Rewrite a run's markdown (and derived rows) from its JSON, e.g. after the report changed."""
    path = pathlib.Path(result)
    rec = json.loads(path.read_text())
    rec["rows"] = with_raw_bound(rec["rows"])
    if note is not None:
        rec["notes"] = notes(rec.get("inputs", {}).get("random_weights", True), note)
    md = markdown(rec)
    write_result(str(path), rec, md)
    click.echo("\n".join(md))


NOTES = (
    "TTFT = Engine.generate's arrival -> first token, one request at a time, fetch deadline off; the prefix KV "
    "restored by PrefixCache.fetch (defaults, policy fixed:0) through a token-bucket link from an in-memory store; "
    "{weights}; the stored chunks code real KV values tiled into its shape, the "
    "prep's seed chunks relocated to every position (raw: random fp16). Points marked modelled: see the module."
)


def notes(random_weights: bool, note: str | None) -> str:
    """The record's notes: the standard ones, saying whether the model's weights were random, then the run's note."""
    weights = "the model has random weights (timing only)" if random_weights else "the model has its real weights"
    return NOTES.format(weights=weights) + (f" {note}" if note else "")


def _floats(text: str) -> list[float]:
    return [float(x) for x in text.split(",") if x.strip()]


def _queue_depths(text: str) -> list[int]:
    try:
        depths = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        depths = []
    if not depths or min(depths) < 1:
        raise click.BadParameter(
            f"{text!r}: queue depths are integers >= 1, comma-separated", param_hint="--busy-queued"
        )
    return depths
