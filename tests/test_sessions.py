"""The sessions are sans-IO: frames in, messages out. Their message table covers the protocol, and the parts behind
it (clients, streams, chunks) keep their rules when driven without a socket (the end-to-end behaviour through a real
server is tests/test_server_e2e.py's)."""

from __future__ import annotations

import typing

import pytest
import torch
from prometheus_client import CollectorRegistry

from code2wav import proto
from code2wav.proto import ErrorCode
from code2wav.sidecar.config import ServerConfig
from code2wav.sidecar.jobs import ChunkJob
from code2wav.sidecar.metrics import Metrics
from code2wav.sidecar.models import load_model
from code2wav.sidecar.scheduler import Scheduler, batch_policy
from code2wav.sidecar.sessions import Sessions
from code2wav.sidecar.state_store import StateArena
from conftest import TINY

CLIENT = b"client-a"


@pytest.fixture(scope="module")
def tiny():
    return load_model(str(TINY), torch.device("cpu"), "float32")


def new_sessions(model, metrics: Metrics) -> Sessions:
    """Sessions of ``model`` with two arena slots, a batch of 8 at most and a clock stopped at 100 s."""
    arena = StateArena(model.state_layout(), 2, model.dtype, model.device)
    return Sessions(ServerConfig(), model, arena, Scheduler(batch_policy(8, 0, 16)), metrics, clock=lambda: 100.0)


@pytest.fixture
def sessions(tiny):
    return new_sessions(tiny, Metrics(CollectorRegistry()))


def _send(sessions: Sessions, msg, buffers=()) -> list:
    sessions.on_message(CLIENT, proto.encode(msg, buffers))
    return [out.message for out in sessions.out.take()]


def _decode(stream_id: str, seq: int, codes: torch.Tensor, request_id: int = 9) -> tuple:
    desc = proto.TensorDesc("int64", tuple(codes.shape), proto.InlineLoc(1))
    chunk = proto.Chunk(stream_id=stream_id, seq=seq, codes=desc)
    return proto.Decode(request_id=request_id, chunks=(chunk,)), [codes.numpy().tobytes()]


def test_the_message_table_handles_every_client_message(sessions):
    assert set(typing.get_args(proto.ClientMessage)) == set(proto.CLIENT_MESSAGES)
    assert set(proto.CLIENT_MESSAGES) == set(sessions.handlers) | {proto.Hello}  # hello opens a session, before it


def test_a_session_starts_with_hello_and_a_stream_takes_chunks_in_seq_order(sessions, tiny):
    (error,) = _send(sessions, proto.Ping(request_id=1))
    assert isinstance(error, proto.Error) and error.code == ErrorCode.INVALID_ARGUMENT and "hello" in error.message
    (welcome,) = _send(sessions, proto.Hello(request_id=2, version=proto.PROTOCOL_VERSION, client_id="a"))
    assert welcome.models[0].samples_per_frame == tiny.samples_per_frame and welcome.session_secret
    (pong,) = _send(sessions, proto.Ping(request_id=3))
    idle = proto.Load(open_streams=0, free_slots=sessions.streams.arena.num_slots, queued_chunks=0, step_s=0.0,
                      draining=False)
    assert pong == proto.Pong(request_id=3, boot_epoch=welcome.boot_epoch, load=idle)
    assert welcome.load == idle and welcome.capabilities["load"] == proto.LOAD_VERSION
    (opened,) = _send(sessions, proto.OpenStream(request_id=4, stream_id="s"))
    assert (opened.mode, opened.samples_per_frame) == ("exact", tiny.samples_per_frame)
    codes = torch.zeros((tiny.num_channels, 3), dtype=torch.long)
    assert _send(sessions, *_decode("s", 0, codes)) == []  # queued: the reply waits for the engine
    (reply,) = _send(sessions, *_decode("s", 5, codes, request_id=10))  # not the next seq
    assert reply.results[0].error.code == ErrorCode.OUT_OF_ORDER and "expected seq 1" in reply.results[0].error.message
    (job,) = sessions.scheduler.take_batch()
    assert isinstance(job, ChunkJob) and job.decoded_frames == 3 and sessions.streams.pending_by_client == {CLIENT: 1}
    sessions.chunks.complete(job, torch.ones(3 * tiny.samples_per_frame))
    (result,) = [out.message for out in sessions.out.take()]
    assert result.results[0].num_frames == 3 and result.results[0].audio.numel == 3 * tiny.samples_per_frame
    stream = sessions.streams.get(CLIENT, "s")
    assert (stream.committed_seq, stream.next_seq, stream.num_pending) == (0, 1, 0)
    assert sessions.streams.pending_by_client == {}


def test_a_failed_chunk_rolls_its_stream_back_and_fails_the_chunks_after_it(sessions, tiny):
    _send(sessions, proto.Hello(request_id=1, version=proto.PROTOCOL_VERSION, client_id="a"))
    _send(sessions, proto.OpenStream(request_id=2, stream_id="s"))
    codes = torch.zeros((tiny.num_channels, 2), dtype=torch.long)
    for seq in range(3):
        assert _send(sessions, *_decode("s", seq, codes, request_id=10 + seq)) == []
    (first, *_) = sessions.scheduler.take_batch()  # one chunk per stream per batch: seq 0
    sessions.chunks.fail(first, ErrorCode.INTERNAL, "device fault")
    replies = {m.request_id: m.results[0].error for m in (out.message for out in sessions.out.take())}
    assert replies[10].code == ErrorCode.INTERNAL
    assert replies[11].code == replies[12].code == ErrorCode.OUT_OF_ORDER and "resend from seq 0" in replies[11].message
    stream = sessions.streams.get(CLIENT, "s")
    assert (stream.next_seq, stream.committed_seq, stream.num_pending, len(sessions.scheduler)) == (0, -1, 0, 0)


def test_bye_frees_the_clients_streams_and_their_slots(sessions, tiny):
    _send(sessions, proto.Hello(request_id=1, version=proto.PROTOCOL_VERSION, client_id="a"))
    for i in range(2):
        _send(sessions, proto.OpenStream(request_id=2 + i, stream_id=f"s{i}"))
    (busy,) = _send(sessions, proto.OpenStream(request_id=5, stream_id="s2"))  # two slots in this arena
    assert busy.code == ErrorCode.BUSY
    assert sessions.streams.arena.num_used == 2
    assert _send(sessions, proto.Bye(request_id=6)) == []
    assert len(sessions.streams) == 0 and sessions.streams.arena.num_used == 0 and len(sessions.clients) == 0


def test_pong_reports_the_load_the_server_has(sessions, tiny):
    """``pong.load`` counts what is there: streams (window ones too), free slots, queued chunks, draining."""
    _send(sessions, proto.Hello(request_id=1, version=proto.PROTOCOL_VERSION, client_id="a"))
    _send(sessions, proto.OpenStream(request_id=2, stream_id="s"))
    _send(sessions, proto.OpenStream(request_id=3, stream_id="w", mode="window", left_context_frames=25))
    codes = torch.zeros((tiny.num_channels, 3), dtype=torch.long)
    assert _send(sessions, *_decode("s", 0, codes)) == []  # queued
    (pong,) = _send(sessions, proto.Ping(request_id=4))
    assert pong.load == proto.Load(open_streams=2, free_slots=1, queued_chunks=1, step_s=0.0, draining=False)
    sessions.note_step(0.010)
    sessions.note_step(0.020)
    sessions.drain()
    (pong,) = _send(sessions, proto.Ping(request_id=5))
    assert pong.load.step_s == pytest.approx(0.012) and pong.load.draining  # 0.010 + 0.2 * (0.020 - 0.010)
    (error,) = _send(sessions, proto.OpenStream(request_id=6, stream_id="t"))
    assert error.code == ErrorCode.UNAVAILABLE  # what draining: true announces


def test_an_open_at_a_start_frame_sets_its_slot_and_a_reused_slot_starts_from_zero(sessions, tiny):
    _send(sessions, proto.Hello(request_id=1, version=proto.PROTOCOL_VERSION, client_id="a"))
    arena = sessions.streams.arena
    (opened,) = _send(sessions, proto.OpenStream(request_id=2, stream_id="replay", start_frame=37))
    assert isinstance(opened, proto.Opened)
    (stream,) = sessions.streams.streams.values()
    assert int(arena.positions[stream.slot]) == 37 and not arena.flat[stream.slot].any()
    slot = stream.slot
    arena.flat[slot].fill_(1.0)  # state it decoded
    assert _send(sessions, proto.Bye(request_id=3)) == []
    _send(sessions, proto.Hello(request_id=4, version=proto.PROTOCOL_VERSION, client_id="a"))
    _send(sessions, proto.OpenStream(request_id=5, stream_id="fresh"))
    (fresh,) = sessions.streams.streams.values()
    assert fresh.slot == slot  # the slot just freed, zeroed again
    assert int(arena.positions[fresh.slot]) == 0 and not arena.flat[fresh.slot].any()


def test_an_open_sends_nothing_from_the_host_to_the_arena(sessions):
    """Opening a stream zeroes its slot and sets its position with kernels that take the values as arguments: a copy
    from host memory (``positions[slot] = n`` makes one) would wait for the device, on a GPU for a step in flight or
    parked on a doorbell (``sidecar/ipc/watchdog.py``). The ops are recorded below torch's Python layer."""
    from torch.utils._python_dispatch import TorchDispatchMode

    class _Ops(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.names: list[str] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.names.append(str(func))
            return func(*args, **(kwargs or {}))

    _send(sessions, proto.Hello(request_id=1, version=proto.PROTOCOL_VERSION, client_id="a"))
    with _Ops() as ops:
        (opened,) = _send(sessions, proto.OpenStream(request_id=2, stream_id="replay", start_frame=37))
    assert isinstance(opened, proto.Opened)
    assert {"aten.zero_.default", "aten.fill_.Scalar"} <= set(ops.names)
    moved = [name for name in ops.names if "copy" in name or "lift" in name or name in
             ("aten.fill_.Tensor", "aten.index_put_.default", "aten._local_scalar_dense.default")]
    assert moved == [], ops.names
