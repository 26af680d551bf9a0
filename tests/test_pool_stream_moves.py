"""``PooledStream``'s move rules without sockets (``client/pool_stream.py``): the sidecar streams and the pool are
fakes here (they record what is sent and let the test answer), the stream under test is the real one. The process
tests are ``test_pool_failover.py`` and ``test_pool_drain.py``; these pin the orderings a review found wrong:
a late reply from the sidecar being left, a chunk in doubt across a move, an abort during a move, a refused replay."""

from __future__ import annotations

from concurrent.futures import Future

import pytest
import torch

from code2wav.client.errors import Busy, DeadlineExceeded, NotFound, StreamLost, Unavailable
from code2wav.client.pool_stream import MAX_FAILED_REPLAYS, PooledStream


class FakeSidecarStream:
    """Stands in for one sidecar's ``Stream``: records each chunk and hands out its future."""

    def __init__(self) -> None:
        self.lost = self.closed = False
        self.stream_id, self.num_quantizers, self.input_kind, self.mode = "s", 2, "codes", "exact"
        self.sent: list[tuple[torch.Tensor, int, Future]] = []

    def submit(self, codes, final=False, context_frames=0, timeout_s=None) -> Future:
        future: Future = Future()
        self.sent.append((codes.clone(), context_frames, future))
        return future

    def submit_abort(self, timeout_s=None) -> Future:
        done: Future = Future()
        done.set_result(None)
        return done

    def firsts(self) -> list[int]:
        """The first value of each chunk sent (the tests fill chunk i with i)."""
        return [int(codes[0, 0]) for codes, _, _ in self.sent]


class FakePool:
    """Records each move the stream asks for; the test completes it."""

    def __init__(self) -> None:
        self.moves: list[tuple] = []

    def start_move(self, stream, reason, start_frame, replay, on_done) -> None:
        self.moves.append((reason, start_frame, replay, on_done))

    def wait(self, future, timeout_s):
        return future.result(timeout_s)

    def wait_s(self, timeout_s):
        return timeout_s


def _member(address: str):
    return type("Member", (), {"address": address})()


def _stream() -> tuple[PooledStream, FakeSidecarStream, FakePool]:
    old, pool = FakeSidecarStream(), FakePool()
    return PooledStream(pool, old, _member("a"), {}, history_frames=100, codebook_size=64), old, pool


def _chunk(value: int) -> torch.Tensor:
    return torch.full((2, 5), value, dtype=torch.long)  # [Q, 5]


def _stream_with_history() -> tuple[PooledStream, FakeSidecarStream, FakePool]:
    """A stream whose chunk 0 its sidecar acknowledged (5 frames of history)."""
    stream, old, pool = _stream()
    stream.submit(_chunk(0))
    old.sent[0][2].set_result(torch.zeros(5))
    return stream, old, pool


def test_a_late_success_from_the_sidecar_being_left_does_not_skip_its_chunk():
    stream, old, pool = _stream_with_history()
    f1, _ = stream.submit(_chunk(1)), stream.submit(_chunk(2))
    old.sent[2][2].set_exception(Unavailable("shutting down"))  # chunk 2 refused: the move starts, chunk 1 pending
    _, start_frame, replay, on_done = pool.moves[0]
    assert start_frame == 0 and replay.shape[1] == 5  # chunk 0 only
    old.sent[1][2].set_result(torch.ones(5))  # chunk 1's success arrives during the move: not taken
    assert not f1.done() and stream.history.total_frames == 5
    new = FakeSidecarStream()
    on_done(new, _member("b"), None)
    assert new.firsts() == [1, 2]  # behind the replay: chunk 1 again, then 2 (the new state misses nothing)
    new.sent[0][2].set_result(torch.full((5,), 7.0))
    assert torch.equal(f1.result(0), torch.full((5,), 7.0))  # the caller gets it once, from the new sidecar


def test_a_chunk_in_doubt_goes_again_after_a_failover_and_resend_gives_its_audio():
    stream, old, pool = _stream_with_history()
    f1 = stream.submit(_chunk(1))
    old.sent[1][2].set_exception(DeadlineExceeded("no reply"))
    with pytest.raises(DeadlineExceeded):
        f1.result(0)
    old.lost = True
    stream.request_move("failover")
    _, _, replay, on_done = pool.moves[0]
    assert replay.shape[1] == 5  # the chunk in doubt is not history: its outcome there is unknown
    new = FakeSidecarStream()
    on_done(new, _member("b"), None)
    assert new.firsts() == [1]  # sent again, right behind the replay
    resent = stream.submit_resend()
    new.sent[0][2].set_result(torch.full((5,), 3.0))
    assert torch.equal(resent.result(0), torch.full((5,), 3.0)) and stream.history.total_frames == 10


def test_a_later_success_commits_the_chunks_in_doubt_before_it():
    stream, old, _ = _stream()
    stream.submit(_chunk(0))
    old.sent[0][2].set_exception(DeadlineExceeded("no reply"))
    stream.submit(_chunk(1))
    old.sent[1][2].set_result(torch.zeros(5))  # seq 1 accepted: the sidecar had committed seq 0
    assert stream.history.total_frames == 10 and torch.equal(stream.history.frames()[0, :5], _chunk(0)[0])


def test_an_abort_during_a_move_fails_the_waiting_chunks_and_starts_no_move():
    stream, old, pool = _stream()
    f0 = stream.submit(_chunk(0))
    old.lost = True
    old.sent[0][2].set_exception(StreamLost("gone"))  # the move starts
    stream.abort(timeout_s=1)
    with pytest.raises(NotFound, match="aborted"):
        f0.result(0)
    on_done = pool.moves[0][3]
    new = FakeSidecarStream()
    on_done(new, _member("b"), None)
    assert new.sent == []  # nothing sent for an aborted stream
    stream, old, pool = _stream()
    f0 = stream.submit(_chunk(0))
    old.lost = True
    stream.abort(timeout_s=1)  # before any reply told it the sidecar is gone
    old.sent[0][2].set_exception(StreamLost("gone"))
    assert pool.moves == [] and f0.done()


def test_a_refused_replay_moves_again_then_gives_up():
    stream, old, pool = _stream_with_history()
    f1 = stream.submit(_chunk(1))
    old.sent[1][2].set_exception(StreamLost("gone"))
    for attempt in range(MAX_FAILED_REPLAYS):
        on_done = pool.moves[attempt][3]
        new = FakeSidecarStream()
        on_done(new, _member(f"s{attempt}"), None)
        stream.replay_failed(new, Busy("full"))  # the pool saw a replay piece refused
        if attempt < MAX_FAILED_REPLAYS - 1:
            assert len(pool.moves) == attempt + 2 and not f1.done()
    with pytest.raises(StreamLost):
        f1.result(0)
