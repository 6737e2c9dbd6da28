"""HEVC chunks decoded in an NvdecPool (kvcodec.video.nvdec_pool): the pool runs one NVDEC
decoder per worker process; this module hands it the codec's own chunk restore, which each
worker runs with its decoder straight into the caller's tensor (CUDA IPC).

    with open_pool(workers=7) as pool:
        kv = decode_parallel(kvc_bytes, pool)   # a whole .kvc file, chunks restored in parallel
        codec = HevcCodec(config, pool=pool)    # a ChunkCodec whose restores run in the pool
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch

from kvcodec.codecs.hevc.codec import HevcCodec
from kvcodec.codecs.hevc.decode import chunk_parts, decode_chunk_blob, inspect_chunk_blob
from kvcodec.codecs.hevc.file import file_chunks
from kvcodec.config import CodecConfig
from kvcodec.dtypes import DTYPES
from kvcodec.errors import ConfigError, wait_all


def warm_up_restore(device: torch.device) -> None:
    """Load the fused restore kernel (run once in each pool worker at start)."""
    from kvcodec.restore import triton_restore

    if triton_restore.available():
        triton_restore.warm_up(device)


def open_pool(workers: int | None = None, **options: Any) -> Any:
    """An NvdecPool whose workers load the HEVC restore kernel at start."""
    from kvcodec.video.nvdec_pool import DEFAULT_WORKERS, NvdecPool

    return NvdecPool(workers=workers or DEFAULT_WORKERS, warm_up=warm_up_restore, **options)


def decode_engines(device) -> int:
    """NVDEC engines of a CUDA `device` (video.nvcuvid_threads.nvdec_engines): the decode sessions a
    fetch on it runs by default; 0 without CUDA."""
    from kvcodec.video.nvcuvid_threads import nvdec_engines

    return nvdec_engines(device)


def open_threads(sessions: int | None = None, *, warm_blob=None, **options: Any) -> Any:
    """NVDEC sessions on threads of this process, in its own CUDA context (video.nvcuvid_threads),
    standing where an NvdecPool does; with `warm_blob`, every session is opened on it first."""
    from kvcodec.video.nvcuvid_threads import DEFAULT_SESSIONS, NvcuvidThreads

    threads = NvcuvidThreads(sessions or DEFAULT_SESSIONS, **options)
    if warm_blob is not None:
        info = inspect_chunk_blob(warm_blob)
        dtype = DTYPES[info.dtype]

        def decode_one(decoder):
            out = torch.empty(info.shape, dtype=dtype, device=threads.device)
            restore_chunk(warm_blob, out, decoder, threads.restore)

        threads.warm_up(decode_one)
    return threads


def restore_chunk(blob, out, decoder, restore: str = "auto") -> None:
    """What a pool worker runs per chunk (picklable by reference: the pool's worker processes
    import it by name)."""
    decode_chunk_blob(blob, out=out, decoder=decoder, restore=restore)


def restore_in_pool(pool: Any, blobs, outs, restore: str = "auto") -> None:
    """Every (blob, out) decoded and restored inside the pool's workers."""
    pool.restore_blobs(blobs, outs, restore=restore, decode_into=restore_chunk)


def decode_parallel(
    data,
    pool: Any,
    *,
    resolution: tuple[int, int] | None = None,
    out: torch.Tensor | None = None,
    threads: int | None = None,
    restore: str = "auto",
    where: str = "workers",
) -> torch.Tensor:
    """Decode a kvcodec file (.kvc bytes) on `pool`'s GPU, its chunks in parallel, each restored
    frame by frame into its token range of the output KV tensor (see decode_blobs_parallel)."""
    out, chunks = file_chunks(data, pool.device, resolution=resolution, out=out)
    jobs = [part for blob, target in chunks for part in chunk_parts(blob, target)]
    decode_blobs_parallel(
        [b for b, _ in jobs], [t for _, t in jobs], pool, threads=threads, restore=restore, where=where
    )
    return out


def decode_blobs_parallel(
    blobs, outs, pool: Any, threads: int | None = None, restore: str = "auto", where: str = "workers"
) -> None:
    """Restore every (blob, target) pair through the pool; returns when every target is written.

    where="workers" (default): each worker decodes and restores whole chunks into the targets.
    where="consumer": the codec's decode runs here in up to `threads` threads (default 2 per
    worker), frames coming from the workers' rings."""
    if where == "workers":
        restore_in_pool(pool, blobs, outs, restore=restore)
        return
    if where != "consumer":
        raise ConfigError("where must be 'workers' or 'consumer'")
    dec = pool.decoder()

    def run(job):
        blob, target = job
        with torch.cuda.device(pool.device):
            decode_chunk_blob(blob, pool.device, out=target, decoder=dec, restore=restore)
            torch.cuda.current_stream(pool.device).synchronize()

    with ThreadPoolExecutor(max_workers=threads or 2 * pool.workers) as ex:
        wait_all([ex.submit(run, j) for j in zip(blobs, outs)])


def PoolCodec(pool: Any, restore: str = "auto", config: CodecConfig | None = None) -> HevcCodec:  # noqa: N802
    """The HEVC codec decoding in `pool` (kept for callers of the earlier class of this name)."""
    return HevcCodec(config or CodecConfig(), pool=pool, restore=restore)
