"""Uncompressed (or zstd/lz4) KV chunk blobs with the codec interface the fetcher uses.

This is the baseline "raw fp16 KV over the same link": the same chunking, store layout, pipeline
and checksums as the HEVC codec, with the tensor bytes as the payload. `RawCodec(variants=...)`
maps resolution j of the config to payload variant ``variants[j % len(variants)]`` ("raw", "zstd",
"lz4"), which gives real size / decode-speed trade-offs for exercising the resolution policies
without the video codec.

Blob: b"KVRAW1\\n" | u32 header length | JSON header | u32 crc32(header) | payload.
"""

from __future__ import annotations

import dataclasses
import json
import struct
import zlib
from typing import Any

import torch

from kvcodec.codec import DTYPE_NAMES, DTYPES
from kvcodec.errors import ChecksumError, ConfigError, FormatError, ShapeError, TruncatedError

MAGIC = b"KVRAW1\n"


@dataclasses.dataclass(frozen=True)
class RawChunk:
    index: int
    start_token: int
    tokens: int
    resolutions: tuple[tuple[int, int], ...]
    blobs: tuple[bytes, ...]


class RawCodec:
    def __init__(self, variants: tuple[str, ...] = ("raw",), zstd_level: int = 3) -> None:
        for v in variants:
            if v not in ("raw", "zstd", "lz4"):
                raise ConfigError(f"raw codec variant {v!r}: expected raw, zstd or lz4")
        self.variants = tuple(variants)
        self.zstd_level = zstd_level
        self.CODEC_ID = "raw-v1:" + ",".join(self.variants)

    # -- encode ------------------------------------------------------------------------------
    def _pack(self, payload: bytes, variant: str) -> bytes:
        if variant == "zstd":
            import zstandard

            return zstandard.ZstdCompressor(level=self.zstd_level).compress(payload)
        if variant == "lz4":
            import lz4.frame

            return lz4.frame.compress(payload)
        return payload

    def encode_chunks(self, kv: torch.Tensor, config: Any, *, first_chunk_index: int = 0, **_: Any) -> list[RawChunk]:
        if kv.dim() != 5 or kv.shape[1] != 2 or kv.dtype not in DTYPE_NAMES:
            raise ShapeError(f"KV must be (layers, 2, tokens, kv_heads, head_dim) fp16/bf16/fp32; got {tuple(kv.shape)} {kv.dtype}")
        kv = kv.detach().to("cpu")
        L, _, T, H, D = kv.shape
        ct = int(config.chunk_tokens)
        out = []
        for n, start in enumerate(range(0, T, ct)):
            x = kv[:, :, start : start + ct].contiguous()
            raw = x.view(torch.uint8).numpy().tobytes()
            blobs = []
            for j, res in enumerate(config.resolutions):
                variant = self.variants[j % len(self.variants)]
                payload = self._pack(raw, variant)
                header = {
                    "index": first_chunk_index + n,
                    "start_token": first_chunk_index * ct + start,
                    "tokens": x.shape[2],
                    "shape": [L, 2, x.shape[2], H, D],
                    "dtype": DTYPE_NAMES[x.dtype],
                    "resolution": list(res),
                    "variant": variant,
                    "raw_bytes": len(raw),
                    "payload_bytes": len(payload),
                    "crc32": zlib.crc32(payload),
                }
                head = json.dumps(header, separators=(",", ":")).encode()
                blobs.append(MAGIC + struct.pack("<I", len(head)) + head + struct.pack("<I", zlib.crc32(head)) + payload)
            out.append(RawChunk(first_chunk_index + n, first_chunk_index * ct + start, x.shape[2],
                                tuple(tuple(r) for r in config.resolutions), tuple(blobs)))
        return out

    # -- decode ------------------------------------------------------------------------------
    def _parse(self, blob: bytes | memoryview) -> tuple[dict, memoryview]:
        mv = memoryview(blob)
        if len(mv) < len(MAGIC) + 4:
            raise TruncatedError("raw chunk blob shorter than its prefix")
        if bytes(mv[: len(MAGIC)]) != MAGIC:
            raise FormatError("not a raw kvcodec chunk blob")
        (hl,) = struct.unpack_from("<I", mv, len(MAGIC))
        p = len(MAGIC) + 4
        if len(mv) < p + hl + 4:
            raise TruncatedError("raw chunk blob ends inside its header")
        head = bytes(mv[p : p + hl])
        (crc,) = struct.unpack_from("<I", mv, p + hl)
        if zlib.crc32(head) != crc:
            raise ChecksumError("raw chunk blob header checksum mismatch")
        header = json.loads(head)
        payload = mv[p + hl + 4 :]
        if len(payload) < header["payload_bytes"]:
            raise TruncatedError(f"raw chunk payload has {len(payload)} of {header['payload_bytes']} bytes")
        payload = payload[: header["payload_bytes"]]
        if zlib.crc32(payload) != header["crc32"]:
            raise ChecksumError(f"raw chunk {header['index']} payload checksum mismatch")
        return header, payload

    def inspect_chunk_blob(self, blob: bytes | memoryview) -> dict:
        return self._parse(blob)[0]

    def decode_chunk_blob(self, blob: bytes | memoryview, device: str | torch.device = "cpu",
                          out: torch.Tensor | None = None) -> torch.Tensor:
        header, payload = self._parse(blob)
        v = header["variant"]
        if v == "zstd":
            import zstandard

            raw = zstandard.ZstdDecompressor().decompress(bytes(payload), max_output_size=header["raw_bytes"])
        elif v == "lz4":
            import lz4.frame

            raw = lz4.frame.decompress(bytes(payload))
        else:
            raw = payload
        if len(raw) != header["raw_bytes"]:
            raise FormatError("raw chunk payload decompressed to the wrong size")
        dtype = DTYPES[header["dtype"]]
        shape = tuple(header["shape"])
        x = torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(dtype).view(shape)
        if out is not None:
            if tuple(out.shape) != shape:
                raise ShapeError(f"output is {tuple(out.shape)}; chunk holds {shape}")
            out.copy_(x)
            return out
        return x.to(device)
