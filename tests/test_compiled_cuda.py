"""The compiled exact step on a real GPU (skipped without one): float32 with TF32 off through the compiled
CUDA graph matches the golden ``full`` within 1e-4 and the eager step within 1e-5; bf16 audio of the
compiled graph is no worse than the plain graph's against float32 (SNR, reported) by more than 1 dB, for both
families' real architectures.

Each compiled bucket costs one ``torch.compile`` (tens of seconds cold; ``TORCHINDUCTOR_CACHE_DIR`` keeps it
between runs), so these tests use one bucket each."""

from __future__ import annotations

import pytest
import torch

from code2wav.sidecar.engine import DecodeItem, Engine
from code2wav.sidecar.graphs.compiled import CompiledRoutine
from code2wav.sidecar.graphs.manager import GraphManager
from code2wav.sidecar.graphs.plan import BucketKey
from code2wav.sidecar.metrics import Metrics
from code2wav.sidecar.models import load_model
from code2wav.sidecar.graphs.routine import StreamRoutine
from code2wav.sidecar.state_store import StateArena

from conftest import TINY, VOXCPM2_TINY

pytestmark = pytest.mark.cuda

NUM_SLOTS = 160
ROUTINE_BATCH, ROUTINE_FRAMES = 64, 25


@pytest.fixture(autouse=True)
def _tf32_off(no_tf32):
    """float32 tolerances hold only with TF32 off (conftest.no_tf32)."""


def _setup(model_spec: str, dtype: str, key: BucketKey, compile_: bool):
    device = torch.device("cuda")
    model = load_model(model_spec, device, dtype)
    arena = StateArena(model.state_layout(), NUM_SLOTS, model.dtype, device)
    metrics = Metrics()
    plain = StreamRoutine(model, arena, ROUTINE_BATCH, ROUTINE_FRAMES)
    compiled = {"exact": CompiledRoutine(plain, "exact", 1)} if compile_ else None
    manager = GraphManager({"exact": plain}, (key,), device, metrics, max_graph_memory_bytes=None,
                           compiled=compiled)
    manager.capture_startup()
    assert manager.is_captured(key), manager.summary()
    assert manager.summary()[0]["compiled"] == compile_, manager.compile_fallbacks
    return model, arena, Engine(model, arena, graphs=manager, metrics=metrics), Engine(model, arena), metrics


def _codes(model, n: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, model.codebook_size, (model.num_quantizers, n), generator=gen)  # [Q, n]


def _snapshot(arena: StateArena):
    return {k: t.clone() for k, t in arena.tensors.items()}, arena.positions.clone()


def _restore(arena: StateArena, snap) -> None:
    for k, t in arena.tensors.items():
        t.copy_(snap[0][k])
    arena.positions.copy_(snap[1])


def test_compiled_graph_streams_the_golden_and_matches_eager(golden_cases):
    model, arena, engine, eager, metrics = _setup(str(TINY), "float32", BucketKey("exact", 2, 25), compile_=True)
    codes, full = golden_cases["codes"], golden_cases["full"][:, 0]  # [2, Q, T], [2, T * U]
    slots = [arena.allocate(), arena.allocate()]
    outs: list[list[torch.Tensor]] = [[], []]
    worst_vs_eager = 0.0
    for start, n in ((0, 1), (1, 25), (26, 14)):  # 1 and 14 frames run padded in the 25-frame bucket
        items = [DecodeItem(codes[b, :, start:start + n], slots[b], 0) for b in range(2)]
        snap = _snapshot(arena)
        audio = engine.decode(items)
        after_graph = _snapshot(arena)
        _restore(arena, snap)
        reference = eager.decode(items)
        worst_vs_eager = max(worst_vs_eager, *((a - r).abs().max().item() for a, r in zip(audio, reference)))
        for k, t in arena.tensors.items():  # the state feeds every later chunk: held to the golden tolerance, and
            # relative to the activations' size (up to ~10: Inductor's kernels and the eager step's GEMMs round apart)
            torch.testing.assert_close(after_graph[0][k], t, rtol=1e-4, atol=1e-4)
        assert torch.equal(after_graph[1], arena.positions)
        for b in range(2):
            outs[b].append(audio[b])
    golden_err = max((torch.cat(outs[b]) - full[b]).abs().max().item() for b in range(2))
    print(f"compiled graph, tiny fp32: golden full max abs err {golden_err:.2e}, vs eager {worst_vs_eager:.2e}")
    assert golden_err <= 1e-4
    assert worst_vs_eager <= 1e-5
    replays = sum(s.value for m in metrics.graph_replays.collect() for s in m.samples if s.name.endswith("_total"))
    assert replays == 3


def test_compiled_graph_matches_eager_on_the_default_model():
    key = BucketKey("exact", 1, 25)
    model, arena, engine, eager, _ = _setup("default", "float32", key, compile_=True)
    slot = arena.allocate()
    eager.decode([DecodeItem(_codes(model, 25, 1), slot, 0)])  # a stream with real state
    items = [DecodeItem(_codes(model, 25, 2), slot, 0)]
    snap = _snapshot(arena)
    audio = engine.decode(items)[0]
    after_graph = _snapshot(arena)
    _restore(arena, snap)
    reference = eager.decode(items)[0]
    audio_err = (audio - reference).abs().max().item()
    state_err = max((after_graph[0][k][slot] - t[slot]).abs().max().item() for k, t in arena.tensors.items())
    print(f"compiled graph, default fp32 b1xt25: audio max abs err vs eager {audio_err:.2e}, state {state_err:.2e}")
    assert audio_err <= 1e-5


def test_compiled_voxcpm2_streams_its_golden_and_matches_eager():
    """The VoxCPM2 family through its compiled graph (depthwise convs as fused taps under compile): the golden
    latents in chunks 1, 16, 16, 16, 8 (the last padded in the 16-frame bucket)."""
    from safetensors.torch import load_file

    cases = load_file(str(VOXCPM2_TINY / "cases.safetensors"))
    latents, full = cases["latents"], cases["full"][:, 0]  # [2, D, 57], [2, 57 * U]
    model, arena, engine, eager, _ = _setup(str(VOXCPM2_TINY), "float32", BucketKey("exact", 2, 16), compile_=True)
    slots = [arena.allocate(), arena.allocate()]
    outs: list[list[torch.Tensor]] = [[], []]
    worst_vs_eager = 0.0
    for start, n in ((0, 1), (1, 16), (17, 16), (33, 16), (49, 8)):
        items = [DecodeItem(latents[b, :, start:start + n], slots[b], 0) for b in range(2)]
        snap = _snapshot(arena)
        audio = engine.decode(items)
        _restore(arena, snap)
        reference = eager.decode(items)  # leaves the eager state in the arena for the next chunk
        worst_vs_eager = max(worst_vs_eager, *((a - r).abs().max().item() for a, r in zip(audio, reference)))
        for b in range(2):
            outs[b].append(audio[b].cpu())
    golden_err = max((torch.cat(outs[b]) - full[b]).abs().max().item() for b in range(2))
    print(f"compiled graph, VoxCPM2 tiny fp32: golden full max abs err {golden_err:.2e}, vs eager {worst_vs_eager:.2e}")
    assert golden_err <= 1e-5
    assert worst_vs_eager <= 1e-5


def _stream_audio(model_spec: str, model_dtype: str, compile_: bool, num_chunks: int = 3) -> torch.Tensor:
    """``num_chunks`` 25-frame chunks of one stream (the bench's synthetic inputs: codes, or latents of std 1):
    ``[num_chunks * 25 * U]`` float32."""
    from code2wav.loadgen.inputs import InputContract, synthetic_inputs

    key = BucketKey("exact", 1, 25)
    if model_dtype == "float32" and not compile_:
        model = load_model(model_spec, torch.device("cuda"), "float32")
        arena = StateArena(model.state_layout(), NUM_SLOTS, model.dtype, model.device)
        engine = Engine(model, arena)  # the reference: the eager float32 step
    else:
        model, arena, engine, _, _ = _setup(model_spec, model_dtype, key, compile_)
    contract = InputContract.of(model)
    slot = arena.allocate()
    return torch.cat([engine.decode([DecodeItem(synthetic_inputs(contract, 25, 200 + c), slot, 0)])[0].cpu()
                      for c in range(num_chunks)])


def _snr_db(reference: torch.Tensor, test: torch.Tensor) -> float:
    noise = (test.double() - reference.double()).pow(2).sum().clamp_min(1e-30)
    return (10 * torch.log10(reference.double().pow(2).sum() / noise)).item()


@pytest.mark.parametrize("model_spec", ["default", "voxcpm2-default"])
def test_compiled_bf16_is_no_worse_than_the_plain_graph(model_spec):
    """Both families' real architectures (seeded random weights): bf16 audio of the compiled graph against the
    float32 eager step, no more than 1 dB below the plain graph's (VoxCPM2: the fused depthwise taps)."""
    reference = _stream_audio(model_spec, "float32", compile_=False)
    snr_plain = _snr_db(reference, _stream_audio(model_spec, "bfloat16", compile_=False))
    snr_compiled = _snr_db(reference, _stream_audio(model_spec, "bfloat16", compile_=True))
    print(f"{model_spec}: bf16 SNR vs float32 eager: plain graph {snr_plain:.2f} dB, compiled graph "
          f"{snr_compiled:.2f} dB")
    assert snr_compiled >= snr_plain - 1.0
