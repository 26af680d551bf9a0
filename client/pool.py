"""``SidecarPool``: one client over several sidecars (a list of addresses, or a DNS name such as a Kubernetes
headless Service), with the single client's API: streams open on the best sidecar and stay there.

``client`` imports ``proto``, zmq, torch and numpy; it never imports ``sidecar``.

    with SidecarPool("dns://code2wav-sidecar.tts.svc.cluster.local:5555", timeout_s=30) as pool:
        s = pool.open_stream("req-1")              # placed by load (placement.py); the Stream is the sidecar's
        wav = s.decode(codes)                      # goes to the sidecar that opened it, always
        outs = pool.decode_batch([(s1, c1), (s2, c2)])   # one decode message per sidecar involved

Mechanism here, policy in ``placement.py``, addresses in ``discovery.py``, one sidecar in ``pool_member.py``, a
batch over several sidecars in ``pool_batch.py``. A
monitor thread pings every connected sidecar each ``refresh_s`` (the ``pong`` carries its load), re-resolves
a DNS name each ``resolve_interval_s`` and connects the sidecars that appear or come back. A sidecar that stops
answering heartbeats loses its streams at once (``StreamLost``, within ``DEAD_AFTER_INTERVALS`` heartbeat
intervals) and takes no new ones until it answers again; one that restarted (a new boot epoch) takes new ones
after its new handshake; one answering ``open_stream`` with ``busy`` or ``unavailable`` (draining) is skipped
for the next best before the caller sees an error. One address is a pool of one.
"""

from __future__ import annotations

import concurrent.futures
import itertools
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
from .errors import AlreadyExists, Busy, DeadlineExceeded, SidecarError, Unavailable, not_running
from .placement import rank
from .pool_batch import submit_pooled_batch
from .pool_member import PoolMember, caller_gpu_uuid
from .sender import WAIT_GRACE_S, set_exception, set_result
from .stream import Stream

__all__ = ["SidecarPool"]

log = logging.getLogger("code2wav.client")


class SidecarPool:
    """Several sidecars behind one client. Thread-safe; use as a context manager or call ``close()``."""

    def __init__(self, address: str | Sequence[str], *, timeout_s: float = 30.0, connect_timeout_s: float = 5.0,
                 refresh_s: float = 0.5, resolve_interval_s: float = 5.0, resolver: Resolver | None = None,
                 device: torch.device | int | None = None, **client_options: Any) -> None:
        """``address``: one address, several (a list or comma-separated) or ``dns://NAME:PORT``
        (``discovery.py``); ``resolver``: how a DNS name is resolved (default: the host's). ``device``: the
        caller's GPU, preferred for CUDA IPC (default: the current CUDA device when CUDA is in use).
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
        self._home: weakref.WeakKeyDictionary[Stream, PoolMember] = weakref.WeakKeyDictionary()
        self._by_id: weakref.WeakValueDictionary[str, Stream] = weakref.WeakValueDictionary()
        self._choices = itertools.count(1)
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

    def address_of(self, stream: Stream) -> str:
        """The address of the sidecar ``stream`` was opened on (where it stays)."""
        return self._home[stream].address

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
        is skipped for the next. The future raises the last such error when every sidecar refused."""
        kwargs = dict(mode=mode, left_context_frames=left_context_frames, model=model, timeout_s=timeout_s,
                      options=options)
        future: Future[Stream] = Future()
        tried: set[str] = set()
        last_error: list[SidecarError] = []
        live = self._by_id.get(stream_id)
        if live is not None and not live.closed and not live.lost:  # as one client refuses it (docs/client.md)
            set_exception(future, AlreadyExists(f"stream {stream_id!r} is already open in this pool (finish, abort "
                                                "or drop that Stream first)"))
            return future

        def attempt() -> None:
            with self._lock:
                order = [key for key in rank([m.candidate(self._gpu_uuid) for m in self._members.values()])
                         if key not in tried]
                member = self._members.get(order[0]) if order else None
                if member is not None:
                    tried.add(member.address)
                    member.placed += 1
                    member.last_chosen = next(self._choices)
            if member is None or member.client is None:
                set_exception(future, last_error[-1] if last_error else Unavailable(
                    f"no sidecar of the pool {self.address} takes streams now: {self._why_none()}"))
                return
            try:
                inner = member.client.submit_open_stream(stream_id, **kwargs)
            except SidecarError as exc:  # refused before sending (bad arguments): the same on every sidecar
                self._unplace(member, refused=False)
                set_exception(future, exc)
                return
            inner.add_done_callback(lambda done: settled(member, done))

        def settled(member: PoolMember, done: Future[Stream]) -> None:
            error = done.exception()
            if error is None:
                stream = done.result()
                with self._lock:
                    member.streams.add(stream)
                    self._home[stream] = member
                    self._by_id[stream_id] = stream
                set_result(future, stream)
                return
            retry = isinstance(error, (Busy, Unavailable)) and not isinstance(error, DeadlineExceeded)
            self._unplace(member, refused=retry)
            if not retry:
                set_exception(future, error)
                return
            log.info("pool: %s refused stream %r (%s); trying the next sidecar", member.address, stream_id, error)
            last_error.append(error)
            attempt()

        attempt()
        return future

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
        return submit_pooled_batch(items, self._home.get, return_exceptions, timeout_s)

    def decode_batch(self, items: Sequence[BatchItem], *, return_exceptions: bool = False,
                     timeout_s: float | None = None) -> list[Any]:
        return self._wait(self.submit_batch(items, return_exceptions=return_exceptions, timeout_s=timeout_s),
                          timeout_s)

    # ------------------------------------------------------------------ internals

    def _wait(self, future: Future[Any], timeout_s: float | None) -> Any:
        if threading.current_thread().name == "code2wav-client-io":
            raise RuntimeError("blocking call from a future callback (a client I/O thread); use submit...()")
        wait_s = (self.timeout_s if timeout_s is None else timeout_s) * 2 + WAIT_GRACE_S  # a retry may follow
        try:
            return future.result(wait_s)
        except concurrent.futures.TimeoutError:
            raise DeadlineExceeded(f"no reply from the pool {self.address} within {wait_s:g}s") from None

    def _unplace(self, member: PoolMember, refused: bool) -> None:
        with self._lock:
            member.placed -= 1
            member.placed_at_report = min(member.placed_at_report, member.placed)
            member.refused = member.refused or refused

    def _why_none(self) -> str:
        return "; ".join(f"{m.address}: " + ("answering" if m.answering else (m.last_error or "not answering"))
                         for m in list(self._members.values())) or "no addresses"

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
            except Exception:  # the monitor must outlive any one sidecar's trouble
                log.exception("pool monitor: refresh failed")
