"""The stepper: form batches, run them on the engine, reply.

Two kinds of step:

- **Pipelined** (inline bytes both ways, the plan's bucket captured, ``max_steps_in_flight`` > 1: on CUDA): the
  worker thread queues the step on the device and the copies of its audio and outcomes into pinned host memory, and the
  stepper goes on at once: the next batch (of other streams: a stream with a chunk in flight is ``busy`` for the
  scheduler) is staged and queued while this one runs, so the device does not idle between steps while chunks wait.
  A waiter thread waits in the step's completion event (CUDA spins there, without the GIL); the worker then takes
  the rows out and the replies leave. At most ``max_steps_in_flight`` steps (2: the graph routines' staging sets)
  are in flight.
- **Alone** (anything else: CUDA IPC inputs or outputs, one stream's inline chunks, a capture first, eager steps):
  it waits for the steps in flight, then runs by itself, where ``step_placement`` says. A GPU graph replay is
  launched from the loop thread itself, with no thread hand-off on the latency path: CUDA IPC codes copied into its
  inputs on the device and checked there, its host rows' audio and its outcomes copied into pinned memory behind it;
  the loop polls its completion (receiving meanwhile), takes the rows out and queues the CUDA IPC audio into the
  regions, whose replies name events and leave at once; the next batch is formed once the device is done with
  those copies. Chunks of early-audio streams (``ChunkFlow.answers_early``) have their audio queued into their
  regions and their replies sent right after the launch, before the wait; their outcomes are read with the
  others', so no later chunk of theirs is stepped before it. Any other alone step (CUDA IPC codes a window stream keeps, read on the host; an eager step) runs
  in the worker thread, and receiving and replying go on meanwhile.

With busy polling the stepper polls (through ``LoopIO.poll``) instead of sleeping while traffic flows and no step
is in flight (a poll would take the GIL from the worker staging the next step), after a CUDA IPC step it polls the
device's completion the same way, and a batch whose CUDA IPC codes events are not all complete yet polls them for a
moment (``CODES_GRACE_S``) before it puts those chunks back for the next step.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import logging
import time
from typing import Callable, Protocol

import torch

from code2wav.proto import ErrorCode

from .chunk_flow import ChunkFlow
from .chunk_trace import ChunkTrace
from .engine import Engine, LaunchedStep
from .forward import ROW_COMMITTED
from .graphs.routine import STAGING_BUFFERS
from .ipc.io import (count_ipc, disarm_released, drop_complete, incomplete_codes_events, keep_host_copies, load_codes,
                     store_rows, warm_early_kernels, write_regions)
from .ipc.watchdog import DoorbellWatchdog
from .metrics import Metrics
from .scheduler import Scheduler
from .sessions import Sessions
from .step_placement import on_loop, pipelined
from .step_plan import StepPlan
from .step_rows import split_outcomes

log = logging.getLogger(__name__)

DEFERRED_RETRY_S = 0.0002
"""Pause before retrying a step whose only chunks were waiting for their clients' codes."""
CODES_GRACE_S = 0.0002
"""With busy polling: how long a batch waits for codes events still incomplete before those chunks are put back
(a chunk put back waits a whole step). The copy behind such an event was usually queued on the client's context
while the sidecar's step held the GPU, and runs as soon as that step ends, within microseconds."""


class LoopIO(Protocol):
    """What the stepper needs from the socket loop (``server.Server``)."""

    busy_poll_s: float  # 0: never busy-poll
    poll_until: float  # monotonic: poll instead of sleeping until then
    region_ops_running: bool  # a region is being opened or closed in the worker thread
    loop_step_running: bool  # set by the stepper while a step runs on the loop thread: no region op starts then

    async def poll(self, done: Callable[[], bool], until_s: float) -> None: ...
    def flush(self) -> None: ...
    async def wait_for_work(self, timeout_s: float | None) -> None: ...
    def wake(self) -> None: ...


class Stepper:
    def __init__(self, engine: Engine, sessions: Sessions, scheduler: Scheduler, metrics: Metrics,
                 pool: concurrent.futures.Executor, io: LoopIO, codes_event_timeout_s: float,
                 max_steps_in_flight: int = 1, trace: ChunkTrace | None = None, armed_wait_s: float = 0.25) -> None:
        self.engine = engine
        self.sessions = sessions
        self.scheduler = scheduler
        self.metrics = metrics
        self.pool = pool
        self.io = io
        self.codes_event_timeout_s = codes_event_timeout_s
        self.watchdog = DoorbellWatchdog(armed_wait_s)  # releases armed waits after armed_wait_s; starts with ``run``
        self.trace = trace  # the chunks' stage recorder (``trace_chunks``): taken, launched, done; None: off
        if not 1 <= max_steps_in_flight <= STAGING_BUFFERS:  # each step in flight holds a routine's staging set
            raise ValueError(f"max_steps_in_flight must be 1 to {STAGING_BUFFERS}, got {max_steps_in_flight}")
        self.max_steps_in_flight = max_steps_in_flight  # 1: every step alone (the CPU)
        # the device runs a queued step while the launching thread goes on (a GPU); the CPU's eager forward runs on
        # the thread that launches it, so there a step alone of inline chunks stays in the worker
        self.launches_async = engine.device.type == "cuda"
        self._bad_inputs = engine.model.input.device_problem()  # what a row the device check refused held
        self.in_flight = 0  # steps launched and not finished
        self._busy: set[int] = set()  # id(stream) of the streams with a chunk in a step in flight
        self._waiter = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="device-wait") \
            if max_steps_in_flight > 1 else None
        self._tasks: set[asyncio.Task] = set()

    @property
    def idle(self) -> bool:
        """Nothing queued and no step in flight (the server may stop)."""
        return not len(self.scheduler) and not self.in_flight

    def seconds_until_ready(self, now_s: float) -> float | None:
        """The scheduler's answer, told how many streams could still add a chunk (the open ones) and which are
        busy in a step in flight."""
        return self.scheduler.seconds_until_ready(now_s, len(self.sessions.streams), self._busy)

    def batch_ready(self) -> bool:
        return self.seconds_until_ready(time.monotonic()) == 0

    async def run(self) -> None:
        """The step loop: until cancelled."""
        io = self.io
        try:
            if self.launches_async:  # a GPU: armed chunks may come (a thread that cannot start fails here, not later)
                self.watchdog.start()
                warm_early_kernels(self.engine.device)
            while True:
                if self.in_flight >= self.max_steps_in_flight:
                    await io.wait_for_work(None)  # a step finishing wakes it
                    continue
                now = time.monotonic()
                wait_s = self.seconds_until_ready(now)
                if wait_s is None or wait_s > 0:
                    if not self.in_flight and now < io.poll_until:  # traffic flows: poll, take what arrives here
                        await io.poll(self.batch_ready, io.poll_until if wait_s is None else now + wait_s)
                        continue
                    await io.wait_for_work(wait_s)
                    continue
                batch = self.scheduler.take_batch(self._busy)
                if self.trace is not None:
                    self.trace.stamp(batch, "taken_ns")
                try:
                    plan = self.engine.plan(batch[0].stream.mode, [job.decoded_frames for job in batch])
                except Exception as exc:  # a bug must not stop the loop: the batch's chunks get internal errors
                    self._failed(batch, exc)
                    self._after_step(batch, time.monotonic())
                    continue
                if pipelined(batch, plan.capture_first, self.max_steps_in_flight, self.in_flight,
                             len(self.sessions.streams)):
                    self._start(batch, plan)
                elif self.in_flight:  # it runs alone: once the steps in flight are done
                    self.scheduler.requeue(batch)
                    await io.wait_for_work(None)
                else:
                    await self.step(batch, plan)
        finally:
            if self._waiter is not None:
                self._waiter.shutdown(wait=False)
            self.watchdog.close()

    def _start(self, batch: list, plan: StepPlan) -> None:
        if self.in_flight:
            self.metrics.steps_overlapped.inc()
        self.in_flight += 1
        self._busy.update(id(job.stream) for job in batch)
        task = asyncio.get_running_loop().create_task(self._pipelined_step(batch, plan), name="step")
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _pipelined_step(self, batch: list, plan: StepPlan) -> None:
        """Launch on the worker, wait for the device's completion on the waiter thread, take the rows out on the
        worker, reply. The next step may be launched meanwhile."""
        loop = asyncio.get_running_loop()
        now = time.monotonic()
        try:
            launched = await loop.run_in_executor(self.pool, self._launch, batch, plan)
            if not launched.ready():
                await loop.run_in_executor(self._waiter, launched.done.synchronize)
            audios, outcomes = await loop.run_in_executor(self.pool, self._finish, batch, launched)
            done, audios, refused = self._split(batch, audios, outcomes)
        except Exception as exc:
            self._failed(batch, exc)
        else:
            self._settle(done, audios, refused, [])
        finally:
            self.in_flight -= 1
            self._busy.difference_update(id(job.stream) for job in batch)
        self._after_step(batch, now)
        self.io.wake()  # the step loop looks at the queue again: these streams may run, a slot is free

    def _launch(self, batch: list, plan: StepPlan) -> LaunchedStep:
        """Worker thread (a pipelined step) or loop thread (``loop_step``): the batch's items (reading stream state
        no other thread writes while the chunks are in the engine), queued on the device."""
        launched = self.engine.launch(plan, self.sessions.chunks.build_items(batch))
        if self.trace is not None:
            self.trace.stamp(batch, "launched_ns")
        return launched

    def _finish(self, batch: list, launched: LaunchedStep) -> tuple[list, list[int]]:
        """Worker thread (a pipelined step) or loop thread (``loop_step``): the launched step's results, once the
        device is done."""
        results = self.engine.finish(launched)
        if self.trace is not None:
            self.trace.stamp([job for job in batch if not job.answered], "done_ns")  # (early ones: at their reply)
        return results

    async def step(self, batch: list, plan: StepPlan) -> None:
        """A step alone: run it where the plan allows (the loop thread, or the worker), reply."""
        io = self.io
        now = time.monotonic()
        self.in_flight += 1  # (chunks of a stream closed meanwhile keep their slot until release_in_flight)
        disarm_released(batch)
        armed = [job for job in batch if job.ipc_codes is not None and job.ipc_codes.armed is not None]
        watch = None
        try:
            if armed:
                watch = self.watchdog.watch(armed)
                self.metrics.ipc_armed_chunks.inc(len(armed))
            pending = incomplete_codes_events(batch)  # the step's one query per codes event
            if pending and io.busy_poll_s:  # a moment's grace rather than a whole step's delay for them
                await io.poll(lambda: not drop_complete(pending), time.monotonic() + CODES_GRACE_S)
            now = time.monotonic()
            if on_loop(batch, plan.capture_first, plan.bucket is not None, io.region_ops_running,
                       self.launches_async):
                io.loop_step_running = True  # a region op in the worker must not overlap it (step_placement)
                try:
                    done, audios, refused, deferred = await self.loop_step(
                        batch, pending, plan, None if watch is None else functools.partial(watch.stop, release=True))
                finally:
                    io.loop_step_running = False
            else:
                done, audios, refused, deferred = await asyncio.get_running_loop().run_in_executor(
                    self.pool, self.engine_step, batch, pending, plan)
            if watch is not None:  # the outcomes are read: every wait ended
                watch.stop()
                watch = None
        except Exception as exc:
            self._failed(batch, exc)
        else:
            if deferred and not done:
                self._settle(done, audios, refused, deferred)
                await asyncio.sleep(DEFERRED_RETRY_S)
            else:
                wrote_regions = any(job.audio_out is not None for job in done)  # (completing a job clears it)
                self._settle(done, audios, refused, deferred)
                if wrote_regions:  # the audio's copies into the regions may still run: the replies (naming their
                    # events) leave now, and the next batch forms in the queue until the device is done
                    io.flush()
                    await self.device_done()
        finally:
            self.in_flight -= 1
            if watch is not None:  # the step failed or was cancelled: a wait may be queued, never leave it parked
                watch.stop(release=True)
        self._after_step(batch, now)

    def _split(self, batch: list, audios: list, outcomes: list[int]) -> tuple[list, list, list]:
        """``(done, their audio, refused)`` by the rows' outcomes (``step_rows.split_outcomes``)."""
        return split_outcomes(batch, audios, outcomes, self.metrics.chunks_not_finite, self._bad_inputs,
                              self.watchdog.wait_s, self.metrics.ipc_armed_released)

    def _failed(self, batch: list, exc: Exception) -> None:
        log.error("engine step failed for a batch of %d %s chunks", len(batch), batch[0].stream.mode.name,
                  exc_info=exc)
        for job in batch:
            self.sessions.chunks.fail(job, ErrorCode.INTERNAL, f"decode failed: {type(exc).__name__}: {exc}")

    def _settle(self, done: list, audios: list, refused: list, deferred: list) -> None:
        """A step's outcomes into the sessions: refused chunks fail, deferred ones go back first in line, the
        decoded ones complete (their replies queued)."""
        chunks = self.sessions.chunks
        for job, code, message in refused:
            chunks.fail(job, code, message)
        if deferred:  # codes still being written by the client: first in line for the next step
            self.scheduler.requeue(deferred)
            self.metrics.ipc_codes_deferred.inc(len(deferred))
        for job, audio in zip(done, audios):
            chunks.complete(job, audio)

    def _after_step(self, batch: list, started_s: float) -> None:
        """Metrics, slots of streams closed meanwhile, the replies out."""
        series = self.metrics.mode_series(batch[0].stream.model, batch[0].stream.mode.name)
        step_s = time.monotonic() - started_s
        series.step_seconds.observe(step_s)
        self.sessions.note_step(step_s)
        self.metrics.queue_depth.set(len(self.scheduler))  # counted after the launch: off the latency path
        for job in batch:
            self.metrics.batch_wait.observe(started_s - job.arrived_s)
        series.batch_size.observe(len(batch))
        self.sessions.streams.release_in_flight(batch)
        self.io.flush()
        self.io.poll_until = time.monotonic() + self.io.busy_poll_s

    async def device_done(self, finished: torch.cuda.Event | None = None) -> None:
        """Wait for ``finished`` (default: the work queued on the engine stream so far): polled with busy polling,
        else in the worker."""
        if finished is None:
            finished = torch.cuda.Event()
            finished.record(torch.cuda.current_stream(self.engine.device))  # the engine's device (cuda:N)
        if self.io.busy_poll_s:
            await self.io.poll(finished.query, float("inf"))
        else:
            await asyncio.get_running_loop().run_in_executor(self.pool, finished.synchronize)

    async def loop_step(self, batch: list, incomplete: list, plan: StepPlan,
                        release: Callable[[], None] | None = None) -> tuple[list, list, list, list]:
        """Loop thread, on a GPU (``step_placement.on_loop``): queue the step (CUDA IPC inputs copied on the device)
        with the copies of its host rows' audio and its outcomes into pinned memory, wait for its completion event
        without blocking the loop, take the rows out, queue the CUDA IPC audio into the regions. ``engine_step``'s
        results. ``release``: ends the step's armed waits at once (a failure after the launch)."""
        done, refused, deferred = self._load(batch, incomplete)
        if not done:
            return done, [], refused, deferred
        launched = self._launch(done, plan)
        early = [b for b, job in enumerate(done) if ChunkFlow.answers_early(job)]
        try:
            if early:  # answered now, their outcomes read below (proto/README.md section 5, early audio)
                self._answer_early(done, early, launched)
            if not launched.ready():
                await self.device_done(launched.done)
        except Exception:  # the chunks fail (``_failed``): only once the step no longer reads their regions
            if not launched.ready():
                if release is not None:  # its armed waits end now, not after armed_wait_s
                    release()
                await asyncio.get_running_loop().run_in_executor(self.pool, launched.done.synchronize)
            raise
        audios, outcomes = self._finish(done, launched)  # the device is done: no wait
        done, audios, not_committed = self._split(done, audios, outcomes)
        if not early:
            return done, store_rows(done, audios, self.metrics), refused + not_committed, deferred
        count_ipc([job for job in done if job.answered], self.metrics)
        rest = [b for b, job in enumerate(done) if not job.answered]
        stored = store_rows([done[b] for b in rest], [audios[b] for b in rest], self.metrics)
        audios = [job.kept_audio for job in done]  # (early rows: their kept host copy)
        for b, audio in zip(rest, stored):
            audios[b] = audio
        return done, audios, refused + not_committed, deferred

    def _answer_early(self, done: list, early: list[int], launched: LaunchedStep) -> None:
        """The rows ``early`` of a launched step (their streams asked for early audio): their audio queued into
        their regions, a refused row's slot zeroed on the device by its outcome, their replies sent now; then the
        host copies they keep for a resend (off the replies' path)."""
        jobs = [done[b] for b in early]
        views = launched.device_rows(early, self.engine.model.samples_per_frame)  # [n_b * U] each, on the device
        refused = launched.device_outcomes != ROW_COMMITTED  # [rows] bool on the device (no host read)
        write_regions(jobs, views, [refused[b] for b in early])
        if self.trace is not None:
            self.trace.stamp(jobs, "done_ns")  # (their device time shows in the client's audio_ready)
        for job in jobs:
            self.sessions.chunks.answer_early(job)
        self.io.flush()
        for job, kept in zip(jobs, keep_host_copies(jobs, views)):
            job.kept_audio = kept

    def engine_step(self, batch: list, incomplete: list, plan: StepPlan) -> tuple[list, list, list, list]:
        """Worker thread: read CUDA IPC inputs (not those behind the codes events in ``incomplete``), decode as
        ``plan`` says, write CUDA IPC audio. Returns the decoded jobs, their audio, ``(job, code, message)`` for jobs
        refused (before decoding, or by their rows' outcomes: inputs refused by the device check, audio or new state
        not finite; the engine did not commit them, their state is untouched), and jobs whose client-side inputs are
        not ready yet. Rows refused or put back leave the plan's bucket with more padding: it still holds the
        rest."""
        done, refused, deferred = self._load(batch, incomplete)
        if not done:
            return done, [], refused, deferred
        items = self.sessions.chunks.build_items(done)
        trace = self.trace
        audios, outcomes = self.engine.execute_checked(
            plan, items, None if trace is None else lambda: trace.stamp(done, "launched_ns"))
        done, audios, not_committed = self._split(done, audios, outcomes)
        audios = store_rows(done, audios, self.metrics)
        if self.trace is not None:
            self.trace.stamp(done, "done_ns")
        return done, audios, refused + not_committed, deferred

    def _load(self, batch: list, incomplete: list) -> tuple[list, list, list]:
        """``(the jobs to decode, refused, deferred)``: CUDA IPC inputs given to their jobs (``ipc.io.load_codes``)."""
        refused, deferred = load_codes(batch, self.engine.model.input, time.monotonic(), self.codes_event_timeout_s,
                                       incomplete)
        skipped = {id(job) for job, _, _ in refused} | {id(job) for job in deferred}
        return [job for job in batch if id(job) not in skipped], refused, deferred
