"""``SidecarPool``: one client over several sidecars (a list of addresses, or a DNS name such as a Kubernetes
headless Service), with the single client's API: streams open on the best sidecar and move only when it dies or
drains (failover: ``pool_stream.PooledStream``, which replays the stream's last ``H`` input frames elsewhere).

``client`` imports ``proto``, zmq, torch and numpy; it never imports ``sidecar``.

    with SidecarPool("dns://code2wav-sidecar.tts.svc.cluster.local:5555", timeout_s=30) as pool:
        s = pool.open_stream("req-1")              # placed by load (placement.py), a PooledStream
        wav = s.decode(codes)                      # to the sidecar it lives on; moved there, if it must, first
        outs = pool.decode_batch([(s1, c1), (s2, c2)])   # one decode message per sidecar involved
        pool.failover_stats()                      # moves so far: failovers, drains, frames replayed, times

Mechanism here, policy in ``placement.py``, addresses in ``discovery.py``, one sidecar in ``pool_member.py``,
opening on the best in ``pool_open.py``, a batch over several sidecars in ``pool_batch.py``, moves in
``pool_moves.py``. A monitor thread pings every connected sidecar each ``refresh_s`` (the ``pong`` carries its
load), re-resolves a DNS name each ``resolve_interval_s``, connects the sidecars that appear or come back, and moves
the streams of a sidecar whose connection closed (``LINK_GRACE_S``), that stopped answering heartbeats (within
``DEAD_AFTER_INTERVALS`` intervals) or restarted
(a new boot epoch), and, at their next chunk boundary, those of a draining one. A sidecar answering ``open_stream``
with ``busy`` or ``unavailable`` (draining) is skipped for the next best before the caller sees an error. With
``failover=False`` a dead sidecar's streams end with ``StreamLost``. One address is a pool of one.
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
import time
import weakref
from concurrent.futures import Future
from typing import Any, Sequence

import torch

from code2wav.proto import DEFAULT_LEFT_CONTEXT_FRAMES, Limits, ModelInfo, Welcome

from .client import BatchItem, SidecarClient
from .discovery import PoolAddress, Resolver, parse_pool_address, system_resolver
from .errors import AlreadyExists, DeadlineExceeded, Unavailable, not_running
from .pool_batch import submit_pooled_batch, submit_pooled_streams
from .pool_member import PoolMember, caller_gpu_uuid
from .pool_moves import MoveService
from .pool_open import Placer
from .pool_stream import PooledStream
from .sender import WAIT_GRACE_S, set_exception, set_result
from .stream import Stream

__all__ = ["SidecarPool"]

log = logging.getLogger("code2wav.client")


class SidecarPool:
    """Several sidecars behind one client. Thread-safe; use as a context manager or call ``close()``."""

    def __init__(self, address: str | Sequence[str], *, timeout_s: float = 30.0, connect_timeout_s: float = 5.0,
                 refresh_s: float = 0.5, resolve_interval_s: float = 5.0, resolver: Resolver | None = None,
                 device: torch.device | int | None = None, failover: bool = True,
                 failover_open_timeout_s: float = 5.0, **client_options: Any) -> None:
        """``address``: one address, several (a list or comma-separated) or ``dns://NAME:PORT``
        (``discovery.py``); ``resolver``: how a DNS name is resolved (default: the host's). ``device``: the
        caller's GPU, preferred for CUDA IPC (default: the current CUDA device when CUDA is in use). ``failover``:
        streams move to another sidecar when theirs dies or drains (``PooledStream``); a move's re-open waits at most
        ``failover_open_timeout_s`` per sidecar tried.
        ``client_options`` go to each sidecar's ``SidecarClient`` (``curve_server_key``, ``cuda_ipc``, ...).
        Raises ``SidecarNotRunning`` when no sidecar of the pool answers within ``connect_timeout_s``."""
        self.spec: PoolAddress = parse_pool_address(address)
        self.address = str(self.spec)
        self.timeout_s = float(timeout_s)
        self.refresh_s = float(refresh_s)
        self.resolve_interval_s = float(resolve_interval_s)
        self._resolver = resolver or system_resolver
        self._gpu_uuid = caller_gpu_uuid(device)
        self._options = dict(client_options, timeout_s=timeout_s, connect_timeout_s=connect_timeout_s,
                             streams_lost_when_dead=True)
        self._lock = threading.Lock()  # members, counters
        self._members: dict[str, PoolMember] = {}
        self.failover = bool(failover)
        self._placer = Placer(self._lock, self._members, self._gpu_uuid, self.address)
        self._moves = MoveService(lambda *args: self._placer.place(*args, retry_all=True),
                                  float(failover_open_timeout_s))
        self._movable: weakref.WeakSet[PooledStream] = weakref.WeakSet()  # the pooled streams that may move
        self._by_id: weakref.WeakValueDictionary[str, Any] = weakref.WeakValueDictionary()
        self._stop = threading.Event()
        self._next_resolve_s = 0.0
        self._refresh_members(time.monotonic())
        if not any(member.client is not None for member in self._members.values()):
            self.close()
            raise not_running(self.address, connect_timeout_s)
        self._thread = threading.Thread(target=self._monitor, name="code2wav-pool", daemon=True)
        self._thread.start()

    # ------------------------------------------------------------------ info

    @property
    def members(self) -> list[dict]:
        """Each sidecar's state: address, answering, load (``proto.Load`` or None), streams placed and open."""
        with self._lock:
            return [member.status() for member in self._members.values()]

    def address_of(self, stream: Stream | PooledStream) -> str:
        """The address of the sidecar ``stream`` lives on now (a ``PooledStream`` moves on failover or drain)."""
        if isinstance(stream, PooledStream):
            return stream.member.address
        return self._member_of(stream).address

    def _member_of(self, stream: Stream) -> PoolMember | None:
        with self._lock:
            return next((m for m in self._members.values() if stream in m.streams), None)

    @property
    def server_info(self) -> Welcome:
        """A connected sidecar's ``welcome`` (the pool's sidecars serve the same models)."""
        for member in list(self._members.values()):
            if member.client is not None and member.answering:
                return member.client.server_info
        raise Unavailable(f"no sidecar of the pool {self.address} answers now")

    @property
    def models(self) -> tuple[ModelInfo, ...]:
        return self.server_info.models

    @property
    def limits(self) -> Limits:
        return self.server_info.limits

    @property
    def ipc_stats(self) -> dict[str, int]:
        """The sidecars' ``ipc_stats`` summed."""
        total: dict[str, int] = {}
        for member in list(self._members.values()):
            for key, value in (member.client.ipc_stats if member.client is not None else {}).items():
                total[key] = total.get(key, 0) + value
        return total

    # ------------------------------------------------------------------ lifecycle

    def close(self) -> None:
        """Close every sidecar's client (each says ``bye``: the sidecars free this pool's streams)."""
        self._stop.set()
        thread = getattr(self, "_thread", None)
        if thread is not None and thread is not threading.current_thread():
            thread.join(5.0)
        with self._lock:
            members, self._members = list(self._members.values()), {}
        for member in members:
            member.close()

    def __enter__(self) -> SidecarPool:
        return self

    def __exit__(self, *exc_info: Any) -> None:
        self.close()

    # ------------------------------------------------------------------ streams

    def submit_open_stream(self, stream_id: str, *, mode: str = "exact",
                           left_context_frames: int = DEFAULT_LEFT_CONTEXT_FRAMES, model: str | None = None,
                           timeout_s: float | None = None, options: dict[str, int] | None = None) -> Future[Stream]:
        """Open a stream on the best sidecar (``placement.rank``); one that answers ``busy`` or ``unavailable``
        is skipped for the next. The future raises the last such error when every sidecar refused. With
        ``failover`` (the default) it gives a ``PooledStream``, which moves to another sidecar when its own dies or
        drains (docs/client.md, "Failover and drain"); else the sidecar's ``Stream``, which stays there."""
        kwargs = dict(mode=mode, left_context_frames=left_context_frames, model=model, options=options)
        future: Future[Stream] = Future()
        live = self._by_id.get(stream_id)
        if live is not None and not live.closed and not live.lost:  # as one client refuses it (docs/client.md)
            set_exception(future, AlreadyExists(f"stream {stream_id!r} is already open in this pool (finish, abort "
                                                "or drop that Stream first)"))
            return future

        def settled(done: Future) -> None:
            if done.exception() is not None:
                return set_exception(future, done.exception())
            inner, member = done.result()
            stream = self._pooled(inner, member, kwargs)
            with self._lock:
                self._by_id[stream_id] = stream
                if isinstance(stream, PooledStream):
                    self._movable.add(stream)
            set_result(future, stream)

        self._placer.place(stream_id, kwargs, set(), timeout_s).add_done_callback(settled)
        return future

    def _pooled(self, inner: Stream, member: PoolMember, kwargs: dict) -> Stream | PooledStream:
        """The caller's handle: a ``PooledStream`` where failover is on and the stream's history is known (an
        ``exact`` stream needs welcome's ``history_frames``; a ``window`` stream's is its left context)."""
        info = member.client.server_info.model(inner.model)
        history_frames = inner.left_context_frames if inner.mode == "window" else (
            info.history_frames if info is not None else 0)
        if not self.failover or (inner.mode == "exact" and history_frames == 0):
            return inner
        codebook_size = info.codebook_size if info is not None else None
        return PooledStream(self, inner, member, kwargs, history_frames, codebook_size)

    def start_move(self, stream: PooledStream, reason: str, start_frame: int, replay: torch.Tensor | None,
                   on_done: Any) -> None:
        """``PooledStream``'s way to move (``pool_moves.MoveService.start_move``)."""
        self._moves.start_move(stream, reason, start_frame, replay, on_done)

    def wait(self, future: Future[Any], timeout_s: float | None) -> Any:
        """Block for a pooled stream's future (a move may come first: twice the timeout, and a grace)."""
        return self._wait(future, timeout_s)

    def wait_s(self, timeout_s: float | None) -> float:
        return (self.timeout_s if timeout_s is None else timeout_s) * 2 + WAIT_GRACE_S

    def failover_stats(self) -> dict:
        """What moves cost so far (``failover.FailoverStats.snapshot``): ``failovers``, ``drain_moves``,
        ``replay_frames``, ``replay_audio_s``, ``recovery_s_total``, ``recovery_s_max``, ``streams_lost``, and
        ``recent`` (each move: reason, stream, from and to, frames replayed, ``recovery_s``)."""
        return self._moves.stats.snapshot()

    def open_stream(self, stream_id: str, *, mode: str = "exact",
                    left_context_frames: int = DEFAULT_LEFT_CONTEXT_FRAMES, model: str | None = None,
                    timeout_s: float | None = None, options: dict[str, int] | None = None) -> Stream:
        future = self.submit_open_stream(stream_id, mode=mode, left_context_frames=left_context_frames, model=model,
                                         timeout_s=timeout_s, options=options)
        return self._wait(future, timeout_s)

    def ping(self, *, timeout_s: float | None = None) -> dict[str, float]:
        """Round trip to every answering sidecar, in seconds, by address."""
        futures = {m.address: m.client.submit_ping(timeout_s=timeout_s) for m in list(self._members.values())
                   if m.client is not None and m.answering}
        return {address: self._wait(future, timeout_s) for address, future in futures.items()}

    # ------------------------------------------------------------------ decode

    def submit_batch(self, items: Sequence[BatchItem], *, return_exceptions: bool = False,
                     timeout_s: float | None = None) -> Future[list[Any]]:
        """The single client's ``submit_batch`` over a pool: one ``decode`` message per sidecar involved; the
        future gives the audio in the items' order (errors as there: the first once all are in, or in place)."""
        if items and isinstance(items[0][0], PooledStream):
            return submit_pooled_streams(items, return_exceptions, timeout_s)
        return submit_pooled_batch(items, self._member_of, return_exceptions, timeout_s)

    def decode_batch(self, items: Sequence[BatchItem], *, return_exceptions: bool = False,
                     timeout_s: float | None = None) -> list[Any]:
        return self._wait(self.submit_batch(items, return_exceptions=return_exceptions, timeout_s=timeout_s),
                          timeout_s)

    # ------------------------------------------------------------------ internals

    def _wait(self, future: Future[Any], timeout_s: float | None) -> Any:
        if threading.current_thread().name == "code2wav-client-io":
            raise RuntimeError("blocking call from a future callback (a client I/O thread); use submit...()")
        wait_s = self.wait_s(timeout_s)  # a retry (or a move) may come first
        try:
            return future.result(wait_s)
        except concurrent.futures.TimeoutError:
            raise DeadlineExceeded(f"no reply from the pool {self.address} within {wait_s:g}s") from None

    def _connect(self, address: str) -> SidecarClient:
        return SidecarClient(address, **self._options)

    def _refresh_members(self, now_s: float) -> None:
        """Re-resolve the addresses when due, connect the new and the returning, retire the gone."""
        if now_s >= self._next_resolve_s:
            self._next_resolve_s = now_s + self.resolve_interval_s
            try:
                wanted = self.spec.resolve(self._resolver)
            except OSError as exc:
                log.warning("pool: could not resolve %s now (%s); keeping its sidecars", self.address, exc)
                wanted = None
            if wanted is not None:
                with self._lock:
                    for address in wanted:
                        member = self._members.setdefault(address, PoolMember(address, self._connect))
                        member.named = True
                    for member in self._members.values():
                        member.named = member.address in wanted
        for member in list(self._members.values()):
            if self._stop.is_set():
                return
            member.try_connect(now_s)
            if not member.named and member.open_here == 0:
                with self._lock:
                    self._members.pop(member.address, None)
                log.info("pool: sidecar %s left (no longer among %s)", member.address, self.address)
                member.close()

    def _ping(self, member: PoolMember) -> None:
        placed_at_ping = member.placed
        future = member.client.submit_ping(timeout_s=max(self.refresh_s * 4, 1.0))

        def done(finished: Future[float]) -> None:
            if finished.exception() is None:
                with self._lock:
                    member.reported(placed_at_ping)
        future.add_done_callback(done)

    def _monitor(self) -> None:
        while not self._stop.wait(self.refresh_s):
            try:
                self._refresh_members(time.monotonic())
                for member in list(self._members.values()):
                    if member.client is not None and member.answering:
                        self._ping(member)
                with self._lock:
                    movable = list(self._movable)
                self._moves.watch(movable)
            except Exception:  # the monitor must outlive any one sidecar's trouble
                log.exception("pool monitor: refresh failed")
