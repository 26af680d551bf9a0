"""The socket side of the server loop: drain input into the sessions, flush their replies, and the loop work that
follows from them (freeing a departed client's streams in slices, opening and closing CUDA IPC regions on the
engine thread). Transport only: it never calls the model.

Busy polling (``busy_poll_s``, on by default on CUDA): for that long after any input or step, the step loop polls
the socket (``poll``) instead of sleeping, and handles what arrives itself (no descriptor wake-up, no hand-off to
another task), so a chunk goes from the socket to the device on a thread that never slept. It never spins while
the worker thread runs a step, which needs the GIL.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import logging
import time
from typing import Callable

from code2wav.proto import ErrorCode

from .chunk_trace import ChunkTrace
from .metrics import Metrics
from .sessions import Sessions
from .stream_table import CLOSE_SLICE_STREAMS
from .transport import Transport

log = logging.getLogger(__name__)

RECEIVE_BATCH = 256
"""Messages handled per wake-up before other loop work (steps, timers) gets a turn."""


class SocketLoop:
    """What the stepper sees of the loop (``stepper.LoopIO``), and the reader callback of the socket."""

    def __init__(self, transport: Transport, sessions: Sessions, pool: concurrent.futures.Executor,
                 metrics: Metrics, busy_poll_s: float, trace: ChunkTrace | None = None) -> None:
        self.transport = transport
        self.sessions = sessions
        self.pool = pool  # the engine thread: region opens and closes run there, between steps
        self.busy_poll_s = busy_poll_s  # 0: never busy-poll
        self.poll_until = 0.0  # monotonic: the step loop polls instead of sleeping until then
        self.trace = trace  # the chunks' stage recorder (``trace_chunks``); None: off
        self.region_ops_running = False  # a task is draining region open/close work
        self.loop_step_running = False  # the stepper has a step on the loop thread (region ops wait for its end)
        self._work = asyncio.Event()
        self._close_slice_due = False  # a loop turn will free a slice of the sessions' close backlog
        self._polling = False  # the step loop is busy-polling now (input found now was not waited for)
        self._pickups_polled = metrics.input_pickups.labels(how="polled")
        self._pickups_woken = metrics.input_pickups.labels(how="woken")

    def wake(self) -> None:
        """The step loop looks at the queue again (input arrived, or the server drains)."""
        self._work.set()

    def on_readable(self) -> int:
        """Drain input: every waiting message goes to the sessions, then replies go out and the step loop wakes.
        Called by the descriptor's callback after the loop slept, or while the step loop busy-polls. Returns how
        many messages it took (none: nothing else to do)."""
        count = 0
        while count < RECEIVE_BATCH:
            received = self.transport.recv_nowait()
            if received is None:
                break
            count += 1
            if self.trace is not None:
                self.trace.message_received()
            identity, frames = received
            try:
                self.sessions.on_message(identity, frames, self.transport.last_user_id)
            except Exception:  # a bug must not stop the server; the client gets an internal error
                log.exception("internal error while handling a message")
                self.sessions.out.error(identity, None, ErrorCode.INTERNAL, "internal error handling the message")
        else:
            asyncio.get_running_loop().call_soon(self.on_readable)  # more waiting: after other loop work
        if not count:
            return 0
        self.poll_until = time.monotonic() + self.busy_poll_s  # traffic flows: poll for a while
        (self._pickups_polled if self._polling else self._pickups_woken).inc()
        self.flush()
        self._work.set()
        return count

    async def poll(self, done: Callable[[], bool], until_s: float) -> None:
        """Busy-poll until ``done()`` or ``until_s`` (monotonic): input is handled as soon as it is there, and the
        loop's other work gets a turn at every check (``sleep(0)`` runs one loop iteration)."""
        self._polling = True
        try:
            while not done():
                if self.on_readable():
                    if done():
                        return
                elif time.monotonic() >= until_s:
                    return
                await asyncio.sleep(0)
        finally:
            self._polling = False

    async def wait_for_work(self, timeout_s: float | None) -> None:
        """Sleep until input arrives or ``timeout_s`` passes."""
        self._work.clear()
        try:
            await asyncio.wait_for(self._work.wait(), timeout=timeout_s)
        except asyncio.TimeoutError:
            pass

    def flush(self) -> None:
        """Send what the sessions have to send; start the loop work that follows from it."""
        sessions = self.sessions
        outbox = sessions.out.take()
        for out in outbox:  # (traced chunks, with trace_chunks on: stamped as their reply goes into the socket)
            sending = None if out.stamps is None else functools.partial(self.trace.sent, out.stamps)
            self.transport.send(out.identity, out.message, out.buffers, sending)
        if outbox and self.transport.readable():  # sending may have consumed the descriptor's signal
            asyncio.get_running_loop().call_soon(self.on_readable)
        if sessions.streams.close_backlog and not self._close_slice_due:  # a departed client's streams: a slice
            self._close_slice_due = True  # per loop turn, so other clients' messages are handled in between
            asyncio.get_running_loop().call_soon(self._close_slice)
        if sessions.regions.device_ops and not self.region_ops_running and not self.loop_step_running:
            self.region_ops_running = True
            asyncio.get_running_loop().create_task(self._run_region_ops(), name="region-ops")

    def _close_slice(self) -> None:
        self._close_slice_due = False
        self.sessions.streams.close_some(CLOSE_SLICE_STREAMS)
        self.flush()

    async def _run_region_ops(self) -> None:
        """Open and close client regions on the engine thread, between steps, in arrival order."""
        loop = asyncio.get_running_loop()
        try:  # flush set region_ops_running when it started this task
            regions = self.sessions.regions  # opens/closes whose device part runs on the engine thread
            while (op := regions.next_device_op()) is not None:
                await loop.run_in_executor(self.pool, regions.run_op, op)
                regions.op_done(op)
                self.flush()
        finally:
            self.region_ops_running = False
