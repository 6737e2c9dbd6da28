"""Every NVDEC engine from the serving process: decoder threads in one CUDA context.

`sessions` NvcuvidDecoders (one NVDEC session per frame size each, default one per engine) are
shared by `threads` worker threads (default one per session). A worker holds a decoder only while
frames come out of it: a chunk's host-side preparation (header, zstd, uploads of side streams)
runs without one. (More threads than sessions, meant to keep engines busy while chunks are being
prepared, restored no faster on the H200 and slowed a concurrent matmul more:
benchmarks/results/decode-h200-nvcuvid.md.) Every worker
restores on a CUDA stream of its own, and everything lives in torch's primary context, the one the
model runs in: the GPU never time-slices between contexts and no worker process holds a context's
memory. Chunks are restored straight into the caller's tensors.

    with NvcuvidThreads() as dec:
        dec.restore_blobs(blobs, [kv[:, :, a:b] for a, b in ranges])  # ordered before later work
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor

import torch

from kvcodec.errors import wait_all
from kvcodec.video.nvcuvid import NvcuvidDecoder
from kvcodec.video.streams import thread_restore_stream

DEFAULT_SESSIONS = 7  # NVDEC engines of an H100/H200
# NVDEC engines per GPU (the vendor's NVDEC support matrix), by a substring of the device name; a
# GPU not listed gets DEFAULT_ENGINES (sessions beyond the engines share them: memory, not errors).
ENGINES_BY_NAME = (("H100", 7), ("H200", 7), ("H800", 7), ("H20", 7), ("GH200", 7), ("B200", 7), ("B100", 7))
ENGINES_BY_NAME += (("A100", 5), ("A800", 5), ("A30", 4), ("A10", 2), ("L40", 3), ("L4", 4), ("T4", 2))
DEFAULT_ENGINES = 4


def engines_for_name(name: str) -> int:
    """NVDEC engines of a GPU called `name` (torch.cuda.get_device_name), DEFAULT_ENGINES if unknown."""
    for part, engines in ENGINES_BY_NAME:
        if part in name:
            return engines
    return DEFAULT_ENGINES


def nvdec_engines(device: str | torch.device | int | None = None) -> int:
    """NVDEC engines of a CUDA device: how many decoder sessions keep it busy (0: no CUDA device)."""
    if not torch.cuda.is_available():
        return 0
    dev = torch.device("cuda", device) if isinstance(device, int) else torch.device(device or "cuda")
    return engines_for_name(torch.cuda.get_device_name(dev.index or 0))


class _LentDecoder:
    """A VideoDecoder that borrows one of the shared decoders for the frames of one stream."""

    name = "nvcuvid"
    device_type = "cuda"

    def __init__(self, idle: queue.Queue):
        self._idle = idle

    def decode(self, bitstream, width: int, height: int) -> Iterator[torch.Tensor]:
        dec = self._idle.get()
        try:
            yield from dec.decode(bitstream, width, height)
        finally:
            self._idle.put(dec)


class NvcuvidThreads:
    """In-process NVDEC: `sessions` decoders shared by `threads` worker threads on `device`.

    restore: the frame restorer the codec uses ("auto", "torch", "triton").
    display_delay: passed to each NvcuvidDecoder.
    """

    def __init__(
        self,
        sessions: int = DEFAULT_SESSIONS,
        threads: int | None = None,
        device: str | torch.device | int | None = None,
        restore: str = "auto",
        display_delay: int = 1,
    ):
        if sessions < 1 or (threads is not None and threads < 1):
            raise ValueError("sessions and threads must be >= 1")
        dev = torch.device("cuda", device) if isinstance(device, int) else torch.device(device or "cuda")
        self.device = torch.device("cuda", dev.index if dev.index is not None else torch.cuda.current_device())
        self.sessions = sessions
        self.threads = threads or sessions
        self.restore = restore
        self.decoders = [NvcuvidDecoder(self.device, display_delay=display_delay) for _ in range(sessions)]
        self._idle: queue.Queue = queue.Queue()
        for dec in self.decoders:
            self._idle.put(dec)
        self._taking = threading.Lock()
        self._pool = ThreadPoolExecutor(
            max_workers=self.threads,
            thread_name_prefix="nvcuvid",
            initializer=torch.cuda.set_device,
            initargs=(self.device,),
        )
        self.workers = sessions  # what NvdecPool users read: engines kept busy
        self.name = "nvcuvid-threads"

    def _restore_one(self, blob, out, restore: str, decode_into) -> torch.cuda.Event:
        stream = thread_restore_stream(self.device)
        with torch.cuda.device(self.device), torch.cuda.stream(stream):
            decode_into(blob, out, _LentDecoder(self._idle), restore)
            done = torch.cuda.Event()
            done.record(stream)
        return done

    def restore_blobs(
        self, blobs: Sequence, outs: Sequence, restore: str | None = None, synchronize: bool = False, *, decode_into
    ) -> None:
        """Restore every chunk blob into its output (a tensor slice or PagedKV), in parallel.
        Returns once every chunk is decoded and its restore queued; the caller's current stream
        waits for them (synchronize=True also waits on the host). A chunk that fails raises its
        error here after the others are done. decode_into(blob, out, decoder, restore): the
        codec's chunk restore (kvcodec.codecs.hevc.pool.restore_chunk for HEVC), as NvdecPool takes it,
        so this object can stand where an NvdecPool does."""
        if len(blobs) != len(outs):
            raise ValueError("restore_blobs needs one output per blob")
        restore = restore or self.restore
        futures = [self._pool.submit(self._restore_one, b, o, restore, decode_into) for b, o in zip(blobs, outs)]
        current = torch.cuda.current_stream(self.device)
        for f in futures:  # the chunks restored before a failure are waited for all the same
            if f.exception() is None:
                current.wait_event(f.result())
        if synchronize:
            current.synchronize()
        f = None
        wait_all(futures)  # a chunk's failure, raised once every chunk has finished

    def run_sessions(self, work: Callable[[list[NvcuvidDecoder]], None], drivers: int | None = None) -> list[Future]:
        """work(decoders) on `drivers` worker threads (default and at most: one per session, and no
        more than `threads`), the sessions shared out among them; each thread holds its decoders for
        the whole call and runs on its own CUDA stream. For callers that stream many chunks through
        each session (NvcuvidDecoder.decode_each) and pull the chunks themselves; fewer threads
        than sessions means less contention for the interpreter lock. Returns the futures at once."""
        n = max(1, min(drivers or self.sessions, self.sessions, self.threads))
        shares = [self.sessions // n + (1 if k < self.sessions % n else 0) for k in range(n)]

        def one(count: int) -> None:
            with self._taking:  # all of a share at once: two callers never each hold part of what they wait for
                decs = [self._idle.get() for _ in range(count)]
            try:
                with torch.cuda.device(self.device), torch.cuda.stream(thread_restore_stream(self.device)):
                    work(decs)
            finally:
                for dec in decs:
                    self._idle.put(dec)

        return [self._pool.submit(one, count) for count in shares]

    def warm_up(self, decode_one) -> None:
        """Open every decoder's NVDEC session and load the restore kernel before requests come:
        decode_one(decoder) decodes one chunk with the given decoder (the codec hands it in, as it
        hands in decode_into)."""

        def one(dec):
            torch.cuda.set_device(self.device)
            decode_one(dec)
            torch.cuda.current_stream(self.device).synchronize()

        with ThreadPoolExecutor(max_workers=self.sessions) as ex:
            wait_all([ex.submit(one, dec) for dec in self.decoders])

    def close(self) -> None:
        self._pool.shutdown(wait=True)
        for dec in self.decoders:
            dec.close()

    def __enter__(self) -> NvcuvidThreads:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
