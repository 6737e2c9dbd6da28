"""Decode-speed profiles: how long a chunk takes to decode at each resolution on this device.

Model per resolution j: seconds = overhead_s[j] + values * seconds_per_value[j], where `values` is
the number of KV values in the chunk (layers * 2 * tokens * kv_heads * head_dim). A quick
calibration times the decode of one stored chunk at every resolution (PrefixCache hands it the
blobs of the fetch's first chunk: no encoder needed where the cache serves), or of a synthetic
chunk encoded here. A calibration that fails is remembered for the process and not retried. Profiles are cached as JSON in the cache dir
(``$KVCODEC_CACHE_DIR`` or ``~/.cache/kvcodec``), keyed by device model and codec id (which covers its configuration),
and refined online from the decode times the fetcher observes.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import platform
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from kvcodec.atomic import replacing
from kvcodec.codecs.base import ChunkCodec
from kvcodec.errors import KVCodecError

log = logging.getLogger(__name__)

PROFILE_FILE = "decode-profiles.json"
PROFILE_VERSION = 3  # bump when calibration changes: old cached profiles are then ignored


class CalibrationError(KVCodecError):
    """The decode-speed calibration cannot run here (it failed before in this process)."""


def cache_dir() -> Path:
    d = os.environ.get("KVCODEC_CACHE_DIR")
    return Path(d) if d else Path.home() / ".cache" / "kvcodec"


def device_model(device: str | torch.device) -> str:
    """A name for the decoding hardware: GPU model, or CPU model and thread count."""
    dev = torch.device(device)
    if dev.type == "cuda":
        return "cuda:" + torch.cuda.get_device_name(dev.index or 0)
    name = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                name = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return f"cpu:{name} x{torch.get_num_threads()}"


@dataclasses.dataclass
class DecodeProfile:
    resolutions: tuple[tuple[int, int], ...]
    seconds_per_value: list[float]
    overhead_s: list[float]
    source: str = "default"  # "calibrated", "cache", "default"
    alpha: float = 0.2
    _lock: threading.Lock = dataclasses.field(default_factory=threading.Lock, repr=False, compare=False)

    @classmethod
    def default(cls, resolutions, values_per_s: float = 50e6) -> DecodeProfile:
        n = len(resolutions)
        return cls(tuple(tuple(r) for r in resolutions), [1.0 / values_per_s] * n, [0.0] * n, "default")

    def fits(self, resolutions) -> bool:  # noqa: ANN001
        """Whether this profile is of exactly these frame sizes (a codec's), in their order."""
        return self.resolutions == tuple(tuple(int(v) for v in r) for r in resolutions)

    def predict(self, r: int, values: int) -> float:
        return self.overhead_s[r] + values * self.seconds_per_value[r]

    def observe(self, r: int, values: int, seconds: float) -> None:
        """Fold an observed decode time into the per-value cost (EWMA)."""
        if values <= 0 or seconds <= 0:
            return
        spv = max(0.0, seconds - self.overhead_s[r]) / values
        with self._lock:
            self.seconds_per_value[r] += self.alpha * (spv - self.seconds_per_value[r])

    def values_per_s(self) -> list[float]:
        return [1.0 / s if s > 0 else float("inf") for s in self.seconds_per_value]

    def to_json(self) -> dict[str, Any]:
        return {
            "resolutions": [list(r) for r in self.resolutions],
            "seconds_per_value": list(self.seconds_per_value),
            "overhead_s": list(self.overhead_s),
        }

    @classmethod
    def from_json(cls, d: dict[str, Any], source: str = "cache") -> DecodeProfile:
        return cls(
            tuple(tuple(r) for r in d["resolutions"]),
            [float(x) for x in d["seconds_per_value"]],
            [float(x) for x in d["overhead_s"]],
            source,
        )


def _synthetic_kv(shape: tuple[int, int, int], tokens: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    L, H, D = shape
    g = torch.Generator().manual_seed(seed)
    scale = torch.rand((L, 2, 1, H, D), generator=g) * 2 + 0.1
    return (torch.randn((L, 2, tokens, H, D), generator=g) * scale).to(dtype)


def calibrate(
    codec: ChunkCodec,
    device: str | torch.device,
    shape: tuple[int, int, int],
    dtype: torch.dtype = torch.float16,
    repeats: int = 3,
    blobs: Sequence[bytes] | None = None,
) -> DecodeProfile:
    """Time the decode of one full chunk at every resolution of `codec` (best of `repeats` after a
    warm-up) into a target on `device`: `blobs` (one stored chunk, one blob per resolution: no
    encoder needed on the serving machine) or, without them, a synthetic chunk encoded here.
    Fetched chunks are full chunks except a prefix's tail, so the per-value cost of a full chunk is
    what the policy needs; the fixed cost is left at 0 (a two-size fit was tried and is unstable:
    a small chunk still costs whole frames)."""
    if blobs is None:
        blobs = codec.encode_chunks(_synthetic_kv(shape, int(codec.chunk_tokens), dtype))[0].blobs
    if len(blobs) != len(codec.resolutions):
        raise ValueError(f"{len(blobs)} blobs for {len(codec.resolutions)} resolutions")
    info = codec.inspect_chunk(blobs[0])
    out = torch.empty((info.layers, 2, info.tokens, info.kv_heads, info.head_dim), dtype=dtype, device=device)
    spv = []
    for blob in blobs:
        codec.decode_chunk(blob, out)  # warm-up (decoder init, caches)
        best = float("inf")
        for _ in range(max(1, repeats)):
            t = time.perf_counter()
            codec.decode_chunk(blob, out)
            if out.device.type == "cuda":
                torch.cuda.synchronize(out.device)
            best = min(best, time.perf_counter() - t)
        spv.append(best / out.numel())
    return DecodeProfile(tuple(codec.resolutions), spv, [0.0] * len(spv), "calibrated")


_FAILED: dict[str, str] = {}  # profile key -> why its calibration failed (this process never retries it)
_FAILED_LOCK = threading.Lock()


def profile_key(codec: ChunkCodec, device: str | torch.device, shape, dtype: torch.dtype) -> str:
    return "|".join(
        [
            f"v{PROFILE_VERSION}",
            device_model(device),
            codec.id,
            "x".join(map(str, shape)),
            str(dtype).replace("torch.", ""),
        ]
    )


def failed_calibration(key: str) -> str | None:
    """Why the calibration of profile `key` failed in this process (None: it has not)."""
    with _FAILED_LOCK:
        return _FAILED.get(key)


def load_or_calibrate(
    codec: ChunkCodec,
    device: str | torch.device,
    shape: tuple[int, int, int],
    dtype: torch.dtype = torch.float16,
    directory: Path | None = None,
    recalibrate: bool = False,
    blobs: Sequence[bytes] | Callable[[], Sequence[bytes] | None] | None = None,
) -> DecodeProfile:
    """The cached profile for (device model, codec id, shape), calibrating on a miss (on `blobs`,
    a stored chunk or a function that gets one, asked only on a miss; see calibrate). A calibration that fails raises, and is remembered:
    later calls for the same key raise CalibrationError at once instead of calibrating again."""
    directory = directory or cache_dir()
    path = directory / PROFILE_FILE
    key = profile_key(codec, device, shape, dtype)
    table: dict[str, Any] = {}
    try:
        table = json.loads(path.read_text())
    except (OSError, ValueError):
        table = {}
    if not recalibrate and isinstance(table, dict) and key in table:
        try:
            cached = DecodeProfile.from_json(table[key], "cache")
        except (KeyError, TypeError, ValueError):
            log.warning("ignoring malformed cached decode profile %s", key)
        else:  # a codec whose id does not name its frame sizes (a plugin's) may have others than the cached one
            if cached.fits(codec.resolutions):
                return cached
            log.info(
                "cached decode profile %s is of frame sizes %s, not the codec's: calibrating", key, cached.resolutions
            )
    why = failed_calibration(key)
    if why is not None and not recalibrate:
        raise CalibrationError(f"decode calibration failed earlier in this process: {why}")
    t = time.perf_counter()
    try:
        prof = calibrate(codec, device, shape, dtype, blobs=blobs() if callable(blobs) else blobs)
    except Exception as e:
        with _FAILED_LOCK:
            _FAILED[key] = f"{type(e).__name__}: {e}"
        raise
    log.info("decode profile calibrated in %.2fs: %s", time.perf_counter() - t, prof.values_per_s())
    table = table if isinstance(table, dict) else {}
    table[key] = prof.to_json()
    try:
        directory.mkdir(parents=True, exist_ok=True)
        with replacing(path) as tmp, open(tmp, "w") as f:
            f.write(json.dumps(table, indent=1))
    except OSError as e:
        log.warning("cannot cache decode profile in %s: %s", directory, e)
    return prof
