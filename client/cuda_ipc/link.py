"""When CUDA codes travel by IPC, and registering the regions; every fallback to inline is counted and its
reason logged once.

Inline fallbacks: the sidecar has no CUDA IPC (CPU-only, or turned off), runs on another host or another
GPU, the export or the registration failed, a region is full, or the regions would have to be registered
from inside a future callback (the client's I/O thread cannot wait for its own replies).
"""

from __future__ import annotations

import collections
import logging
import threading
from concurrent.futures import Future
from typing import TYPE_CHECKING, Any

import torch

from code2wav.proto import RegionRegistered, ServerMessage, UnregisterRegion, audio_num_samples, encode

from .._call import Call
from ..errors import SidecarError
from .channel import IpcChannel, IpcUnavailable, PackedChunk, gpu_uuid

if TYPE_CHECKING:
    from .._io import Connection

__all__ = ["IpcLink"]

log = logging.getLogger("code2wav.client")


def _resolve(future: Future) -> tuple[Any, Any]:
    def reply(msg: ServerMessage, _frames: list) -> None:
        future.set_result(msg)

    def failure(error: SidecarError, _outcome: str) -> None:
        future.set_exception(error)

    return reply, failure


class IpcLink:
    def __init__(self, conn: Connection, enabled: bool, host_id: str | None, codes_nbytes: int,
                 audio_nbytes: int, armed: bool = False) -> None:
        self._conn = conn
        self.enabled = enabled
        self.armed = armed  # arm chunks where the sidecar offers doorbells (else codes events)
        self.host_id = host_id
        self._codes_nbytes = codes_nbytes
        self._audio_nbytes = audio_nbytes
        self._channel: IpcChannel | None = None
        self._off: str | None = None  # a reason that holds for the rest of the connection
        self._failed: tuple[int, str] | None = None  # (session, reason): registration refused in that session
        self._last_reason = "not_registered: no chunk registered the regions yet"
        self._lock = threading.Lock()  # one registration at a time
        self.stats: collections.Counter[str] = collections.Counter()
        self._logged: set[str] = set()

    def fallback(self, reason: str, num_chunks: int = 1) -> None:
        self.stats["inline_fallback:" + reason.split(":")[0]] += num_chunks
        if reason not in self._logged:
            self._logged.add(reason)
            log.warning("CUDA codes sent inline instead of by CUDA IPC: %s", reason)

    def ready(self, device: torch.device) -> IpcChannel | None:
        """The registered channel for ``device`` in the current session, or None (never blocks)."""
        channel = self._channel
        if channel is None or channel.session != self._conn.session or channel.device.index != device.index:
            return None
        return channel

    def ensure(self, device: torch.device, timeout_s: float) -> str | None:
        """Make IPC usable for ``device`` (blocking: export and register once per session). Returns None when
        usable, else the reason it is not."""
        if self.ready(device) is not None:
            return None
        if self._off is not None:
            return self._off
        if self._failed is not None and self._failed[0] == self._conn.session:
            return self._failed[1]  # not again in this session: every chunk would pay two round trips
        if self._conn.on_io_thread:
            self._last_reason = ("registration_from_callback: regions are registered on the first chunk sent "
                                 "outside callbacks")
            return self._last_reason
        with self._lock:
            if self.ready(device) is not None:
                return None
            session = self._conn.session
            reason = self._why_not(device)
            if reason is None:
                reason = self._register(device, timeout_s)
                if reason is not None:
                    self._failed = (session, reason)
            if reason is not None:
                self._last_reason = reason
            return reason

    def _why_not(self, device: torch.device) -> str | None:
        welcome = self._conn.welcome
        caps = welcome.capabilities if welcome is not None else {}
        if not caps.get("cuda_ipc"):
            return "sidecar_without_cuda_ipc: the sidecar does not offer CUDA IPC (CPU-only or turned off)"
        server_host = caps.get("host_id")
        if self.host_id is None or server_host != self.host_id:
            self._off = f"different_host: the sidecar runs on host {server_host}, this client on {self.host_id}"
            return self._off
        if self._channel is not None and self._channel.device.index != device.index:
            return f"second_device: regions are on {self._channel.device}, codes are on {device}"
        uuid = gpu_uuid(device)
        if caps.get("gpu_uuid") != uuid:
            return f"different_gpu: codes are on {uuid}, the sidecar decodes on {caps.get('gpu_uuid')}"
        if self._channel is None:
            try:
                self._channel = IpcChannel(device, self._codes_nbytes, self._audio_nbytes)
            except IpcUnavailable as exc:
                self._off = f"export_failed: {exc}"
                return self._off
        return None

    def _register(self, device: torch.device, timeout_s: float) -> str | None:
        channel = self._channel
        assert channel is not None
        session = self._conn.session
        first = self._conn.next_request_id()
        self._conn.next_request_id()  # the audio region's request id is first + 1
        futures = []
        for msg in channel.register_messages(first):
            future: Future = Future()
            reply, failure = _resolve(future)
            self._conn.submit(Call(msg.request_id, encode(msg), timeout_s, reply, failure))
            futures.append(future)
        try:
            codes, audio = (f.result(timeout_s + 1.0) for f in futures)
        except Exception as exc:  # the sidecar refused (different GPU, open failed) or did not answer
            return f"register_failed: {exc}"
        if not isinstance(codes, RegionRegistered) or not isinstance(audio, RegionRegistered):
            return f"register_failed: unexpected replies {codes!r}, {audio!r}"
        try:
            channel.adopt(session, codes.region_id, audio.region_id, audio.events,
                          codes.doorbells if self.armed else None)
        except (IpcUnavailable, RuntimeError) as exc:
            self._off = f"register_failed: {exc}"
            return self._off
        log.info("CUDA IPC regions registered on %s: codes %d bytes (region %d), audio %d bytes (region %d)",
                 channel.uuid, self._codes_nbytes, codes.region_id, self._audio_nbytes, audio.region_id)
        return None

    def pack(self, planned: list) -> list[PackedChunk | None]:
        """Per ``(stream, sent chunk)``: its CUDA IPC placement, or None to send it inline (host codes, or a
        counted fallback). Called under the client's order lock; never blocks on the sidecar."""
        rows = [i for i, (_, chunk) in enumerate(planned) if isinstance(chunk.codes, torch.Tensor)]
        packed: list[PackedChunk | None] = [None] * len(planned)
        if not rows or not self.enabled:
            return packed
        device = planned[rows[0]][1].codes.device
        channel = self.ready(device)
        same_device = all(planned[i][1].codes.device == device for i in rows)
        if channel is None or not same_device:  # never registers here: this runs under the order lock
            self.fallback(self._last_reason if channel is None else "second_device: codes on several GPUs", len(rows))
            return packed
        num_samples = [audio_num_samples(planned[i][1].num_frames, planned[i][1].context_frames,
                                         planned[i][0].samples_per_frame) for i in rows]
        arm = all(planned[i][0].mode == "exact" for i in rows)  # a window stream's codes are read on the host
        placed = channel.pack([planned[i][1].codes for i in rows], num_samples, arm)
        if placed is None:
            self.fallback("region_full: codes or audio views in flight fill the regions, or every codes event "
                          "is named by a message in flight", len(rows))
            return packed
        for i, ipc in zip(rows, placed):
            packed[i] = ipc
        self.stats["ipc_chunks"] += len(rows)
        if placed[0].codes_token is not None:
            self.stats["ipc_armed"] += len(rows)
        return packed

    def close(self, timeout_s: float = 1.0) -> None:
        """Unregister (waiting for the sidecar to close them, bounded) and free the regions."""
        channel, self._channel = self._channel, None
        if channel is None:
            return
        if channel.session == self._conn.session and not self._conn.on_io_thread:
            futures = []
            for region_id in (channel.codes_region, channel.audio_region):
                future: Future = Future()
                reply, failure = _resolve(future)
                request_id = self._conn.next_request_id()
                self._conn.submit(Call(request_id, encode(UnregisterRegion(request_id, region_id)), timeout_s,
                                       reply, failure))  # fails at once when the sidecar is known dead
                futures.append(future)
            for future in futures:
                try:
                    future.result(timeout_s + 0.5)
                except Exception as exc:  # the server frees them on bye / TTL anyway
                    log.info("unregistering a CUDA IPC region: %s", exc)
        channel.close()
