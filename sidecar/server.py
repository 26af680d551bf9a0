"""The sidecar server: drain input -> step -> emit, on one asyncio loop (uvloop where available).

The loop thread owns the socket, the sessions and the scheduler. A step whose every chunk writes its audio
into a client's CUDA IPC region does not wait for the device (its replies name events instead), so it is
launched from the loop thread itself, with no thread hand-off on the latency path, and its replies leave at
once. After any step that wrote into client regions the worker thread waits for the device to finish it
before the next batch is formed, so batches fill while the device works and a step never starts while the
last one still reads its inputs. Any other step waits for the device (audio copied to the host), so it runs in
the worker thread, and receiving and replying go on meanwhile. One step at a time, and none on the loop thread
while a region is being opened or closed in the worker.

Busy polling (``busy_poll_us``, on by default on CUDA): for that long after any input or step, the step loop
polls the socket instead of sleeping, and handles what arrives itself (no descriptor wake-up, no hand-off to
another task), so a chunk goes from the socket to the device on a thread that never slept. After a CUDA IPC
step it polls the device's completion the same way instead of waiting for it in the worker thread. And a batch
whose CUDA IPC codes events are not all complete yet polls them for a moment (``_CODES_GRACE_S``) before it
puts those chunks back for the next step. It never spins while the worker thread runs a step, which needs the
GIL.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import signal
import time

import torch
import zmq

from code2wav.proto import ErrorCode

from .arena_sizing import UNCAPPED_GRAPH_RESERVE_BYTES, ArenaPlan, plan_arena
from .config import ServerConfig, busy_poll_s
from .engine import Engine
from .graphs.compiled import compile_routines
from .graphs.manager import GraphManager
from .graphs.plan import build_buckets
from .ipc.cudart import CudaIpcError, host_id
from .ipc.device import CudaIpcDevice
from .ipc.io import drop_complete, incomplete_codes_events, load_codes, store_audio
from .metrics import HealthServer, Metrics
from .models import LoadedModel, configure_cuda, load_model, resolve_device
from .models.routine import StreamRoutine
from .scheduler import Scheduler
from .sessions import Sessions
from .state_store import StateArena
from .transport import Transport, check_bind_security

log = logging.getLogger(__name__)

_RECEIVE_BATCH = 256
"""Messages handled per wake-up before other loop work (steps, timers) gets a turn."""
_DEFERRED_RETRY_S = 0.0002
"""Pause before retrying a step whose only chunks were waiting for their clients' codes."""
_CODES_GRACE_S = 0.0002
"""With busy polling: how long a batch waits for codes events still incomplete before those chunks are put back
(a chunk put back waits a whole step). The copy behind such an event was usually queued on the client's context
while the sidecar's step held the GPU, and runs as soon as that step ends, within microseconds."""


class Server:
    def __init__(self, cfg: ServerConfig, metrics: Metrics | None = None) -> None:
        self.cfg = cfg
        self.metrics = metrics or Metrics()
        self.health = HealthServer(self.metrics, is_ready=lambda: self.ready)
        self.ready = False
        self.model: LoadedModel | None = None
        self.sessions: Sessions | None = None
        self.transport: Transport | None = None
        self.scheduler = Scheduler(cfg.scheduler.max_batch_size, cfg.scheduler.batch_window_us / 1e6,
                                   cfg.scheduler.max_pending_chunks)
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="engine")
        self._work = asyncio.Event()
        self._stop = asyncio.Event()
        self._zmq = zmq.Context()
        self._busy = False  # an engine step is in flight
        self._ops_running = False  # a task is draining region open/close work
        self._busy_poll_s = 0.0  # resolved for the device at start
        self._poll_until = 0.0  # monotonic: the step loop polls instead of sleeping until then
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
        self._busy_poll_s = busy_poll_s(cfg, device.type)
        t0 = time.perf_counter()
        self.model = await loop.run_in_executor(
            self._pool, lambda: load_model(cfg.model, device, cfg.dtype, name=cfg.model_name, seed=cfg.seed))
        log.info("model '%s' (%s) loaded on %s as %s in %.1fs", self.model.name, self.model.source, device,
                 cfg.dtype, time.perf_counter() - t0)
        layout = self.model.module.state_layout()
        arena_plan = self._plan_arena(StateArena.stream_nbytes(layout, self.model.dtype), device)
        num_slots = arena_plan.num_slots
        arena = StateArena(layout, num_slots, self.model.dtype, device)
        log.info("stream state: %s", arena_plan.describe(arena.bytes_per_stream))
        self.metrics.state_bytes_per_stream.labels(model=self.model.name).set(arena.bytes_per_stream)
        self.metrics.arena_slots.labels(model=self.model.name, kind="total").set(num_slots)
        self.metrics.arena_slots.labels(model=self.model.name, kind="used").set(0)
        graphs = None
        if device.type == "cuda" and cfg.graphs.enabled:  # capture on the engine thread; /healthz stays live
            graphs = await loop.run_in_executor(self._pool, self._build_graphs, arena)
        self.engine = Engine(self.model, arena, cfg.engine.max_forward_frames, graphs=graphs, metrics=self.metrics)
        ipc_device, ipc_off_reason = self._ipc_device(device)
        self.sessions = Sessions(cfg, self.model, arena, self.scheduler, self.metrics, ipc_device, host_id(),
                                 ipc_off_reason)
        sec = cfg.security
        self.transport = Transport(self._zmq, cfg.address, cfg.limits.max_message_bytes,
                                   sec.curve_secret_key_file, sec.insecure)
        self.ready = True
        self.metrics.ready.set(1)

    def _ipc_device(self, device) -> tuple[CudaIpcDevice | None, str]:
        """What opens clients' CUDA IPC regions, or None and why not."""
        reason, ipc_device = "", None
        if device.type != "cuda":
            reason = "the sidecar runs on the CPU"
        elif not self.cfg.cuda_ipc:
            reason = "disabled by the cuda_ipc setting"
        else:
            try:
                ipc_device = CudaIpcDevice(device)
            except CudaIpcError as exc:
                reason = str(exc)
        log.info("CUDA IPC regions: %s", f"accepted on {ipc_device.uuid}" if ipc_device else f"off ({reason})")
        return ipc_device, reason

    def _plan_arena(self, bytes_per_stream: int, device) -> ArenaPlan:
        """Arena slots (policy: arena_sizing): measured free device memory, less what the graphs may take."""
        scfg, gcfg = self.cfg.streams, self.cfg.graphs
        free = torch.cuda.mem_get_info(device)[0] if device.type == "cuda" else None
        graphs_on = device.type == "cuda" and gcfg.enabled
        reserve = (gcfg.max_graph_memory_bytes if gcfg.max_graph_memory_bytes is not None
                   else UNCAPPED_GRAPH_RESERVE_BYTES) if graphs_on else 0
        return plan_arena(bytes_per_stream, max_streams=scfg.max_streams, state_memory_bytes=scfg.state_memory_bytes,
                          free_device_bytes=free, graph_reserve_bytes=reserve,
                          margin_bytes=scfg.state_memory_margin_bytes, auto_max_streams=scfg.auto_max_streams)

    def _build_graphs(self, arena: StateArena) -> GraphManager:
        """CUDA graphs for the configured buckets (policy: graphs.plan; mechanism: graphs.manager)."""
        gcfg = self.cfg.graphs
        buckets = (build_buckets("exact", gcfg.exact_batch_sizes, gcfg.exact_frames)
                   + build_buckets("window", gcfg.window_batch_sizes, gcfg.window_frames))
        max_frames = self.cfg.engine.max_forward_frames
        routines = {
            "exact": StreamRoutine(self.model, arena, max(gcfg.exact_batch_sizes), max(max(gcfg.exact_frames), max_frames)),
            "window": StreamRoutine(self.model, None, max(gcfg.window_batch_sizes),
                                    max(max(gcfg.window_frames), max_frames)),
        }
        compiled = (compile_routines(routines, [k.mode for k in buckets], gcfg.compile_cache_dir,
                                     gcfg.max_lazy_captures) if gcfg.compile else None)
        manager = GraphManager(routines, buckets, self.model.device, self.metrics, mode=gcfg.mode,
                               max_lazy_captures=gcfg.max_lazy_captures,
                               max_graph_memory_bytes=gcfg.max_graph_memory_bytes,
                               cudnn_benchmark=gcfg.cudnn_benchmark, compiled=compiled)
        manager.capture_startup()
        largest = manager.largest_captured_batch("exact")
        if largest and self.scheduler.max_batch_size > largest:
            if gcfg.cap_batch_to_buckets:
                log.info("scheduler.max_batch_size %d capped to the largest captured exact bucket (%d)",
                         self.scheduler.max_batch_size, largest)
                self.scheduler.max_batch_size = largest
            else:
                log.info("batches of %d..%d chunks run eager (largest captured exact bucket: %d)", largest + 1,
                         self.scheduler.max_batch_size, largest)
        return manager

    @property
    def address(self) -> str:
        assert self.transport is not None
        return self.transport.bound_address

    async def serve(self) -> None:
        """Run until ``stop()``; then drain: queued chunks finish, new ones are refused, replies flushed."""
        assert self.sessions is not None and self.transport is not None
        loop = asyncio.get_running_loop()
        loop.add_reader(self.transport.fd, self._on_readable)
        loop.call_soon(self._on_readable)  # anything that arrived before the reader was added
        tasks = [asyncio.create_task(self._step_loop(), name="step"),
                 asyncio.create_task(self._reap_loop(), name="reap")]
        await self._stop.wait()
        self.sessions.draining = True
        self.ready = False
        self.metrics.ready.set(0)
        while len(self.scheduler) or self._busy:
            await asyncio.sleep(0.005)
        self._flush()
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
        self._zmq.term()
        self._pool.shutdown(wait=True)

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
                self.sessions.on_message(identity, frames)
            except Exception:  # a bug must not stop the server; the client gets an internal error
                log.exception("internal error while handling a message")
                self.sessions.error(identity, None, ErrorCode.INTERNAL, "internal error handling the message")
        else:
            asyncio.get_running_loop().call_soon(self._on_readable)  # more waiting: after other loop work
        if not count:
            return 0
        self._poll_until = time.monotonic() + self._busy_poll_s  # traffic flows: poll for a while
        (self._pickups_polled if self._polling else self._pickups_woken).inc()
        self._flush()
        self._work.set()
        return count

    async def _step_loop(self) -> None:
        assert self.sessions is not None
        loop = asyncio.get_running_loop()
        while True:
            now = time.monotonic()
            wait_s = self.scheduler.seconds_until_ready(now)
            if wait_s is None or wait_s > 0:
                if now < self._poll_until:  # traffic flows: poll, and take what arrives on this thread
                    await self._poll(self._batch_ready, self._poll_until if wait_s is None else now + wait_s)
                    continue
                self._work.clear()
                try:
                    await asyncio.wait_for(self._work.wait(), timeout=wait_s)
                except asyncio.TimeoutError:
                    pass
                continue
            batch = self.scheduler.take_batch()
            mode = batch[0].stream.mode
            now = time.monotonic()
            self._busy = True  # (chunks of a stream closed meanwhile keep their slot until release_in_flight)
            try:
                pending = incomplete_codes_events(batch)  # the step's one query per codes event
                if pending and self._busy_poll_s:  # a moment's grace rather than a whole step's delay for them
                    await self._poll(lambda: not drop_complete(pending), time.monotonic() + _CODES_GRACE_S)
                now = time.monotonic()
                if self._step_on_loop(batch):
                    done, audios, refused, deferred = self._engine_step(batch, pending, on_loop=True)
                else:
                    done, audios, refused, deferred = await loop.run_in_executor(self._pool, self._engine_step,
                                                                                 batch, pending)
            except Exception as exc:
                log.exception("engine step failed for a batch of %d %s chunks", len(batch), mode)
                for job in batch:
                    self.sessions.fail_job(job, ErrorCode.INTERNAL, f"decode failed: {type(exc).__name__}: {exc}")
            else:
                for job, code, message in refused:
                    self.sessions.fail_job(job, code, message)
                if deferred:  # codes still being written by the client: first in line for the next step
                    self.scheduler.requeue(deferred)
                    self.metrics.ipc_codes_deferred.inc(len(deferred))
                    if not done:
                        await asyncio.sleep(_DEFERRED_RETRY_S)
                wrote_regions = any(job.audio_out is not None for job in done)  # (completing a job clears it)
                for job, audio in zip(done, audios):
                    self.sessions.complete_job(job, audio)
                if wrote_regions:  # the step may still be running: the replies leave now, and the next batch
                    # forms in the queue until the device is done
                    self._flush()
                    await self._device_done()
                self.metrics.step_seconds.labels(mode=mode).observe(time.monotonic() - now)
            finally:
                self._busy = False
            self.metrics.queue_depth.set(len(self.scheduler))  # counted after the launch: off the latency path
            for job in batch:
                self.metrics.batch_wait.observe(now - job.arrived_s)
            self.metrics.batch_size.labels(mode=mode).observe(len(batch))
            self.sessions.release_in_flight(batch)
            self._flush()
            self._poll_until = time.monotonic() + self._busy_poll_s

    async def _poll(self, done, until_s: float) -> None:
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

    async def _device_done(self) -> None:
        """Wait for the work queued on the engine stream so far: polled with busy polling, else in the worker."""
        finished = torch.cuda.Event()
        finished.record()
        if self._busy_poll_s:
            await self._poll(finished.query, float("inf"))
        else:
            await asyncio.get_running_loop().run_in_executor(self._pool, finished.synchronize)

    def _batch_ready(self) -> bool:
        return self.scheduler.seconds_until_ready(time.monotonic()) == 0

    def _step_on_loop(self, batch: list) -> bool:
        """Policy: run on the loop thread a step that does not wait for the device (every chunk's audio goes
        to a client region), unless a region is being opened or closed in the worker thread meanwhile, or the
        step's graph is still to be captured (that holds the thread for up to seconds: receiving and heartbeats
        would stop; the worker thread captures it)."""
        if self._ops_running or not all(job.audio_out is not None for job in batch):
            return False
        if not self.engine.captures_on_demand:  # the default (graphs captured at start): nothing to foresee
            return True
        frames = [job.decoded_frames for job in batch]
        return not self.engine.graph_choice(batch[0].stream.mode, frames).needs_capture

    def _engine_step(self, batch: list, incomplete: list, on_loop: bool = False) -> tuple[list, list, list, list]:
        """Worker thread (or the loop thread, see ``_step_on_loop``): read CUDA IPC codes (not those behind the
        codes events in ``incomplete``), decode, write CUDA IPC audio. Returns the decoded jobs, their audio,
        ``(job, code, message)`` for jobs refused before decoding (their state is untouched), and jobs whose
        client-side codes are not ready yet. On the loop thread it never captures a graph (chunks put back or
        refused can leave a smaller batch than the policy saw)."""
        refused, deferred = load_codes(batch, self.model.codebook_size, time.monotonic(),
                                       self.cfg.codes_event_timeout_s, incomplete)
        skipped = {id(job) for job, _, _ in refused} | {id(job) for job in deferred}
        done = [job for job in batch if id(job) not in skipped]
        if not done:
            return done, [], refused, deferred
        audios = self.engine.decode(self.sessions.build_items(done), may_capture=not on_loop)
        num_out = sum(job.audio_out is not None for job in done)
        if num_out:
            audios = store_audio(done, audios)
            self.metrics.ipc_chunks.labels(direction="audio_out").inc(num_out)
        num_in = sum(job.ipc_codes is not None for job in done)
        if num_in:
            self.metrics.ipc_chunks.labels(direction="codes_in").inc(num_in)
        return done, audios, refused, deferred

    async def _run_device_ops(self) -> None:
        """Open and close client regions on the engine thread, between steps, in arrival order."""
        regions = self.sessions.regions
        loop = asyncio.get_running_loop()
        try:  # _flush set _ops_running when it started this task
            while regions.device_ops:
                op = regions.device_ops.pop(0)
                await loop.run_in_executor(self._pool, regions.run_op, op)
                regions.op_done(op)
                self._flush()
        finally:
            self._ops_running = False

    async def _reap_loop(self) -> None:
        assert self.sessions is not None
        interval_s = min(1.0, self.cfg.streams.ttl_s / 4)
        while True:
            await asyncio.sleep(interval_s)
            self.sessions.reap(time.monotonic())
            self._flush()

    def _flush(self) -> None:
        assert self.transport is not None and self.sessions is not None
        outbox, self.sessions.outbox = self.sessions.outbox, []
        for out in outbox:
            self.transport.send(out.identity, out.message, out.buffers)
        if outbox and self.transport.readable():  # sending may have consumed the descriptor's signal
            asyncio.get_running_loop().call_soon(self._on_readable)
        if self.sessions.regions.device_ops and not self._ops_running:
            self._ops_running = True
            asyncio.get_running_loop().create_task(self._run_device_ops(), name="region-ops")


def install_uvloop() -> str:
    try:
        import uvloop  # noqa: PLC0415
    except ImportError:
        return "asyncio"
    asyncio.set_event_loop_policy(uvloop.EventLoopPolicy())
    return "uvloop"


async def run_server(cfg: ServerConfig, on_ready=None) -> int:
    server = Server(cfg)
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, server.stop)
    await server.start()
    if on_ready is not None:
        on_ready(server)
    await server.serve()
    return 0

