"""engine/gcfreeze: a hold collects and freezes the live objects, a release returns them; an
application's own freeze is left alone."""

from __future__ import annotations

import gc
import threading
import weakref

import pytest

from kvcodec.engine import gcfreeze


class Cycle:
    def __init__(self) -> None:
        self.me = self


@pytest.fixture
def fresh(monkeypatch):
    """No hold, nothing frozen (engines other tests left open are forgotten for this test)."""
    monkeypatch.setattr(gcfreeze, "_holders", 0)
    monkeypatch.setattr(gcfreeze, "_theirs", False)
    monkeypatch.setattr(gcfreeze, "_lock", threading.RLock())  # a thread stuck on it stays out of later tests
    gc.unfreeze()
    yield
    gc.unfreeze()


def test_holds_are_counted_and_a_release_unfreezes(fresh):
    gcfreeze.hold()
    assert gc.get_freeze_count() > 0
    gcfreeze.hold()
    assert gcfreeze.holders() == 2
    gcfreeze.release()
    assert gcfreeze.holders() == 1 and gc.get_freeze_count() == 0
    gcfreeze.release()
    assert gcfreeze.holders() == 0 and gc.get_freeze_count() == 0
    gcfreeze.release()  # an unmatched release changes nothing
    assert gcfreeze.holders() == 0


def test_garbage_from_before_the_hold_is_collected_first_not_frozen(fresh):
    c = Cycle()
    alive = weakref.ref(c)
    del c
    kept = Cycle()
    ref = weakref.ref(kept)
    gcfreeze.hold()
    assert alive() is None
    del kept
    gc.collect()
    assert ref() is not None  # frozen while held: not collected
    gcfreeze.release()
    gc.collect()
    assert ref() is None  # collectable once released


def test_one_release_returns_everything_while_another_holds(fresh):
    gcfreeze.hold()  # a long-lived engine
    closed = Cycle()  # a second engine's objects, frozen by its own hold
    ref = weakref.ref(closed)
    gcfreeze.hold()
    gcfreeze.release()  # the second engine closes (its caller still holds it)
    assert gcfreeze.holders() == 1 and gc.get_freeze_count() == 0
    del closed
    gc.collect()
    assert ref() is None  # collectable once its caller drops it
    gcfreeze.release()


def test_an_applications_own_freeze_is_left_alone(fresh):
    """Neither unfrozen by release (the count would fall to 0) nor frozen again by hold (the objects
    made since would join it). Not an exact count: another test's thread may free frozen objects
    meanwhile, each leaving the permanent generation (CI saw 2 go)."""
    gc.freeze()
    theirs = gc.get_freeze_count()
    made_since = [[i] for i in range(5000)]  # tracked objects a second freeze would take in
    gcfreeze.hold()
    gcfreeze.release()
    assert theirs - 1000 < gc.get_freeze_count() <= theirs and gcfreeze.holders() == 0
    assert len(made_since) == 5000


def test_a_finalizer_that_closes_an_engine_during_the_holds_collection_does_not_deadlock(fresh):
    class ClosesAnEngine(Cycle):
        def __del__(self) -> None:
            gcfreeze.release()  # as an engine's close from a finalizer

    gcfreeze.hold()  # the engine the finalizer will close
    gc.disable()  # no automatic collection runs the finalizer before the hold's own
    try:
        ClosesAnEngine()  # garbage in a cycle: only a collection runs its finalizer
        worker = threading.Thread(target=gcfreeze.hold, daemon=True)  # its collection runs the finalizer
        worker.start()
        worker.join(timeout=120)  # only a deadlock reaches the timeout
    finally:
        gc.enable()
    assert not worker.is_alive() and gcfreeze.holders() == 1
    gcfreeze.release()
