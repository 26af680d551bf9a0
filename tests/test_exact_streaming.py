"""Exact streaming: chunked decode with committed per-stream state equals one forward over all frames."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings

from chunking import splits_of
from code2wav.sidecar.engine import DecodeItem, Engine
from code2wav.sidecar.models import LoadedModel
from code2wav.sidecar.models.qwen3_tts import DecoderConfig, random_model
from code2wav.sidecar.models.qwen3_tts.family import QWEN3_TTS, contract_of
from code2wav.sidecar.state_store import StateArena

TOL = 1e-5
NUM_FRAMES = 40


def make_engine(model: LoadedModel, num_slots: int = 8, max_forward_frames: int = 256) -> Engine:
    arena = StateArena(model.module.state_layout(), num_slots, model.dtype, model.device)
    return Engine(model, arena, max_forward_frames=max_forward_frames)


def stream_interleaved(engine: Engine, codes: torch.Tensor, plans: list[list[int]],
                       context_frames: list[int] | None = None) -> list[torch.Tensor]:
    """Decode row ``b`` of ``codes`` ``[B, Q, T]`` in the chunk sizes ``plans[b]``; every engine step batches
    the next chunk of every unfinished stream together (streams at different positions, different sizes)."""
    slots = [engine.arena.allocate() for _ in plans]
    starts = [0] * len(plans)
    steps = [0] * len(plans)
    outs: list[list[torch.Tensor]] = [[] for _ in plans]
    while any(steps[b] < len(plans[b]) for b in range(len(plans))):
        rows = [b for b in range(len(plans)) if steps[b] < len(plans[b])]
        items = []
        for b in rows:
            n = plans[b][steps[b]]
            skip = context_frames[b] if (context_frames and steps[b] == 0) else 0
            items.append(DecodeItem(codes=codes[b, :, starts[b]: starts[b] + n], slot=slots[b], skip_frames=skip))
        for b, audio in zip(rows, engine.decode(items)):
            outs[b].append(audio)
            starts[b] += plans[b][steps[b]]
            steps[b] += 1
    for slot in slots:
        engine.arena.release(slot)
    return [torch.cat(o) for o in outs]


@pytest.fixture(scope="module")
def tiny_engine(tiny_model):
    return make_engine(tiny_model)


@settings(max_examples=40, deadline=None)
@given(plan_a=splits_of(NUM_FRAMES), plan_b=splits_of(NUM_FRAMES))
def test_random_splits_batched_equal_full(tiny_engine, golden_cases, plan_a, plan_b):
    full = golden_cases["full"][:, 0]  # [2, T * U]
    out_a, out_b = stream_interleaved(tiny_engine, golden_cases["codes"], [plan_a, plan_b])
    assert (out_a - full[0]).abs().max().item() <= TOL
    assert (out_b - full[1]).abs().max().item() <= TOL


@pytest.mark.parametrize("plan", [[1] * 40, [1] + [25] + [14], [40], [1, 25, 1, 13]],
                         ids=["1-frame", "1-then-25", "whole", "mixed"])
def test_named_splits_equal_full(tiny_engine, golden_cases, plan):
    full = golden_cases["full"][:, 0]
    # four streams in one batch: both golden rows, each twice, with different plans so positions differ
    codes = golden_cases["codes"].repeat(2, 1, 1)  # [4, Q, T]
    plans = [plan, [40], [3] * 13 + [1], plan]
    outs = stream_interleaved(tiny_engine, codes, plans)
    for b, out in enumerate(outs):
        assert (out - full[b % 2]).abs().max().item() <= TOL, b


def test_context_frames_return_only_later_audio(tiny_engine, golden_cases):
    full = golden_cases["full"][:, 0]
    spf = tiny_engine.model.samples_per_frame
    k = 7
    outs = stream_interleaved(tiny_engine, golden_cases["codes"], [[12, 25, 3], [9, 31]], context_frames=[k, 2])
    assert outs[0].numel() == (NUM_FRAMES - k) * spf
    assert (outs[0] - full[0, k * spf:]).abs().max().item() <= TOL
    assert (outs[1] - full[1, 2 * spf:]).abs().max().item() <= TOL


@pytest.fixture(scope="module")
def long_window_model() -> LoadedModel:
    """A config of our own whose sliding window (3) is many times shorter than the sequence."""
    cfg = DecoderConfig(codebook_size=32, num_quantizers=4, codebook_dim=16, hidden_size=16, num_attention_heads=2,
                        num_key_value_heads=2, head_dim=8, intermediate_size=24, num_hidden_layers=3,
                        sliding_window=3, latent_dim=24, decoder_dim=16, upsample_rates=(2, 3),
                        upsampling_ratios=(2,))
    module = random_model(cfg, seed=11)
    return LoadedModel("long", QWEN3_TTS, module, contract_of(module, 24000), torch.device("cpu"), torch.float32,
                       "random-weights")


def test_sequence_many_windows_long_equals_one_shot(long_window_model):
    gen = torch.Generator().manual_seed(5)
    num_frames = 60  # 20x the sliding window
    codes = torch.randint(0, 32, (3, 4, num_frames), generator=gen)
    with torch.no_grad():
        full = long_window_model.module(codes)[:, 0]  # one forward over everything
    engine = make_engine(long_window_model)
    plans = [[1] * num_frames, [1, 25, 25, 9], [7, 50, 3]]  # a chunk much longer than the window, too
    outs = stream_interleaved(engine, codes, plans)
    for b, out in enumerate(outs):
        assert (out - full[b]).abs().max().item() <= TOL, b
    # the sliced forward (max_forward_frames < chunk) is exact too
    sliced = make_engine(long_window_model, max_forward_frames=4)
    outs = stream_interleaved(sliced, codes, [[60], [33, 27], [60]])
    for b, out in enumerate(outs):
        assert (out - full[b]).abs().max().item() <= TOL, b


def test_failed_forward_commits_nothing(tiny_engine, golden_cases, monkeypatch):
    """An exception inside the forward (injected: the family's streaming call fails half-way, after its first slice)
    leaves the state as it was. (A code outside the codebook no longer raises: the step clamps it and refuses its
    row, ``test_poisoned_stream``.)"""
    full = golden_cases["full"][:, 0]
    codes = golden_cases["codes"][0]  # [Q, T]
    arena = tiny_engine.arena
    slot = arena.allocate()
    tiny_engine.decode([DecodeItem(codes[:, :10], slot, 0)])
    before = {k: t[slot].clone() for k, t in arena.tensors.items()}
    position_before = int(arena.positions[slot])
    model = tiny_engine.model
    real_forward, calls = model.forward_stream, []

    def fails_on_the_second_slice(batch, state):
        calls.append(batch.inputs.shape[2])
        if len(calls) == 2:
            raise RuntimeError("injected: the device failed mid-forward")
        return real_forward(batch, state)

    monkeypatch.setattr(model, "forward_stream", fails_on_the_second_slice)
    monkeypatch.setattr(tiny_engine.planner, "max_forward_frames", 4)  # 10 frames: three slices, state carried
    with pytest.raises(RuntimeError, match="injected"):
        tiny_engine.decode([DecodeItem(codes[:, 10:20], slot, 0)])
    monkeypatch.undo()
    assert calls == [4, 3]  # the first slice ran (its state carried in memory), the second failed
    assert int(arena.positions[slot]) == position_before == 10
    assert all(torch.equal(before[k], t[slot]) for k, t in arena.tensors.items())
    spf = tiny_engine.model.samples_per_frame
    audio = tiny_engine.decode([DecodeItem(codes[:, 10:40], slot, 0)])[0]
    assert (audio - full[0, 10 * spf:]).abs().max().item() <= TOL
    arena.release(slot)


def test_state_bytes_per_stream_for_shipped_config():
    from code2wav.sidecar.models.qwen3_tts import SHIPPED, Qwen3TTSDecoder

    layout = Qwen3TTSDecoder(SHIPPED).state_layout()
    arena = StateArena(layout, 1, torch.float32, torch.device("cpu"))
    assert 5e6 <= arena.bytes_per_stream <= 6e6  # about 5-6 MB per stream in float32
