"""CPU tests for the graph plan (policy) and the streaming routine's padding contract."""

from __future__ import annotations

import pytest
import torch

from code2wav.sidecar.engine import DecodeItem, Engine
from code2wav.sidecar.graphs.plan import (BucketKey, build_buckets, dispatch, extra_bucket, refine_slices,
                                          slices_for_budget, time_slices)
from code2wav.sidecar.models.qwen3_tts.family import GRAPH_BUCKETS as QWEN3  # the default model's buckets
from code2wav.sidecar.graphs.routine import META_FRAMES, META_GATE, META_SLOT, META_TOKEN, StreamRoutine
from code2wav.sidecar.state_store import StateArena

EXACT = build_buckets("exact", QWEN3.exact_batch_sizes, QWEN3.exact_frames)


def test_buckets_are_largest_first_and_unique():
    assert EXACT[0] == BucketKey("exact", 16, 25)
    assert [k.cost for k in EXACT] == sorted((k.cost for k in EXACT), reverse=True)
    assert len(set(EXACT)) == len(EXACT) == len(QWEN3.exact_batch_sizes) * len(QWEN3.exact_frames)
    with pytest.raises(ValueError):
        build_buckets("exact", (0,), (1,))


@pytest.mark.parametrize("rows,frames,expected,pad_rows,pad_frames", [
    (1, [1], ("exact", 1, 1), 0, 0),
    (1, [25], ("exact", 1, 25), 0, 0),
    (3, [25, 1, 7], ("exact", 4, 25), 1, 24 + 18 + 25),
    (5, [1, 1, 1, 1, 1], ("exact", 8, 1), 3, 3),
    (2, [1, 2], ("exact", 2, 25), 0, 24 + 23),
])
def test_dispatch_picks_smallest_fitting_bucket(rows, frames, expected, pad_rows, pad_frames):
    choice = dispatch(EXACT, "exact", rows, frames)
    assert choice.key == BucketKey(*expected)
    assert choice.padding_rows == pad_rows and choice.padded_frames == pad_frames


def test_dispatch_reasons():
    assert dispatch(EXACT, "exact", 17, [1] * 17).reason == "batch_too_large"
    assert dispatch(EXACT, "exact", 1, [26]).reason == "frames_too_long"
    assert dispatch(EXACT, "window", 1, [50]).reason == "no_buckets"
    assert extra_bucket("exact", 3, 26, 32, 256) == BucketKey("exact", 4, 32)
    assert extra_bucket("exact", 33, 1, 32, 256) is None
    assert extra_bucket("exact", 1, 300, 32, 256) is None


def test_time_slices_cover_the_frames_and_the_budget_picks_the_fewest():
    assert time_slices(25, 1) == ((0, 25),)
    assert time_slices(25, 2) == ((0, 13), (13, 12))
    assert time_slices(32, 7) == ((0, 5), (5, 5), (10, 5), (15, 5), (20, 4), (24, 4), (28, 4))
    for frames in (1, 7, 25, 50):
        for n in range(1, frames + 1):
            parts = time_slices(frames, n)
            assert len(parts) == n and parts[0][0] == 0 and sum(length for _, length in parts) == frames
            assert all(a + la == b for (a, la), (b, _) in zip(parts, parts[1:]))  # contiguous
            assert max(length for _, length in parts) - min(length for _, length in parts) <= 1
    with pytest.raises(ValueError):
        time_slices(4, 5)
    gib = 2**30
    assert slices_for_budget(int(1.7 * gib), 2 * gib, 25) == 1
    assert slices_for_budget(int(3.69 * gib), 2 * gib, 25) == 2  # the default model's b32xt25 on the H200
    assert slices_for_budget(int(7.2 * gib), 2 * gib, 25) == 5  # 5 frames per slice: 1.44 GiB estimated
    assert slices_for_budget(100 * gib, 2 * gib, 25) is None  # even 1 frame per slice would not fit


def test_refine_slices_fits_a_line_through_the_last_two_measurements():
    """What the H200 measured for the default model's b32xt25 in float32: 6220 MiB whole, 1160 MiB in 7 slices
    (4 frames each at most), 1086 MiB in 9 (3 frames): a large part does not shrink with the slice, so a line
    through the whole step and one slicing is too hopeful. Through the last two measurements the line says the
    898 MiB a 1 GiB budget left after b1xt25 cannot be met (13 slices measured 20 GiB there: not tried)."""
    mib = 2**20
    assert refine_slices(25, [(25, 6220 * mib), (4, 1160 * mib)], 1024 * mib) == 9  # the hopeful first line
    assert refine_slices(25, [(25, 6220 * mib), (4, 1160 * mib), (3, 1086 * mib)], 898 * mib) is None
    assert refine_slices(25, [(25, 6220 * mib), (4, 1160 * mib), (3, 1086 * mib)], 1024 * mib) == 13  # 2 frames
    fixed, per_frame = 200 * mib, 240 * mib  # a step that is exactly linear: the refined count fits, one fewer not
    size = lambda slices: fixed + per_frame * -(-25 // slices)  # noqa: E731
    for budget in (600 * mib, 1024 * mib, 1800 * mib):  # each over budget at the proportional estimate
        start = slices_for_budget(size(1), budget, 25)
        assert size(start) > budget
        refined = refine_slices(25, [(25, size(1)), (-(-25 // start), size(start))], budget)
        assert refined > start and size(refined) <= budget
        assert refined == 25 or size(refined - 1) > budget or -(-25 // (refined - 1)) == -(-25 // refined)
    assert refine_slices(25, [(25, 1000 * mib), (5, 1000 * mib)], 500 * mib) is None  # slicing did not shrink it
    assert refine_slices(4, [(4, 100 * mib), (1, 60 * mib)], 50 * mib) is None  # already one frame per slice
    assert refine_slices(25, [(25, 6220 * mib), (4, 1160 * mib)], 100 * mib) is None  # the fixed part alone is over


@pytest.mark.parametrize("num_slices", [1, 3, 7])
def test_routine_padding_rows_and_frames_match_eager(tiny_model, golden_cases, num_slices):
    """The routine run on static buffers (what a graph captures) equals the eager engine for a padded
    bucket; padding rows write only the scratch slot; returned audio has exactly the real rows' samples.
    In time slices (``num_slices`` exact-streaming sub-steps: 7 leaves the 1- and 5-frame rows without frames in
    later slices) the audio and the committed state are the same."""
    codes = golden_cases["codes"]  # [2, Q, 40]
    layout = tiny_model.module.state_layout()
    eager_arena = StateArena(layout, 4, torch.float32, torch.device("cpu"))
    graph_arena = StateArena(layout, 4, torch.float32, torch.device("cpu"))
    eager = Engine(tiny_model, eager_arena)
    routine = StreamRoutine(tiny_model, graph_arena, max_batch=8, max_frames=32)
    slots_e = [eager_arena.allocate() for _ in range(3)]
    slots_g = [graph_arena.allocate() for _ in range(3)]
    bystander = graph_arena.allocate()  # a real stream not in the batch
    graph_arena.tensors[next(iter(layout))][bystander].fill_(7.0)
    snapshot = {k: t[bystander].clone() for k, t in graph_arena.tensors.items()}
    plan = [(0, 0, 5), (1, 0, 1), (0, 5, 25)]  # (row of codes, start, frames): different positions and sizes
    for step in range(2):
        items_e, items_g = [], []
        for (row, start, n), se, sg in zip(plan, slots_e, slots_g):
            chunk = codes[row, :, start + step * n: start + (step + 1) * n]
            skip = 1 if step == 0 and n > 1 else 0  # a context frame on first chunks
            items_e.append(DecodeItem(chunk, se, skip))
            items_g.append(DecodeItem(chunk, sg, skip))
        ref = eager.decode(items_e)
        routine.copy_in(8, 32, items_g)  # bucket b8 x t32: 5 padding rows, padded frames on every row
        with torch.inference_mode():
            out = routine.copy_out(routine.forward(8, 32, num_slices), items_g)
        for r, o, it in zip(ref, out, items_g):
            assert o.numel() == (it.codes.shape[1] - it.skip_frames) * tiny_model.samples_per_frame
            assert (r - o).abs().max().item() <= 1e-5
    for k, t in graph_arena.tensors.items():
        assert torch.equal(t[bystander], snapshot[k])  # padding never touched a real stream's slot
        for se, sg in zip(slots_e, slots_g):
            assert torch.allclose(t[sg], eager_arena.tensors[k][se], rtol=1e-4, atol=1e-4)  # same committed state
    assert torch.equal(graph_arena.positions[slots_g], eager_arena.positions[slots_e])


def test_time_sliced_routine_equals_the_whole_step_for_voxcpm2():
    """The second family (float latents, its own state layout) in time slices: the same audio and state as the
    whole step, rows of 16, 3 and 1 frames in a b4 x t16 bucket, two steps in a row."""
    from code2wav.sidecar.models import load_model

    from conftest import VOXCPM2_TINY

    model = load_model(str(VOXCPM2_TINY), torch.device("cpu"), "float32")
    gen = torch.Generator().manual_seed(5)
    latents = torch.randn(3, model.num_channels, 32, generator=gen)  # [3, D, 32]
    results = {}
    for num_slices in (1, 4):
        arena = StateArena(model.state_layout(), 4, torch.float32, torch.device("cpu"))
        routine = StreamRoutine(model, arena, max_batch=4, max_frames=16)
        slots = [arena.allocate() for _ in range(3)]
        outs = []
        for step in range(2):
            items = [DecodeItem(latents[r, :, step * 16: step * 16 + n], slots[r], 0) for r, n in enumerate((16, 3, 1))]
            routine.copy_in(4, 16, items)
            with torch.inference_mode():
                outs += routine.copy_out(routine.forward(4, 16, num_slices), items)
        results[num_slices] = outs, {k: t[:3].clone() for k, t in arena.tensors.items()}, arena.positions[:3].clone()
    (whole, whole_state, whole_pos), (sliced, sliced_state, sliced_pos) = results[1], results[4]
    assert max((a - b).abs().max().item() for a, b in zip(whole, sliced)) <= 1e-5
    assert max((whole_state[k] - sliced_state[k]).abs().max().item() for k in whole_state) <= 1e-4
    assert torch.equal(whole_pos, sliced_pos)


def test_copy_in_stages_each_row_as_the_per_row_contract_says():
    """``copy_in`` stages a batch in a few whole-batch ops: row ``b`` holds its inputs then zeros, padding rows
    hold zeros, the scratch slot, no valid frames and each option's default, whatever an earlier, larger or
    fuller batch left in the buffers; a row's stream option lands in its row. VoxCPM2 (float latents, one option)."""
    from code2wav.sidecar.models import load_model

    from conftest import VOXCPM2_TINY

    model = load_model(str(VOXCPM2_TINY), torch.device("cpu"), "float32")
    arena = StateArena(model.state_layout(), 6, torch.float32, torch.device("cpu"))
    routine = StreamRoutine(model, arena, max_batch=8, max_frames=16)
    (option,) = model.contract.stream_options
    gen = torch.Generator().manual_seed(3)
    full = [DecodeItem(torch.randn(model.num_channels, 16, generator=gen), slot, 0, options={option.name: 16000})
            for slot in range(6)]
    routine.copy_in(8, 16, full)  # rows of equal length (stacked); leaves every frame of the b8 x t16 bucket written
    assert torch.equal(routine.inputs(8, 16)[:6], torch.stack([item.codes for item in full]))
    assert not routine.inputs(8, 16)[6:8].any()
    meta = routine.meta(8)  # [K, 8]
    assert meta[META_SLOT].tolist() == list(range(6)) + [arena.scratch_slot] * 2
    assert routine.options(8)[option.name].tolist() == [16000] * 6 + [option.default] * 2
    assert meta[META_TOKEN].tolist() == meta[META_GATE].tolist() == [0] * 8  # no row armed: every row ready
    ragged = [DecodeItem(torch.randn(model.num_channels, n, generator=gen), slot, 0, options=opts)
              for n, slot, opts in ((3, 4, {option.name: 24000}), (5, 1, {}), (1, 2, {}))]
    routine.copy_in(4, 8, ragged)  # a smaller bucket: 1 padding row, padded frames on every row
    inputs = routine.inputs(4, 8)
    assert inputs.is_contiguous()  # one copy in at any frames
    for b, item in enumerate(ragged):
        n = item.codes.shape[1]
        assert torch.equal(inputs[b, :, :n], item.codes) and not inputs[b, :, n:].any()
    assert not inputs[3].any()
    meta = routine.meta(4)
    assert meta[META_FRAMES].tolist() == [3, 5, 1, 0]
    assert meta[META_SLOT].tolist() == [4, 1, 2, arena.scratch_slot]
    assert routine.options(4)[option.name].tolist() == [24000, option.default, option.default, option.default]
    routine.copy_in(1, 1, ragged[2:])  # one row: the frames of its bucket only
    assert torch.equal(routine.inputs(1, 1), ragged[2].codes[None])
    assert routine.meta(1)[META_FRAMES].tolist() == [1] and routine.meta(1)[META_SLOT].tolist() == [2]


def test_an_eager_plan_runs_the_rows_it_is_given(tiny_model, golden_cases):
    """Rows refused after planning (CUDA IPC inputs not ready) leave an eager step shorter than planned: it pads to
    the rows it runs, and their audio and state are those of a step planned for them alone."""
    from code2wav.sidecar.modes import MODES

    codes = golden_cases["codes"]  # [2, Q, 40]
    results = []
    for planned in ([7, 30], [7]):  # the 30-frame row was planned, then dropped
        arena = StateArena(tiny_model.module.state_layout(), 2, torch.float32, torch.device("cpu"))
        engine = Engine(tiny_model, arena, max_forward_frames=16)
        slot = arena.allocate()
        plan = engine.plan(MODES["exact"], planned)
        assert plan.bucket is None and plan.frames == max(planned)
        audio = engine.execute(plan, [DecodeItem(codes[0, :, :7], slot, 0)])[0]
        results.append((audio, {k: t[slot].clone() for k, t in arena.tensors.items()}))
    (audio_a, state_a), (audio_b, state_b) = results
    assert audio_a.shape == (7 * tiny_model.samples_per_frame,) and torch.equal(audio_a, audio_b)
    assert all(torch.equal(state_a[k], state_b[k]) for k in state_a)
