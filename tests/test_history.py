"""The history contract (``sidecar/models/streaming/reach.py``): the last ``H`` input frames of a stream determine its
decoder state. Replaying them into a fresh stream (at their original positions, ``open_stream.start_frame``)
rebuilds the state and the audio of every later chunk within the exact-streaming tolerance; replaying ``H - 1``
frames does not (checked in float64, where rounding cannot hide the missing frame). Both families, on the tiny
goldens; ``H`` for the shipped configs."""

from __future__ import annotations

import pytest
import torch

from code2wav import proto
from code2wav.sidecar.engine import DecodeItem, Engine
from code2wav.sidecar.models import StreamBatch, load_model
from code2wav.sidecar.models.qwen3_tts.config import SHIPPED as QWEN3_SHIPPED
from code2wav.sidecar.models.streaming import reach
from code2wav.sidecar.models.voxcpm2_audiovae.config import SHIPPED as VOXCPM2_SHIPPED
from code2wav.sidecar.state_store import StateArena
from code2wav.sidecar.welcome import model_entry
from conftest import TINY, VOXCPM2_TINY

TOL = 1e-5  # the exact-streaming tolerance (tests/test_exact_streaming.py)
STATE_RTOL = 1e-4
"""The rebuilt state against the original, relative to the state's largest magnitude: float32 state built by one
replayed chunk and by 7-frame chunks sums in different orders; on an AVX-512 CPU (torch 2.13) Qwen3's transformer
state (``decoder.4``, magnitude 13) differs by 1.3e-5 of its scale, on AVX2 by less than 1e-5. The audio after the
split, what a client gets, is held to ``TOL``; a missing frame is caught in float64 below."""
CHUNK_FRAMES = 7  # the original stream's chunks (replay is one chunk of H frames: a different chunking)
FAMILIES = {"qwen3_tts": (TINY, 25), "voxcpm2_audiovae": (VOXCPM2_TINY, 24)}


def test_history_frames_of_the_shipped_and_tiny_configs():
    assert QWEN3_SHIPPED.history_frames == 580  # pre_conv 2 + 8 layers x 71 + 10 frames of convs after them
    assert VOXCPM2_SHIPPED.history_frames == 20  # shared/voxcpm2_audiovae.md: frames t-20 .. t, ceil(19.14)
    for folder, expected in FAMILIES.values():
        model = load_model(str(folder), torch.device("cpu"), "float32")
        assert model.contract.history_frames == expected
        entry = model_entry(model)
        assert entry.history_frames == expected
        wire = proto.encode(proto.Welcome(1, 1, "s", "e", (entry,), entry.name))
        assert proto.decode_server_message(wire).models[0].history_frames == expected


def test_the_walk_is_exact_at_sample_level():
    # a k=2s transposed conv reads its previous input frame; k=s reads none; a conv's columns count at its rate
    assert reach.history_frames([reach.trans_conv(4, 2)]) == 1
    assert reach.history_frames([reach.trans_conv(2, 2)]) == 0
    assert reach.history_frames([reach.trans_conv(2, 2), reach.conv(7)]) == 3  # 6 samples at 2 per frame
    assert reach.history_frames([reach.trans_conv(2, 2), reach.conv(6)]) == 3  # 5 samples: ceil(2.5)
    assert reach.history_frames([reach.conv(3), reach.attention(5), reach.attention(5)]) == 12


def _random_inputs(model, num_frames: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    spec = model.input
    if spec.is_integer:
        return torch.randint(0, spec.high, (spec.channels, num_frames), generator=gen)  # [C, T]
    return torch.randn(spec.channels, num_frames, generator=gen)  # [C, T]


def _chunks(start: int, end: int, size: int) -> list[tuple[int, int]]:
    return [(a, min(a + size, end)) for a in range(start, end, size)]


@pytest.mark.parametrize("max_forward_frames", [256, 8])  # 8: the replay in eager slices, the last of 1 frame
@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_replaying_the_last_h_frames_rebuilds_state_and_audio(family, max_forward_frames):
    folder, history = FAMILIES[family]
    model = load_model(str(folder), torch.device("cpu"), "float32")
    arena = StateArena(model.state_layout(), 4, model.dtype, model.device)
    engine = Engine(model, arena, max_forward_frames=max_forward_frames)
    split = history + 30  # frames the first sidecar decoded before it died
    total = split + 3 * CHUNK_FRAMES
    inputs = _random_inputs(model, total, seed=1)
    original = arena.allocate()
    for a, b in _chunks(0, split, CHUNK_FRAMES):
        engine.decode([DecodeItem(codes=inputs[:, a:b], slot=original, skip_frames=0)])
    state_at_split, position = arena.gather(torch.tensor([original]))
    assert int(position) == split

    replayed = arena.allocate(split - history)  # what open_stream.start_frame does (stream_table.open)
    (audio,) = engine.decode([DecodeItem(codes=inputs[:, split - history:split], slot=replayed,
                                         skip_frames=history)])
    assert audio.numel() == 0  # replayed frames are all context: no audio comes back
    state_rebuilt, position_rebuilt = arena.gather(torch.tensor([replayed]))
    assert int(position_rebuilt) == split
    for name, value in state_at_split.items():
        scale = max(1.0, value.abs().max().item())
        assert (state_rebuilt[name] - value).abs().max().item() <= STATE_RTOL * scale, name
    for a, b in _chunks(split, total, CHUNK_FRAMES):
        (want,) = engine.decode([DecodeItem(codes=inputs[:, a:b], slot=original, skip_frames=0)])
        (got,) = engine.decode([DecodeItem(codes=inputs[:, a:b], slot=replayed, skip_frames=0)])
        assert got.numel() == (b - a) * model.samples_per_frame
        assert (got - want).abs().max().item() <= TOL


def _stream(model, module, inputs: torch.Tensor, state: dict, start: int) -> tuple[torch.Tensor, dict]:
    batch = StreamBatch(inputs[None], torch.tensor([inputs.shape[1]]), torch.tensor([start]))
    audio, state = model.family.forward_stream(module, batch, state)  # [1, T * U]
    return audio[0], state


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_one_frame_less_is_not_enough(family):
    """float64: with ``H`` frames the rebuilt state matches the full stream's to rounding (~1e-15) and the next
    audio (float32 out) bit for bit; with ``H - 1`` the state differs by far more: the walk's oldest frame is read."""
    folder, history = FAMILIES[family]
    model = load_model(str(folder), torch.device("cpu"), "float32")
    module = model.module.double()  # (a model of its own, loaded here)
    if hasattr(module, "refresh_codebooks"):
        module.refresh_codebooks()
    split, ahead = history + 20, 5
    inputs = _random_inputs(model, split + ahead, seed=2)
    if inputs.is_floating_point():
        inputs = inputs.double()
    zero = {k: torch.zeros((1, *shape), dtype=torch.float64) for k, shape in model.state_layout().items()}
    _, state_full = _stream(model, module, inputs[:, :split], dict(zero), 0)
    after, _ = _stream(model, module, inputs[:, split:], dict(state_full), split)
    state_diff, audio_diff = {}, {}
    for kept in (history, history - 1):
        _, state = _stream(model, module, inputs[:, split - kept:split], dict(zero), split - kept)
        state_diff[kept] = max((state[k] - v).abs().max().item() for k, v in state_full.items())
        got, _ = _stream(model, module, inputs[:, split:], state, split)
        audio_diff[kept] = (got - after).abs().max().item()
    assert state_diff[history] <= 1e-12 and audio_diff[history] == 0.0, (state_diff, audio_diff)
    assert state_diff[history - 1] >= 1e-8, state_diff  # (seen: 4.3e-6 qwen3_tts, 6.6e-4 voxcpm2)


def test_a_replay_runs_the_convolutions_over_their_reach_only_and_rebuilds_the_same_state():
    """Qwen3-TTS, float64: a step whose audio nobody keeps (``StreamBatch.audio`` False: a history replay) runs the
    layers after the transformer over each row's last ``cfg.tail_frames`` frames only (10 of the shipped 580). Its
    new state equals the full decode's to rounding, from a fresh state and mid-stream, for rows of different
    lengths in one batch (one shorter than the tail); with one frame less of tail the state differs (the walk is
    tight). The eager engine takes that path for such steps (``test_replaying_the_last_h_frames...`` above)."""
    from code2wav.sidecar.models.qwen3_tts import decoder as qwen3_decoder

    folder, _ = FAMILIES["qwen3_tts"]
    model = load_model(str(folder), torch.device("cpu"), "float32")
    module = model.module.double()
    module.refresh_codebooks()
    tail = module.cfg.tail_frames
    assert QWEN3_SHIPPED.tail_frames == 10 and 0 < tail < 40
    lengths = torch.tensor([40, tail - 1, 33])  # [B]: one row shorter than the tail
    inputs = torch.stack([_random_inputs(model, 40, seed=3 + b) for b in range(3)])  # [B, C, 40]
    zero = {k: torch.zeros((3, *shape), dtype=torch.float64) for k, shape in model.state_layout().items()}
    _, mid = model.family.forward_stream(module, StreamBatch(inputs[:, :, :12], torch.full((3,), 12),
                                                             torch.zeros(3, dtype=torch.long)), dict(zero))
    for start_state, start in ((zero, 0), (mid, 12)):
        positions = torch.full((3,), start)
        full_wav, full = model.family.forward_stream(module, StreamBatch(inputs, lengths, positions), dict(start_state))
        replay_wav, replay = model.family.forward_stream(
            module, StreamBatch(inputs, lengths, positions, audio=False), dict(start_state))
        assert full_wav.shape[1] == 40 * model.samples_per_frame
        assert replay_wav.shape[1] == tail * model.samples_per_frame
        diff = max((replay[k] - v).abs().max().item() for k, v in full.items())
        assert diff <= 1e-12, (start, diff)
    # one frame less of tail: the convolutions' state misses a frame it reads
    x = torch.randn(3, 8, 40, dtype=torch.float64)
    short, short_lengths = qwen3_decoder.last_frames(x, lengths, tail - 1)
    assert torch.equal(short_lengths, torch.tensor([tail - 1, tail - 1, tail - 1]))
    assert torch.equal(short[0], x[0, :, 40 - (tail - 1):]) and torch.equal(short[2], x[2, :, 33 - (tail - 1):33])
    full_lengths, starts = torch.full((3,), 40), torch.zeros(3, dtype=torch.long)
    _, short_state = module.forward_stream(inputs, full_lengths, dict(zero), starts, tail - 1)
    _, full40 = module.forward_stream(inputs, full_lengths, dict(zero), starts)
    assert max((short_state[k] - v).abs().max().item() for k, v in full40.items()) >= 1e-8
