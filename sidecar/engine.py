"""The engine: the only code that runs the model. Decodes a batch of chunks in one (or a few) forwards.

Mechanism only: the scheduler decides which chunks share a batch; the graph plan decides the bucket. On a
captured bucket the engine replays its graph; otherwise (CPU, no bucket, capture failed) it runs eager:
pads the chunks to a common length, gathers their state from the arena, runs the forward, and commits new
state for stateful rows only after the whole forward succeeded. Chunks longer than ``max_forward_frames``
are decoded in slices with the state carried between slices, which is exact (the decoder is causal).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from .graphs.manager import GraphManager
from .graphs.plan import BucketKey, dispatch, extra_bucket
from .models import LoadedModel
from .models.routine import rows_audio, rows_state
from .state_store import StateArena
from .work import DecodeItem

__all__ = ["Engine", "DecodeItem", "GraphChoice"]


@dataclass(frozen=True)
class GraphChoice:
    """The graph bucket a batch would replay (``needs_capture``: captured on first use), or None and why not."""

    key: BucketKey | None
    reason: str = ""
    needs_capture: bool = False


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
    def decode(self, items: list[DecodeItem], may_capture: bool = True) -> list[Tensor]:
        """Audio per item (float32 ``[(n - skip) * U]``): on the host, or for ``out_device`` items a device view
        valid until the next ``decode``. Stateless and stateful items may not mix. ``may_capture=False``: a batch
        whose graph is still to be captured runs eager instead (a capture holds the calling thread for long)."""
        stateful = items[0].slot is not None
        if any((it.slot is not None) != stateful for it in items):
            raise ValueError("a batch mixes stateful and stateless chunks")
        if self.graphs is not None:
            outputs = self._try_graph("exact" if stateful else "window", items, may_capture)
            if outputs is not None:
                return outputs
        return self._decode_eager(items, stateful)

    @property
    def captures_on_demand(self) -> bool:
        """Whether a batch may still need a graph captured first (graphs in ``lazy`` or ``startup_lazy`` mode)."""
        return self.graphs is not None and self.graphs.mode != "startup"

    def graph_choice(self, mode: str, row_frames: list[int]) -> GraphChoice:
        """Policy, no side effects: the bucket a batch with rows of ``row_frames`` frames would replay, and
        whether it must be captured first; or no bucket, and why the batch would run eager."""
        graphs = self.graphs
        if graphs is None:
            return GraphChoice(None, "no_graphs")
        num_rows = len(row_frames)
        choice = dispatch(graphs.usable_buckets(), mode, num_rows, row_frames)
        if choice.key is not None:
            return GraphChoice(choice.key, needs_capture=not graphs.is_captured(choice.key))
        if dispatch(tuple(graphs.buckets), mode, num_rows, row_frames).key is not None:
            return GraphChoice(None, "not_captured")  # a configured bucket fits, but its capture failed or was skipped
        if choice.reason in ("frames_too_long", "batch_too_large"):
            largest = max((k for k in graphs.buckets if k.mode == mode), key=lambda k: k.cost, default=None)
            if largest is not None:
                extra = extra_bucket(mode, num_rows, max(row_frames), largest.batch, self.max_forward_frames)
                if extra is not None and graphs.may_capture_extra(extra):
                    return GraphChoice(extra, choice.reason, needs_capture=not graphs.is_captured(extra))
        return GraphChoice(None, choice.reason)

    def _try_graph(self, mode: str, items: list[DecodeItem], may_capture: bool) -> list[Tensor] | None:
        graphs = self.graphs
        choice = self.graph_choice(mode, [it.codes.shape[1] for it in items])
        key, reason = choice.key, choice.reason
        if key is not None and choice.needs_capture and not may_capture:
            key, reason = None, "capture_deferred"  # captured by the next such batch on the worker thread
        if key is not None and key not in graphs.buckets and not graphs.capture_extra(key):
            key = None  # the reason stays why no configured bucket held the batch
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
