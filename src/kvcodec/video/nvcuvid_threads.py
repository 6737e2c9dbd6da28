"""Every NVDEC engine from the serving process: N decoder threads, one CUDA context.

Each thread owns an `NvcuvidDecoder` (its own NVDEC sessions and copy stream) and a torch CUDA
stream of its own for the restore kernel; all of them live in torch's primary context, the one
the model runs in, so the GPU never time-slices between contexts and no worker process holds a
context's memory. Chunks are restored straight into the caller's tensors.

    with NvcuvidThreads(threads=7) as dec:
        dec.restore_blobs(blobs, [kv[:, :, a:b] for a, b in ranges])  # ordered before later work
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

import torch

from kvcodec.video.nvcuvid import NvcuvidDecoder

DEFAULT_THREADS = 7  # NVDEC engines of an H100/H200


class NvcuvidThreads:
    """A pool of `threads` in-process NVDEC decoder threads on `device`.

    restore: the frame restorer the codec uses ("auto", "torch", "triton").
    display_delay: passed to each NvcuvidDecoder.
    """

    def __init__(self, threads: int = DEFAULT_THREADS, device: str | torch.device | int | None = None,
                 restore: str = "auto", display_delay: int = 1):
        if threads < 1:
            raise ValueError("threads must be >= 1")
        dev = torch.device("cuda", device) if isinstance(device, int) else torch.device(device or "cuda")
        self.device = torch.device("cuda", dev.index if dev.index is not None else torch.cuda.current_device())
        self.threads = threads
        self.restore = restore
        self.display_delay = display_delay
        self._local = threading.local()
        self._decoders: list[NvcuvidDecoder] = []
        self._lock = threading.Lock()
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="nvcuvid")
        self.workers = threads  # the name NvdecPool users read

    def _thread_state(self) -> tuple[NvcuvidDecoder, torch.cuda.Stream]:
        state = getattr(self._local, "state", None)
        if state is None:
            torch.cuda.set_device(self.device)
            dec = NvcuvidDecoder(self.device, display_delay=self.display_delay)
            state = (dec, torch.cuda.Stream(self.device))
            self._local.state = state
            with self._lock:
                self._decoders.append(dec)
        return state

    def _restore_one(self, blob, out, restore: str) -> torch.cuda.Event:
        from kvcodec import codec

        dec, stream = self._thread_state()
        with torch.cuda.device(self.device), torch.cuda.stream(stream):
            codec.decode_chunk_blob(blob, self.device, out=out, decoder=dec, restore=restore)
            done = torch.cuda.Event()
            done.record(stream)
        return done

    def restore_blobs(self, blobs: Sequence, outs: Sequence, restore: str | None = None, synchronize: bool = False) -> None:
        """Restore every chunk blob into its output (a tensor slice or PagedKV), in parallel.
        Returns once every chunk is decoded and its restore queued; the caller's current stream
        waits for them (synchronize=True also waits on the host)."""
        if len(blobs) != len(outs):
            raise ValueError("restore_blobs needs one output per blob")
        futures = [self._pool.submit(self._restore_one, b, o, restore or self.restore) for b, o in zip(blobs, outs)]
        events = [f.result() for f in futures]
        current = torch.cuda.current_stream(self.device)
        for event in events:
            current.wait_event(event)
        if synchronize:
            current.synchronize()

    def warm_up(self, blob) -> None:
        """Open every thread's NVDEC session (and compile the restore kernel) with one chunk blob,
        so the first request pays neither."""
        from kvcodec import codec

        h = codec.inspect_chunk_blob(blob)
        barrier = threading.Barrier(self.threads)

        def one():
            barrier.wait(timeout=60)  # one job per thread: every thread opens its session
            out = torch.empty(h.shape, dtype=codec.DTYPES[h.dtype], device=self.device)
            self._restore_one(blob, out, self.restore).synchronize()

        for f in [self._pool.submit(one) for _ in range(self.threads)]:
            f.result()

    def close(self) -> None:
        self._pool.shutdown(wait=True)
        with self._lock:
            for dec in self._decoders:
                dec.close()
            self._decoders.clear()

    def __enter__(self) -> NvcuvidThreads:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
