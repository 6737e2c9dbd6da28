"""Baselines: what users would pick instead of kvcodec.

    from kvbench.baselines import get_codec, available_codecs
    coder = get_codec("zstd-19")            # a whole-tensor TensorCoder
    data = coder.encode(kv)                 # kv: (layers, 2, tokens, kv_heads, head_dim)
    kv2 = coder.decode(data, device="cpu")

    from kvbench.baselines.chunk import BaselineCodec
    codec = BaselineCodec("cachegen")       # the same baseline as a kvcodec ChunkCodec, chunk by chunk

kvcodec's codec registry finds them too: make_codec("baseline", baseline="cachegen") (an entry point of
the kvbench package), or make_codec("cachegen") after kvbench.baselines.chunk.register_chunk_codecs().

Codecs are registered by name (like LMCache's serializers): a name maps to "module:Class" plus
constructor arguments; modules import only when a codec is asked for, so entries that need CUDA,
nvCOMP, LMCache or kvcodec's own encoder drop out of `available_codecs()` where those are missing.
Add a codec with `register_codec`.
"""

from __future__ import annotations

import functools
import importlib
import logging
from dataclasses import dataclass, field
from typing import Any

from kvbench.baselines.base import TensorCoder
from kvcodec.errors import BackendUnavailableError, ConfigError

log = logging.getLogger(__name__)

__all__ = ["TensorCoder", "CodecEntry", "available_codecs", "get_codec", "register_codec", "registered_codecs"]


@dataclass(frozen=True)
class CodecEntry:
    name: str
    target: str  # "module:ClassName"
    kwargs: dict[str, Any] = field(default_factory=dict)
    description: str = ""

    def load(self):
        module, cls = self.target.split(":")
        return getattr(importlib.import_module(module), cls)


_REGISTRY: dict[str, CodecEntry] = {}


@functools.cache
def _is_available(name: str) -> bool:
    entry = _REGISTRY[name]
    try:
        return bool(entry.load().is_available())
    except Exception as e:  # a codec whose module cannot import is unavailable
        log.debug("baseline codec %s unavailable: %s", name, e)
        return False


def register_codec(name: str, target: str, description: str = "", **kwargs: Any) -> None:
    """Register a codec class (with `name`, `lossless`, `encode`, `decode`, `is_available()`) under
    `name`; it is built as Class(name=name, **kwargs)."""
    if name in _REGISTRY:
        raise ConfigError(f"codec {name!r} is already registered")
    _REGISTRY[name] = CodecEntry(name, target, dict(kwargs), description)
    _is_available.cache_clear()


_G = "kvbench.baselines.general"
_BUILTIN = [
    ("raw", f"{_G}:RawCodec", "identity: the KV bits as they are", {}),
    ("zstd-3", f"{_G}:ByteCodec", "zstd level 3 on the KV bytes", {"backend": "zstd", "level": 3}),
    ("zstd-19", f"{_G}:ByteCodec", "zstd level 19 on the KV bytes", {"backend": "zstd", "level": 19}),
    ("zstd-3-shuffle", f"{_G}:ByteCodec", "zstd 3 on byte planes", {"backend": "zstd", "level": 3, "shuffle": True}),
    ("zstd-19-shuffle", f"{_G}:ByteCodec", "zstd 19 on byte planes", {"backend": "zstd", "level": 19, "shuffle": True}),
    ("lz4", f"{_G}:ByteCodec", "lz4 frame (default level) on the KV bytes", {"backend": "lz4", "level": 0}),
    ("lz4-shuffle", f"{_G}:ByteCodec", "lz4 on byte planes", {"backend": "lz4", "level": 0, "shuffle": True}),
    ("int8-zstd-19", f"{_G}:QuantZstdCodec", "per-channel min-max int8, then zstd 19", {"bits": 8, "level": 19}),
    (
        "int4-zstd-19",
        f"{_G}:QuantZstdCodec",
        "per-channel min-max int4 (byte per symbol), then zstd 19",
        {"bits": 4, "level": 19},
    ),
    (
        "cachegen",
        "kvbench.baselines.cachegen:CacheGenCodec",
        "CacheGen-style per-token quantization + per-(layer, channel) rANS, LMCache bins",
        {},
    ),
    (
        "cachegen-compact",
        "kvbench.baselines.cachegen:CacheGenCodec",
        "cachegen with zstd-compressed side information",
        {"table": "zstd"},
    ),
    (
        "lmcache-cachegen",
        "kvbench.baselines.lmcache_ref:LMCacheCacheGen",
        "LMCache's own CacheGen serializer (needs lmcache)",
        {},
    ),
    (
        "nvcomp-ans",
        "kvbench.baselines.nvcomp_codec:NvcompCodec",
        "nvCOMP ANS on the KV bytes (GPU)",
        {"algorithm": "ANS"},
    ),
    (
        "nvcomp-ans-shuffle",
        "kvbench.baselines.nvcomp_codec:NvcompCodec",
        "nvCOMP ANS on byte planes (GPU)",
        {"algorithm": "ANS", "shuffle": True},
    ),
    (
        "nvcomp-bitcomp",
        "kvbench.baselines.nvcomp_codec:NvcompCodec",
        "nvCOMP Bitcomp on 16/32-bit words (GPU)",
        {"algorithm": "Bitcomp", "typed": True},
    ),
    (
        "nvcomp-gdeflate",
        "kvbench.baselines.nvcomp_codec:NvcompCodec",
        "nvCOMP GDeflate on the KV bytes (GPU)",
        {"algorithm": "GDeflate"},
    ),
    (
        "nvcomp-gdeflate-shuffle",
        "kvbench.baselines.nvcomp_codec:NvcompCodec",
        "nvCOMP GDeflate on byte planes (GPU)",
        {"algorithm": "GDeflate", "shuffle": True},
    ),
]
_QUANTS = ("exact",) + tuple(f"int{b}" for b in range(2, 9))
for _name, _target, _desc, _kw in _BUILTIN:
    register_codec(_name, _target, _desc, **_kw)
for _q in _QUANTS:
    register_codec(
        f"kvcodec-{_q}", "kvbench.baselines.kvcodec_adapter:KVCodecAdapter", f"kvcodec, quant={_q}", quant=_q
    )


def registered_codecs() -> dict[str, str]:
    """Every registered name with its one-line description, available here or not."""
    return {n: e.description for n, e in _REGISTRY.items()}


def available_codecs() -> list[str]:
    """Names of the codecs that run on this machine, in registration order."""
    return [n for n in _REGISTRY if _is_available(n)]


def get_codec(name: str, **overrides: Any) -> TensorCoder:
    """Build the codec registered as `name` (constructor arguments may be overridden)."""
    entry = _REGISTRY.get(name)
    if entry is None:
        raise ConfigError(f"unknown baseline codec {name!r}; registered: {', '.join(_REGISTRY)}")
    if not _is_available(name):
        raise BackendUnavailableError(f"baseline codec {name!r} is not usable on this machine")
    return entry.load()(name=name, **{**entry.kwargs, **overrides})
