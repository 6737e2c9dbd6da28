"""Chunk codecs by name: one registration per codec, built-ins registered here.

    register_codec("mine", "mypkg.codec:MyCodec")    # or a callable factory(**options)
    codec = make_codec("hevc", config=CodecConfig(quant="int4"))
    registered_codecs()                              # ["hevc", "raw", ...]

Factories are called with the options given to make_codec and return a ChunkCodec. Installed
packages add codecs through entry points of group "kvcodec.codecs" (name -> "module:attr").
"""

from __future__ import annotations

import importlib.metadata
from collections.abc import Callable
from typing import Any

from kvcodec.codecs.base import ChunkCodec
from kvcodec.errors import ConfigError
from kvcodec.plugins import check_arguments, load_object

PLUGIN_GROUP = "kvcodec.codecs"

CodecFactory = Callable[..., ChunkCodec]

_REGISTRY: dict[str, str | CodecFactory] = {
    "hevc": "kvcodec.codecs.hevc.codec:HevcCodec.from_options",
    "raw": "kvcodec.codecs.raw:RawCodec",
    "grouped": "kvcodec.codecs.grouped:GroupedCodec.from_options",
    "transform": "kvcodec.codecs.transform.codec:make_transform_codec",
    "transform-ans": "kvcodec.codecs.transform_ans:make_transform_ans_codec",
}


def register_codec(name: str, factory: str | CodecFactory) -> None:
    """Register `factory(**options) -> ChunkCodec` (or its "module:attr") under `name`."""
    if not isinstance(name, str) or not name:
        raise ConfigError(f"a codec name must be a non-empty string; got {name!r}")
    _REGISTRY[name] = factory


def _plugins() -> dict[str, str]:
    return {ep.name: ep.value for ep in importlib.metadata.entry_points(group=PLUGIN_GROUP)}


def registered_codecs() -> list[str]:
    return sorted({*_REGISTRY, *_plugins()})


def make_codec(name: str, **options: Any) -> ChunkCodec:
    """A new codec of the kind registered as `name`, configured by `options`."""
    factory = _REGISTRY.get(name) or _plugins().get(name)
    if factory is None:
        raise ConfigError(f"unknown codec {name!r}; registered: {', '.join(registered_codecs())}")
    if isinstance(factory, str):
        factory = load_object(factory)
    check_arguments(factory, f"codec {name!r}", **options)
    codec = factory(**options)
    if not isinstance(codec, ChunkCodec):
        raise ConfigError(f"codec factory {name!r} returned {type(codec).__name__}, not a ChunkCodec")
    return codec
