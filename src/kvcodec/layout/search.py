"""Pick a tile layout per frame resolution by trial encodes on a calibration sample."""

from __future__ import annotations

import logging
import threading

import torch

from kvcodec.layout.tiling import LayoutPlan, candidate_plans, frame_blocks, pack_frame

log = logging.getLogger(__name__)

MAX_CANDIDATES = 6
CALIBRATION_TOKENS = 128

VIDEO_BITS_CANDIDATES = (3, 4, 5, 6, 8)

_cache: dict[tuple, LayoutPlan] = {}
_bits_cache: dict[tuple, int] = {}
_lock = threading.Lock()


def shortlist(width: int, height: int, units: int, dim: int, chunk_tokens: int) -> list[LayoutPlan]:
    """Candidates worth a trial: the best-filled plans first, both orientations represented."""
    plans = candidate_plans(width, height, units, dim, chunk_tokens)
    plans.sort(key=lambda p: (-round(p.fill, 2), -p.tokens_per_frame))
    picked: list[LayoutPlan] = []
    for orientation in ("token_major", "channel_major"):
        picked += [p for p in plans if p.orientation == orientation][: MAX_CANDIDATES // 2]
    return picked or plans[:MAX_CANDIDATES]


def trial_bytes(plan: LayoutPlan, units_tokens_dim: torch.Tensor, encoder) -> int:
    frames = [pack_frame(block, plan).numpy() for _, _, block in frame_blocks(units_tokens_dim, plan)]
    return len(encoder.encode(frames, plan.width, plan.height))


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
    cache_key = (key, resolution, units, dim, chunk_tokens, search)
    with _lock:
        if cache_key in _cache:
            return _cache[cache_key]
    candidates = shortlist(width, height, units, dim, chunk_tokens)
    if not search or len(candidates) == 1:
        best = candidates[0]
    else:
        sample = units_tokens_dim[:, :CALIBRATION_TOKENS]
        scored = [(trial_bytes(p, sample, encoder) / sample.shape[1], p) for p in candidates]
        scored.sort(key=lambda sp: sp[0])
        best = scored[0][1]
        log.info(
            "layout %dx%d: %s",
            width,
            height,
            ", ".join(f"{p.orientation}/{p.tile_w}x{p.tile_h}/{p.tokens_per_frame}tpf={b:.0f}B/tok" for b, p in scored),
        )
    with _lock:
        _cache[cache_key] = best
    return best


def choose_video_bits(
    resolution: tuple[int, int],
    units_tokens_dim: torch.Tensor,
    unit_bits: torch.Tensor,
    chunk_tokens: int,
    encoder,
    key: tuple | None = None,
) -> int:
    """How many top bits of each sample to code as video: the candidate whose video stream plus
    raw low bit planes is smallest on the calibration sample (first layout candidate). Cached
    under `key` for the process."""
    from kvcodec.quant import bitsplit

    width, height = resolution
    units, tokens, dim = units_tokens_dim.shape
    cache_key = (key, resolution, units, dim, chunk_tokens)
    with _lock:
        if cache_key in _bits_cache:
            return _bits_cache[cache_key]
    plan = shortlist(width, height, units, dim, chunk_tokens)[0]
    sample = units_tokens_dim[:, :CALIBRATION_TOKENS]
    most = int(unit_bits.max())
    scored = []
    for video_bits in sorted({min(b, most) for b in VIDEO_BITS_CANDIDATES}):
        counts = bitsplit.low_bit_counts(unit_bits, video_bits)
        high, _ = bitsplit.split(sample, counts)
        low_bytes = int(counts.sum()) * sample.shape[1] * dim / 8
        scored.append((trial_bytes(plan, high, encoder) + low_bytes, video_bits))
    best = min(scored)[1]
    log.info("video bits: %s -> %d", ", ".join(f"{b}={s / sample.shape[1]:.0f}B/tok" for s, b in scored), best)
    with _lock:
        _bits_cache[cache_key] = best
    return best
