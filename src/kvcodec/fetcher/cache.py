"""PrefixCache: store, look up and fetch KV-cache prefixes chunk by chunk (the serving engine's API).

    cache = PrefixCache(open_store("redis://kv:6379/0"), "qwen2.5-coder-0.5b", CodecConfig(), "cuda")
    n = cache.lookup(token_ids)                     # tokens whose KV is stored (one batched query)
    res = cache.fetch(token_ids, n, out=kv_buffer, deadline_s=0.2)
    # res.kv[:, :, :res.tokens_restored] is restored; recompute the rest. res.error says why a
    # fetch stopped early (None when everything asked for was restored).
    cache.put(token_ids, kv)                        # after prefill: encode + store missing chunks

Fetch runs three overlapping stages with at most `max_inflight` chunks between the first and the
last (threads + bounded queues, so peak memory does not grow with the prefix):
    network get (policy picks the resolution per chunk) -> decode -> restore into `out`.
"""

from __future__ import annotations

import dataclasses
import importlib
import logging
import queue
import threading
import time
from typing import Any

import torch

from kvcodec.codec import DTYPES
from kvcodec.errors import ConfigError, FetchError, FormatError, KVCodecError, ShapeError, StoreError
from kvcodec.fetcher.bandwidth import BandwidthEstimator
from kvcodec.fetcher.keys import (
    ChunkMeta,
    as_token_array,
    blob_key,
    chunk_keys,
    codec_identity,
    config_fingerprint,
    longest_present,
    meta_key,
)
from kvcodec.fetcher.policy import ChoiceContext, ResolutionPolicy, get_policy
from kvcodec.fetcher.profile import DecodeProfile, load_or_calibrate

log = logging.getLogger(__name__)

_POLL_S = 0.02


@dataclasses.dataclass
class ChunkTiming:
    """One chunk's path through the pipeline; times in seconds since the fetch started."""

    index: int
    resolution: int
    nbytes: int
    tokens: int
    net_start: float = 0.0
    net_end: float = 0.0
    dec_start: float = 0.0
    dec_end: float = 0.0
    restore_start: float = 0.0
    restore_end: float = 0.0
    bw_estimate_gbit: float = 0.0
    predicted_decode_s: float = 0.0


@dataclasses.dataclass
class FetchStats:
    policy: str = ""
    chunks_planned: int = 0
    chunks_restored: int = 0
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
    """kv: the output tensor (layers, 2, n_tokens, kv_heads, head_dim); only
    ``kv[:, :, :tokens_restored]`` holds restored values (None if nothing could be planned and no
    `out` was given). error: why the fetch stopped before n_tokens (None on full success)."""

    kv: torch.Tensor | None
    tokens_restored: int
    error: KVCodecError | None
    stats: FetchStats

    @property
    def ok(self) -> bool:
        return self.error is None

    @property
    def timeline(self) -> list[ChunkTiming]:
        return self.stats.timeline


_NP_SAME = {torch.float16: torch.int16, torch.bfloat16: torch.int16, torch.float32: torch.int32}


def _copy_chunk(dst: torch.Tensor, src: torch.Tensor) -> None:
    """dst.copy_(src); CPU to CPU of one dtype through numpy (single-threaded): torch's intra-op
    threads make this small strided copy up to 1000x slower on an oversubscribed CPU."""
    if dst.device.type == "cpu" and src.device.type == "cpu" and dst.dtype == src.dtype and dst.dtype in _NP_SAME:
        import numpy as np

        iv = _NP_SAME[dst.dtype]
        np.copyto(dst.view(iv).numpy(), src.view(iv).numpy())
    else:
        dst.copy_(src)


def _default_codec():
    return importlib.import_module("kvcodec.codec")


class PrefixCache:
    """Stored KV prefixes of one model under one codec configuration.

    store: a KVStore, or a store URL for kvcodec.store.open_store.
    model_id: identity string of the model (part of every key: different models never collide).
    config: CodecConfig (its fingerprint is part of every key).
    device: where fetched KV is decoded and restored ("cpu", "cuda", "cuda:1").
    policy: resolution policy name or object ("adaptive", "fixed:J", "min-bytes", "min-decode").
    max_inflight: chunks between network get and restore at once (bounds peak memory).
    decode_workers: decode threads (results are restored in order).
    net_workers: concurrent gets (several connections; helps where one client stream cannot fill
        the link). The bandwidth estimator charges overlapping gets only their non-overlapped time.
    codec: module/object with encode_chunks, decode_chunk_blob, inspect_chunk_blob
        (default kvcodec.codec; kvcodec.fetcher.rawcodec.RawCodec() for the fp16 baseline).
    decoder: a video decoder handed to codec.decode_chunk_blob, shared by the decode workers
        (e.g. ``NvdecPool(workers=7).decoder()`` with ``decode_workers=7`` on a GPU); None: the
        codec picks the best one for `device`.
    profile: a DecodeProfile; None = calibrate (cached in the cache dir) on first adaptive fetch.
    initial_gbit: bandwidth prior until chunks have been received.
    store_partial: also store a last chunk shorter than chunk_tokens.
    direct: decode each chunk straight into its slice of the output tensor (the codec restores
        frame by frame; no staging tensor, no copy) when `out` is on `device` in the stored dtype.
        A fetch that stops early then waits for the decode workers to finish their current chunk
        before returning, so nothing writes into `out` after `fetch` returns. Default: decode into
        a per-chunk staging tensor and copy (returns at once on a deadline).
    """

    def __init__(
        self,
        store: Any,
        model_id: str,
        config: Any,
        device: str | torch.device = "cpu",
        *,
        policy: str | ResolutionPolicy = "adaptive",
        max_inflight: int = 4,
        decode_workers: int = 1,
        net_workers: int = 1,
        codec: Any = None,
        decoder: Any = None,
        profile: DecodeProfile | None = None,
        initial_gbit: float = 8.0,
        bandwidth_alpha: float = 0.3,
        store_partial: bool = True,
        direct: bool = False,
    ) -> None:
        if max_inflight < 1 or decode_workers < 1:
            raise ConfigError("max_inflight and decode_workers must be >= 1")
        if isinstance(store, str):
            from kvcodec.store import open_store

            store = open_store(store)
        self.store = store
        self.model_id = str(model_id)
        self.config = config
        self.device = torch.device(device)
        self.codec = codec if codec is not None else _default_codec()
        self.decoder = decoder
        self.policy = get_policy(policy, config.resolutions)
        self.max_inflight = int(max_inflight)
        self.decode_workers = int(decode_workers)
        self.net_workers = max(1, min(int(net_workers), self.max_inflight))
        self.profile = profile
        self.bandwidth = BandwidthEstimator(initial_gbit, bandwidth_alpha)
        self.store_partial = store_partial
        self.direct = bool(direct)
        self.codec_id = codec_identity(self.codec)
        self.fingerprint = config_fingerprint(config, self.codec)

    # -- keys --------------------------------------------------------------------------------
    def keys(self, token_ids: Any) -> list[str]:
        return chunk_keys(token_ids, self.model_id, self.config, partial=self.store_partial,
                          fingerprint=self.fingerprint)

    # -- lookup ------------------------------------------------------------------------------
    def lookup(self, token_ids: Any) -> int:
        """Number of leading tokens of `token_ids` whose KV is stored (0 if none), found with one
        batched existence query. Raises StoreError if the store cannot be asked."""
        ids = as_token_array(token_ids)
        keys = self.keys(ids)
        if not keys:
            return 0
        n = longest_present(self.store.exists_many([meta_key(k) for k in keys]))
        return min(len(ids), n * int(self.config.chunk_tokens))

    # -- put ---------------------------------------------------------------------------------
    def put(self, token_ids: Any, kv: torch.Tensor) -> int:
        """Encode and store the chunks of `kv` (its token axis aligned with `token_ids`) that are
        not stored yet; returns how many chunks were written. Idempotent: a second call writes 0.
        Each chunk's blobs are written before its meta object, the commit marker."""
        ids = as_token_array(token_ids)
        if kv.dim() != 5 or kv.shape[1] != 2:
            raise ShapeError(f"KV must be (layers, 2, tokens, kv_heads, head_dim); got {tuple(kv.shape)}")
        T = kv.shape[2]
        if T > len(ids):
            raise ShapeError(f"KV holds {T} tokens but only {len(ids)} token ids were given")
        ids = ids[:T]
        keys = self.keys(ids)
        if not keys:
            return 0
        present = self.store.exists_many([meta_key(k) for k in keys])
        missing = [i for i, p in enumerate(present) if not p]
        ct = int(self.config.chunk_tokens)
        L, _, _, H, D = kv.shape
        written = 0
        # encode contiguous runs of missing chunks
        runs: list[list[int]] = []
        for i in missing:
            if runs and runs[-1][-1] == i - 1:
                runs[-1].append(i)
            else:
                runs.append([i])
        for run in runs:
            a, b = run[0] * ct, min(T, (run[-1] + 1) * ct)
            chunks = self.codec.encode_chunks(kv[:, :, a:b], self.config, first_chunk_index=run[0])
            for c in chunks:
                k = keys[c.index]
                self.store.put_many({blob_key(k, j): blob for j, blob in enumerate(c.blobs)})
                meta = ChunkMeta(
                    index=c.index, start_token=c.start_token, tokens=c.tokens, shape=(L, H, D),
                    dtype=str(kv.dtype).replace("torch.", ""),
                    resolutions=tuple(tuple(r) for r in self.config.resolutions),
                    sizes=tuple(len(bl) for bl in c.blobs), codec=self.codec_id,
                )
                self.store.put(meta_key(k), meta.to_bytes())
                written += 1
        return written

    # -- profile -----------------------------------------------------------------------------
    def ensure_profile(self, shape: tuple[int, int, int], dtype: torch.dtype = torch.float16) -> DecodeProfile:
        """Load (or calibrate and cache) the decode-speed profile for KV of `shape` (L, H, D)."""
        if self.profile is None:
            self.profile = load_or_calibrate(self.codec, self.config, self.device, tuple(shape), dtype)
        return self.profile

    # -- fetch -------------------------------------------------------------------------------
    def fetch(
        self,
        token_ids: Any,
        n_tokens: int | None = None,
        out: torch.Tensor | None = None,
        deadline_s: float | None = None,
        *,
        policy: str | ResolutionPolicy | None = None,
    ) -> FetchResult:
        """Restore the KV of the first `n_tokens` tokens of `token_ids` (default: all of them).

        out: optional preallocated (layers, 2, >= n_tokens, kv_heads, head_dim) tensor on any
            device/dtype; restored values are written to ``out[:, :, :n]``. Without it a tensor of
            the stored dtype on `device` is allocated.
        deadline_s: time budget in seconds from the call; when it runs out the fetch stops.
        Never raises for store, format or deadline failures: it stops at the first chunk that
        cannot be restored in order and returns what was restored with `error` set (the error is
        also logged). Invalid arguments (bad `out` shape) raise ShapeError/ConfigError.
        """
        t0 = time.monotonic()
        pol = get_policy(policy, self.config.resolutions) if policy is not None else self.policy
        stats = FetchStats(policy=pol.name, max_inflight=self.max_inflight)
        ids = as_token_array(token_ids)
        n_tokens = len(ids) if n_tokens is None else int(n_tokens)
        if n_tokens < 0 or n_tokens > len(ids):
            raise ConfigError(f"n_tokens={n_tokens} outside 0..{len(ids)}")

        def result(kv, restored, error):
            stats.wall_s = time.monotonic() - t0
            stats.bandwidth_estimate_gbit = self.bandwidth.gbit
            stats.latency_estimate_s = self.bandwidth.latency_s
            if error is not None:
                log.warning("fetch stopped after %d of %d tokens: %s: %s", restored, n_tokens,
                            type(error).__name__, error)
            return FetchResult(kv, restored, error, stats)

        if n_tokens == 0:
            return result(out, 0, None)
        ct = int(self.config.chunk_tokens)
        n_chunks = -(-n_tokens // ct)
        keys = self.keys(ids[: min(len(ids), n_chunks * ct)])[:n_chunks]
        try:
            tm0 = time.monotonic()
            raw_metas = self.store.get_many([meta_key(k) for k in keys])
        except StoreError as e:
            return result(out, 0, e)
        stats.meta_s = time.monotonic() - tm0
        self.bandwidth.add_latency(stats.meta_s)  # one round trip of ~200 bytes per chunk
        metas: list[ChunkMeta] = []
        plan_error: KVCodecError | None = None
        for i, raw in enumerate(raw_metas):
            if raw is None:
                plan_error = FetchError(f"chunk {i} (tokens {i * ct}..) is not stored; "
                                        f"only {i * ct} of {n_tokens} tokens can be fetched")
                break
            try:
                m = ChunkMeta.from_bytes(raw)
            except FormatError as e:
                plan_error = e
                break
            if m.index != i or m.start_token != i * ct or m.codec != self.codec_id or len(m.sizes) != len(self.config.resolutions):
                plan_error = FormatError(f"chunk {i} meta does not match this cache's codec/config: {m}")
                break
            metas.append(m)
        if metas and metas[-1].start_token + metas[-1].tokens < min(n_tokens, metas[-1].start_token + ct):
            # a stored partial tail shorter than what is asked for
            plan_error = plan_error or FetchError("stored tail chunk is shorter than the tokens asked for")
        stats.chunks_planned = len(metas)
        if not metas:
            return result(out, 0, plan_error)

        L, H, D = metas[0].shape
        dtype = DTYPES.get(metas[0].dtype)
        if dtype is None:
            return result(out, 0, FormatError(f"stored dtype {metas[0].dtype!r} unknown"))
        if out is None:
            out = torch.empty((L, 2, n_tokens, H, D), dtype=dtype, device=self.device)
        elif out.dim() != 5 or tuple(out.shape[:2]) != (L, 2) or tuple(out.shape[3:]) != (H, D) or out.shape[2] < n_tokens:
            raise ShapeError(f"out is {tuple(out.shape)}; need ({L}, 2, >={n_tokens}, {H}, {D})")
        if pol.name == "adaptive" and self.profile is None:
            try:
                self.ensure_profile((L, H, D), dtype)
            except Exception as e:  # noqa: BLE001 - calibration failed: fall back to a neutral prior
                log.warning("decode calibration failed (%s: %s); using a default profile", type(e).__name__, e)
        profile = self.profile or DecodeProfile.default(self.config.resolutions)

        restored, error = self._run_pipeline(metas, keys, n_tokens, out, t0, deadline_s, pol, profile, stats)
        if error is None and restored < n_tokens:
            error = plan_error or FetchError(f"only {restored} of {n_tokens} tokens restored")
        return result(out, restored, error)

    # -- the pipeline ------------------------------------------------------------------------
    def _run_pipeline(self, metas, keys, n_tokens, out, t0, deadline_s, pol, profile, stats):
        direct = self.direct
        n = len(metas)
        stop = threading.Event()
        slots = threading.Semaphore(self.max_inflight)
        dec_q: queue.Queue = queue.Queue()
        res_q: queue.Queue = queue.Queue()
        timings = [None] * n
        sched_lock = threading.Lock()
        backlog: dict[int, float] = {}  # predicted decode seconds of issued, undecoded chunks
        inflight = [0]
        R = len(self.config.resolutions)
        est = self.bandwidth
        est.begin()
        workers = self.decode_workers

        def now() -> float:
            return time.monotonic() - t0

        # suffix sums, so each choice costs O(resolutions), not O(chunks)
        suf_sizes = [[0.0] * R for _ in range(n + 1)]
        suf_values = [0.0] * (n + 1)
        for k in range(n - 1, -1, -1):
            suf_values[k] = suf_values[k + 1] + metas[k].values
            for j in range(R):
                suf_sizes[k][j] = suf_sizes[k + 1][j] + metas[k].sizes[j]

        def rest_means(i):
            cnt = n - i - 1
            if cnt <= 0:
                return [0.0] * R, [0.0] * R
            mean_values = suf_values[i + 1] / cnt
            # the profile is linear in values, so the mean prediction is the prediction of the mean
            return [suf_sizes[i + 1][j] / cnt for j in range(R)], [profile.predict(j, mean_values) for j in range(R)]

        next_issue = [0]

        def net_worker():
            while not stop.is_set():
                if not slots.acquire(timeout=_POLL_S):
                    continue
                if stop.is_set():
                    return
                with sched_lock:
                    i = next_issue[0]
                    if i >= n:
                        slots.release()
                        return
                    next_issue[0] += 1
                    m = metas[i]
                    rs, rd = rest_means(i)
                    dpred = [profile.predict(j, m.values) for j in range(R)]
                    ctx = ChoiceContext(m.sizes, dpred, est.bytes_per_s, sum(backlog.values()),
                                        workers, n - i - 1, rs, rd, est.latency_s)
                    try:
                        j = pol.choose(ctx)
                    except KVCodecError as e:
                        res_q.put((i, e, None))
                        return
                    backlog[i] = dpred[j]
                    inflight[0] += 1
                    stats.peak_inflight = max(stats.peak_inflight, inflight[0])
                tm = ChunkTiming(i, j, m.sizes[j], m.tokens, bw_estimate_gbit=est.gbit, predicted_decode_s=dpred[j])
                timings[i] = tm
                tm.net_start = now()
                ts = time.monotonic()
                try:
                    blob = self.store.get(blob_key(keys[i], j))
                except StoreError as e:
                    res_q.put((i, e, None))
                    return
                except Exception as e:  # noqa: BLE001 - a wrapper store's own failure
                    err = StoreError(f"get of chunk {i} failed: {type(e).__name__}: {e}")
                    err.__cause__ = e
                    res_q.put((i, err, None))
                    return
                te = time.monotonic()
                tm.net_end = te - t0
                if blob is None:
                    # evicted or lost: drop the chunk's commit marker so lookups stop reporting it
                    # and the next put rewrites it (best effort)
                    try:
                        self.store.delete(meta_key(keys[i]))
                    except Exception as e:  # noqa: BLE001
                        log.warning("could not drop meta of chunk %d after a missing blob: %s", i, e)
                    res_q.put((i, StoreError(f"chunk {i} resolution {j} blob is missing from {self.store.url}"), None))
                    return
                est.add(len(blob), ts, te)
                dec_q.put((i, j, blob))

        def decode_worker():
            while not stop.is_set():
                try:
                    item = dec_q.get(timeout=_POLL_S)
                except queue.Empty:
                    continue
                if item is None:
                    return
                i, j, blob = item
                m = metas[i]
                tm = timings[i]
                tm.dec_start = now()
                kw = {"decoder": self.decoder} if self.decoder is not None else {}
                in_place = (direct and out.device == self.device and out.dtype == DTYPES.get(m.dtype)
                            and m.start_token + m.tokens <= n_tokens)
                if in_place:  # restore frame by frame straight into the output tensor
                    kw["out"] = out[:, :, m.start_token : m.start_token + m.tokens]
                try:
                    x = self.codec.decode_chunk_blob(blob, device=self.device, **kw)
                    if tuple(x.shape) != (m.shape[0], 2, m.tokens, m.shape[1], m.shape[2]):
                        raise FormatError(f"chunk {i} decoded to {tuple(x.shape)}, meta says {m}")
                    if self.device.type == "cuda":
                        torch.cuda.current_stream(self.device).synchronize()
                except KVCodecError as e:
                    res_q.put((i, e, None))
                    continue
                except Exception as e:  # noqa: BLE001 - report, never swallow
                    err = FormatError(f"chunk {i} failed to decode: {type(e).__name__}: {e}")
                    err.__cause__ = e
                    res_q.put((i, err, None))
                    continue
                tm.dec_end = now()
                profile.observe(j, m.values, tm.dec_end - tm.dec_start)
                with sched_lock:
                    backlog.pop(i, None)
                res_q.put((i, None, x))

        threads = [threading.Thread(target=net_worker, name=f"kvc-fetch-net{w}", daemon=True)
                   for w in range(self.net_workers)]
        n_net = len(threads)
        threads += [threading.Thread(target=decode_worker, name=f"kvc-fetch-dec{w}", daemon=True) for w in range(workers)]
        for t in threads:
            t.start()

        pending: dict[int, tuple] = {}
        next_i = 0
        restored = 0
        error: KVCodecError | None = None
        deadline = t0 + deadline_s if deadline_s is not None else None
        try:
            while next_i < n:
                while next_i in pending:
                    err, x = pending.pop(next_i)
                    if err is not None:
                        error = err
                        break
                    m = metas[next_i]
                    tm = timings[next_i]
                    tm.restore_start = now()
                    take = min(m.tokens, n_tokens - m.start_token)
                    dst = out[:, :, m.start_token : m.start_token + take]
                    if not (x.data_ptr() == dst.data_ptr() and x.shape == dst.shape):
                        _copy_chunk(dst, x[:, :, :take])
                    if out.device.type == "cuda":
                        torch.cuda.current_stream(out.device).synchronize()
                    tm.restore_end = now()
                    restored = m.start_token + take
                    stats.chunks_restored += 1
                    stats.bytes_fetched += tm.nbytes
                    key = "x".join(map(str, self.config.resolutions[tm.resolution]))
                    stats.resolution_counts[key] = stats.resolution_counts.get(key, 0) + 1
                    with sched_lock:
                        inflight[0] -= 1
                    slots.release()
                    next_i += 1
                if error is not None or next_i >= n:
                    break
                wait = _POLL_S * 5
                if deadline is not None:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        error = FetchError(f"deadline of {deadline_s:.3f}s passed after {restored} of {n_tokens} tokens")
                        break
                    wait = min(wait, left)
                try:
                    i, err, x = res_q.get(timeout=wait)
                except queue.Empty:
                    continue
                pending[i] = (err, x)
        finally:
            stop.set()
            for _ in range(workers):
                dec_q.put(None)
            for t in threads[n_net:]:
                # direct mode: a decode worker may be writing into `out` beyond the restored
                # prefix; the caller will write there next, so wait for it to finish its chunk
                t.join(timeout=60.0 if direct else 0.05)
                if direct and t.is_alive():
                    log.error("decode worker still running 60 s after the fetch stopped")
        tl = [t for t in timings if t is not None]
        stats.timeline = tl
        stats.net_busy_s = sum(t.net_end - t.net_start for t in tl if t.net_end)
        stats.decode_busy_s = sum(t.dec_end - t.dec_start for t in tl if t.dec_end)
        stats.restore_busy_s = sum(t.restore_end - t.restore_start for t in tl if t.restore_end)
        return restored, error
