"""Client pieces that need no real server, and the client's threading against a fake ROUTER peer.

The fake peer is a real ZeroMQ ROUTER on an ipc:// socket in tmp_path, speaking
proto v1; its "audio" for frame f of a chunk is ``codes[0, f] + 0.25 * j`` for
sample j, so tests can check every value the client returns.
"""

from __future__ import annotations

import asyncio
import pickle
import threading
import time
import warnings
from typing import Any, Sequence

import numpy as np
import pytest
import torch
import zmq

from code2wav.client import (
    Busy,
    DeadlineExceeded,
    Internal,
    InvalidArgument,
    NotFound,
    OutOfOrder,
    SidecarClient,
    SidecarError,
    StreamLost,
    Unavailable,
    VersionMismatch,
    error_from,
)
from code2wav.client.wire_tensors import InlineTransport, as_wire_codes, audio_from_frames
from code2wav.proto import (
    Abort, Aborted, Bye, ChunkResult, Decode, DecodeResult, Error, ErrorCode, ErrorInfo, Finish, Finished, Hello,
    InlineLoc, Limits, ModelInfo, Opened, OpenStream, Ping, Pong, ProtocolError, TensorDesc, Welcome,
    decode_client_message, encode, inline_view,
)

U = 4  # samples per frame of the fake model
Q = 2  # quantizers of the fake model


def expected_audio(codes: np.ndarray, context_frames: int = 0) -> torch.Tensor:
    firsts = codes[0, context_frames:].astype(np.float32)
    return torch.from_numpy((firsts[:, None] + 0.25 * np.arange(U, dtype=np.float32)).reshape(-1))


def make_codes(num_frames: int, start: int = 0) -> np.ndarray:
    return np.stack([np.arange(start, start + num_frames), np.zeros(num_frames, dtype=np.int64)]).astype(np.int64)


class FakeSidecar:
    """A minimal proto-v1 server with seq checks, resend replay and switches to misbehave."""

    def __init__(
        self, address: str, boot_epoch: str = "epoch-1", heartbeat_interval_s: float = 0.1, strict_hello: bool = False
    ) -> None:
        self.address, self.boot_epoch, self.heartbeat_interval_s = address, boot_epoch, heartbeat_interval_s
        self.received: list[Any] = []
        self.mute = False  # answer nothing at all
        self.drop_decodes = False  # decodes are lost before they are applied
        self.drop_decode_replies = False  # decodes are applied, their replies lost
        self.reply_delay_s: dict[str, float] = {}  # per stream id (decodes and opens)
        self.welcome_delay_s = 0.0
        self.in_order = False  # replies leave in request order, as the real sidecar's (a delay holds back later ones)
        self._last_due = 0.0
        self.hello_error: ErrorCode | None = None
        self.strict_hello = strict_hello  # refuse even pings from peers that have not said hello
        self.capabilities: dict[str, Any] = {"cuda_ipc": False}  # the welcome's
        # stream id -> seq answered with audio and then refused after its reply, as the sidecar's early audio does
        # (proto/README.md section 5): later chunks and a finish are refused with failed_seq until it comes again
        self.late_fail: dict[str, int] = {}
        self._known_peers: set[bytes] = set()
        self._streams: dict[tuple[bytes, str], dict[str, Any]] = {}
        self._later: list[tuple[float, list[Any]]] = []
        self._stop = threading.Event()
        self._sock = zmq.Context.instance().socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.bind(address)
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self._sock.close(linger=0)

    def count(self, kind: type) -> int:
        return sum(isinstance(msg, kind) for msg in list(self.received))

    def _run(self) -> None:
        while not self._stop.is_set():
            if self._sock.poll(5, zmq.POLLIN):
                parts = self._sock.recv_multipart(copy=False)
                self._handle(parts[0].bytes, [p.buffer for p in parts[1:]])
            now = time.monotonic()
            for item in [item for item in self._later if item[0] <= now]:
                self._later.remove(item)
                self._sock.send_multipart(item[1], copy=False)

    def _send(self, peer: bytes, msg: Any, buffers: Sequence[Any] = (), delay_s: float = 0.0) -> None:
        frames = [peer, *encode(msg, list(buffers))]
        if self.in_order:
            self._last_due = max(time.monotonic() + delay_s, self._last_due)
            self._later.append((self._last_due, frames))
        elif delay_s > 0:
            self._later.append((time.monotonic() + delay_s, frames))
        else:
            self._sock.send_multipart(frames, copy=False)

    def _handle(self, peer: bytes, frames: list[memoryview]) -> None:
        try:
            msg = decode_client_message(frames)
        except ProtocolError as exc:
            self._send(peer, Error(exc.request_id, exc.code, exc.message))
            return
        self.received.append(msg)
        if self.mute or isinstance(msg, Bye):
            return
        if self.strict_hello and peer not in self._known_peers and not isinstance(msg, Hello):
            self._send(peer, Error(msg.request_id, ErrorCode.INVALID_ARGUMENT, "send hello first"))
            return
        if isinstance(msg, Ping):
            self._send(peer, Pong(msg.request_id, self.boot_epoch))
        elif isinstance(msg, Hello):
            if self.hello_error is not None:
                self._send(peer, Error(msg.request_id, self.hello_error, "no"))
                return
            self._known_peers.add(peer)
            model = ModelInfo("fake", Q, 100, U, 16, ("exact", "window"), "float32", "cpu")
            self._send(peer, Welcome(msg.request_id, 1, "fake-sidecar", self.boot_epoch, (model,), "fake",
                                     Limits(max_chunk_frames=64), self.heartbeat_interval_s, self.capabilities),
                       delay_s=self.welcome_delay_s)
        elif isinstance(msg, OpenStream):
            self._streams[(peer, msg.stream_id)] = {"next_seq": 0, "last": None}
            self._send(peer, Opened(msg.request_id, msg.stream_id, "fake", msg.mode, msg.left_context_frames, U, Q),
                       delay_s=self.reply_delay_s.get(msg.stream_id, 0.0))
        elif isinstance(msg, Decode) and not self.drop_decodes:
            self._decode(peer, msg, frames)
        elif isinstance(msg, Finish) and self._streams.get((peer, msg.stream_id), {}).get("failed") is not None:
            failed = self._streams[(peer, msg.stream_id)]["failed"]
            self._send(peer, Error(msg.request_id, ErrorCode.INTERNAL, f"seq {failed} was refused", failed))
        elif isinstance(msg, (Finish, Abort)):
            self._streams.pop((peer, msg.stream_id), None)
            reply = Finished if isinstance(msg, Finish) else Aborted
            self._send(peer, reply(msg.request_id, msg.stream_id))

    def _decode(self, peer: bytes, msg: Decode, frames: list[memoryview]) -> None:
        results: list[ChunkResult] = []
        buffers: list[bytes] = []
        for chunk in msg.chunks:
            state = self._streams.get((peer, chunk.stream_id))
            codes = np.frombuffer(inline_view(chunk.codes, frames), chunk.codes.dtype).reshape(chunk.codes.shape)
            error = None
            if state is None:
                error = ErrorInfo(ErrorCode.NOT_FOUND, f"no stream {chunk.stream_id}")
            elif state.get("failed") is not None and chunk.seq > state["failed"]:
                error = ErrorInfo(ErrorCode.INTERNAL, f"seq {state['failed']} was refused", state["failed"])
            elif state["last"] is not None and chunk.seq == state["next_seq"] - 1:
                audio = state["last"]  # resend: same reply again
            elif chunk.seq != state["next_seq"]:
                error = ErrorInfo(ErrorCode.OUT_OF_ORDER, f"expected seq {state['next_seq']}, got {chunk.seq}")
            elif (codes < 0).any():
                error = ErrorInfo(ErrorCode.INVALID_ARGUMENT, "negative code")
            elif self.late_fail.get(chunk.stream_id) == chunk.seq:  # answered, then refused after the reply
                del self.late_fail[chunk.stream_id]
                audio = bytes(4 * U * (chunk.codes.shape[1] - chunk.context_frames))  # its slot: zeros
                state["failed"] = chunk.seq
            else:
                audio = expected_audio(codes, chunk.context_frames).numpy().tobytes()
                state["next_seq"], state["last"], state["failed"] = chunk.seq + 1, audio, None
            if error is not None:
                results.append(ChunkResult(chunk.stream_id, chunk.seq, None, 0, error))
                continue
            buffers.append(audio)
            desc = TensorDesc("float32", (len(audio) // 4,), InlineLoc(len(buffers)))
            results.append(ChunkResult(chunk.stream_id, chunk.seq, desc, len(audio) // 4 // U))
        if not self.drop_decode_replies:
            delay_s = max(self.reply_delay_s.get(c.stream_id, 0.0) for c in msg.chunks)
            self._send(peer, DecodeResult(msg.request_id, tuple(results)), buffers, delay_s)


@pytest.fixture()
def address(tmp_path: Any) -> str:
    return f"ipc://{tmp_path}/sidecar.sock"


@pytest.fixture()
def fake(address: str) -> Any:
    server = FakeSidecar(address)
    yield server
    server.stop()


@pytest.fixture()
def client(fake: FakeSidecar, address: str) -> Any:
    with SidecarClient(address, timeout_s=5, client_id="unit") as c:
        yield c


# ----------------------------------------------------------------------------- no server needed


def test_error_mapping_one_class_per_code() -> None:
    for code in ErrorCode:
        error = error_from(code, "why")
        assert error.code is code and error.message == "why" and str(error) == f"{code.value}: why"
        assert isinstance(error, SidecarError)
    assert type(error_from("deadline_exceeded", "x")) is DeadlineExceeded
    assert type(error_from(ErrorCode.STREAM_LOST, "x")) is StreamLost
    copied = pickle.loads(pickle.dumps(error_from("busy", "full")))
    assert type(copied) is Busy and copied.message == "full" and str(copied) == "busy: full"
    unknown = error_from("quota_exceeded", "m")
    assert type(unknown) is Internal and "quota_exceeded" in unknown.message


def test_codes_conversion_is_zero_copy_when_possible() -> None:
    codes = torch.arange(50, dtype=torch.int64).reshape(2, 25)
    array = as_wire_codes(codes)
    assert array.dtype == np.int64 and array.shape == (2, 25)
    assert array.ctypes.data == codes.data_ptr()  # shares memory
    assert as_wire_codes(codes.to(torch.int32)).dtype == np.int32
    widened = as_wire_codes(codes.to(torch.uint8))
    assert widened.dtype == np.int64 and widened.tolist() == codes.tolist()
    transposed = torch.arange(50, dtype=torch.int64).reshape(25, 2).t()
    assert as_wire_codes(transposed).flags["C_CONTIGUOUS"] and as_wire_codes(transposed).tolist() == transposed.tolist()
    big_endian = np.arange(6, dtype=">i4").reshape(2, 3)
    little = as_wire_codes(big_endian)
    assert little.dtype.str == "<i4" and little.tolist() == [[0, 1, 2], [3, 4, 5]]
    assert as_wire_codes([[1, 2], [3, 4]]).dtype == np.int64
    with pytest.raises(InvalidArgument, match="integer tensor, got torch.float32"):
        as_wire_codes(codes.float())
    with pytest.raises(InvalidArgument, match=r"shape \[num_quantizers, num_frames\], got \[50\]"):
        as_wire_codes(torch.arange(50))
    with pytest.raises(InvalidArgument, match="integer array"):
        as_wire_codes(np.ones((2, 2), dtype=bool))


def test_inline_transport_packs_without_copy() -> None:
    array = make_codes(3)
    desc, frames = InlineTransport().pack(array, first_frame=2)
    assert desc == TensorDesc("int64", (2, 3), InlineLoc(2))
    assert frames[0].obj is array and bytes(frames[0]) == array.tobytes()
    assert InlineTransport().pack(make_codes(0), 1)[1] == [b""]


def test_audio_from_frames_zero_copy_and_fallback_copies() -> None:
    samples = np.arange(8, dtype=np.float32)
    desc = TensorDesc("float32", (8,), InlineLoc(1))
    writable = bytearray(samples.tobytes())
    audio = audio_from_frames(desc, [b"", memoryview(writable)])
    assert audio.data_ptr() == np.frombuffer(writable, np.uint8).ctypes.data  # no copy
    assert audio.tolist() == samples.tolist()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # torch warns on non-writable buffers: we must copy instead
        assert audio_from_frames(desc, [b"", samples.tobytes()]).tolist() == samples.tolist()
        misaligned = memoryview(bytearray(b"\0" + samples.tobytes()))[1:]
        assert audio_from_frames(desc, [b"", misaligned]).tolist() == samples.tolist()
    assert audio_from_frames(TensorDesc("float32", (0,), InlineLoc(1)), [b"", b""]).shape == (0,)
    with pytest.raises(ProtocolError, match="holds 4 bytes"):
        audio_from_frames(desc, [b"", bytes(4)])


def test_connect_to_nothing_is_unavailable_with_a_hint(tmp_path: Any) -> None:
    address = f"ipc://{tmp_path}/nobody.sock"
    start = time.monotonic()
    with pytest.raises(Unavailable) as info:
        SidecarClient(address, connect_timeout_s=0.3)
    assert time.monotonic() - start < 3
    assert address in info.value.message and "code2wav-sidecar serve" in info.value.message
    assert "does not exist" in info.value.message


# ----------------------------------------------------------------------------- against the fake peer


def test_handshake(client: SidecarClient, fake: FakeSidecar) -> None:
    hello = fake.received[0]
    assert isinstance(hello, Hello) and hello.version == 1 and hello.client_id == "unit"
    assert client.server_info.server_id == "fake-sidecar" and client.boot_epoch == "epoch-1"
    assert [m.name for m in client.models] == ["fake"] and client.limits.max_chunk_frames == 64
    assert client.ping() < 1.0


def test_version_mismatch_on_connect(fake: FakeSidecar, address: str) -> None:
    fake.hello_error = ErrorCode.VERSION_MISMATCH
    with pytest.raises(VersionMismatch):
        SidecarClient(address, connect_timeout_s=2)


def test_decode_values_seq_context_and_final(client: SidecarClient, fake: FakeSidecar) -> None:
    stream = client.open_stream("req-1", mode="window", left_context_frames=25)
    opened = [m for m in fake.received if isinstance(m, OpenStream)][0]
    assert (opened.mode, opened.left_context_frames, stream.samples_per_frame) == ("window", 25, U)
    first = make_codes(5, start=10)
    audio = stream.decode(torch.from_numpy(first), context_frames=2)
    assert audio.dtype == torch.float32 and audio.shape == ((5 - 2) * U,)
    assert torch.equal(audio, expected_audio(first, 2))
    assert stream.next_seq == 1
    last = make_codes(3, start=40)
    assert torch.equal(stream.decode(last, final=True), expected_audio(last))
    assert stream.closed and stream.next_seq == 2
    with pytest.raises(NotFound, match="closed"):
        stream.decode(last)
    with pytest.raises(InvalidArgument, match="3 quantizers"):
        client.open_stream("req-2").decode(np.zeros((3, 4), np.int64))


def test_batch_is_one_message_and_per_chunk_errors(client: SidecarClient, fake: FakeSidecar) -> None:
    streams = [client.open_stream(f"s{i}") for i in range(3)]
    codes = [make_codes(2, start=i) for i in range(3)]
    bad = make_codes(2)
    bad[0, 0] = -1
    outs = client.decode_batch([(streams[0], codes[0]), (streams[1], codes[1]), (streams[2], codes[2], {"final": True})])
    assert [torch.equal(o, expected_audio(c)) for o, c in zip(outs, codes)] == [True] * 3
    decodes = [m for m in fake.received if isinstance(m, Decode)]
    assert len(decodes) == 1 and [c.stream_id for c in decodes[0].chunks] == ["s0", "s1", "s2"]
    assert decodes[0].chunks[2].final and streams[2].closed
    mixed = [(streams[0], codes[0]), (streams[1], bad)]
    results = client.decode_batch(mixed, return_exceptions=True)
    assert torch.equal(results[0], expected_audio(codes[0])) and isinstance(results[1], InvalidArgument)
    assert (streams[0].next_seq, streams[1].next_seq) == (2, 1)  # the failed chunk's seq is free again
    with pytest.raises(InvalidArgument, match="negative code"):
        client.decode_batch([(streams[0], codes[0]), (streams[1], bad)])
    assert streams[0].next_seq == 3  # the good chunk still went through
    assert torch.equal(streams[1].decode(codes[1]), expected_audio(codes[1]))


def test_chunks_that_never_left_free_their_seq(client: SidecarClient, fake: FakeSidecar) -> None:
    one, two = client.open_stream("one"), client.open_stream("two")
    with pytest.raises(InvalidArgument, match="3 quantizers"):  # refused before anything is sent
        client.decode_batch([(one, make_codes(2)), (two, np.zeros((3, 2), np.int64))])
    assert one.next_seq == 0 and not one.ledger.num_unacked
    fake.stop()
    time.sleep(0.1)  # the DEALER notices the closed peer; IMMEDIATE then refuses to queue
    with pytest.raises((DeadlineExceeded, Unavailable)):
        one.decode(make_codes(2), timeout_s=0.2)
    assert one.next_seq == 0 and not one.ledger.num_unacked  # never sent, so not in doubt


def test_replies_matched_by_request_id_not_order(client: SidecarClient, fake: FakeSidecar) -> None:
    slow, quick = client.open_stream("slow"), client.open_stream("quick")
    fake.reply_delay_s["slow"] = 0.3
    slow_codes, quick_codes = make_codes(3, 1), make_codes(3, 7)
    slow_future = slow.submit(slow_codes)
    quick_future = quick.submit(quick_codes)
    assert torch.equal(quick_future.result(2), expected_audio(quick_codes))
    assert not slow_future.done()  # the later request finished first
    assert torch.equal(slow_future.result(2), expected_audio(slow_codes))


def test_pipelined_chunks_and_asyncio(client: SidecarClient) -> None:
    stream = client.open_stream("pipe")
    chunks = [make_codes(2, 10 * i) for i in range(4)]

    async def run() -> list[torch.Tensor]:
        return await asyncio.gather(*(asyncio.wrap_future(stream.submit(c)) for c in chunks))

    outs = asyncio.run(run())
    assert all(torch.equal(o, expected_audio(c)) for o, c in zip(outs, chunks))
    assert stream.next_seq == 4


def test_threads_send_directly_and_callbacks_hand_over(client: SidecarClient, fake: FakeSidecar,
                                                        monkeypatch: Any) -> None:
    """Callers send on their own threads when the socket is free; a submit from a reply callback (the I/O
    thread, which holds the socket) is handed over instead. Every reply reaches its caller with its values."""
    conn = client._conn
    direct = []
    real_send_direct = conn._send_direct
    monkeypatch.setattr(conn, "_send_direct", lambda call: direct.append(1) or real_send_direct(call))
    streams = [client.open_stream(f"t{i}") for i in range(8)]
    errors: list[BaseException] = []

    def run(stream: Any, base: int) -> None:
        try:
            for i in range(40):
                codes = make_codes(2, base + 2 * i)
                assert torch.equal(stream.decode(codes), expected_audio(codes))
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(s, 1000 * k)) for k, s in enumerate(streams)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not errors, errors[0]
    assert all(s.next_seq == 40 for s in streams) and direct

    chained = client.open_stream("chained")
    fake.reply_delay_s["chained"] = 0.2  # the callback is attached before the reply arrives
    first_codes, second_codes = make_codes(2, 5), make_codes(3, 50)
    second: list[Any] = []
    on_io_thread: list[bool] = []

    def chain(_future: Any) -> None:
        on_io_thread.append(conn.on_io_thread)
        second.append(chained.submit(second_codes))

    first = chained.submit(first_codes)
    first.add_done_callback(chain)
    assert torch.equal(first.result(5), expected_audio(first_codes))
    deadline = time.monotonic() + 5
    while not second and time.monotonic() < deadline:
        time.sleep(0.01)
    assert on_io_thread == [True]
    assert torch.equal(second[0].result(5), expected_audio(second_codes)) and chained.next_seq == 2


@pytest.mark.parametrize("applied", [False, True])
def test_deadline_then_resend(client: SidecarClient, fake: FakeSidecar, applied: bool) -> None:
    stream = client.open_stream("slowpoke")
    codes = make_codes(3, 5)
    if applied:
        fake.drop_decode_replies = True
    else:
        fake.drop_decodes = True
    start = time.monotonic()
    with pytest.raises(DeadlineExceeded, match="within 0.3s"):
        stream.decode(codes, timeout_s=0.3)
    assert 0.25 < time.monotonic() - start < 1.5
    with pytest.raises(OutOfOrder, match="call resend"):
        stream.decode(make_codes(1))
    fake.drop_decodes = fake.drop_decode_replies = False
    assert torch.equal(stream.resend(), expected_audio(codes))  # same seq either way
    assert stream.next_seq == 1
    after = make_codes(2, 9)
    assert torch.equal(stream.decode(after), expected_audio(after))
    assert [c.seq for m in fake.received if isinstance(m, Decode) for c in m.chunks] == [0, 0, 1]


def test_heartbeat_death_then_recovery(client: SidecarClient, fake: FakeSidecar) -> None:
    stream = client.open_stream("hb")
    pings_before = fake.count(Ping)
    time.sleep(0.35)  # idle: the client pings every 0.1 s
    assert fake.count(Ping) - pings_before >= 2
    fake.mute = True
    start = time.monotonic()
    with pytest.raises(Unavailable, match="has not answered"):
        stream.decode(make_codes(2), timeout_s=10)
    assert time.monotonic() - start < 1.5  # ~3 intervals, not the 10 s timeout
    with pytest.raises(Unavailable):
        client.open_stream("while-dead", timeout_s=10)  # fails fast while dead
    fake.mute = False
    deadline = time.monotonic() + 3
    while True:  # pongs revive the connection; the unanswered chunk is in doubt
        try:
            audio = stream.resend(timeout_s=1)
            break
        except Unavailable:
            assert time.monotonic() < deadline
            time.sleep(0.05)
    assert torch.equal(audio, expected_audio(make_codes(2))) and stream.next_seq == 1


@pytest.mark.parametrize("strict_hello", [False, True])
def test_restart_loses_streams_and_reconnects(address: str, strict_hello: bool) -> None:
    first = FakeSidecar(address, boot_epoch="epoch-1", heartbeat_interval_s=0.25)
    try:
        client = SidecarClient(address, timeout_s=5)
        old = client.open_stream("old")
        first.drop_decodes = True
        pending = old.submit(make_codes(2))
    finally:
        first.stop()
    # strict: the new server refuses pings before hello; the re-handshake's welcome shows the new epoch
    second = FakeSidecar(address, boot_epoch="epoch-2", heartbeat_interval_s=0.25, strict_hello=strict_hello)
    try:
        with pytest.raises(StreamLost, match="epoch-1 -> epoch-2"):
            pending.result(5)
        assert old.lost
        with pytest.raises(StreamLost):
            old.decode(make_codes(2))
        deadline = time.monotonic() + 3
        while client.boot_epoch != "epoch-2":  # the re-handshake's welcome
            assert time.monotonic() < deadline
            time.sleep(0.02)
        assert second.count(Hello) == 1
        new = client.open_stream("old")  # same id, new server
        codes = make_codes(2, 3)
        assert torch.equal(new.decode(codes), expected_audio(codes))
        old.abort()  # no-op on a lost stream
        client.close()
        deadline = time.monotonic() + 2
        while second.count(Bye) == 0:
            assert time.monotonic() < deadline
            time.sleep(0.02)
    finally:
        second.stop()


@pytest.mark.parametrize("in_order", [True, False])
def test_an_open_sent_after_the_rehandshake_belongs_to_the_new_server(address: str, in_order: bool) -> None:
    """Found by the GPU soak: after a sidecar restart, an open the client sent after its new hello (so the new
    server opened it) was failed with StreamLost when the welcome came, and the caller's retry of the same id got
    already_exists for ever. An open sent after the hello must get its own answer.

    ``in_order``: replies in request order, as the real sidecar sends them: the restart shows in the welcome, and
    the open's answer comes after it. Otherwise the fake answers pings before its delayed welcome: the restart
    shows in a pong first, and the welcome that follows must not be taken for a second loss (a forgotten
    session), which would fail the new stream too."""
    first = FakeSidecar(address, boot_epoch="epoch-1", heartbeat_interval_s=0.25)
    try:
        client = SidecarClient(address, timeout_s=5)
        old = client.open_stream("old")
    finally:
        first.stop()
    second = FakeSidecar(address, boot_epoch="epoch-2", heartbeat_interval_s=0.25, strict_hello=True)
    second.in_order = in_order
    second.welcome_delay_s = 0.4  # the welcome leaves after the open below has reached the server (within the
    second.reply_delay_s = {"fresh": 0.6}  # 3 heartbeats of silence that would declare the server dead)
    try:
        deadline = time.monotonic() + 5
        while second.count(Hello) == 0:  # the refused ping made the client say hello again
            assert time.monotonic() < deadline
            time.sleep(0.01)
        fresh = client.open_stream("fresh")  # sent after that hello: the new server opens it
        assert client.boot_epoch == "epoch-2" and not fresh.lost and old.lost
        assert fresh.generation == old.generation + 1  # one restart, seen once
        codes = make_codes(2)
        assert torch.equal(fresh.decode(codes), expected_audio(codes))
        assert second.count(OpenStream) == 1
        client.close()
    finally:
        second.stop()


def test_close_sends_bye_and_fails_later_calls(fake: FakeSidecar, address: str) -> None:
    client = SidecarClient(address, timeout_s=5)
    stream = client.open_stream("x")
    stream.finish()
    assert stream.closed
    client.close()
    client.close()  # idempotent
    deadline = time.monotonic() + 2
    while fake.count(Bye) == 0:
        assert time.monotonic() < deadline
        time.sleep(0.02)
    with pytest.raises(Unavailable, match="closed"):
        client.open_stream("y")
