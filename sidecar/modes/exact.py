"""Exact streaming: each stream holds an arena slot; a chunk continues its stream's decoder state, so the
joined audio equals the one-shot decode. The state itself is committed by the engine (arena scatter, only
after the forward succeeded); nothing else is kept."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from torch import Tensor

from ..work import DecodeItem
from .base import StreamMode

if TYPE_CHECKING:
    from ..streams import ServedStream


class ExactMode(StreamMode):
    name = "exact"
    stateful = True
    keeps_inputs = False

    def left_context_frames(self, requested: int) -> int:
        return 0  # the state is the context

    def kept_context(self, stream: ServedStream) -> Tensor | None:
        return None

    def build_item(self, stream: ServedStream, inputs: Tensor, context_frames: int,
                   out_device: bool = False) -> DecodeItem:
        return DecodeItem(codes=inputs, slot=stream.slot, skip_frames=context_frames, out_device=out_device,
                          options=stream.options)

    def commit(self, stream: ServedStream, inputs: Tensor) -> None:
        return None

    def bucket_sizes(self, graphs_cfg: Any) -> tuple[tuple[int, ...], tuple[int, ...]]:
        return tuple(graphs_cfg.exact_batch_sizes), tuple(graphs_cfg.exact_frames)
