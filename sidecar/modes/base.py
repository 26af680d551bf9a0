"""What a stream mode is: the few decisions in which exact and window streaming differ.

The scheduler, sessions, engine and graph set-up ask the stream's mode; none of them branches on its name.
A mode never touches sockets, the arena or the model: it decides what a chunk decodes (``build_item``),
what a stream keeps after a chunk succeeded (``commit``), whether a stream holds an arena slot
(``stateful``), and which graph buckets serve it (``bucket_sizes``).
"""

from __future__ import annotations

from typing import Any, Protocol

from torch import Tensor

from ..work import DecodeItem


class StreamLike(Protocol):  # the fields of ``streams.Stream`` a mode reads and writes
    left_context_frames: int
    slot: int | None
    context_codes: Tensor | None
    options: dict[str, int]


class JobLike(Protocol):  # the fields of ``scheduler.ChunkJob`` a mode reads
    stream: Any
    codes: Any  # Tensor [C, n]
    context_frames: int
    audio_out: tuple | None


class StreamMode:
    name: str = ""
    stateful: bool = False
    """True: the stream holds an arena slot and each chunk continues its state; False: chunks decode from a zero
    state (stateless rows)."""

    def left_context_frames(self, requested: int) -> int:
        """The left context a stream opened with ``requested`` keeps (echoed in ``opened``)."""
        raise NotImplementedError

    def kept_context(self, stream: StreamLike) -> Tensor | None:
        """Inputs ``[C, c]`` decoded ahead of a chunk's own, or None."""
        raise NotImplementedError

    def build_item(self, job: JobLike) -> DecodeItem:
        """What the engine decodes for ``job`` (engine thread: its inputs are on the host by now)."""
        raise NotImplementedError

    def commit(self, stream: StreamLike, inputs: Tensor) -> None:
        """After a chunk with ``inputs`` ``[C, n]`` produced its audio: keep what the next chunk needs."""
        raise NotImplementedError

    def bucket_sizes(self, graphs_cfg: Any) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """``(batch sizes, frame counts)`` of this mode's configured graph buckets."""
        raise NotImplementedError
