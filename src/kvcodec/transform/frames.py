"""Coefficient samples <-> video frames. Samples (coordinates, tokens) are laid out
coordinate-major (each coordinate's tokens in a run, coordinates ordered from widest to
narrowest so that runs of similar width sit together) and fill 4:4:4 frames row by row; the
tail of the last frame is padded with the zero sample (128)."""

from __future__ import annotations

import torch

from kvcodec.errors import ConfigError, CorruptStreamError

PAD = 128


def frame_count(samples: int, width: int, height: int) -> int:
    return max(1, -(-samples // (3 * width * height)))


def to_frames(samples: torch.Tensor, width: int, height: int) -> list[torch.Tensor]:
    """uint8 samples (any shape, read in order) -> frames (3, height, width) uint8."""
    if width < 16 or height < 16:
        raise ConfigError(f"frames must be at least 16x16; got {width}x{height}")
    flat = samples.reshape(-1)
    per = 3 * width * height
    n = frame_count(flat.numel(), width, height)
    padded = torch.full((n * per,), PAD, dtype=torch.uint8, device=flat.device)
    padded[: flat.numel()] = flat
    return list(padded.view(n, 3, height, width).unbind(0))


def from_frames(frames, count: int, width: int, height: int, device) -> torch.Tensor:
    """The first `count` samples of a sequence of (3, height, width) frames, as a flat uint8
    tensor on `device` (each frame is copied as it arrives: decoders may reuse their surfaces)."""
    per = 3 * width * height
    n = frame_count(count, width, height)
    out = torch.empty(n * per, dtype=torch.uint8, device=device)
    got = 0
    for frame in frames:
        if got >= n:
            raise CorruptStreamError(f"video stream has more than the {n} frames announced")
        if tuple(frame.shape) != (3, height, width):
            raise CorruptStreamError(f"decoded frame is {tuple(frame.shape)}, expected (3, {height}, {width})")
        out[got * per : (got + 1) * per].copy_(frame.reshape(-1), non_blocking=True)
        got += 1
    if got != n:
        raise CorruptStreamError(f"video stream decoded to {got} frames, expected {n}")
    return out[:count]


# Frames a chunk's samples take at least, where frames can shrink: more frames are more pieces a short
# fetch can spread over NVDEC engines (one video chunk takes an engine ~3.8 ms on Qwen2.5's KV), but
# NVDEC's map runs a conversion kernel on the SMs per frame (at 512x512, two frames a chunk, a busy
# GPU's matmul lost 6.9-7.1% beside a fetch against 3.3-4.4%: fetch-h200-s43-frame-size). 1 (frames as
# large as the codec's resolution) until that trade is measured on the H200; fetch_restore's case
# option frames=N codes with another.
MIN_FRAMES = 1
MIN_SIDE = 256  # frames shrink no further (NVDEC decodes HEVC from 144x144; per-frame work grows as they shrink)


def frame_size(samples: int, largest: tuple[int, int], min_frames: int | None = None) -> tuple[int, int]:
    """The frame size for chunks of `samples` samples: `largest`, its longer side halved (the height
    on a tie) while a chunk would take fewer than `min_frames` (default MIN_FRAMES) frames and the
    halved side stays even and at least MIN_SIDE. Each frame of a chunk is coded as a picture that
    decodes alone, so a chunk of several frames can be decoded on several NVDEC engines at once. Pure."""
    w, h = largest
    min_frames = MIN_FRAMES if min_frames is None else min_frames

    def halves(side: int) -> bool:
        return side // 2 >= MIN_SIDE and side % 4 == 0

    while frame_count(samples, w, h) < min_frames:
        if halves(h) and (h >= w or not halves(w)):
            h //= 2
        elif halves(w):
            w //= 2
        else:
            break
    return w, h
