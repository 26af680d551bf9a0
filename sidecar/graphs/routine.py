"""The model side of CUDA graphs: how a streaming decoder runs on static buffers.

A ``StreamRoutine`` allocates its static inputs once at the largest bucket and slices them per bucket; copies a
batch in (inputs, valid frames per row, slot indices, the rows' stream options; padding rows point at the
arena's scratch slot, have zero valid frames and default options); runs the forward for capture (state gather
-> ``model.forward_stream`` -> state scatter, all on device); and takes outputs out with an explicit length
contract: row ``b`` returns exactly samples ``[skip_b * U, n_b * U)``, never the padded length. The graph
manager never looks inside; the routine never names a family (it reads the model's contract).
"""

from __future__ import annotations

import torch
from torch import Tensor

from ..models import LoadedModel, StreamBatch
from ..state_store import StateArena
from ..work import DecodeItem
from .plan import time_slices


def rows_state(model: LoadedModel, arena: StateArena | None, slots: Tensor | None, batch: int,
               device: torch.device) -> tuple[dict[str, Tensor], Tensor]:
    """Initial state of a batch: the arena rows of ``slots`` (stateful rows), or an empty state at position 0
    (stateless rows). Shared by the eager engine and the graph routine."""
    if arena is not None:
        return arena.gather(slots)
    return model.zero_state(batch), torch.zeros(batch, dtype=torch.long, device=device)


def rows_audio(wav: Tensor, items: list[DecodeItem], samples_per_frame: int) -> list[Tensor]:
    """Row ``b``'s samples ``[skip_b * U, n_b * U)`` of ``wav`` ``[B, T * U]``: copied to the host, or for
    ``out_device`` rows a view of ``wav`` (valid until the next forward overwrites it).

    A host row owns its memory, exactly its own samples: its stream keeps it for an idempotent resend, up to the
    TTL when the client vanished, and a view would keep the whole padded batch ``[B, T * U]`` alive with it."""
    spf = samples_per_frame
    host = None if all(it.out_device for it in items) else wav[: len(items)].cpu()  # [rows, T * U]; synchronous
    return [wav[b, it.skip_frames * spf: it.codes.shape[1] * spf] if it.out_device
            else _owned(host[b, it.skip_frames * spf: it.codes.shape[1] * spf]) for b, it in enumerate(items)]


def _owned(row: Tensor) -> Tensor:
    """``row`` itself when it spans its whole storage, else a compact copy (a memcpy of the row only)."""
    return row if row.untyped_storage().nbytes() == row.nbytes else row.clone()


def rows_options(model: LoadedModel, items: list[DecodeItem], device: torch.device) -> dict[str, Tensor]:
    """Each option of the model as ``[B]`` int64: the row's stream value, or the option's default."""
    return {opt.name: torch.tensor([it.options.get(opt.name, opt.default) for it in items], dtype=torch.long,
                                   device=device)
            for opt in model.contract.stream_options}


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
        self._defaults = [opt.default for opt in model.contract.stream_options]
        self._option_names = [opt.name for opt in model.contract.stream_options]
        # flat, so that a bucket's inputs are staged contiguous ([B, C, T] of any T): a strided host source
        # would make the copy in go through a pageable temporary, synchronously
        self._inputs_host = torch.zeros(max_batch * channels * max_frames, dtype=staged, pin_memory=pin)
        self._channels = channels
        # num_frames, slots, then one row per option
        self._meta_host = torch.zeros((2 + len(self._option_names), max_batch), dtype=torch.long, pin_memory=pin)

    def prime(self, batch: int, frames: int) -> None:
        """Safe inputs for warm-up and capture: every row on the scratch slot, zero inputs, default options."""
        self.inputs[:batch, :, :frames].zero_()
        self.num_frames[:batch].fill_(frames)
        self.slots[:batch].fill_(self.scratch_slot)
        for name, default in zip(self._option_names, self._defaults):
            self.options[name][:batch].fill_(default)

    def copy_in(self, batch: int, frames: int, items: list[DecodeItem]) -> None:
        """Stage a batch through pinned host buffers (non-blocking copies): callers start a step only once the
        device finished the previous one (the server's step loop waits for it), so those buffers are free.

        A handful of tensor ops whatever the batch (no per-row indexing: at 64 rows that loop cost about 0.45 ms
        of host time per step, with the device idle, ``loadgen/probes/hot_path_cpu.py``)."""
        host = self._inputs_host[:batch * self._channels * frames].view(batch, self._channels, frames)  # [B, C, T]
        meta = self._meta_host[:, :batch]  # [2 + O, B] (each row contiguous)
        rows = len(items)
        num_frames = [item.codes.shape[1] for item in items]
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

        ``num_slices`` > 1: the frames as that many exact-streaming sub-steps (``plan.time_slices``), each row's
        state and position carried from one to the next and committed once at the end: the same audio, with the
        peak memory of the longest slice (a row with no frames left in a slice keeps its state)."""
        num_frames = self.num_frames[:batch]  # [B]
        slots = self.slots[:batch]  # [B]
        state, positions = rows_state(self.model, self.arena, slots, batch, self.inputs.device)
        start_positions = positions
        options = {name: t[:batch] for name, t in self.options.items()}  # name -> [B]
        pieces = []
        for i, (start, length) in enumerate(time_slices(frames, num_slices)):
            inputs = self.inputs[:batch, :, start:start + length]  # [B, C, t]
            valid = num_frames if num_slices == 1 else (num_frames - start).clamp(0, length)  # [B] frames here
            wav, state = self.model.forward_stream(StreamBatch(inputs, valid, positions, options), state)  # [B, t*U]
            pieces.append(wav)
            if i + 1 < num_slices:
                positions = positions + valid
        if self.stateful:
            self.arena.scatter(slots, state, start_positions + num_frames)
        return pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=1)  # [B, T * U]

    def copy_out(self, wav: Tensor, items: list[DecodeItem]) -> list[Tensor]:
        """Exact samples per row: host rows are copied out of graph-owned memory before returning; device rows
        are views the caller must consume before the next replay."""
        return rows_audio(wav, items, self.model.samples_per_frame)
