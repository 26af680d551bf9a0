"""The stepper: form batches, run them on the engine, reply. One step at a time.

A step whose every chunk writes its audio into a client's CUDA IPC region does not wait for the device (its
replies name events instead), so it is launched from the loop thread itself, with no thread hand-off on the
latency path, and its replies leave at once. After any step that wrote into client regions the stepper waits
for the device to finish it before the next batch is formed, so batches fill while the device works and a
step never starts while the last one still reads its inputs. Any other step waits for the device (audio copied
to the host), so it runs in the worker thread, and receiving and replying go on meanwhile. No step runs on the
loop thread while a region is being opened or closed in the worker.

With busy polling the stepper polls (through ``LoopIO.poll``) instead of sleeping while traffic flows, after a
CUDA IPC step it polls the device's completion the same way, and a batch whose CUDA IPC codes events are not
all complete yet polls them for a moment (``CODES_GRACE_S``) before it puts those chunks back for the next step.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import logging
import time
from typing import Callable, Protocol

import torch

from code2wav.proto import ErrorCode

from .engine import Engine
from .ipc.io import drop_complete, incomplete_codes_events, load_codes, store_audio
from .metrics import Metrics
from .scheduler import Scheduler
from .sessions import Sessions
from .step_plan import StepPlan

log = logging.getLogger(__name__)

DEFERRED_RETRY_S = 0.0002
"""Pause before retrying a step whose only chunks were waiting for their clients' codes."""
CODES_GRACE_S = 0.0002
"""With busy polling: how long a batch waits for codes events still incomplete before those chunks are put back
(a chunk put back waits a whole step). The copy behind such an event was usually queued on the client's context
while the sidecar's step held the GPU, and runs as soon as that step ends, within microseconds."""


NOT_FINITE_MESSAGE = ("the decoder's audio or new state for seq {seq} is not finite (overflow): the chunk was not "
                      "committed and the stream continues from its last good state; send seq {seq} again with "
                      "other inputs")


class LoopIO(Protocol):
    """What the stepper needs from the socket loop (``server.Server``)."""

    busy_poll_s: float  # 0: never busy-poll
    poll_until: float  # monotonic: poll instead of sleeping until then
    region_ops_running: bool  # a region is being opened or closed in the worker thread

    async def poll(self, done: Callable[[], bool], until_s: float) -> None: ...
    def flush(self) -> None: ...
    async def wait_for_work(self, timeout_s: float | None) -> None: ...


class Stepper:
    def __init__(self, engine: Engine, sessions: Sessions, scheduler: Scheduler, metrics: Metrics,
                 pool: concurrent.futures.Executor, io: LoopIO, codes_event_timeout_s: float) -> None:
        self.engine = engine
        self.sessions = sessions
        self.scheduler = scheduler
        self.metrics = metrics
        self.pool = pool
        self.io = io
        self.codes_event_timeout_s = codes_event_timeout_s
        self.busy = False  # a step is in flight

    @property
    def idle(self) -> bool:
        """Nothing queued and no step in flight (the server may stop)."""
        return not len(self.scheduler) and not self.busy

    def seconds_until_ready(self, now_s: float) -> float | None:
        """The scheduler's answer, told how many streams could still add a chunk (the open ones)."""
        return self.scheduler.seconds_until_ready(now_s, len(self.sessions.streams))

    def batch_ready(self) -> bool:
        return self.seconds_until_ready(time.monotonic()) == 0

    async def run(self) -> None:
        """The step loop: until cancelled."""
        io = self.io
        while True:
            now = time.monotonic()
            wait_s = self.seconds_until_ready(now)
            if wait_s is None or wait_s > 0:
                if now < io.poll_until:  # traffic flows: poll, and take what arrives on this thread
                    await io.poll(self.batch_ready, io.poll_until if wait_s is None else now + wait_s)
                    continue
                await io.wait_for_work(wait_s)
                continue
            await self.step(self.scheduler.take_batch())

    async def step(self, batch: list) -> None:
        """Plan the batch once (``step_plan``), run it where the plan allows (the loop thread, or the worker), reply."""
        io, chunks, streams = self.io, self.sessions.chunks, self.sessions.streams
        mode = batch[0].stream.mode
        series = self.metrics.mode_series(batch[0].stream.model, mode.name)
        now = time.monotonic()
        self.busy = True  # (chunks of a stream closed meanwhile keep their slot until release_in_flight)
        try:
            plan = self.engine.plan(mode, [job.decoded_frames for job in batch])
            pending = incomplete_codes_events(batch)  # the step's one query per codes event
            if pending and io.busy_poll_s:  # a moment's grace rather than a whole step's delay for them
                await io.poll(lambda: not drop_complete(pending), time.monotonic() + CODES_GRACE_S)
            now = time.monotonic()
            if self.step_on_loop(batch, plan):
                done, audios, refused, deferred = self.engine_step(batch, pending, plan)
            else:
                done, audios, refused, deferred = await asyncio.get_running_loop().run_in_executor(
                    self.pool, self.engine_step, batch, pending, plan)
        except Exception as exc:
            log.exception("engine step failed for a batch of %d %s chunks", len(batch), mode.name)
            for job in batch:
                chunks.fail(job, ErrorCode.INTERNAL, f"decode failed: {type(exc).__name__}: {exc}")
        else:
            for job, code, message in refused:
                chunks.fail(job, code, message)
            if deferred:  # codes still being written by the client: first in line for the next step
                self.scheduler.requeue(deferred)
                self.metrics.ipc_codes_deferred.inc(len(deferred))
                if not done:
                    await asyncio.sleep(DEFERRED_RETRY_S)
            wrote_regions = any(job.audio_out is not None for job in done)  # (completing a job clears it)
            for job, audio in zip(done, audios):
                chunks.complete(job, audio)
            if wrote_regions:  # the step may still be running: the replies leave now, and the next batch
                # forms in the queue until the device is done
                io.flush()
                await self.device_done()
            step_s = time.monotonic() - now
            series.step_seconds.observe(step_s)
            self.sessions.note_step(step_s)
        finally:
            self.busy = False
        self.metrics.queue_depth.set(len(self.scheduler))  # counted after the launch: off the latency path
        for job in batch:
            self.metrics.batch_wait.observe(now - job.arrived_s)
        series.batch_size.observe(len(batch))
        streams.release_in_flight(batch)
        io.flush()
        io.poll_until = time.monotonic() + io.busy_poll_s

    async def device_done(self) -> None:
        """Wait for the work queued on the engine stream so far: polled with busy polling, else in the worker."""
        finished = torch.cuda.Event()
        finished.record()
        if self.io.busy_poll_s:
            await self.io.poll(finished.query, float("inf"))
        else:
            await asyncio.get_running_loop().run_in_executor(self.pool, finished.synchronize)

    def step_on_loop(self, batch: list, plan: StepPlan) -> bool:
        """Policy: run on the loop thread a step that does not wait for the device (every chunk's audio goes
        to a client region), unless a region is being opened or closed in the worker thread meanwhile, or the
        plan captures a graph first (that holds the thread for up to seconds: receiving and heartbeats would stop;
        the worker thread captures it)."""
        return (not self.io.region_ops_running and not plan.capture_first
                and all(job.audio_out is not None for job in batch))

    def engine_step(self, batch: list, incomplete: list, plan: StepPlan) -> tuple[list, list, list, list]:
        """Worker thread (or the loop thread, see ``step_on_loop``): read CUDA IPC inputs (not those behind the
        codes events in ``incomplete``), decode as ``plan`` says, write CUDA IPC audio. Returns the decoded jobs,
        their audio, ``(job, code, message)`` for jobs refused (before decoding, or after it when their audio or new
        state was not finite, which the engine did not commit: their state is untouched), and
        jobs whose client-side inputs are not ready yet. Rows refused or put back leave the plan's bucket with more
        padding: it still holds the rest."""
        refused, deferred = load_codes(batch, self.engine.model.input, time.monotonic(), self.codes_event_timeout_s,
                                       incomplete)
        skipped = {id(job) for job, _, _ in refused} | {id(job) for job in deferred}
        done = [job for job in batch if id(job) not in skipped]
        if not done:
            return done, [], refused, deferred
        audios, committed = self.engine.execute_checked(plan, self.sessions.chunks.build_items(done))
        if not all(committed):  # audio or new state not finite: the stream keeps its last good state
            refused += [(job, ErrorCode.INTERNAL, NOT_FINITE_MESSAGE.format(seq=job.seq))
                        for job, ok in zip(done, committed) if not ok]
            audios = [audio for audio, ok in zip(audios, committed) if ok]
            done = [job for job, ok in zip(done, committed) if ok]
            self.metrics.chunks_not_finite.inc(committed.count(False))
        num_out = sum(job.audio_out is not None for job in done)
        if num_out:
            audios = store_audio(done, audios)
            self.metrics.ipc_audio_out.inc(num_out)
        num_in = sum(job.ipc_codes is not None for job in done)
        if num_in:
            self.metrics.ipc_codes_in.inc(num_in)
        return done, audios, refused, deferred
