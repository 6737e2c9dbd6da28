"""The header of a transform-ANS chunk (magic KVTA, docs/FORMAT.md): the transform codec's
fields (same .kvt, same level and quantization) with the integer samples in an rANS stream
instead of HEVC frames. Every field is typed and range-checked before a byte of payload is read."""

from __future__ import annotations

import dataclasses
from typing import Any

from kvcodec.codecs.transform.header import FIELDS as TRANSFORM_FIELDS
from kvcodec.codecs.transform_ans.rans import AnsParams
from kvcodec.container import validate as v
from kvcodec.container.format import StreamEntry
from kvcodec.errors import ConfigError, FormatError

CHUNK_MAGIC = b"KVTA"
ANS_VERSION = 1
READABLE_VERSIONS = (1,)
STREAM_NAMES = ("escapes", "sink", "ans")
STREAM_CODECS = {"escapes": "zstd", "sink": "zstd", "ans": "rans"}
SHARED = ("kvt", "codec", "index", "start_token", "tokens", "shape", "dtype", "theta", "key_weight", "sink")
SHARED += ("fine_tokens", "fine_bits", "recon", "resolution", "escapes", "key")


def _stream(x: Any, field: str) -> StreamEntry:
    if not isinstance(x, list) or len(x) != 4:
        raise v.fail(field, x, "[name, codec, length, crc32]")
    name = v.choice(STREAM_NAMES)(x[0], f"{field}.name")
    if x[1] != STREAM_CODECS[name]:
        raise v.fail(f"{field}.codec", x[1], repr(STREAM_CODECS[name]))
    return StreamEntry(
        name, x[1], v.integer(0, 1 << 40)(x[2], f"{field}.length"), v.integer(0, 0xFFFFFFFF)(x[3], f"{field}.crc32")
    )


FIELDS: dict[str, v.Check] = {
    **{k: TRANSFORM_FIELDS[k] for k in SHARED},
    "ans_version": v.integer(0, 1 << 16),
    "samples": v.integer(1, v.MAX_TOKENS),
    "block": v.integer(1, 1 << 24),
    "lanes": v.integer(1, 1024),
    "streams": v.listing(_stream, 2, len(STREAM_NAMES)),
}


@dataclasses.dataclass(frozen=True)
class AnsChunkHeader:
    """One chunk's header. `samples`: coded coordinates x tokens (the rANS stream's symbols, the
    transform's layout order); `block`, `lanes`: how the stream is cut (rans.AnsParams)."""

    kvt: str
    codec: str
    index: int
    start_token: int
    tokens: int
    shape: tuple[int, int, int]
    dtype: str
    theta: float
    key_weight: float
    sink: int
    fine_tokens: int
    fine_bits: int
    recon: str
    resolution: tuple[int, int]
    escapes: int
    samples: int
    block: int
    lanes: int
    streams: tuple[StreamEntry, ...]
    key: str | None = None
    ans_version: int = ANS_VERSION

    @property
    def params(self) -> AnsParams:
        return AnsParams(self.block, self.lanes)

    def to_json(self) -> dict[str, Any]:
        d = dict(vars(self))  # every field is a scalar but the three below (asdict's deep copy: 100 us)
        d["shape"], d["resolution"] = list(self.shape), list(self.resolution)
        d["streams"] = [[s.name, s.codec, s.length, s.crc32] for s in self.streams]
        return d

    @classmethod
    def from_json(cls, h: Any) -> AnsChunkHeader:
        """The checked header; FormatError naming the field that is missing, mistyped or out of range."""
        if not isinstance(h, dict):
            raise FormatError("transform-ANS chunk header is not a JSON object")
        version = FIELDS["ans_version"](h.get("ans_version"), "ans_version")
        if version not in READABLE_VERSIONS:
            raise FormatError(f"transform-ANS chunk version {version} is not readable (this reads {READABLE_VERSIONS})")
        extra = sorted(set(h) - set(FIELDS))
        if extra:
            raise FormatError(f"transform-ANS chunk header has unknown fields {extra}")
        c = v.fields_of(h, FIELDS, {"key": None})
        names = [s.name for s in c["streams"]]
        need = {"escapes", "ans"} | ({"sink"} if c["sink"] else set())
        if len(set(names)) != len(names) or set(names) != need:
            raise FormatError(f"transform-ANS chunk streams {names} are not {sorted(need)}")
        for field in ("sink", "fine_tokens"):
            if c[field] > c["tokens"]:
                raise v.fail(field, c[field], f"at most tokens={c['tokens']}")
        try:
            AnsParams(c["block"], c["lanes"])
        except ConfigError as e:
            raise FormatError(f"transform-ANS chunk: {e}") from None
        c["shape"], c["resolution"], c["streams"] = tuple(c["shape"]), tuple(c["resolution"]), tuple(c["streams"])
        return cls(**c)

    def restorer_fields(self) -> dict[str, Any]:
        """The header as the transform codec's restore path reads it (a transform chunk's fields)."""
        d = self.to_json()
        d.update(coder="ans", frames=0, transform_version=None)
        return d
