"""EngineConfig: every setting of an Engine in one frozen dataclass.

Engine("smollm2-135m", max_batch=4, store_url="file:///srv/kv")   # keyword arguments = fields
Engine(model, EngineConfig(max_batch=4))                           # or one config object
"""

from __future__ import annotations

import dataclasses
from typing import Any

from kvcodec.engine.storer import StorePolicy
from kvcodec.errors import ConfigError

POLICIES = ("fetch-aware", "blocking")
AUTO = "auto"
SDPA_BACKENDS = ("flash", "efficient", "math", "cudnn")


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """How an Engine runs, stores and reuses KV.

    store_url: KV store (file://, memory://, redis://, throttle://); None: in-process memory://.
    codec: the ChunkCodec of stored KV: an object (e.g. HevcCodec(config, pool=pool), RawCodec())
        or a registered name ("hevc", "raw", ...); None: HevcCodec. codec_config: a
        kvcodec.CodecConfig the codec is configured with (default int8 for HevcCodec).
    resolution_policy: which stored resolution a fetch reads ("adaptive", "fixed:0", ...).
    decode_workers: decode threads of a fetch; None (default): the fetcher's default for the
        device (on CUDA one per NVDEC engine, each its own session in this process's CUDA context:
        7 on an H100/H200; 1 on the CPU). store_partial: also store a last partial chunk.
    reuse: look up and fetch stored prefixes. store_policy: what is stored after prefills, and
        how: storing is background work, encoded in worker processes (store_policy.encode_in;
        threads of this process where the store URL cannot be opened by another, e.g. memory://)
        by store_policy.encode_workers threads in all (default: the cores less a quarter) at
        store_policy.nice lower OS priority (default 10) than the engine.
    policy: "fetch-aware" (a fetching request never blocks others) or "blocking" (for comparison).
    max_batch: most requests in the running batch.
    max_prefill_tokens: prompt tokens admitted per iteration (soft; one request always fits), and
        the most prefilled in one iteration while no request is decoding: a prompt up to this long
        then goes through the model in one forward. Larger pieces cost more memory (one forward's
        activations), smaller ones more time: a piece after the first attends to the cache through
        a dense [piece, cache] mask, which rules out the causal kernels (flash on CUDA, the CPU's
        causal block skipping) and makes attention cover the whole rectangle: a 32k prompt in 8k
        pieces took 2.6x one forward on the H200 (benchmarks/results/ttft-h200-engine.md), an 8k
        one in 2k pieces ~1.3-1.4x on a CPU (engine-prefill-cpu-tiny.md, probes/engine_gap.py).
    prefill_chunk_tokens: while other requests are decoding, a prompt is prefilled at most this
        many tokens per iteration, so a long prompt never stalls the running batch for its whole
        prefill (with nothing else running, up to max_prefill_tokens go in one forward). Each piece
        costs an iteration (a decode step of the others) and, after the first, a masked forward: at
        512 a small model's 2k-token prompt takes 4 iterations, and on the H200, where its prefill
        is launch-bound, runs whose prompts overlapped got their first tokens in ~150 ms against
        ~33 ms (serve-store-h200-pairs.md; attributed, not measured per request). 2048 takes such a
        prompt in one, at the price of a longer step for the decoding requests while it does.
    min_reuse_tokens: shorter stored prefixes are recomputed instead of fetched.
    fetch_deadline_s: "auto" (default): a fetch may take as long as recomputing its prefix would,
        from the measured prefill rate; a number: that many seconds; None: no deadline. It counts
        from the request's arrival: the prefix lookup (bounded by the whole prompt's recompute time) and
        time queued for a fetch worker are spent from it.
    fetch_workers: concurrent fetches.
    store_queue: most prompt KVs waiting for the background encoder (besides one in each encode
        process); past it new stores are dropped (logged and counted), so queued cache slices
        never grow without bound.
    max_context: longest prompt + output in tokens; None: the model's max_position_embeddings.
    stall_s: /health reports a stalled engine after this long without a finished iteration or
        prefill piece while work is pending (while a prefill forward runs, 4x its time predicted
        from the measured prefill rate more).
    batch_decode: one forward for the whole running batch per decode step.
    sdpa_backends: the torch scaled-dot-product attention kernels the model may use, in
        SDPA_BACKENDS names; None: torch's own choice. The default leaves out cuDNN, which plans
        anew for every new (query, key) length pair, and serving meets a new pair with nearly
        every request's suffix and decode step (H200, SmolLM2's shape, 8k restored tokens: the
        first request's suffix forward 0.67 s with cuDNN vs 0.06 s without, later new-length
        suffixes 66-89 ms vs 43-49 ms to the first token, decode steps 56-65 ms vs 25-40 ms;
        benchmarks/results/ttft-gpu-h200-latency.md).
    device, dtype: where and in which dtype the model runs (default: cuda if present; fp32 on
        CPU, fp16 on CUDA).
    freeze_gc: at its start the engine collects once and freezes the objects alive then out of the
        garbage collector's full collections (engine/gcfreeze.py, as vLLM's engine does), which walk
        them all with every fetch and decode thread paused (119-136 ms for SmolLM2 on the CPU VM);
        the close of any engine that froze unfreezes them (engines still open run unfrozen until the
        next start); an application that froze objects itself before the first engine is left to
        manage the collector.
    store_writable: False for a store that refuses writes (a read-only replica): a fetch leaves the
        damaged chunks it finds in place instead of deleting their metas, which would fail
        (PrefixCache.drop_damaged). An engine that stores nothing but may write (`serve --no-store`)
        keeps it True: the deleted meta lets the next writer's put (an ingest's, a peer's) rewrite the chunk.
    """

    store_url: str | None = None
    codec_config: Any = None
    codec: Any = None
    resolution_policy: str = "adaptive"
    decode_workers: int | None = None
    store_partial: bool = True
    reuse: bool = True
    store_policy: StorePolicy = StorePolicy()
    policy: str = "fetch-aware"
    max_batch: int = 8
    max_prefill_tokens: int = 65536
    prefill_chunk_tokens: int = 2048
    min_reuse_tokens: int = 1
    fetch_deadline_s: float | str | None = AUTO
    fetch_workers: int = 2
    store_queue: int = 4
    max_context: int | None = None
    stall_s: float = 60.0
    batch_decode: bool = True
    sdpa_backends: tuple[str, ...] | None = ("flash", "efficient", "math")
    device: Any = None
    dtype: Any = None
    freeze_gc: bool = True
    store_writable: bool = True

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ConfigError(f"scheduler policy must be one of {POLICIES}; got {self.policy!r}")
        for name in (
            "max_batch",
            "max_prefill_tokens",
            "prefill_chunk_tokens",
            "fetch_workers",
            "store_queue",
            "decode_workers",
        ):
            if getattr(self, name) is None and name == "decode_workers":
                continue
            if int(getattr(self, name)) < 1:
                raise ConfigError(f"{name} must be >= 1; got {getattr(self, name)}")
        d = self.fetch_deadline_s
        if not (d is None or d == AUTO or (isinstance(d, (int, float)) and d > 0)):
            raise ConfigError(f"fetch_deadline_s must be 'auto', None or a positive number; got {d!r}")
        if self.max_context is not None and self.max_context < 2:
            raise ConfigError(f"max_context must be >= 2; got {self.max_context}")
        if self.sdpa_backends is not None and (
            not self.sdpa_backends or not set(self.sdpa_backends) <= set(SDPA_BACKENDS)
        ):
            raise ConfigError(f"sdpa_backends must be None or names from {SDPA_BACKENDS}; got {self.sdpa_backends!r}")
        if self.stall_s <= 0:
            raise ConfigError(f"stall_s must be > 0; got {self.stall_s}")
        if not isinstance(self.store_policy, StorePolicy):
            raise ConfigError(
                f"store_policy must be a StorePolicy (StorePolicy(enabled=False): store nothing); got {self.store_policy!r}"
            )

    @classmethod
    def from_kwargs(cls, config: EngineConfig | None = None, **kwargs: Any) -> EngineConfig:
        """`config` (or the defaults) with `kwargs` replacing fields; unknown names are an error."""
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(kwargs) - names)
        if unknown:
            raise ConfigError(f"unknown engine option(s) {unknown}; EngineConfig has {sorted(names)}")
        base = config if config is not None else cls()
        return dataclasses.replace(base, **kwargs) if kwargs else base
