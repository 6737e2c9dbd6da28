"""What a fetch reports: its result, its counters and each chunk's path through the pipeline."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from kvcodec.errors import KVCodecError
from kvcodec.restore.paged import PagedKV


@dataclasses.dataclass
class ChunkTiming:
    """One chunk's path through the pipeline; times in seconds since the fetch started."""

    index: int
    resolution: int
    nbytes: int
    tokens: int
    net_start: float = 0.0
    net_end: float = 0.0
    queued: float = 0.0  # handed to the decode stage (the network stage's queue)
    dec_start: float = 0.0
    submitted: float = 0.0  # a driven fetch: its video pushed to a session's feeder
    dec_end: float = 0.0
    restore_start: float = 0.0
    restore_end: float = 0.0
    bw_estimate_gbit: float = 0.0
    predicted_decode_s: float = 0.0
    worker: str = ""  # the decode thread's name (where a chunk's decode ran)


@dataclasses.dataclass
class FetchStats:
    policy: str = ""
    codec: str = ""  # the codec's id
    decoder: str = ""  # the decoder that ran (e.g. "ffmpeg-cpu" on a CUDA device without NVDEC)
    chunks_planned: int = 0
    chunks_restored: int = 0
    chunks_dropped: int = 0  # chunks failing a check whose meta is deleted (the next put rewrites them)
    chunks_staged: int = 0  # chunks restored into a staging tensor and copied into the target
    bytes_fetched: int = 0
    meta_s: float = 0.0
    wall_s: float = 0.0
    net_busy_s: float = 0.0
    decode_busy_s: float = 0.0
    restore_busy_s: float = 0.0
    max_inflight: int = 0
    peak_inflight: int = 0
    bandwidth_estimate_gbit: float = 0.0
    latency_estimate_s: float = 0.0
    resolution_counts: dict[str, int] = dataclasses.field(default_factory=dict)
    timeline: list[ChunkTiming] = dataclasses.field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclasses.dataclass
class FetchResult:
    """kv: the target (the caller's `out`, or a tensor (layers, 2, n_tokens, kv_heads, head_dim)
    allocated on the cache's device); only its first `tokens_restored` tokens hold restored
    values (None if nothing could be planned and no `out` was given). error: why the fetch
    stopped before n_tokens (None on full success)."""

    kv: torch.Tensor | PagedKV | None
    tokens_restored: int
    error: KVCodecError | None
    stats: FetchStats

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def timeline(self) -> list[ChunkTiming]:
        return self.stats.timeline
