"""The client's side of ``code2wav-sidecar bench --stages``: when each traced chunk's ``decode`` message was handed
to the socket and when its reply was taken off it, by ``(stream_id, seq)``, to join with the sidecar's stamps
(``/debug/chunk-stages``, ``sidecar/chunk_trace.py``).

Optional: ``SidecarClient(..., trace=CallTrace(n))``; without one (the default) nothing is stamped and the send and
receive paths cost one ``is None`` check per call. The stamps are ``time.monotonic_ns()`` (CLOCK_MONOTONIC: one clock
for every process of a Linux host, so they subtract from the sidecar's on the same host).

``client`` imports ``proto``, zmq, torch and numpy; it never imports ``sidecar``.
"""

from __future__ import annotations

import collections
import threading

__all__ = ["CallTrace", "CallStamps"]


class CallStamps:
    """One ``decode`` call's stamps (0: not reached): its chunks' ``(stream_id, seq)``, when the message was handed
    to the socket (``sent_ns``: on the caller's thread or the I/O thread) and when its reply was taken off the
    socket (``received_ns``: the I/O thread, before the reply was parsed)."""

    __slots__ = ("keys", "sent_ns", "received_ns")

    def __init__(self, keys: tuple[tuple[str, int], ...]) -> None:
        self.keys = keys
        self.sent_ns = 0
        self.received_ns = 0


class CallTrace:
    """The recorder: the stamps of the last ``capacity`` decode calls of a client."""

    def __init__(self, capacity: int = 10_000) -> None:
        if capacity < 1:
            raise ValueError(f"a call trace keeps at least 1 call, got {capacity}")
        self.capacity = capacity
        self._lock = threading.Lock()  # calls are opened on callers' threads
        self._ring: collections.deque[CallStamps] = collections.deque(maxlen=capacity)

    def open(self, keys: tuple[tuple[str, int], ...]) -> CallStamps:
        """A decode call of these chunks is about to be sent: its stamps, kept in the ring."""
        stamps = CallStamps(keys)
        with self._lock:
            self._ring.append(stamps)
        return stamps

    def chunks(self) -> dict[tuple[str, int], tuple[int, int]]:
        """``(stream_id, seq) -> (sent_ns, received_ns)`` of every chunk whose call was sent and answered (a resent
        chunk: its last call's)."""
        with self._lock:
            calls = list(self._ring)
        return {key: (call.sent_ns, call.received_ns) for call in calls if call.sent_ns and call.received_ns
                for key in call.keys}
