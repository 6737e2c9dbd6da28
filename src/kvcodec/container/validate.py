"""Type and range checks of header fields (pure functions).

Every check raises `FormatError` naming the field, so a damaged or forged header never reaches a
decoder as a negative count, a null, a dict where a string belongs, or a size that would make the
decoder allocate far more than the container could ever hold.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import numpy as np

from kvcodec.errors import FormatError

MAX_JSON_DEPTH = 8  # deepest legitimate header: file -> blobs -> entry -> resolution = 4
MAX_DIM = 1 << 16  # layers, kv_heads, head_dim
MAX_TOKENS = 1 << 31
MAX_FRAME_SIDE = 1 << 14
# A container may not announce more decoded bytes than this many times its own size. Lossless
# HEVC and zstd of constant KV stay near 10^3 (tests/test_container.py encodes an all-zero KV);
# real KV is under 10. The limit keeps a 300-byte forgery from allocating gigabytes.
MAX_EXPANSION = 1 << 16
DTYPE_BYTES = {"float16": 2, "bfloat16": 2, "float32": 4}
STREAM_CODECS = ("hevc", "zstd", "raw")
PARAM_DTYPES = ("float16", "float32", "")
ORIENTATIONS = ("token_major", "channel_major")

_STRING = re.compile(rb'"(?:[^"\\]|\\.)*"', re.DOTALL)
_OPEN = np.zeros(256, dtype=np.int8)
_OPEN[[ord("["), ord("{")]] = 1
_OPEN[[ord("]"), ord("}")]] = -1

Check = Callable[[Any, str], Any]


def json_depth(text: bytes) -> int:
    """Deepest nesting of arrays/objects in JSON text (brackets inside strings do not count)."""
    if b"\\" not in text:  # no escapes: every quote opens or closes a string (a header, as written)
        return _depth_without_escapes(text)
    return _deepest(_STRING.sub(b'""', text))


def _depth_without_escapes(text: bytes) -> int:
    """json_depth of text holding no backslash, without the string pattern: the text between the
    2k-th and (2k+1)-th quotes is outside strings, and so is what follows an unpaired last quote
    (as the pattern leaves it). Several times faster on a chunk header."""
    parts = text.split(b'"')
    outside = parts[::2] if len(parts) % 2 else [*parts[::2], parts[-1]]
    brackets = b"".join(outside).translate(None, _NOT_BRACKETS)
    if len(brackets) > 64:
        return _deepest(brackets)
    depth = deepest = 0
    for c in brackets:  # a header's few brackets: cheaper in Python than through numpy
        depth += 1 if c in _OPENERS else -1
        deepest = max(deepest, depth)
    return deepest


def _deepest(skeleton_text: bytes) -> int:
    """The deepest running count of openers less closers over text whose strings hold no brackets."""
    skeleton = np.frombuffer(skeleton_text, dtype=np.uint8)
    if skeleton.size == 0:
        return 0
    return int(max(np.cumsum(_OPEN[skeleton], dtype=np.int64).max(), 0))


_OPENERS = b"[{"
_NOT_BRACKETS = bytes(c for c in range(256) if c not in b"[]{}")


def check_json_depth(text: bytes, what: str) -> None:
    depth = json_depth(text)
    if depth > MAX_JSON_DEPTH:
        raise FormatError(f"{what} header nests {depth} levels deep; at most {MAX_JSON_DEPTH} are allowed")


def fail(field: str, value: Any, expected: str) -> FormatError:
    shown = repr(value)
    shown = shown if len(shown) <= 60 else shown[:57] + "..."
    return FormatError(f"header field {field!r} is {shown}; expected {expected}")


def integer(lo: int, hi: int) -> Check:
    def check(v: Any, field: str) -> int:
        if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
            raise fail(field, v, f"an integer in {lo}..{hi}")
        return v

    return check


def choice(options: tuple[str, ...]) -> Check:
    def check(v: Any, field: str) -> str:
        if not isinstance(v, str) or v not in options:
            raise fail(field, v, "one of " + ", ".join(repr(o) for o in options))
        return v

    return check


def text(max_len: int = 1024, optional: bool = False) -> Check:
    def check(v: Any, field: str) -> str | None:
        if v is None and optional:
            return None
        if not isinstance(v, str) or not 0 < len(v) <= max_len:
            raise fail(field, v, f"a string of 1..{max_len} characters" + (" or null" if optional else ""))
        return v

    return check


def listing(item: Check, min_len: int = 0, max_len: int = MAX_TOKENS) -> Check:
    def check(v: Any, field: str) -> tuple:
        if not isinstance(v, list) or not min_len <= len(v) <= max_len:
            raise fail(field, v, f"a list of {min_len}..{max_len} entries")
        return tuple(item(x, f"{field}[{i}]") for i, x in enumerate(v))

    return check


def pair(item: Check) -> Check:
    return listing(item, 2, 2)


def mapping(what: str) -> Check:
    def check(v: Any, field: str) -> dict:
        if not isinstance(v, dict):
            raise fail(field, v, what)
        return v

    return check


def record(fields: Mapping[str, Check], build: Callable[..., Any] = dict) -> Check:
    """A JSON object with exactly `fields` (each checked), built by `build(**checked)`."""

    def check(v: Any, field: str) -> Any:
        if not isinstance(v, dict):
            raise fail(field, v, "an object with fields " + ", ".join(fields))
        missing = [k for k in fields if k not in v]
        extra = [k for k in v if k not in fields]
        if missing or extra:
            raise FormatError(f"header field {field!r} has fields missing {missing} / unexpected {extra}")
        return build(**{k: c(v[k], f"{field}.{k}") for k, c in fields.items()})

    return check


def fields_of(d: Mapping[str, Any], checks: Mapping[str, Check], optional: Mapping[str, Any]) -> dict[str, Any]:
    """Checked values of a header's fields; a field in `optional` may be absent (its default)."""
    out = {}
    for name, check in checks.items():
        if name not in d:
            if name in optional:
                out[name] = optional[name]
                continue
            raise FormatError(f"header lacks the field {name!r}")
        out[name] = check(d[name], name)
    return out


LAYOUT = record(
    {
        "width": integer(1, MAX_FRAME_SIDE),
        "height": integer(1, MAX_FRAME_SIDE),
        "units": integer(1, 2 * MAX_DIM * MAX_DIM),
        "dim": integer(1, MAX_DIM),
        "tokens_per_frame": integer(1, MAX_TOKENS),
        "tile_w": integer(1, MAX_FRAME_SIDE),
        "tile_h": integer(1, MAX_FRAME_SIDE),
        "orientation": choice(ORIENTATIONS),
    }
)


def tagged_version(
    header: Mapping[str, Any], tag: str, version_field: str, readable: tuple[int, ...], fields: Iterable[str], what: str
) -> int:
    """The version of a header tagged {"format": tag, version_field: N}: FormatError unless N is
    one this build reads and the header has no field beyond `fields`, the tag and the version."""
    version = header.get(version_field)
    if header.get("format") != tag or isinstance(version, bool) or version not in readable:
        raise FormatError(f"{what} version {version!r} is not one this build reads {readable}")
    extra = sorted(set(header) - set(fields) - {"format", version_field})
    if extra:
        raise FormatError(f"{what} header has unknown fields {extra}")
    return version


def check_expansion(decoded_bytes: int, stored_bytes: int, what: str) -> None:
    """Refuse a container announcing more output than MAX_EXPANSION times its own size."""
    if decoded_bytes > MAX_EXPANSION * max(stored_bytes, 1):
        raise FormatError(
            f"{what} announces {decoded_bytes} decoded bytes from {stored_bytes} stored bytes "
            f"(over {MAX_EXPANSION}x): a forged or damaged header"
        )
