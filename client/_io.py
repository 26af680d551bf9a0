"""The connection: one ZeroMQ DEALER socket, a background I/O thread, and a direct send path for callers.

``client`` imports ``proto``, zmq, torch and numpy; it never imports ``sidecar``.

The socket and the call bookkeeping are guarded by one lock (``_io_lock``). A caller that finds the lock
free and nothing queued ahead of it sends its ``Call`` itself, on its own thread (no hand-off: this is the
latency of every chunk); otherwise the call goes through a deque and the I/O thread is woken through an
``os.pipe``. The I/O thread sleeps in a poll on the wake pipe and the socket's file descriptor (not on the
socket itself, which only the lock holder may touch) and, holding the lock, sends what is queued, receives,
matches replies to calls by request_id, enforces each call's deadline (``DeadlineExceeded``), and keeps
track of the server (``_liveness``: heartbeats, a dead server, a restart that loses the streams).

ZeroMQ's descriptor only signals that the socket's state may have changed, and any operation on the socket
(a caller's send included) may consume that signal; so every lock holder checks ``ZMQ_EVENTS`` before
letting go, and wakes the I/O thread when a message is waiting.
"""

from __future__ import annotations

import collections
import heapq
import itertools
import logging
import os
import threading
import time
from typing import Any, Callable

import zmq

from code2wav.proto import (
    PROTOCOL_VERSION,
    Bye,
    Error,
    Hello,
    Pong,
    ProtocolError,
    ServerMessage,
    Welcome,
    decode_server_message,
    encode,
    exceeded_limit,
)

from ._call import RECEIVE_LIMITS, Call, OnFailure, Outcome
from ._liveness import DEAD_AFTER_INTERVALS, LINK_EVENTS, LINK_GRACE_S, LinkState, Liveness
from .errors import DeadlineExceeded, Internal, LimitExceeded, SidecarError, Unavailable, error_from

__all__ = ["Call", "Connection", "Outcome", "DEAD_AFTER_INTERVALS"]

log = logging.getLogger("code2wav.client")

_BYE_LINGER_MS = 100
"""How long closing waits for the ``bye`` to leave (bounded; 0 once the server is dead)."""
_RECEIVE_BATCH = 256
"""Messages received per wake-up before deadlines and heartbeats get a turn."""


class Connection(Liveness):
    """Owns the DEALER socket and the I/O thread. Thread-safe entry points: ``submit``, ``close``."""

    def __init__(self, address: str, client_id: str, routing_id: bytes, capabilities: dict[str, Any],
                 curve_server_key: bytes | str | None = None, curve_client_keys: tuple | None = None,
                 dead_loses_streams: bool = False) -> None:
        self.address = address
        self.dead_loses_streams = dead_loses_streams  # (see _liveness)
        self.client_id = client_id
        self._capabilities = dict(capabilities)
        self._ids = itertools.count(1)
        self._sent_count = 0  # messages sent (under _io_lock): Call.sent_seq
        self._inbox: collections.deque[Call | None] = collections.deque()  # None = close
        self._pending: dict[int, Call] = {}
        self._unsent: collections.deque[Call] = collections.deque()
        self._deadlines: list[tuple[float, int]] = []
        self._state = LinkState()
        self._closed = threading.Event()
        self._submit_lock = threading.Lock()  # orders submit() against close()
        self._io_lock = threading.Lock()  # the socket, _pending, _unsent, _deadlines, _state
        self._wake_at = 0.0  # when the sleeping I/O thread will look at deadlines next (monotonic)
        self._held_failures: list | None = None  # set while a caller sends directly
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._sock = zmq.Context.instance().socket(zmq.DEALER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.setsockopt(zmq.IMMEDIATE, 1)  # never queue towards a peer that is not connected
        self._sock.setsockopt(zmq.ROUTING_ID, routing_id)  # stable across reconnects: keeps the session
        self._sock.setsockopt(zmq.RECONNECT_IVL, 100)
        self._sock.setsockopt(zmq.RECONNECT_IVL_MAX, 1000)
        if curve_server_key is not None:  # CurveZMQ: encrypt and authenticate the server by its public key
            public, secret = curve_client_keys or zmq.curve_keypair()  # (a fixed pair for an allow-list)
            self._sock.curve_serverkey = curve_server_key.encode() if isinstance(curve_server_key, str) else curve_server_key
            self._sock.curve_publickey = public
            self._sock.curve_secretkey = secret
        # a pool's member watches its connection too: a peer process gone (SIGKILL, OOM) closes it at once, well
        # before the heartbeats miss (``Liveness._link_events``)
        self._monitor = self._sock.get_monitor_socket(LINK_EVENTS) if dead_loses_streams else None
        self._sock.connect(address)
        self._poller = zmq.Poller()  # on file descriptors only: the socket itself is touched under _io_lock
        self._poller.register(self._wake_r, zmq.POLLIN)
        self._poller.register(self._sock.getsockopt(zmq.FD), zmq.POLLIN)
        if self._monitor is not None:
            self._poller.register(self._monitor.getsockopt(zmq.FD), zmq.POLLIN)
        self._thread = threading.Thread(target=self._run, name="code2wav-client-io", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ any thread

    @property
    def on_io_thread(self) -> bool:
        return threading.current_thread() is self._thread

    def next_request_id(self) -> int:
        return next(self._ids)

    def submit(self, call: Call) -> None:
        """Send ``call`` now from this thread when the socket is free and nothing is queued ahead of it, else
        queue it for the I/O thread. Reply callbacks fire on the I/O thread; a failure found while sending
        here (or a closed client) is reported on this thread."""
        welcome = self._state.welcome  # the server's limits: refuse here what it would refuse (or drop)
        exceeded = exceeded_limit(call.frames, welcome.limits) if welcome is not None else None
        if exceeded is not None:
            call.on_failure(LimitExceeded(exceeded[1], exceeded[0]), "not_sent")
            return
        with self._submit_lock:
            if self._closed.is_set():
                failures = None
            elif self._inbox or not self._io_lock.acquire(blocking=False):
                self._inbox.append(call)  # the I/O thread holds the socket or has calls queued: hand it over
                self._wake()
                return
            else:
                failures = self._send_direct(call)
        if failures is None:
            call.on_failure(Unavailable(f"client for {self.address} is closed"), "not_sent")
            return
        for failed, error, outcome in failures:
            self._settle_failure(failed, error, outcome)

    def _send_direct(self, call: Call) -> list:
        """Caller's thread, holding ``_io_lock`` (released here): accept and send ``call``; returns the failures
        to report once the locks are released (callbacks must not run under them)."""
        self._held_failures = []
        try:
            self._accept(call, front=False)
            self._flush()
            if self._unsent or call.deadline < self._wake_at or self._readable():
                self._wake()  # a backlog to send, an earlier deadline, or a reply to receive
        finally:
            failures, self._held_failures = self._held_failures, None
            self._io_lock.release()
        return failures

    def hello_call(self, timeout_s: float, on_welcome: Callable[[Welcome], None],
                   on_failure: OnFailure) -> Call:
        """A ``hello`` call; on success the connection adopts the welcome before ``on_welcome``."""
        request_id = self.next_request_id()
        last = self._state.welcome  # a re-handshake presents the session's secret (it may still exist)
        msg = Hello(request_id, PROTOCOL_VERSION, self.client_id, self._capabilities,
                    session_secret=last.session_secret if last is not None else None)

        def on_reply(reply: ServerMessage, frames: list[memoryview]) -> None:
            if not isinstance(reply, Welcome):
                raise Internal(f"expected welcome, got {reply.TYPE}")
            self._adopt_welcome(reply)
            on_welcome(reply)

        return Call(request_id, encode(msg), timeout_s, on_reply, on_failure, internal=True)

    def close(self, timeout_s: float = 2.0) -> None:
        with self._submit_lock:
            if self._closed.is_set():
                return
            self._closed.set()
            self._inbox.append(None)
            self._wake()
        if not self.on_io_thread:
            self._thread.join(timeout_s)
        if not self._thread.is_alive():
            os.close(self._wake_w)

    def _wake(self) -> None:
        try:
            os.write(self._wake_w, b"\0")
        except (BlockingIOError, OSError):
            pass  # pipe full (already woken) or closed

    # ------------------------------------------------------------------ holder of _io_lock only

    def _run(self) -> None:
        try:
            while True:
                with self._io_lock:
                    if not self._intake():
                        break
                    self._flush()
                    self._receive()
                    now = time.monotonic()
                    self._expire(now)
                    self._link_events(now)
                    self._heartbeat(now)
                    self._flush()  # a re-handshake may have been queued
                    events = self._sock.getsockopt(zmq.EVENTS)  # also re-arms the descriptor's signal
                    if events & zmq.POLLIN or (self._unsent and events & zmq.POLLOUT):
                        continue
                    timeout_ms = self._poll_timeout_ms()
                    self._wake_at = time.monotonic() + timeout_ms / 1000.0
                self._poller.poll(timeout_ms)
                self._wake_at = 0.0
                self._drain_wake_pipe()
        except Exception as exc:  # a bug here must not leave callers waiting forever
            log.exception("sidecar client I/O thread failed")
            with self._io_lock:
                self._fail_all(Internal(f"client I/O thread failed: {exc!r}"), include_internal=True)
        finally:
            with self._io_lock:
                self._shutdown()

    def _readable(self) -> bool:
        """A message is waiting (lock holder only; also re-arms the descriptor's signal)."""
        return bool(self._sock.getsockopt(zmq.EVENTS) & zmq.POLLIN)

    def _intake(self) -> bool:
        """Move submitted calls into the send queue; False once close was requested."""
        while self._inbox:
            call = self._inbox.popleft()
            if call is None:
                return False
            self._accept(call, front=False)
        return True

    def _accept(self, call: Call, front: bool) -> None:
        state = self._state
        failure: SidecarError | None = state.broken
        if failure is None and state.dead_reason is not None and not call.internal:
            failure = Unavailable(state.dead_reason)
        if failure is None and call.generation is not None and call.generation != state.generation:
            failure = self._lost_error()
        if failure is not None:
            self._settle_failure(call, failure, "not_sent")
            return
        call.deadline = time.monotonic() + call.timeout_s
        self._pending[call.request_id] = call
        heapq.heappush(self._deadlines, (call.deadline, call.request_id))
        if front:
            self._unsent.appendleft(call)
        else:
            self._unsent.append(call)

    def _flush(self) -> None:
        while self._unsent:
            call = self._unsent[0]
            if call.generation is not None and call.generation != self._state.generation:
                self._unsent.popleft()
                self._pending.pop(call.request_id, None)
                self._settle_failure(call, self._lost_error(), "not_sent")
                continue
            if call.stamps is not None:  # a traced call (call_trace): stamped as it goes into the socket
                call.stamps.sent_ns = time.monotonic_ns()
            try:
                self._sock.send_multipart(call.frames, zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return  # not connected or at the high-water mark: wait for POLLOUT
            self._unsent.popleft()
            self._sent_count += 1
            call.sent_seq = self._sent_count
            call.frames = []  # zmq holds what it still needs

    def _poll_timeout_ms(self) -> int:
        now = time.monotonic()
        wake_at = self._deadlines[0][0] if self._deadlines else now + 3600.0
        state = self._state
        if state.welcome is not None and state.broken is None:
            interval_s = state.welcome.heartbeat_interval_s
            wake_at = min(wake_at, max(state.last_rx, state.last_ping_tx) + interval_s)
            if state.dead_reason is None:
                wake_at = min(wake_at, state.last_rx + DEAD_AFTER_INTERVALS * interval_s)
                if state.disconnected_at is not None:
                    wake_at = min(wake_at, state.disconnected_at + LINK_GRACE_S)
        return max(0, int((wake_at - now) * 1000.0) + 1)

    def _drain_wake_pipe(self) -> None:
        try:
            while os.read(self._wake_r, 4096):
                pass
        except BlockingIOError:
            pass

    def _receive(self) -> None:
        for _ in range(_RECEIVE_BATCH):
            try:
                parts = self._sock.recv_multipart(zmq.NOBLOCK, copy=False)
            except zmq.Again:
                return
            received_ns = time.monotonic_ns()  # (also a traced call's reply stamp: call_trace)
            self._state.last_rx = received_ns / 1e9  # time.monotonic()
            if self._state.dead_reason is not None:
                log.info("sidecar at %s answers again", self.address)
                self._state.dead_reason = None
            self._dispatch([part.buffer for part in parts], received_ns)

    def _dispatch(self, frames: list[memoryview], received_ns: int = 0) -> None:
        try:
            msg = decode_server_message(frames, RECEIVE_LIMITS)
        except ProtocolError as exc:
            call = self._pending.pop(exc.request_id, None) if exc.request_id is not None else None
            if call is None:
                log.warning("dropping malformed message from %s: %s", self.address, exc)
                return
            self._settle_failure(call, Internal(f"malformed reply from the server: {exc.message}"), "unknown")
            return
        if isinstance(msg, Pong):
            self._observe_epoch(msg.boot_epoch, via_welcome=False)
            if msg.load is not None:
                self._state.load = msg.load
        if isinstance(msg, Error) and msg.request_id in self._state.recent_ping_ids:
            # A server that refuses our ping does not know this connection: it restarted, or it dropped our
            # session (silent past its client_silence_s, or its TTL), and our streams with it. Say hello
            # again; the welcome's boot epoch tells which (_adopt_welcome).
            log.warning("ping refused by %s (%s): %s", self.address, msg.code.value, msg.message)
            self._state.session_refused = True
            self._rehello()
            return
        if msg.request_id is None:
            log.warning("error from %s not tied to a request: %s", self.address, getattr(msg, "message", msg))
            return
        call = self._pending.pop(msg.request_id, None)
        if call is None:
            return  # a late reply to a call that already timed out, or a ping we stopped waiting for
        if call.stamps is not None:
            call.stamps.received_ns = received_ns
        if isinstance(msg, Error):
            self._settle_failure(call, error_from(msg.code, msg.message, msg.failed_seq), "rejected")
            return
        try:
            call.on_reply(msg, frames)
        except SidecarError as exc:
            self._settle_failure(call, exc, "unknown")
        except Exception as exc:
            log.exception("reply handler failed")
            self._settle_failure(call, Internal(f"could not handle the {msg.TYPE} reply: {exc!r}"), "unknown")

    def _expire(self, now: float) -> None:
        while self._deadlines and self._deadlines[0][0] <= now:
            _, request_id = heapq.heappop(self._deadlines)
            call = self._pending.pop(request_id, None)
            if call is None:
                continue
            if call.sent:
                error = DeadlineExceeded(f"no reply from {self.address} within {call.timeout_s:g}s")
            else:
                self._unsent.remove(call)
                error = DeadlineExceeded(
                    f"could not send to {self.address} within {call.timeout_s:g}s (not connected)"
                )
            self._settle_failure(call, error, "unknown" if call.sent else "not_sent")

    def _fail_all(self, error: SidecarError, include_internal: bool, generation: int | None = None) -> None:
        """Fail pending calls (``generation``: only the stream calls of that server generation)."""
        self._fail_calls(error, lambda call: (include_internal or not call.internal)
                         and (generation is None or call.generation == generation))

    def _fail_calls(self, error: SidecarError, doomed: Callable[[Call], bool]) -> None:
        """Fail the pending calls ``doomed`` names (unsent ones leave the send queue)."""
        for call in [call for call in self._pending.values() if doomed(call)]:
            del self._pending[call.request_id]
            if not call.sent:
                self._unsent.remove(call)
            self._settle_failure(call, error, "unknown" if call.sent else "not_sent")

    def _settle_failure(self, call: Call, error: SidecarError, outcome: Outcome) -> None:
        if self._held_failures is not None:  # a direct send: reported after its locks are released
            self._held_failures.append((call, error, outcome))
            return
        try:
            call.on_failure(error, outcome)
        except Exception:
            log.exception("failure handler raised")

    def _shutdown(self) -> None:
        state = self._state
        linger_ms = 0
        if state.welcome is not None and state.dead_reason is None and state.broken is None:
            try:
                self._sock.send_multipart(encode(Bye(self.next_request_id())), zmq.NOBLOCK)
                linger_ms = _BYE_LINGER_MS
            except zmq.ZMQError:
                pass
        closed = Unavailable(f"client for {self.address} is closed")
        self._fail_all(closed, include_internal=True)
        while self._inbox:
            call = self._inbox.popleft()
            if call is not None:
                self._settle_failure(call, closed, "not_sent")
        if self._monitor is not None:
            self._sock.disable_monitor()
            self._monitor.close(linger=0)
        self._sock.close(linger=linger_ms)
        os.close(self._wake_r)

