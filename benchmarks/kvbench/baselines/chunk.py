"""Baseline codecs as kvcodec ChunkCodecs (kvcodec.codecs.base), so the fetcher, the engine and
every benchmark store and restore them exactly like kvcodec's own codecs.

Each chunk of `chunk_tokens` tokens is coded on its own by the named baseline (its checked KVBL
container, kvbench.baselines.base) and wrapped in kvcodec's container envelope (magic "KVBC"),
whose header says which chunk it is, which baseline wrote it and the prefix key it is bound to. A
baseline has no resolutions: every resolution slot holds the same blob.

`register_chunk_codecs()` registers every baseline that is not kvcodec's own (not "raw", not
"kvcodec-*") in kvcodec's codec registry under its baseline name: make_codec("cachegen").
"""

from __future__ import annotations

import json
from collections.abc import Callable, Sequence
from typing import Any

import torch

from kvbench.baselines import base
from kvcodec.codecs.base import ChunkInfo, EncodedChunk, Target, collect_chunks, token_chunks
from kvcodec.container.format import read_object, write_object
from kvcodec.errors import ConfigError, FormatError, ShapeError
from kvcodec.restore.paged import PagedKV

MAGIC = b"KVBC"
FORMAT = "kvbench-baseline-chunk"
_WHAT = "baseline chunk blob"


class BaselineCodec:
    """The baseline registered as `baseline` in kvbench.baselines, chunk by chunk (default zstd-3,
    lossless, so that make_codec("baseline") alone gives a working codec)."""

    def __init__(
        self,
        baseline: str = "zstd-3",
        chunk_tokens: int = 256,
        resolutions: Sequence[tuple[int, int]] = ((512, 512),),
        **options: Any,
    ) -> None:
        from kvbench.baselines import get_codec

        if int(chunk_tokens) < 1:
            raise ConfigError(f"chunk_tokens must be >= 1; got {chunk_tokens}")
        self.name = baseline
        self.baseline = get_codec(baseline, **options)
        self.chunk_tokens = int(chunk_tokens)
        self.resolutions = tuple((int(w), int(h)) for w, h in resolutions) or ((512, 512),)
        opts = f":{json.dumps(options, sort_keys=True)}" if options else ""
        self.id = f"baseline-v1:{baseline}{opts}:{self.chunk_tokens}"

    def with_config(self, config) -> BaselineCodec:  # noqa: ANN001
        """This baseline with the chunking and resolution slots of a CodecConfig."""
        return BaselineCodec(self.name, config.chunk_tokens, config.resolutions)

    def encode_chunks(
        self,
        kv: torch.Tensor,
        *,
        first_chunk_index: int = 0,
        keys: Sequence[str] | None = None,
        on_chunk: Callable[[EncodedChunk], None] | None = None,
    ) -> list[EncodedChunk]:
        base.check_kv(kv)
        parts = token_chunks(kv, self.chunk_tokens, first_chunk_index, keys)
        return collect_chunks((self._chunk(*part) for part in parts), on_chunk)

    def _chunk(self, x: torch.Tensor, index: int, start_token: int, key: str | None) -> EncodedChunk:
        header = {"format": FORMAT, "codec": self.name, "index": index, "start_token": start_token, "key": key}
        blob = write_object(MAGIC, header, [bytes(self.baseline.encode(x))])
        return EncodedChunk(index, start_token, x.shape[2], self.resolutions, tuple(blob for _ in self.resolutions))

    def _parse(self, blob: bytes | memoryview) -> tuple[dict, base.Header, memoryview]:
        header, inner = read_object(blob, MAGIC, _WHAT)
        if header.get("format") != FORMAT or header.get("codec") != self.name:
            raise FormatError(f"{_WHAT} was written by {header.get('codec')!r}, not by baseline {self.name!r}")
        if not all(isinstance(header.get(k), int) and header[k] >= 0 for k in ("index", "start_token")):
            raise FormatError(f"{_WHAT} header has no valid index / start_token: {header}")
        head, _ = base.unpack(inner, codec=self.name)
        return header, head, inner

    def inspect_chunk(self, blob: bytes | memoryview) -> ChunkInfo:
        header, head, _ = self._parse(blob)
        layers, _, tokens, heads, dim = head.shape
        return ChunkInfo(
            header["index"],
            header["start_token"],
            tokens,
            layers,
            heads,
            dim,
            str(head.dtype).removeprefix("torch."),
            self.id,
            header.get("key"),
        )

    def decode_chunk(self, blob: bytes | memoryview, out: Target) -> Target:
        header, head, inner = self._parse(blob)
        if isinstance(out, PagedKV):
            out.check(head.shape, head.dtype, header["start_token"])
            blocks, within = out.slots(header["start_token"], head.shape[2])
            out.pages[:, :, blocks, within] = self.baseline.decode(bytes(inner), device=out.device)
            return out
        if tuple(out.shape) != head.shape or out.dtype != head.dtype:
            raise ShapeError(f"output is {tuple(out.shape)} {out.dtype}; chunk holds {head.shape} {head.dtype}")
        out.copy_(self.baseline.decode(bytes(inner), device=out.device))
        return out


def register_chunk_codecs() -> None:
    """Every baseline that is not kvcodec's own, in kvcodec's codec registry by its name."""
    from kvbench.baselines import registered_codecs
    from kvcodec.codecs.registry import register_codec

    for name in registered_codecs():
        if name != "raw" and not name.startswith("kvcodec-"):
            register_codec(name, lambda _name=name, **options: BaselineCodec(_name, **options))
