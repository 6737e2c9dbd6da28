"""Prometheus metrics of one engine (its own registry, so several engines can live in a process)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

_LAT_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
_GAP_BUCKETS = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.25, 0.5, 1.0)
_TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)


class EngineMetrics:
    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.ttft = Histogram("kvcodec_ttft_seconds", "Time to first token", buckets=_LAT_BUCKETS, registry=r)
        self.tpot = Histogram(
            "kvcodec_tpot_seconds", "Time per output token after the first", buckets=_TPOT_BUCKETS, registry=r
        )
        self.fetch_seconds = Histogram(
            "kvcodec_fetch_seconds", "Prefix KV fetch time (lookup excluded)", buckets=_LAT_BUCKETS, registry=r
        )
        self.restored_to_prefill = Histogram(
            "kvcodec_restored_to_prefill_seconds",
            "From a request's prefix KV restored to its suffix prefill starting",
            buckets=_GAP_BUCKETS,
            registry=r,
        )
        self.prefill_to_first_token = Histogram(
            "kvcodec_prefill_to_first_token_seconds",
            "From a request's (suffix) prefill starting to its first token",
            buckets=_LAT_BUCKETS,
            registry=r,
        )
        self.requests = Counter("kvcodec_requests", "Finished requests", ["finish_reason"], registry=r)
        self.reuse_hits = Counter("kvcodec_reuse_hits", "Requests that found a stored prefix", registry=r)
        self.reuse_misses = Counter("kvcodec_reuse_misses", "Requests that found no stored prefix", registry=r)
        self.fetch_fallbacks = Counter(
            "kvcodec_fetch_fallbacks", "Fetches that failed or stopped early (rest recomputed)", registry=r
        )
        self.bytes_fetched = Counter("kvcodec_fetch_bytes", "Bytes of stored KV fetched", registry=r)
        self.restored_tokens = Counter("kvcodec_restored_tokens", "Prompt tokens restored from the store", registry=r)
        self.prefill_tokens = Counter("kvcodec_prefill_tokens", "Prompt tokens computed by prefill", registry=r)
        self.generated_tokens = Counter("kvcodec_generated_tokens", "Output tokens generated", registry=r)
        self.stored_chunks = Counter("kvcodec_stored_chunks", "KV chunks encoded and written to the store", registry=r)
        self.store_errors = Counter("kvcodec_store_errors", "Background KV stores that failed", registry=r)
        self.stores_dropped = Counter(
            "kvcodec_stores_dropped",
            "KV stores dropped because the store backlog was full (a new one, or a waiting one for a more valuable one)",
            registry=r,
        )
        self.stores_skipped = Counter(
            "kvcodec_stores_skipped", "Prompts not stored: no prefix seen by StorePolicy.min_seen prompts", registry=r
        )
        self.stored_prefixes = Counter("kvcodec_stored_prefixes", "Prompt prefixes encoded and stored", registry=r)
        self.stored_tokens = Counter("kvcodec_stored_tokens", "Prompt tokens of KV encoded and stored", registry=r)
        self.store_lag = Histogram(
            "kvcodec_store_lag_seconds",
            "From a prefill to its prefix KV in the store",
            buckets=_LAT_BUCKETS,
            registry=r,
        )
        self.store_backlog = Gauge("kvcodec_store_backlog", "KV stores waiting for or in the encoder", registry=r)
        self.store_backlog_tokens = Gauge(
            "kvcodec_store_backlog_tokens", "Prompt tokens of the KV stores waiting for the encoder", registry=r
        )
        self.store_encode_processes = Gauge(
            "kvcodec_store_encode_processes",
            "Worker processes encoding stored KV (0: stores are encoded on threads of this process)",
            registry=r,
        )
        self.queue = Gauge("kvcodec_requests_in_state", "Requests per scheduler state", ["state"], registry=r)

    def render(self) -> bytes:
        return generate_latest(self.registry)
