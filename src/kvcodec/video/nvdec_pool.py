"""A pool of NVDEC decoders, one per worker process, to keep all of a GPU's decode engines busy.

One NVDEC session decodes on one engine at a time, and sessions driven by threads of one process do
not scale (about 2x at best), so the pool runs one `NvdecDecoder` in each of `workers` processes
(spawned once, reused), fed from a shared job queue. Two kinds of job:

* restore (`restore_blobs`): a chunk blob, its output tensor (a CUDA tensor of the consumer,
  shared through CUDA IPC) and the codec's chunk restore function, handed in by the codec
  (kvcodec.codecs.hevc.pool: this package knows no codec). The worker runs it with its decoder,
  so decoding, de-tiling and dequantization all happen in the worker and the consumer does no
  per-frame work (Python's GIL made a consumer restoring for seven decoders the bottleneck:
  benchmarks/results/decode-h200-v3.md).
* frames (`decode_streams`, `PoolDecoder`): the worker copies each decoded frame into a small
  ring of slots shared once with the consumer through CUDA IPC and passes the
  slot number back; the consumer reads it in place and the slot is reused once the consumer's
  GPU work on it has finished (CUDA events polled by a dispatcher thread), so at most
  `workers * slots` frames are in flight whatever the prefix length.

    with NvdecPool(workers=7) as pool:
        pool.restore_blobs(blobs, outs, decode_into=restore_chunk)  # restore_chunk(blob, out, decoder, restore)
        for stream_idx, frame_idx, frame in pool.decode_streams([(bitstream, w, h), ...]):
            consume(frame)  # (3, h, w) uint8 on the GPU, valid until the next item is requested

Every worker is a CUDA context of its own: without MPS the GPU time-slices between contexts, so a
busy pool slows a model running beside it by several percent even when the workers launch no
kernel (benchmarks/results/decode-h200-v3-probe.md); a single in-process decoder does not.
"""

from __future__ import annotations

import itertools
import logging
import os
import queue
import threading
import time
from collections.abc import Iterator, Sequence

import torch

from kvcodec.errors import BackendUnavailableError, CorruptStreamError

log = logging.getLogger(__name__)

DEFAULT_WORKERS = 7  # NVDEC engines of an H100/H200


def _worker_main(wid, device_index, slots, slot_bytes, latency, job_q, free_q, res_q, hold_output_s=0.0, warm_up=None):
    """Worker process: decode jobs from job_q into the slot ring, report slots on res_q.

    hold_output_s: keep the last restore job's output tensor (the consumer's memory, mapped through
    CUDA IPC) alive this long after the job while no other job comes. The chunks of one fetch are
    slices of one tensor, so the next chunk finds the mapping open instead of opening and closing
    the IPC handle again; the consumer cannot reuse that memory until it is released."""
    try:
        os.environ.setdefault("CUDA_MODULE_LOADING", "LAZY")
        torch.cuda.set_device(device_index)
        from kvcodec.video.nvdec import NvdecDecoder

        dec = NvdecDecoder(device_index, latency=latency, copy=False)
        try:  # e.g. load the codec's restore kernel before the first job, not during it
            if warm_up is not None:
                warm_up(torch.device("cuda", device_index))
        except Exception as e:  # the first job pays for it instead
            log.warning("NVDEC pool worker %d: warm-up failed: %s", wid, e)
        ring = torch.empty((slots, slot_bytes), dtype=torch.uint8, device=f"cuda:{device_index}")
        res_q.put(("ready", wid, ring))
    except Exception as e:  # pragma: no cover - start failures are reported to the consumer
        res_q.put(("fatal", wid, f"{type(e).__name__}: {e}"))
        return
    free = list(range(slots))
    cur = torch.cuda.current_stream(device_index)
    held = None  # the last restore target, kept mapped (see hold_output_s)
    while True:
        if held is None:
            job = job_q.get()
        else:
            try:
                job = job_q.get(timeout=hold_output_s)
            except queue.Empty:
                held = None
                continue
        if job is None:
            break
        if job[0] == "restore":
            out = _restore_job(wid, dec, job, res_q)
            held = out if hold_output_s > 0 else None
            del out, job  # otherwise the loop variable would keep the mapping open until the next job
            continue
        _frames_job(wid, dec, job, _Ring(ring, free, free_q, max(1, slots // 2), cur), slot_bytes, res_q)
        del job


class _Ring:
    """A worker's frame slots: the ring, the free slot numbers and where released ones come back."""

    def __init__(self, ring, free, free_q, flush_at, stream):
        self.ring, self.free, self.free_q, self.flush_at, self.stream = ring, free, free_q, flush_at, stream

    def take_back(self) -> None:
        while True:  # slots the consumer released meanwhile
            try:
                self.free.extend(self.free_q.get_nowait())
            except queue.Empty:
                return


def _frames_job(wid, dec, job, ring: _Ring, slot_bytes: int, res_q) -> None:
    """Decode one stream into the slot ring, reporting filled slots in batches on res_q."""
    _, jid, payload, width, height = job
    nbytes = 3 * width * height
    batch: list[tuple[int, int]] = []
    count = 0

    def flush():
        if batch:
            ring.stream.synchronize()  # the copies into the slots are done before the consumer reads them
            res_q.put(("frames", wid, jid, list(batch)))
            batch.clear()

    try:
        if nbytes > slot_bytes:
            raise CorruptStreamError(f"{width}x{height} frames exceed the pool's slot size")
        for frame in dec.decode(payload, width, height):
            if not ring.free:
                flush()
                ring.free.extend(ring.free_q.get())
            s = ring.free.pop()
            ring.stream.wait_stream(dec.stream)
            ring.ring[s, :nbytes].view(3, height, width).copy_(frame)
            batch.append((s, count))
            count += 1
            if len(batch) >= ring.flush_at or not ring.free:
                flush()
            ring.take_back()
        flush()
        res_q.put(("done", wid, jid, count))
    except Exception as e:
        flush()
        res_q.put(("error", wid, jid, f"{type(e).__name__}: {e}"))


def _restore_job(wid, dec, job, res_q) -> torch.Tensor:
    """Decode a chunk blob and restore it straight into the consumer's KV tensor (CUDA IPC) with
    the job's restore function; returns that tensor (the caller decides how long its mapping
    stays open)."""
    _, jid, blob, out, restore, decode_into = job
    try:
        decode_into(blob, out, dec, restore)
        torch.cuda.current_stream(out.device).synchronize()  # written before the consumer hears "done"
        res_q.put(("done", wid, jid, 1))
    except Exception as e:
        res_q.put(("error", wid, jid, f"{type(e).__name__}: {e}"))
    return out


class _Job:
    __slots__ = ("jid", "width", "height", "sink", "tag")

    def __init__(self, jid, width, height, sink, tag):
        self.jid, self.width, self.height, self.sink, self.tag = jid, width, height, sink, tag


class NvdecPool:
    """`workers` processes, each with its own NVDEC session, decoding streams in parallel.

    device: CUDA device of the decoders and of the frames handed out.
    slots: frame buffers per worker (frames in flight per worker).
    max_frame: (width, height) of the largest frame the pool will decode (sizes the slots).
    latency: passed to each worker's NvdecDecoder ("low" or "native").
    hold_output_s: how long a worker keeps the consumer's last output tensor mapped after a
        restore job while it waits for the next (0: unmap after every job). Chunks of one fetch
        land in one tensor, so this saves an IPC map and unmap per chunk; the consumer's allocator
        cannot reuse that memory meanwhile.
    warm_up: a module-level function(device) each worker runs once at start (the codec's kernel
        loading; kvcodec.codecs.hevc.pool.open_pool passes the HEVC restore's).
    """

    def __init__(
        self,
        workers: int = DEFAULT_WORKERS,
        device: str | torch.device | int | None = None,
        slots: int = 4,
        max_frame: tuple[int, int] = (1024, 1024),
        latency: str = "low",
        start_timeout: float = 180.0,
        hold_output_s: float = 0.05,
        warm_up=None,
    ):
        from kvcodec.video.nvdec import NvdecDecoder

        self._closed = True
        if not NvdecDecoder.is_available():
            raise BackendUnavailableError("NVDEC (PyNvVideoCodec on a CUDA GPU) is not available")
        if workers < 1 or slots < 1:
            raise ValueError("workers and slots must be >= 1")
        if hold_output_s < 0:
            raise ValueError("hold_output_s must be >= 0")
        dev = torch.device("cuda", device) if isinstance(device, int) else torch.device(device or "cuda")
        self.device = torch.device("cuda", dev.index if dev.index is not None else torch.cuda.current_device())
        self.workers = workers
        self.slots = slots
        self.slot_bytes = 3 * max_frame[0] * max_frame[1]
        ctx = torch.multiprocessing.get_context("spawn")
        self._job_q = ctx.Queue()
        self._res_q = ctx.Queue()
        self._free_q = [ctx.Queue() for _ in range(workers)]
        self._procs = [
            ctx.Process(
                target=_worker_main,
                args=(
                    w,
                    self.device.index,
                    slots,
                    self.slot_bytes,
                    latency,
                    self._job_q,
                    self._free_q[w],
                    self._res_q,
                    hold_output_s,
                    warm_up,
                ),
                daemon=True,
                name=f"kvcodec-nvdec-{w}",
            )
            for w in range(workers)
        ]
        for p in self._procs:
            p.start()
        self._rings: dict[int, torch.Tensor] = {}
        deadline = time.monotonic() + start_timeout
        while len(self._rings) < workers:
            try:
                msg = self._res_q.get(timeout=max(0.1, deadline - time.monotonic()))
            except queue.Empty:
                self._stop_workers()
                raise BackendUnavailableError("NVDEC pool workers did not start in time") from None
            if msg[0] == "fatal":
                self._stop_workers()
                raise BackendUnavailableError(f"NVDEC pool worker {msg[1]} failed to start: {msg[2]}")
            if msg[0] == "ready":
                self._rings[msg[1]] = msg[2]
        self._closed = False
        self._ids = itertools.count()
        self._jobs: dict[int, _Job] = {}
        self._pending: list[tuple[torch.cuda.Event, int, list[int]]] = []  # handed-out slots not yet released
        self._lock = threading.Lock()
        self._dispatcher = threading.Thread(target=self._dispatch, name="kvcodec-nvdec-dispatch", daemon=True)
        self._dispatcher.start()

    # -- dispatcher thread: routes worker messages to jobs, gives finished slots back ------------

    def _dispatch(self) -> None:
        while not self._closed:
            with self._lock:
                busy = bool(self._pending)
            try:
                msg = self._res_q.get(timeout=0.001 if busy else 0.02)
            except queue.Empty:
                msg = None
            except (EOFError, OSError):  # pragma: no cover - queue closed at shutdown
                return
            self._release(block=False)
            if msg is None:
                continue
            kind, wid = msg[0], msg[1]
            if kind == "fatal":  # pragma: no cover
                log.error("NVDEC pool worker %s died: %s", wid, msg[2])
                for job in list(self._jobs.values()):
                    job.sink.put(("error", job, f"worker {wid} died: {msg[2]}"))
                continue
            jid = msg[2]
            job = self._jobs.get(jid)
            if kind == "frames":
                if job is None:  # abandoned job: give the slots straight back
                    self._free_q[wid].put([s for s, _ in msg[3]])
                    continue
                job.sink.put(("frames", job, wid, msg[3]))
            elif kind in ("done", "error"):
                self._jobs.pop(jid, None)
                if job is not None:
                    job.sink.put(("done", job) if kind == "done" else ("error", job, msg[3]))

    def _release(self, block: bool) -> None:
        by_worker: dict[int, list[int]] = {}
        with self._lock:
            keep = []
            for ev, wid, slots in self._pending:
                if block:
                    ev.synchronize()
                elif not ev.query():
                    keep.append((ev, wid, slots))
                    continue
                by_worker.setdefault(wid, []).extend(slots)
            self._pending = keep
        for wid, slots in by_worker.items():
            self._free_q[wid].put(slots)

    def _hand_back(self, wid: int, slots: list[int]) -> None:
        """The consumer is done queuing GPU work on these frames: free them once that work is done."""
        ev = torch.cuda.Event()
        ev.record(torch.cuda.current_stream(self.device))
        with self._lock:
            self._pending.append((ev, wid, slots))

    # -- consumer side ---------------------------------------------------------------------------

    def submit(self, bitstream, width: int, height: int, sink: queue.Queue, tag=None) -> _Job:
        if self._closed:
            raise BackendUnavailableError("the NVDEC pool is closed")
        if 3 * width * height > self.slot_bytes:
            raise ValueError(f"{width}x{height} frames exceed the pool's max_frame")
        payload = bytes(bitstream)  # pickled through the job pipe: cheaper than a shared-memory segment per job
        job = _Job(next(self._ids), width, height, sink, tag)
        self._jobs[job.jid] = job
        self._job_q.put(("frames", job.jid, payload, width, height))
        return job

    def restore_blobs(self, blobs, outs, restore: str = "auto", *, decode_into=None) -> None:
        """Decode every chunk blob and restore it into its output tensor (a CUDA tensor on the
        pool's device, typically a slice of a KV cache) inside the workers: each worker calls
        `decode_into(blob, out, decoder, restore)` (a module-level function, pickled by name) with
        its own NVDEC session and writes `out` through CUDA IPC, so the consumer does no
        per-frame work. Returns when every output is written; raises CorruptStreamError naming
        the first chunk that failed (the others are still written)."""
        if decode_into is None:
            raise ValueError(
                "restore_blobs needs the codec's decode_into (e.g. kvcodec.codecs.hevc.pool.restore_chunk)"
            )
        if self._closed:
            raise BackendUnavailableError("the NVDEC pool is closed")
        torch.cuda.current_stream(self.device).synchronize()  # what this process queued on the outputs is done
        sink: queue.Queue = queue.Queue()
        jobs = []
        for k, (blob, out) in enumerate(zip(blobs, outs, strict=True)):
            if out.device != self.device:
                raise ValueError(f"output on {out.device}; the pool restores on {self.device}")
            job = _Job(next(self._ids), 0, 0, sink, k)
            self._jobs[job.jid] = job
            jobs.append(job)
            self._job_q.put(("restore", job.jid, bytes(blob), out, restore, decode_into))
        errors = []
        for _ in jobs:
            msg = sink.get()
            if msg[0] == "error":
                errors.append((msg[1].tag, msg[2]))
        if errors:
            tag, text = min(errors)
            raise CorruptStreamError(
                f"chunk {tag}: {text}" + (f" (and {len(errors) - 1} more)" if len(errors) > 1 else "")
            )

    def _frames(self, sink: queue.Queue, remaining: int) -> Iterator[tuple[_Job, int, torch.Tensor]]:
        """Frames of `remaining` submitted jobs feeding `sink`, as views of the slots."""
        error = None
        try:
            while remaining:
                msg = sink.get()
                if msg[0] == "frames":
                    _, job, wid, batch = msg
                    try:
                        if error is None:
                            n = 3 * job.width * job.height
                            ring = self._rings[wid]
                            for slot, idx in batch:
                                yield job, idx, ring[slot, :n].view(3, job.height, job.width)
                    finally:
                        self._hand_back(wid, [slot for slot, _ in batch])
                elif msg[0] == "done":
                    remaining -= 1
                else:
                    remaining -= 1
                    error = error or CorruptStreamError(f"stream {msg[1].tag}: {msg[2]}")
        finally:
            while remaining:  # stopped early: let the rest run out, giving slots back
                msg = sink.get()
                if msg[0] == "frames":
                    self._free_q[msg[2]].put([slot for slot, _ in msg[3]])
                else:
                    remaining -= 1
        if error is not None:
            raise error

    def decode_streams(self, streams: Sequence[tuple[object, int, int]]) -> Iterator[tuple[int, int, torch.Tensor]]:
        """Decode every (bitstream, width, height); yield (stream index, frame index, frame) as
        frames complete. A frame is a (3, height, width) uint8 view of a worker's slot on the pool's
        device, valid until the next item is requested: de-tile or copy it before then (GPU work
        queued on the current stream is waited for before the slot is reused). Frames of one stream
        come in order. Raises CorruptStreamError when a stream does not decode."""
        sink: queue.Queue = queue.Queue()
        for k, (bitstream, width, height) in enumerate(streams):
            self.submit(bitstream, width, height, sink, tag=k)
        for job, idx, frame in self._frames(sink, len(streams)):
            yield job.tag, idx, frame

    def decoder(self) -> PoolDecoder:
        return PoolDecoder(self)

    # -- lifetime --------------------------------------------------------------------------------

    def _stop_workers(self) -> None:
        self._rings.clear()  # drop the IPC mappings before the workers free the memory
        for _ in self._procs:
            self._job_q.put(None)
        for p in self._procs:
            p.join(timeout=10)
            if p.is_alive():
                p.terminate()

    def close(self) -> None:
        if self._closed:
            return
        self._release(block=True)
        self._closed = True
        self._dispatcher.join(timeout=5)
        self._stop_workers()

    def __enter__(self) -> NvdecPool:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self):  # pragma: no cover
        try:
            self.close()
        except Exception:
            pass


class PoolDecoder:
    """VideoDecoder over an NvdecPool, safe to use from several threads at once (each decode()
    call is one job). Frames are views valid until the next frame is requested."""

    name = "nvdec-pool"
    device_type = "cuda"

    def __init__(self, pool: NvdecPool):
        self.pool = pool

    @classmethod
    def is_available(cls) -> bool:
        from kvcodec.video.nvdec import NvdecDecoder

        return NvdecDecoder.is_available()

    def decode(self, bitstream, width: int, height: int) -> Iterator[torch.Tensor]:
        sink: queue.Queue = queue.Queue()
        self.pool.submit(bitstream, width, height, sink, tag=0)
        for _, _, frame in self.pool._frames(sink, 1):
            yield frame
