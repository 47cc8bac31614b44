"""garbage_collection_for_run: a run's full garbage collections skip the objects alive before it, and
nothing is lost (garbage made during the run is collected then, the rest once it ends)."""

from __future__ import annotations

import gc
import weakref

from gossipcomp.experiment.simulation.setup import RUN_GC_THRESHOLD, garbage_collection_for_run


class _Node:
    """A reference cycle (only the cyclic collector frees it)."""

    def __init__(self) -> None:
        self.me = self


def test_objects_alive_at_entry_are_frozen_for_the_run_only():
    before = _Node()
    threshold = gc.get_threshold()
    assert gc.get_freeze_count() == 0
    with garbage_collection_for_run():
        assert gc.get_freeze_count() > 0
        assert gc.get_threshold() == (max(threshold[0], RUN_GC_THRESHOLD), *threshold[1:])
        made = weakref.ref(_Node())  # garbage made during the run: collected as ever
        gc.collect()
        assert made() is None
        old = weakref.ref(before)
        del before  # garbage among the frozen: kept while the run lasts
        gc.collect()
        assert old() is not None
    assert gc.get_freeze_count() == 0
    assert gc.get_threshold() == threshold
    gc.collect()  # and collected once it ends
    assert old() is None


def test_a_callers_own_freeze_is_kept():
    gc.freeze()
    try:
        frozen, threshold = gc.get_freeze_count(), gc.get_threshold()
        with garbage_collection_for_run():
            assert (gc.get_freeze_count(), gc.get_threshold()) == (frozen, threshold)
        assert (gc.get_freeze_count(), gc.get_threshold()) == (frozen, threshold)
    finally:
        gc.unfreeze()
