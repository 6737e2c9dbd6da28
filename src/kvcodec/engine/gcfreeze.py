"""The collector's full collections kept off the objects an Engine starts with: when an engine
starts, every object alive then (the model, the runtime's modules, the codec's tables: about 385k
objects for SmolLM2 on the CPU) is collected once and put in the collector's permanent generation
(gc.freeze), as vLLM's engine does, so that a full collection, which walks every tracked object with
the interpreter lock held and pauses every fetch and decode thread, walks only what was made since
(benchmarks/probes/gc_pause.py). Closing an engine unfreezes them all, so a closed engine's memory
is collectable as before (an engine still open runs unfrozen until the next one starts). An
application that froze objects itself before the first engine keeps managing the collector: the
engines then leave it alone. An engine never closed keeps the freeze, as it keeps its threads and
worker processes."""

from __future__ import annotations

import gc
import threading

_lock = threading.RLock()  # a finalizer or signal handler may close an engine inside hold or release
_holders = 0
_theirs = False  # the application had frozen objects itself: hold and release change nothing


def hold() -> None:
    """Collect, then freeze every object alive now, until the matching release()."""
    global _holders, _theirs
    with _lock:
        if _holders == 0:
            _theirs = gc.get_freeze_count() > 0
        _holders += 1
        ours = not _theirs
    if ours:  # outside the lock: a finalizer the collection runs may close an engine (release)
        gc.collect()
        gc.freeze()


def release() -> None:
    """End one hold(): every frozen object goes back to the collector (one engine's close frees its
    memory even while others stay open; they run unfrozen until the next hold)."""
    global _holders
    with _lock:
        if _holders == 0:
            return
        _holders -= 1
        if not _theirs:
            gc.unfreeze()


def holders() -> int:
    with _lock:
        return _holders
