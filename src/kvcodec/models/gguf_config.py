"""A GGUF file's transformers config in a fraction of a second: only the header's metadata is read
(large arrays such as the tokenizer's vocabulary are skipped, not parsed), then mapped to config
fields with transformers' own GGUF tables, as its loader does. kvcodec checks a model from this
before any weights load; transformers' full parser (seconds to minutes: it parses every vocabulary
string) stays the fallback for files this reader does not understand."""

from __future__ import annotations

import struct
from pathlib import Path
from typing import Any, BinaryIO

from kvcodec.errors import ConfigError

_SCALARS = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}
_STRING, _ARRAY = 8, 9
MAX_KEPT_ARRAY = 4096  # numeric arrays up to this long are kept (per-layer settings); longer ones skipped
_RENAMES = (("qwen2moe", "qwen2_moe"), ("gpt_oss", "gpt_oss"), ("gpt-oss", "gpt_oss"), ("qwen3moe", "qwen3_moe"))


class DamagedGGUFError(ConfigError):
    """A GGUF header that ends early or holds impossible values: no other parser reads it either."""


def _exactly(f: BinaryIO, n: int) -> bytes:
    data = f.read(n)
    if len(data) != n:
        raise DamagedGGUFError(f"truncated GGUF header (ends at byte {f.tell()})")
    return data


def _read(f: BinaryIO, fmt: str) -> Any:
    return struct.unpack(fmt, _exactly(f, struct.calcsize(fmt)))[0]


def _string(f: BinaryIO) -> str:
    n = _read(f, "<Q")
    if n > 1 << 24:
        raise DamagedGGUFError("implausible GGUF string length")
    return _exactly(f, n).decode("utf-8", errors="replace")


def _value(f: BinaryIO, kind: int) -> Any:
    if kind in _SCALARS:
        return _read(f, _SCALARS[kind])
    if kind == _STRING:
        return _string(f)
    if kind != _ARRAY:
        raise ConfigError(f"unknown GGUF value type {kind}")
    item, count = _read(f, "<I"), _read(f, "<Q")
    if item in _SCALARS:
        size = struct.calcsize(_SCALARS[item])
        if count > MAX_KEPT_ARRAY:
            f.seek(size * count, 1)
            return _Skipped(count)
        return list(struct.unpack(f"<{count}{_SCALARS[item][1]}", _exactly(f, size * count)))
    if item == _STRING:
        for _ in range(count):
            f.seek(_read(f, "<Q"), 1)
        return _Skipped(count)
    return [_value(f, item) for _ in range(count)]


class _Skipped:
    """A long array left unparsed: only its length is known."""

    def __init__(self, count: int) -> None:
        self.count = count


def read_header(path: str | Path) -> tuple[dict[str, Any], list[str]]:
    """(metadata key -> value, tensor names) of a GGUF file."""
    with open(path, "rb") as f:
        if f.read(4) != b"GGUF":
            raise ConfigError(f"{path} is not a GGUF file")
        version = _read(f, "<I")
        if version < 2:
            raise ConfigError(f"GGUF version {version} is not supported")
        tensors, kvs = _read(f, "<Q"), _read(f, "<Q")
        fields = {}
        for _ in range(kvs):
            key = _string(f)
            fields[key] = _value(f, _read(f, "<I"))
        names = []
        for _ in range(tensors):
            names.append(_string(f))
            dims = _read(f, "<I")
            f.seek(8 * dims + 4 + 8, 1)  # dims, type, offset
    return fields, names


def gguf_config(path: str | Path) -> Any:
    """The transformers config of a GGUF file, from its header alone."""
    from transformers import AutoConfig
    from transformers.integrations.ggml import GGUF_CONFIG_DEFAULTS_MAPPING, GGUF_CONFIG_MAPPING

    fields, tensors = read_header(path)
    arch = fields.get("general.architecture")
    if not isinstance(arch, str):
        raise ConfigError(f"{path}: the GGUF header names no architecture")
    name = str(fields.get("general.name", "")).lower()
    updated = "mistral" if "llama" in arch and "mistral" in name else arch
    for old, new in _RENAMES:
        updated = new if old in arch else updated
    if updated not in GGUF_CONFIG_MAPPING:
        raise ConfigError(f"{path}: GGUF architecture {arch!r} is not one transformers loads")
    config: dict[str, Any] = dict(GGUF_CONFIG_DEFAULTS_MAPPING.get(updated, {}))
    config["tie_word_embeddings"] = "output.weight" not in tensors
    for key, value in fields.items():
        prefix, _, rest = key.replace(arch, updated).partition(".")
        target = GGUF_CONFIG_MAPPING.get(prefix, {}).get(rest)
        if target in (None, -1) or isinstance(value, _Skipped):
            continue
        config[target] = value.replace(arch, updated) if isinstance(value, str) else value
    if "vocab_size" not in config and isinstance(fields.get("tokenizer.ggml.tokens"), _Skipped):
        config["vocab_size"] = fields["tokenizer.ggml.tokens"].count
    model_type = {"gemma3": "gemma3_text", "gemma4": "gemma4_text"}.get(
        config.get("model_type"), config.get("model_type")
    )
    if model_type == "lfm2" and isinstance(config.get("num_key_value_heads"), list):
        heads = config["num_key_value_heads"]
        config.update(num_key_value_heads=max(heads), full_attn_idxs=[i for i, h in enumerate(heads) if h > 0])
    config.pop("model_type", None)
    config.pop("_model_name_or_path", None)
    try:
        return AutoConfig.for_model(model_type, **config)
    except (ValueError, KeyError, TypeError) as e:
        raise ConfigError(f"{path}: cannot build a {model_type} config from the GGUF header ({e})") from e
