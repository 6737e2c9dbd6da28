"""Content-addressed chunk keys and the per-chunk store objects.

A prefix is split into chunks of `codec.chunk_tokens` tokens. Chunk i's key chains the previous
key, so it names the whole prefix up to the chunk's end, not just the chunk's own tokens:

    key_i = blake2b-256( key_{i-1} | model_id | codec.id [| namespace] [| heads] | token ids of chunk i )

(each field length-prefixed, token ids as little-endian int64; key_{-1} is empty; codec.id names
the codec and every setting that changes its bytes; an optional namespace, e.g. a tenant's salt,
keeps tenants sharing a store from finding each other's prefixes; a tensor-parallel shard's
head range (fetcher.shards.TPShard.key_field, absent for all heads) keeps each rank's heads under
keys of their own). Store objects for chunk key K:
``K/r{j}``: the chunk blob at `codec.resolutions[j]`, whose header carries K (so a blob served
under another key is refused);  ``K/meta``: a small JSON object with the per-resolution blob
sizes, shape and dtype. The meta object is written last, so its presence means every
resolution's blob is complete (the commit marker lookups test for).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import struct
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np

from kvcodec.config import CodecConfig
from kvcodec.dtypes import DTYPES
from kvcodec.errors import ConfigError, FormatError, ShapeError

if TYPE_CHECKING:
    from kvcodec.fetcher.shards import TPShard

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


def key_fingerprint(codec: Any) -> str:
    """What chunk keys take from the codec: its id; a bare CodecConfig means the HEVC codec with it."""
    ident = getattr(codec, "id", None)
    if isinstance(ident, str) and ident:
        return ident
    if isinstance(codec, CodecConfig):
        from kvcodec.codecs.hevc.codec import hevc_id

        return hevc_id(codec)
    raise ConfigError(f"{type(codec).__name__} has no codec id")


def config_fingerprint(config: Any, codec: Any = None) -> str:
    """blake2b hex of a codec (or CodecConfig): any change of its id gives new keys."""
    ident = key_fingerprint(codec if codec is not None else config)
    return hashlib.blake2b(ident.encode(), digest_size=16).hexdigest()


def _field(b: bytes) -> bytes:
    return struct.pack("<Q", len(b)) + b


def chunk_keys(
    token_ids: Any,
    model_id: str,
    codec: Any,
    *,
    partial: bool = True,
    namespace: str | None = None,
    shard: TPShard | None = None,
) -> list[str]:
    """Keys of the chunks of `token_ids` (blake2b-256 hex, chained) for a ChunkCodec (or a
    CodecConfig: the HEVC codec). With `partial`, a last chunk shorter than `codec.chunk_tokens`
    gets a key too (it matches only that exact tail). With a `shard`, the keys of its KV heads."""
    ids = as_token_array(token_ids)
    ct = int(codec.chunk_tokens)
    head = _field(model_id.encode()) + _field(key_fingerprint(codec).encode())
    if namespace:
        head += _field(b"namespace:" + namespace.encode())
    heads = shard.key_field if shard is not None else None
    if heads:
        head += _field(heads.encode())
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
    def from_bytes(cls, b: bytes) -> ChunkMeta:
        """Parse and range-check a meta object; FormatError naming what is wrong. The same bytes give
        the same (frozen) meta: a fetch's set-up parses each chunk's meta, ~15-20 us each, so the
        metas of recently fetched prefixes are kept by their bytes."""
        if cls is ChunkMeta and isinstance(b, bytes):
            return _parsed_meta(b)
        return cls._parse(b)

    @classmethod
    def _parse(cls, b: bytes | bytearray | str) -> ChunkMeta:
        try:
            d = json.loads(b)
            if not isinstance(d, dict) or d.pop("v", None) != META_VERSION:
                raise FormatError(f"chunk meta version {d.get('v') if isinstance(d, dict) else d!r} unsupported")
            m = cls(
                index=_int(d["index"]),
                start_token=_int(d["start_token"]),
                tokens=_int(d["tokens"]),
                shape=tuple(_int(x) for x in d["shape"]),
                dtype=str(d["dtype"]),
                resolutions=tuple(tuple(_int(x) for x in r) for r in d["resolutions"]),
                sizes=tuple(_int(x) for x in d["sizes"]),
                codec=str(d["codec"]),
            )
        except FormatError:
            raise
        except (ValueError, KeyError, TypeError, AttributeError, RecursionError) as e:
            raise FormatError(f"chunk meta object is malformed: {e!r}") from e
        m.check()
        return m

    def check(self) -> None:
        if len(self.shape) != 3 or min(self.shape) < 1 or self.tokens < 1 or self.index < 0 or self.start_token < 0:
            raise FormatError(f"chunk meta has an impossible shape or position: {self}")
        if self.dtype not in DTYPES:
            raise FormatError(f"chunk meta dtype {self.dtype!r} is not one of {', '.join(DTYPES)}")
        if len(self.sizes) != len(self.resolutions) or not self.sizes or min(self.sizes) < 1:
            raise FormatError(f"chunk meta sizes {self.sizes} do not match its resolutions {self.resolutions}")


@functools.lru_cache(maxsize=8192)  # ~1 KB a meta; an error is raised, not kept
def _parsed_meta(b: bytes) -> ChunkMeta:
    return ChunkMeta._parse(b)


def _int(x: Any) -> int:
    if isinstance(x, bool) or not isinstance(x, int):
        raise TypeError(f"expected an integer, got {x!r}")
    return x


def chunk_spans(n_tokens: int, chunk_tokens: int) -> list[tuple[int, int]]:
    return [(s, min(s + chunk_tokens, n_tokens)) for s in range(0, n_tokens, chunk_tokens)]


def longest_present(flags: Sequence[bool]) -> int:
    """Number of leading True values."""
    for i, f in enumerate(flags):
        if not f:
            return i
    return len(flags)
