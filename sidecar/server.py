"""The sidecar server's lifecycle on one asyncio loop (uvloop where available): start, serve, drain, stop.

Three parts, each with one job: ``bootstrap`` builds the parts from the config (model, arena, graphs, engine,
scheduler, sessions, transport); ``loop_io.SocketLoop`` owns the socket side of the loop (input into the
sessions, replies out, region opens/closes on the engine thread); the ``stepper`` forms batches, runs them and
replies. The loop reads as: drain input -> step -> emit. This module wires them, reaps idle streams, and drains on
stop.

Signals (``run_server``): SIGTERM and SIGINT first serve the open streams for up to ``drain_grace_s`` (new streams get
``unavailable``, the load says ``draining``: a client pool moves its streams away at a chunk boundary, and the grace
ends as soon as none is open), then drain (queued chunks finish, new ones get ``unavailable``), then the
socket stays open until every reply still queued has been sent to its connected client, for up to
``shutdown_timeout_s`` (what is left then is dropped: a warning and ``shutdown_replies_unsent_total``), and the
process exits 0. A second SIGTERM or SIGINT during that shutdown exits at once with 128 + the signal's number,
dropping what is queued. SIGHUP re-reads what can change while running (the CURVE allow-list) and is otherwise
ignored with a log line. SIGUSR1 writes every thread's stack to the log. Once started, the process's heap is frozen
out of Python's garbage collector and every collection is timed into ``gc_pause_seconds`` (``gc_pauses``).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import faulthandler
import logging
import os
import signal
import time
from typing import Callable, Sequence

import torch
import zmq

from . import bootstrap
from .auth import start_client_auth
from .chunk_trace import CHUNK_STAGES_PATH, ChunkTrace
from .loop_profile import LOOP_PROFILE_PATH, LOOP_PROFILE_START_PATH, LoopProfile
from .config import ServerConfig, armed_wait_s, busy_poll_s, cpu_threads, steps_in_flight
from .connlog import shutdown_summary
from .engine import Engine
from .gc_pauses import GcPauses, freeze_heap
from .loop_io import SocketLoop
from .metrics import HealthServer, Metrics
from .models import FAMILIES, DecoderFamily, LoadedModel, configure_cuda, resolve_device
from .sessions import Sessions
from .stepper import Stepper
from .transport import Transport, check_bind_security

log = logging.getLogger(__name__)

GRACE_POLL_S = 0.02
"""How often the drain grace looks whether every stream is gone."""


class Server:
    def __init__(self, cfg: ServerConfig, metrics: Metrics | None = None,
                 families: Sequence[DecoderFamily] = FAMILIES) -> None:
        self.cfg = cfg
        self.families = tuple(families)
        self.metrics = metrics or Metrics()
        # the chunks' stage recorder (``trace_chunks``), handed to what stamps them; None: off
        self.trace = ChunkTrace(cfg.trace_chunks) if cfg.trace_chunks else None
        routes = {CHUNK_STAGES_PATH: self.trace.json_body} if self.trace is not None else {}
        if cfg.profile_loop:  # the loop thread's cProfile between two requests (sidecar/loop_profile.py)
            profile = LoopProfile()
            routes.update({LOOP_PROFILE_START_PATH: profile.start, LOOP_PROFILE_PATH: profile.stop})
        self.health = HealthServer(self.metrics, is_ready=lambda: self.ready, routes=routes)
        self.ready = False
        self.metrics_port = 0
        self.model: LoadedModel | None = None
        self.engine: Engine | None = None
        self.sessions: Sessions | None = None
        self.transport: Transport | None = None
        self.io: SocketLoop | None = None
        self.stepper: Stepper | None = None
        self.auth = None
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="engine")
        self._stop = asyncio.Event()
        self._zmq = zmq.Context()
        self.step_loop_error: BaseException | None = None  # why the step loop died, if it did (``serve`` then ends)

    async def start(self, before_ready: Callable[[], None] | None = None) -> None:
        """Build every part, then (``before_ready``: the process's last word first, ``run_server``'s) say ready."""
        cfg, sec = self.cfg, self.cfg.security
        check_bind_security(cfg.address, sec.curve_secret_key_file, sec.insecure)  # fail fast
        self.metrics_port = await self.health.start(cfg.metrics_host, cfg.metrics_port)
        loop = asyncio.get_running_loop()
        device = resolve_device(cfg.device)
        if device.type == "cuda":
            configure_cuda(cfg.graphs.allow_tf32)
        # before any thread runs a parallel op: torch sizes a thread's pool when it first uses it, so this must stay
        # ahead of build_engine_side (the engine thread's first parallel op is in loading the weights)
        if (threads := cpu_threads(cfg, device.type)) is not None:
            torch.set_num_threads(threads)
        # model, arena, graph capture: on the engine thread, so /healthz stays live
        parts = await loop.run_in_executor(self._pool, lambda: bootstrap.build_engine_side(
            cfg, device, self.metrics, self.families))
        self.model, self.engine = parts.model, parts.engine
        self.sessions = bootstrap.build_sessions(cfg, parts, self.metrics, self.trace)
        self.auth = start_client_auth(self._zmq, check_bind_security(cfg.address, sec.curve_secret_key_file,
                                      sec.insecure, warn=False), sec.curve_allowed_clients_dir, self.metrics)
        self.transport = bootstrap.build_transport(cfg, self._zmq)
        self.io = SocketLoop(self.transport, self.sessions, self._pool, self.metrics, busy_poll_s(cfg, device.type),
                             self.trace)
        self.stepper = Stepper(parts.engine, self.sessions, parts.scheduler, self.metrics, self._pool, self.io,
                               cfg.codes_event_timeout_s, steps_in_flight(cfg, device.type), self.trace,
                               armed_wait_s=armed_wait_s(cfg))
        if before_ready is not None:
            before_ready()
        self.ready = True
        self.metrics.ready.set(1)

    @property
    def address(self) -> str:
        assert self.transport is not None
        return self.transport.bound_address

    async def serve(self) -> None:
        """Run until ``stop()``; then drain: queued chunks finish, new ones are refused, replies flushed."""
        assert self.sessions is not None and self.io is not None and self.stepper is not None
        sessions, io, stepper = self.sessions, self.io, self.stepper
        loop = asyncio.get_running_loop()
        loop.add_reader(self.transport.fd, io.on_readable)
        loop.call_soon(io.on_readable)  # anything that arrived before the reader was added
        step_loop = asyncio.create_task(stepper.run(), name="step")
        step_loop.add_done_callback(self._step_loop_ended)
        tasks = [step_loop, asyncio.create_task(self._reap_loop(), name="reap")]
        await self._stop.wait()
        if self.cfg.drain_grace_s > 0:
            await self._serve_grace(self.cfg.drain_grace_s)
        sent_at_stop = self.transport.num_sent
        sessions.drain()
        io.wake()
        drain = (time.monotonic(), sum(sessions.streams.pending_by_client.values()), len(sessions.streams))
        self.ready = False
        self.metrics.ready.set(0)
        while not stepper.idle and not step_loop.done():  # (a dead step loop finishes nothing)
            await asyncio.sleep(0.005)
        io.flush()
        sessions.clients.connlog.flush()
        shutdown_summary(log, self.metrics, drain[1], drain[2], time.monotonic() - drain[0])
        loop.remove_reader(self.transport.fd)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await self.close(self.cfg.shutdown_timeout_s, sent_at_stop)

    async def _serve_grace(self, grace_s: float) -> None:
        """The drain grace: open streams are still served, new ones refused and the load says ``draining``, until
        no stream is open (client pools moved them, at a chunk boundary) or ``grace_s`` ran out. Not ready meanwhile
        (``/readyz``), so an orchestrator takes the sidecar out of its Service."""
        sessions = self.sessions
        sessions.stop_opening()
        self.ready = False
        self.metrics.ready.set(0)
        started, num_open = time.monotonic(), len(sessions.streams)
        log.info("drain grace: %d open streams may move to other sidecars for up to %gs (drain_grace_s); new "
                 "streams are refused", num_open, grace_s)
        while len(sessions.streams) and time.monotonic() - started < grace_s:
            await asyncio.sleep(GRACE_POLL_S)
        log.info("drain grace over after %.2fs: %d of %d streams still open (the drain ends them)",
                 time.monotonic() - started, len(sessions.streams), num_open)

    def stop(self) -> None:
        self._stop.set()

    def _step_loop_ended(self, task: asyncio.Task) -> None:
        """The step loop ends only when the drain cancels it; ended otherwise (an error it did not contain), nothing
        decodes chunks any more: the sidecar stops and exits 1 (``step_loop_error``), so an orchestrator restarts it
        and client pools move its streams, instead of a sidecar that answers pings and no chunk."""
        if task.cancelled() or task.exception() is None:
            return
        self.step_loop_error = task.exception()
        log.critical("the step loop died (%s: %s): no chunk can be decoded any more; the sidecar stops (exit "
                     "code 1)", type(self.step_loop_error).__name__, self.step_loop_error, exc_info=self.step_loop_error)
        self.ready = False
        self.metrics.ready.set(0)
        self.stop()

    @property
    def stopping(self) -> bool:
        """A stop was asked for: the server drains, or is about to."""
        return self._stop.is_set()

    def reload(self) -> None:
        """SIGHUP: re-read what can change while the server runs (the CURVE allow-list); nothing else is."""
        if self.auth is not None:
            log.info("SIGHUP: reloading the CURVE client allow-list")
            self.auth.reload()
        else:
            log.info("SIGHUP ignored: nothing to reload (only security.curve_allowed_clients_dir is, with CurveZMQ)")

    async def close(self, linger_s: float = 0.0, sent_at_stop: int = 0) -> None:
        """Close the socket (after ``serve``'s drain: the replies still queued go out for up to ``linger_s``), the
        ZAP handler, the context, then the metrics endpoint (so a scrape still sees how the shutdown went)."""
        sent_since_stop = 0
        if self.transport is not None:
            sent_since_stop = self.transport.num_sent - sent_at_stop
            self.transport.close(linger_s)
        if self.auth is not None:
            self.auth.stop()
        started = time.monotonic()
        # (a thread: the loop stays free for a second signal; term returns once the socket sent its queue)
        await asyncio.get_running_loop().run_in_executor(None, self._zmq.term)
        waited_s = time.monotonic() - started
        if linger_s > 0 and waited_s >= linger_s:
            self.metrics.shutdown_unsent.inc(sent_since_stop)
            log.warning("shutdown: replies were still queued after shutdown_timeout_s (%gs) and were dropped (at "
                        "most the %d replies sent since the stop signal; a client reading too slowly)", linger_s,
                        sent_since_stop)
        elif linger_s > 0:
            log.info("shutdown: every queued reply was sent (%d since the stop signal) in %.2fs", sent_since_stop,
                     waited_s)
        await self.health.close()
        self._pool.shutdown(wait=True)

    async def _reap_loop(self) -> None:
        assert self.sessions is not None and self.io is not None
        interval_s = min(1.0, self.cfg.streams.ttl_s / 4, self.cfg.streams.client_silence_s / 4)
        while True:
            await asyncio.sleep(interval_s)
            self.sessions.reap(time.monotonic())
            self.io.flush()


def _on_stop_signal(server: Server, sig: signal.Signals) -> None:
    """The first SIGTERM/SIGINT drains; a second one during the shutdown exits now (128 + its number)."""
    if not server.stopping:
        log.info("%s: draining (a second SIGTERM or SIGINT exits at once)", sig.name)
        server.stop()
        return
    log.warning("%s again during the shutdown: exiting now; queued chunks and unsent replies are dropped", sig.name)
    os._exit(128 + sig)


def install_uvloop() -> str:
    try:
        import uvloop  # noqa: PLC0415
    except ImportError:
        return "asyncio"
    asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())
    return "uvloop"


def _freeze_heap(server: Server) -> None:
    """What start-up made, out of the garbage collector for good (sidecar/gc_pauses.py): before the server says ready,
    so no first request waits for the collection."""
    frozen, collect_s = freeze_heap()
    server.metrics.gc_frozen_objects.set(frozen)
    log.info("heap frozen: %d objects out of the garbage collector (its last full pass took %.1f ms)", frozen,
             collect_s * 1e3)


async def run_server(cfg: ServerConfig, on_ready=None, families: Sequence[DecoderFamily] = FAMILIES) -> int:
    server = Server(cfg, families=families)
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, _on_stop_signal, server, sig)
    loop.add_signal_handler(signal.SIGHUP, server.reload)
    # `kill -USR1 <pid>`: every thread's Python stack to stderr (the log), even while one holds the GIL in C code
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    pauses = GcPauses(server.metrics.observe_gc_pause).install()
    try:
        await server.start(before_ready=lambda: _freeze_heap(server))
        if on_ready is not None:
            on_ready(server)
        await server.serve()
    finally:
        pauses.remove()
    return 0 if server.step_loop_error is None else 1
