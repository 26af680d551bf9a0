"""No stream is ever left poisoned (issue 47, item 3).

A chunk whose audio or new state is not finite is not committed: its stream keeps its last good state and
position, the chunk is refused (``internal``, counted in ``chunks_not_finite_total``), and the stream's next normal
chunk is exactly what it would have been without the bad one. Other rows of the same batch are untouched,
bit for bit. Inputs beyond the documented range are refused up front: VoxCPM2 latents of magnitude over
``LATENT_ABS_MAX`` (1e4; the measured margin is in ``models.family``); and again by the step itself (CUDA IPC inputs
reach it unchecked): such a row is ``ROW_BAD_INPUTS``, with the same guarantees. Both families, eager steps and the graph
routine's step (the code a CUDA graph captures, run here on the CPU: the same check and commit), float32 and
bfloat16, extreme finite values, denormals, mixed batches; and end to end through a real server and client, with a
family defined here whose weights overflow within the input range.
"""

from __future__ import annotations

import pytest
import torch

from code2wav.client import SidecarClient
from code2wav.client import errors as cerr
from code2wav.sidecar.engine import DecodeItem, Engine
from code2wav.sidecar.forward import ROW_BAD_INPUTS, ROW_COMMITTED, ROW_NOT_FINITE, ROW_NOT_READY
from code2wav.sidecar.graphs.routine import StreamRoutine
from code2wav.sidecar.models import load_model
from code2wav.sidecar.models.family import LATENT_ABS_MAX
from code2wav.sidecar.modes import mode_for
from code2wav.sidecar.state_store import StateArena
from conftest import TINY, VOXCPM2_TINY, start_sidecar

FLOAT32_EXTREME = 3.4e38  # the largest float32 magnitudes are finite: accepted by a bare finiteness check
DENORMAL = 1e-40  # below float32's smallest normal (1.18e-38)
EXACT = mode_for(True)


def _engine(model, num_slots: int = 4) -> Engine:
    return Engine(model, StateArena(model.state_layout(), num_slots, model.dtype, model.device))


def _snapshot(arena: StateArena, slot: int) -> tuple[torch.Tensor, int]:
    return arena.flat[slot].clone(), int(arena.positions[slot])


def _run_routine(model, arena: StateArena, items: list[DecodeItem]) -> tuple[list[torch.Tensor], list[int]]:
    """One step through the graph routine (copy in, the captured forward's code, copy out) on its own buffers."""
    routine = StreamRoutine(model, arena, max_batch=4, max_frames=16)
    frames = max(it.num_frames for it in items)
    routine.copy_in(4, frames, items)  # two padding rows on the scratch slot
    with torch.inference_mode():
        wav = routine.forward(4, frames)
    return routine.copy_out(wav, items), routine.outcomes[:len(items)].tolist()


def _step(path: str, engine: Engine, items: list[DecodeItem]) -> tuple[list[torch.Tensor], list[int]]:
    """One step's audio and its rows' ``ROW_*`` outcomes."""
    if path == "eager":
        return engine.execute_checked(engine.plan(EXACT, [it.num_frames for it in items]), items)
    return _run_routine(engine.model, engine.arena, items)


def _poisoned_run(model, path: str, good: list[torch.Tensor], bad: torch.Tensor, bystander: list[torch.Tensor]):
    """Streams P and B in one batch per step: [B0, P0], [B1, P_bad], [B2, P1]. Returns B's audio, P's audio of
    steps 1 and 3, step 2's outcomes, and P's slot before and after step 2."""
    engine = _engine(model)
    slot_b, slot_p = engine.arena.allocate(), engine.arena.allocate()
    out_b, out_p = [], []
    audio, outcomes = _step(path, engine, [DecodeItem(bystander[0], slot_b, 0), DecodeItem(good[0], slot_p, 0)])
    assert outcomes == [ROW_COMMITTED, ROW_COMMITTED]
    out_b.append(audio[0]), out_p.append(audio[1])
    before = _snapshot(engine.arena, slot_p)
    audio, ok_bad = _step(path, engine, [DecodeItem(bystander[1], slot_b, 0), DecodeItem(bad, slot_p, 0)])
    out_b.append(audio[0])
    after = _snapshot(engine.arena, slot_p)
    audio, outcomes = _step(path, engine, [DecodeItem(bystander[2], slot_b, 0), DecodeItem(good[1], slot_p, 0)])
    assert outcomes == [ROW_COMMITTED, ROW_COMMITTED]
    out_b.append(audio[0]), out_p.append(audio[1])
    return out_b, out_p, ok_bad, before, after


def _clean_run(model, path: str, good: list[torch.Tensor], bystander: list[torch.Tensor]):
    """The same steps with P's bad chunk left out: [B0, P0], [B1, P1], [B2, P1 again on a scratch stream]."""
    engine = _engine(model)
    slot_b, slot_p, spare = engine.arena.allocate(), engine.arena.allocate(), engine.arena.allocate()
    out_b, out_p = [], []
    audio, _ = _step(path, engine, [DecodeItem(bystander[0], slot_b, 0), DecodeItem(good[0], slot_p, 0)])
    out_b.append(audio[0]), out_p.append(audio[1])
    audio, _ = _step(path, engine, [DecodeItem(bystander[1], slot_b, 0), DecodeItem(good[1], slot_p, 0)])
    out_b.append(audio[0]), out_p.append(audio[1])
    audio, _ = _step(path, engine, [DecodeItem(bystander[2], slot_b, 0), DecodeItem(good[1], spare, 0)])
    out_b.append(audio[0])
    return out_b, out_p


def _total(counter) -> float:
    """A labelled prometheus Counter's sum over its labels."""
    return sum(sample.value for metric in counter.collect() for sample in metric.samples
               if sample.name.endswith("_total"))


def _check_not_poisoned(model, path: str, good, bad, bystander, refused_as: int = ROW_NOT_FINITE) -> None:
    out_b, out_p, outcomes_bad, before, after = _poisoned_run(model, path, good, bad, bystander)
    ref_b, ref_p = _clean_run(model, path, good, bystander)
    assert outcomes_bad == [ROW_COMMITTED, refused_as]  # the bystander committed, the poisoned row did not
    assert torch.equal(before[0], after[0]) and before[1] == after[1]  # P's slot: same state and position
    for got, ref in zip(out_b, ref_b):
        assert torch.equal(got, ref)  # the bystander in the same batch: bit-identical audio
    assert torch.equal(out_p[0], ref_p[0])
    assert torch.equal(out_p[1], ref_p[1])  # P's next normal chunk: as if the bad chunk never came
    assert all(bool(torch.isfinite(a).all()) for a in out_b + out_p)


@pytest.mark.parametrize("path", ["eager", "graph_routine"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_voxcpm2_extreme_latents_never_poison_a_stream(path, dtype):
    model = load_model(str(VOXCPM2_TINY), torch.device("cpu"), dtype)
    gen = torch.Generator().manual_seed(47)
    D = model.num_channels
    good = [torch.randn(D, 5, generator=gen), torch.randn(D, 4, generator=gen)]
    bystander = [torch.randn(D, n, generator=gen) for n in (5, 3, 4)]
    bad = torch.full((D, 3), FLOAT32_EXTREME)
    bad[::2] *= -1  # +-3.4e38: finite, and every sample of the audio comes out NaN
    staged = model.input.staged_dtype(model.dtype)
    cast = lambda ts: [t.to(staged) for t in ts]  # noqa: E731 - (engine items hold staged inputs)
    # beyond the bound: the step's own input check refuses the row before its audio is looked at
    _check_not_poisoned(model, path, cast(good), bad.to(staged), cast(bystander), refused_as=ROW_BAD_INPUTS)


@pytest.mark.parametrize("path", ["eager", "graph_routine"])
def test_qwen3_overflow_inside_the_model_never_poisons_a_stream(path):
    """Codes are range-checked, so a Qwen3 chunk overflows only inside the model: a codebook entry of 3e38 here."""
    model = load_model(str(TINY), torch.device("cpu"), "float32")
    model.module.codebook_table[63] = 3.0e38  # quantizer 0's code 63
    gen = torch.Generator().manual_seed(3)
    Q = model.num_channels
    good = [torch.randint(0, 63, (Q, 5), generator=gen), torch.randint(0, 63, (Q, 4), generator=gen)]
    bystander = [torch.randint(0, 63, (Q, n), generator=gen) for n in (5, 3, 4)]
    bad = torch.randint(0, 63, (Q, 4), generator=gen)  # as long as good[1]: the clean run's step has the same shape
    bad[0, 1] = 63
    _check_not_poisoned(model, path, good, bad, bystander)


@pytest.mark.parametrize("path", ["eager", "graph_routine"])
@pytest.mark.parametrize("bad_code", [-1, 64, 10**6])
def test_codes_out_of_range_that_skipped_the_host_check_are_refused_by_the_step(path, bad_code):
    """CUDA IPC codes of an exact stream reach the step unchecked (``ipc.io.load_codes``): the step's own check
    (``InputSpec.check_rows``) clamps them before any lookup (an index outside the codebook raises here on the CPU,
    and would fault the device for every stream on a GPU), refuses the row as ``ROW_BAD_INPUTS`` and keeps its
    stream's state; the bystander's audio is bit-identical, the stream's next chunk as if the bad one never came."""
    model = load_model(str(TINY), torch.device("cpu"), "float32")
    assert model.input.high == 64
    gen = torch.Generator().manual_seed(11)
    Q = model.num_channels
    good = [torch.randint(0, 64, (Q, 5), generator=gen), torch.randint(0, 64, (Q, 4), generator=gen)]
    bystander = [torch.randint(0, 64, (Q, n), generator=gen) for n in (5, 3, 4)]
    bad = torch.randint(0, 64, (Q, 4), generator=gen)  # as long as good[1]: the clean run's step has the same shape
    bad[Q - 1, 2] = bad_code
    _check_not_poisoned(model, path, good, bad, bystander, refused_as=ROW_BAD_INPUTS)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_denormal_and_bound_latents_are_accepted_and_committed(dtype):
    model = load_model(str(VOXCPM2_TINY), torch.device("cpu"), dtype)
    D = model.num_channels
    staged = model.input.staged_dtype(model.dtype)
    for inputs in (torch.full((D, 4), DENORMAL), torch.full((D, 4), -LATENT_ABS_MAX),
                   torch.where(torch.arange(4) % 2 == 0, LATENT_ABS_MAX, -DENORMAL).expand(D, 4)):
        assert model.input.problem(inputs) is None
        engine = _engine(model)
        slot = engine.arena.allocate()
        audio, outcomes = engine.execute_checked(engine.plan(EXACT, [4]), [DecodeItem(inputs.to(staged), slot, 0)])
        assert outcomes == [ROW_COMMITTED] and bool(torch.isfinite(audio[0]).all()) and int(engine.arena.positions[slot]) == 4


def test_latents_beyond_the_bound_are_refused_up_front():
    model = load_model(str(VOXCPM2_TINY), torch.device("cpu"), "float32")
    x = torch.zeros(model.num_channels, 3)
    x[2, 1] = -2 * LATENT_ABS_MAX
    assert model.input.problem(x) == ("latents hold a value of magnitude 2e+04, beyond the bound 10000 that keeps "
                                      "the decoder finite (proto/README.md, section 4)")
    x[2, 1] = FLOAT32_EXTREME
    assert "beyond the bound 10000" in model.input.problem(x)
    x[2, 1] = float("inf")
    assert "non-finite value (NaN or inf)" in model.input.problem(x)


def test_server_refuses_extreme_latents_and_the_stream_goes_on(tmp_path):
    """Over the wire (VoxCPM2 tiny sidecar): +-3.4e38 latents are invalid_argument, the stream's next chunk and a
    bystander in the same message equal a clean stream's audio bit for bit; denormals decode."""
    running = start_sidecar(tmp_path, model=str(VOXCPM2_TINY))
    try:
        with SidecarClient(running.address, timeout_s=60) as client:
            D = client.models[0].channels
            gen = torch.Generator().manual_seed(5)
            chunks = [torch.randn(D, 4, generator=gen) for _ in range(3)]
            clean = client.open_stream("clean")
            ref = [clean.decode(c) for c in chunks]
            hit, bystander = client.open_stream("hit"), client.open_stream("bystander")
            assert torch.equal(hit.decode(chunks[0]), ref[0])
            bad = torch.full((D, 4), FLOAT32_EXTREME)
            results = client.decode_batch([(hit, bad), (bystander, chunks[0])], return_exceptions=True)
            assert isinstance(results[0], cerr.InvalidArgument) and "beyond the bound 10000" in str(results[0])
            assert torch.equal(results[1], ref[0])
            assert torch.equal(hit.decode(chunks[1]), ref[1])  # the same seq again, normal inputs
            assert torch.equal(hit.decode(chunks[2]), ref[2])
            tiny = client.open_stream("denormal").decode(torch.full((D, 4), DENORMAL))
            assert bool(torch.isfinite(tiny).all())
    finally:
        running.stop()


@pytest.mark.parametrize(("device", "steps_in_flight"), [("cpu", 1), ("cpu", 2),
                                                         pytest.param("cuda", "auto", marks=pytest.mark.cuda)])
def test_a_chunk_that_overflows_in_the_model_is_refused_over_the_wire(tmp_path, device, steps_in_flight):
    """A family (the toy of test_family_toy) whose weights overflow float32 for latents of magnitude >= ~300, well
    inside the input range: the chunk gets ``internal`` naming the seq, is counted, and the stream continues from
    its last good state: its next chunk equals a clean stream's; a bystander in the same batch is bit-identical.
    On CUDA the steps are the family's captured graphs (b1, b2 x 1, 8 frames): the check and the commit replayed,
    pipelined (``auto``: two steps in flight); on the CPU with two steps in flight the pipelined stepper's logic."""
    from safetensors.torch import load_file, save_file  # noqa: PLC0415

    import test_family_toy as toy  # noqa: PLC0415

    folder = tmp_path / "hot"
    folder.mkdir()
    (folder / "config.json").write_text((toy.json.dumps({"toy_decoder": {"latent_dim": toy.LATENT_DIM,
                                                                         "samples_per_frame": 8}})))
    torch.manual_seed(7)
    weights = toy.ToyDecoder(toy.LATENT_DIM, 8).state_dict()
    weights = {k: (v * 1e36 if k == "mix.conv.weight" else v).contiguous() for k, v in weights.items()}
    save_file(weights, str(folder / "model.safetensors"))
    assert torch.equal(load_file(str(folder / "model.safetensors"))["mix.conv.weight"], weights["mix.conv.weight"])
    running = toy.serve(tmp_path, folder, device, scheduler={"max_steps_in_flight": steps_in_flight})
    try:
        with SidecarClient(running.server.address, timeout_s=60) as client:
            gen = torch.Generator().manual_seed(9)
            chunks = [torch.randn(toy.LATENT_DIM, n, generator=gen) for n in (3, 2, 4)]
            hot = torch.full((toy.LATENT_DIM, 2), 1000.0)  # inside the bound; h = 1e36 x 1000 overflows
            solo, clean, partner = (client.open_stream(name) for name in ("solo", "clean", "partner"))
            ref = [solo.decode(c) for c in chunks]  # one stream alone: what "hit" must give after the hot chunk
            assert torch.equal(clean.decode(chunks[0]), ref[0]) and torch.equal(partner.decode(chunks[0]), ref[0])
            # the bystander's reference: the same batch company, with a normal chunk where the hot one will be
            ref_pair = client.decode_batch([(partner, torch.ones(toy.LATENT_DIM, 2)), (clean, chunks[1])])[1]
            hit, bystander = client.open_stream("hit"), client.open_stream("bystander")
            assert torch.equal(hit.decode(chunks[0]), ref[0])
            assert torch.equal(bystander.decode(chunks[0]), ref[0])
            results = client.decode_batch([(hit, hot), (bystander, chunks[1])], return_exceptions=True)  # one batch
            assert isinstance(results[0], cerr.SidecarError), results[0]
            assert "seq 1 is not finite" in str(results[0]) and "continues from its last good state" in str(results[0])
            assert torch.equal(results[1], ref_pair)  # bit-identical beside the hot row
            assert torch.equal(hit.decode(chunks[1]), ref[1])  # seq 1 again, as if the hot chunk never came
            assert torch.equal(hit.decode(chunks[2]), ref[2])
            assert running.server.metrics.chunks_not_finite._value.get() == 1
            assert all(bool(torch.isfinite(r).all()) for r in ref)
            if device == "cuda":  # every step above was a graph replay
                metrics = running.server.metrics
                assert _total(metrics.graph_misses) == 0 and _total(metrics.graph_replays) >= 8
    finally:
        running.stop()


def test_split_outcomes_refuses_each_row_with_the_code_its_outcome_names():
    from types import SimpleNamespace

    from prometheus_client import CollectorRegistry, Counter

    from code2wav.proto import ErrorCode
    from code2wav.sidecar.step_rows import split_outcomes

    not_finite = Counter("not_finite", "rows whose audio or state was not finite", registry=CollectorRegistry())
    not_ready = Counter("not_ready", "armed rows not rung when released", registry=CollectorRegistry())

    def armed(token: int):  # an armed chunk's CUDA IPC inputs: its word, region and the region's doorbells
        return SimpleNamespace(event_index=3, region=SimpleNamespace(region_id=9),
                               armed=SimpleNamespace(token=token, doorbells=SimpleNamespace(released=False)))

    late, rung = armed(42), armed(44)
    jobs = [SimpleNamespace(seq=s) for s in (4, 5, 6, 7)] + [SimpleNamespace(seq=8, ipc_codes=late)]
    audios = ["a4", "a5", "a6", "a7", "a8"]
    assert split_outcomes(jobs, audios, [ROW_COMMITTED] * 5, not_finite, "x") == (jobs, audios, [])
    # an armed row of another client in the same step, rung in time: decoded, its region stays armed
    jobs[3].ipc_codes = rung
    done, kept, refused = split_outcomes(
        jobs, audios, [ROW_COMMITTED, ROW_BAD_INPUTS, ROW_NOT_FINITE, ROW_COMMITTED, ROW_NOT_READY], not_finite,
        "a code out of range [0, 64)", armed_wait_s=0.25, not_ready=not_ready)
    assert done == [jobs[0], jobs[3]] and kept == ["a4", "a7"]
    (bad_job, bad_code, bad_message), (nan_job, nan_code, nan_message), (late_job, late_code, late_message) = refused
    assert (bad_job, bad_code) == (jobs[1], ErrorCode.INVALID_ARGUMENT)
    assert bad_message.startswith("seq 5 holds a code out of range [0, 64): the chunk was not committed")
    assert (nan_job, nan_code) == (jobs[2], ErrorCode.INTERNAL) and "seq 6 is not finite" in nan_message
    assert (late_job, late_code) == (jobs[4], ErrorCode.DEADLINE_EXCEEDED)
    assert late_message.startswith("seq 8's codes were not ready: doorbell word 3 of region 9 had not reached "
                                   "codes_token 42 0.25s after the step queued its wait (armed_wait_s)")
    assert _total(not_finite) == 1  # only the row that overflowed is counted there
    # the row not ready disarms its region (its later chunks go by their event) and is counted; the rung one not
    assert late.armed.doorbells.released and not rung.armed.doorbells.released and _total(not_ready) == 1
