"""Content-addressed chunk keys and the per-chunk store objects.

A prefix is split into chunks of `config.chunk_tokens` tokens. Chunk i's key chains the previous
key, so it names the whole prefix up to the chunk's end, not just the chunk's own tokens:

    key_i = blake2b-256( key_{i-1} | model_id | codec-config fingerprint | token ids of chunk i )

(each field length-prefixed, token ids as little-endian int64; key_{-1} is empty). Store objects
for chunk key K:  ``K/r{j}``: the chunk blob at `config.resolutions[j]`;  ``K/meta``: a small JSON
object with the per-resolution blob sizes, shape and dtype. The meta object is written last, so its
presence means every resolution's blob is complete (the commit marker lookups test for).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import struct
from collections.abc import Sequence
from typing import Any

import numpy as np

from kvcodec.errors import FormatError, ShapeError

META_VERSION = 1


def as_token_array(token_ids: Any) -> np.ndarray:
    """Token ids (list, numpy array, or 1-D / [1, n] torch tensor) as a 1-D int64 numpy array."""
    if hasattr(token_ids, "detach"):
        token_ids = token_ids.detach().cpu().numpy()
    a = np.asarray(token_ids)
    if a.ndim == 2 and a.shape[0] == 1:
        a = a[0]
    if a.ndim != 1:
        raise ShapeError(f"token ids must be 1-D (or [1, n]); got shape {a.shape}")
    if a.size and not np.issubdtype(a.dtype, np.integer):
        raise ShapeError(f"token ids must be integers; got {a.dtype}")
    return a.astype("<i8", copy=False)


def codec_identity(codec: Any) -> str:
    """A string naming the codec implementation and its format version."""
    ident = getattr(codec, "CODEC_ID", None)
    if ident:
        return str(ident)
    name = getattr(codec, "__name__", type(codec).__name__)
    if name == "kvcodec.codec":
        from kvcodec.container.format import FORMAT_VERSION

        return f"kvcodec-hevc-v{FORMAT_VERSION}"
    return name


def config_fingerprint(config: Any, codec: Any = None) -> str:
    """blake2b hex of the codec configuration (+ codec identity): any change gives new keys."""
    d = config.to_dict() if hasattr(config, "to_dict") else dict(config)
    payload = {"config": d, "codec": codec_identity(codec) if codec is not None else "kvcodec-hevc"}
    return hashlib.blake2b(json.dumps(payload, sort_keys=True).encode(), digest_size=16).hexdigest()


def _field(b: bytes) -> bytes:
    return struct.pack("<Q", len(b)) + b


def chunk_keys(
    token_ids: Any, model_id: str, config: Any, *, partial: bool = True, fingerprint: str | None = None
) -> list[str]:
    """Keys of the chunks of `token_ids` (blake2b-256 hex, chained). With `partial`, a last chunk
    shorter than `config.chunk_tokens` gets a key too (it matches only that exact tail)."""
    ids = as_token_array(token_ids)
    ct = int(config.chunk_tokens)
    fp = fingerprint if fingerprint is not None else config_fingerprint(config)
    head = _field(model_id.encode()) + _field(fp.encode())
    keys: list[str] = []
    prev = b""
    n = len(ids)
    end = n if partial else (n // ct) * ct
    for start in range(0, end, ct):
        chunk = ids[start : min(start + ct, end)]
        h = hashlib.blake2b(digest_size=32)
        h.update(_field(prev))
        h.update(head)
        h.update(_field(chunk.tobytes()))
        prev = h.digest()
        keys.append(prev.hex())
    return keys


def blob_key(chunk_key: str, resolution_index: int) -> str:
    return f"{chunk_key}/r{resolution_index}"


def meta_key(chunk_key: str) -> str:
    return f"{chunk_key}/meta"


@dataclasses.dataclass(frozen=True)
class ChunkMeta:
    """What the fetcher needs to know before fetching a chunk."""

    index: int
    start_token: int
    tokens: int
    shape: tuple[int, int, int]  # (layers, kv_heads, head_dim)
    dtype: str
    resolutions: tuple[tuple[int, int], ...]
    sizes: tuple[int, ...]  # blob bytes per resolution
    codec: str

    @property
    def values(self) -> int:
        L, H, D = self.shape
        return L * 2 * self.tokens * H * D

    def to_bytes(self) -> bytes:
        d = dataclasses.asdict(self)
        d["v"] = META_VERSION
        return json.dumps(d, separators=(",", ":")).encode()

    @classmethod
    def from_bytes(cls, b: bytes) -> "ChunkMeta":
        try:
            d = json.loads(b)
            if d.pop("v", None) != META_VERSION:
                raise FormatError(f"chunk meta version {d.get('v')!r} unsupported")
            return cls(
                index=int(d["index"]),
                start_token=int(d["start_token"]),
                tokens=int(d["tokens"]),
                shape=tuple(int(x) for x in d["shape"]),
                dtype=str(d["dtype"]),
                resolutions=tuple(tuple(int(x) for x in r) for r in d["resolutions"]),
                sizes=tuple(int(x) for x in d["sizes"]),
                codec=str(d["codec"]),
            )
        except FormatError:
            raise
        except (ValueError, KeyError, TypeError) as e:
            raise FormatError(f"chunk meta object is malformed: {e}") from e


def chunk_spans(n_tokens: int, chunk_tokens: int) -> list[tuple[int, int]]:
    return [(s, min(s + chunk_tokens, n_tokens)) for s in range(0, n_tokens, chunk_tokens)]


def longest_present(flags: Sequence[bool]) -> int:
    """Number of leading True values."""
    for i, f in enumerate(flags):
        if not f:
            return i
    return len(flags)
