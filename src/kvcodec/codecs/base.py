"""The ChunkCodec type: what every KV chunk codec implements.

A chunk codec turns a KV tensor into self-contained chunk blobs (one per stored resolution) and
restores a blob into a caller's target: a dense slice of a KV tensor or a PagedKV. The fetcher,
the engine, the server and the integrations see only this type; the HEVC codec (CPU, NVDEC or
NVDEC process pool decoding), raw fp16, the transform codec and the benchmarks' baselines are
all ChunkCodecs, registered by name.

Data flow: encode_chunks(kv) -> EncodedChunk(blobs) -> store -> inspect_chunk(blob) (cheap,
checks the header) -> decode_chunk(blob, out) (writes every value of `out`, or raises).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Protocol, runtime_checkable

import torch

from kvcodec.dtypes import dtype_of
from kvcodec.errors import ShapeError
from kvcodec.restore.paged import PagedKV

log = logging.getLogger(__name__)

Target = torch.Tensor | PagedKV
"""Where a chunk is restored: a (layers, 2, tokens, kv_heads, head_dim) tensor (for example a
slice of a preallocated cache), or a PagedKV whose block table covers the chunk's tokens."""


@dataclasses.dataclass(frozen=True)
class EncodedChunk:
    """One chunk of tokens, as one self-contained blob per resolution (the codec's order)."""

    index: int
    start_token: int
    tokens: int
    resolutions: tuple[tuple[int, int], ...]
    blobs: tuple[bytes, ...]
    encoder: str = ""  # the coder(s) that actually ran (e.g. "x265" after an NVENC session failed)

    def blob_for(self, resolution: tuple[int, int]) -> bytes:
        return self.blobs[self.resolutions.index(tuple(resolution))]


@dataclasses.dataclass(frozen=True)
class ChunkInfo:
    """What a chunk blob's verified header says about it."""

    index: int
    start_token: int
    tokens: int
    layers: int
    kv_heads: int
    head_dim: int
    dtype: str
    codec: str
    key: str | None = None  # the chained prefix key the chunk was stored under, when bound

    @property
    def shape(self) -> tuple[int, int, int, int, int]:
        return (self.layers, 2, self.tokens, self.kv_heads, self.head_dim)


@runtime_checkable
class ChunkCodec(Protocol):
    """A KV chunk codec. `id` names the codec, its format version and every setting that changes
    the bytes it writes (it goes into chunk keys: a store never mixes codecs)."""

    id: str
    chunk_tokens: int
    resolutions: tuple[tuple[int, int], ...]

    def encode_chunks(
        self,
        kv: torch.Tensor,
        *,
        first_chunk_index: int = 0,
        keys: Sequence[str] | None = None,
        on_chunk: Callable[[EncodedChunk], None] | None = None,
    ) -> list[EncodedChunk]:
        """Chunks of `kv` (layers, 2, tokens, kv_heads, head_dim); chunk n is numbered
        first_chunk_index + n. With `keys`, chunk n's header carries keys[n] (binding it to the
        prefix it was stored under)."""
        ...

    def inspect_chunk(self, blob: bytes | memoryview) -> ChunkInfo:
        """Parse and verify a blob's header (not its payload); KVCodecError if it is not this
        codec's or is damaged."""
        ...

    def decode_chunk(self, blob: bytes | memoryview, out: Target) -> Target:
        """Restore every value of the chunk into `out` (its device decides where decoding runs)
        and return `out`; KVCodecError on any damage or mismatch, never partial silent data. `out`
        is in the chunk's stored dtype, or a tensor in one the codec restores into
        (restores_into: the values rounded once into it)."""
        ...


@runtime_checkable
class StagedDecode(Protocol):
    """An optional capability of a ChunkCodec: restoring in two halves, so that many chunks share
    one pass of the second. The fetch pipeline uses it (on CUDA, or when asked to) for codecs that
    have it: decode workers run `stage` on each chunk in parallel (the video decode, on NVDEC where
    the target is on CUDA), then the in-order restore hands every chunk ready at that moment to
    one `finish` call (the transform codec's inverse transform: a few kernels for the whole batch
    instead of per chunk). A codec without it is decoded with decode_chunk, as before.

    stage(blob, out): check the blob and the target as decode_chunk does (KVCodecError on any
        damage or mismatch) and return an opaque staged chunk; `out` is not written yet.
    finish(staged, outs): write every value of each outs[i] from staged[i] (work may still be
        queued on the target device's current stream when it returns)."""

    def stage(self, blob: bytes | memoryview, out: Target) -> object: ...

    def finish(self, staged: Sequence[object], outs: Sequence[Target]) -> None: ...


@runtime_checkable
class WarmUp(Protocol):
    """An optional capability of a ChunkCodec: compiling what its restore runs on `device` before
    the first chunk arrives (the transform codec's Triton kernels; a server calls it at start)."""

    def warm_up(self, device: torch.device | str, dtype: torch.dtype = ...) -> None: ...


@runtime_checkable
class PinnedStaging(Protocol):
    """An optional capability of a ChunkCodec: its chunks' host data reach the GPU through pinned
    blocks of one size (`pinned_block_bytes`), whatever a chunk's level and length, so that blocks
    made before the first fetch (reserve_staging) serve every fetch from torch's pinned cache."""

    def pinned_block_bytes(self) -> int: ...


def reserve_staging(codec, device: torch.device | str, blocks: int) -> float:  # noqa: ANN001
    """Make `blocks` of the codec's pinned staging blocks now and hand them to torch's pinned cache
    (codecs with the PinnedStaging capability, on CUDA): a first long fetch otherwise makes them
    one by one on its own thread (a 32k-token fetch of a 7-8B model: 73 blocks, 0.42 s,
    plan-cost-h200-s65-first-fetch.log); seconds spent. A failure is logged, never raised."""
    size = codec.pinned_block_bytes() if isinstance(codec, PinnedStaging) else 0
    if torch.device(device).type != "cuda" or size <= 0 or blocks < 1:
        return 0.0
    t0 = time.perf_counter()
    try:
        held = [torch.empty(size, dtype=torch.uint8, pin_memory=True) for _ in range(blocks)]
        del held  # never uploaded from: free for the next allocation of this size at once
    except RuntimeError as e:
        log.warning("pinned staging for %d chunks not reserved (%s); fetches pin their own", blocks, e)
    return time.perf_counter() - t0


def target_dtypes(codec) -> tuple[torch.dtype, ...]:  # noqa: ANN001
    """The dtypes `codec` restores straight into a tensor target of, beside each chunk's stored one:
    its optional `target_dtypes` (none: the stored dtype only, other targets get a staging copy)."""
    dtypes = getattr(codec, "target_dtypes", ())
    return tuple(dtypes) if isinstance(dtypes, (tuple, list, frozenset, set)) else ()


def holds_range(stored: torch.dtype, target: torch.dtype) -> bool:
    """Whether `target` holds every finite value of `stored` (float16 into bfloat16 or float32;
    bfloat16 and float32 not into float16, where they would turn to inf). Pure."""
    return torch.finfo(target).max >= torch.finfo(stored).max


def restores_into(codec, stored: torch.dtype, target: torch.dtype) -> bool:  # noqa: ANN001
    """Whether `codec` restores a chunk stored in `stored` straight into a tensor of `target`."""
    return target == stored or (target in target_dtypes(codec) and holds_range(stored, target))


def narrowed_checked(kv: torch.Tensor, into: torch.dtype, what: str) -> torch.Tensor:
    """`kv` as a copy into `into` may take it: itself where `into` holds its range (the copy casts),
    else cast to `into` (bfloat16 chunks into float16), a ShapeError where a finite value would turn
    to inf: the values cannot tell a real one from a lossy codec's overshoot of the edge, and inf in
    a KV cache is silent wrong data."""
    if holds_range(kv.dtype, into):
        return kv
    narrowed = kv.to(into)
    if bool((torch.isinf(narrowed) & torch.isfinite(kv)).any()):
        raise ShapeError(
            f"{what} restores {kv.dtype} values beyond the range of the target's {into} (stored so, or a lossy"
            f" codec's overshoot of values near its edge); fetch it into {kv.dtype} or wider"
        )
    return narrowed


def stored_dtype(info: ChunkInfo) -> torch.dtype:
    """The dtype a chunk's header says its KV was stored in."""
    return dtype_of(info.dtype, "chunk dtype")


def decode_chunk_as(
    codec: ChunkCodec,
    blob: bytes | memoryview,
    shape: tuple[int, ...],
    dtype: torch.dtype,
    device: torch.device | str,
    what: str,
    info: ChunkInfo | None = None,
) -> torch.Tensor:
    """A chunk's KV (L, 2, tokens, H, D) in `dtype` on `device`: restored straight into it where the
    codec can (restores_into), else in the chunk's stored dtype, then cast (narrowed_checked). A
    ShapeError unless the chunk holds `shape`. `info`: the blob's inspect_chunk, where the caller has it."""
    if dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise ShapeError(f"{what}: a {dtype} target is not one kvcodec restores into (float16, bfloat16, float32)")
    info = info or codec.inspect_chunk(blob)
    if info.shape != tuple(shape):
        raise ShapeError(f"{what} holds {info.shape}; the target takes {tuple(shape)}")
    stored = stored_dtype(info)
    into = dtype if restores_into(codec, stored, dtype) else stored
    out = torch.empty(info.shape, dtype=into, device=device)
    return narrowed_checked(codec.decode_chunk(blob, out), dtype, what).to(dtype)


def warm_up_codec(codec, device: torch.device | str, dtype: torch.dtype = torch.float16) -> float:
    """Compile `codec`'s restore kernels for `dtype` on a CUDA `device` now (codecs with the WarmUp
    capability), and for each other half-precision dtype whose chunks it cannot restore into
    `dtype` (restores_into): those restore into staging of their stored dtype (an HEVC chunk stored
    in float16, as `extract` writes KV, for a bfloat16 engine), whose kernels otherwise compiled
    during timed fetches (0.4-0.7 s each on an H200, fetch-h200-s56-stalls); seconds spent. A
    failure is logged, never raised: the first restore then compiles them, or falls back as it
    would have."""
    if torch.device(device).type != "cuda" or not isinstance(codec, WarmUp):
        return 0.0
    t0 = time.perf_counter()
    staged = [d for d in (torch.float16, torch.bfloat16) if not restores_into(codec, d, dtype)]
    for each in dict.fromkeys((dtype, *staged)):
        try:
            codec.warm_up(device, each)
        except Exception as e:  # noqa: BLE001 - serving goes on; the first restore pays or falls back
            log.warning(
                "restore warm-up for %s failed (%s: %s); the first restore compiles the kernels",
                each, type(e).__name__, e,
            )  # fmt: skip
    return time.perf_counter() - t0


def check_keys(keys: Sequence[str] | None, chunks: int) -> None:
    """ShapeError unless `keys`, when given, holds one key per chunk (encode_chunks' `keys`)."""
    if keys is not None and len(keys) != chunks:
        raise ShapeError(f"{len(keys)} keys given for {chunks} chunks")


def chunk_key(keys: Sequence[str] | None, n: int) -> str | None:
    """The key chunk n is bound to: keys[n], or None without keys."""
    return None if keys is None else str(keys[n])


def token_chunks(
    kv: torch.Tensor, chunk_tokens: int, first_chunk_index: int = 0, keys: Sequence[str] | None = None
) -> Iterator[tuple[torch.Tensor, int, int, str | None]]:
    """(its KV, index, start_token, key) of each chunk of `kv` (layers, 2, tokens, kv_heads,
    head_dim) cut every `chunk_tokens` tokens, each chunk's KV contiguous; the key count is checked
    at once, before any chunk is cut."""
    starts = range(0, kv.shape[2], chunk_tokens)
    check_keys(keys, len(starts))
    return (
        (
            kv[:, :, start : start + chunk_tokens].contiguous(),
            first_chunk_index + n,
            first_chunk_index * chunk_tokens + start,
            chunk_key(keys, n),
        )
        for n, start in enumerate(starts)
    )


def collect_chunks(
    chunks: Iterable[EncodedChunk], on_chunk: Callable[[EncodedChunk], None] | None = None
) -> list[EncodedChunk]:
    """`chunks` in order as a list, each handed to `on_chunk` as soon as it is made (what
    encode_chunks returns)."""
    out = []
    for chunk in chunks:
        out.append(chunk)
        if on_chunk:
            on_chunk(chunk)
    return out
