"""Pure page math for the SGLang HiCache backend (no SGLang import): host-pool page layouts to
kvcodec's canonical (layers, 2, tokens, heads, head_dim), page grouping, and the pointer record a
page key holds.

A HiCache page is `page_size` tokens of every layer's K and V. SGLang hands a backend each page
as one flat tensor in its host pool's layout; the axes of that flat page, in order, are below
(k: K/V, l: layer, p: token in page, h: head, d: channel).
"""

from __future__ import annotations

import dataclasses
import struct
import zlib

import torch

from kvcodec.errors import ConfigError, FormatError, ShapeError

PAGE_AXES: dict[str, str] = {
    "layer_first": "klphd",
    "page_first": "kplhd",
    "page_first_direct": "klphd",  # (2, 1, layers, page, heads, dim): the unit page axis drops out
    "page_head": "khpld",
}
_CANONICAL = "lkphd"


@dataclasses.dataclass(frozen=True)
class PageGeometry:
    """What one HiCache page holds, from the registered host pool."""

    layout: str
    layers: int
    page_size: int
    heads: int
    head_dim: int
    dtype: torch.dtype

    def __post_init__(self) -> None:
        if self.layout not in PAGE_AXES:
            raise ConfigError(f"HiCache host layout {self.layout!r} is not supported; supported: {sorted(PAGE_AXES)}")

    @property
    def numel(self) -> int:
        return 2 * self.layers * self.page_size * self.heads * self.head_dim

    def sizes(self) -> dict[str, int]:
        return {"k": 2, "l": self.layers, "p": self.page_size, "h": self.heads, "d": self.head_dim}


def page_to_canonical(flat: torch.Tensor, g: PageGeometry) -> torch.Tensor:
    """A flat page (host layout order) as a (layers, 2, page_size, heads, head_dim) view."""
    if flat.numel() != g.numel or flat.dtype != g.dtype:
        raise ShapeError(
            f"HiCache page has {flat.numel()} {flat.dtype} values; the pool's pages hold {g.numel} {g.dtype}"
        )
    axes = PAGE_AXES[g.layout]
    sizes = g.sizes()
    return flat.reshape([sizes[a] for a in axes]).permute([axes.index(a) for a in _CANONICAL])


def canonical_to_page(kv: torch.Tensor, g: PageGeometry, out: torch.Tensor) -> torch.Tensor:
    """Write a canonical page into a flat page tensor `out` (host layout order); returns `out`."""
    page_to_canonical(out, g).copy_(kv)
    return out


def group_spans(n_pages: int, pages_per_group: int) -> list[tuple[int, int]]:
    """Consecutive [start, end) page runs of at most `pages_per_group` covering n_pages."""
    if pages_per_group < 1:
        raise ConfigError(f"pages per group must be >= 1; got {pages_per_group}")
    return [(s, min(n_pages, s + pages_per_group)) for s in range(0, n_pages, pages_per_group)]


_POINTER = struct.Struct("<4sBHHHI")  # magic, version, page index in group, pages in group, group key length, CRC32
_MAGIC = b"KVHP"
# 3: the pointer names its own page key (version 2 did not: a pointer the store served under another
# page's key read that page's KV); 2: a CRC32 over index, pages and keys (1 had none)
_VERSION = 3


@dataclasses.dataclass(frozen=True)
class PagePointer:
    """What a page key holds: that page key, the key of its group's coded blob and its place in
    the group."""

    page_key: str
    group_key: str
    index: int
    pages: int

    def to_bytes(self) -> bytes:
        group, page = self.group_key.encode(), self.page_key.encode()
        crc = _crc(self.index, self.pages, group, page)
        return _POINTER.pack(_MAGIC, _VERSION, self.index, self.pages, len(group), crc) + group + page

    @classmethod
    def from_bytes(cls, data: bytes, page_key: str) -> PagePointer:
        """The pointer stored under `page_key`; FormatError if it is damaged or belongs to another page."""
        if len(data) < _POINTER.size:
            raise FormatError(f"HiCache page pointer truncated ({len(data)} bytes)")
        magic, version, index, pages, group_len, crc = _POINTER.unpack_from(data, 0)
        if magic != _MAGIC or version != _VERSION:
            raise FormatError(f"not a kvcodec HiCache page pointer of version {_VERSION}")
        group, page = data[_POINTER.size : _POINTER.size + group_len], data[_POINTER.size + group_len :]
        if len(group) != group_len or crc != _crc(index, pages, group, page):
            raise FormatError("HiCache page pointer fails its checksum")
        if page != page_key.encode():
            raise FormatError(f"the HiCache page pointer under {page_key} belongs to another page")
        if not 0 <= index < pages:
            raise FormatError(f"HiCache page pointer index {index} outside its group of {pages}")
        try:
            group_key = group.decode()
        except UnicodeDecodeError as e:
            raise FormatError(f"HiCache page pointer names no group ({e})") from None
        return cls(page_key, group_key, index, pages)


def _crc(index: int, pages: int, group_key: bytes, page_key: bytes) -> int:
    return zlib.crc32(struct.pack("<HHH", index, pages, len(group_key)) + group_key + page_key)
