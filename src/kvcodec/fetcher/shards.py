"""Tensor-parallel shards of a KV cache: which KV heads a rank holds, and pure split / join.

With tensor parallelism (TP) over `world` ranks each rank computes attention for its own KV heads
only, so each rank needs (and stores, and fetches) only those heads. The rule is vLLM's and
SGLang's: heads are split evenly in rank order when kv_heads >= world (kv_heads % world == 0);
when kv_heads < world (world % kv_heads == 0) every head is replicated on world // kv_heads
consecutive ranks and rank r holds head r // (world // kv_heads).

    shard = TPShard(rank, world, kv_heads)   # shard.heads: range of the model's KV heads
    local = shard.take(kv)                   # (layers, 2, tokens, kv_heads, dim) -> this rank's heads
    parts = split_kv(kv, world)              # one tensor per rank (a TP=1 producer storing for TP=world)
    kv == join_kv(parts, kv_heads)           # and back

Chunk keys name the heads a shard holds (`TPShard.key_field`), not its rank: ranks that hold the
same heads (replicas, or equal head ranges under different TP degrees) share stored chunks, shards
of other heads never meet, and the full range keys exactly as an unsharded cache.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch

from kvcodec.errors import ConfigError, ShapeError


def shard_heads(rank: int, world: int, kv_heads: int) -> tuple[int, int]:
    """[start, stop) of the KV heads rank `rank` of `world` holds (see the module doc);
    ConfigError for a rank outside the world or a head count the TP rule cannot split."""
    for name, v in (("rank", rank), ("world", world), ("kv_heads", kv_heads)):
        if isinstance(v, bool) or not isinstance(v, int):
            raise ConfigError(f"{name} must be an integer; got {v!r}")
    if world < 1 or kv_heads < 1:
        raise ConfigError(f"world and kv_heads must be >= 1; got world={world}, kv_heads={kv_heads}")
    if not 0 <= rank < world:
        raise ConfigError(f"rank {rank} is outside a world of {world} ranks")
    if kv_heads >= world:
        if kv_heads % world:
            raise ConfigError(f"{kv_heads} KV heads cannot be split evenly over {world} tensor-parallel ranks")
        per = kv_heads // world
        return rank * per, (rank + 1) * per
    if world % kv_heads:
        raise ConfigError(f"{world} tensor-parallel ranks cannot replicate {kv_heads} KV heads evenly")
    head = rank // (world // kv_heads)
    return head, head + 1


@dataclasses.dataclass(frozen=True)
class TPShard:
    """Rank `rank` of a tensor-parallel group of `world` ranks over a model with `kv_heads` KV heads."""

    rank: int
    world: int
    kv_heads: int

    def __post_init__(self) -> None:
        shard_heads(self.rank, self.world, self.kv_heads)  # validates

    @property
    def heads(self) -> range:
        return range(*shard_heads(self.rank, self.world, self.kv_heads))

    @property
    def local_heads(self) -> int:
        return len(self.heads)

    @property
    def replicas(self) -> int:
        """How many ranks hold this shard's heads."""
        return max(1, self.world // self.kv_heads)

    @property
    def full(self) -> bool:
        """Whether this shard holds every KV head (TP=1, or no sharding)."""
        return self.local_heads == self.kv_heads

    @property
    def key_field(self) -> str | None:
        """What chunk keys take from the shard: its head range of the model's heads (None when full)."""
        if self.full:
            return None
        h = self.heads
        return f"tp-heads:{h.start}:{h.stop}/{self.kv_heads}"

    @classmethod
    def all(cls, world: int, kv_heads: int) -> tuple[TPShard, ...]:
        return tuple(cls(r, world, kv_heads) for r in range(world))

    def take(self, kv: torch.Tensor) -> torch.Tensor:
        """This rank's heads of a full (layers, 2, tokens, kv_heads, head_dim) KV tensor (a view)."""
        _check_5d(kv)
        if kv.shape[3] != self.kv_heads:
            raise ShapeError(f"KV has {kv.shape[3]} heads; {self} takes its heads from {self.kv_heads}")
        h = self.heads
        return kv[:, :, :, h.start : h.stop]

    def check_local(self, kv_heads: int, what: str = "KV") -> None:
        """ShapeError unless `kv_heads` is this rank's local head count."""
        if kv_heads != self.local_heads:
            raise ShapeError(
                f"{what} has {kv_heads} KV heads; rank {self.rank} of {self.world} holds heads "
                f"{self.heads.start}..{self.heads.stop - 1} of {self.kv_heads} ({self.local_heads} heads). "
                "Give it this rank's heads (TPShard.take / split_kv), not the full KV or another world's shard"
            )

    def __str__(self) -> str:
        return (
            f"TPShard(rank {self.rank} of {self.world}, heads {self.heads.start}:{self.heads.stop} of {self.kv_heads})"
        )


def tiling_shards(heads: range, world: int, kv_heads: int) -> tuple[TPShard, ...]:
    """The shards of a `world`-rank group that tile `heads` exactly, in head order, one per
    distinct head range: where a holder of `heads` finds its KV among chunks stored by `world`
    ranks. ConfigError when they do not tile it (a stored shard straddles the range: that TP
    degree is coarser than the holder's, so its chunks carry heads the holder does not keep)."""
    out, pos = [], heads.start
    for shard in TPShard.all(world, kv_heads):
        h = shard.heads
        if h.start == pos and h.stop <= heads.stop:
            out.append(shard)
            pos = h.stop
    if pos != heads.stop or not out:
        raise ConfigError(
            f"chunks stored by {world} tensor-parallel ranks over {kv_heads} KV heads do not tile heads "
            f"{heads.start}..{heads.stop - 1}: store them for this TP degree (PrefixCache.put_sharded)"
        )
    return tuple(out)


def _check_5d(kv: torch.Tensor) -> None:
    if not isinstance(kv, torch.Tensor) or kv.dim() != 5 or kv.shape[1] != 2:
        raise ShapeError(f"KV must be (layers, 2, tokens, kv_heads, head_dim); got {tuple(getattr(kv, 'shape', ()))}")


def split_kv(kv: torch.Tensor, world: int) -> list[torch.Tensor]:
    """Rank r's heads of `kv` for every rank r of `world` (contiguous; replicated ranks share one tensor)."""
    _check_5d(kv)
    parts: dict[tuple[int, int], torch.Tensor] = {}
    out = []
    for shard in TPShard.all(world, kv.shape[3]):
        h = (shard.heads.start, shard.heads.stop)
        if h not in parts:
            parts[h] = shard.take(kv).contiguous()
        out.append(parts[h])
    return out


def join_kv(parts: Sequence[torch.Tensor], kv_heads: int) -> torch.Tensor:
    """The full KV from every rank's local KV (rank order; world = len(parts)). ShapeError when a
    part has the wrong heads or shape, or replicas of a head disagree (bit for bit)."""
    if not parts:
        raise ShapeError("join_kv needs one KV tensor per rank; got none")
    shards = TPShard.all(len(parts), kv_heads)
    first = {}
    for shard, part in zip(shards, parts):
        _check_5d(part)
        shard.check_local(part.shape[3], f"rank {shard.rank}'s KV")
        if part.shape[:3] + part.shape[4:] != parts[0].shape[:3] + parts[0].shape[4:] or part.dtype != parts[0].dtype:
            raise ShapeError(
                f"rank {shard.rank}'s KV is {tuple(part.shape)} {part.dtype}; rank 0's {tuple(parts[0].shape)}"
            )
        start = shard.heads.start
        if start in first:
            if not _same_bits(first[start], part):
                raise ShapeError(f"rank {shard.rank} holds a replica of head {start} that differs from another rank's")
        else:
            first[start] = part
    return torch.cat([first[s].to(parts[0].device) for s in sorted(first)], dim=3)


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    b = b.to(a.device)
    return torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))
