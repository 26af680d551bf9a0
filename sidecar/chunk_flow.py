"""A chunk's way through the sessions (sans-IO): accepted from a ``decode`` message into the scheduler's queue, then
completed (its audio committed and replied) or failed (its stream's state untouched).

Rules (``streams.py`` states them per stream): a chunk must carry the stream's next seq, or repeat the last
committed one (answered again from what the stream kept); its inputs are checked against the model's contract
(``inputs.py``); a chunk that produced audio commits its stream (seq, the mode's kept context, the audio kept for a
resend); a chunk that failed rolls the stream's expected seq back to it, and its later queued chunks fail too,
so the client resends from there. Every problem is a typed error scoped to the chunk.
"""

from __future__ import annotations

from typing import Callable

import torch
from torch import Tensor

from code2wav import proto
from code2wav.proto import ErrorCode

from .chunk_trace import ChunkTrace
from .inputs import read_chunk_inputs
from .ipc.regions import RegionService
from .jobs import ChunkJob
from .metrics import Metrics
from .models import LoadedModel
from .replies import Outbox, PendingReply
from .scheduler import Scheduler
from .stream_table import StreamTable, late_failure_message
from .streams import LateFailure, SeqVerdict, check_seq
from .work import ChunkRejected, DecodeItem


class ChunkFlow:
    def __init__(self, model: LoadedModel, streams: StreamTable, scheduler: Scheduler, regions: RegionService,
                 out: Outbox, metrics: Metrics, max_pending_per_client: int, clock: Callable[[], float],
                 trace: ChunkTrace | None = None) -> None:
        self.model = model
        self.streams = streams
        self.scheduler = scheduler
        self.regions = regions
        self.out = out
        self.metrics = metrics
        self.max_pending_per_client = max_pending_per_client
        self.clock = clock
        self.draining = False  # the server is stopping: new chunks are refused
        self.trace = trace  # the chunks' stage recorder (``trace_chunks``): queued; None: off

    def decode(self, identity: bytes, msg: proto.Decode, frames: list) -> None:
        """A ``decode`` message: each chunk queued, answered again (a resend) or refused; the reply goes out once
        every chunk has an outcome."""
        now = self.clock()
        reply = PendingReply(identity, msg.request_id, len(msg.chunks))
        for index, chunk in enumerate(msg.chunks):
            try:
                self._accept(identity, chunk, index, reply, frames, now)
            except ChunkRejected as exc:
                self.out.reject(reply, index, chunk.stream_id, chunk.seq, exc.code, exc.message, exc.failed_seq)
        self.metrics.queue_depth.set(len(self.scheduler))
        self.out.emit_if_done(reply)

    def _accept(self, identity: bytes, chunk: proto.Chunk, index: int, reply: PendingReply, frames: list,
                now: float) -> None:
        stream = self.streams.get(identity, chunk.stream_id)
        late = None if stream is None or stream.closed else stream.late_failure
        if late is not None and chunk.seq > late.seq:  # an early-answered chunk was refused: told before anything
            raise ChunkRejected(late.code, late_failure_message(stream, late), failed_seq=late.seq)
        if self.draining:
            raise ChunkRejected(ErrorCode.UNAVAILABLE, "the sidecar is shutting down")
        if stream is None or stream.closed:
            raise ChunkRejected(ErrorCode.NOT_FOUND, f"stream '{chunk.stream_id}' is not open")
        if stream.closing is not None:
            raise ChunkRejected(ErrorCode.INVALID_ARGUMENT, f"stream '{chunk.stream_id}' is closing ({stream.closing})")
        verdict, reason = check_seq(stream, chunk.seq)
        if verdict == SeqVerdict.RESEND:
            if stream.last_audio_event is not None:  # its host copy: queued before any later step, so this waits
                stream.last_audio_event.synchronize()  # for that copy only, never behind a step parked on a wait
            return reply.resolve(index, stream.stream_id, chunk.seq, stream.last_audio, stream.last_num_frames)
        if verdict != SeqVerdict.ACCEPT:
            raise ChunkRejected(ErrorCode.OUT_OF_ORDER, reason)
        job = ChunkJob(stream=stream, seq=chunk.seq, codes=None, context_frames=chunk.context_frames,
                       final=chunk.final, arrived_s=now, reply=reply, index=index)
        read_chunk_inputs(self.model, self.regions, identity, job, chunk, frames)
        if chunk.num_frames == 0:  # an empty final chunk: nothing to decode, an empty inline reply
            stream.next_seq += 1
            self.streams.chunk_queued(stream)
            return self.complete(job, torch.zeros(0, dtype=torch.float32))
        queued = self.streams.pending_by_client.get(identity, 0)
        if queued >= self.max_pending_per_client:
            raise ChunkRejected(ErrorCode.BUSY, f"this client has {queued} chunks queued "
                                "(limits.max_pending_chunks_per_client); retry with backoff")
        if not self.scheduler.submit(job):
            raise ChunkRejected(ErrorCode.BUSY, f"{len(self.scheduler)} chunks are queued "
                                "(scheduler.max_pending_chunks); retry with backoff")
        if self.trace is not None:
            self.trace.queued(job, reply)
        for region in job.regions:
            self.regions.acquire(region)
        stream.next_seq += 1
        stream.late_failure = None  # (its seq came again)
        self.streams.chunk_queued(stream)
        stream.last_active_s = now
        if chunk.final:
            stream.closing = "final"

    @staticmethod
    def build_items(batch: list[ChunkJob]) -> list[DecodeItem]:
        """Engine thread (reads stream state that no other thread writes while the chunk is in the engine)."""
        items = [job.stream.mode.build_item(job.stream, job.codes, job.context_frames, job.audio_out is not None)
                 for job in batch]
        for item, job in zip(items, batch):
            if job.ipc_codes is not None and job.ipc_codes.armed is not None:
                item.armed = job.ipc_codes.armed
        return items

    @staticmethod
    def answers_early(job: ChunkJob) -> bool:
        """Whether ``job`` is answered when its step is launched (proto/README.md section 5, early audio): its
        stream asked for it, its audio goes into the client's region, and it is not its stream's last chunk."""
        return job.stream.early_audio and job.audio_out is not None and not job.final

    def answer_early(self, job: ChunkJob) -> None:
        """Resolve ``job``'s place in its reply at its step's launch: its audio's copy into the region and the
        event after it are queued (``job.audio_event``); ``complete`` or ``fail`` follows once the outcome is
        read. The stream's state is not committed here."""
        num_frames = proto.audio_num_frames(job.num_frames, job.context_frames)
        job.answered = True
        job.reply.resolve(job.index, job.stream.stream_id, job.seq, job.audio_out.view, num_frames,
                          (job.audio_out.desc, job.audio_event))
        self.out.emit_if_done(job.reply)
        if job.reply.done:  # it left (a reply that waits for other chunks leaves after the outcome: not early)
            self.metrics.chunks_answered_early.inc()

    def complete(self, job: ChunkJob, audio: Tensor) -> None:
        """The chunk produced ``audio``: commit its stream and resolve its place in the reply (unless it was
        answered early: ``answer_early``)."""
        stream = job.stream
        ipc = None if job.audio_out is None else (job.audio_out.desc, job.audio_event)
        num_frames = proto.audio_num_frames(job.num_frames, job.context_frames)  # frames that produced audio
        self.streams.chunk_done(job)
        if not stream.closed:
            stream.committed_seq = job.seq
            stream.last_audio, stream.last_audio_event = audio, job.kept_event
            stream.last_num_frames = num_frames
            stream.last_active_s = self.clock()
            stream.mode.commit(stream, job.codes)
            series = self.metrics.mode_series(stream.model, stream.mode.name)
            series.chunks.inc()
            series.frames.inc(job.codes.shape[1])
            series.audio_seconds.inc(audio.numel() / self.model.sample_rate_hz)
            series.chunk_latency.observe(self.clock() - job.arrived_s)
        if not job.answered:
            job.reply.resolve(job.index, stream.stream_id, job.seq, audio, num_frames, ipc)
            self.out.emit_if_done(job.reply)
        if job.final or (stream.closing and stream.num_pending == 0):
            self.streams.close(stream, stream.closing or "final")

    def fail(self, job: ChunkJob, code: ErrorCode, message: str) -> None:
        """The chunk produced no audio: its stream keeps the state it had, its later queued chunks fail too. A chunk
        answered early (``answer_early``) is not answered again: its stream records the failure (``LateFailure``),
        and its later chunks and a finish are refused with it until its seq comes again."""
        stream = job.stream
        self.streams.chunk_done(job)
        if job.answered and not job.reply.done:  # its reply waited for other chunks: it tells the refusal itself
            job.reply.unresolve(job.index)
            job.answered = False
        if job.answered:
            self.metrics.chunks_refused_after_early_audio.inc()
            self.metrics.errors.labels(code=code.value).inc()
        if not stream.closed:
            stream.next_seq = job.seq
            if stream.closing == "final":  # a finish sent meanwhile still waits for an answer
                stream.closing = "finish" if stream.finish_waiters else None
            if job.answered:  # the later chunks tell the client: with the chunk's own error and its seq
                stream.late_failure = LateFailure(job.seq, code, message)
                told = (code, late_failure_message(stream, stream.late_failure), job.seq)
            else:
                told = (ErrorCode.OUT_OF_ORDER, f"an earlier chunk (seq {job.seq}) failed; resend from seq {job.seq}",
                        None)
            for later in self.scheduler.remove_stream(stream):
                self.streams.chunk_done(later)
                self.out.reject(later.reply, later.index, stream.stream_id, later.seq, *told)
                self.out.emit_if_done(later.reply)
        if not job.answered:
            self.out.reject(job.reply, job.index, stream.stream_id, job.seq, code, message)
            self.out.emit_if_done(job.reply)
        if stream.closing and stream.num_pending == 0 and not stream.closed:
            if stream.late_failure is not None:  # a finish waits: it is refused, the stream stays open
                self.streams.refuse_finish(stream)
            else:
                self.streams.close(stream, stream.closing)
