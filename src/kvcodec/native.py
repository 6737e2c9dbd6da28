"""Small C libraries compiled at first use: a module's C SOURCE built with the system C compiler
into the kvcodec cache directory (once per source text), loaded with ctypes.

Nothing is linked: the functions a library calls from other libraries (nvcuvid's, zstd's) are
handed to it as pointers from ctypes, so it builds anywhere a C compiler is. Without a compiler,
or where a build fails, `build` returns None and the caller keeps its Python path, which is also
the tests' reference. KVCODEC_NATIVE=0 turns every native path off.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

log = logging.getLogger(__name__)

ENABLED = os.environ.get("KVCODEC_NATIVE", "1") != "0"


def cache_dir() -> Path:
    d = os.environ.get("KVCODEC_CACHE_DIR")
    return (Path(d) if d else Path.home() / ".cache" / "kvcodec") / "native"


def build(name: str, source: str, directory: Path | None = None) -> Path | None:
    """The shared library compiled from `source` (named `name` plus the source's hash: built once
    per text); None without a C compiler or if the build fails."""
    cc = os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc")
    if cc is None:
        log.info("no C compiler: %s stays in Python", name)
        return None
    directory = directory or cache_dir()
    path = directory / f"{name}-{hashlib.sha256(source.encode()).hexdigest()[:16]}.so"
    if path.exists():
        return path
    try:
        directory.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=directory) as tmp:
            src, lib = Path(tmp) / f"{name}.c", Path(tmp) / f"{name}.so"
            src.write_text(source)
            cmd = [cc, "-O2", "-shared", "-fPIC", "-pthread", "-o", str(lib), str(src)]
            subprocess.run(cmd, check=True, capture_output=True)
            os.replace(lib, path)  # atomic: a concurrent build wins or loses whole
    except (OSError, subprocess.CalledProcessError) as e:
        log.warning("building %s failed (%s): it stays in Python", name, e)
        return None
    return path


def declare(lib, signatures: dict[str, tuple[type | None, list[type]]]):  # noqa: ANN201 - lib itself
    """Set each function's restype and argtypes on `lib` (a ctypes CDLL) from `signatures`."""
    for fname, (restype, argtypes) in signatures.items():
        fn = getattr(lib, fname)
        fn.restype, fn.argtypes = restype, argtypes
    return lib


def function_pointer(fn) -> int:
    """The address of a ctypes foreign function (handed to the C code)."""
    return ctypes.cast(fn, ctypes.c_void_p).value
