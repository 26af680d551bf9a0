"""A blocked caller in the I/O role: ``Connection.wait`` (what ``Stream.decode`` and every blocking form wait in).

``client`` imports ``proto``, zmq, torch and numpy; it never imports ``sidecar``.

A caller that blocks on its call anyway takes the connection's I/O role while the socket is free: holding
``_io_lock``, it runs the I/O thread's turns (``Connection._turn``: send, receive, deadlines, heartbeat) on its own
thread until its reply is in. The reply then reaches it without waking the I/O thread and handing the result over
between threads (at one stream, that hand-off is part of every chunk's latency). Meanwhile the I/O thread only
finds the lock taken; a call another thread queues (``submit`` with the lock taken goes through the inbox and the
wake pipe) is sent by the caller's next turn, and its reply settled there. A close request hands the role back at
once. With ``busy_poll_s`` it polls without sleeping for that long first (no wake-up latency when the reply
comes). Callbacks run where replies are received, so ``on_io_thread`` is true in the role too: a blocking call from a
callback is refused there as on the I/O thread.

``CallerRole`` is mixed into ``Connection``; it relies on its ``busy_poll_s``, ``_io_lock``, ``_io_role``, ``_thread``, ``_turn``,
``_poller``, ``_wake_r``, ``_wake_at``, ``_inbox``, ``_unsent``, ``_closed``, ``_state``, ``_readable``,
``_poll_timeout_ms``, ``_drain_wake_pipe``, ``_wake`` and ``_fail_all``.
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import Future
from typing import Any

import zmq

from .errors import Internal

__all__ = ["CallerRole"]

log = logging.getLogger("code2wav.client")

_ROLE_WAIT_S = 0.002
"""How long a blocking caller waits for the lock (the I/O thread's turn, woken by the caller's own send; another
caller's direct send) before it leaves the receiving to whoever holds it."""


class CallerRole:
    @property
    def on_io_thread(self) -> bool:
        """On the I/O thread, or on a caller's thread while it holds the I/O role: where callbacks run."""
        return threading.current_thread() is self._thread or self._io_role == threading.get_ident()

    def wait(self, future: Future[Any], timeout_s: float) -> Any:
        """Caller's thread: the result of ``future`` (a call's on this connection), or its exception, or
        ``concurrent.futures.TimeoutError`` after ``timeout_s``; in the I/O role while the socket is free."""
        end_s = time.monotonic() + timeout_s
        # the lock may be held for a moment: wait that out, but not a role another caller holds (its turns settle
        # our future too)
        if (not future.done() and self._io_role is None and not self._closed.is_set()
                and self._io_lock.acquire(timeout=_ROLE_WAIT_S)):
            self._serve_until(future, end_s)
        return future.result(max(0.0, end_s - time.monotonic()))

    def _serve_until(self, future: Future[Any], end_s: float) -> None:
        """Caller's thread, holding ``_io_lock`` (released here): the I/O thread's turns until ``future`` is done,
        ``end_s`` passes or close is requested."""
        self._io_role = threading.get_ident()
        spin_until_s = time.monotonic() + self.busy_poll_s
        try:
            while not future.done():
                timeout_ms = self._turn()
                left_s = end_s - time.monotonic()
                if timeout_ms is None or future.done() or left_s <= 0:
                    break
                if timeout_ms == 0:
                    continue
                sleep_ms = 0 if time.monotonic() < spin_until_s else min(timeout_ms, int(left_s * 1000.0) + 1)
                if (self._wake_r, zmq.POLLIN) in self._poller.poll(sleep_ms):
                    self._drain_wake_pipe()  # a call queued by another thread: the next turn takes it
        except Exception as exc:  # as on the I/O thread: a bug here must not leave callers waiting forever
            log.exception("sidecar client I/O turn failed on a caller's thread")
            self._state.broken = Internal(f"client I/O failed: {exc!r}")
            self._fail_all(self._state.broken, include_internal=True)
        finally:
            self._io_role = None
            try:
                if self._inbox or self._unsent or self._readable() or (
                        self._wake_at and time.monotonic() + self._poll_timeout_ms() / 1000.0 < self._wake_at):
                    self._wake()  # close requested, a backlog, a reply for another call, or an earlier deadline
            finally:
                self._io_lock.release()
