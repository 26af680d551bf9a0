"""The doorbell watchdog: releases armed waits (``doorbells.release_due``) from a thread of its own.

Why not the event loop: while a step is parked on a doorbell, any CUDA call on the loop thread that waits for the
device waits for that release. Measured on an H100 (``docs/design-notes.md``, "The device-armed hand-off"): a kernel
launched for the first time in the process (CUDA loads kernels lazily, and loading one waits for the device, on any
stream) and a copy from pageable host memory each blocked the calling thread until the parked wait ended; a stream
opened while a dying client's chunk was parked did both, and with the release timed on that same loop, the sidecar
hung. A release here is a CPU store into shared host memory: it needs no other thread, no GPU queue, only the GIL,
which torch and the CUDA bindings give up while they block (``release_due`` stores first and logs after).

One thread per sidecar (``start``: the stepper starts it on a GPU, so a machine that cannot start a thread fails at
start-up, not at the first armed chunk): it sleeps while nothing is watched and otherwise wakes every quarter of
``wait_s`` (10 ms at least). Each pass runs under the watchdog's lock, so once ``Watch.stop`` returns no release of
that watch is under way or to come (the caller may then close the words).
"""

from __future__ import annotations

import logging
import threading
import time

from .doorbells import release_due

__all__ = ["DoorbellWatchdog", "Watch"]

log = logging.getLogger(__name__)


class Watch:
    """One step's armed waits (``(stream_id, seq, ArmedInputs)``), kept until ``stop``: the chunks' CUDA IPC records
    are cleared when they complete or fail."""

    def __init__(self, dog: DoorbellWatchdog, waits: list) -> None:
        self._dog = dog
        self.waits = waits

    def stop(self, release: bool = False) -> None:
        """No more releases from the watchdog; ``release``: the step did not finish (it failed, or was cancelled), so
        every wait it queued is released now (the caller's thread: a CPU store), the engine stream never left
        parked on one."""
        self._dog._forget(self)
        if release:
            release_due(self.waits, 0.0, float("inf"), "their step did not finish")


class DoorbellWatchdog:
    def __init__(self, wait_s: float) -> None:
        self.wait_s = wait_s
        self.period_s = max(wait_s / 4, 0.01)
        self._cond = threading.Condition()
        self._watches: list[Watch] = []
        self._closed = False
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        """Start the thread (idempotent; ``watch`` starts it too)."""
        with self._cond:
            self._start_locked()

    def _start_locked(self) -> None:
        if self._closed:
            raise RuntimeError("the doorbell watchdog is closed")
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="doorbell-watchdog", daemon=True)
            self._thread.start()

    @property
    def running(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def watch(self, jobs: list) -> Watch:
        """Watch ``jobs``' armed waits from now until ``Watch.stop``: each is released ``wait_s`` after it was queued
        (``ArmedInputs.queued_s``), again each period while its step runs (a release that did not land)."""
        watch = Watch(self, [(job.stream.stream_id, job.seq, job.ipc_codes.armed) for job in jobs])
        with self._cond:
            self._start_locked()
            self._watches.append(watch)
            if len(self._watches) == 1:  # the thread sleeps only while nothing is watched
                self._cond.notify()
        return watch

    def _forget(self, watch: Watch) -> None:
        with self._cond:  # (waits for a pass under way)
            if watch in self._watches:
                self._watches.remove(watch)

    def close(self, timeout_s: float = 1.0) -> None:
        """Release what is still watched (a step that never stopped its watch: never leave the engine stream parked)
        and stop the thread."""
        with self._cond:
            self._closed = True
            left, self._watches = self._watches, []
            for watch in left:
                release_due(watch.waits, 0.0, float("inf"), "the sidecar is stopping")
            self._cond.notify()
            thread = self._thread
        if thread is not None:
            thread.join(timeout_s)

    def _run(self) -> None:
        why = f"queued armed_wait_s {self.wait_s:g}s ago"
        with self._cond:
            while True:
                while not self._watches and not self._closed:
                    self._cond.wait()
                if self._closed:
                    return
                self._cond.wait(self.period_s)
                now_s = time.monotonic()
                for watch in self._watches:  # under the lock: a stopped watch is never released after its stop
                    try:
                        release_due(watch.waits, self.wait_s, now_s, why)
                    except Exception:  # a bug here must not end the thread: the next period tries again
                        log.exception("the doorbell watchdog failed")
