"""Python's collector in the serving process (sidecar/gc_pauses.py): the heap frozen at ready, collections timed.

Real collections of this test process: ``gc.collect`` and the callbacks CPython calls. The freeze is undone at the
end of each test (``gc.unfreeze``), so the rest of the session collects as before."""

from __future__ import annotations

import gc

import pytest
from prometheus_client import CollectorRegistry, Histogram

from code2wav.sidecar.gc_pauses import GcPauses, freeze_heap
from code2wav.sidecar.metrics import GC_PAUSE_BUCKETS_S


@pytest.fixture
def unfrozen():
    yield
    gc.unfreeze()


class Cycle:
    def __init__(self) -> None:
        self.me = self  # a reference cycle: only the collector frees it


def test_freezing_takes_the_heap_out_of_later_collections(unfrozen):
    """After the freeze a full collection walks only what was made after it: fewer objects, and garbage made before
    it was collected first (the freeze keeps only survivors)."""
    garbage = Cycle()
    del garbage
    frozen, took_s = freeze_heap()
    assert frozen == gc.get_freeze_count() > 10_000 and took_s > 0  # pytest and torch alone are more than that
    assert not any(isinstance(o, Cycle) for o in gc.get_objects())  # collected before the freeze, not frozen
    tracked = len(gc.get_objects())
    assert tracked < frozen / 10  # what a collection still walks: made after the freeze
    made_after = [Cycle() for _ in range(100)]
    assert len(gc.get_objects()) >= tracked + 100
    del made_after
    assert gc.collect() >= 100  # what is made after the freeze is collected as before


def test_each_collection_is_timed_by_generation():
    registry = CollectorRegistry()
    histogram = Histogram("gc_pause_seconds", "test", ["generation"], buckets=GC_PAUSE_BUCKETS_S, registry=registry)
    seen: list[tuple[int, float]] = []

    def observe(generation: int, seconds: float) -> None:
        seen.append((generation, seconds))
        histogram.labels(str(generation)).observe(seconds)

    with GcPauses(observe) as pauses:
        assert pauses in gc.callbacks
        gc.collect(0)
        gc.collect(2)
    assert pauses not in gc.callbacks
    gc.collect()  # not timed any more
    assert [g for g, _ in seen] == [0, 2] and all(0 <= s < 5 for _, s in seen)
    assert registry.get_sample_value("gc_pause_seconds_count", {"generation": "2"}) == 1
    assert registry.get_sample_value("gc_pause_seconds_count", {"generation": "0"}) == 1


def test_a_collection_inside_a_scrape_is_observed_without_the_histograms_lock():
    """A collection can start in the thread of a scrape that holds the histogram's lock (its children's copy): the
    sidecar's observer must not take that lock again (it is not reentrant: the thread would wait on itself for good,
    and with the collector's flag still set no collection would run again)."""
    import threading

    from code2wav.sidecar.metrics import Metrics

    metrics = Metrics()
    done = threading.Event()

    def in_scrape() -> None:
        with metrics.gc_pause_seconds._lock:  # what the scrape holds while it copies the children
            metrics.observe_gc_pause(2, 0.004)
        done.set()

    thread = threading.Thread(target=in_scrape, daemon=True)
    thread.start()
    assert done.wait(5.0), "the observer waited on the histogram's lock"
    assert metrics.registry.get_sample_value("code2wav_sidecar_gc_pause_seconds_count", {"generation": "2"}) == 1


def test_a_freeze_for_a_while_leaves_an_earlier_freeze_alone(unfrozen):
    """``FrozenWhile`` thaws only what it froze: inside a process (or an outer context) that froze its heap already,
    leaving the context must not thaw it."""
    from code2wav.sidecar.gc_pauses import FrozenWhile

    with FrozenWhile():
        assert gc.get_freeze_count() > 0
    assert gc.get_freeze_count() == 0  # it froze, so it thawed
    freeze_heap()  # a serving process's freeze for good
    before = gc.get_freeze_count()
    with FrozenWhile():
        with FrozenWhile():
            pass
    assert gc.get_freeze_count() == before > 0
