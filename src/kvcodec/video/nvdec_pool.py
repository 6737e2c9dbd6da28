"""A pool of NVDEC decoders, one per worker process, to keep all of a GPU's decode engines busy.

One NVDEC session decodes on one engine at a time, and sessions driven by threads of one process do
not scale (the driver serialises them), so the pool runs one `NvdecDecoder` in each of `workers`
processes (spawned once, reused). Streams go to the workers through a shared job queue, their bytes
in shared host memory (no pickling of the payload). Each worker owns a small ring of frame slots in
GPU memory, shared once with the consumer through CUDA IPC; it copies each decoded frame into a free
slot and passes the slot number back. The consumer reads the frame in place (no copy) and the slot
goes back to the worker once the consumer's GPU work on it has finished (a CUDA event per slot), so
at most `workers * slots` frames are in flight and staging memory does not grow with the prefix.

    with NvdecPool(workers=7) as pool:
        for stream_idx, frame_idx, frame in pool.decode_streams([(bitstream, w, h), ...]):
            consume(frame)   # (3, h, w) uint8 on the GPU, valid until the next item is requested

Frames of one stream arrive in order; frames of different streams interleave.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from collections.abc import Iterator, Sequence

import numpy as np
import torch

from kvcodec.errors import BackendUnavailableError, CorruptStreamError

log = logging.getLogger(__name__)

DEFAULT_WORKERS = 7  # NVDEC engines of an H100/H200; more processes than engines still help a little


def _worker_main(wid, device_index, slots, slot_bytes, latency, job_q, free_q, res_q):
    """Worker process: decode jobs from job_q into the slot ring, report slots on res_q."""
    try:
        os.environ.setdefault("CUDA_MODULE_LOADING", "LAZY")
        torch.cuda.set_device(device_index)
        from kvcodec.video.nvdec import NvdecDecoder

        dec = NvdecDecoder(device_index, latency=latency, copy=False)
        ring = torch.empty((slots, slot_bytes), dtype=torch.uint8, device=f"cuda:{device_index}")
        res_q.put(("ready", wid, ring))
    except Exception as e:  # pragma: no cover - start failures are reported to the consumer
        res_q.put(("fatal", wid, f"{type(e).__name__}: {e}"))
        return
    free = list(range(slots))
    flush_at = max(1, slots // 2)
    cur = torch.cuda.current_stream(device_index)
    while True:
        job = job_q.get()
        if job is None:
            break
        jid, payload, width, height = job
        nbytes = 3 * width * height
        batch: list[tuple[int, int]] = []
        count = 0

        def flush():
            if batch:
                cur.synchronize()  # copies into the slots are done before the consumer reads them
                res_q.put(("frames", wid, jid, list(batch)))
                batch.clear()

        try:
            if nbytes > slot_bytes:
                raise CorruptStreamError(f"{width}x{height} frames exceed the pool's slot size {slot_bytes}")
            data = payload.numpy()
            for frame in dec.decode(data, width, height):
                if not free:
                    flush()
                    free.extend(free_q.get())
                s = free.pop()
                cur.wait_stream(dec.stream)
                ring[s, :nbytes].view(3, height, width).copy_(frame)
                dec.stream.wait_stream(cur)
                batch.append((s, count))
                count += 1
                if len(batch) >= flush_at or not free:
                    flush()
                while True:  # take back slots the consumer has released meanwhile
                    try:
                        free.extend(free_q.get_nowait())
                    except queue.Empty:
                        break
            flush()
            res_q.put(("done", wid, jid, count))
        except Exception as e:
            flush()
            res_q.put(("error", wid, jid, f"{type(e).__name__}: {e}"))
        del payload


class NvdecPool:
    """`workers` processes, each with its own NVDEC session, decoding streams in parallel.

    device: CUDA device of the decoders and of the frames handed out.
    slots: frame buffers per worker (frames in flight); the consumer holds at most one of them.
    max_frame: (width, height) of the largest frame the pool will decode (sizes the slots).
    """

    def __init__(
        self,
        workers: int = DEFAULT_WORKERS,
        device: str | torch.device | int | None = None,
        slots: int = 4,
        max_frame: tuple[int, int] = (1024, 1024),
        latency: str = "low",
        start_timeout: float = 120.0,
    ):
        from kvcodec.video.nvdec import NvdecDecoder

        if not NvdecDecoder.is_available():
            raise BackendUnavailableError("NVDEC (PyNvVideoCodec on a CUDA GPU) is not available")
        if workers < 1 or slots < 1:
            raise ValueError("workers and slots must be >= 1")
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
                args=(w, self.device.index, slots, self.slot_bytes, latency, self._job_q, self._free_q[w], self._res_q),
                daemon=True,
                name=f"kvcodec-nvdec-{w}",
            )
            for w in range(workers)
        ]
        for p in self._procs:
            p.start()
        self._rings: dict[int, torch.Tensor] = {}
        self._events = {}
        self._lock = threading.Lock()  # one decode_streams at a time
        deadline = time.monotonic() + start_timeout
        while len(self._rings) < workers:
            try:
                msg = self._res_q.get(timeout=max(0.1, deadline - time.monotonic()))
            except queue.Empty:
                self.close()
                raise BackendUnavailableError("NVDEC pool workers did not start in time") from None
            if msg[0] == "fatal":
                self.close()
                raise BackendUnavailableError(f"NVDEC pool worker {msg[1]} failed to start: {msg[2]}")
            if msg[0] == "ready":
                self._rings[msg[1]] = msg[2]
        self._closed = False

    # -- consumer side ---------------------------------------------------------------------------

    def decode_streams(self, streams: Sequence[tuple[object, int, int]]) -> Iterator[tuple[int, int, torch.Tensor]]:
        """Decode every (bitstream, width, height) in `streams`; yield (stream index, frame index,
        frame) as frames complete. A frame is a (3, height, width) uint8 view of a worker's slot on
        the pool's device, valid until the next item is requested: de-tile or copy it before then.
        GPU work queued on the current stream against the frame is waited for before the slot is
        reused. Raises CorruptStreamError when a stream does not decode."""
        if self._closed:
            raise BackendUnavailableError("the NVDEC pool is closed")
        if not self._lock.acquire(blocking=False):
            raise RuntimeError("NvdecPool.decode_streams is already running (one consumer at a time)")
        try:
            yield from self._decode_streams(streams)
        finally:
            self._lock.release()

    def _decode_streams(self, streams):
        sizes = []
        todo = len(streams)
        for jid, (bitstream, width, height) in enumerate(streams):
            if 3 * width * height > self.slot_bytes:
                raise ValueError(f"{width}x{height} frames exceed the pool's max_frame")
            src = np.frombuffer(bitstream, dtype=np.uint8)
            payload = torch.empty(src.size, dtype=torch.uint8).share_memory_()
            payload.numpy()[:] = src
            sizes.append((width, height))
            self._job_q.put((jid, payload, width, height))
        pending: list[tuple[torch.cuda.Event, int, int]] = []  # (event, worker, slot) awaiting release
        stream = torch.cuda.current_stream(self.device)
        error = None
        try:
            while todo:
                try:
                    msg = self._res_q.get_nowait()
                except queue.Empty:
                    self._release(pending, wait=True)
                    msg = self._res_q.get()
                kind, wid = msg[0], msg[1]
                if kind == "frames":
                    _, _, jid, batch = msg
                    width, height = sizes[jid]
                    nbytes = 3 * width * height
                    ring = self._rings[wid]
                    for slot, idx in batch:
                        if error is None:
                            yield jid, idx, ring[slot, :nbytes].view(3, height, width)
                        ev = torch.cuda.Event()
                        ev.record(stream)
                        pending.append((ev, wid, slot))
                    self._release(pending, wait=False)
                elif kind == "done":
                    todo -= 1
                elif kind == "error":
                    todo -= 1
                    error = error or CorruptStreamError(f"stream {msg[2]}: {msg[3]}")
                elif kind == "fatal":  # pragma: no cover
                    raise BackendUnavailableError(f"NVDEC pool worker {wid} died: {msg[2]}")
        finally:
            # drain what is still in flight (consumer stopped early, or an error): give slots back
            self._release(pending, wait=True)
            while todo:
                msg = self._res_q.get()
                if msg[0] == "frames":
                    self._free_q[msg[1]].put([slot for slot, _ in msg[3]])
                elif msg[0] in ("done", "error"):
                    todo -= 1
                elif msg[0] == "fatal":  # pragma: no cover
                    break
        if error is not None:
            raise error

    def _release(self, pending: list, wait: bool) -> None:
        by_worker: dict[int, list[int]] = {}
        keep = []
        for ev, wid, slot in pending:
            if wait:
                ev.synchronize()
            elif not ev.query():
                keep.append((ev, wid, slot))
                continue
            by_worker.setdefault(wid, []).append(slot)
        pending[:] = keep
        for wid, slots in by_worker.items():
            self._free_q[wid].put(slots)

    # -- lifetime --------------------------------------------------------------------------------

    def close(self) -> None:
        if getattr(self, "_closed", False):
            return
        self._closed = True
        self._rings.clear()  # drop the IPC mappings before the workers free the memory
        for _ in self._procs:
            self._job_q.put(None)
        for p in self._procs:
            p.join(timeout=10)
            if p.is_alive():
                p.terminate()
        self._rings.clear()

    def __enter__(self) -> "NvdecPool":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self):  # pragma: no cover
        try:
            self.close()
        except Exception:
            pass
