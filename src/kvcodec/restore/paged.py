"""Paged KV caches as restore targets.

Serving engines with paged attention keep KV in fixed-size blocks: per layer and K/V, a pool of
`num_blocks` blocks of `block_size` tokens, and per sequence a block table naming the block that
holds each run of `block_size` tokens. `PagedKV` describes such a cache so that a chunk restores
straight into its blocks (no dense staging tensor, no copy).
"""

from __future__ import annotations

import dataclasses

import torch

from kvcodec.errors import ShapeError


@dataclasses.dataclass(frozen=True)
class PagedKV:
    """pages: (layers, 2, num_blocks, block_size, kv_heads, head_dim); block_table: the block ids
    holding tokens [0, len(block_table) * block_size) of the sequence, in order (int64, any device).
    A chunk whose header says start_token s fills sequence tokens [s, s + tokens)."""

    pages: torch.Tensor
    block_table: torch.Tensor

    def __post_init__(self) -> None:
        if not isinstance(self.pages, torch.Tensor) or self.pages.dim() != 6 or self.pages.shape[1] != 2:
            raise ShapeError("pages must be (layers, 2, num_blocks, block_size, kv_heads, head_dim)")
        given = torch.as_tensor(self.block_table)
        if given.dtype.is_floating_point or given.dtype.is_complex or given.dtype == torch.bool:
            raise ShapeError(f"the block table holds block ids, integers; got {given.dtype}")
        table = given.to(torch.int64).reshape(-1)
        if table.numel() and (int(table.min()) < 0 or int(table.max()) >= self.pages.shape[2]):
            raise ShapeError(f"block table names blocks outside 0..{self.pages.shape[2] - 1}")
        if table.unique().numel() != table.numel():  # two runs of the sequence would overwrite each other
            raise ShapeError("the block table names a block more than once")
        object.__setattr__(self, "block_table", table.to(self.pages.device))

    @property
    def device(self) -> torch.device:
        return self.pages.device

    @property
    def block_size(self) -> int:
        return self.pages.shape[3]

    @property
    def capacity(self) -> int:
        """Sequence tokens the block table covers."""
        return self.block_table.numel() * self.block_size

    def check(self, shape: tuple[int, ...], dtype: torch.dtype, first_token: int) -> None:
        """Refuse a chunk of `shape` (layers, 2, tokens, heads, dim) starting at `first_token`
        that these pages cannot hold."""
        layers, _, tokens, heads, dim = shape
        want = (layers, 2, heads, dim)
        have = (self.pages.shape[0], 2, self.pages.shape[4], self.pages.shape[5])
        if want != have or self.pages.dtype != dtype:
            raise ShapeError(f"pages hold (layers, 2, heads, dim) {have} {self.pages.dtype}; chunk is {want} {dtype}")
        if first_token + tokens > self.capacity:
            raise ShapeError(
                f"chunk covers tokens [{first_token}, {first_token + tokens}); the block table covers {self.capacity}"
            )

    def slots(self, first_token: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(block ids, offsets within the block) of sequence tokens [first_token, first_token + n)."""
        pos = torch.arange(first_token, first_token + n, device=self.block_table.device)
        return self.block_table[pos // self.block_size], pos % self.block_size

    def token_offsets(self, first_token: int, n: int) -> torch.Tensor:
        """Element offset into `pages` of each token's (layer 0, K, head 0, channel 0) value."""
        blocks, within = self.slots(first_token, n)
        return blocks * self.pages.stride(2) + within * self.pages.stride(3)

    def gather(self, first_token: int, n: int) -> torch.Tensor:
        """Tokens [first_token, first_token + n) as a dense (layers, 2, n, heads, dim) tensor."""
        blocks, within = self.slots(first_token, n)
        return self.pages[:, :, blocks, within]


@dataclasses.dataclass(frozen=True)
class PagedChunk:
    """One chunk's view of a PagedKV: chunk token t is sequence token first_token + t."""

    paged: PagedKV
    first_token: int
