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

from ..forward import (armed_columns, copy_device_rows, forward_in_slices, host_codes, row_outcomes, rows_audio,
                       rows_state)
from ..models import LoadedModel
from ..state_store import StateArena
from ..work import DecodeItem
from .plan import time_slices

STAGING_BUFFERS = 2
"""Pinned staging sets per routine: a step can be staged while the one before it still runs on the device."""


META_FRAMES, META_SLOT, META_TOKEN, META_GATE = 0, 1, 2, 3
"""The rows of a batch's metadata ``[K, B]`` (``StreamRoutine.meta``): valid frames, arena slot, an armed row's token
and its doorbell's snapshot (equal for every other row), then one row per stream option."""
META_OPTIONS = 4


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
        # flat, like its staging below: a bucket's inputs are the buffer's first B * C * T entries as [B, C, T]
        # (``inputs``), so the copy in is one contiguous copy at any T (a [B, C, T] slice of a [Bmax, C, Tmax]
        # tensor is strided for T < Tmax: the copy then went through a device temporary and a copy kernel)
        self._inputs = torch.zeros(max_batch * channels * max_frames, dtype=staged, device=device)  # [Bmax C Tmax]
        self._defaults = [opt.default for opt in model.contract.stream_options]
        self._option_names = [opt.name for opt in model.contract.stream_options]
        self._meta_rows = META_OPTIONS + len(self._option_names)
        # one flat buffer: a batch of B rows uses its first K * B entries as [K, B] (``meta``), so that its staging
        # is one contiguous copy in; each graph bucket captured the views of its own B
        self._meta = torch.zeros(self._meta_rows * max_batch, dtype=torch.long, device=device)  # [K * Bmax]
        self.outcomes = torch.zeros(max_batch, dtype=torch.uint8, device=device)  # [Bmax] the last replay's ROW_*
        # flat, so that a bucket's inputs are staged contiguous ([B, C, T] of any T): a strided host source
        # would make the copy in go through a pageable temporary, synchronously. Two sets, used in turn (copy_in)
        self._inputs_host = [torch.zeros(max_batch * channels * max_frames, dtype=staged, pin_memory=pin)
                             for _ in range(STAGING_BUFFERS)]
        self._channels = channels
        self._meta_host = [torch.zeros(self._meta_rows * max_batch, dtype=torch.long, pin_memory=pin)
                           for _ in range(STAGING_BUFFERS)]
        self._turn = 0  # the staging set the next copy_in fills

    def inputs(self, batch: int, frames: int) -> Tensor:
        """The static inputs of a bucket, ``[batch, C, frames]`` on the device, contiguous (each bucket's graph
        captured the view of its own shape)."""
        return self._inputs[: batch * self._channels * frames].view(batch, self._channels, frames)

    def meta(self, batch: int) -> Tensor:
        """The metadata of a batch of ``batch`` rows, ``[K, batch]`` on the device (rows ``META_*``)."""
        return self._meta[: self._meta_rows * batch].view(self._meta_rows, batch)

    def options(self, batch: int) -> dict[str, Tensor]:
        """Each stream option's ``[batch]`` values (views of ``meta``)."""
        meta = self.meta(batch)
        return {name: meta[META_OPTIONS + i] for i, name in enumerate(self._option_names)}

    def prime(self, batch: int, frames: int) -> None:
        """Safe inputs for warm-up and capture: every row on the scratch slot, zero inputs, default options, no row
        armed."""
        self.inputs(batch, frames).zero_()
        self.meta(batch).copy_(self._padding_meta(batch, frames))

    def _padding_meta(self, batch: int, frames: int) -> Tensor:
        """``[K, batch]`` on the host: ``frames`` valid frames, the scratch slot, token and gate 0, defaults."""
        column = [frames, self.scratch_slot, 0, 0, *self._defaults]
        return torch.tensor(column, dtype=torch.long)[:, None].expand(self._meta_rows, batch)

    def copy_in(self, batch: int, frames: int, items: list[DecodeItem]) -> None:
        """Stage a batch through pinned host buffers (non-blocking copies: the inputs, then the metadata in one),
        the ``STAGING_BUFFERS`` sets in turn: a set is free again once the device finished the step that staged it,
        which the callers guarantee by never having more steps in flight than there are sets (the server's stepper:
        ``scheduler.max_steps_in_flight``, checked against ``STAGING_BUFFERS``). Device rows (CUDA IPC inputs) are
        copied in on the device after them; an armed row first waits there for its doorbell.

        A handful of tensor ops whatever the batch (no per-row indexing: at 64 rows that loop cost about 0.45 ms
        of host time per step, with the device idle, docs/design-notes.md, "Batch 1: norms, gate and state joins as ops")."""
        turn, self._turn = self._turn, (self._turn + 1) % STAGING_BUFFERS
        flat = self._inputs_host[turn][:batch * self._channels * frames]  # [B * C * T]
        host = flat.view(batch, self._channels, frames)  # [B, C, T]
        meta = self._meta_host[turn][: self._meta_rows * batch].view(self._meta_rows, batch)  # [K, B] contiguous
        rows = len(items)
        num_frames = [item.num_frames for item in items]
        longest = max(num_frames)
        codes = host_codes(items, self.model.input.host_dtype())  # [C, n] each (device rows: zeros, copied next)
        if rows == 1:
            staged = codes[0].unsqueeze(0)  # [1, C, n]
        elif min(num_frames) == longest:
            staged = torch.stack(codes)  # [rows, C, n]
        else:  # ragged: right-padded with zeros (pad_sequence pads the leading dim, hence the transposes)
            staged = torch.nn.utils.rnn.pad_sequence([c.t() for c in codes], batch_first=True).transpose(1, 2)
            # [rows, C, longest]
        host[:rows, :, :longest].copy_(staged)
        if longest < frames:
            host[:rows, :, longest:].zero_()
        tokens, gates = armed_columns(items)  # 0 and 0 but for armed rows (the device snapshots their doorbells)
        columns = [num_frames, [item.slot for item in items] if self.stateful else [self.scratch_slot] * rows,
                   tokens, gates]
        for name, default in zip(self._option_names, self._defaults):
            columns.append([item.options.get(name, default) for item in items])
        meta[:, :rows].copy_(torch.tensor(columns, dtype=torch.long))  # [K, rows]
        if rows < batch:  # padding rows: no inputs, no valid frames, the scratch slot, default options
            host[rows:].zero_()
            meta[:, rows:].copy_(self._padding_meta(batch - rows, 0))
        inputs = self.inputs(batch, frames)  # [B, C, T]
        inputs.copy_(host, non_blocking=True)
        device_meta = self.meta(batch)  # [K, B]
        device_meta.copy_(meta, non_blocking=True)
        copy_device_rows(inputs, device_meta[META_GATE], items)  # behind the copies above, on the same stream

    def forward(self, batch: int, frames: int, num_slices: int = 1) -> Tensor:
        """Run on the static buffers (this is what a graph captures). Returns ``[batch, frames * U]``.

        ``num_slices`` > 1: the frames as that many exact-streaming sub-steps (``forward.forward_in_slices``), the
        state committed once at the end: the same audio, with the peak memory of the longest slice."""
        meta = self.meta(batch)  # [K, B]
        num_frames, slots = meta[META_FRAMES], meta[META_SLOT]  # [B], [B]
        state, positions = rows_state(self.model, self.arena, slots, batch, self._inputs.device)
        inputs, inputs_ok = self.model.input.check_rows(self.inputs(batch, frames))  # [B, C, T], [B]
        wav, state, positions = forward_in_slices(self.model, inputs, num_frames, state, positions,
                                                  self.options(batch), time_slices(frames, num_slices))
        # the same checks and commit as an eager step: only rows that were ready (an armed row's doorbell reached
        # its token) with valid inputs, finite audio and new state
        outcomes = row_outcomes(self.model, self.arena, wav, num_frames, slots, state, positions, inputs_ok,
                                meta[META_GATE] == meta[META_TOKEN])  # [B]
        self.outcomes[:batch].copy_(outcomes)
        return wav  # [B, T * U]

    def copy_out(self, wav: Tensor, items: list[DecodeItem]) -> list[Tensor]:
        """Exact samples per row: host rows are copied out of graph-owned memory before returning; device rows
        are views the caller must consume before the next replay."""
        return rows_audio(wav, items, self.model.samples_per_frame)
