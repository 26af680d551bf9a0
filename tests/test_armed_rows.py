"""Armed rows on the CPU: the step's own readiness check of the device-armed hand-off (``forward.armed_columns``,
``copy_device_rows``, ``row_outcomes``) in the graph routine's step (the code a CUDA graph captures, run here on the
CPU) and in an eager step.

An armed row's doorbell word is snapshotted into the step's gates before its codes are read; the row is decoded into
its stream only where the snapshot equals its token. The doorbell here is a CPU stand-in for ``ipc.doorbells``'s
(one int32 word; the GPU's wait on it, which only a GPU can queue, is a no-op): the CUDA tests
(``test_cuda_armed.py``) run the real one. A row whose word was released (the token + 1) is ``ROW_NOT_READY``, its
stream's state untouched; a ready armed row decodes exactly as the same codes unarmed; the other rows of the step
are bit-identical to a step without the armed ones. Tokens past 2^31 compare as the int32 words hold them."""

from __future__ import annotations

import pytest
import torch

from code2wav.sidecar import forward
from code2wav.sidecar.engine import DecodeItem, Engine
from code2wav.sidecar.forward import ROW_COMMITTED, ROW_NOT_READY
from code2wav.sidecar.graphs.routine import StreamRoutine
from code2wav.sidecar.ipc.doorbells import as_int32
from code2wav.sidecar.models import load_model
from code2wav.sidecar.modes import mode_for
from code2wav.sidecar.state_store import StateArena
from conftest import TINY

EXACT = mode_for(True)


class _CpuDoorbell:
    """One doorbell word on the CPU (``ArmedInputs``'s interface): it holds the last token (the token - 2) until the
    step queues its wait, and ``value`` after it, as a GPU stream sees a word once its wait ended (rung, or
    released). A snapshot taken before the wait would see the last token."""

    def __init__(self, token: int, value: int) -> None:
        self.token = token
        self.token_int32 = as_int32(token)
        self.word = torch.tensor([as_int32((token - 2) & 0xFFFFFFFF)], dtype=torch.int32)  # [1]
        self._value = value
        self.waits = 0

    def queue_wait(self, device: torch.device) -> None:
        self.waits += 1
        self.word.fill_(as_int32(self._value))


def _step(path: str, engine: Engine, items: list[DecodeItem]) -> tuple[list[torch.Tensor], list[int]]:
    if path == "eager":
        return engine.execute_checked(engine.plan(EXACT, [it.num_frames for it in items]), items)
    routine = StreamRoutine(engine.model, engine.arena, max_batch=4, max_frames=16)
    frames = max(it.num_frames for it in items)
    routine.copy_in(4, frames, items)  # a padding row too
    with torch.inference_mode():
        wav = routine.forward(4, frames)
    return routine.copy_out(wav, items), routine.outcomes[: len(items)].tolist()


@pytest.mark.parametrize("path", ["eager", "graph_routine"])
@pytest.mark.parametrize("token", [2, (1 << 32) - 2])
@pytest.mark.parametrize("armed_on_device", [False, True])
def test_only_armed_rows_whose_doorbell_reached_the_token_are_decoded(path, token, armed_on_device, monkeypatch):
    """``armed_on_device``: the armed rows' codes are taken for device rows (a CUDA IPC region's view, int32 as a
    client may send them): zeros in the host staging, then copied in behind the wait (``forward.on_device`` is
    told which rows those are: on the CPU every tensor is a host one)."""
    model = load_model(str(TINY), torch.device("cpu"), "float32")
    gen = torch.Generator().manual_seed(45)
    Q = model.num_channels
    codes = [torch.randint(0, 64, (Q, n), generator=gen) for n in (6, 5, 4)]
    if armed_on_device:
        codes[1], codes[2] = codes[1].int(), codes[2].int()
        device_rows = {id(codes[1]), id(codes[2])}
        monkeypatch.setattr(forward, "on_device", lambda t: id(t) in device_rows)
    engine = Engine(model, StateArena(model.state_layout(), 8, model.dtype, model.device))
    slots = [engine.arena.allocate() for _ in range(3)]
    ref_engine = Engine(model, StateArena(model.state_layout(), 8, model.dtype, model.device))
    ref_slots = [ref_engine.arena.allocate() for _ in range(3)]
    ref_audio, ref_outcomes = _step(path, ref_engine, [DecodeItem(c.long(), s, 0)  # host rows (new tensors)
                                                       for c, s in zip(codes, ref_slots)])
    assert ref_outcomes == [ROW_COMMITTED] * 3
    rung, released = _CpuDoorbell(token, token), _CpuDoorbell(token, (token + 1) & 0xFFFFFFFF)
    items = [DecodeItem(codes[0], slots[0], 0), DecodeItem(codes[1], slots[1], 0, armed=rung),
             DecodeItem(codes[2], slots[2], 0, armed=released)]
    released_state = engine.arena.flat[slots[2]].clone(), int(engine.arena.positions[slots[2]])
    audio, outcomes = _step(path, engine, items)
    assert outcomes == [ROW_COMMITTED, ROW_COMMITTED, ROW_NOT_READY]
    assert rung.waits == released.waits == 1  # each armed row queued its wait before its codes were read
    assert torch.equal(audio[0], ref_audio[0]) and torch.equal(audio[1], ref_audio[1])
    assert torch.equal(engine.arena.flat[slots[2]], released_state[0])  # not ready: the stream's state as it was
    assert int(engine.arena.positions[slots[2]]) == released_state[1] == 0
    assert int(engine.arena.positions[slots[1]]) == 5  # the ready armed row committed
