"""Python's garbage collector in a serving process: the heap frozen once the server is ready, each collection timed.

CPython's cyclic collector walks every object its generation tracks. With a model loaded, the oldest generation
holds the modules, parameters, compiled kernels and captured graphs' Python objects: 195,000 objects for the
default model on the CPU, and a full collection of them took 69-77 ms on this project's CPU machine. Such a
collection runs on whichever thread allocates when it is due (the loop thread, mostly), holding the GIL: every
stream stops for it. It is due after enough objects survived two younger collections, which capture and start-up
make many of, so it lands early in serving, and again under load.

``freeze_heap`` collects once and then freezes what is left (``gc.freeze``): those objects go into a permanent
generation no later collection walks (a full collection over 20,000 new objects then took 0.1 ms on the same
machine). What is created after it is collected as before. ``GcPauses`` times every collection (``gc.callbacks``)
into a histogram by generation, so a pause shows in the metrics. Both are process-wide by nature (the collector
is): the process's entry point (``server.run_server``, the bench's in-process timings) calls them, never a library
class.
"""

from __future__ import annotations

import gc
import time
from typing import Any


def freeze_heap() -> tuple[int, float]:
    """Collect every generation, then freeze the survivors. Returns ``(objects frozen in all, seconds the collection
    took)``."""
    start_s = time.perf_counter()
    gc.collect()
    took_s = time.perf_counter() - start_s
    gc.freeze()
    return gc.get_freeze_count(), took_s


class FrozenWhile:
    """A context that freezes the heap for its length (``freeze_heap``) and thaws it after, unless it was frozen
    already on entry (a process that froze for good, or an outer context): then it leaves the freeze alone."""

    def __enter__(self) -> FrozenWhile:
        self._owner = gc.get_freeze_count() == 0
        if self._owner:
            freeze_heap()
        return self

    def __exit__(self, *exc) -> None:
        if self._owner:
            gc.unfreeze()


class GcPauses:
    """Times each collection of the process: ``install()`` adds it to ``gc.callbacks``, ``remove()`` takes it out.
    ``observe(generation, seconds)`` is called at each collection's end (a Prometheus histogram's
    ``labels(generation=...).observe``, or a recorder's). Collections run with the GIL held, so a start and its stop
    are never interleaved with another collection's."""

    def __init__(self, observe) -> None:
        self._observe = observe
        self._start_s = 0.0

    def __call__(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._start_s = time.perf_counter()
        else:
            self._observe(info["generation"], time.perf_counter() - self._start_s)

    def install(self) -> GcPauses:
        if self not in gc.callbacks:
            gc.callbacks.append(self)
        return self

    def remove(self) -> None:
        if self in gc.callbacks:
            gc.callbacks.remove(self)

    def __enter__(self) -> GcPauses:
        return self.install()

    def __exit__(self, *exc) -> None:
        self.remove()
