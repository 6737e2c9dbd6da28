"""Pick a tile layout per frame resolution by trial encodes on a calibration sample.

Decisions are per model shape, not per chunk: each is made once (on the first chunk that needs
it) and kept for the process and on disk (`$KVCODEC_CACHE_DIR/coding-plans.json`, default
`~/.cache/kvcodec`), keyed by everything the trial depends on (shape, quantization, resolution,
the encoder's bitstream settings), so later processes encoding KV of the same model pay no trial
encodes. `KVCODEC_PLAN_CACHE=0` keeps decisions in memory only.
"""

from __future__ import annotations

import json
import logging
import os
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from kvcodec.atomic import replacing
from kvcodec.errors import ConfigError
from kvcodec.layout.tiling import LayoutPlan, candidate_plans, frame_blocks, pack_frame

log = logging.getLogger(__name__)

MAX_CANDIDATES = 6
CALIBRATION_TOKENS = 128

VIDEO_BITS_CANDIDATES = (3, 4, 5, 6, 8)

PLANS_FILE = "coding-plans.json"
PLANS_VERSION = 2  # bump when a trial's method changes: older decisions are then ignored

_cache: dict[tuple, LayoutPlan] = {}
_bits_cache: dict[tuple, tuple[str, int]] = {}
_lock = threading.Lock()
_disk: dict[str, object] | None = None
_deciding: dict[str, threading.Lock] = {}


def plans_file() -> Path | None:
    """Where decisions are kept between processes (None: in memory only)."""
    if os.environ.get("KVCODEC_PLAN_CACHE", "1").lower() in ("0", "off", "false", "no"):
        return None
    d = os.environ.get("KVCODEC_CACHE_DIR")
    return (Path(d) if d else Path.home() / ".cache" / "kvcodec") / PLANS_FILE


def encoder_settings(encoder) -> str:
    """What an encoder's bitstream (and so a trial's outcome) depends on."""
    return str(getattr(encoder, "settings", None) or getattr(encoder, "name", type(encoder).__name__))


def _disk_key(kind: str, cache_key: tuple) -> str:
    return json.dumps([kind, PLANS_VERSION, repr(cache_key)])


def _read_disk() -> dict[str, object]:
    path = plans_file()
    if path is None or not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text())
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError) as e:
        log.warning("ignoring unreadable coding-plan cache %s: %s", path, e)
        return {}


def _disk_get(key: str) -> object | None:
    global _disk
    with _lock:
        if _disk is None:
            _disk = _read_disk()
        return _disk.get(key)


def _disk_put(key: str, value: object) -> None:
    """Record a decision (merged with what other processes wrote meanwhile; best effort)."""
    global _disk
    path = plans_file()
    with _lock:
        _disk = {**(_disk or {}), key: value}
        if path is None:
            return
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            merged = {**_read_disk(), key: value}
            with replacing(path) as tmp, open(tmp, "w") as f:
                json.dump(merged, f, indent=0, sort_keys=True)
        except OSError as e:
            log.warning("could not write the coding-plan cache %s: %s", path, e)


def recall(kind: str, key: tuple, encoder) -> object | None:
    """A decision of `kind` made before for `key` with this encoder's settings (this process or,
    through the plan cache file, another one: the file is read again on a miss, so a decision
    another process wrote since is seen); None when there is none."""
    key_ = _disk_key(kind, (*key, encoder_settings(encoder)))
    found = _disk_get(key_)
    if found is None and plans_file() is not None:
        global _disk
        with _lock:
            _disk = {**(_disk or {}), **_read_disk()}
            found = _disk.get(key_)
    return found


def once(kind: str, key: tuple, encoder) -> threading.Lock:
    """A lock held while a decision of `kind` for `key` is made: threads of this process that
    need the same decision wait for the first one's instead of each deciding on its own chunk."""
    with _lock:
        return _deciding.setdefault(_disk_key(kind, (*key, encoder_settings(encoder))), threading.Lock())


def remember(kind: str, key: tuple, encoder, value: object) -> None:
    """Keep a decision (JSON-serializable) for `recall`."""
    _disk_put(_disk_key(kind, (*key, encoder_settings(encoder))), value)


def shortlist(width: int, height: int, units: int, dim: int, chunk_tokens: int) -> list[LayoutPlan]:
    """Candidates worth a trial: the best-filled plans first, both orientations represented."""
    plans = candidate_plans(width, height, units, dim, chunk_tokens)
    plans.sort(key=lambda p: (-round(p.fill, 2), -p.tokens_per_frame))
    picked: list[LayoutPlan] = []
    for orientation in ("token_major", "channel_major"):
        picked += [p for p in plans if p.orientation == orientation][: MAX_CANDIDATES // 2]
    return picked or plans[:MAX_CANDIDATES]


def trial_bytes(plan: LayoutPlan, units_tokens_dim: torch.Tensor, encoder) -> int:
    frames = [pack_frame(block, plan).cpu().numpy() for _, _, block in frame_blocks(units_tokens_dim, plan)]
    return len(encoder.encode(frames, plan.width, plan.height))


def usable_cores() -> int:
    """The cores this process may run on (its CPU affinity where the OS has one), at least 1."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # pragma: no cover - platforms without affinity
        return max(1, os.cpu_count() or 1)


def encode_workers() -> int:
    """Encodes run at once (chunks, trials): the cores this process may use
    ($KVCODEC_ENCODE_WORKERS overrides)."""
    env = os.environ.get("KVCODEC_ENCODE_WORKERS")
    if env:
        try:
            workers = int(env)
        except ValueError:
            workers = 0
        if workers < 1:
            raise ConfigError(f"KVCODEC_ENCODE_WORKERS must be an integer >= 1; got {env!r}")
        return workers
    return usable_cores()


def _trials(jobs: list[tuple[LayoutPlan, torch.Tensor]], encoder) -> list[int]:
    """trial_bytes of each (plan, sample), in parallel over the cores where the encoder can make
    single-threaded copies of itself (the sizes do not depend on it)."""
    workers = min(encode_workers(), len(jobs)) if callable(getattr(encoder, "with_threads", None)) else 1
    if workers <= 1:
        return [trial_bytes(p, x, encoder) for p, x in jobs]
    one = encoder.with_threads(1)
    with ThreadPoolExecutor(max_workers=workers, thread_name_prefix="kvcodec-trial") as pool:
        return list(pool.map(lambda job: trial_bytes(job[0], job[1], one), jobs))


def choose_plan(
    resolution: tuple[int, int],
    units_tokens_dim: torch.Tensor,
    chunk_tokens: int,
    encoder,
    key: tuple | None = None,
    search: bool = True,
) -> LayoutPlan:
    """The candidate layout that codes `units_tokens_dim` (units x tokens x dim uint8, the
    calibration sample) in the fewest bytes per token. Cached under `key` for the process."""
    width, height = resolution
    units, tokens, dim = units_tokens_dim.shape
    cache_key = (key, resolution, units, dim, chunk_tokens, search, encoder_settings(encoder))
    with _lock:
        if cache_key in _cache:
            return _cache[cache_key]
    candidates = shortlist(width, height, units, dim, chunk_tokens)
    disk_key = _disk_key("layout", cache_key)
    stored = _disk_get(disk_key) if search and len(candidates) > 1 else None
    if isinstance(stored, dict) and LayoutPlan.from_dict(stored) in candidates:
        best = LayoutPlan.from_dict(stored)
    elif not search or len(candidates) == 1:
        best = candidates[0]
    else:
        sample = units_tokens_dim[:, :CALIBRATION_TOKENS]
        sizes = _trials([(p, sample) for p in candidates], encoder)
        scored = [(b / sample.shape[1], p) for b, p in zip(sizes, candidates)]
        scored.sort(key=lambda sp: sp[0])
        best = scored[0][1]
        log.info(
            "layout %dx%d: %s",
            width,
            height,
            ", ".join(f"{p.orientation}/{p.tile_w}x{p.tile_h}/{p.tokens_per_frame}tpf={b:.0f}B/tok" for b, p in scored),
        )
        _disk_put(disk_key, best.to_dict())
    with _lock:
        _cache[cache_key] = best
    return best


def choose_sample_coding(
    resolution: tuple[int, int],
    units_tokens_dim: torch.Tensor,
    unit_bits: torch.Tensor,
    chunk_tokens: int,
    encoder,
    key: tuple | None = None,
    video_bits: tuple[int, ...] = VIDEO_BITS_CANDIDATES,
    zstd_bytes: Callable[[torch.Tensor], int] | None = None,
) -> tuple[str, int]:
    """(coder, video bits) that code the calibration sample in the fewest bytes: "hevc" with the
    top b bits of each sample in the video and the rest as raw low bit planes, for each b of
    `video_bits` (first layout candidate); with `zstd_bytes` (the zstd-coded size of a sample
    tensor), also "zstd": every bit zstd-coded, restored on the host's cores instead of NVDEC
    (the top max(video_bits) bits and raw planes when every candidate splits). Cached under `key`
    for the process and on disk."""
    from kvcodec.quant import bitsplit

    width, height = resolution
    units, tokens, dim = units_tokens_dim.shape
    coders = ("hevc", "zstd") if zstd_bytes is not None else ("hevc",)
    cache_key = (key, resolution, units, dim, chunk_tokens, encoder_settings(encoder), video_bits, coders)
    with _lock:
        if cache_key in _bits_cache:
            return _bits_cache[cache_key]
    disk_key = _disk_key("sample_coding", cache_key)
    stored = _disk_get(disk_key)
    if isinstance(stored, list) and len(stored) == 2 and stored[0] in coders and stored[1] in video_bits:
        return _keep(cache_key, (str(stored[0]), int(stored[1])))
    plan = shortlist(width, height, units, dim, chunk_tokens)[0]
    sample = units_tokens_dim[:, :CALIBRATION_TOKENS]
    most = int(unit_bits.max())
    candidates = sorted({min(b, most) for b in video_bits})
    counts = [bitsplit.low_bit_counts(unit_bits, b) for b in candidates]
    splits = [bitsplit.split(sample, c)[0] for c in counts]
    sizes = _trials([(plan, top) for top in splits], encoder)
    low_bytes = [int(c.sum()) * sample.shape[1] * dim / 8 for c in counts]
    scored = [(v + low, "hevc", b) for v, low, b in zip(sizes, low_bytes, candidates)]
    if zstd_bytes is not None:
        scored.append((zstd_bytes(splits[-1]) + low_bytes[-1], "zstd", candidates[-1]))
    _, coder, bits = min(scored)
    log.info(
        "sample coding: %s -> %s %d",
        ", ".join(f"{c} {b}={s / sample.shape[1]:.0f}B/tok" for s, c, b in scored),
        coder,
        bits,
    )
    _disk_put(disk_key, [coder, bits])
    return _keep(cache_key, (coder, bits))


def _keep(cache_key: tuple, decision: tuple[str, int]) -> tuple[str, int]:
    with _lock:
        _bits_cache[cache_key] = decision
    return decision
