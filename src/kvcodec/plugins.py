"""The one "module:attr" loader: registries (codecs, video backends, stores) name their lazily
imported factories this way, so registering a backend never imports it; and the check of the
options a caller hands such a factory."""

from __future__ import annotations

import functools
import importlib
import inspect
from collections.abc import Callable
from typing import Any

from kvcodec.errors import ConfigError


@functools.cache
def load_object(target: str) -> Any:
    """The object `target` names: "package.module:attr" or "package.module:Class.method".
    ConfigError if it is not of that form; ImportError/AttributeError from the import itself."""
    module, sep, attr = target.partition(":")
    if not sep or not module or not attr:
        raise ConfigError(f"{target!r} is not a 'module:attr' reference")
    obj: Any = importlib.import_module(module)
    for part in attr.split("."):
        obj = getattr(obj, part)
    return obj


def check_arguments(fn: Callable, what: str, *args: Any, **options: Any) -> None:
    """ConfigError naming what `fn(*args, **options)` would be refused for (an option it does not
    take, one it needs and lacks), before it runs. A factory that takes **options passes this
    check: it checks them where it hands them on."""
    try:
        inspect.signature(fn).bind(*args, **options)
    except TypeError as e:
        given = ", ".join(sorted(options)) or "none"
        raise ConfigError(f"{what} refuses its options ({given}): {e}") from None
