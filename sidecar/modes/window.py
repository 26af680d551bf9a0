"""Window streaming (vLLM-Omni's stateless chunked decode): a stream keeps its last ``left_context_frames``
committed inputs; each chunk decodes ``[kept context, own inputs]`` from a zero state and drops the context's
audio. No arena slot."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from ..work import DecodeItem
from .base import StreamMode

if TYPE_CHECKING:
    from ..streams import ServedStream


class WindowMode(StreamMode):
    name = "window"
    stateful = False
    keeps_inputs = True

    def left_context_frames(self, requested: int) -> int:
        return requested

    def kept_context(self, stream: ServedStream) -> Tensor | None:
        return stream.context_codes

    def build_item(self, stream: ServedStream, inputs: Tensor, context_frames: int,
                   out_device: bool = False) -> DecodeItem:
        prefix = stream.context_codes
        joined = inputs if prefix is None else torch.cat([prefix, inputs], dim=1)  # [C, c + n]
        skip = (0 if prefix is None else prefix.shape[1]) + context_frames
        return DecodeItem(codes=joined, slot=None, skip_frames=skip, out_device=out_device, options=stream.options)

    def commit(self, stream: ServedStream, inputs: Tensor) -> None:
        if not stream.left_context_frames:
            return
        joined = inputs if stream.context_codes is None else torch.cat([stream.context_codes, inputs], 1)
        stream.context_codes = joined[:, -stream.left_context_frames:].clone()  # [C, <=L]

    def bucket_sizes(self, graphs_cfg: Any) -> tuple[tuple[int, ...], tuple[int, ...]]:
        return tuple(graphs_cfg.window_batch_sizes), tuple(graphs_cfg.window_frames)
