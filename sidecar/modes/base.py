"""What a stream mode is: the few decisions in which exact and window streaming differ.

Sessions, the scheduler, the planner, graph set-up and offline decoding ask the stream's mode; none of them branches
on its name. A mode never touches sockets, the arena or the model: it decides what a chunk decodes (``build_item``),
what a stream keeps after a chunk succeeded (``commit``), whether a stream holds an arena slot (``stateful``), the
left context a stream keeps, and which graph buckets serve it (``bucket_sizes``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from torch import Tensor

from ..work import DecodeItem

if TYPE_CHECKING:
    from ..streams import ServedStream


class StreamMode:
    name: str = ""
    stateful: bool = False
    """True: the stream holds an arena slot and each chunk continues its state; False: chunks decode from a zero
    state (stateless rows)."""

    keeps_inputs: bool = False
    """True: ``commit`` keeps a chunk's inputs (on the host) for the next chunk, so inputs from a CUDA IPC region are
    read to the host; False: they stay on the device, copied into the step's inputs and checked there."""

    def left_context_frames(self, requested: int) -> int:
        """The left context a stream opened with ``requested`` keeps (echoed in ``opened``)."""
        raise NotImplementedError

    def kept_context(self, stream: ServedStream) -> Tensor | None:
        """Inputs ``[C, c]`` decoded ahead of a chunk's own, or None."""
        raise NotImplementedError

    def decoded_frames(self, stream: ServedStream, num_frames: int) -> int:
        """Frames the engine decodes for a chunk of ``num_frames`` frames: its own after the kept context."""
        kept = self.kept_context(stream)
        return num_frames + (0 if kept is None else kept.shape[1])

    def build_item(self, stream: ServedStream, inputs: Tensor, context_frames: int,
                   out_device: bool = False) -> DecodeItem:
        """What the engine decodes for a chunk of ``inputs`` ``[C, n]`` (on the host by now) whose first
        ``context_frames`` give no audio; ``out_device``: its audio stays on the device (a CUDA IPC region)."""
        raise NotImplementedError

    def commit(self, stream: ServedStream, inputs: Tensor) -> None:
        """After a chunk with ``inputs`` ``[C, n]`` produced its audio: keep what the next chunk needs."""
        raise NotImplementedError

    def bucket_sizes(self, graphs_cfg: Any) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """``(batch sizes, frame counts)`` of this mode's configured graph buckets."""
        raise NotImplementedError
