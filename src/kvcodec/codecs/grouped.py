"""GroupedCodec: KV caches of several uniform layer groups (kvspec.GroupedKV) as chunk blobs.

Each group (full-attention layers, sliding-window layers, MLA latents, MLA rope keys, ...) is coded
by an inner ChunkCodec as the canonical tensor it is. Chunk n covers prefix positions
[n * chunk_tokens, (n + 1) * chunk_tokens); its blob (one per resolution) holds, for every group
that has positions in that range, the inner codec's blob of them (a sliding group only its held
window), behind a header of its own with the KVSpec:

    container framing (docs/FORMAT.md), magic "KVCG"; JSON header:
    {"format": "kvcodec-grouped-chunk", "grouped_version": 2, "spec": KVSpec.to_dict(),
     "chunk_index", "start_token", "tokens", "resolution", "key",
     "parts": [{"group", "start", "tokens", "length", "crc32"}, ...]}   payload: the parts' blobs

Each part's own header carries the key `part_key(key, group)` (version 2; version 1 parts carry the
chunk's key and still read), so parts of two same-shape groups cannot be exchanged unnoticed.

Plain tensors go to the inner codec unchanged, and blobs that are not grouped (older single-group
data) decode through it: `GroupedCodec(HevcCodec(config))` reads everything `HevcCodec(config)` wrote.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import torch

from kvcodec.codecs.base import (
    ChunkCodec,
    ChunkInfo,
    EncodedChunk,
    StagedDecode,
    Target,
    check_keys,
    chunk_key,
    collect_chunks,
    narrowed_checked,
    restores_into,
)
from kvcodec.container import validate as v
from kvcodec.container.format import crc32, read_object, read_parsed, write_object
from kvcodec.dtypes import DTYPES
from kvcodec.errors import ChecksumError, ConfigError, FormatError, ShapeError, TruncatedError
from kvcodec.kvspec import GroupedKV, GroupSpec, KVSpec

MAGIC = b"KVCG"
GROUPED_VERSION = 2  # 2: each inner blob carries part_key(key, group)
READABLE_VERSIONS = (1, 2)
FORMAT_NAME = "kvcodec-grouped-chunk"
WHAT = "grouped kvcodec chunk blob"


@dataclasses.dataclass(frozen=True)
class Part:
    """One group's positions [start, start + tokens) inside a grouped chunk blob."""

    group: int
    start: int
    tokens: int
    length: int
    crc32: int


@dataclasses.dataclass(frozen=True)
class GroupedChunkInfo(ChunkInfo):
    """ChunkInfo of a grouped blob: `layers` counts the model's layers; kv_heads and head_dim are 0
    (the groups differ: see `spec`); `parts` says which positions of which group it holds."""

    spec: KVSpec | None = None
    parts: tuple[Part, ...] = ()
    version: int = GROUPED_VERSION


def is_grouped(blob: bytes | memoryview) -> bool:
    return bytes(blob[:4]) == MAGIC


_PART = v.record(
    {
        "group": v.integer(0, v.MAX_DIM),
        "start": v.integer(0, v.MAX_TOKENS),
        "tokens": v.integer(1, v.MAX_TOKENS),
        "length": v.integer(1, 1 << 40),
        "crc32": v.integer(0, 0xFFFFFFFF),
    },
    Part,
)
_FIELDS = {
    "chunk_index": v.integer(0, v.MAX_TOKENS),
    "start_token": v.integer(0, v.MAX_TOKENS),
    "tokens": v.integer(1, v.MAX_TOKENS),
    "resolution": v.pair(v.integer(1, v.MAX_FRAME_SIDE)),
    "key": v.text(512, optional=True),
    "parts": v.listing(_PART, 0, 4 * v.MAX_DIM),  # none: a chunk before every group's window
}


def spec_of(d: Any) -> KVSpec:
    """A header's KVSpec; FormatError (never a TypeError or an OverflowError) for a damaged one."""
    try:
        spec = KVSpec.from_dict(d)
    except FormatError:
        raise
    except (TypeError, ValueError, KeyError, AttributeError, OverflowError, ShapeError) as e:
        raise FormatError(f"header field 'spec' is not a valid KV spec: {e}") from e
    if len(spec.layers) > v.MAX_DIM or any(max(g.heads, g.head_dim) > v.MAX_DIM for g in spec.groups):
        raise FormatError(f"header field 'spec' announces more than {v.MAX_DIM} layers, heads or dims")
    return spec


def part_key(key: str | None, group: int) -> str:
    """The key an inner blob of group `group` carries (version 2): the chunk's key and the group,
    so that parts of same-shape groups cannot be exchanged unnoticed."""
    return f"{key or ''}#g{group}"


def _parse(blob: bytes | memoryview) -> tuple[GroupedChunkInfo, memoryview]:
    info, payload = read_parsed(blob, MAGIC, WHAT, _header_info)  # parsed once per header (a fetch reads it twice)
    need = sum(p.length for p in info.parts)
    if len(payload) != need:
        raise (TruncatedError if len(payload) < need else FormatError)(
            f"grouped chunk payload has {len(payload)} bytes; its parts take {need}"
        )
    return info, payload


def _header_info(header: dict[str, Any]) -> GroupedChunkInfo:
    fields = (*_FIELDS, "spec")
    version = v.tagged_version(header, FORMAT_NAME, "grouped_version", READABLE_VERSIONS, fields, "grouped chunk")
    spec = _interned(spec_of(header.get("spec")))
    f = v.fields_of(header, _FIELDS, {"key": None})
    start, tokens, parts = f["start_token"], f["tokens"], f["parts"]
    info = GroupedChunkInfo(
        f["chunk_index"], start, tokens, len(spec.layers), 0, 0, spec.dtype, "grouped", f["key"], spec=spec, parts=parts
    )
    for p in parts:
        if not (0 <= p.group < len(spec.groups) and start <= p.start and p.start + p.tokens == start + tokens):
            raise FormatError(f"grouped chunk part {p} does not fit the chunk [{start}, {start + tokens})")
    if len({p.group for p in parts}) != len(parts):
        raise FormatError("grouped chunk lists a group twice")
    return dataclasses.replace(info, version=version)


_SPECS: dict[KVSpec, KVSpec] = {}


def _interned(spec: KVSpec) -> KVSpec:
    """One KVSpec object per distinct spec among the headers kept (every chunk of a model carries the same spec:
    an 80-layer one is ~20 KB of objects, which every kept header would otherwise hold once)."""
    if len(_SPECS) >= 64 and spec not in _SPECS:
        _SPECS.clear()
    return _SPECS.setdefault(spec, spec)


def split_parts(info: GroupedChunkInfo, payload: memoryview) -> dict[int, tuple[Part, memoryview]]:
    """A parsed chunk's parts by group, in the order they are stored: group -> (Part, its bytes of the payload)."""
    parts, offset = {}, 0
    for p in info.parts:
        parts[p.group] = (p, payload[offset : offset + p.length])
        offset += p.length
    return parts


def chunk_info(blob: bytes | memoryview) -> GroupedChunkInfo:
    """A grouped chunk blob's checked header (no codec needed; its parts not verified)."""
    return _parse(blob)[0]


def describe_chunk(blob: bytes | memoryview) -> dict[str, Any]:
    """One grouped chunk blob's summary (codecs/describe.py), every part checksummed."""
    from kvcodec.codecs.describe import chunk_summary

    info, payload = _parse(blob)
    header, _ = read_object(blob, MAGIC, WHAT)
    for p, data in split_parts(info, payload).values():
        if crc32(data) != p.crc32:
            raise ChecksumError(f"grouped chunk {info.index}: part of group {p.group} fails its checksum")
    groups = info.spec.groups
    parts = [
        {"group": groups[p.group].name, "start": p.start, "tokens": p.tokens, "bytes": p.length} for p in info.parts
    ]
    return chunk_summary(
        blob,
        header["resolution"],
        2 * sum(math.prod(groups[p.group].shape(p.tokens)) for p in info.parts),
        format=FORMAT_NAME,
        version=info.version,
        codec="grouped",
        dtype=info.dtype,
        layers=info.layers,
        tokens=info.tokens,
        chunk_index=info.index,
        start_token=info.start_token,
        key=info.key,
        parts=parts,
    )


class GroupedCodec:
    """A ChunkCodec for GroupedKV: every group coded by `inner` (e.g. HevcCodec(CodecConfig(...))),
    or by `per_group[name]` / `per_group[kind]` where given (a codec calibrated for that kind of
    layer: "sliding", "mla", "full", or one group's name such as "mla-rope-1x32"). All codecs
    share chunk_tokens and resolutions; their ids all go into this codec's id."""

    def __init__(self, inner: ChunkCodec, per_group: Mapping[str, ChunkCodec] | None = None) -> None:
        self.per_group = dict(per_group or {})
        for name, codec in {"inner": inner, **self.per_group}.items():
            if not isinstance(codec, ChunkCodec):
                raise ConfigError(f"GroupedCodec: {name} is {type(codec).__name__}, not a ChunkCodec")
            if (codec.chunk_tokens, tuple(codec.resolutions)) != (inner.chunk_tokens, tuple(inner.resolutions)):
                raise ConfigError(
                    f"GroupedCodec: {name} codes {codec.chunk_tokens}-token chunks at "
                    f"{list(codec.resolutions)}; the inner codec {inner.chunk_tokens} at {list(inner.resolutions)}"
                )
        self.inner = inner
        self.id = f"grouped-v{GROUPED_VERSION}-{inner.id}"
        if self.per_group:
            ids = json.dumps(sorted((k, c.id) for k, c in self.per_group.items()))
            self.id += "-" + hashlib.blake2b(ids.encode(), digest_size=8).hexdigest()

    @property
    def codecs(self) -> tuple[ChunkCodec, ...]:
        """Every codec a group may be coded by: the inner one and the per-group ones."""
        return (self.inner, *self.per_group.values())

    def codec_for(self, group: GroupSpec) -> ChunkCodec:
        for name in (group.name, group.kind):
            if self.per_group.get(name) is not None:
                return self.per_group[name]
        return self.inner

    @classmethod
    def from_options(cls, inner: str | ChunkCodec = "hevc", **options: Any) -> GroupedCodec:
        """make_codec("grouped", inner="hevc", quant="exact"): the inner codec by name and its options."""
        if isinstance(inner, str):
            from kvcodec.codecs.registry import make_codec

            inner = make_codec(inner, **options)
        elif options:
            raise ConfigError(f"options {sorted(options)} apply to an inner codec given by name only")
        return cls(inner)

    @property
    def chunk_tokens(self) -> int:
        return self.inner.chunk_tokens

    @property
    def config(self) -> Any:
        """The inner codec's CodecConfig (None when it has none)."""
        return getattr(self.inner, "config", None)

    def decoder_name(self, device: str | torch.device) -> str:
        name = getattr(self.inner, "decoder_name", None)
        return f"grouped:{name(device) if name else type(self.inner).__name__}"

    @property
    def resolutions(self) -> tuple[tuple[int, int], ...]:
        return self.inner.resolutions

    # ---- encode ----------------------------------------------------------------------------------
    def encode_chunks(
        self,
        kv: GroupedKV | torch.Tensor,
        *,
        first_chunk_index: int = 0,
        keys: Sequence[str] | None = None,
        on_chunk: Callable[[EncodedChunk], None] | None = None,
    ) -> list[EncodedChunk]:
        """Chunks of `kv` from position first_chunk_index * chunk_tokens to kv.stop (a GroupedKV
        holds absolute positions); a plain tensor is coded by the inner codec as it is."""
        if isinstance(kv, torch.Tensor):
            return self.inner.encode_chunks(kv, first_chunk_index=first_chunk_index, keys=keys, on_chunk=on_chunk)
        if not isinstance(kv, GroupedKV):
            raise ShapeError(f"GroupedCodec encodes a GroupedKV or a KV tensor; got {type(kv).__name__}")
        ct = self.chunk_tokens
        starts = range(first_chunk_index * ct, kv.stop, ct)
        check_keys(keys, len(starts))
        chunks = (
            self._chunk(kv.view(start, min(start + ct, kv.stop)), first_chunk_index + n, chunk_key(keys, n))
            for n, start in enumerate(starts)
        )
        return collect_chunks(chunks, on_chunk)

    def _chunk(self, part: GroupedKV, index: int, key: str | None) -> EncodedChunk:
        start = index * self.chunk_tokens
        coded = []  # (group, start, tokens, EncodedChunk of the inner codec)
        for g, (s, t) in enumerate(zip(part.starts, part.tensors)):
            if t.shape[2]:
                codec = self.codec_for(part.spec.groups[g])
                inner = codec.encode_chunks(t, first_chunk_index=index, keys=[part_key(key, g)])
                if len(inner) != 1:
                    raise ConfigError(f"inner codec {codec.id} split {t.shape[2]} tokens into {len(inner)} chunks")
                coded.append((g, s, t.shape[2], inner[0]))
        blobs = []
        for res in self.resolutions:
            payloads = [c.blob_for(res) for *_, c in coded]
            parts = [
                {"group": g, "start": s, "tokens": n, "length": len(b), "crc32": crc32(b)}
                for (g, s, n, _), b in zip(coded, payloads)
            ]
            header = {
                "format": FORMAT_NAME,
                "grouped_version": GROUPED_VERSION,
                "spec": part.spec.to_dict(),
                "chunk_index": index,
                "start_token": start,
                "tokens": part.stop - start,
                "resolution": list(res),
                "key": key,
                "parts": parts,
            }
            blobs.append(write_object(MAGIC, header, payloads))
        encoders = sorted({getattr(c, "encoder", "") for *_, c in coded} - {""})
        return EncodedChunk(index, start, part.stop - start, self.resolutions, tuple(blobs), encoder=",".join(encoders))

    # ---- decode ----------------------------------------------------------------------------------
    def inspect_chunk(self, blob: bytes | memoryview) -> ChunkInfo:
        if not is_grouped(blob):
            return self.inner.inspect_chunk(blob)
        info, payload = _parse(blob)
        for p, data in split_parts(info, payload).values():  # the inner headers must verify too
            self.codec_for(info.spec.groups[p.group]).inspect_chunk(data)
        return info

    def decode_chunk(self, blob: bytes | memoryview, out: Target | GroupedKV) -> Target | GroupedKV:
        """Restore a chunk into `out`: for a grouped blob, a GroupedKV covering the chunk's
        positions (e.g. prefix_kv.view(start, stop)), each group from its own first position; a
        plain blob restores into a tensor, or into the one group of a uniform GroupedKV."""
        if not is_grouped(blob):
            if isinstance(out, GroupedKV):
                if not out.spec.uniform:
                    raise ShapeError("a plain (single-group) chunk cannot fill a KV of several layer groups")
                self.inner.decode_chunk(blob, out.tensors[0])
                return out
            return self.inner.decode_chunk(blob, out)
        info, parts = self._parts(blob, out)
        for g, group in enumerate(out.spec.groups):
            self._restore_group(g, group, parts.get(g), out, info)
        return out

    def _parts(self, blob: bytes | memoryview, out: Target | GroupedKV) -> tuple[GroupedChunkInfo, dict]:
        """A grouped chunk's header, checked against the target, and its parts by group: group -> (Part, bytes)."""
        if not isinstance(out, GroupedKV):
            raise ShapeError(f"a grouped chunk restores into a GroupedKV; got {type(out).__name__}")
        info, payload = _parse(blob)
        self._check_target(info, out)
        return info, split_parts(info, payload)

    @staticmethod
    def _check_target(info: GroupedChunkInfo, out: GroupedKV) -> None:
        if dataclasses.replace(out.spec, dtype=info.spec.dtype) != info.spec:  # restored into any dtype
            raise ShapeError(f"the chunk holds KV of another model shape or dtype: {_spec_diff(info.spec, out.spec)}")
        if out.stop != info.start_token + info.tokens or min(out.starts) < info.start_token:
            raise ShapeError(
                f"target covers positions from {min(out.starts)} to {out.stop}; chunk {info.index} holds "
                f"[{info.start_token}, {info.start_token + info.tokens})"
            )

    def _restore_group(
        self, g: int, group: GroupSpec, part: tuple[Part, memoryview] | None, out: GroupedKV, info: GroupedChunkInfo
    ) -> None:
        checked = self._checked_part(g, group, part, out, info)
        if checked is None:
            return
        codec, data, p = checked
        target = out.tensors[g]
        if _direct(codec, p, out, g, info):
            codec.decode_chunk(data, target)
        else:
            target.copy_(_decoded_whole(codec, data, p, out, g, info))

    def _checked_part(
        self, g: int, group: GroupSpec, part: tuple[Part, memoryview] | None, out: GroupedKV, info: GroupedChunkInfo
    ) -> tuple[ChunkCodec, memoryview, Part] | None:
        """(the group's codec, its part's bytes, the part) with every check passed; None: the target holds
        nothing of this group here."""
        name, codec = group.name, self.codec_for(group)
        need = out.stop - out.starts[g]
        if need == 0:
            return None
        if part is None or part[0].start > out.starts[g]:
            have = "nothing" if part is None else f"positions from {part[0].start}"
            raise ShapeError(f"group {name}: the chunk holds {have}; the target needs them from {out.starts[g]}")
        p, data = part
        if crc32(data) != p.crc32:
            raise ChecksumError(f"group {name}: part checksum mismatch")
        _check_part(codec.inspect_chunk(data), p, g, info)
        return codec, data, p

    # ---- staged decode (codecs.base.StagedDecode) --------------------------------------------------
    @property
    def stages(self) -> bool:
        """Every group's codec restores in two halves (StagedDecode): a fetch stages this codec's chunks on
        its decode workers and finishes each group of many chunks in one call of that group's codec."""
        return all(isinstance(c, StagedDecode) for c in self.codecs)

    def stage(self, blob: bytes | memoryview, out: Target | GroupedKV) -> GroupedStaged:
        """decode_chunk's checks of a chunk, each group's part staged by its codec where it restores straight
        into the target (its whole positions, a dtype it restores into), else decoded here into memory of its
        own (checked against the target's dtype): `out` is not written before finish."""
        if not is_grouped(blob):
            if isinstance(out, GroupedKV) and not out.spec.uniform:
                raise ShapeError("a plain (single-group) chunk cannot fill a KV of several layer groups")
            target = out.tensors[0] if isinstance(out, GroupedKV) else out
            scratch = torch.empty_like(target)
            self.inner.decode_chunk(blob, scratch)
            return GroupedStaged((), ((target, scratch),))
        info, parts = self._parts(blob, out)
        staged, copies = [], []
        for g, group in enumerate(out.spec.groups):
            checked = self._checked_part(g, group, parts.get(g), out, info)
            if checked is None:
                continue
            codec, data, p = checked
            if isinstance(codec, StagedDecode) and _direct(codec, p, out, g, info):
                staged.append((g, codec, codec.stage(data, out.tensors[g]), out.tensors[g]))
            else:
                copies.append((out.tensors[g], _decoded_whole(codec, data, p, out, g, info)))
        return GroupedStaged(tuple(staged), tuple(copies))

    def finish(self, staged: Sequence[GroupedStaged], outs: Sequence[Target | GroupedKV]) -> None:
        finish_grouped(staged)

    # ---- driven restore (codecs/driven.py) -------------------------------------------------------
    @property
    def codes_video(self) -> bool:
        """Whether any group's chunks hold a video (NVDEC sessions are borrowed for a driven fetch)."""
        return any(getattr(c, "codes_video", True) for c in self.codecs)

    def driven_chunks(self):  # noqa: ANN201 - a GroupedDriven or None
        """This codec's DrivenChunks where every group's codec has one (codecs/grouped_driven.py); None: not driven."""
        from kvcodec.codecs.grouped_driven import grouped_driven

        return grouped_driven(self)


def finish_grouped(staged: Sequence[GroupedStaged]) -> None:
    """Each group's staged parts of every chunk by one finish of what staged it (its codec, or its codec's
    DrivenChunks), in chunk order; then the copies the staging left (what it restored into memory of its own)."""
    batches: dict[tuple[int, int], tuple[Any, list, list]] = {}
    for st in staged:
        for g, stager, part, target in st.parts:
            batch = batches.setdefault((g, id(stager)), (stager, [], []))
            batch[1].append(part)
            batch[2].append(target)
    for stager, parts, targets in batches.values():
        stager.finish(parts, targets)
    for st in staged:
        for target, restored in st.copies:
            target.copy_(restored)


@dataclasses.dataclass(frozen=True)
class GroupedStaged:
    """A grouped chunk's staged groups (group, what staged it: its codec or that codec's DrivenChunks, the staged
    part, the group's target) and the copies left to finish (target, values restored into memory of their own:
    groups that cannot be staged, a plain chunk, the positions of a chunk past the fetch's target)."""

    parts: tuple[tuple[int, Any, object, torch.Tensor], ...]
    copies: tuple[tuple[torch.Tensor, torch.Tensor], ...] = ()


def _direct(codec: ChunkCodec, p: Part, out: GroupedKV, g: int, info: GroupedChunkInfo) -> bool:
    """Group g's part restores straight into the target: it holds the target's positions of the group
    exactly, in a dtype the codec restores this chunk into."""
    return p.tokens == out.stop - out.starts[g] and restores_into(codec, DTYPES[info.spec.dtype], out.tensors[g].dtype)


def _decoded_whole(codec: ChunkCodec, data, p: Part, out: GroupedKV, g: int, info: GroupedChunkInfo) -> torch.Tensor:  # noqa: ANN001
    """Group g's part restored whole into memory of its own, as the target's positions of it in the target's
    dtype (a ShapeError where a finite value would turn to inf): the chunk holds more of the group than the
    target keeps, or the target's dtype is not one the codec restores this chunk into."""
    target, stored = out.tensors[g], DTYPES[info.spec.dtype]
    need = out.stop - out.starts[g]
    into = target.dtype if restores_into(codec, stored, target.dtype) else stored
    full = torch.empty((*target.shape[:2], p.tokens, *target.shape[3:]), dtype=into, device=target.device)
    codec.decode_chunk(data, full)
    return narrowed_checked(full[:, :, p.tokens - need :], target.dtype, f"group {out.spec.groups[g].name}")


def _check_part(inner: ChunkInfo, p: Part, g: int, info: GroupedChunkInfo) -> None:
    """Refuse an inner blob that is not group g's part of this chunk: its own header must give
    the part's token count and (version 2) the chunk's key bound to the group."""
    want_key = part_key(info.key, g) if info.version >= 2 else inner.key
    if inner.tokens != p.tokens or inner.key != want_key:
        raise FormatError(
            f"grouped chunk {info.index}: the part listed for group {g} holds {inner.tokens} tokens under key "
            f"{inner.key!r}; expected {p.tokens} under {want_key!r} (parts exchanged or moved)"
        )


def _spec_diff(a: KVSpec, b: KVSpec) -> str:
    if a.dtype != b.dtype:
        return f"dtype {a.dtype}, target {b.dtype}"
    if len(a.layers) != len(b.layers):
        return f"{len(a.layers)} layers, target {len(b.layers)}"
    i = next(i for i, (x, y) in enumerate(zip(a.layers, b.layers)) if x != y)
    return f"layer {i} is {a.layers[i].to_dict()}, target {b.layers[i].to_dict()}"
