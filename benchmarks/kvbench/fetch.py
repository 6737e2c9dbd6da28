"""`kvcodec bench fetch`: time to restore a stored prefix of real KV over a shaped link.

The prefix is stored with one method (kvbench.methods: "kvcodec", kvcodec's HEVC codec at --quant, by
default; "kvcodec-transform-5" with --transform MODEL.kvt, ...) and as raw fp16 KV. For each link rate
(and a jitter trace) and each policy (each of the codec's resolutions fixed, adaptive where it has several,
and raw fp16 KV through the same store and pipeline), fetch the prefix from a real redis-server with
PrefixCache's defaults (what `serve` gets; --max-inflight and --decode-workers change them) and record:
fetch_s, bytes, stage busy times, a per-chunk timeline, and

    bound_s = max(bytes / bandwidth, decode_s) + min(bytes / bandwidth, decode_s) / chunks

(the slower stage for the whole prefix, plus one chunk of the other stage to fill/drain the
pipeline: the least a two-stage pipeline of equal chunks can take), time_over_bound = fetch_s /
bound_s. decode_s is the chunks' summed decode-busy time in that run over the decode workers, bandwidth
the nominal (mean) rate. Zstd-coded transform chunks on CUDA decompress on the host threads, not on the
decode workers, and their busy time counts from the blob's arrival: for them decode_s and bound_s are rough.

A grouped KV file (`kvcodec extract` of a sliding-window or MLA model: one tensor per layer group) is stored
and fetched with GroupedPrefixCache, raw fp16 and coded alike (the method's codec on every group; a
kvcodec-transform method needs the model's grouped .kvt). Every group must hold every position from 0 (extract
records sliding layers whole). Its records' fp16_bytes count every group's values; kv_shape lists each group's
shape (kv_groups their names). A GroupedPrefixCache plans an adaptive policy with a neutral decode-time prior
(no decode profile is calibrated, as in `serve`).

Link: "tc-netns" (redis-server in a network namespace behind a veth pair shaped by tc tbf) when
permitted, else "token-bucket" (an in-process shaper around a loopback redis-server). Each record
says which. Results: benchmarks/results/fetch-<machine>-<time>.json and .md.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import tempfile
import time
from pathlib import Path

import click

from kvbench.results import RESULTS_DIR, command_line, machine, write_result
from kvbench.transform_options import kvt_option
from kvcodec.cli.options import check_device
from kvcodec.errors import KVCodecError

log = logging.getLogger(__name__)


def _load_kv(model: str, kv_path: str | None, text: str, tokens: int):
    """(token_ids, kv fp16, source, the model the KV is of (None: a file that does not say)) from a KV file (a
    plain "kv" [+ "token_ids"], or a grouped file: a GroupedKV) or a real model prefill (cached as safetensors
    in the cache dir)."""
    import torch
    from safetensors.torch import save_file

    from kvcodec.fetcher.profile import cache_dir

    given = kv_path is not None
    if not given:
        from kvbench.workloads import model_tag, text_tag

        cached = cache_dir() / "bench-kv" / f"{model_tag(model)}-{text_tag(text)}-{tokens}.safetensors"
        if not cached.exists():
            from kvcodec.integrations.hf import extract_kv
            from kvcodec.models.registry import load_model
            from kvcodec.models.texts import load_text

            t = time.perf_counter()
            m, tok = load_model(model)
            ids, kv = extract_kv(m, tok, load_text(text, max_chars=tokens * 8), max_tokens=tokens)
            log.info("prefill of %d tokens took %.1fs", ids.numel(), time.perf_counter() - t)
            cached.parent.mkdir(parents=True, exist_ok=True)
            save_file({"kv": kv.to(torch.float16).contiguous(), "token_ids": ids.contiguous()}, str(cached))
        kv_path = str(cached)
        source = f"{model} prefill of text {text!r}"
    else:
        source = f"file {Path(kv_path).name}"
    kv, ids, meta = _read_kv_file(kv_path)
    kv = grouped_prefix(kv, tokens) if is_grouped(kv) else kv.to(torch.float16)[:, :, :tokens].contiguous()
    n = kv_tokens(kv)
    ids = ids[:n] if ids is not None else torch.arange(n)
    return ids, kv, source, meta.get("model") if given else model


def _read_kv_file(path: str):  # noqa: ANN202
    """(the `kv` tensor, its "token_ids" or None, metadata) of a plain KV file; (a GroupedKV, None, metadata) of
    a grouped one; the file read once."""
    from kvcodec.kvspec.files import load_kv_file

    kv, meta = load_kv_file(path)
    return kv, None if is_grouped(kv) else _token_ids(path), meta


def _token_ids(path: str):  # noqa: ANN202 - a tensor or None
    """The file's "token_ids" tensor, where it holds one."""
    from safetensors import safe_open

    with safe_open(path, "pt") as f:
        names = f.keys()  # a safe_open handle cannot be searched itself
        return f.get_tensor("token_ids") if "token_ids" in names else None


# ---- the two kinds of KV a run measures: one (layers, 2, tokens, heads, dim) tensor, or a GroupedKV
# (sliding-window / MLA models: one tensor per layer group, positions on axis 2, every group from 0)


def is_grouped(kv) -> bool:  # noqa: ANN001
    """Whether `kv` is a GroupedKV (a KV file of several layer groups) rather than one KV tensor."""
    from kvcodec.kvspec import GroupedKV

    return isinstance(kv, GroupedKV)


def kv_tensors(kv) -> tuple:  # noqa: ANN001
    return kv.tensors if is_grouped(kv) else (kv,)


def kv_tokens(kv) -> int:  # noqa: ANN001
    return kv.stop if is_grouped(kv) else kv.shape[2]


def fp16_bytes(kv) -> int:  # noqa: ANN001
    return 2 * sum(t.numel() for t in kv_tensors(kv))


def kv_shape(kv) -> list:  # noqa: ANN001
    """A record's kv_shape: the tensor's shape; of a GroupedKV, each group's (in kv.spec.groups' order)."""
    return [list(t.shape) for t in kv.tensors] if is_grouped(kv) else list(kv.shape)


def kv_groups(kv) -> list[str] | None:  # noqa: ANN001
    """A record's kv_groups: the names of a GroupedKV's groups, in kv_shape's order; None for one KV tensor."""
    return [g.name for g in kv.spec.groups] if is_grouped(kv) else None


def kv_text(shape: list, groups: list[str] | None) -> str:
    """kv_shape (with kv_groups) as a line shows it."""
    if groups is None:
        return str(tuple(shape))
    return ", ".join(f"{name} {tuple(s)}" for name, s in zip(groups, shape))


def prefix_cache(kv, store, model: str, codec, device: str, **options):  # noqa: ANN001, ANN003, ANN201
    """A PrefixCache storing and fetching KV like `kv`: a GroupedPrefixCache of its KVSpec for a GroupedKV."""
    if is_grouped(kv):
        from kvcodec.fetcher.grouped import GroupedPrefixCache

        return GroupedPrefixCache(store, model, codec, device, spec=kv.spec, **options)
    from kvcodec.fetcher import PrefixCache

    return PrefixCache(store, model, codec, device, **options)


def fetch_target(kv, device: str):  # noqa: ANN001, ANN201
    """Uninitialized storage like `kv` on `device` that a fetch of all of its tokens restores into."""
    import torch

    if is_grouped(kv):
        return type(kv).empty(kv.spec, kv.stop, device=device, window=False)
    return torch.empty(kv.shape, dtype=kv.dtype, device=device)


def bit_exact(restored, kv) -> bool:  # noqa: ANN001
    import torch

    return all(torch.equal(a.cpu(), b) for a, b in zip(kv_tensors(restored), kv_tensors(kv), strict=True))


def grouped_prefix(kv, tokens: int):  # noqa: ANN001, ANN201 - a GroupedKV
    """The first `tokens` positions of a GroupedKV (all of them where it holds fewer) as fp16; a usage error
    where a group does not hold them from 0 (a sliding group recorded as a cache holds it: its last positions)."""
    import torch

    from kvcodec.kvspec import GroupedKV

    if max(kv.starts) > 0:
        held = ", ".join(f"{g.name} from {s}" for g, s in zip(kv.spec.groups, kv.starts) if s > 0)
        raise click.BadParameter(
            f"the file's sliding-window groups hold only their last positions ({held}, of {kv.stop}): the store "
            "keeps only chunks every group holds whole, so no prefix from position 0 can be fetched; give a KV file "
            "with every position of every group (kvcodec extract records sliding layers whole)",
            param_hint="--kv",
        )
    n = min(tokens, kv.stop)
    tensors = tuple(t[:, :, :n].to(torch.float16).contiguous() for t in kv.tensors)
    return GroupedKV(dataclasses.replace(kv.spec, dtype="float16"), n, kv.starts, tensors)


class _Link:
    """The shaped path to a redis-server: tc-netns or token-bucket, with a uniform interface."""

    def __init__(self, kind: str, tmp: Path, store: str = "redis") -> None:
        from kvbench.net.redis_server import RedisServer

        self.kind = kind
        self.netns = None
        self.server = None
        if store == "memory":  # in-process store behind the token bucket: no server, no client cap
            from kvcodec.store import open_store

            self.base = open_store(f"memory://bench-fetch-{id(self)}")
            self.store = self.base
            self.describe = {"link": kind, "rate": "unshaped", "store": "memory"}
            return
        if kind == "tc-netns":
            from kvbench.net.netns import NetnsLink

            self.netns = NetnsLink(100.0).open()
            self.server = RedisServer(
                tmp / "redis", bind=self.netns.ns_ip, netns=self.netns.name, appendonly=False
            ).start()
        else:
            self.server = RedisServer(tmp / "redis", appendonly=False).start()
        from kvcodec.store import open_store

        self.base = open_store(self.server.url, socket_timeout=30.0, socket_read_size=1 << 20)
        self.store = self.base
        self.describe: dict = {"link": kind, "rate": "unshaped"}

    def shape(self, trace) -> None:
        from kvbench.net.throttle import ThrottledStore

        if self.netns is not None:
            if len(trace.segments) == 1:
                self.netns.set_rate(trace.segments[0][1])
            else:
                self.netns.play(trace)
            self.store = self.base
            self.describe = self.netns.describe()
        else:
            self.store = ThrottledStore(self.base, jitter_trace=trace)
            self.describe = self.store.link.describe()

    def unshape(self) -> None:
        if self.netns is not None:
            self.netns.set_rate(100.0)
        self.store = self.base

    def close(self) -> None:
        self.base.close()
        if self.server is not None:
            self.server.kill()
        if self.netns is not None:
            self.netns.close()


def _goodput(store, key: str, nbytes: int, repeats: int = 3) -> float:
    best = float("inf")
    for _ in range(repeats):
        t = time.perf_counter()
        store.get(key)
        best = min(best, time.perf_counter() - t)
    return nbytes * 8 / best / 1e9


@click.command("fetch")
@click.option("--model", default="smollm2-135m", show_default=True, help="Registry model whose prefill KV is fetched.")
@click.option(
    "--kv",
    "kv_path",
    default=None,
    help="Use a saved safetensors KV ('kv' [+ 'token_ids'], or a grouped file of `kvcodec extract`) instead.",
)
@click.option("--text", default="pg", show_default=True, help="Text (kvcodec.models.texts name) to prefill.")
@click.option("--tokens", "prefix_tokens", type=click.IntRange(min=1), default=1024, show_default=True)
@click.option("--chunk-tokens", type=click.IntRange(min=1), default=256, show_default=True)
@click.option("--quant", default="int8", show_default=True, help="The quant of the method 'kvcodec'.")
@click.option(
    "--method",
    default="kvcodec",
    show_default=True,
    help="How the prefix is stored (kvbench.methods): kvcodec (the HEVC codec at --quant), kvcodec-<quant>, "
    "kvcodec-transform-<ratio>[-<coder>] (with --transform), or a baseline's name.",
)
@kvt_option
@click.option(
    "--resolutions",
    default=None,
    help="Frame sizes, e.g. 256x256,512x512,1024x1024 (several: the adaptive policy picks one per chunk). "
    "Default: the method's own (what a user gets).",
)
@click.option(
    "--rates",
    default="1,2,4,8,16,25,40",
    show_default=True,
    callback=lambda c, p, v: _rates(v),
    help="Link rates, Gbit/s.",
)
@click.option("--jitter-mean", default=4.0, show_default=True, help="Mean Gbit/s of the jitter trace (0: none).")
@click.option("--jitter-cv", type=click.FloatRange(min=0), default=0.6, show_default=True)
@click.option("--jitter-segment-ms", default=50.0, show_default=True)
@click.option(
    "--policies",
    default=None,
    help="Comma-separated, e.g. fixed:0,adaptive,raw-fp16. Default: fixed:<j> for each resolution, adaptive "
    "where there are several, raw-fp16.",
)
@click.option(
    "--link", "link_kind", type=click.Choice(["auto", "tc-netns", "token-bucket"]), default="auto", show_default=True
)
@click.option("--repeats", type=click.IntRange(min=1), default=3, show_default=True)
@click.option("--device", default="cpu", show_default=True, callback=check_device)
@click.option(
    "--max-inflight",
    type=click.IntRange(min=1),
    default=None,
    help="Chunks in flight per fetch (default: PrefixCache's).",
)
@click.option(
    "--decode-workers",
    type=click.IntRange(min=1),
    default=None,
    help="Decoders per fetch (default: PrefixCache's; with --nvdec-pool or --nvdec-threads their count, as serve does).",
)
@click.option(
    "--net-workers",
    type=click.IntRange(min=1),
    default=None,
    help="Concurrent gets per fetch (default: PrefixCache's).",
)
@click.option(
    "--torch-threads",
    default=1,
    show_default=True,
    help="torch intra-op threads on the CPU (0: leave torch's default). More than 1 on a "
    "small shared CPU makes decode several times slower.",
)
@click.option(
    "--store",
    "store_kind",
    type=click.Choice(["redis", "memory"]),
    default="redis",
    show_default=True,
    help="redis: a real redis-server process; memory: an in-process store (token-bucket link only; "
    "for machines without redis-server, and rates a single Redis client cannot reach).",
)
@click.option(
    "--nvdec-pool",
    "pool_workers",
    default=0,
    show_default=True,
    help="On CUDA: restore in an NVDEC pool of this many worker processes (kvcodec.video.nvdec_pool."
    "HevcCodec(pool=...); use --decode-workers of the same number). 0: the codec's own decoder.",
)
@click.option(
    "--nvdec-threads",
    "thread_sessions",
    default=0,
    show_default=True,
    help="On CUDA: restore on this many NVDEC sessions on threads of this process, in its own CUDA context "
    "(kvcodec.video.nvcuvid_threads; use --decode-workers of the same number). 0: not used.",
)
@click.option(
    "--streams-per-chunk",
    default=1,
    show_default=True,
    help="CodecConfig.streams_per_chunk: each chunk as this many HEVC streams (layer ranges), restored in "
    "parallel by a pool or threads.",
)
@click.option(
    "--nvdec-gbit",
    default=0.0,
    show_default=True,
    help="Measured NVDEC restore rate in coded Gbit/s (e.g. from `kvcodec bench decode`): records then carry "
    "target_bound_s = max(bytes / link, bytes / this rate) and fetch_s over it. 0: not computed.",
)
@click.option("--out-dir", default=str(RESULTS_DIR), show_default="benchmarks/results")
def command(**options) -> None:  # noqa: ANN003
    """Time restoring a stored prefix over a shaped link: each resolution policy vs raw fp16 KV."""
    import torch

    s = Settings(**options)
    if s.torch_threads > 0:
        torch.set_num_threads(s.torch_threads)
    link_kind = resolve_link_kind(s.store_kind, s.link_kind)
    if s.pool_workers > 0 and s.thread_sessions > 0:
        raise click.BadParameter("give --nvdec-pool or --nvdec-threads, not both")
    codec = method_codec_for(s)  # a bad method, .kvt or policy is refused before any KV is made
    if (s.pool_workers > 0 or s.thread_sessions > 0) and not is_hevc_method(s.method):
        raise click.BadParameter(f"--nvdec-pool and --nvdec-threads restore the HEVC codec, not {s.method!r}")
    check_policies(s.policy_list(len(codec.resolutions)), codec.resolutions)
    ids, kv, source, kv_model = _load_kv(s.model, s.kv_path, s.text, s.prefix_tokens)
    click.echo(f"KV {kv_text(kv_shape(kv), kv_groups(kv))} from {source}; link {link_kind}", err=True)
    check_fits(codec, kv, kv_model, f"{source}'s model" if s.kv_path else "the model prefilled")
    pool = None
    if s.pool_workers > 0:
        from kvcodec.video.nvdec_pool import NvdecPool

        frames = codec.resolutions
        pool = NvdecPool(workers=s.pool_workers, device=s.device, max_frame=max(frames, key=lambda r: r[0] * r[1]))
    elif s.thread_sessions > 0:
        from kvcodec.codecs.hevc.pool import open_threads

        pool = open_threads(s.thread_sessions, device=s.device)
    if pool is not None:
        codec = method_codec_for(s, pool=pool)
    try:
        with tempfile.TemporaryDirectory(prefix="kvc-bench-") as tmp:
            link = _Link(link_kind, Path(tmp), s.store_kind)
            try:
                run = FetchRun(s, link, ids, kv, codec)
                records = [rec for trace in traces(s) for rec in run.under(trace)]
            finally:
                link.close()
    finally:
        if pool is not None:
            pool.close()
    doc = {
        "benchmark": "fetch",
        "command": command_line("fetch"),
        "kv_source": source,
        "kv_shape": kv_shape(kv),
        "kv_groups": kv_groups(kv),
        "method": s.method,
        "codec": run.coded.codec.id,
        "transform": str(s.transform) if s.transform else None,
        "codec_config": codec.config.to_dict() if is_hevc_method(s.method) else None,
        "encode_s": run.encode_s,
        "bytes_per_resolution": dict(zip(["x".join(map(str, r)) for r in run.coded.codec.resolutions], run.sizes)),
        "decode_profile": run.profile.to_json() | {"source": run.profile.source} if run.profile else None,
        "machine": run.machine,
        "link": link_kind,
        "records": records,
    }
    host = "gpu" if "gpu" in run.machine else "cpu"
    stem = f"fetch-{host}-{time.strftime('%Y%m%d-%H%M%S', time.gmtime())}"
    path = write_result(Path(s.out_dir) / f"{stem}.json", doc, markdown(doc, host))
    click.echo(f"wrote {path} and .md", err=True)


@dataclasses.dataclass(frozen=True)
class Settings:
    """The command's options (see its --help)."""

    model: str
    kv_path: str | None
    text: str
    prefix_tokens: int
    chunk_tokens: int
    quant: str
    method: str
    transform: Path | None
    resolutions: str | None
    rates: str
    jitter_mean: float
    jitter_cv: float
    jitter_segment_ms: float
    policies: str | None
    link_kind: str
    repeats: int
    device: str
    max_inflight: int | None
    decode_workers: int | None
    net_workers: int | None
    torch_threads: int
    store_kind: str
    pool_workers: int
    thread_sessions: int
    streams_per_chunk: int
    nvdec_gbit: float
    out_dir: str

    @property
    def res(self) -> tuple[tuple[int, int], ...] | None:
        """--resolutions, None where not given (the method's own)."""
        if not self.resolutions:
            return None
        from kvcodec.config import video_frame_sizes

        try:
            return video_frame_sizes(self.resolutions)
        except (ValueError, KVCodecError) as e:
            raise click.BadParameter(str(e), param_hint="--resolutions") from e

    @property
    def config(self):  # noqa: ANN201
        from kvcodec.config import CodecConfig

        return CodecConfig(quant=self.quant, chunk_tokens=self.chunk_tokens, streams_per_chunk=self.streams_per_chunk)

    @property
    def workers(self) -> int | None:
        """--decode-workers; else, restoring in an NVDEC pool or thread sessions, their count (as `serve` does);
        else None (PrefixCache's default)."""
        return self.decode_workers or max(self.pool_workers, self.thread_sessions) or None

    def policy_list(self, resolutions: int) -> list[str]:
        """--policies, or each of `resolutions` fixed, adaptive where there are several, and raw-fp16."""
        if self.policies is not None:
            return [p for p in self.policies.split(",") if p]
        return [f"fixed:{j}" for j in range(resolutions)] + ["adaptive"] * (resolutions > 1) + ["raw-fp16"]


def check_policies(policies: list[str], resolutions) -> None:  # noqa: ANN001
    """A usage error for an empty list, or a policy the codec's frame sizes do not allow (fixed:1 with one)."""
    from kvcodec.fetcher.policy import get_policy

    if not policies:
        raise click.BadParameter("no policy to measure", param_hint="--policies")
    for p in policies:
        if p == "raw-fp16":
            continue
        try:
            get_policy(p, resolutions)
        except KVCodecError as e:
            raise click.BadParameter(f"{e} (--resolutions)", param_hint="--policies") from e


def is_hevc_method(method: str) -> bool:
    """Whether `method` stores with kvcodec's HEVC codec (the one NVDEC pools and thread sessions restore)."""
    from kvbench.methods import transform_ratio

    return (method == "kvcodec" or method.startswith("kvcodec-")) and transform_ratio(method) is None


def method_codec_for(s: Settings, **hevc_options):  # noqa: ANN003, ANN201 - a ChunkCodec
    """The chunk codec of --method (with --transform, --chunk-tokens, --resolutions); a usage error for a
    method this bench cannot store with, a file that is not a .kvt, or a grouped .kvt without --kv (a prefill
    gives one KV tensor)."""
    from kvbench.methods import method_codec, transform_ratio

    try:
        ratio = transform_ratio(s.method)
        if s.transform is not None and ratio is None:
            raise click.BadParameter(f"--transform codes the kvcodec-transform-<ratio> methods, not {s.method!r}")
        codec = method_codec(s.method, s.config, transform=s.transform, resolutions=s.res, **hevc_options)
    except (KVCodecError, ValueError) as e:
        raise click.BadParameter(str(e), param_hint="--method/--transform") from e
    if ratio is not None and getattr(codec, "cal", None) is None and s.kv_path is None:
        raise click.BadParameter(
            f"{s.transform} is a grouped .kvt (a model of several KV layer groups); the prefill of --model gives "
            "one KV tensor: give the grouped model's KV file as --kv",
            param_hint="--transform",
        )
    return codec


def check_fits(codec, kv, model: str | None, what: str = "the model prefilled") -> None:  # noqa: ANN001
    """A usage error where a transform's .kvt was made for another kind of KV than `kv` (one KV tensor, or
    layer groups) or for another shape (of a GroupedKV: a group the grouped .kvt has no transform of, or one
    of another shape); a warning where it was calibrated on another model than `model` (`what`: the one
    prefilled, or the one a KV file names; None: a file that names none)."""
    from kvcodec.codecs.grouped import GroupedCodec

    grouped_kvt = isinstance(codec, GroupedCodec)
    if getattr(codec, "cal", None) is None and not grouped_kvt:
        return
    from kvcodec.cli.transform_io import warn_if_other_model

    if grouped_kvt != is_grouped(kv):
        held, want = ("layer groups", "one KV tensor") if is_grouped(kv) else ("one KV tensor", "layer groups")
        raise click.BadParameter(
            f"the KV holds {held}; the .kvt is calibrated for {want}: give the .kvt of the KV's model",
            param_hint="--transform",
        )
    try:
        for cal, shape in _calibrations(codec, kv):
            cal.check_shape(shape)
    except KVCodecError as e:
        raise click.BadParameter(f"the KV does not fit the .kvt: {e}", param_hint="--transform") from e
    warn_if_other_model(codec, model, what)


def _calibrations(codec, kv) -> list:  # noqa: ANN001
    """(calibration, KV shape it codes) of each part of `kv`: the codec's own of the one tensor, or of each
    group the grouped .kvt's transform for it (a KVCodecError where it has none)."""
    if not is_grouped(kv):
        return [(codec.cal, tuple(kv.shape))]
    return [(codec.codec_for(g).cal, g.shape(kv.stop)) for g in kv.spec.groups]


def _rates(text: str) -> str:
    """--rates as given, once every item reads as a finite number of Gbit/s > 0 (a usage error otherwise)."""
    import math

    try:
        ok = all(math.isfinite(float(r)) and float(r) > 0 for r in text.split(",") if r.strip())
    except ValueError:
        ok = False
    if not ok or not text.strip(" ,"):
        raise click.BadParameter(
            f"{text!r}: comma-separated link rates in Gbit/s, each a number > 0", param_hint="--rates"
        )
    return text


def traces(s: Settings) -> list:
    """Constant-rate traces at each --rates, then the jitter trace (when --jitter-mean > 0)."""
    from kvbench.net.trace import JitterTrace

    out = [JitterTrace.constant(float(r)) for r in s.rates.split(",") if r]
    if s.jitter_mean > 0:
        n_seg = max(20, int(20.0 / (s.jitter_segment_ms / 1e3)) // 10)
        out.append(
            JitterTrace.random_walk(s.jitter_mean, cv=s.jitter_cv, segment_s=s.jitter_segment_ms / 1e3, n=n_seg, seed=1)
        )
    return out


def resolve_link_kind(store_kind: str, link_kind: str) -> str:
    if store_kind == "memory":
        if link_kind == "tc-netns":
            raise click.BadParameter("--store memory has no network path: use --link token-bucket")
        return "token-bucket"
    if link_kind == "auto":
        from kvbench.net.netns import NetnsLink

        ok, why = NetnsLink.available()
        if not ok:
            click.echo(f"tc-netns link unavailable ({why}); using the token bucket", err=True)
        return "tc-netns" if ok else "token-bucket"
    return link_kind


class FetchRun:
    """The prefix stored raw and (unless only raw-fp16 is measured) with kvcodec, then fetched
    under each trace and policy."""

    def __init__(self, s: Settings, link: _Link, ids, kv, coded) -> None:  # noqa: ANN001
        from kvcodec.codecs.registry import make_codec
        from kvcodec.fetcher.keys import blob_key

        self.s, self.link, self.ids, self.kv = s, link, ids, kv
        self.machine = machine()
        self.policies = s.policy_list(len(coded.resolutions))
        raw = make_codec("raw", chunk_tokens=s.chunk_tokens, resolutions=(coded.resolutions[0],))
        self.coded = prefix_cache(
            kv, link.base, s.model, coded, s.device, max_inflight=s.max_inflight, decode_workers=s.workers
        )
        self.raw = prefix_cache(
            kv,
            link.base,
            s.model,
            raw,
            s.device,
            max_inflight=s.max_inflight,
            decode_workers=s.workers,
            policy="fixed:0",
        )
        self.raw.put(ids, kv)
        self.encode_s, self.sizes, self.profile = None, [], None
        if any(p != "raw-fp16" for p in self.policies):
            t = time.perf_counter()
            self.coded.put(ids, kv)
            self.encode_s = time.perf_counter() - t
            self.profile = self.decode_profile()
            keys = self.coded.keys(ids)
            self.sizes = [
                sum(len(link.base.get(blob_key(k, j)) or b"") for k in keys) for j in range(len(coded.resolutions))
            ]
            speeds = [f"{v / 1e6:.1f}M/s" for v in self.profile.values_per_s()] if self.profile else "(neutral prior)"
            click.echo(
                f"encoded in {self.encode_s:.1f}s; bytes per resolution {self.sizes} (fp16 {fp16_bytes(kv)}); "
                f"decode profile {speeds}",
                err=True,
            )
        # link goodput probe: the largest object, per condition
        self.probe_key = blob_key(self.raw.keys(ids)[0], 0)
        self.probe_bytes = len(link.base.get(self.probe_key))

    def decode_profile(self):  # noqa: ANN201 - a DecodeProfile or None
        """The coded cache's decode-speed profile of KV of this shape (loaded or calibrated, as serve's); None
        for a GroupedKV: a GroupedPrefixCache plans with a neutral prior, never a calibration of one KV tensor."""
        if is_grouped(self.kv):
            return None
        L, _, _, H, D = self.kv.shape
        return self.coded.ensure_profile((L, H, D), self.kv.dtype)

    def under(self, trace) -> list[dict]:  # noqa: ANN001
        """One record per policy, the link shaped by `trace`."""
        self.link.shape(trace)
        try:
            goodput = _goodput(self.link.store, self.probe_key, self.probe_bytes)
            return [self.measure(trace, pol, goodput) for pol in self.policies]
        finally:
            self.link.unshape()

    def timed_fetches(self, pc, pol: str, trace) -> list[tuple[float, object]]:  # noqa: ANN001
        """(seconds, result) of --repeats fetches after one warm-up (the bandwidth estimator learns
        the link), fastest first."""
        T = kv_tokens(self.kv)
        pc.fetch(self.ids, T)
        runs = []
        for _ in range(self.s.repeats):
            out = fetch_target(self.kv, self.s.device)
            t = time.perf_counter()
            r = pc.fetch(self.ids, T, out=out)
            dt = time.perf_counter() - t
            if r.error is not None:
                raise click.ClickException(f"fetch failed under {pol} at {trace.name}: {r.error}")
            runs.append((dt, r))
        return sorted(runs, key=lambda x: x[0])

    def measure(self, trace, pol: str, goodput: float) -> dict:  # noqa: ANN001
        import torch

        s, is_raw = self.s, pol == "raw-fp16"
        base = self.raw if is_raw else self.coded
        pc = prefix_cache(
            self.kv,
            self.link.store,
            s.model,
            base.codec,
            s.device,
            policy="fixed:0" if is_raw else pol,
            max_inflight=s.max_inflight,
            decode_workers=s.workers,
            net_workers=s.net_workers,
            profile=None if is_raw else self.profile,
        )
        runs = self.timed_fetches(pc, pol, trace)
        fetch_s, med = runs[len(runs) // 2]
        st = med.stats
        bw = trace.mean_gbit
        net_s = st.bytes_fetched * 8 / (bw * 1e9)
        dec_s = st.decode_busy_s / pc.decode_workers
        bound = max(net_s, dec_s) + min(net_s, dec_s) / max(1, st.chunks_restored)
        rec = {
            "bandwidth_gbit": bw,
            "trace": trace.name,
            "prefix_tokens": kv_tokens(self.kv),
            "tokens_restored": med.tokens_restored,
            "policy": pol,
            "fetch_s": fetch_s,
            "fetch_s_min": runs[0][0],
            "fetch_s_all": [x[0] for x in runs],
            "bound_s": bound,
            "time_over_bound": fetch_s / bound,
            "bytes": st.bytes_fetched,
            "fp16_bytes": fp16_bytes(self.kv),
            "net_s_at_nominal_rate": net_s,
            "decode_s": dec_s,
            "link_goodput_gbit": goodput,
            "link": self.link.describe["link"],
            "link_detail": self.link.describe,
            "resolution_counts": st.resolution_counts,
            "stats": {k: v for k, v in st.to_dict().items() if k != "timeline"},
            "timeline": [vars(t) for t in st.timeline],
            "bit_exact": bit_exact(med.kv, self.kv) if is_raw else None,
            "machine": self.machine,
            "load_avg_1m": os.getloadavg()[0],
            "torch_threads": torch.get_num_threads(),
            "device": s.device,
            "method": "raw" if is_raw else s.method,
            "codec": pc.codec.id,
            "net_workers": pc.net_workers,
            "decode_workers": pc.decode_workers,
            "max_inflight": pc.max_inflight,
            "store": s.store_kind,
            "nvdec_pool_workers": s.pool_workers,
            "nvdec_threads": s.thread_sessions,
            "cuda_contexts": s.pool_workers + 1 if s.pool_workers else 1,
            "streams_per_chunk": 1 if is_raw else s.streams_per_chunk,
        }
        if s.nvdec_gbit > 0 and not is_raw:
            rec["target_bound_s"] = max(net_s, st.bytes_fetched * 8 / (s.nvdec_gbit * 1e9))
            rec["time_over_target_bound"] = fetch_s / rec["target_bound_s"]
        click.echo(
            f"{trace.name:>36} {pol:>10}: {fetch_s * 1e3:8.1f} ms  bound {bound * 1e3:8.1f} ms"
            f"  x{fetch_s / bound:5.2f}  {st.bytes_fetched / 1e6:6.2f} MB  {st.resolution_counts}",
            err=True,
        )
        return rec


def markdown(doc: dict, host: str) -> list[str]:
    kv = kv_text(doc["kv_shape"], doc.get("kv_groups"))
    lines = [
        f"# fetch benchmark ({host}, link {doc['link']})",
        "",
        f"`{doc['command']}`",
        "",
        f"KV {kv} fp16 from {doc['kv_source']}; machine {doc['machine']['cpu']}",
        "",
        f"method {doc['method']}: codec `{doc['codec']}`" + (f", .kvt {doc['transform']}" if doc["transform"] else ""),
        "",
        "vs raw fp16 = raw fp16's fetch time over this one's (above 1: faster than raw fp16 KV fetched through the "
        "same link in this run); bound = bytes at the link's rate.",
        "",
        "| rate Gbit/s | trace | policy | fetch ms | vs raw fp16 | bound ms | x bound | MB | resolutions "
        "| link goodput Gbit/s |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    raw = {(r["bandwidth_gbit"], r["trace"]): r["fetch_s"] for r in doc["records"] if r["policy"] == "raw-fp16"}
    for r in doc["records"]:
        base = raw.get((r["bandwidth_gbit"], r["trace"]))
        speed = f"{base / r['fetch_s']:.2f}x" if base and r["fetch_s"] and r["policy"] != "raw-fp16" else "-"
        lines.append(
            f"| {r['bandwidth_gbit']:g} | {r['trace']} | {r['policy']} | {r['fetch_s'] * 1e3:.1f} | {speed} | "
            f"{r['bound_s'] * 1e3:.1f} | {r['time_over_bound']:.2f} | {r['bytes'] / 1e6:.2f} | "
            f"{r['resolution_counts']} | {r['link_goodput_gbit']:.2f} |"
        )
    target = [r for r in doc["records"] if "target_bound_s" in r]
    if target:
        lines += ["", "target bound = max(bytes / link, bytes / the given NVDEC rate):", ""]
        lines += ["| rate Gbit/s | policy | fetch ms | target bound ms | x target bound |", "|---|---|---|---|---|"]
        for r in target:
            lines.append(
                f"| {r['bandwidth_gbit']:g} | {r['policy']} | {r['fetch_s'] * 1e3:.1f} | "
                f"{r['target_bound_s'] * 1e3:.1f} | {r['time_over_target_bound']:.2f} |"
            )
    return lines
