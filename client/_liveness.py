"""What the client knows about the server behind its socket: the handshake it adopted, the boot epoch (a change
means the server restarted and every stream opened before is lost), and whether it still answers
(heartbeat pings; dead after ``DEAD_AFTER_INTERVALS`` silent intervals; a pool's member also when its connection
closed and did not come back within ``LINK_GRACE_S``: the server process is gone).

``client`` imports ``proto``, zmq, torch and numpy; it never imports ``sidecar``.

``Liveness`` is mixed into ``Connection`` and runs with its ``_io_lock`` held; it relies on the connection's
``_state``, ``_monitor`` (the socket's monitor, a pool member's only), ``dead_loses_streams`` (a pool member's policy:
a server silent for ``DEAD_AFTER_INTERVALS`` loses its streams at once, ``StreamLost``, instead of keeping them for a
reconnect), ``address``, ``_sock``, ``next_request_id``, ``hello_call``, ``_accept``, ``_fail_all`` and
``_fail_calls``.
"""

from __future__ import annotations

import collections
import logging
import time
from dataclasses import dataclass, field

import zmq
from zmq.utils.monitor import parse_monitor_message

from code2wav.proto import Load, Ping, Welcome, encode

from ._call import Call, Outcome
from .errors import SidecarError, StreamLost, Unavailable, VersionMismatch

__all__ = ["DEAD_AFTER_INTERVALS", "LINK_EVENTS", "LINK_GRACE_S", "LinkState", "Liveness"]

log = logging.getLogger("code2wav.client")

DEAD_AFTER_INTERVALS = 3.0
"""Silent heartbeat intervals after which the server is considered dead."""

LINK_EVENTS = zmq.EVENT_CONNECTED | zmq.EVENT_DISCONNECTED
"""The connection's events a pool member watches: closed (the peer process exited or was killed: the kernel closes
its sockets at once) and connected again."""

LINK_GRACE_S = 0.3
"""How long a closed connection may stay closed before a pool member takes its server for dead: a live server is
reconnected to within one reconnect interval (100 ms); a killed one refuses. On a SIGKILL this replaces the
heartbeats' ``DEAD_AFTER_INTERVALS`` wait (1.5 s); a server that hangs with its process alive is still found by
them."""


@dataclass
class LinkState:
    welcome: Welcome | None = None
    load: Load | None = None  # the latest pong's or welcome's
    boot_epoch: str | None = None
    generation: int = 0
    dead_reason: str | None = None
    broken: SidecarError | None = None
    last_rx: float = field(default_factory=time.monotonic)
    last_ping_tx: float = 0.0
    recent_ping_ids: collections.deque[int] = field(default_factory=lambda: collections.deque(maxlen=8))
    rehello_call: Call | None = None  # the re-handshake's hello while it is pending (its sent_seq orders calls)
    session: int = 0  # welcomes adopted: a new one means the server dropped our session (and our regions)
    session_refused: bool = False  # a ping was refused: the next welcome says restarted (epoch) or forgot us
    disconnected_at: float | None = None  # monotonic time the connection closed, while it stays closed (pool member)


def _went_to_old_server(call: Call, old_generation: int, sent_before: int | None) -> bool:
    """After a restart: a call on the old server's streams (``old_generation``), or a call on no stream (an open)
    sent before the re-handshake's hello (its place ``sent_before``; None: no hello sent, every sent call). Unsent
    calls on no stream go on: they leave after the hello. A call sent after the hello reached the new server,
    which answers it; failing it would orphan a stream the new server did open (found by the GPU soak)."""
    if call.internal:
        return False
    if call.generation is not None:
        return call.generation == old_generation
    return call.sent and (sent_before is None or call.sent_seq < sent_before)


class Liveness:
    @property
    def welcome(self) -> Welcome | None:
        return self._state.welcome

    @property
    def load(self) -> Load | None:
        """The server's latest reported load (a ``pong``'s or the ``welcome``'s; None from a server without it)."""
        return self._state.load

    @property
    def dead(self) -> bool:
        """The server stopped answering heartbeats (until it answers again), or speaks another version."""
        return self._state.dead_reason is not None or self._state.broken is not None

    @property
    def generation(self) -> int:
        return self._state.generation

    @property
    def session(self) -> int:
        return self._state.session

    @property
    def boot_epoch(self) -> str | None:
        return self._state.boot_epoch

    def _adopt_welcome(self, welcome: Welcome) -> None:
        state = self._state
        state.welcome = welcome
        state.load = welcome.load
        state.session += 1
        generation = state.generation
        self._observe_epoch(welcome.boot_epoch, via_welcome=True)
        if state.session_refused:
            state.session_refused = False
            if state.generation == generation:  # same server, which forgot this client and its streams
                self._session_lost()

    def _observe_epoch(self, boot_epoch: str, via_welcome: bool) -> None:
        state = self._state
        if state.boot_epoch is None or state.boot_epoch == boot_epoch:
            state.boot_epoch = boot_epoch
            return
        old_epoch, state.boot_epoch = state.boot_epoch, boot_epoch
        old_generation = state.generation
        state.generation += 1
        state.session_refused = False  # a refused ping is explained: a new server, not a forgotten session
        log.warning("sidecar at %s restarted (boot epoch %s -> %s): open streams are lost",
                    self.address, old_epoch, boot_epoch)
        hello = state.rehello_call
        sent_before = hello.sent_seq if hello is not None and hello.sent else None
        self._fail_calls(self._lost_error(old_epoch), lambda call: _went_to_old_server(call, old_generation,
                                                                                        sent_before))
        if not via_welcome:
            self._rehello()

    def _session_lost(self) -> None:
        """The server (same boot epoch) forgot this client, after no heartbeat for its ``client_silence_s`` or its
        TTL, and freed its streams: they fail with ``StreamLost`` from now on, not with ``not_found``."""
        log.warning("sidecar at %s had forgotten this client (no heartbeat for its client_silence_s): open "
                    "streams are lost", self.address)
        old_generation = self._state.generation
        self._state.generation += 1
        self._fail_all(StreamLost(f"the sidecar at {self.address} forgot this client (no heartbeat for its "
                                  "streams.client_silence_s) and freed its streams; streams opened before are gone"),
                       include_internal=False, generation=old_generation)  # new-session calls go on

    def _lost_error(self, old_epoch: str | None = None) -> StreamLost:
        detail = f" (boot epoch {old_epoch} -> {self._state.boot_epoch})" if old_epoch else ""
        return StreamLost(f"the sidecar at {self.address} restarted{detail}; streams opened before are gone")

    def _rehello(self) -> None:
        if self._state.rehello_call is not None:
            return

        def on_welcome(welcome: Welcome) -> None:
            self._state.rehello_call = None
            log.info("re-handshake with %s done (server %s)", self.address, welcome.server_id)

        def on_failure(error: SidecarError, outcome: Outcome) -> None:
            self._state.rehello_call = None
            if isinstance(error, VersionMismatch):
                self._state.broken = error  # the new server speaks another version
            log.warning("re-handshake with %s failed: %s", self.address, error)

        interval_s = self._state.welcome.heartbeat_interval_s if self._state.welcome else 0.5
        call = self.hello_call(max(1.0, DEAD_AFTER_INTERVALS * interval_s), on_welcome, on_failure)
        self._state.rehello_call = call  # pending: what is sent after it goes to the server that answers it
        self._accept(call, front=True)  # goes out before anything queued after the restart

    def _declare_dead(self, reason: str) -> None:
        state = self._state
        state.dead_reason = reason
        log.warning("%s", reason)
        if self.dead_loses_streams:  # a pool's member: its streams end now, typed, and go nowhere else
            old_generation = state.generation
            state.generation += 1
            self._fail_all(StreamLost(f"{reason}: its streams are given up (StreamLost)"),
                           include_internal=False, generation=old_generation)
        self._fail_all(Unavailable(reason), include_internal=False)

    def _link_events(self, now: float) -> None:
        """Read the connection's events (lock holder; a pool member's monitor only): note when it closed, forget it
        when it connected again."""
        if self._monitor is None:
            return
        # one flag read per loop turn when nothing happened (the client's per-chunk path); reading it last also
        # re-arms the monitor descriptor's signal for the next poll
        while self._monitor.getsockopt(zmq.EVENTS) & zmq.POLLIN:
            event = parse_monitor_message(self._monitor.recv_multipart())["event"]
            if event == zmq.EVENT_DISCONNECTED:
                self._state.disconnected_at = now
            elif event == zmq.EVENT_CONNECTED:
                self._state.disconnected_at = None

    def _heartbeat(self, now: float) -> None:
        state = self._state
        if state.welcome is None or state.broken is not None:
            return
        interval_s = state.welcome.heartbeat_interval_s
        silent_s = now - state.last_rx
        if state.dead_reason is None:
            if silent_s >= DEAD_AFTER_INTERVALS * interval_s:
                self._declare_dead(f"the sidecar at {self.address} has not answered for {silent_s:.1f}s "
                                   f"(heartbeat interval {interval_s}s); is `code2wav-sidecar serve` still running?")
            elif state.disconnected_at is not None and now - state.disconnected_at >= LINK_GRACE_S:
                self._declare_dead(f"the sidecar at {self.address} closed its connection and has not taken one "
                                   f"again for {now - state.disconnected_at:.1f}s (its process exited or was "
                                   "killed?)")
        if silent_s >= interval_s and now - state.last_ping_tx >= interval_s:
            state.last_ping_tx = now
            request_id = self.next_request_id()
            state.recent_ping_ids.append(request_id)
            try:  # straight to the socket: a ping that cannot leave now is simply skipped
                self._sock.send_multipart(encode(Ping(request_id)), zmq.NOBLOCK)
            except zmq.Again:
                return
