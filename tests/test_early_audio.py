"""Early audio (proto/README.md section 5): a CUDA IPC chunk answered at its step's launch, its outcome read after.

CPU tests: the sessions' rules driven sans-IO (a chunk answered early, then committed or refused; what its stream's
later chunks and a finish are told), and the client's handling of ``failed_seq`` against the fake ROUTER peer of
``test_client_unit`` (a real ZeroMQ socket). The audio itself, zeroed on the GPU for a refused chunk, and the whole
path through a real sidecar are ``tests/test_cuda_ipc.py``'s (CUDA).
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch
from prometheus_client import CollectorRegistry

from code2wav import proto
from code2wav.client import InvalidArgument, OutOfOrder, SidecarClient
from code2wav.client.ledger import StreamLedger
from code2wav.proto import ErrorCode
from code2wav.sidecar.jobs import IpcAudioOut
from code2wav.sidecar.metrics import Metrics
from test_client_unit import U, FakeSidecar, expected_audio, make_codes
from test_sessions import CLIENT, _send, new_sessions

@pytest.fixture
def tiny(tiny_model):
    return tiny_model


@pytest.fixture
def sessions(tiny):
    registry = CollectorRegistry()
    sessions = new_sessions(tiny, Metrics(registry))
    sessions.registry = registry
    (welcome,) = _send(sessions, proto.Hello(request_id=1, version=proto.PROTOCOL_VERSION, client_id="a"))
    assert welcome.capabilities["early_audio"] is True
    return sessions


def _decode(sessions, stream_id: str, seq: int, num_frames: int = 3, final: bool = False,
            request_id: int = 9) -> list:
    codes = torch.zeros((sessions.streams.model.num_channels, num_frames), dtype=torch.long)  # [Q, n]
    desc = proto.TensorDesc("int64", tuple(codes.shape), proto.InlineLoc(1))
    chunk = proto.Chunk(stream_id=stream_id, seq=seq, codes=desc, final=final)
    return _send(sessions, proto.Decode(request_id=request_id, chunks=(chunk,)), [codes.numpy().tobytes()])


def _as_region_audio(job, num_samples: int) -> None:
    """Make a queued chunk's audio go to a client region, as a CUDA IPC chunk's does (a stand-in region: the
    sessions only count its uses; the device copy is the stepper's, tested on CUDA)."""
    region = SimpleNamespace(uses=1, closing=False)
    loc = proto.CudaIpcLoc(region_id=1, offset=0, nbytes=4 * num_samples)
    job.audio_out = IpcAudioOut(region=region, view=torch.zeros(num_samples),  # [num_samples]
                                desc=proto.TensorDesc("float32", (num_samples,), loc))
    job.audio_event = 0


def _open_early(sessions, stream_id: str = "s") -> Any:
    (opened,) = _send(sessions, proto.OpenStream(request_id=2, stream_id=stream_id, early_audio=True))
    assert isinstance(opened, proto.Opened)
    return sessions.streams.get(CLIENT, stream_id)


def _take_early(sessions) -> Any:
    (job,) = sessions.scheduler.take_batch()
    _as_region_audio(job, job.num_frames * sessions.streams.model.samples_per_frame)
    assert sessions.chunks.answers_early(job)
    sessions.chunks.answer_early(job)
    return job


def _refused_late(sessions, code: ErrorCode, message: str) -> Any:
    """Stream "s"'s chunk seq 0 answered early (its reply taken), then refused by its step."""
    _decode(sessions, "s", 0)
    job = _take_early(sessions)
    sessions.out.take()
    sessions.chunks.fail(job, code, message)
    return job


def _metric(sessions, name: str) -> float:
    return sessions.registry.get_sample_value(f"code2wav_sidecar_{name}_total") or 0.0


def test_an_early_answer_leaves_before_the_outcome_and_the_commit_follows_it(sessions, tiny):
    stream = _open_early(sessions)
    assert _decode(sessions, "s", 0) == []
    job = _take_early(sessions)
    (reply,) = [out.message for out in sessions.out.take()]  # answered at launch
    (result,) = reply.results
    assert result.error is None and isinstance(result.audio.loc, proto.CudaIpcLoc) and result.audio_event == 0
    assert result.num_frames == 3 and (stream.committed_seq, stream.next_seq) == (-1, 1)  # not committed yet
    kept = torch.arange(3 * tiny.samples_per_frame, dtype=torch.float32)  # the host copy kept for a resend
    sessions.chunks.complete(job, kept)
    assert sessions.out.take() == []  # answered once only
    assert (stream.committed_seq, stream.next_seq, stream.num_pending) == (0, 1, 0)
    assert torch.equal(stream.last_audio, kept) and _metric(sessions, "chunks_answered_early") == 1
    assert _metric(sessions, "chunks_refused_after_early_audio") == 0


def test_a_chunk_refused_after_its_early_answer_refuses_the_streams_later_chunks_until_it_comes_again(sessions,
                                                                                                      tiny):
    stream = _open_early(sessions)
    _decode(sessions, "s", 0)
    first = _take_early(sessions)
    sessions.chunks.complete(first, torch.zeros(3 * tiny.samples_per_frame))
    sessions.out.take()
    _decode(sessions, "s", 1)
    job = _take_early(sessions)
    sessions.out.take()  # seq 1 answered with audio
    assert _decode(sessions, "s", 2, request_id=10) == []  # sent while seq 1's outcome is unknown: queued
    sessions.chunks.fail(job, ErrorCode.INVALID_ARGUMENT, "codes out of range")
    (reply,) = [out.message for out in sessions.out.take()]  # only seq 2's: seq 1 was answered already
    error = reply.results[0].error
    assert reply.request_id == 10 and reply.results[0].seq == 2
    assert (error.code, error.failed_seq) == (ErrorCode.INVALID_ARGUMENT, 1)
    assert "seq 1" in error.message and "codes out of range" in error.message and "send seq 1 again" in error.message
    assert (stream.committed_seq, stream.next_seq, stream.late_failure.seq) == (0, 1, 1)
    assert len(sessions.scheduler) == 0 and stream.num_pending == 0
    # sent after the failure: refused the same way; a resend of the last committed seq is answered as before
    (late,) = _decode(sessions, "s", 3, request_id=11)
    assert (late.results[0].error.code, late.results[0].error.failed_seq) == (ErrorCode.INVALID_ARGUMENT, 1)
    (resent,) = _decode(sessions, "s", 0, request_id=12)
    assert resent.results[0].error is None and resent.results[0].seq == 0
    # seq 1 again clears the failure
    assert _decode(sessions, "s", 1, request_id=13) == [] and stream.late_failure is None
    assert _metric(sessions, "chunks_refused_after_early_audio") == 1


def test_a_finish_is_refused_while_a_late_failure_stands_and_the_stream_stays_open(sessions, tiny):
    stream = _open_early(sessions)
    _decode(sessions, "s", 0)
    job = _take_early(sessions)
    sessions.out.take()
    assert _send(sessions, proto.Finish(request_id=20, stream_id="s")) == []  # waits for seq 0's outcome
    sessions.chunks.fail(job, ErrorCode.INTERNAL, "audio not finite")
    (error,) = [out.message for out in sessions.out.take()]
    assert isinstance(error, proto.Error) and error.request_id == 20
    assert (error.code, error.failed_seq) == (ErrorCode.INTERNAL, 0) and "send seq 0 again" in error.message
    assert not stream.closed and stream.closing is None and sessions.streams.get(CLIENT, "s") is stream
    (again,) = _send(sessions, proto.Finish(request_id=21, stream_id="s"))  # nothing pending: refused at once
    assert isinstance(again, proto.Error) and again.failed_seq == 0 and not stream.closed
    _decode(sessions, "s", 0)
    (job,) = sessions.scheduler.take_batch()
    sessions.chunks.complete(job, torch.zeros(3 * tiny.samples_per_frame))
    sessions.out.take()
    (finished,) = _send(sessions, proto.Finish(request_id=22, stream_id="s"))
    assert isinstance(finished, proto.Finished) and stream.closed


def test_a_finish_waiting_behind_a_final_chunk_is_answered_when_an_earlier_chunk_is_refused_late(sessions, tiny):
    stream = _open_early(sessions)
    _decode(sessions, "s", 0)
    job = _take_early(sessions)
    sessions.out.take()
    assert _decode(sessions, "s", 1, final=True, request_id=10) == []  # queued behind seq 0
    assert _send(sessions, proto.Finish(request_id=20, stream_id="s")) == []  # waits too
    sessions.chunks.fail(job, ErrorCode.INTERNAL, "audio not finite")
    replies = {out.message.request_id: out.message for out in sessions.out.take()}
    assert replies[10].results[0].error.failed_seq == 0  # the final chunk
    assert isinstance(replies[20], proto.Error) and replies[20].failed_seq == 0  # the finish: answered, not lost
    assert not stream.closed and stream.closing is None and not stream.finish_waiters


def test_a_late_failure_is_told_before_a_draining_sidecars_refusal(sessions, tiny):
    _open_early(sessions)
    _refused_late(sessions, ErrorCode.INVALID_ARGUMENT, "codes out of range")
    sessions.drain()
    sessions.out.take()
    (reply,) = _decode(sessions, "s", 1, request_id=10)
    assert (reply.results[0].error.code, reply.results[0].error.failed_seq) == (ErrorCode.INVALID_ARGUMENT, 0)
    (again,) = _decode(sessions, "s", 0, request_id=11)  # the refused seq itself: the drain's answer
    assert again.results[0].error.code == ErrorCode.UNAVAILABLE


def test_a_finish_waiting_behind_a_failed_final_chunk_closes_the_stream(sessions, tiny):
    """Without early audio: the final chunk's refusal is told in its own result; the finish sent after it closes
    the stream (it waited for the stream's queued chunks, and none is left), where before it was never answered."""
    (opened,) = _send(sessions, proto.OpenStream(request_id=2, stream_id="plain"))
    _decode(sessions, "plain", 0, final=True)
    assert _send(sessions, proto.Finish(request_id=20, stream_id="plain")) == []
    (job,) = sessions.scheduler.take_batch()
    sessions.chunks.fail(job, ErrorCode.INVALID_ARGUMENT, "codes out of range")
    replies = {out.message.request_id: out.message for out in sessions.out.take()}
    assert replies[9].results[0].error.code == ErrorCode.INVALID_ARGUMENT
    assert isinstance(replies[20], proto.Finished) and sessions.streams.get(CLIENT, "plain") is None


def test_a_refusal_known_before_the_reply_leaves_is_told_in_it(sessions, tiny):
    """A message of two streams' chunks: the early one is answered at launch, but the reply waits for the other;
    its step refuses it before that, so the reply carries the error itself and the stream keeps no late failure."""
    stream = _open_early(sessions, "early")
    (opened,) = _send(sessions, proto.OpenStream(request_id=3, stream_id="plain"))
    codes = torch.zeros((tiny.num_channels, 3), dtype=torch.long)  # [Q, n]
    desc = proto.TensorDesc("int64", tuple(codes.shape), proto.InlineLoc(1))
    chunks = (proto.Chunk(stream_id="early", seq=0, codes=desc), proto.Chunk(stream_id="plain", seq=0, codes=desc))
    assert _send(sessions, proto.Decode(request_id=9, chunks=chunks), [codes.numpy().tobytes()]) == []
    early, plain = sessions.scheduler.take_batch()
    _as_region_audio(early, 3 * tiny.samples_per_frame)
    sessions.chunks.answer_early(early)
    assert sessions.out.take() == []  # the reply waits for the plain chunk
    sessions.chunks.fail(early, ErrorCode.INVALID_ARGUMENT, "codes out of range")
    sessions.chunks.complete(plain, torch.zeros(3 * tiny.samples_per_frame))
    (reply,) = [out.message for out in sessions.out.take()]
    assert reply.results[0].error.code == ErrorCode.INVALID_ARGUMENT and reply.results[0].error.failed_seq is None
    assert reply.results[0].error.message == "codes out of range" and reply.results[1].error is None
    assert stream.late_failure is None and (stream.next_seq, stream.committed_seq) == (0, -1)
    assert _metric(sessions, "chunks_refused_after_early_audio") == 0
    assert _metric(sessions, "chunks_answered_early") == 0  # its reply left after the outcome


def test_only_region_audio_of_an_early_stream_that_is_not_final_is_answered_early(sessions, tiny):
    stream = _open_early(sessions, "early")
    (opened,) = _send(sessions, proto.OpenStream(request_id=3, stream_id="plain"))
    assert isinstance(opened, proto.Opened)
    _decode(sessions, "early", 0)
    (job,) = sessions.scheduler.take_batch()
    assert not sessions.chunks.answers_early(job)  # host audio: answered with its outcome
    _as_region_audio(job, 3 * tiny.samples_per_frame)
    assert sessions.chunks.answers_early(job)
    job.final = True
    assert not sessions.chunks.answers_early(job)  # a final chunk: nothing after it could tell a refusal
    _decode(sessions, "plain", 0)
    (plain,) = sessions.scheduler.take_batch()
    _as_region_audio(plain, 3 * tiny.samples_per_frame)
    assert not sessions.chunks.answers_early(plain) and stream.early_audio
    # a repeated open must repeat early_audio too
    (repeat,) = _send(sessions, proto.OpenStream(request_id=4, stream_id="plain", early_audio=True))
    assert isinstance(repeat, proto.Error) and repeat.code == ErrorCode.ALREADY_EXISTS


def test_a_stream_with_a_late_failure_at_seq_0_is_not_opened_again(sessions, tiny):
    _open_early(sessions)
    _refused_late(sessions, ErrorCode.INTERNAL, "audio not finite")
    (repeat,) = _send(sessions, proto.OpenStream(request_id=5, stream_id="s", early_audio=True))
    assert isinstance(repeat, proto.Error) and repeat.code == ErrorCode.ALREADY_EXISTS


def test_a_plain_failure_still_answers_the_chunk_and_out_of_order_for_the_rest(sessions, tiny):
    _open_early(sessions)
    _decode(sessions, "s", 0)
    _decode(sessions, "s", 1, request_id=10)
    job = sessions.scheduler.take_batch()[0]  # seq 0 (host audio): not answered early
    sessions.chunks.fail(job, ErrorCode.INVALID_ARGUMENT, "bad codes")  # told directly
    replies = {out.message.request_id: out.message for out in sessions.out.take()}
    assert replies[9].results[0].error.code == ErrorCode.INVALID_ARGUMENT
    assert replies[9].results[0].error.failed_seq is None
    assert replies[10].results[0].error.code == ErrorCode.OUT_OF_ORDER  # seq 1, queued behind it
    assert sessions.streams.get(CLIENT, "s").late_failure is None


# ----------------------------------------------------------------------------- the client


def test_a_stale_failed_seq_does_not_rewind_a_stream_that_went_on():
    """Two chunks after a refused early one are told its failure in two replies; the first rewinds the stream, the
    caller sends the refused seq again and it is committed; the second reply (a message that waited for another
    stream's chunk) comes after that and must change nothing: rewinding again would send the next chunk with a seq
    the sidecar answers as a resend, its codes dropped."""
    ledger = StreamLedger("s", lambda: False)
    ledger.chunk_ok(ledger.reserve("c0", False, 0))
    ledger.chunk_ok(ledger.reserve("c1", False, 0))  # answered early, refused after its reply
    in_batch, alone = ledger.reserve("c2", False, 0), ledger.reserve("c3", False, 0)
    ledger.rewind(1, alone)  # alone's error came first
    ledger.chunk_failed(alone, "rejected")
    assert ledger.next_seq == 1
    again = ledger.reserve("c1 again", False, 0, seq=1)
    assert again.seq == 1
    ledger.chunk_ok(again)
    ledger.rewind(1, in_batch)  # the stale one
    ledger.chunk_failed(in_batch, "rejected")
    assert ledger.next_seq == 2 and ledger.reserve("c2 again", False, 0).seq == 2


# ----------------------------------------------------------------------------- the client, against the fake peer


@pytest.fixture()
def fake(tmp_path: Any) -> Any:
    server = FakeSidecar(f"ipc://{tmp_path}/sidecar.sock")
    server.capabilities = {"cuda_ipc": False, "early_audio": True}
    yield server
    server.stop()


def test_the_client_opens_early_streams_only_where_the_sidecar_offers_them(tmp_path: Any) -> None:
    server = FakeSidecar(f"ipc://{tmp_path}/old.sock")  # a sidecar without the capability
    try:
        with SidecarClient(server.address, timeout_s=5) as client:
            with pytest.raises(InvalidArgument, match="early audio"):
                client.open_stream("s", early_audio=True)
            client.open_stream("s")
            assert not any(isinstance(m, proto.OpenStream) and m.early_audio for m in server.received)
    finally:
        server.stop()


def test_a_late_refusal_rewinds_the_stream_to_the_refused_seq(fake: FakeSidecar) -> None:
    with SidecarClient(fake.address, timeout_s=5) as client:
        stream = client.open_stream("s", early_audio=True)
        assert [m.early_audio for m in fake.received if isinstance(m, proto.OpenStream)] == [True]
        codes = [make_codes(2, start=10 * i) for i in range(4)]
        assert torch.equal(stream.decode(codes[0]), expected_audio(codes[0]))
        fake.late_fail["s"] = 1
        assert torch.equal(stream.decode(codes[1]), torch.zeros(2 * U))  # answered, refused after its reply
        assert stream.next_seq == 2
        with pytest.raises(Exception) as info:
            stream.decode(codes[2])
        assert info.value.code == ErrorCode.INTERNAL and info.value.failed_seq == 1 and "seq 1" in str(info.value)
        assert stream.next_seq == 1
        with pytest.raises(InvalidArgument, match="no chunk to resend"):
            stream.resend()  # the refused chunk is never replayed as if acknowledged
        with pytest.raises(OutOfOrder, match=r"seq=1 .* send seq 1 again first, naming it"):
            stream.decode(codes[3])  # a chunk meant to follow seq 2 must not silently take seq 1
        with pytest.raises(OutOfOrder, match="send seq 1 again first"):
            stream.decode(codes[2], seq=2)  # naming another seq does not do either
        assert torch.equal(stream.decode(codes[1], seq=1), expected_audio(codes[1]))  # seq 1 again, then on
        with pytest.raises(OutOfOrder, match="takes seq 2 next, not 5"):
            stream.decode(codes[2], seq=5)
        assert torch.equal(stream.decode(codes[2]), expected_audio(codes[2]))
        assert [m.chunks[0].seq for m in fake.received if isinstance(m, proto.Decode)] == [0, 1, 2, 1, 2]


def test_chunks_pipelined_past_a_late_refusal_are_dropped_from_the_ledger(fake: FakeSidecar) -> None:
    """Seqs 1-3 in flight (3 final); 2's reply tells that 1 was refused after its early answer. The stream takes
    seq 1 next, named, at once: 3, final and still unanswered, no longer holds it back."""
    fake.reply_delay_s["p"] = 0.0
    with SidecarClient(fake.address, timeout_s=5) as client:
        stream = client.open_stream("p", early_audio=True)
        codes = [make_codes(2, start=10 * i) for i in range(4)]
        stream.decode(codes[0])
        fake.late_fail["p"] = 1
        futures = [stream.submit(codes[1]), stream.submit(codes[2]), stream.submit(codes[3], final=True)]
        assert torch.equal(futures[0].result(timeout=5), torch.zeros(2 * U))
        for future in futures[1:]:
            assert future.exception(timeout=5).failed_seq == 1
        assert torch.equal(stream.decode(codes[1], seq=1), expected_audio(codes[1]))
        assert torch.equal(stream.decode(codes[2], seq=2), expected_audio(codes[2]))


def test_a_finish_refused_by_a_late_failure_rewinds_and_the_stream_goes_on(fake: FakeSidecar) -> None:
    with SidecarClient(fake.address, timeout_s=5) as client:
        stream = client.open_stream("s", early_audio=True)
        codes = make_codes(3)
        fake.late_fail["s"] = 0
        stream.decode(codes)
        with pytest.raises(Exception) as info:
            stream.finish()
        assert info.value.failed_seq == 0 and not stream.closed and stream.next_seq == 0
        assert np.array_equal(stream.decode(codes, seq=0).numpy(), expected_audio(codes).numpy())
        stream.finish()
        assert stream.closed
