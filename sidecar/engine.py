"""The engine: the only code that runs the model. Decodes a batch of chunks in one (or a few) forwards.

Mechanism only: the scheduler decides which chunks share a batch; the graph dispatcher decides whether a
captured graph serves it. Otherwise (CPU, no bucket, capture failed) the engine runs eager: pads the chunks
to a common length, gathers their state from the arena, runs the forward, and commits new state for
stateful rows only after the whole forward succeeded. Chunks longer than ``max_forward_frames`` are decoded
in slices with the state carried between slices, which is exact (the decoders are causal).
"""

from __future__ import annotations

import torch
from torch import Tensor

from .graphs.dispatcher import GraphChoice, GraphDispatcher
from .graphs.manager import GraphManager
from .graphs.routine import rows_audio, rows_options, rows_state
from .models import LoadedModel, StreamBatch
from .modes import StreamMode, mode_for
from .state_store import StateArena
from .work import DecodeItem

__all__ = ["Engine", "DecodeItem", "GraphChoice"]


class Engine:
    def __init__(self, model: LoadedModel, arena: StateArena, max_forward_frames: int = 256,
                 graphs: GraphDispatcher | GraphManager | None = None, metrics=None) -> None:
        self.model = model
        self.arena = arena
        self.max_forward_frames = max_forward_frames
        self.device = model.device
        if isinstance(graphs, GraphManager):
            graphs = GraphDispatcher(graphs, max_forward_frames, metrics)
        self.graphs = graphs
        self.metrics = metrics

    @torch.inference_mode()
    def decode(self, items: list[DecodeItem], may_capture: bool = True,
               mode: StreamMode | None = None) -> list[Tensor]:
        """Audio per item (float32 ``[(n - skip) * U]``): on the host, or for ``out_device`` items a device view
        valid until the next ``decode``. Stateless and stateful items may not mix. ``may_capture=False``: a batch
        whose graph is still to be captured runs eager instead (a capture holds the calling thread for long).
        ``mode``: the batch's stream mode (by default the one whose statefulness the items have)."""
        stateful = items[0].slot is not None
        if any((it.slot is not None) != stateful for it in items):
            raise ValueError("a batch mixes stateful and stateless chunks")
        if self.graphs is not None:
            outputs = self.graphs.run((mode or mode_for(stateful)).name, items, may_capture)
            if outputs is not None:
                return outputs
        return self._decode_eager(items, stateful)

    @property
    def captures_on_demand(self) -> bool:
        """Whether a batch may still need a graph captured first (graphs in ``lazy`` or ``startup_lazy`` mode)."""
        return self.graphs is not None and self.graphs.captures_on_demand

    def graph_choice(self, mode: str, row_frames: list[int]) -> GraphChoice:
        """The dispatcher's choice for a batch (no side effects); ``no_graphs`` without graphs."""
        if self.graphs is None:
            return GraphChoice(None, "no_graphs")
        return self.graphs.choose(mode, row_frames)

    def _decode_eager(self, items: list[DecodeItem], stateful: bool) -> list[Tensor]:
        batch = len(items)
        model = self.model
        num_frames = torch.tensor([it.codes.shape[1] for it in items], dtype=torch.long)  # [B]
        max_frames = int(num_frames.max())
        staged = model.input.staged_dtype(model.dtype)
        inputs = torch.zeros((batch, model.num_channels, max_frames), dtype=staged)  # [B, C, T] right-padded
        for b, it in enumerate(items):
            inputs[b, :, : it.codes.shape[1]] = it.codes
        inputs = inputs.to(self.device, non_blocking=True)
        num_frames_dev = num_frames.to(self.device)
        slots = torch.tensor([it.slot for it in items], dtype=torch.long, device=self.device) if stateful else None
        state, positions = rows_state(model, self.arena if stateful else None, slots, batch, self.device)
        options = rows_options(model, items, self.device)
        wav, state, positions = self.run(inputs, num_frames_dev, state, positions, options)  # [B, T * U]
        if stateful:
            self.arena.scatter(slots, state, positions)  # commit: only after the forward succeeded
        return rows_audio(wav, items, model.samples_per_frame)

    def run(self, inputs: Tensor, num_frames: Tensor, state: dict[str, Tensor], positions: Tensor,
            options: dict[str, Tensor] | None = None) -> tuple[Tensor, dict[str, Tensor], Tensor]:
        """Forward ``inputs`` ``[B, C, T]`` in time slices of at most ``max_forward_frames``; returns
        ``(wav [B, T * U], new state, new positions)``. Rows with no valid frames in a slice keep their state.
        ``options``: name -> ``[B]`` (missing: every row at the option's default)."""
        batch = inputs.shape[0]
        options = {**self.model.zero_options(batch), **(options or {})}
        outs = []
        total = inputs.shape[2]
        for start in range(0, total, self.max_forward_frames):
            piece = inputs[:, :, start: start + self.max_forward_frames]  # [B, C, t]
            valid = (num_frames - start).clamp(0, piece.shape[2])  # [B]
            wav, state = self.model.forward_stream(StreamBatch(piece, valid, positions, options), state)  # [B, t * U]
            positions = positions + valid
            outs.append(wav)
        return (outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)), state, positions
