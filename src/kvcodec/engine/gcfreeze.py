"""The collector's pauses kept out of serving: while an Engine is open, the objects alive when it
started (the model, the runtime's modules, the codec's tables: about 384k objects for SmolLM2 on
the CPU) sit in the collector's permanent generation (gc.freeze), as vLLM's engine does. A full
collection walks every tracked object with the interpreter lock held, pausing each fetch and
decode thread: 185 ms for those objects on the 2-core CPU VM, 65-250 ms seen in the TTFT bench's
process on an H100 machine (benchmarks/results/fetch-h100-s58-stalls.md); frozen, it walks only
what was made since. The last open engine's close() returns them to the collector, so engines
closed in a long-lived process (tests, notebooks) leave nothing uncollectable."""

from __future__ import annotations

import gc
import threading

_lock = threading.Lock()
_holders = 0


def hold() -> None:
    """Collect, then freeze what is left (every object alive now) until the matching release()."""
    global _holders
    with _lock:
        gc.collect()
        gc.freeze()
        _holders += 1


def release() -> None:
    """End one hold(); the last one returns the frozen objects to the collector."""
    global _holders
    with _lock:
        _holders = max(0, _holders - 1)
        if _holders == 0:
            gc.unfreeze()


def holders() -> int:
    with _lock:
        return _holders
