"""The engine: the only code that runs the model. Decodes a batch of chunks in one (or a few) forwards.

Mechanism only: the scheduler decides which chunks share a batch; the graph plan decides the bucket. On a
captured bucket the engine replays its graph; otherwise (CPU, no bucket, capture failed) it runs eager:
pads the chunks to a common length, gathers their state from the arena, runs the forward, and commits new
state for stateful rows only after the whole forward succeeded. Chunks longer than ``max_forward_frames``
are decoded in slices with the state carried between slices, which is exact (the decoder is causal).
"""

from __future__ import annotations

import torch
from torch import Tensor

from .graphs.manager import GraphManager
from .graphs.plan import dispatch, extra_bucket
from .models import LoadedModel
from .models.routine import rows_audio, rows_state
from .state_store import StateArena
from .work import DecodeItem

__all__ = ["Engine", "DecodeItem"]


class Engine:
    def __init__(self, model: LoadedModel, arena: StateArena, max_forward_frames: int = 256,
                 graphs: GraphManager | None = None, metrics=None) -> None:
        self.model = model
        self.arena = arena
        self.max_forward_frames = max_forward_frames
        self.device = model.device
        self.graphs = graphs
        self.metrics = metrics

    @torch.inference_mode()
    def decode(self, items: list[DecodeItem]) -> list[Tensor]:
        """Audio per item (float32 ``[(n - skip) * U]``): on the host, or for ``out_device`` items a device view
        valid until the next ``decode``. Stateless and stateful items may not mix."""
        stateful = items[0].slot is not None
        if any((it.slot is not None) != stateful for it in items):
            raise ValueError("a batch mixes stateful and stateless chunks")
        if self.graphs is not None:
            outputs = self._try_graph("exact" if stateful else "window", items)
            if outputs is not None:
                return outputs
        return self._decode_eager(items, stateful)

    def _try_graph(self, mode: str, items: list[DecodeItem]) -> list[Tensor] | None:
        graphs = self.graphs
        row_frames = [it.codes.shape[1] for it in items]
        choice = dispatch(graphs.usable_buckets(), mode, len(items), row_frames)
        key = choice.key
        reason = choice.reason
        if key is None and dispatch(tuple(graphs.buckets), mode, len(items), row_frames).key is not None:
            reason = "not_captured"  # a configured bucket fits, but its capture failed or was skipped
        if key is None and reason in ("frames_too_long", "batch_too_large"):
            largest = max((k for k in graphs.buckets if k.mode == mode), key=lambda k: k.cost, default=None)
            if largest is not None:
                extra = extra_bucket(mode, len(items), max(row_frames), largest.batch, self.max_forward_frames)
                if extra is not None and graphs.capture_extra(extra):
                    key = extra
        if key is not None and not graphs.ready(key):  # a lazy capture that failed just now
            reason, key = "not_captured", None
        if key is None:
            if self.metrics is not None:
                self.metrics.graph_misses.labels(component=mode, reason=reason).inc()
            return None
        return graphs.run(key, items)  # an error here propagates: no silent eager retry after replay started

    def _decode_eager(self, items: list[DecodeItem], stateful: bool) -> list[Tensor]:
        batch = len(items)
        num_frames = torch.tensor([it.codes.shape[1] for it in items], dtype=torch.long)  # [B]
        max_frames = int(num_frames.max())
        num_q = items[0].codes.shape[0]
        codes = torch.zeros((batch, num_q, max_frames), dtype=torch.long)  # [B, Q, T] right-padded
        for b, it in enumerate(items):
            codes[b, :, : it.codes.shape[1]] = it.codes
        codes = codes.to(self.device, non_blocking=True)
        num_frames_dev = num_frames.to(self.device)
        slots = torch.tensor([it.slot for it in items], dtype=torch.long, device=self.device) if stateful else None
        state, positions = rows_state(self.model.module, self.arena if stateful else None, slots, batch, self.device)
        wav, state, positions = self.run(codes, num_frames_dev, state, positions)  # [B, T * U]
        if stateful:
            self.arena.scatter(slots, state, positions)  # commit: only after the forward succeeded
        return rows_audio(wav, items, self.model.samples_per_frame)

    def run(self, codes: Tensor, num_frames: Tensor, state: dict[str, Tensor],
            positions: Tensor) -> tuple[Tensor, dict[str, Tensor], Tensor]:
        """Forward ``codes`` ``[B, Q, T]`` in time slices of at most ``max_forward_frames``; returns
        ``(wav [B, T * U], new state, new positions)``. Rows with no valid frames in a slice keep their state."""
        module = self.model.module
        outs = []
        total = codes.shape[2]
        for start in range(0, total, self.max_forward_frames):
            piece = codes[:, :, start: start + self.max_forward_frames]  # [B, Q, t]
            valid = (num_frames - start).clamp(0, piece.shape[2])  # [B]
            wav, state = module.forward_stream(piece, valid, state, positions)  # [B, t * U]
            positions = positions + valid
            outs.append(wav)
        return (outs[0] if len(outs) == 1 else torch.cat(outs, dim=1)), state, positions
