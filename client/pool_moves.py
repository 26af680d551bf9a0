"""A pool's stream moves: re-open a ``PooledStream`` on another sidecar and replay its history there
(``start_move``), and the monitor's look at which streams must move (``watch``). The stream's side (chunks waiting,
sent again after the replay) is ``pool_stream.py``'s; counters are ``failover.py``'s.

``client`` imports ``proto``, zmq, torch and numpy; it never imports ``sidecar``.
"""

from __future__ import annotations

import logging
import time
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any, Callable, Iterable

import torch

from .failover import FailoverStats, MoveRecord, now_s

if TYPE_CHECKING:
    from .pool_stream import PooledStream
    from .stream import Stream

__all__ = ["MoveService"]

log = logging.getLogger("code2wav.client")

Place = Callable[[str, dict, set, "float | None"], Future]
"""``(stream_id, open kwargs, addresses to skip, timeout_s) -> Future[(Stream, PoolMember)]``: the pool's placement
with retries over its sidecars (``SidecarPool._place``)."""


class MoveService:
    def __init__(self, place: Place, open_timeout_s: float) -> None:
        self._place = place
        self.open_timeout_s = open_timeout_s  # a re-open's timeout: a sidecar that died unseen must not stall it
        self.stats = FailoverStats()

    def start_move(self, stream: PooledStream, reason: str, start_frame: int, replay: torch.Tensor | None,
                   on_done: Callable[[Stream | None, Any, BaseException | None], None]) -> None:
        """Re-open ``stream`` (drain: on another sidecar; failover: on any live one, its own if it restarted), send
        ``replay`` ``[C, H]`` there as context frames (pipelined, in pieces of ``max_chunk_frames``), then call
        ``on_done(inner, member, None)`` so the stream sends its waiting chunks right behind; or ``on_done(None,
        None, error)`` when no sidecar took it."""
        started_s, from_address = now_s(), stream.member.address
        skip = {from_address} if reason == "drain" else set()
        kwargs = dict(stream.open_kwargs, start_frame=start_frame if stream.mode == "exact" else 0)
        opened = self._place(stream.stream_id, kwargs, skip, self.open_timeout_s)

        def on_opened(done: Future) -> None:
            error = done.exception()
            if error is not None:
                if reason == "drain" and not stream.inner.lost:
                    log.debug("pool: stream %r stays on draining %s for now: no other sidecar took it (%s)",
                              stream.stream_id, from_address, error)
                else:
                    self.stats.lost()
                    log.warning("pool: stream %r lost its sidecar %s and no other took it (%s)", stream.stream_id,
                                from_address, error)
                return on_done(None, None, error)
            inner, member = done.result()
            try:
                replies = self._send_replay(inner, member, replay)
            except Exception as exc:  # refused before sending (it fits: the stream took these frames once)
                inner.submit_abort()
                self.stats.lost()
                return on_done(None, None, exc)
            on_done(inner, member, None)
            num_frames = 0 if replay is None else int(replay.shape[1])
            self._record_when_done(stream, inner, replies,
                                   MoveRecord(reason, stream.stream_id, from_address, member.address, num_frames,
                                              _audio_s(member, inner, num_frames), 0.0, 0.0), started_s)

        opened.add_done_callback(on_opened)

    @staticmethod
    def _send_replay(inner: Stream, member: Any, replay: torch.Tensor | None) -> list[Future]:
        if replay is None:
            return []
        limit = member.client.limits.max_chunk_frames
        replies = []
        for first in range(0, int(replay.shape[1]), limit):
            piece = replay[:, first:first + limit]  # [C, <= limit]
            replies.append(inner.submit(piece, context_frames=int(piece.shape[1])))  # no audio comes back
        return replies

    def _record_when_done(self, stream: PooledStream, inner: Stream, replies: list[Future], record: MoveRecord,
                          started_s: float) -> None:
        """Count the move once its replay's replies are in. A refused piece is not a move: the stream moves again
        (``PooledStream.replay_failed``; the chunks sent behind it there are not accepted either)."""
        remaining = [len(replies)]

        def one_done(done: Future | None) -> None:
            if done is not None:
                if done.exception() is not None:
                    if remaining[0] > 0:
                        remaining[0] = -1  # (once per move)
                        stream.replay_failed(inner, done.exception())
                    return
                remaining[0] -= 1
                if remaining[0]:
                    return
            stream.replayed()
            recovery_s = now_s() - started_s
            final = MoveRecord(record.reason, record.stream_id, record.from_address, record.to_address,
                               record.replay_frames, record.replay_audio_s, recovery_s, time.time())
            self.stats.moved(final)
            log.info("pool: stream %r moved from %s to %s (%s): replayed %d frames (%.2fs of audio) in %.3fs",
                     record.stream_id, record.from_address, record.to_address, record.reason, record.replay_frames,
                     record.replay_audio_s, recovery_s)

        if not replies:
            return one_done(None)
        for reply in replies:
            reply.add_done_callback(one_done)

    @staticmethod
    def watch(streams: Iterable[PooledStream]) -> None:
        """The monitor's turn: streams whose sidecar died or restarted move now; those on a draining sidecar (its
        ``pong`` says so) at their next chunk boundary."""
        for stream in streams:
            if stream.closed or stream.lost:
                continue
            member = stream.member
            client = member.client
            if stream.inner.lost or client is None or not client.answering:
                stream.request_move("failover")
            elif client.load is not None and client.load.draining:
                stream.request_move("drain")


def _audio_s(member: Any, inner: Stream, num_frames: int) -> float:
    """The audio duration of ``num_frames`` input frames of ``inner``'s model (welcome's frame rate)."""
    info = member.client.server_info.model(inner.model)
    return num_frames / info.frame_rate_hz if info is not None else 0.0
