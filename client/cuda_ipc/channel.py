"""One connection's CUDA IPC state: two exported regions (codes in, audio out), their events, their slots.

Ordering (no device-wide synchronisation anywhere):
- Codes: each chunk's codes are copied into a slot of the codes region on the caller's current stream (where
  they were made), and one of the client's interprocess events is recorded after the copy. Nobody blocks on
  it: the sidecar decodes the chunk once that event is complete (until then the chunk waits in its queue),
  so the caller's thread goes on at once and the sidecar never waits on unfinished client work. A codes slot
  and its event are reusable once the chunk's reply arrives (the sidecar read it before replying; see
  ``slots.EventPool`` for why an event named by a chunk in flight is never recorded again); the caller's codes
  tensor is kept alive until then by the stream's unacknowledged-chunk record.
- Audio: the sidecar writes into a slot of the audio region, records one of its events after the write and
  replies at once (the reply overlaps the decode). ``audio_tensor`` makes the sending caller's stream wait
  for that event (``cudaStreamWaitEvent``, no host wait) before handing out the view: work queued on that
  stream sees the finished audio, as with torch's own non-blocking copies; another stream or a host read
  through raw pointers must synchronise with that stream first.
- Armed (the sidecar returned ``doorbells`` with the codes region, and the link arms): before the event, the
  caller's stream writes the message's token into the sidecar's doorbell word of the event's index
  (``cuStreamWriteValue32``; the words are shared host memory, ``code2wav.cudart.doorbell_words``, mapped here and
  registered for the GPU). The sidecar queues the step behind a GPU wait for it, without looking at the event:
  the decode starts when the codes land, with no CPU round trip after them. Each word's tokens grow by 2 (the
  sidecar releases a word with the odd token + 1); a word, like an event, serves one message in flight. An armed
  chunk's slot and event are reused only once its event completed: one refused before its codes came (the sidecar
  released its wait) may still have its copy queued.
- Early audio (a stream opened with ``early_audio``): the reply leaves at the step's launch, before the step has
  read the codes, so the chunk's codes slot and event are reused only once the audio event the reply names (recorded
  after the step) completed.
- An audio view is released when the last tensor using it is freed. Its slot is reused only by a later
  chunk, and the sidecar writes into it only after that chunk's codes event, recorded on the sender's
  current stream: work queued on that stream with the view is therefore finished first.
  (As with torch's caching allocator, work on another stream must be synchronised by the caller.)
"""

from __future__ import annotations

import logging
import threading
import weakref
from dataclasses import dataclass

import torch

from code2wav.proto import CudaIpcLoc, RegisterRegion, TensorDesc

from code2wav.cudart import Runtime, runtime
from code2wav.cudart.doorbell_words import WORD_NBYTES, DoorbellWords
from .slots import EventPool, SlotAllocator, next_token

__all__ = ["IpcChannel", "IpcUnavailable", "PackedChunk", "gpu_uuid"]

log = logging.getLogger("code2wav.client")

NUM_CODES_EVENTS = 64
"""The most a region may register (``proto.MAX_REGION_EVENTS``): one per message in flight."""
_WIRE_DTYPES = {torch.int16: "int16", torch.int32: "int32", torch.int64: "int64", torch.float32: "float32",
                torch.bfloat16: "bfloat16", torch.float16: "float16"}


class IpcUnavailable(Exception):
    """CUDA IPC cannot be used; the message is the reason (the client falls back to inline tensors)."""


def gpu_uuid(device: torch.device) -> str:
    text = str(torch.cuda.get_device_properties(device).uuid)
    return text if text.startswith("GPU-") else f"GPU-{text}"


class _Lease:
    """Device memory as a CUDA array interface; for audio it owns its slot while any tensor uses it (torch
    keeps this object alive as long as the tensor's storage)."""

    def __init__(self, pointer: int, count: int, typestr: str) -> None:
        self.__cuda_array_interface__ = {"shape": (count,), "typestr": typestr, "data": (pointer, False),
                                         "version": 2, "strides": None}


class _ExportedRegion:
    def __init__(self, rt: Runtime, device: torch.device, nbytes: int) -> None:
        self.nbytes = nbytes
        self.pointer = rt.malloc(nbytes, device.index)
        self.handle = rt.export(self.pointer).hex()
        self.slots = SlotAllocator(nbytes)


@dataclass
class PackedChunk:
    channel: IpcChannel
    codes: TensorDesc
    codes_event: int
    codes_token: int | None  # armed: the token written into the doorbell word ``codes_event`` after the codes
    audio_out: TensorDesc
    codes_offset: int
    audio_offset: int
    stream: torch.cuda.Stream  # the caller's stream when it sent the chunk: the audio is ordered on it


class IpcChannel:
    def __init__(self, device: torch.device, codes_nbytes: int, audio_nbytes: int,
                 num_events: int = NUM_CODES_EVENTS) -> None:
        if device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        self.device = device
        try:
            self._rt = runtime()
            self.uuid = gpu_uuid(device)
            self._codes = _ExportedRegion(self._rt, device, codes_nbytes)
            self._audio = _ExportedRegion(self._rt, device, audio_nbytes)
        except (OSError, RuntimeError) as exc:
            raise IpcUnavailable(f"cannot export device memory: {exc}") from None
        with torch.cuda.device(device):
            self._events = [torch.cuda.Event(interprocess=True) for _ in range(num_events)]
        self._event_pool = EventPool(num_events)
        self._lock = threading.Lock()  # slots and released audio
        self._released: list[int] = []  # audio offsets whose tensors died, not yet fenced
        # answered chunks' (codes offset, event index, events that must complete before both are reused)
        self._fenced: list[tuple[int, int, tuple]] = []
        self._live_audio = 0
        self.codes_region: int | None = None
        self.audio_region: int | None = None
        self.session: int | None = None  # the connection session the regions were registered in
        self._server_events: list = []
        self._doorbells: int | None = None  # the device pointer of the sidecar's doorbell words (armed); None: events
        self._doorbell_words: DoorbellWords | None = None  # their mapping here
        self._tokens = [0] * num_events  # the last token written into each doorbell word
        self.closed = False

    # ------------------------------------------------------------------ registration
    def register_messages(self, first_request_id: int) -> tuple[RegisterRegion, RegisterRegion]:
        handles = tuple(ev.ipc_handle().hex() for ev in self._events)
        return (RegisterRegion(first_request_id, self.uuid, self._codes.handle, self._codes.nbytes, "read", handles),
                RegisterRegion(first_request_id + 1, self.uuid, self._audio.handle, self._audio.nbytes, "write"))

    def adopt(self, session: int, codes_region: int, audio_region: int, server_events: tuple[str, ...],
              doorbells: str | None = None) -> None:
        """The regions' ids and the sidecar's audio events; ``doorbells``: the name of the sidecar's doorbell words
        (armed chunks from now on), None: codes events."""
        if not server_events:
            raise IpcUnavailable("the sidecar returned no events for the audio region")
        self._server_events = [torch.cuda.Event.from_ipc_handle(self.device, bytes.fromhex(h)) for h in server_events]
        self._close_doorbells()  # the last session's words, if any: this registration's (or none) replace them
        with self._lock:  # the last session's audio events fence nothing any more: its regions are closed (or its
            # sidecar gone), so nothing of it reads a codes slot now; a fence that waits on one would hold its slot
            own = {id(event) for event in self._events}  # (the client's own codes events still fence)
            self._fenced = [(offset, index, tuple(e for e in fences if id(e) in own))
                            for offset, index, fences in self._fenced]
        if doorbells is not None:
            try:
                self._open_doorbells(doorbells)
            except (OSError, ValueError, RuntimeError) as exc:  # (CudaIpcError) codes events still work
                log.warning("the sidecar's doorbells %s cannot be opened (%s: %s): CUDA IPC chunks go unarmed "
                            "(the sidecar and this client need one /dev/shm and the same user)", doorbells,
                            type(exc).__name__, exc)
            self._tokens = [0] * len(self._tokens)  # the new words start at zero
        self.codes_region, self.audio_region, self.session = codes_region, audio_region, session

    @property
    def armed(self) -> bool:
        """Chunks are armed (the sidecar waits on the GPU for each message's doorbell token)."""
        return self._doorbells is not None

    def _next_token(self, word: int) -> int:
        """The next token of doorbell ``word`` (``slots.next_token``)."""
        self._tokens[word] = token = next_token(self._tokens[word])
        return token

    # ------------------------------------------------------------------ per message (under the client's order lock)
    def pack(self, codes: list[torch.Tensor], num_samples: list[int], arm: bool = True) -> list[PackedChunk] | None:
        """Copy each chunk's codes into the codes region, reserve its audio slot and an event; None when a region
        is full or every event is named by a chunk still in flight. ``arm``: the message may be armed (every chunk's
        stream is exact) where the sidecar offers doorbells."""
        with self._lock:
            released, self._released = self._released, []
            for offset in released:
                self._audio.slots.free(offset)
            if self._fenced:
                self._free_fenced()
            codes_offsets: list[int] = []
            audio_offsets: list[int] = []
            for tensor, samples in zip(codes, num_samples):
                codes_offset = self._codes.slots.alloc(tensor.nbytes)
                audio_offset = self._audio.slots.alloc(samples * 4) if codes_offset is not None else None
                if audio_offset is None:
                    if codes_offset is not None:
                        self._codes.slots.free(codes_offset)
                    self._free(codes_offsets, audio_offsets)
                    return None
                codes_offsets.append(codes_offset)
                audio_offsets.append(audio_offset)
            event_index = self._event_pool.alloc(len(codes))
            if event_index is None:
                self._free(codes_offsets, audio_offsets)
                return None
        caller = torch.cuda.current_stream(self.device.index)  # codes were made there; released audio views too
        for tensor, offset in zip(codes, codes_offsets):  # contiguous, on this device (``cuda_wire_codes``)
            self._rt.copy_async(self._codes.pointer + offset, tensor.data_ptr(), tensor.nbytes, caller.cuda_stream)
        token = None
        if arm and self._doorbells is not None:  # armed: the word, written behind the copies, is what it waits on
            token = self._next_token(event_index)
            with torch.cuda.device(self.device):  # the driver call needs this device's context current
                self._rt.write_value32(self._doorbells + WORD_NBYTES * event_index, token, caller.cuda_stream)
        # the event, after the word: what the sidecar polls for an unarmed chunk (or one of a region it disarmed),
        # and what tells this client that its copy is done before it reuses the slot of a refused armed chunk
        self._events[event_index].record(caller)
        packed = []
        for tensor, samples, codes_offset, audio_offset in zip(codes, num_samples, codes_offsets, audio_offsets):
            codes_desc = TensorDesc(_WIRE_DTYPES[tensor.dtype], tuple(tensor.shape),
                                    CudaIpcLoc(self.codes_region, codes_offset, tensor.nbytes))
            audio_desc = TensorDesc("float32", (samples,), CudaIpcLoc(self.audio_region, audio_offset, samples * 4))
            packed.append(PackedChunk(self, codes_desc, event_index, token, audio_desc, codes_offset, audio_offset,
                                      caller))
        return packed

    def release(self, packed: PackedChunk, audio_used: bool, audio_event: int | None = None) -> None:
        """The chunk's reply arrived: its codes slot and event are free, but an armed chunk's only once its event is
        complete (refused before its codes came, its copy may still be queued), and with ``audio_event`` (an early
        audio reply: sent at the step's launch, before the step read the codes) only once that audio event of the
        sidecar's is complete; its audio slot too unless a view now owns it."""
        with self._lock:
            fences = []
            if packed.codes_token is not None:
                fences.append(self._events[packed.codes_event])
            if audio_event is not None:
                fences.append(self._server_events[audio_event])
            if fences:
                self._fenced.append((packed.codes_offset, packed.codes_event, tuple(fences)))
            else:
                self._codes.slots.free(packed.codes_offset)
                self._event_pool.free(packed.codes_event)
            if not audio_used:
                self._audio.slots.free(packed.audio_offset)

    def _free_fenced(self) -> None:
        """Free the codes slots and events of answered chunks whose fences completed (one query each)."""
        waiting = []
        for codes_offset, event_index, fences in self._fenced:
            if all(event.query() for event in fences):
                self._codes.slots.free(codes_offset)
                self._event_pool.free(event_index)
            else:
                waiting.append((codes_offset, event_index, fences))
        self._fenced = waiting

    def _free(self, codes_offsets: list[int], audio_offsets: list[int]) -> None:
        for offset in codes_offsets:
            self._codes.slots.free(offset)
        for offset in audio_offsets:
            self._audio.slots.free(offset)

    def audio_tensor(self, packed: PackedChunk, event_index: int) -> torch.Tensor:
        """A float32 view of the chunk's audio slot, ordered on the sender's stream after the sidecar's write."""
        packed.stream.wait_event(self._server_events[event_index])
        num_samples = packed.audio_out.shape[0]
        lease = _Lease(self._audio.pointer + packed.audio_offset, num_samples, "<f4")
        with self._lock:
            self._live_audio += 1
        weakref.finalize(lease, self._on_view_freed, packed.audio_offset)
        return torch.as_tensor(lease, device=self.device)  # [num_samples] float32

    def _on_view_freed(self, offset: int) -> None:
        with self._lock:
            self._live_audio -= 1
            if not self.closed:
                self._released.append(offset)

    # ------------------------------------------------------------------ teardown
    def stats(self) -> dict[str, int]:
        with self._lock:
            if self._fenced:
                self._free_fenced()
            return {"codes_bytes_in_use": self._codes.slots.used_nbytes,
                    "audio_bytes_in_use": self._audio.slots.used_nbytes, "live_audio_views": self._live_audio}

    def _open_doorbells(self, name: str) -> None:
        """Map the sidecar's doorbell file ``name``, register it for the GPU, remove its name (both processes have
        it mapped now: nobody else needs to find it)."""
        words = DoorbellWords.open(name, len(self._tokens))
        try:
            with torch.cuda.device(self.device):
                pointer = self._rt.host_register(words.address, words.nbytes)
        except Exception:
            words.close()
            raise
        words.unlink()
        self._doorbell_words, self._doorbells = words, pointer

    def _close_doorbells(self) -> None:
        if self._doorbell_words is not None:
            words, self._doorbell_words, self._doorbells = self._doorbell_words, None, None
            torch.cuda.synchronize(self.device)  # no write into the words still queued on a caller's stream
            self._rt.host_unregister(words.address)
            words.close()

    def close(self) -> None:
        """Free both regions (after the sidecar unregistered them). Audio views still alive keep the audio
        region: it is then left allocated, with a warning, rather than freed under them."""
        if self.closed:
            return
        self.closed = True
        try:
            self._close_doorbells()
            self._rt.free(self._codes.pointer)
            with self._lock:
                live = self._live_audio
            if live:
                log.warning("%d CUDA audio views are still alive; their region (%d bytes) stays allocated",
                            live, self._audio.nbytes)
            else:
                self._rt.free(self._audio.pointer)
        except RuntimeError as exc:
            log.warning("freeing CUDA IPC regions failed: %s", exc)
