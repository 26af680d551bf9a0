"""The model side of CUDA graphs: how a streaming decoder runs on static buffers.

A ``StreamRoutine`` allocates its static inputs once at the largest bucket and slices them per bucket; copies a
batch in (inputs, valid frames per row, slot indices, the rows' stream options; padding rows point at the
arena's scratch slot, have zero valid frames and default options); runs the forward for capture (state gather
-> ``model.forward_stream`` -> state scatter, all on device); and takes outputs out with an explicit length
contract (``forward.rows_audio``): row ``b`` returns exactly samples ``[skip_b * U, n_b * U)``, never the padded
length. The graph manager never looks inside; the routine never names a family (it reads the model's contract).
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..forward import committed_rows, forward_in_slices, rows_audio, rows_state
from ..models import LoadedModel
from ..state_store import StateArena
from ..work import DecodeItem
from .plan import time_slices

STAGING_BUFFERS = 2
"""Pinned staging sets per routine: a step can be staged while the one before it still runs on the device."""


class StreamRoutine:
    def __init__(self, model: LoadedModel, arena: StateArena | None, max_batch: int, max_frames: int) -> None:
        self.model = model
        self.arena = arena  # None: stateless (window mode) rows decode from a zero state at position 0
        self.stateful = arena is not None
        self.max_batch = max_batch
        self.max_frames = max_frames
        device = model.device
        pin = device.type == "cuda"
        channels = model.num_channels
        self.scratch_slot = arena.scratch_slot if arena is not None else 0
        staged = model.input.staged_dtype(model.dtype)
        self.inputs = torch.zeros((max_batch, channels, max_frames), dtype=staged, device=device)  # [Bmax, C, Tmax]
        self.num_frames = torch.zeros(max_batch, dtype=torch.long, device=device)  # [Bmax]
        self.slots = torch.full((max_batch,), self.scratch_slot, dtype=torch.long, device=device)  # [Bmax]
        self.options = model.zero_options(max_batch)  # name -> [Bmax]
        self.committed = torch.zeros(max_batch, dtype=torch.bool, device=device)  # [Bmax] the last replay's rows
        self._defaults = [opt.default for opt in model.contract.stream_options]
        self._option_names = [opt.name for opt in model.contract.stream_options]
        # flat, so that a bucket's inputs are staged contiguous ([B, C, T] of any T): a strided host source
        # would make the copy in go through a pageable temporary, synchronously. Two sets, used in turn (copy_in)
        self._inputs_host = [torch.zeros(max_batch * channels * max_frames, dtype=staged, pin_memory=pin)
                             for _ in range(STAGING_BUFFERS)]
        self._channels = channels
        # num_frames, slots, then one row per option
        self._meta_host = [torch.zeros((2 + len(self._option_names), max_batch), dtype=torch.long, pin_memory=pin)
                           for _ in range(STAGING_BUFFERS)]
        self._turn = 0  # the staging set the next copy_in fills

    def prime(self, batch: int, frames: int) -> None:
        """Safe inputs for warm-up and capture: every row on the scratch slot, zero inputs, default options."""
        self.inputs[:batch, :, :frames].zero_()
        self.num_frames[:batch].fill_(frames)
        self.slots[:batch].fill_(self.scratch_slot)
        for name, default in zip(self._option_names, self._defaults):
            self.options[name][:batch].fill_(default)

    def copy_in(self, batch: int, frames: int, items: list[DecodeItem]) -> None:
        """Stage a batch through pinned host buffers (non-blocking copies), the ``STAGING_BUFFERS`` sets in turn: a
        set is free again once the device finished the step that staged it, which the callers guarantee by never
        having more steps in flight than there are sets (the server's stepper: ``scheduler.max_steps_in_flight``,
        checked against ``STAGING_BUFFERS``).

        A handful of tensor ops whatever the batch (no per-row indexing: at 64 rows that loop cost about 0.45 ms
        of host time per step, with the device idle, docs/design-notes.md, "Batch 1: norms, gate and state joins as ops")."""
        turn, self._turn = self._turn, (self._turn + 1) % STAGING_BUFFERS
        flat = self._inputs_host[turn][:batch * self._channels * frames]  # [B * C * T]
        host = flat.view(batch, self._channels, frames)  # [B, C, T]
        meta = self._meta_host[turn][:, :batch]  # [2 + O, B] (each row contiguous)
        rows = len(items)
        num_frames = [item.num_frames for item in items]
        longest = max(num_frames)
        if rows == 1:
            staged = items[0].codes.unsqueeze(0)  # [1, C, n]
        elif min(num_frames) == longest:
            staged = torch.stack([item.codes for item in items])  # [rows, C, n]
        else:  # ragged: right-padded with zeros (pad_sequence pads the leading dim, hence the transposes)
            staged = torch.nn.utils.rnn.pad_sequence([item.codes.t() for item in items],
                                                     batch_first=True).transpose(1, 2)  # [rows, C, longest]
        host[:rows, :, :longest].copy_(staged)
        if longest < frames:
            host[:rows, :, longest:].zero_()
        columns = [num_frames, [item.slot for item in items] if self.stateful else [self.scratch_slot] * rows]
        for name, default in zip(self._option_names, self._defaults):
            columns.append([item.options.get(name, default) for item in items])
        meta[:, :rows].copy_(torch.tensor(columns, dtype=torch.long))  # [2 + options, rows]
        if rows < batch:  # padding rows: no inputs, no valid frames, the scratch slot, default options
            host[rows:].zero_()
            meta[0, rows:].zero_()
            meta[1, rows:].fill_(self.scratch_slot)
            for i, default in enumerate(self._defaults):
                meta[2 + i, rows:].fill_(default)
        self.inputs[:batch, :, :frames].copy_(host, non_blocking=True)
        self.num_frames[:batch].copy_(meta[0], non_blocking=True)
        self.slots[:batch].copy_(meta[1], non_blocking=True)
        for i, name in enumerate(self._option_names):
            self.options[name][:batch].copy_(meta[2 + i], non_blocking=True)

    def forward(self, batch: int, frames: int, num_slices: int = 1) -> Tensor:
        """Run on the static buffers (this is what a graph captures). Returns ``[batch, frames * U]``.

        ``num_slices`` > 1: the frames as that many exact-streaming sub-steps (``forward.forward_in_slices``), the
        state committed once at the end: the same audio, with the peak memory of the longest slice."""
        slots = self.slots[:batch]  # [B]
        state, positions = rows_state(self.model, self.arena, slots, batch, self.inputs.device)
        options = {name: t[:batch] for name, t in self.options.items()}  # name -> [B]
        wav, state, positions = forward_in_slices(self.model, self.inputs[:batch, :, :frames], self.num_frames[:batch],
                                                  state, positions, options, time_slices(frames, num_slices))
        # the same check and commit as an eager step: only rows whose audio and new state are finite
        committed = committed_rows(self.model, self.arena, wav, self.num_frames[:batch], slots, state,
                                   positions)  # [B]
        self.committed[:batch].copy_(committed)
        return wav  # [B, T * U]

    def copy_out(self, wav: Tensor, items: list[DecodeItem]) -> list[Tensor]:
        """Exact samples per row: host rows are copied out of graph-owned memory before returning; device rows
        are views the caller must consume before the next replay."""
        return rows_audio(wav, items, self.model.samples_per_frame)
