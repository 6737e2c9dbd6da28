"""The CUDA streams a restore runs on, made in one place so that their priority is one setting.

At the device's highest priority the scheduler would hand the restore's blocks the next free SMs
ahead of a model's kernels. Measured on an H200 beside a loop of 8192x8192 bf16 matmuls it gained
nothing (int8 at 2048 and 8192 tokens, transform 5x at 2048: the same restore rate under the matmul,
1.0-1.5 GB/s) and cost the matmul 3.5-4.9% against 3.0-3.3% at 8192 tokens
[benchmarks/results/fetch-h200-issue21-priority]: the default priority stays.
"""

from __future__ import annotations

import threading

import torch

HIGHEST = -(1 << 16)  # torch maps a priority beyond the device's range to its nearest end
PRIORITY = 0  # the default priority; fetch_restore's -hipri compares HIGHEST in the same run

_threads = threading.local()  # .streams: {(device, priority): this thread's restore stream}


def restore_stream(device: torch.device | int | str) -> torch.cuda.Stream:
    """A CUDA stream on `device` for restore work, at PRIORITY."""
    return torch.cuda.Stream(device, priority=PRIORITY)


def thread_restore_stream(device: torch.device) -> torch.cuda.Stream:
    """This thread's restore stream on `device` (a CUDA device with its index), made once and kept.
    Torch's caching allocator keeps freed memory for the stream it was allocated on: a new stream
    per fetch (torch hands out 32 in turn) left every fetch's output and scratch reserved on its
    stream, 3-6 GB more after each fetch of a 7-8B model's 8k-32k tokens
    [benchmarks/results/fetch-h200-s47-memory]."""
    streams = getattr(_threads, "streams", None)
    if streams is None:
        streams = _threads.streams = {}
    stream = streams.get((device, PRIORITY))
    if stream is None:
        stream = streams[device, PRIORITY] = restore_stream(device)
    return stream
