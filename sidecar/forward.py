"""One batched forward over decode items, shared by the eager engine and the graph routine: the rows' inputs staged
(host rows through the host, device rows copied on the device), their initial state and options, the time-slice
loop, each row's outcome (``ROW_*``: committed, or refused and its state kept) and its audio out of the padded batch.

The time-slice loop is the one place a step runs ``forward_stream`` more than once: the frames ``[B, C, T]`` go
through in contiguous slices (``graphs.plan.time_slices``), each row's state and position carried from one slice to
the next, which is exact (the decoders are causal). Eager steps slice to stay within ``max_forward_frames``; a graph
bucket over the memory budget was captured in slices to shrink its peak. A row with no frames left in a slice keeps
its state.
"""

from __future__ import annotations

import torch
from torch import Tensor

from .models import LoadedModel, StreamBatch
from .state_store import StateArena
from .work import DecodeItem


def on_device(codes: Tensor) -> bool:
    """A row's inputs are still in device memory (a CUDA IPC region, unchecked), not on the host."""
    return codes.device.type != "cpu"


def host_codes(items: list[DecodeItem], host_dtype: torch.dtype) -> list[Tensor]:
    """Each row's host inputs ``[C, n]``; zeros (``host_dtype``) in the place of a row whose inputs are on the
    device."""
    return [torch.zeros(it.codes.shape, dtype=host_dtype) if on_device(it.codes) else it.codes for it in items]


def armed_columns(items: list[DecodeItem]) -> tuple[list[int], list[int]]:
    """``(tokens, gates)`` as a step stages them: an armed row's token (as int32) and a gate that differs from it
    until the device snapshots the row's doorbell word into it (``copy_device_rows``); 0 and 0 for any other row.
    A row is ready where the two are equal."""
    tokens = [0 if it.armed is None else it.armed.token_int32 for it in items]
    return tokens, [token if it.armed is None else ~token for it, token in zip(items, tokens)]


def copy_device_rows(inputs: Tensor, gates: Tensor | None, items: list[DecodeItem]) -> None:
    """Copy the device rows' inputs into ``inputs`` ``[B, C, T]`` (staged, on the device), in their dtype there:
    device to device, on the current stream, nothing read to the host. They are checked by the step itself
    (``InputSpec.check_rows``). An armed row first makes the stream wait on the GPU for its doorbell, then
    snapshots the word into ``gates[b]`` (int64 ``[B]``; None: no row is armed), then copies: a word equal to the
    token means the client's codes before it are written; one that is not (the sidecar released the wait) makes the
    row not ready."""
    for b, it in enumerate(items):
        if it.armed is not None:
            it.armed.queue_wait(inputs.device)  # on the device's current stream: this step's
            gates[b: b + 1].copy_(it.armed.word)  # [1] int32 -> int64, before the codes are read
        if on_device(it.codes):
            inputs[b, :, : it.num_frames].copy_(it.codes)  # [C, n], a client's wire dtype cast on the device


def rows_state(model: LoadedModel, arena: StateArena | None, slots: Tensor | None, batch: int,
               device: torch.device) -> tuple[dict[str, Tensor], Tensor]:
    """Initial state of a batch: the arena rows of ``slots`` (stateful rows), or an empty state at position 0
    (stateless rows)."""
    if arena is not None:
        return arena.gather(slots)
    return model.zero_state(batch), torch.zeros(batch, dtype=torch.long, device=device)


def rows_options(model: LoadedModel, items: list[DecodeItem], device: torch.device) -> dict[str, Tensor]:
    """Each option of the model as ``[B]`` int64: the row's stream value, or the option's default."""
    return {opt.name: torch.tensor([it.options.get(opt.name, opt.default) for it in items], dtype=torch.long,
                                   device=device)
            for opt in model.contract.stream_options}


def forward_in_slices(model: LoadedModel, inputs: Tensor, num_frames: Tensor, state: dict[str, Tensor],
                      positions: Tensor, options: dict[str, Tensor], slices: tuple[tuple[int, int], ...],
                      audio: bool = True) -> tuple[Tensor, dict[str, Tensor], Tensor]:
    """``inputs`` ``[B, C, T]`` (row ``b`` valid for ``num_frames[b]`` frames) through ``model.forward_stream`` in
    ``slices`` (``(start, length)``, contiguous, covering ``T``). Returns ``(wav [B, T * U], state after each row's
    last valid frame, positions + num_frames)``. Graph-capturable: no Python branch on tensor values. ``audio``
    False (no row's audio is kept: ``StreamBatch.audio``): the family may return less audio than ``T * U``."""
    pieces = []
    for start, length in slices:
        piece = inputs[:, :, start:start + length]  # [B, C, t]
        # one slice: every row's frames are in it (no clamp: two kernels fewer in a batch-1 step)
        valid = num_frames if len(slices) == 1 else (num_frames - start).clamp(0, length)  # [B] frames here
        wav, state = model.forward_stream(StreamBatch(piece, valid, positions, options, audio), state)  # [B, t * U]
        pieces.append(wav)
        if len(slices) > 1:
            positions = positions + valid
    if len(slices) == 1:
        positions = positions + num_frames
    return (pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=1)), state, positions  # [B, T * U]


def rows_finite(wav: Tensor, num_frames: Tensor, samples_per_frame: int) -> Tensor:
    """``[B]`` bool: row ``b``'s audio is finite over its valid samples ``[0, num_frames[b] * U)`` of ``wav``
    ``[B, T * U]`` (context frames included; padding excluded). The one check, for eager steps and graph routines
    alike; a row that fails it is not committed (``StateArena.scatter``) and its chunk is refused. Graph-capturable."""
    sample = torch.arange(wav.shape[1], device=wav.device)  # [T * U]
    valid = sample[None, :] < (num_frames * samples_per_frame)[:, None]  # [B, T * U]
    return (torch.isfinite(wav) | ~valid).all(dim=1)  # [B]


ROW_COMMITTED, ROW_NOT_FINITE, ROW_BAD_INPUTS, ROW_NOT_READY = 0, 1, 2, 3
"""A row's outcome (``row_outcomes``): committed; its audio or new state not finite; its inputs refused by the
device check (``InputSpec.check_rows``); an armed row whose doorbell the sidecar released (its codes never came).
Every refusal leaves the stream's state as it was."""


def row_outcomes(model: LoadedModel, arena: StateArena | None, wav: Tensor, num_frames: Tensor,
                 slots: Tensor | None, state: dict[str, Tensor], positions: Tensor, inputs_ok: Tensor,
                 ready: Tensor | None = None) -> Tensor:
    """After a forward: commit the stateful rows that were ready (``ready`` ``[B]``; None: all), whose inputs passed
    the device check (``inputs_ok`` ``[B]``) and whose audio and new state are finite (``arena`` None: stateless
    rows, nothing to commit). Returns ``[B]`` uint8 on the device: each row's ``ROW_*`` outcome. Graph-capturable."""
    keep = rows_finite(wav, num_frames, model.samples_per_frame) & inputs_ok  # [B]
    if ready is not None:
        keep = keep & ready
    committed = keep if arena is None else arena.scatter(slots, state, positions, keep)  # [B]
    # bad inputs were not kept either: 1 + 1; not finite: 1 + 0; committed: 0
    outcomes = (~committed).to(torch.uint8) + (~inputs_ok).to(torch.uint8)  # [B]
    return outcomes if ready is None else torch.where(ready, outcomes, ROW_NOT_READY)  # [B]


def start_host_copy(wav: Tensor, items: list[DecodeItem]) -> Tensor | None:
    """Start copying the rows of ``items`` out of ``wav`` ``[B, T * U]`` to the host, without waiting for the device:
    into pinned memory on CUDA (the copy is queued behind the step), ``wav`` itself on the CPU. None when every row's
    audio stays on the device. The rows are the host's once the device reached the copy (``rows_audio``)."""
    if all(it.out_device for it in items):
        return None
    rows = wav[: len(items)]  # [rows, T * U]
    if rows.device.type != "cuda":
        return rows
    host = torch.empty(rows.shape, dtype=rows.dtype, pin_memory=True)  # [rows, T * U]
    host.copy_(rows, non_blocking=True)
    return host


def rows_audio(wav: Tensor, items: list[DecodeItem], samples_per_frame: int,
               host: Tensor | None = None) -> list[Tensor]:
    """Row ``b``'s samples ``[skip_b * U, n_b * U)`` of ``wav`` ``[B, T * U]``: on the host, or for ``out_device``
    rows a view of ``wav`` (valid until the next forward overwrites it). ``host``: the rows already copied by
    ``start_host_copy`` (the copy complete); None: copied here, synchronously.

    A host row owns its memory, exactly its own samples: its stream keeps it for an idempotent resend, up to the
    TTL when the client vanished, and a view would keep the whole padded batch ``[B, T * U]`` alive with it."""
    if host is None and not all(it.out_device for it in items):
        host = wav[: len(items)].cpu()  # [rows, T * U]; synchronous
    return [wav[b, row_samples(it, samples_per_frame)] if it.out_device
            else _owned(host[b, row_samples(it, samples_per_frame)]) for b, it in enumerate(items)]


def row_samples(item: DecodeItem, samples_per_frame: int) -> slice:
    """Where a row's own audio lies in its step's output row: after the frames it decodes only into the state."""
    return slice(item.skip_frames * samples_per_frame, item.num_frames * samples_per_frame)


def _owned(row: Tensor) -> Tensor:
    """``row`` itself when it spans its whole storage, else a compact copy (a memcpy of the row only)."""
    return row if row.untyped_storage().nbytes() == row.nbytes else row.clone()
