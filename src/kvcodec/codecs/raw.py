"""RawCodec: KV chunks as their own bytes (optionally zstd or lz4), the "raw fp16 KV over the same
link" baseline. Same chunking, store layout, pipeline and checksums as the HEVC codec.

Resolution j of the codec stores payload variant ``variants[j % len(variants)]`` ("raw", "zstd",
"lz4"): real size / decode-speed trade-offs that exercise the resolution policies without the
video codec. Blobs use kvcodec's container envelope (docs/FORMAT.md) with magic "KVRW" and one
payload whose length and CRC32 the header names.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
from collections.abc import Callable, Sequence

import numpy as np
import torch

from kvcodec.codecs.base import ChunkInfo, EncodedChunk, Target, collect_chunks, token_chunks
from kvcodec.config import resolution_pairs, whole_number
from kvcodec.container.format import crc32, object_version, read_object, write_object
from kvcodec.dtypes import DTYPE_NAMES, SAME_SIZE_INT, dtype_of
from kvcodec.errors import ChecksumError, ConfigError, FormatError, ShapeError, TruncatedError
from kvcodec.restore.paged import PagedKV

MAGIC = b"KVRW"
FORMAT_NAME = "kvcodec-raw-chunk"
VARIANTS = ("raw", "zstd", "lz4")
HEADER_FIELDS = frozenset(
    {"format", "index", "start_token", "shape", "dtype", "resolution", "variant", "raw_bytes", "payload_bytes"}
    | {"crc32", "key"}
)  # all required but `key` (docs/FORMAT.md)
ZSTD_LEVELS = (-7, 22)  # zstd's fast levels, its default (0) and its strongest


NUMPY_INT = {torch.int16: np.int16, torch.int32: np.int32}
MAX_EXPANSION = 1 << 16  # a payload may announce at most this many times its size (forged headers)


def _is_count(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


@dataclasses.dataclass(frozen=True)
class RawCodec:
    """variants: payload coding per resolution slot; resolutions: the slots' labels (default one
    per variant); chunk_tokens: tokens per chunk."""

    variants: tuple[str, ...] = ("raw",)
    zstd_level: int = 3
    chunk_tokens: int = 256
    resolutions: tuple[tuple[int, int], ...] = ()

    def __post_init__(self) -> None:
        variants = self.variants.split(",") if isinstance(self.variants, str) else self.variants  # "raw,zstd"
        object.__setattr__(self, "variants", tuple(v.strip() if isinstance(v, str) else v for v in variants))
        bad = [v for v in self.variants if v not in VARIANTS]
        if bad or not self.variants:
            raise ConfigError(f"raw codec variants {list(self.variants)}: expected some of {', '.join(VARIANTS)}")
        object.__setattr__(self, "zstd_level", whole_number(self.zstd_level, "zstd_level"))
        if not ZSTD_LEVELS[0] <= self.zstd_level <= ZSTD_LEVELS[1]:
            raise ConfigError(f"zstd_level must be in {ZSTD_LEVELS[0]}..{ZSTD_LEVELS[1]}; got {self.zstd_level}")
        object.__setattr__(self, "chunk_tokens", whole_number(self.chunk_tokens, "chunk_tokens"))
        if self.chunk_tokens < 1:
            raise ConfigError(f"chunk_tokens must be >= 1; got {self.chunk_tokens}")
        res = self.resolutions or tuple((256 << j, 256 << j) for j in range(len(self.variants)))
        object.__setattr__(self, "resolutions", resolution_pairs(res))

    @property
    def id(self) -> str:
        spec = [list(self.variants), self.zstd_level, int(self.chunk_tokens), [list(r) for r in self.resolutions]]
        return "raw-v2-" + hashlib.blake2b(json.dumps(spec).encode(), digest_size=8).hexdigest()

    def with_config(self, config) -> RawCodec:
        """This codec with the chunking and resolution slots of a CodecConfig."""
        return dataclasses.replace(self, chunk_tokens=config.chunk_tokens, resolutions=config.resolutions)

    # -- encode ------------------------------------------------------------------------------
    def _pack(self, payload: bytes, variant: str) -> bytes:
        if variant == "zstd":
            import zstandard

            return zstandard.ZstdCompressor(level=self.zstd_level).compress(payload)
        if variant == "lz4":
            import lz4.frame

            return lz4.frame.compress(payload)
        return payload

    def encode_chunks(
        self,
        kv: torch.Tensor,
        *,
        first_chunk_index: int = 0,
        keys: Sequence[str] | None = None,
        on_chunk: Callable[[EncodedChunk], None] | None = None,
    ) -> list[EncodedChunk]:
        if (
            not isinstance(kv, torch.Tensor)
            or kv.dim() != 5
            or kv.shape[1] != 2
            or kv.dtype not in DTYPE_NAMES
            or kv.is_meta
        ):
            raise ShapeError(
                f"KV must be (layers, 2, tokens, kv_heads, head_dim) fp16/bf16/fp32; got "
                f"{tuple(getattr(kv, 'shape', ()))} {getattr(kv, 'dtype', type(kv).__name__)}"
            )
        parts = token_chunks(kv.detach().to("cpu"), int(self.chunk_tokens), first_chunk_index, keys)
        return collect_chunks((self._chunk(*part) for part in parts), on_chunk)

    def _chunk(self, x: torch.Tensor, index: int, start_token: int, key: str | None) -> EncodedChunk:
        raw = x.view(torch.uint8).numpy().tobytes()
        blobs = []
        for j, res in enumerate(self.resolutions):
            variant = self.variants[j % len(self.variants)]
            payload = self._pack(raw, variant)
            header = {
                "format": FORMAT_NAME,
                "index": index,
                "start_token": start_token,
                "shape": list(x.shape),
                "dtype": DTYPE_NAMES[x.dtype],
                "resolution": list(res),
                "variant": variant,
                "raw_bytes": len(raw),
                "payload_bytes": len(payload),
                "crc32": crc32(payload),
                "key": key,
            }
            blobs.append(write_object(MAGIC, header, [payload]))
        return EncodedChunk(index, start_token, x.shape[2], self.resolutions, tuple(blobs), encoder="raw")

    # -- decode ------------------------------------------------------------------------------
    def inspect_chunk(self, blob: bytes | memoryview) -> ChunkInfo:
        """The chunk's checked header; its payload's checksum is decode_chunk's (one pass over it per fetch)."""
        h, _ = parse_chunk(blob, verify_payload=False)
        L, _, T, H, D = h["shape"]
        return ChunkInfo(int(h["index"]), int(h["start_token"]), T, L, H, D, h["dtype"], "raw", h["key"])

    def _unpack(self, h: dict, payload: memoryview) -> bytes | memoryview:
        """The chunk's value bytes: the payload itself (raw), else decompressed."""
        try:
            if h["variant"] == "zstd":
                import zstandard

                return zstandard.ZstdDecompressor().decompress(payload, max_output_size=h["raw_bytes"])
            if h["variant"] == "lz4":
                import lz4.frame

                return lz4.frame.LZ4FrameDecompressor().decompress(payload, max_length=h["raw_bytes"])
        except Exception as e:  # zstd/lz4 errors: a damaged payload whose CRC was forged
            raise FormatError(f"raw chunk payload does not decompress: {e}") from e
        return payload

    def decode_chunk(self, blob: bytes | memoryview, out: Target) -> Target:
        """Checks the header and the payload's CRC32 before a value is written, then one bulk copy
        of the blob's bytes into `out` (write_values: no per-value or per-layer work)."""
        h, payload = parse_chunk(blob)
        raw = self._unpack(h, payload)
        if len(raw) != h["raw_bytes"]:
            raise FormatError("raw chunk payload decompressed to the wrong size")
        dtype, shape = dtype_of(h["dtype"]), h["shape"]
        if isinstance(out, PagedKV):
            out.check(shape, dtype, int(h["start_token"]))
            write_paged(out, int(h["start_token"]), raw, dtype, shape)
            return out
        if tuple(out.shape) != shape or out.dtype != dtype:
            raise ShapeError(f"output is {tuple(out.shape)} {out.dtype}; chunk holds {shape} {dtype}")
        write_values(out, raw, shape)
        return out

    def decoder_name(self, device) -> str:
        return "raw-cpu"


def _check_fields(header: dict) -> None:
    """FormatError unless the header has exactly the raw chunk's fields, its format name and a resolution label."""
    if extra := sorted(set(header) - HEADER_FIELDS):
        raise FormatError(f"raw chunk header has unknown fields {extra}")
    if missing := sorted(HEADER_FIELDS - {"key"} - set(header)):
        raise FormatError(f"raw chunk header lacks {missing}")
    if header["format"] != FORMAT_NAME:
        raise FormatError(f"raw chunk header names format {header['format']!r}, not {FORMAT_NAME!r}")
    res = header["resolution"]
    if not (isinstance(res, list) and len(res) == 2 and all(_is_count(r) and r > 0 for r in res)):
        raise FormatError(f"raw chunk header's resolution is {res!r}, not [width, height]")


def parse_chunk(blob: bytes | memoryview, verify_payload: bool = True) -> tuple[dict, memoryview]:
    """A raw chunk blob's checked header and its payload (its length checked; checksummed unless
    verify_payload is False: a header-only look, whose caller never reads the values)."""
    header, payload = read_object(blob, MAGIC, "raw kvcodec chunk blob")
    _check_fields(header)
    try:
        h = {
            k: header[k]
            for k in ("index", "start_token", "shape", "dtype", "variant", "raw_bytes", "payload_bytes", "crc32")
        }
        h["shape"] = tuple(int(s) for s in h["shape"])
        h["key"] = header.get("key")
        ok = (
            all(_is_count(h[k]) for k in ("index", "start_token", "raw_bytes", "payload_bytes", "crc32"))
            and (h["key"] is None or isinstance(h["key"], str))
            and h["raw_bytes"] <= MAX_EXPANSION * max(h["payload_bytes"], 1)
            and (h["variant"] != "raw" or h["raw_bytes"] == h["payload_bytes"])
            and len(h["shape"]) == 5
            and h["shape"][1] == 2
            and min(h["shape"]) > 0
            and h["variant"] in VARIANTS
            and h["raw_bytes"] == math.prod(h["shape"]) * dtype_of(h["dtype"]).itemsize
        )
    except (KeyError, TypeError, ValueError) as e:
        raise FormatError(f"raw chunk header is malformed: {e!r}") from e
    if not ok:
        raise FormatError(f"raw chunk header is inconsistent: {header}")
    if len(payload) < h["payload_bytes"]:
        raise TruncatedError(f"raw chunk payload has {len(payload)} of {h['payload_bytes']} bytes")
    if len(payload) > h["payload_bytes"]:
        raise FormatError(f"raw chunk has {len(payload) - h['payload_bytes']} unexpected bytes after its payload")
    if verify_payload and crc32(payload) != h["crc32"]:
        raise ChecksumError(f"raw chunk {h['index']} payload checksum mismatch")
    return h, payload


def describe_chunk(blob: bytes | memoryview) -> dict:
    """One raw chunk blob's summary (codecs/describe.py); its one "resolution" is its payload variant
    (the blob does not know which resolution slot of its codec it was stored under)."""
    h, _ = parse_chunk(blob)
    L, _, T, H, D = h["shape"]
    size = len(memoryview(blob))
    fp16_bytes = 2 * math.prod(h["shape"])
    return {
        "format": "kvcodec-raw-chunk",
        "version": object_version(blob),
        "codec": "raw",
        "dtype": h["dtype"],
        "layers": L,
        "kv_heads": H,
        "head_dim": D,
        "tokens": T,
        "chunks": 1,
        "chunk_index": h["index"],
        "start_token": h["start_token"],
        "key": h["key"],
        "file_bytes": size,
        "fp16_bytes": fp16_bytes,
        "ratio_vs_fp16": fp16_bytes / size,
        "chunk_bytes": {h["variant"]: [size]},
        "streams": {h["variant"]: h["payload_bytes"]},
    }


def copy_chunk(dst: torch.Tensor, src: torch.Tensor) -> None:
    """dst.copy_(src); CPU to CPU of one dtype through numpy (single-threaded): torch's intra-op
    threads make this small strided copy up to 1000x slower on an oversubscribed CPU."""
    if dst.device.type == "cpu" and src.device.type == "cpu" and dst.dtype == src.dtype and dst.dtype in SAME_SIZE_INT:
        iv = SAME_SIZE_INT[dst.dtype]
        np.copyto(dst.view(iv).numpy(), src.view(iv).numpy())
    else:
        dst.copy_(src)


def host_values(raw: bytes | memoryview, dtype: torch.dtype, shape: tuple[int, ...]) -> np.ndarray:
    """A chunk's value bytes as a (read-only, zero-copy) numpy array of `shape` in the integer type
    of `dtype`'s size (numpy has no bfloat16)."""
    return np.frombuffer(raw, dtype=NUMPY_INT[SAME_SIZE_INT[dtype]]).reshape(shape)


def write_values(out: torch.Tensor, raw: bytes | memoryview, shape: tuple[int, ...]) -> None:
    """out (the chunk's shape and dtype, any strides, any device) <- the chunk's value bytes, in
    one bulk copy. CPU: numpy straight from the blob's buffer into out. CUDA: one memcpy into pinned
    staging (torch's caching host allocator: a block is reused only after the copy that read it has
    run), then one asynchronous host-to-device copy on the current stream (the caller synchronizes,
    as after any codec's decode). numpy's copies and the copy engine run without the interpreter
    lock, so the fetch's decode threads overlap."""
    if out.device.type == "cpu":
        np.copyto(out.view(SAME_SIZE_INT[out.dtype]).numpy(), host_values(raw, out.dtype, shape))
        return
    out.copy_(pinned_copy(raw).view(out.dtype).view(shape), non_blocking=True)


def write_paged(out: PagedKV, start: int, raw: bytes | memoryview, dtype: torch.dtype, shape: tuple[int, ...]) -> None:
    """The chunk's values into the blocks of a PagedKV that hold tokens [start, start + tokens)."""
    blocks, within = out.slots(start, shape[2])
    if out.device.type == "cpu":
        pages = out.pages.view(SAME_SIZE_INT[dtype]).numpy()
        pages[:, :, blocks.numpy(), within.numpy()] = host_values(raw, dtype, shape)
        return
    out.pages[:, :, blocks, within] = pinned_copy(raw).view(dtype).view(shape).to(out.device, non_blocking=True)


def pinned_copy(raw: bytes | memoryview) -> torch.Tensor:
    """`raw`'s bytes in a pinned host tensor (uint8; one memcpy)."""
    src = np.frombuffer(raw, dtype=np.uint8)
    staging = torch.empty(src.shape, dtype=torch.uint8, pin_memory=True)
    np.copyto(staging.numpy(), src)
    return staging
