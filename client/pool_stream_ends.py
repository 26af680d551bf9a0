"""A pooled stream's ends: resend, finish, abort (``StreamEnds``, a part of ``pool_stream.PooledStream``, which
holds the state these read: its lock, chunks waiting and in doubt, the sidecar stream it speaks through, the move
under way). Apart from the chunk and move rules (``pool_stream.py``) so each module stays one job.

``client`` imports ``proto``, zmq, torch and numpy; it never imports ``sidecar``.
"""

from __future__ import annotations

from concurrent.futures import Future

import torch

from .errors import NotFound, StreamLost
from .sender import set_exception

__all__ = ["StreamEnds"]


class StreamEnds:
    """``submit_resend``/``resend``, ``finish``, ``submit_abort``/``abort`` of a ``PooledStream``."""

    def submit_resend(self, *, timeout_s: float | None = None) -> Future[torch.Tensor]:
        """As ``Stream.submit_resend`` (on the sidecar it lives on); the resent chunks enter the history once
        acknowledged."""
        with self._lock:
            self.check_usable()
            if self._resends:  # a move sent the chunks in doubt again: the last one's audio
                future, self._resends = self._resends[-1], []
                return future
            doubtful, self._in_doubt = self._in_doubt, []
            inner = self._inner
        future = inner.submit_resend(timeout_s=timeout_s)

        def done(finished: Future) -> None:
            with self._lock:
                if finished.exception() is None and inner is self._inner:
                    for chunk in doubtful:
                        self.history.add(chunk.inputs)
                        self._num_acked += 1
                else:
                    self._in_doubt = doubtful + self._in_doubt
        future.add_done_callback(done)
        return future

    def resend(self, *, timeout_s: float | None = None) -> torch.Tensor:
        return self._host.wait(self.submit_resend(timeout_s=timeout_s), timeout_s)

    def finish(self, *, timeout_s: float | None = None) -> None:
        """Close gracefully once the chunks in flight are done (they may move meanwhile)."""
        if self.closed:
            return
        with self._lock:
            self._finishing = True
        self._settled.wait(self._host.wait_s(timeout_s))  # a move under way ends first (its stream is the one)
        with self._lock:
            self.check_usable()
            waiting = [chunk.future for chunk in self._pending]
        for future in waiting:
            self._host.wait(future, timeout_s)
        try:
            self._inner.finish(timeout_s=timeout_s)
        except StreamLost:
            pass  # its sidecar went away after the last chunk: nothing is left to close there

    def submit_abort(self, *, timeout_s: float | None = None) -> Future[None]:
        """Drop what is in flight and free the state now (no-op if closed or lost)."""
        with self._lock:
            self._aborted = True
            inner, moving = self._inner, self._moving
            stranded = list(self._pending) if moving is not None or inner.lost else []  # no sidecar will answer them
            for chunk in stranded:
                self._pending.remove(chunk)
        for chunk in stranded:
            set_exception(chunk.future, NotFound(f"stream {self.stream_id!r} was aborted"))
        if moving is None and not inner.lost and not inner.closed:
            return inner.submit_abort(timeout_s=timeout_s)
        done: Future[None] = Future()
        done.set_result(None)
        return done

    def abort(self, *, timeout_s: float | None = None) -> None:
        try:
            self._host.wait(self.submit_abort(timeout_s=timeout_s), timeout_s)
        except StreamLost:
            pass
