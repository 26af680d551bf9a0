"""The sidecar server's loop: socket I/O, the handshake and liveness, on one asyncio loop (uvloop where available).

Three parts, each with one job: ``bootstrap`` builds the parts from the config (model, arena, graphs, engine,
sessions, transport); this module owns the socket and the loop (draining input into the sessions, flushing
replies, reaping idle streams, running region opens/closes on the engine thread, draining on stop); the
``stepper`` forms batches, runs them and replies. They talk through small public interfaces: the stepper sees
this loop as a ``LoopIO`` (poll, flush, wait for work), the loop sees the sessions' ``on_message``,
``out.take()`` and their ``regions`` (region opens/closes).

Busy polling (``busy_poll_us``, on by default on CUDA): for that long after any input or step, the step loop
polls the socket instead of sleeping, and handles what arrives itself (no descriptor wake-up, no hand-off to
another task), so a chunk goes from the socket to the device on a thread that never slept. It never spins
while the worker thread runs a step, which needs the GIL.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import faulthandler
import logging
import signal
import time
from typing import Callable, Sequence

import torch
import zmq

from code2wav.proto import ErrorCode

from . import bootstrap
from .config import ServerConfig, busy_poll_s, cpu_threads
from .connlog import shutdown_summary
from .metrics import HealthServer, Metrics
from .models import FAMILIES, DecoderFamily, LoadedModel, configure_cuda, resolve_device
from .scheduler import Scheduler
from .auth import start_client_auth
from .sessions import CLOSE_SLICE_STREAMS, Sessions
from .stepper import Stepper
from .transport import Transport, check_bind_security

log = logging.getLogger(__name__)

_RECEIVE_BATCH = 256
"""Messages handled per wake-up before other loop work (steps, timers) gets a turn."""


class Server:
    def __init__(self, cfg: ServerConfig, metrics: Metrics | None = None,
                 families: Sequence[DecoderFamily] = FAMILIES) -> None:
        self.cfg = cfg
        self.families = tuple(families)
        self.metrics = metrics or Metrics()
        self.health = HealthServer(self.metrics, is_ready=lambda: self.ready)
        self.ready = False
        self.model: LoadedModel | None = None
        self.sessions: Sessions | None = None
        self.transport: Transport | None = None
        self.stepper: Stepper | None = None
        self.engine = None  # bootstrap's Engine, once started
        self.scheduler = Scheduler(cfg.scheduler.max_batch_size, cfg.scheduler.batch_window_us / 1e6,
                                   cfg.scheduler.max_pending_chunks)
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="engine")
        self._work = asyncio.Event()
        self._stop = asyncio.Event()
        self._zmq = zmq.Context()
        self.region_ops_running = False  # a task is draining region open/close work
        self.busy_poll_s = 0.0  # resolved for the device at start
        self.poll_until = 0.0  # monotonic: the step loop polls instead of sleeping until then
        self._close_slice_due = False  # a loop turn will free a slice of the sessions' close backlog
        self._polling = False  # the step loop is busy-polling now (input found now was not waited for)
        self._pickups_polled = self.metrics.input_pickups.labels(how="polled")
        self._pickups_woken = self.metrics.input_pickups.labels(how="woken")
        self.metrics_port = 0

    async def start(self) -> None:
        cfg = self.cfg
        check_bind_security(cfg.address, cfg.security.curve_secret_key_file, cfg.security.insecure)  # fail fast
        self.metrics_port = await self.health.start(cfg.metrics_host, cfg.metrics_port)
        loop = asyncio.get_running_loop()
        device = resolve_device(cfg.device)
        if device.type == "cuda":
            configure_cuda(cfg.graphs.allow_tf32)
        self.busy_poll_s = busy_poll_s(cfg, device.type)
        # before any thread runs a parallel op: torch sizes a thread's pool when it first uses it, so this must stay
        # ahead of build_engine_side (the engine thread's first parallel op is in loading the weights)
        if (threads := cpu_threads(cfg, device.type)) is not None:
            torch.set_num_threads(threads)
        # model, arena, graph capture: on the engine thread, so /healthz stays live
        parts = await loop.run_in_executor(self._pool, lambda: bootstrap.build_engine_side(
            cfg, device, self.scheduler, self.metrics, self.families))
        self.model, self.engine = parts.model, parts.engine
        self.sessions = bootstrap.build_sessions(cfg, parts, self.scheduler, self.metrics)
        sec = cfg.security
        self.auth = start_client_auth(self._zmq, check_bind_security(cfg.address, sec.curve_secret_key_file,
                                      sec.insecure, warn=False), sec.curve_allowed_clients_dir, self.metrics)
        if self.auth is not None:
            loop.add_signal_handler(signal.SIGHUP, self.auth.reload)
        self.transport = bootstrap.build_transport(cfg, self._zmq)
        self.stepper = Stepper(parts.engine, self.sessions, self.scheduler, self.metrics, self._pool, self,
                               cfg.codes_event_timeout_s)
        self.ready = True
        self.metrics.ready.set(1)

    @property
    def address(self) -> str:
        assert self.transport is not None
        return self.transport.bound_address

    async def serve(self) -> None:
        """Run until ``stop()``; then drain: queued chunks finish, new ones are refused, replies flushed."""
        assert self.sessions is not None and self.transport is not None and self.stepper is not None
        loop = asyncio.get_running_loop()
        loop.add_reader(self.transport.fd, self._on_readable)
        loop.call_soon(self._on_readable)  # anything that arrived before the reader was added
        tasks = [asyncio.create_task(self.stepper.run(), name="step"),
                 asyncio.create_task(self._reap_loop(), name="reap")]
        await self._stop.wait()
        self.sessions.draining = True
        self.scheduler.batch_window_s = 0.0  # queued chunks run now, without waiting for company
        self._work.set()
        drain = (time.monotonic(), sum(self.sessions.pending_by_client.values()), len(self.sessions.streams))
        self.ready = False
        self.metrics.ready.set(0)
        while not self.stepper.idle:
            await asyncio.sleep(0.005)
        self.flush()
        self.sessions.connlog.flush()
        shutdown_summary(log, self.metrics, drain[1], drain[2], time.monotonic() - drain[0])
        loop.remove_reader(self.transport.fd)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await self.close()

    def stop(self) -> None:
        self._stop.set()

    async def close(self) -> None:
        await self.health.close()
        if self.transport is not None:
            self.transport.close()
        if getattr(self, "auth", None) is not None:
            self.auth.stop()
        self._zmq.term()
        self._pool.shutdown(wait=True)

    # ------------------------------------------------------------------ LoopIO (what the stepper uses)
    async def poll(self, done: Callable[[], bool], until_s: float) -> None:
        """Busy-poll until ``done()`` or ``until_s`` (monotonic): input is handled as soon as it is there, and
        the loop's other work gets a turn at every check (``sleep(0)`` runs one loop iteration)."""
        self._polling = True
        try:
            while not done():
                if self._on_readable():
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
        """Send what the sessions have to send; start region opens/closes waiting for the engine thread."""
        assert self.transport is not None and self.sessions is not None
        outbox = self.sessions.out.take()
        for out in outbox:
            self.transport.send(out.identity, out.message, out.buffers)
        if outbox and self.transport.readable():  # sending may have consumed the descriptor's signal
            asyncio.get_running_loop().call_soon(self._on_readable)
        if self.sessions.close_backlog and not self._close_slice_due:  # a departed client's streams: a slice
            self._close_slice_due = True  # per loop turn, so other clients' messages are handled in between
            asyncio.get_running_loop().call_soon(self._close_slice)
        if self.sessions.regions.device_ops and not self.region_ops_running:
            self.region_ops_running = True
            asyncio.get_running_loop().create_task(self._run_device_ops(), name="region-ops")

    # ------------------------------------------------------------------ loops
    def _on_readable(self) -> int:
        """Drain input: every waiting message goes to the sessions, then replies go out and the step loop wakes.
        Called by the descriptor's callback after the loop slept, or while the step loop busy-polls. Returns
        how many messages it took (none: nothing else to do)."""
        assert self.transport is not None and self.sessions is not None
        count = 0
        while count < _RECEIVE_BATCH:
            received = self.transport.recv_nowait()
            if received is None:
                break
            count += 1
            identity, frames = received
            try:
                self.sessions.on_message(identity, frames, self.transport.last_user_id)
            except Exception:  # a bug must not stop the server; the client gets an internal error
                log.exception("internal error while handling a message")
                self.sessions.out.error(identity, None, ErrorCode.INTERNAL, "internal error handling the message")
        else:
            asyncio.get_running_loop().call_soon(self._on_readable)  # more waiting: after other loop work
        if not count:
            return 0
        self.poll_until = time.monotonic() + self.busy_poll_s  # traffic flows: poll for a while
        (self._pickups_polled if self._polling else self._pickups_woken).inc()
        self.flush()
        self._work.set()
        return count

    async def _run_device_ops(self) -> None:
        """Open and close client regions on the engine thread, between steps, in arrival order."""
        sessions = self.sessions
        loop = asyncio.get_running_loop()
        try:  # flush set region_ops_running when it started this task
            regions = sessions.regions  # opens/closes whose device part runs on the engine thread
            while (op := regions.next_device_op()) is not None:
                await loop.run_in_executor(self._pool, regions.run_op, op)
                regions.op_done(op)
                self.flush()
        finally:
            self.region_ops_running = False

    async def _reap_loop(self) -> None:
        assert self.sessions is not None
        interval_s = min(1.0, self.cfg.streams.ttl_s / 4, self.cfg.streams.client_silence_s / 4)
        while True:
            await asyncio.sleep(interval_s)
            self.sessions.reap(time.monotonic())
            self.flush()

    def _close_slice(self) -> None:
        self._close_slice_due = False
        self.sessions.close_some(CLOSE_SLICE_STREAMS)
        self.flush()


def install_uvloop() -> str:
    try:
        import uvloop  # noqa: PLC0415
    except ImportError:
        return "asyncio"
    asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())
    return "uvloop"


async def run_server(cfg: ServerConfig, on_ready=None, families: Sequence[DecoderFamily] = FAMILIES) -> int:
    server = Server(cfg, families=families)
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, server.stop)
    # `kill -USR1 <pid>`: every thread's Python stack to stderr (the log), even while one holds the GIL in C code
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    await server.start()
    if on_ready is not None:
        on_ready(server)
    await server.serve()
    return 0
