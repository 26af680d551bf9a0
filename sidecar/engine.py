"""The engine: the only code that runs the model. It executes a step as its ``StepPlan`` says, and trusts it.

Policy lives elsewhere: the scheduler decides which chunks share a step, the planner (``step_plan.py``) decides how
the step runs (a captured graph bucket, or eager and why). Here: a graph step replays its bucket (capturing it first
where the plan says so; a capture that fails then runs the step eager, counted); an eager step pads the rows to the
plan's frames, gathers their state from the arena, runs the forward in the plan's time slices and commits the new
state of stateful rows only after the whole forward succeeded, and only for rows whose inputs pass the device check
and whose audio and new state are finite (the others keep their state; each row's ``ROW_*`` outcome says which).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch import Tensor

from .forward import (armed_columns, copy_device_rows, forward_in_slices, host_codes, row_outcomes, rows_audio,
                      row_samples, rows_options, rows_state, start_host_copy)
from .graphs.manager import GraphManager
from .models import LoadedModel
from .modes import StreamMode, mode_for
from .state_store import StateArena
from .step_plan import StepPlan, StepPlanner, eager_slices
from .work import DecodeItem

__all__ = ["Engine", "DecodeItem", "LaunchedStep", "StepPlan"]


@dataclass
class LaunchedStep:
    """A step queued on the device (``Engine.launch``): what ``Engine.finish`` reads once the device is done."""

    items: list[DecodeItem]
    wav: Tensor  # [B, T * U] on the device: a graph's output is overwritten by the next replay
    host: Tensor | None  # [rows, T * U] the host rows' audio, being copied (pinned); None: no host rows
    outcomes: Tensor  # [rows] uint8: each row's ROW_* (a pinned copy being made, on CUDA)
    done: torch.cuda.Event | None  # recorded after the copies; None: done already (the CPU)
    device_outcomes: Tensor | None = None  # [rows] uint8 on the device, in stream order (early audio's mask)

    def device_rows(self, indices: list[int], samples_per_frame: int) -> list[Tensor]:
        """The audio of rows ``indices`` as views of the step's output on the device (``out_device`` rows),
        before the step finished: usable in stream order only."""
        return [self.wav[b, row_samples(self.items[b], samples_per_frame)] for b in indices]

    def ready(self) -> bool:
        """The device finished the step and its copies (never waits)."""
        return self.done is None or self.done.query()


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
        """The audio of ``execute_checked``, the outcomes not read (tests, offline decoding, benches: no wait for the
        device beyond what the audio's copy needs)."""
        return rows_audio(self._execute(plan, items)[0], items, self.model.samples_per_frame)

    def execute_checked(self, plan: StepPlan, items: list[DecodeItem],
                        launched: Callable[[], None] | None = None) -> tuple[list[Tensor], list[int]]:
        """Audio per item (float32 ``[(n - skip) * U]``): on the host, or for ``out_device`` items a device view
        valid until the next step; and per item its ``forward.ROW_*`` outcome: ``ROW_COMMITTED``, or a refused row
        (not ready, inputs refused by the device check, or audio or new state not finite) whose stream kept its
        state. Waits for the device (a step alone: the host rows copied synchronously, no pinned staging or event,
        the lowest latency). ``items`` are
        the plan's rows, or some of them (rows refused after planning: the plan's bucket and frames still hold the
        rest). ``launched``: called once the step is queued on the device, before the wait (a chunk trace's stamp)."""
        wav, outcomes = self._execute(plan, items)  # [B, T * U], [rows]: a step alone, so copied out now
        if launched is not None:
            launched()
        return rows_audio(wav, items, self.model.samples_per_frame), outcomes[: len(items)].tolist()

    def launch(self, plan: StepPlan, items: list[DecodeItem]) -> LaunchedStep:
        """Queue the step on the device and the copies of its host rows' audio and its outcomes to the host, without
        waiting for the device (on the CPU the step is done when this returns). ``finish`` takes the results."""
        wav, outcomes = self._execute(plan, items)  # [B, T * U], [rows]
        host = start_host_copy(wav, items)  # [rows, T * U] or None
        if wav.device.type != "cuda":
            return LaunchedStep(items, wav, host, outcomes, None)
        pinned = torch.empty(len(items), dtype=outcomes.dtype, pin_memory=True)  # [rows]
        pinned.copy_(outcomes[: len(items)], non_blocking=True)
        done = torch.cuda.Event()
        done.record(torch.cuda.current_stream(self.device))  # the engine's device, whichever is current (cuda:N)
        return LaunchedStep(items, wav, host, pinned, done, outcomes[: len(items)])

    def finish(self, step: LaunchedStep) -> tuple[list[Tensor], list[int]]:
        """``execute_checked``'s results of a launched step, waiting for the device if it is not done yet. Device
        rows are views of the step's output: valid only if no later step was launched meanwhile."""
        if step.done is not None:
            step.done.synchronize()
        return rows_audio(step.wav, step.items, self.model.samples_per_frame, step.host), step.outcomes.tolist()

    @torch.inference_mode()
    def _execute(self, plan: StepPlan, items: list[DecodeItem]) -> tuple[Tensor, Tensor]:
        """Run (queue) the step: its audio ``[B, T * U]`` (a graph's output, or the eager forward's) and its outcomes
        ``[rows]`` uint8 (``ROW_*``), both on the device, not read."""
        if any((it.slot is not None) != plan.mode.stateful for it in items):
            raise ValueError(f"every row of a {plan.mode.name} step must {'' if plan.mode.stateful else 'not '}hold "
                             "a state slot")
        bucket = plan.bucket
        if bucket is not None and (not plan.capture_first or self.graphs.capture(bucket)):
            wav = self.graphs.launch(bucket, items)  # [Bb, T * U]
            return wav, self.graphs.outcomes(bucket, len(items))
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
               slices: tuple[tuple[int, int], ...]) -> tuple[Tensor, Tensor]:
        batch, model = len(items), self.model
        staged = model.input.staged_dtype(model.dtype)
        inputs = torch.zeros((batch, model.num_channels, frames), dtype=staged)  # [B, C, T] right-padded
        for b, codes in enumerate(host_codes(items, model.input.host_dtype())):
            inputs[b, :, : codes.shape[1]] = codes
        inputs = inputs.to(self.device, non_blocking=True)
        num_frames = torch.tensor([it.num_frames for it in items], dtype=torch.long).to(self.device)  # [B]
        slots = torch.tensor([it.slot for it in items], dtype=torch.long, device=self.device) if stateful else None
        options = rows_options(model, items, self.device)  # name -> [B]
        gated = None  # [2, B] tokens and gates, with armed rows only
        if any(it.armed is not None for it in items):
            gated = torch.tensor(armed_columns(items), dtype=torch.long).to(self.device)  # [2, B]
        # the host's copies in are queued: the armed rows' waits next (the host does not wait behind them)
        copy_device_rows(inputs, None if gated is None else gated[1], items)
        inputs, inputs_ok = model.input.check_rows(inputs)  # [B, C, T], [B]
        state, positions = rows_state(model, self.arena if stateful else None, slots, batch, self.device)
        audio = any(it.skip_frames < it.num_frames for it in items)  # none kept: a history replay, its state only
        wav, state, positions = forward_in_slices(model, inputs, num_frames, state, positions, options,
                                                  slices, audio)  # [B, T * U] (audio False: less)
        # commit: only after the forward succeeded, and only rows with valid inputs, finite audio and new state
        outcomes = row_outcomes(model, self.arena if stateful else None, wav, num_frames, slots, state, positions,
                                inputs_ok, None if gated is None else gated[1] == gated[0])  # [B]
        return wav, outcomes  # [B, T * U], [B]
