"""``Placer``: a pool's way to open a stream on one of its sidecars: the best by ``placement.rank``, and on a
refusal the next, until one takes it or none is left. Used for a new stream and for a moving one's re-open
(``pool_moves.py``: there any error but a bad argument sends it to the next sidecar).

``client`` imports ``proto``, zmq, torch and numpy; it never imports ``sidecar``.

Thread-safety: reads and updates the members under the pool's lock.
"""

from __future__ import annotations

import itertools
import logging
import secrets
import threading
from concurrent.futures import Future

from .errors import Busy, DeadlineExceeded, InvalidArgument, SidecarError, Unavailable
from .placement import rank
from .pool_member import PoolMember
from .sender import set_exception, set_result
from .stream import Stream

__all__ = ["Placer"]

log = logging.getLogger("code2wav.client")


class Placer:
    def __init__(self, lock: threading.Lock, members: dict[str, PoolMember], gpu_uuid: str | None,
                 address: str) -> None:
        self._lock = lock  # the pool's
        self._members = members  # the pool's, by address
        self._gpu_uuid = gpu_uuid
        self.address = address
        self._choices = itertools.count(1)
        self._salt = secrets.randbits(63) or 1  # this pool's own order among tied sidecars (placement rule 4)

    def place(self, stream_id: str, kwargs: dict, tried: set[str], timeout_s: float | None,
              retry_all: bool = False) -> Future[tuple[Stream, PoolMember]]:
        """Open on the best sidecar not in ``tried``, skipping on ``busy``/``unavailable`` (and, with ``retry_all``,
        a move's re-open: on any error but a bad argument) to the next; the future gives ``(stream, member)``."""
        future: Future[tuple[Stream, PoolMember]] = Future()
        last_error: list[SidecarError] = []

        def attempt() -> None:
            with self._lock:
                order = [key for key in rank([m.candidate(self._gpu_uuid) for m in self._members.values()],
                                         self._salt)
                         if key not in tried]
                member = self._members.get(order[0]) if order else None
                if member is not None:
                    tried.add(member.address)
                    member.placed += 1
                    member.last_chosen = next(self._choices)
            if member is None or member.client is None:
                set_exception(future, last_error[-1] if last_error else Unavailable(
                    f"no sidecar of the pool {self.address} takes streams now: {self.why_none()}"))
                return
            try:
                inner = member.client.submit_open_stream(stream_id, timeout_s=timeout_s, **kwargs)
            except SidecarError as exc:  # refused before sending (bad arguments): the same on every sidecar
                self.unplace(member, refused=False)
                set_exception(future, exc)
                return
            inner.add_done_callback(lambda done: settled(member, done))

        def settled(member: PoolMember, done: Future[Stream]) -> None:
            error = done.exception()
            if error is None:
                stream = done.result()
                with self._lock:
                    member.streams.add(stream)
                set_result(future, (stream, member))
                return
            if retry_all:
                retry = not isinstance(error, InvalidArgument)
            else:
                retry = isinstance(error, (Busy, Unavailable)) and not isinstance(error, DeadlineExceeded)
            self.unplace(member, refused=retry)
            if not retry:
                set_exception(future, error)
                return
            log.info("pool: %s refused stream %r (%s); trying the next sidecar", member.address, stream_id, error)
            last_error.append(error)
            attempt()

        attempt()
        return future

    def unplace(self, member: PoolMember, refused: bool) -> None:
        with self._lock:
            member.placed -= 1
            member.placed_at_report = min(member.placed_at_report, member.placed)
            member.refused = member.refused or refused

    def why_none(self) -> str:
        return "; ".join(f"{m.address}: " + ("answering" if m.answering else (m.last_error or "not answering"))
                         for m in list(self._members.values())) or "no addresses"
