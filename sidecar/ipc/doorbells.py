"""The device-armed hand-off's doorbells (proto/README.md, section 3): words a client's GPU stream writes a token into
after its codes, which a step waits for on the GPU instead of the loop polling the client's event.

Mechanism only. A ``read`` region's ``Doorbells`` are a file of shared host memory (``code2wav.cudart.doorbell_words``:
one 32-bit word per event the client registered, zero at first), registered for the GPU here and by the client. An
armed chunk's ``ArmedInputs`` names its word and token:

- ``queue_wait``: on the engine stream, before the step reads the row's codes: the stream waits until the word
  reaches the token (cyclic ``>=``). The engine then snapshots the word into the step's gates and only then copies
  the codes: a word equal to the token means the client's codes before it are written (the sidecar never writes the
  token itself, only the token + 1).
- ``release``: the watchdog (``watchdog.DoorbellWatchdog``, a thread of its own), ``armed_wait_s`` after the wait was
  queued (the client died, or its codes did not come): a word still behind its token is raised to the token + 1,
  from the CPU, so the wait ends and the snapshot refuses the row (``ROW_NOT_READY``, its state kept). No GPU queue
  and no other thread is involved, so nothing queued on the GPU and no thread blocked on the device can hold the
  release up. A word that reached its token, or passed it, is left alone: an armed row of another
  client in the same step, rung in time, is still decoded.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field

import torch

from code2wav.cudart.doorbell_words import WORD_NBYTES, DoorbellWords

from .cudart import Cudart

__all__ = ["DeviceBytes", "Doorbells", "ArmedInputs", "as_int32", "release_due"]

log = logging.getLogger(__name__)


class DeviceBytes:
    """A raw device allocation (or host memory mapped for the device) as a CUDA array interface (torch wraps it
    without copying)."""

    def __init__(self, pointer: int, nbytes: int) -> None:
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (pointer, False),
                                         "version": 2, "strides": None}


def as_int32(token: int) -> int:
    """A 32-bit word's value as the int32 tensors that hold it (tokens run to 2^32 - 2)."""
    return token - (1 << 32) if token >= 1 << 31 else token


class Doorbells:
    """A read region's doorbell words: ``shared`` (the host mapping; its ``name`` goes to the client), registered for
    the GPU at ``device_pointer``; ``words`` is the device's int32 view of them (the step's snapshot reads it)."""

    def __init__(self, cudart: Cudart, device: torch.device, num_words: int) -> None:
        self.cudart = cudart
        self.shared = DoorbellWords.create(num_words)
        try:
            with torch.cuda.device(device):  # registered against the engine's device: torch then places the view there
                self.device_pointer = cudart.host_register(self.shared.address, self.shared.nbytes)
            try:
                block = torch.as_tensor(DeviceBytes(self.device_pointer, self.shared.nbytes), device=device)  # [nbytes]
                self.words = block[: num_words * WORD_NBYTES].view(torch.int32)  # [E] int32, host memory
            except Exception:
                cudart.host_unregister(self.shared.address)
                raise
        except Exception:
            self.shared.close()
            raise
        self.released = False  # an armed chunk of the region was refused not ready: its later chunks go unarmed

    @property
    def name(self) -> str:
        """What ``region_registered.doorbells`` sends the client: the shared file's name."""
        return self.shared.name

    def armed(self, index: int, token: int) -> ArmedInputs:
        return ArmedInputs(self, index, token)

    def close(self) -> None:
        """Unmap the words: the caller has synchronised the engine stream (no wait still reads them)."""
        self.words = None  # type: ignore[assignment]
        self.cudart.host_unregister(self.shared.address)
        self.shared.close()


@dataclass(eq=False)
class ArmedInputs:
    """One armed chunk: its codes are ready once word ``index`` of ``doorbells`` reaches ``token`` (even)."""

    doorbells: Doorbells
    index: int
    token: int
    queued_s: float | None = field(default=None)  # monotonic: when its wait was queued on the engine stream
    released: bool = False

    @property
    def word(self) -> torch.Tensor:
        return self.doorbells.words[self.index: self.index + 1]  # [1] int32: the device's view of the host word

    @property
    def token_int32(self) -> int:
        return as_int32(self.token)

    def queue_wait(self, device: torch.device) -> None:
        """``device``'s current stream (the engine's) waits on the GPU until the word reaches the token."""
        bells = self.doorbells
        with torch.cuda.device(device):  # the driver call needs the device's context current on this thread
            stream = torch.cuda.current_stream(device).cuda_stream
            bells.cudart.wait_value32(bells.device_pointer + WORD_NBYTES * self.index, self.token, stream)
        self.queued_s = time.monotonic()

    def release(self) -> None:
        """From the CPU: a word still behind the token (cyclic) becomes the token + 1; any other is left as it is
        (``DoorbellWords.raise_behind``). Ends a wait queued for the token; the step's snapshot then refuses the row
        (``ROW_NOT_READY``, which disarms the region: ``step_rows.split_outcomes``). A word rung in time is untouched
        and its row decoded: whether this release mattered is known only from the row's outcome."""
        self.doorbells.shared.raise_behind(self.index, self.token)
        self.released = True


def release_due(waits: list[tuple[str, int, ArmedInputs]], wait_s: float, now_s: float, why: str) -> int:
    """Release the armed chunks among ``waits`` (``(stream_id, seq, ArmedInputs)``) whose wait was queued ``wait_s``
    or more before ``now_s`` (again, if the watchdog comes back to them: a word that reached its token is left alone;
    a wait not queued yet needs none). Logs (with ``why``) each chunk's first release; returns how many were
    released now. The rows' outcomes say which were not rung (those are counted and disarm their regions,
    ``step_rows.split_outcomes``): a release also reaches the words of the step's other armed chunks, rung in time
    or not. A release that fails is logged: the device is then failing, and the next step reports it."""
    due = [(stream_id, seq, armed) for stream_id, seq, armed in waits
           if armed.queued_s is not None and now_s - armed.queued_s >= wait_s]
    first = [stream_id for stream_id, _, armed in due if not armed.released]
    failed = []
    for stream_id, seq, armed in due:  # the stores first: logging can block (a handler's lock, a full stderr pipe)
        try:
            armed.release()
        except Exception as exc:
            failed.append((stream_id, seq, exc))
    if first:
        log.warning("releasing the doorbell waits of %d armed CUDA IPC chunk(s): %s (streams %s); a chunk whose "
                    "word was not rung by then fails deadline_exceeded", len(first), why, ", ".join(sorted(set(first))))
    for stream_id, seq, exc in failed:
        log.error("releasing the doorbell of stream %s seq %d failed", stream_id, seq, exc_info=exc)
    return len(due)

