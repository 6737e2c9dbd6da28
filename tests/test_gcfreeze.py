"""engine/gcfreeze: nested holds freeze the live objects; the last release returns them."""

from __future__ import annotations

import gc

from kvcodec.engine import gcfreeze


class Cycle:
    def __init__(self) -> None:
        self.me = self


def test_holds_nest_and_the_last_release_unfreezes():
    base = gcfreeze.holders()  # engines other tests left open
    gcfreeze.hold()
    try:
        assert gc.get_freeze_count() > 0
        gcfreeze.hold()
        gcfreeze.release()
        assert gcfreeze.holders() == base + 1 and gc.get_freeze_count() > 0
    finally:
        gcfreeze.release()
    assert gcfreeze.holders() == base
    if base == 0:
        assert gc.get_freeze_count() == 0
        gcfreeze.release()  # an unmatched release neither goes below zero nor raises
        assert gcfreeze.holders() == 0


def test_garbage_from_before_the_hold_is_collected_first_not_frozen():
    import weakref

    c = Cycle()
    alive = weakref.ref(c)
    del c
    base = gcfreeze.holders()
    gcfreeze.hold()
    try:
        assert alive() is None  # collected by the hold, not kept forever in the frozen generation
        kept = Cycle()
        ref = weakref.ref(kept)
    finally:
        gcfreeze.release()
    del kept
    gc.collect()
    if base == 0:
        assert ref() is None  # frozen while held, collectable once released
