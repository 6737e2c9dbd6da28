"""The fetch pipeline: three overlapping stages with at most `max_inflight` chunks between the
first and the last (threads and bounded queues, so peak memory does not grow with the prefix):

    network get (the policy picks the resolution per chunk) -> check + decode -> restore in order

Each chunk is decoded straight into the caller's target (its slice of a dense tensor, or its
blocks of a PagedKV) when the target is on the decode device in the stored dtype (a tensor target:
or in one of the codec's target_dtypes); otherwise into
a staging tensor that the in-order restore copies from. A codec with the StagedDecode capability
(codecs.base) is restored in two halves where the fetch runs on CUDA (or `batched` says so): the
decode workers stage each chunk (its video decode), and the in-order restore finishes every chunk
ready at that moment in one call (the transform codec's math, batched over those chunks). A fetch on
CUDA of a codec that can be driven (codecs/driven.py: the transform and HEVC codecs) has no decode
workers: the in-order restore's thread also stages each blob as it arrives, its videos pushed to a
native feeder thread per NVDEC session (driven.StageDriver; KVCODEC_DRIVEN=0 for the workers), and
finishes the chunks the sessions complete in order, in batches, with the codec's driven finish; the network
thread begins each blob's host work as it arrives (driven.StageDriver.begin: the transform codec's zstd on
native threads). The restore thread and one network thread per get in flight (default_net_workers: two from a
store across a link on CUDA, else one) share the interpreter lock, not nine threads
(benchmarks/results/fetch-h200-issue21.md).
A blob is decoded only after its header names the key, chunk, first token and shape the fetch asked for (a store serving another
prefix's KV is caught here); a chunk failing a check is reported through `on_bad_chunk` (the
cache drops its meta, so the next put rewrites it).
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import logging
import queue
import threading
import time
from collections.abc import Callable
from typing import Any

import torch

from kvcodec.codecs.base import ChunkCodec, ChunkInfo, StagedDecode, Target, narrowed_checked, restores_into
from kvcodec.codecs.raw import copy_chunk
from kvcodec.errors import FetchError, FormatError, KVCodecError, ShapeError, StoreError
from kvcodec.fetcher import storecalls
from kvcodec.fetcher.bandwidth import BandwidthEstimator
from kvcodec.fetcher.keys import ChunkMeta, blob_key
from kvcodec.fetcher.policy import ChoiceContext, ResolutionPolicy
from kvcodec.fetcher.profile import DecodeProfile
from kvcodec.fetcher.stats import ChunkTiming, FetchStats
from kvcodec.restore.paged import PagedKV
from kvcodec.video.streams import thread_restore_stream

log = logging.getLogger(__name__)

_POLL_S = 0.02
CPU_DECODE_WORKERS = 1  # FFmpeg's decoder threads itself
CPU_MAX_INFLIGHT = 4
CUDA_MAX_INFLIGHT = 64  # never caps the staged batch of a fetch on CUDA (chunks are a few MB each)


def default_decode_workers(device: torch.device) -> int:
    """Decode threads of a fetch on `device`: one NVDEC session each, one per engine on CUDA (all
    in this process's CUDA context), else CPU_DECODE_WORKERS."""
    if device.type != "cuda":
        return CPU_DECODE_WORKERS
    from kvcodec.codecs.hevc.pool import decode_engines

    return max(1, decode_engines(device))


# gets in flight per fetch on CUDA from a store across a link (its `remote`): with one, the link idles while the
# network thread begins each chunk's host work (2048 tokens of transform-coded KV behind 5-40 Gbit/s on an H100:
# 1.3-1.36x faster with two, four no faster than two); from a store in this machine's memory or disk, a second
# get has nothing to overlap and its thread only contends for the interpreter lock (0.6-0.95x of one), so one
# (benchmarks/results/fetch-h100-s75-net-workers.md)
REMOTE_NET_WORKERS = 2


def default_net_workers(device: torch.device, store: Any) -> int:
    """Concurrent gets of a fetch on `device` from `store`: REMOTE_NET_WORKERS on CUDA where the store says its
    gets cross a link (its `remote`, BaseStore's), else 1."""
    return REMOTE_NET_WORKERS if device.type == "cuda" and getattr(store, "remote", False) else 1


def stage_executor(decode_workers: int, net_workers: int) -> concurrent.futures.ThreadPoolExecutor:
    """Threads for the stages of a cache's fetches, started once and kept (a fetch of a short
    prefix otherwise spends a good part of its time starting and joining its threads): room for
    two fetches at once, more fetches queue their stages."""
    return concurrent.futures.ThreadPoolExecutor(2 * (decode_workers + net_workers), thread_name_prefix="kvc-fetch")


def default_max_inflight(device: torch.device, decode_workers: int) -> int:
    """Chunks between network get and restore: on CUDA enough that the staged batch a finish takes
    is never capped (every engine busy and chunks queued behind each), else CPU_MAX_INFLIGHT."""
    if device.type != "cuda":
        return max(CPU_MAX_INFLIGHT, decode_workers)
    return max(CUDA_MAX_INFLIGHT, 4 * decode_workers)


# most fp16-equivalent KV one finish restores: a transform's GEMM writes float32 products, twice
# that, so a fetch's scratch stays bounded however long the prefix (2-4 GB beyond a 7-8B model's
# output: fetch-h200-s47-memory); at 32 chunks of that model, 1 GiB, the kernels run at their best
# per GB, 16 cost 7.5% more (decode-h200-s47-kernels-llama)
FINISH_BATCH_BYTES = 1 << 30


def finish_batches(ready: list, nbytes: list[int], most: int | None = None) -> list[list]:
    """`ready` cut, in order, into runs of at most `most` bytes (nbytes: each item's; a larger item
    is a run of its own). Pure."""
    most = FINISH_BATCH_BYTES if most is None else most
    runs: list[list] = []
    size = 0
    for item, b in zip(ready, nbytes):
        if not runs or size + b > most:
            runs.append([])
            size = 0
        runs[-1].append(item)
        size += b
    return runs


# a driven fetch finishes an in-order run of ready chunks once it holds this much fp16-equivalent KV (or the
# fetch's last chunk): each finish costs the fetch's thread ~0.3-1 ms whatever its size (uploads, launches,
# the wait), and a short prefix's chunks were finished in 2-3 runs (benchmarks/results/fetch-h100-s60-phases-qwen.md)
MIN_FINISH_BYTES = 64 << 20
_DRIVEN_NET_WAIT_S = 0.0005  # a driven fetch waits this long for the next blob before flushing a session
_DIRECT_JOIN_S = 60.0  # how long a stopped fetch waits for a decode still writing into the target


@dataclasses.dataclass(frozen=True)
class PipelineSettings:
    codec: ChunkCodec
    store: Any
    device: torch.device
    max_inflight: int
    decode_workers: int
    net_workers: int
    direct: bool
    batched: bool | None = None  # staged decode for codecs that have it; None: on CUDA only
    stream: bool = True  # staged decode streamed (stage_stream) where the codec can
    executor: Any = None  # a ThreadPoolExecutor whose threads run the stages (None: threads per fetch)

    @property
    def staged(self) -> bool:
        on = self.batched if self.batched is not None else self.device.type == "cuda"
        return bool(on) and isinstance(self.codec, StagedDecode) and getattr(self.codec, "stages", True)

    @property
    def drivable(self) -> bool:
        """Staged from the fetch's own thread (driven.stage_driver) where the codec can be: on CUDA,
        with the staged and streamed decode not turned off (`batched`, `stream`)."""
        return self.device.type == "cuda" and self.batched is not False and self.stream

    @property
    def streamed(self) -> bool:
        """Staged through the codec's stage_stream (chunks back to back on one decoder session per
        worker), where the codec has one; `stream` False turns it off."""
        return self.staged and self.stream and callable(getattr(self.codec, "stage_stream", None))


@dataclasses.dataclass(frozen=True)
class Decoded:
    """A chunk out of the decode stage: its target, the staging tensor the restore copies from
    (None: the target is the caller's own) and, in a staged fetch, what the codec's finish takes."""

    target: Target
    staging: torch.Tensor | None
    part: object = None
    ready: torch.cuda.Event | None = None  # recorded where the part was staged; finish waits for it


@dataclasses.dataclass(frozen=True)
class FetchPlan:
    """The chunks to fetch (their metas and keys, in order), the tokens asked for and where (None:
    allocated on the decode device once a chunk's own header has confirmed the metas' shape, so
    a damaged meta never sizes an allocation)."""

    metas: list[ChunkMeta]
    keys: list[str]
    n_tokens: int
    dtype: torch.dtype
    out: Target | None


class FetchPipeline:
    """One fetch's stages; `run()` returns (tokens restored, error or None)."""

    def __init__(
        self,
        settings: PipelineSettings,
        plan: FetchPlan,
        policy: ResolutionPolicy,
        profile: DecodeProfile,
        bandwidth: BandwidthEstimator,
        stats: FetchStats,
        deadline: storecalls.Deadline,
        t0: float,
        on_bad_chunk: Callable[[int, KVCodecError], None],
    ) -> None:
        self.s, self.plan, self.policy, self.profile = settings, plan, policy, profile
        self.est, self.stats, self.deadline, self.t0 = bandwidth, stats, deadline, t0
        self.on_bad_chunk = on_bad_chunk
        n = len(plan.metas)
        self.stop = threading.Event()
        self.slots = threading.Semaphore(settings.max_inflight)
        self.dec_q: queue.Queue = queue.Queue()
        self.res_q: queue.Queue = queue.Queue()
        self.results_closed = False
        self.timings: list[ChunkTiming | None] = [None] * n
        self.lock = threading.Lock()
        self.backlog: dict[int, float] = {}  # predicted decode seconds of issued, undecoded chunks
        self.inflight = 0
        self.next_issue = 0
        self.direct_used = False
        self.halves: Callable | None = settings.codec.finish if settings.staged else None  # the second half
        self.begin: Callable | None = None  # a driven fetch's StageDriver.begin: host work started as blobs come in
        self.out = plan.out
        self._suffix_sums()
        self.started = None  # CUDA: the caller's stream at the start; the fetch's own streams wait for it
        self.caller: torch.cuda.Stream | None = None  # CUDA: the caller's stream, the one its output is for
        if settings.device.type == "cuda":
            self.caller = torch.cuda.current_stream(settings.device)
            self.started = torch.cuda.Event()
            self.started.record(self.caller)

    def now(self) -> float:
        return time.monotonic() - self.t0

    # -- the whole run -----------------------------------------------------------------------
    def run(self) -> tuple[int, KVCodecError | None]:
        self.est.begin()
        dec: list = []
        try:
            with contextlib.ExitStack() as stack:
                for _ in range(min(self.s.net_workers, self.s.max_inflight)):
                    self._start(self._net_worker, "net")
                driver = stack.enter_context(self._driver())
                if driver is None:
                    dec = [self._start(self._decode_worker, "dec") for _ in range(self.s.decode_workers)]
                else:
                    self.halves, self.begin = driver.finish, driver.begin
                stack.enter_context(_own_stream(self.s.device, self.started))  # never behind the model's work
                return self._consume() if driver is None else self._consume_driven(driver)
        finally:
            try:
                self._shutdown(dec)
            finally:
                self._close_results()
                self._finish_stats()

    def _report(self, item: tuple) -> None:
        """(index, error, staged) of a chunk to the in-order restore, dropped once the run has ended."""
        with self.lock:
            if not self.results_closed:
                self.res_q.put(item)

    def _close_results(self) -> None:
        """No more results, and none left queued: a queued error's traceback holds the worker's frame and so
        this pipeline and its queue, a cycle that kept the fetch's output and buffers alive until the
        collector's next full pass (a deadline with a store call in flight, a second bad chunk)."""
        with self.lock:
            self.results_closed = True
        while True:
            try:
                self.res_q.get_nowait()
            except queue.Empty:
                return

    def _driver(self):  # noqa: ANN202 - a context manager yielding a StageDriver or None
        """A fetch on CUDA of a codec that can be driven stages its chunks from this thread
        (driven.StageDriver: no decode worker threads); None: decode workers."""
        if not self.s.drivable:
            return contextlib.nullcontext()
        from kvcodec.codecs import driven

        return driven.stage_driver(
            self.s.codec, self.s.device, self.s.decode_workers, self._check_info, len(self.plan.metas)
        )

    def _start(self, work: Callable[[], None], kind: str):  # noqa: ANN202 - a threading.Thread or a _Task
        """Run `work` on a thread of the settings' executor (kept across fetches), else a new thread."""
        if self.s.executor is not None:
            return _Task(self.s.executor.submit(work))
        t = threading.Thread(target=work, name=f"kvc-fetch-{kind}", daemon=True)
        t.start()
        return t

    def _shutdown(self, decoders: list) -> None:
        self.stop.set()
        for _ in decoders:
            self.dec_q.put(None)
        writers = self.direct_used and self.halves is None  # a staged chunk's target is written by finish, here
        for t in decoders:
            # a decode may be writing into the caller's target beyond the restored prefix; the
            # caller writes there next, so wait for it to finish its chunk
            t.join(timeout=_DIRECT_JOIN_S if writers else 0.05)
            if writers and t.is_alive():
                log.error(
                    "a decode worker is still writing into the target %.0f s after the fetch stopped", _DIRECT_JOIN_S
                )

    def _consume(self) -> tuple[int, KVCodecError | None]:
        """Restore chunks in order as they come back; stop at the first error or the deadline."""
        pending: dict[int, tuple] = {}
        next_i, restored, n = 0, 0, len(self.plan.metas)
        while next_i < n:
            next_i, restored, err, _ = self._advance(pending, next_i, restored)
            if err is not None:
                return restored, err
            if next_i >= n:
                break
            wait, late = self._wait_for(_POLL_S * 5, restored)
            if late is not None:
                return restored, late
            try:
                i, err, staged = self.res_q.get(timeout=wait)
            except queue.Empty:
                continue
            pending[i] = (err, staged)
        return restored, None

    def _advance(
        self, pending: dict[int, tuple], next_i: int, restored: int, hold: bool = False
    ) -> tuple[int, int, KVCodecError | None, bool]:
        """Restore the in-order run of decoded chunks from next_i (every result already queued
        joins `pending` first): (the next chunk due, tokens restored, the error that stops the
        fetch or None, whether any chunk was restored). hold: a run too small to be worth its
        finish (_held) stays in `pending`."""
        self._take_ready(pending)
        ready, err = _ready_run(pending, next_i)
        if ready and err is None and hold and self._held(ready):
            pending.update((i, (None, done)) for i, done in ready)
            return next_i, restored, None, False
        if ready:
            restored, failed = self._restore_run(ready, restored)
            if failed is not None:
                return next_i, restored, failed, True
            next_i += len(ready)
        return next_i, restored, err, bool(ready)

    def _held(self, ready: list[tuple[int, Decoded]]) -> bool:
        """Whether a driven fetch waits for more chunks before finishing the in-order run `ready`:
        it holds under MIN_FINISH_BYTES of fp16-equivalent KV, does not end the fetch, and keeps
        fewer than half the in-flight slots."""
        if ready[-1][0] + 1 >= len(self.plan.metas) or 2 * len(ready) >= self.s.max_inflight:
            return False
        return sum(self._fp16_bytes(i) for i, _ in ready) < MIN_FINISH_BYTES

    def _consume_driven(self, driver) -> tuple[int, KVCodecError | None]:
        """_consume where this thread also stages the chunks: each blob the network stage delivers
        is handed to `driver` (its video to a session's native feeder) and the chunks it completes
        are finished in order, in batches of at least MIN_FINISH_BYTES (or to the end), between
        submissions."""
        pending: dict[int, tuple] = {}
        fed: dict[int, tuple] = {}  # chunks submitted and not yet handed back: index -> (j, target, direct)
        next_i, restored, n, delivered = 0, 0, len(self.plan.metas), 0
        while next_i < n:
            try:
                got = self._submit_queued(driver, fed)
                delivered += got
                if got and delivered == n:  # the last blob is in: flushes follow the last streams at once
                    driver.end_all()
                for i, part, busy in driver.poll():
                    self._staged(i, part, fed.pop(i), busy)
            except Exception as e:  # noqa: BLE001 - a session failed with no chunk at fault
                next_i, restored, failed = self._restore_held(pending, next_i, restored)
                return restored, failed or (
                    e if isinstance(e, KVCodecError) else _failed(next_i, "failed to decode", e)
                )
            next_i, restored, err, progressed = self._advance(pending, next_i, restored, hold=True)
            if err is not None:
                return restored, err
            if next_i >= n or progressed:
                continue
            due = next_i
            while due in pending:  # held: the chunk after them decides when they are finished
                due += 1
            wait, late = self._wait_for(_POLL_S, restored)
            if late is not None:
                next_i, restored, failed = self._restore_held(pending, next_i, restored)
                return restored, failed or self._wait_for(0.0, restored)[1] or late
            if due in pending or not self.res_q.empty() or driver.has_done():
                continue
            if driver.pending(due):
                more = delivered < n and not self.stop.is_set()
                if more and self._submit_waiting(driver, fed, min(wait, _DRIVEN_NET_WAIT_S)):
                    delivered += 1
                    if delivered == n:
                        driver.end_all()
                    continue
                try:  # while blobs may come, back to the queue often
                    if not more:
                        driver.flush_stuck()
                    driver.wait(due, min(wait, 0.002) if more else wait, flush=self.dec_q.empty())
                except Exception as e:  # noqa: BLE001
                    next_i, restored, failed = self._restore_held(pending, next_i, restored)
                    return restored, failed or _failed(due, "failed to decode", e)
            elif self._submit_waiting(driver, fed, wait):
                delivered += 1
                if delivered == n:
                    driver.end_all()
        return restored, None

    def _restore_held(
        self, pending: dict[int, tuple], next_i: int, restored: int
    ) -> tuple[int, int, KVCodecError | None]:
        """The fetch is stopping: the chunks it held restored first (the next chunk due, tokens
        restored, the error of a chunk that failed among them or right after them)."""
        next_i, restored, failed, _ = self._advance(pending, next_i, restored)
        return next_i, restored, failed

    def _submit_queued(self, driver, fed: dict) -> int:
        """Every blob the network stage has delivered, to the driver in one call (it pushes the
        videos first); how many."""
        items = []
        while True:
            try:
                item = self.dec_q.get_nowait()
            except queue.Empty:
                break
            if item is not None:
                items.append(item)
        self._submit(driver, fed, items)
        return len(items)

    def _submit_waiting(self, driver, fed: dict, timeout_s: float) -> bool:
        """The next blob delivered within timeout_s to the driver; whether one came."""
        try:
            item = self.dec_q.get(timeout=timeout_s)
        except queue.Empty:
            return False
        if item is None:
            return False
        self._submit(driver, fed, [item])
        return True

    def _submit(self, driver, fed: dict, items: list[tuple]) -> None:
        """The delivered (chunk, resolution, blob) items to the driver, with their targets."""
        if not items:
            return
        batch = []
        for i, j, blob in items:
            tm = self.timings[i]
            tm.dec_start = self.now()
            tm.worker = threading.current_thread().name
            target, direct = self._target(self.plan.metas[i])
            fed[i] = (j, target, direct)
            batch.append((i, blob, target))
        driver.submit_many(batch)
        now = self.now()
        for i, _, _ in items:
            self.timings[i].submitted = now

    def _take_ready(self, pending: dict[int, tuple]) -> None:
        """Every result already queued, so that chunks decoded together are finished together."""
        while True:
            try:
                i, err, staged = self.res_q.get_nowait()
            except queue.Empty:
                return
            pending[i] = (err, staged)

    def _wait_for(self, most: float, restored: int) -> tuple[float, FetchError | None]:
        """How long to wait for the next chunk (at most `most`, never past the deadline), or the
        error of a deadline that has passed with `restored` tokens restored."""
        left = self.deadline.left()
        if left is not None and left <= 0:
            return 0.0, FetchError(f"{self.deadline.ended()} after {restored} of {self.plan.n_tokens} tokens")
        return (most if left is None else min(most, left)), None

    def _restore_run(self, ready: list[tuple[int, Decoded]], restored: int) -> tuple[int, KVCodecError | None]:
        """Finish and restore the in-order run `ready`, in batches of at most FINISH_BATCH_BYTES:
        (tokens restored, the error that stopped it). The batches are queued one after another on
        the stream and waited for once; each batch's scratch is freed when the next is queued."""
        finished, error = [], None
        for batch in finish_batches(ready, [self._fp16_bytes(i) for i, _ in ready]):
            try:
                self._finish(batch)
            except KVCodecError as e:
                error = e
            except Exception as e:  # noqa: BLE001 - report, never swallow
                error = _failed(batch[0][0], "failed to restore", e)
            if error is not None:
                break
            finished += batch
        if finished and self.halves is not None and self.s.device.type == "cuda":  # one wait for the math
            torch.cuda.current_stream(self.s.device).synchronize()
        for i, done in finished:
            try:
                restored = self._restore(i, done.staging)
            except ShapeError as e:  # values the target's dtype cannot hold: the chunks are sound, kept
                return restored, e
        return restored, error

    def _fp16_bytes(self, i: int) -> int:
        """Chunk i's KV in fp16 bytes (what a finish batch is measured in)."""
        return self.plan.metas[i].values * 2

    def _finish(self, ready: list[tuple[int, Decoded]]) -> None:
        """A staged or driven fetch: the codec's second half for the chunks `ready` (in order), in one call."""
        if self.halves is None:
            return
        start = self.now()
        for i, _ in ready:
            self.timings[i].restore_start = start
        parts, targets = [d.part for _, d in ready], [d.target for _, d in ready]
        if self.s.device.type == "cuda":
            stream = torch.cuda.current_stream(self.s.device)
            for _, d in ready:
                if d.ready is not None:
                    stream.wait_event(d.ready)
            with torch.cuda.device(self.s.device):
                self.halves(parts, targets)
        else:
            self.halves(parts, targets)

    def _restore(self, i: int, staged: torch.Tensor | None) -> int:
        """Chunk i is complete in the target (copied from its staging tensor if it has one)."""
        m, tm, out = self.plan.metas[i], self.timings[i], self.out
        if self.halves is None:  # a staged chunk's restore began with its finish
            tm.restore_start = self.now()
        take = min(m.tokens, self.plan.n_tokens - m.start_token)
        try:
            if staged is not None:
                self._copy_staged(i, m.start_token, staged[:, :, :take])
                self.stats.chunks_staged += 1  # copied: a chunk refused for its values is not counted
            if out.device.type == "cuda" and (staged is not None or self.halves is None):
                torch.cuda.current_stream(out.device).synchronize()  # a staged batch was waited for once
        finally:
            with self.lock:
                self.inflight -= 1
            self.slots.release()
        tm.restore_end = self.now()
        st = self.stats
        st.chunks_restored += 1
        st.bytes_fetched += tm.nbytes
        label = "x".join(map(str, self.s.codec.resolutions[tm.resolution]))
        st.resolution_counts[label] = st.resolution_counts.get(label, 0) + 1
        return m.start_token + take

    def _copy_staged(self, i: int, start: int, staged: torch.Tensor) -> None:
        """Chunk i's staged tokens into the target from token `start`, in the target's dtype; a
        ShapeError, with nothing written, where that dtype is narrower than the staged one
        (bfloat16 chunks into float16) and a finite value would turn to inf."""
        out = self.out
        into = kv_tensor(out).dtype
        staged = narrowed_checked(staged, into, f"chunk {i}")
        if isinstance(out, PagedKV):
            blocks, within = out.slots(start, staged.shape[2])
            out.pages[:, :, blocks, within] = staged.to(out.device, into)
        else:
            copy_chunk(out[:, :, start : start + staged.shape[2]], staged)

    # -- network stage -----------------------------------------------------------------------
    def _net_worker(self) -> None:
        # the host work it begins (StageDriver.begin) pins memory for the fetch's device, not device 0
        if self.s.device.type == "cuda":
            torch.cuda.set_device(self.s.device)
        while not self.stop.is_set():
            if not self.slots.acquire(timeout=_POLL_S):
                continue
            if self.stop.is_set():
                return
            try:
                issued = self._issue()
            except _IssueError as e:  # this thread ends here: the fetch must hear why, not wait
                self._report((e.index, e.error, None))
                return
            if issued is None:
                self.slots.release()
                return
            i, j = issued
            try:
                blob = self._get(i, j)
            except Exception as e:  # noqa: BLE001
                self._report((i, _as_fetch_error(i, "failed to get", e), None))
                return
            if self.begin is not None:  # before the blob is queued: the fetch's thread then takes the work over
                self.begin(blob)
            self.timings[i].queued = self.now()
            self.dec_q.put((i, j, blob))

    def _issue(self) -> tuple[int, int] | None:
        """The next chunk to get and the resolution the policy picks for it."""
        with self.lock:
            i = self.next_issue
            if i >= len(self.plan.metas):
                return None
            self.next_issue += 1
            try:
                return self._choose(i)
            except Exception as e:  # noqa: BLE001 - chunk i's error, whatever raised it (a policy, a profile)
                raise _IssueError(i, _as_fetch_error(i, "failed to issue", e)) from e

    def _choose(self, i: int) -> tuple[int, int]:
        """Chunk i issued (under the lock): the resolution the policy picks for it, its timing started."""
        m = self.plan.metas[i]
        dpred = [self.profile.predict(j, m.values) for j in range(len(m.sizes))]
        rest_sizes, rest_dec = self._rest_means(i)
        ctx = ChoiceContext(
            m.sizes,
            dpred,
            self.est.bytes_per_s,
            sum(self.backlog.values()),
            self.s.decode_workers,
            len(self.plan.metas) - i - 1,
            rest_sizes,
            rest_dec,
            self.est.latency_s,
        )
        j = self.policy.choose(ctx)
        self.backlog[i] = dpred[j]
        self.inflight += 1
        self.stats.peak_inflight = max(self.stats.peak_inflight, self.inflight)
        self.timings[i] = ChunkTiming(
            i, j, m.sizes[j], m.tokens, bw_estimate_gbit=self.est.gbit, predicted_decode_s=dpred[j]
        )
        return i, j

    def _get(self, i: int, j: int) -> bytes:
        tm = self.timings[i]
        tm.net_start = self.now()
        ts = time.monotonic()
        blob = storecalls.call(self.deadline, f"get of chunk {i}", self.s.store.get, blob_key(self.plan.keys[i], j))
        te = time.monotonic()
        tm.net_end = te - self.t0
        if blob is None:
            err = StoreError(
                f"chunk {i} resolution {j} blob is missing from {getattr(self.s.store, 'url', 'the store')}"
            )
            self.on_bad_chunk(i, err)
            raise err
        if len(blob) != self.plan.metas[i].sizes[j]:
            err = FormatError(
                f"chunk {i} resolution {j} blob has {len(blob)} bytes; its meta says {self.plan.metas[i].sizes[j]}"
            )
            self.on_bad_chunk(i, err)
            raise err
        self.est.add(len(blob), ts, te)
        return blob

    # -- decode stage ------------------------------------------------------------------------
    def _decode_worker(self) -> None:
        if self.s.device.type == "cuda":  # a new thread's CUDA device is 0: decoders and kernels must use the fetch's
            torch.cuda.set_device(self.s.device)
        with _own_stream(self.s.device, self.started):  # each worker waits for its own work only
            if self.s.streamed:
                self._stream_loop()
            else:
                self._decode_loop()

    # -- streamed staged decode (a codec's stage_stream: one NVDEC session per worker) ---------
    def _stream_loop(self) -> None:
        """Chunks through the codec's stage_stream while they come: one stream per run of chunks
        already queued (the parser is flushed when the queue runs dry, so no chunk waits for the
        network behind another's frames)."""
        while not self.stop.is_set():
            try:
                item = self.dec_q.get(timeout=_POLL_S)
            except queue.Empty:
                continue
            if item is None:
                return
            fed: dict[int, tuple] = {}
            ended: list[bool] = [False]  # the shutdown marker came while chunks were queued
            try:
                items = self._queued(item, fed, ended)
                for i, part in self.s.codec.stage_stream(items, self.s.device, self._check_info):
                    self._staged(i, part, fed.pop(i))
            except Exception as e:  # noqa: BLE001 - the session failed: every chunk fed reports it
                for i in list(fed):
                    fed.pop(i)
                    self._report((i, e if isinstance(e, KVCodecError) else _failed(i, "failed to decode", e), None))
            if ended[0]:
                return

    def _queued(self, first: tuple, fed: dict, ended: list[bool]):
        """(index, blob, target) of `first` and of the chunks queued behind it, until the queue is
        empty, this worker holds its share of the fetch's chunks (fed and not yet staged: the
        others go to the other workers' engines) or the fetch stops."""
        item, share = first, max(1, -(-len(self.plan.metas) // self.s.decode_workers))
        while item is not None and not self.stop.is_set():
            i, j, blob = item
            self.timings[i].dec_start = self.now()
            self.timings[i].worker = threading.current_thread().name
            target, direct = self._target(self.plan.metas[i])
            fed[i] = (j, target, direct)
            yield i, blob, target
            if len(fed) >= share:
                return
            try:
                item = self.dec_q.get_nowait()
            except queue.Empty:
                return
            ended[0] = item is None

    def _check_info(self, i: int, info: ChunkInfo) -> None:
        self._check_binding(i, info)

    def _staged(self, i: int, part: object, fed: tuple, busy_s: float | None = None) -> None:
        """Chunk i's staged part (or its error) to the in-order restore. busy_s: the seconds its
        decoder spent on it (a driven fetch's chunks wait behind others: the start is moved up);
        None: staged on this thread's stream since dec_start."""
        j, target, direct = fed
        if isinstance(part, KVCodecError):
            if isinstance(part, FormatError):
                self.on_bad_chunk(i, part)
            self._report((i, part, None))
            return
        ready = None  # a driven chunk's frames were copied and waited for on its session's stream
        if self.s.device.type == "cuda" and busy_s is None:
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream(self.s.device))
        tm = self.timings[i]
        tm.dec_end = self.now()
        if busy_s is not None:
            tm.dec_start = max(tm.dec_start, tm.dec_end - busy_s)
        self.profile.observe(j, self.plan.metas[i].values, tm.dec_end - tm.dec_start)
        with self.lock:
            self.backlog.pop(i, None)
        self._report((i, None, Decoded(target, None if direct else target, part, ready)))

    def _decode_loop(self) -> None:
        while not self.stop.is_set():
            try:
                item = self.dec_q.get(timeout=_POLL_S)
            except queue.Empty:
                continue
            if item is None:
                return
            i, j, blob = item
            try:
                staged = self._decode(i, j, blob)
            except KVCodecError as e:
                if isinstance(e, FormatError):
                    self.on_bad_chunk(i, e)
                self._report((i, e, None))
                continue
            except Exception as e:  # noqa: BLE001 - report, never swallow
                self._report((i, _failed(i, "failed to decode", e), None))
                continue
            self._report((i, None, staged))

    def _decode(self, i: int, j: int, blob: bytes, staged: bool | None = None) -> Decoded:
        """Check chunk i's blob, decode it into its target (or, staged, its first half; `staged`: whether
        to, where not the fetch's setting)."""
        m, tm = self.plan.metas[i], self.timings[i]
        tm.dec_start = self.now()
        self._check_binding(i, self.s.codec.inspect_chunk(blob))
        target, direct = self._target(m)
        staged = self.s.staged if staged is None else staged
        part = self.s.codec.stage(blob, target) if staged else None
        if not staged:
            self.s.codec.decode_chunk(blob, target)
        if self.s.device.type == "cuda":
            torch.cuda.current_stream(self.s.device).synchronize()
        tm.dec_end = self.now()
        self.profile.observe(j, m.values, tm.dec_end - tm.dec_start)
        with self.lock:
            self.backlog.pop(i, None)
        return Decoded(target, None if direct else target, part)

    def _check_binding(self, i: int, info: ChunkInfo) -> None:
        check_binding(i, info, self.plan.metas[i], self.plan.keys[i])

    def _target(self, m: ChunkMeta) -> tuple[Target, bool]:
        dev, dtype = self.s.device, self.plan.dtype
        L, H, D = m.shape
        with self.lock:
            if self.out is None:  # the metas' shape is now confirmed by a blob bound to its key
                self.out = self._new_output((L, 2, self.plan.n_tokens, H, D), dtype)
            out = self.out
        end = m.start_token + m.tokens
        into = kv_tensor(out).dtype
        castable = restores_into(self.s.codec, dtype, into)  # else staged in the stored dtype and copied
        if self.s.direct and end <= self.plan.n_tokens and out.device == dev:
            if isinstance(out, PagedKV) and into == dtype:
                self.direct_used = True
                return out, True
            if isinstance(out, torch.Tensor) and castable:
                self.direct_used = True
                return out[:, :, m.start_token : end], True
        # staged in the target's dtype where the codec restores into it: every chunk rounded once
        return torch.empty((L, 2, m.tokens, H, D), dtype=into if castable else dtype, device=dev), False

    def _new_output(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        """The output the fetch allocates, on the caller's stream: once the caller drops it, torch's
        allocator hands its memory out again in the order of the caller's own work, not to the next
        fetch on this thread's kept stream while the caller's work may still read it. Off CUDA the
        caller is None, which makes torch.cuda.stream a no-op."""
        with torch.cuda.stream(self.caller):
            return torch.empty(shape, dtype=dtype, device=self.s.device)

    # -- bookkeeping -------------------------------------------------------------------------
    def _suffix_sums(self) -> None:
        """Suffix sums of sizes and values, so each choice costs O(resolutions), not O(chunks)."""
        metas = self.plan.metas
        R = len(metas[0].sizes) if metas else 0
        self.suf_sizes = [[0.0] * R for _ in range(len(metas) + 1)]
        self.suf_values = [0.0] * (len(metas) + 1)
        for k in range(len(metas) - 1, -1, -1):
            self.suf_values[k] = self.suf_values[k + 1] + metas[k].values
            for j in range(R):
                self.suf_sizes[k][j] = self.suf_sizes[k + 1][j] + metas[k].sizes[j]

    def _rest_means(self, i: int) -> tuple[list[float], list[float]]:
        R = len(self.suf_sizes[0])
        cnt = len(self.plan.metas) - i - 1
        if cnt <= 0:
            return [0.0] * R, [0.0] * R
        mean_values = self.suf_values[i + 1] / cnt
        # the profile is linear in values, so the mean prediction is the prediction of the mean
        return (
            [self.suf_sizes[i + 1][j] / cnt for j in range(R)],
            [self.profile.predict(j, mean_values) for j in range(R)],
        )

    def _finish_stats(self) -> None:
        tl = [t for t in self.timings if t is not None]
        st = self.stats
        st.timeline = tl
        st.net_busy_s = sum(t.net_end - t.net_start for t in tl if t.net_end)
        st.decode_busy_s = sum(t.dec_end - t.dec_start for t in tl if t.dec_end)
        st.restore_busy_s = sum(t.restore_end - t.restore_start for t in tl if t.restore_end)


@contextlib.contextmanager
def _own_stream(device: torch.device, after: torch.cuda.Event | None):
    """On CUDA, the fetching thread's restore stream as its current one (ordered after `after`):
    its host waits wait for this stream's work alone, not for the legacy default stream that every
    thread and the model share; kept for the thread's next fetch, which reuses the memory this
    one freed there (thread_restore_stream)."""
    if device.type != "cuda":
        yield
        return
    stream = thread_restore_stream(device)
    if after is not None:
        stream.wait_event(after)
    with torch.cuda.stream(stream):
        yield


class _Task:
    """A stage running on an executor's thread, joined like a thread."""

    def __init__(self, future: concurrent.futures.Future):
        self.future = future

    def join(self, timeout: float | None = None) -> None:
        concurrent.futures.wait([self.future], timeout=timeout)

    def is_alive(self) -> bool:
        return not self.future.done()


def _ready_run(pending: dict[int, tuple], first: int) -> tuple[list[tuple[int, Decoded]], KVCodecError | None]:
    """The decoded chunks first, first+1, ... that are in `pending` (taken out of it), up to the
    first that failed; and that chunk's error."""
    ready = []
    while first + len(ready) in pending:
        err, done = pending.pop(first + len(ready))
        if err is not None:
            return ready, err
        ready.append((first + len(ready), done))
    return ready, None


class _IssueError(Exception):
    """Issuing chunk `index` failed with `error` (the chunk it names is known only under the lock)."""

    def __init__(self, index: int, error: KVCodecError) -> None:
        super().__init__(str(error))
        self.index, self.error = index, error


def _as_fetch_error(i: int, what: str, e: Exception) -> KVCodecError:
    """`e` itself where it is kvcodec's, else a FetchError of chunk i that chains it."""
    return e if isinstance(e, KVCodecError) else _failed(i, what, e)


def _failed(i: int, what: str, e: Exception) -> FetchError:
    err = FetchError(f"chunk {i} {what}: {type(e).__name__}: {e}")
    err.__cause__ = e
    return err


def kv_tensor(out: Target) -> torch.Tensor:
    """The tensor a target's KV lands in: (layers, 2, ..., kv_heads, head_dim), dense or paged."""
    return out.pages if isinstance(out, PagedKV) else out


def check_binding(i: int, info: ChunkInfo, m: ChunkMeta, key: str) -> None:
    """FormatError unless the blob whose verified header is `info` is chunk `m` of the prefix
    `key` names, of the shape and dtype its meta says (checked before anything is sized from it)."""
    want = (m.index, m.start_token, m.tokens, tuple(m.shape), m.dtype)
    got = (info.index, info.start_token, info.tokens, (info.layers, info.kv_heads, info.head_dim), info.dtype)
    if info.key != key:
        raise FormatError(
            f"chunk {i}: the stored blob is bound to another prefix key ({info.key!r}), not the one asked for"
        )
    if got != want:
        raise FormatError(
            f"chunk {i}: the stored blob is (index, start, tokens, shape, dtype) {got}; its meta says {want}"
        )
