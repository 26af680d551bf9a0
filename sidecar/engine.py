"""The engine: the only code that runs the model. It executes a step as its ``StepPlan`` says, and trusts it.

Policy lives elsewhere: the scheduler decides which chunks share a step, the planner (``step_plan.py``) decides how
the step runs (a captured graph bucket, or eager and why). Here: a graph step replays its bucket (capturing it first
where the plan says so; a capture that fails then runs the step eager, counted); an eager step pads the rows to the
plan's frames, gathers their state from the arena, runs the forward in the plan's time slices and commits the new
state of stateful rows only after the whole forward succeeded, and only for rows whose audio and new state are
finite (the others keep their state and are reported as failed).
"""

from __future__ import annotations

import torch
from torch import Tensor

from .forward import committed_rows, forward_in_slices, rows_audio, rows_options, rows_state
from .graphs.manager import GraphManager
from .models import LoadedModel
from .modes import StreamMode, mode_for
from .state_store import StateArena
from .step_plan import StepPlan, StepPlanner, eager_slices
from .work import DecodeItem

__all__ = ["Engine", "DecodeItem", "StepPlan"]


class Engine:
    def __init__(self, model: LoadedModel, arena: StateArena, max_forward_frames: int = 256,
                 graphs: GraphManager | None = None, metrics=None) -> None:
        self.model = model
        self.arena = arena
        self.max_forward_frames = max_forward_frames
        self.device = model.device
        self.graphs = graphs
        self.metrics = metrics
        self.planner = StepPlanner(graphs, max_forward_frames)

    def plan(self, mode: StreamMode, row_frames: list[int], may_capture: bool = True) -> StepPlan:
        return self.planner.plan(mode, row_frames, may_capture)

    def execute(self, plan: StepPlan, items: list[DecodeItem]) -> list[Tensor]:
        """The audio of ``execute_checked``, the flags not read (tests, offline decoding, benches: no wait for the
        device beyond what the audio's copy needs)."""
        return self._execute(plan, items)[0]

    def execute_checked(self, plan: StepPlan, items: list[DecodeItem]) -> tuple[list[Tensor], list[bool]]:
        """Audio per item (float32 ``[(n - skip) * U]``): on the host, or for ``out_device`` items a device view
        valid until the next step; and per item whether it succeeded: False for a row whose audio or new state is
        not finite, whose stream kept its state (``forward.committed_rows``; reading the flags waits for the
        device). ``items`` are the plan's rows, or some of them (rows refused after planning: the plan's bucket and
        frames still hold the rest)."""
        audios, committed = self._execute(plan, items)
        return audios, committed.tolist()

    @torch.inference_mode()
    def _execute(self, plan: StepPlan, items: list[DecodeItem]) -> tuple[list[Tensor], Tensor]:
        """``execute_checked``'s audio, and its flags as a ``[B]`` bool tensor on the device (not read)."""
        if any((it.slot is not None) != plan.mode.stateful for it in items):
            raise ValueError(f"every row of a {plan.mode.name} step must {'' if plan.mode.stateful else 'not '}hold "
                             "a state slot")
        bucket = plan.bucket
        if bucket is not None and (not plan.capture_first or self.graphs.capture(bucket)):
            audios = self.graphs.replay(bucket, items)
            return audios, self.graphs.committed_flags(bucket, len(items))
        if self.graphs is not None and self.metrics is not None:
            self.metrics.graph_misses.labels(component=plan.mode.name, reason=plan.reason).inc()
        frames = max(it.num_frames for it in items)  # (rows refused after planning shorten an eager step)
        slices = plan.slices if plan.slices and frames == plan.frames else eager_slices(frames, self.max_forward_frames)
        return self._eager(plan.mode.stateful, items, frames, slices)

    def decode(self, items: list[DecodeItem], may_capture: bool = True, mode: StreamMode | None = None) -> list[Tensor]:
        """Plan and execute one step (tests, offline decoding, in-process benches). ``mode``: the rows' stream mode
        (default: the mode whose statefulness the rows have)."""
        mode = mode or mode_for(items[0].slot is not None)
        return self.execute(self.plan(mode, [it.num_frames for it in items], may_capture), items)

    def _eager(self, stateful: bool, items: list[DecodeItem], frames: int,
               slices: tuple[tuple[int, int], ...]) -> tuple[list[Tensor], Tensor]:
        batch, model = len(items), self.model
        staged = model.input.staged_dtype(model.dtype)
        inputs = torch.zeros((batch, model.num_channels, frames), dtype=staged)  # [B, C, T] right-padded
        for b, it in enumerate(items):
            inputs[b, :, : it.num_frames] = it.codes
        inputs = inputs.to(self.device, non_blocking=True)
        num_frames = torch.tensor([it.num_frames for it in items], dtype=torch.long).to(self.device)  # [B]
        slots = torch.tensor([it.slot for it in items], dtype=torch.long, device=self.device) if stateful else None
        state, positions = rows_state(model, self.arena if stateful else None, slots, batch, self.device)
        options = rows_options(model, items, self.device)  # name -> [B]
        wav, state, positions = forward_in_slices(model, inputs, num_frames, state, positions, options,
                                                  slices)  # [B, T * U]
        # commit: only after the forward succeeded, and only rows whose audio and new state are finite
        committed = committed_rows(model, self.arena if stateful else None, wav, num_frames, slots, state,
                                   positions)  # [B]
        audios = rows_audio(wav, items, model.samples_per_frame)
        return audios, committed  # [B]
