"""Text as one field of a store key: injective, reversible, safe in every store's keys (file
names, Redis keys). Pure."""

from __future__ import annotations

SAFE = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789._-")


def key_field(text: str) -> str:
    """`text`'s UTF-8 bytes, each outside SAFE as "=xx" (always two hex digits, so that no two
    texts give one field: "=100" is not both U+0100 and "\\x10" + "0"); "=" alone for ""."""
    raw = text.encode("utf-8", "surrogatepass")
    return "".join(chr(b) if chr(b) in SAFE else f"={b:02x}" for b in raw) or "="


def field_text(field: str) -> str:
    """key_field's inverse; ValueError where `field` is not one of its results."""
    if field == "=":
        return ""
    out, i = bytearray(), 0
    while i < len(field):
        if field[i] == "=" and len(field) >= i + 3:
            out += bytes.fromhex(field[i + 1 : i + 3])
            i += 3
        elif field[i] in SAFE:
            out += field[i].encode()
            i += 1
        else:
            raise ValueError(f"not a key field: {field!r}")
    text = out.decode("utf-8", "surrogatepass")
    if key_field(text) != field:  # another spelling of the same bytes ("=41" for "A", upper-case hex)
        raise ValueError(f"not a key field: {field!r}")
    return text
