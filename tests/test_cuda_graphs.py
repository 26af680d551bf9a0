"""CUDA graphs on a real GPU (skipped without one): graph == eager, golden through graphs, no aliasing,
padding isolation, capture failure -> eager, lazy capture bound, captures foreseen and deferred."""

from __future__ import annotations

import pytest
import torch

from code2wav.sidecar.config import ServerConfig
from code2wav.sidecar.engine import DecodeItem, Engine
from code2wav.sidecar.modes import MODES
from code2wav.sidecar.graphs.manager import GraphManager
from code2wav.sidecar.graphs.plan import BucketKey, build_buckets
from code2wav.sidecar.models.qwen3_tts.family import GRAPH_BUCKETS as QWEN3  # the default model's buckets
from code2wav.sidecar.metrics import Metrics
from code2wav.sidecar.models import load_model
from code2wav.sidecar.graphs.routine import StreamRoutine
from code2wav.sidecar.state_store import StateArena

from conftest import TINY

pytestmark = pytest.mark.cuda


@pytest.fixture(autouse=True)
def _tf32_off(no_tf32):
    """float32 tolerances hold only with TF32 off (conftest.no_tf32)."""


def _setup(model_spec: str, buckets, num_slots: int = 40, mode: str = "startup", max_lazy: int = 8,
           routine_cls=StreamRoutine, max_frames: int = 64, budget: int | None = None, dtype: str = "float32"):
    device = torch.device("cuda")
    model = load_model(model_spec, device, dtype)
    arena = StateArena(model.module.state_layout(), num_slots, model.dtype, device)
    max_batch = max(k.batch for k in buckets)
    metrics = Metrics()
    routines = {"exact": routine_cls(model, arena, max_batch, max_frames)}
    manager = GraphManager(routines, buckets, device, metrics, mode=mode, max_lazy_captures=max_lazy,
                           max_graph_memory_bytes=budget)
    manager.capture_startup()
    engine = Engine(model, arena, graphs=manager, metrics=metrics)
    eager = Engine(model, arena)
    return model, arena, manager, engine, eager, metrics


def _snapshot(arena: StateArena):
    return {k: t.clone() for k, t in arena.tensors.items()}, arena.positions.clone()


def _restore(arena: StateArena, snap) -> None:
    tensors, positions = snap
    for k, t in arena.tensors.items():
        t.copy_(tensors[k])
    arena.positions.copy_(positions)


def _codes(model, n: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, model.codebook_size, (model.num_quantizers, n), generator=gen)


def test_graph_equals_eager_for_every_default_bucket():
    buckets = build_buckets("exact", QWEN3.exact_batch_sizes, QWEN3.exact_frames)
    model, arena, manager, engine, eager, metrics = _setup("default", buckets)
    assert all(s.status == "captured" for s in manager.buckets.values()), manager.summary()
    slots = [arena.allocate() for _ in range(max(k.batch for k in buckets))]
    eager.decode([DecodeItem(_codes(model, 3 + i % 5, i), s, 0) for i, s in enumerate(slots)])  # non-zero state
    worst = {}
    for key in buckets:
        for padded in (False, True):
            rows = key.batch - 1 if padded and key.batch > 1 else key.batch
            frames = [key.frames if not padded else max(1, key.frames - 1 - (b % 3)) for b in range(rows)]
            items = [DecodeItem(_codes(model, n, 100 + b), slots[b], 0) for b, n in enumerate(frames)]
            snap = _snapshot(arena)
            out_graph = engine.decode(items)
            state_graph = _snapshot(arena)
            _restore(arena, snap)
            out_eager = eager.decode(items)
            err = max((g - e).abs().max().item() for g, e in zip(out_graph, out_eager))
            state_err = max((state_graph[0][k][slots[:rows]] - t[slots[:rows]]).abs().max().item()
                            for k, t in arena.tensors.items())
            worst[(key.label, padded)] = (err, state_err)
            tol = 1e-5 if (padded and (rows < key.batch or min(frames) < key.frames)) else 1e-6
            assert err <= tol, (key, padded, err)
            assert torch.equal(state_graph[1], arena.positions)
    print("graph vs eager max abs error per bucket:", {k: f"{v[0]:.1e}" for k, v in worst.items()})


def test_exact_streaming_through_graphs_matches_golden(golden_cases):
    buckets = build_buckets("exact", (1, 2, 4), (1, 25))
    model, arena, manager, engine, _, metrics = _setup(str(TINY), buckets)
    codes, full = golden_cases["codes"], golden_cases["full"][:, 0]
    slots = [arena.allocate(), arena.allocate()]
    outs = [[], []]
    for start, n in ((0, 1), (1, 25), (26, 14)):  # 14 runs padded in the 25-frame bucket
        audio = engine.decode([DecodeItem(codes[b, :, start:start + n], slots[b], 0) for b in range(2)])
        for b in range(2):
            outs[b].append(audio[b])
    for b in range(2):
        assert (torch.cat(outs[b]) - full[b]).abs().max().item() <= 1e-4
    assert sum(s.value for m in metrics.graph_replays.collect() for s in m.samples if s.name.endswith("_total")) == 3


def test_consecutive_replays_do_not_alias_and_padding_isolates_slots():
    buckets = (BucketKey("exact", 4, 25),)
    model, arena, manager, engine, eager, _ = _setup("default", buckets)
    slots = [arena.allocate() for _ in range(3)]
    bystander = arena.allocate()
    eager.decode([DecodeItem(_codes(model, 5, 9), bystander, 0)])
    bystander_state = {k: t[bystander].clone() for k, t in arena.tensors.items()}
    first_items = [DecodeItem(_codes(model, 25, s), s, 0) for s in slots]  # 3 rows: 1 padding row
    first = engine.decode(first_items)
    first_copy = [a.clone() for a in first]
    second = engine.decode([DecodeItem(_codes(model, 25, 50 + s), s, 0) for s in slots])
    for a, b in zip(first, first_copy):
        assert torch.equal(a, b)  # the second replay did not overwrite the first's audio
    assert any((a - b).abs().max() > 0 for a, b in zip(first, second))
    for k, t in arena.tensors.items():
        assert torch.equal(t[bystander], bystander_state[k])  # padding rows wrote only the scratch slot
    assert int(arena.positions[bystander]) == 5


class FailingRoutine(StreamRoutine):
    """Fails while a capture is active (a forced capture failure); runs normally otherwise."""

    def forward(self, batch, frames, num_slices=1):
        if torch.cuda.is_current_stream_capturing():
            raise RuntimeError("forced capture failure")
        return super().forward(batch, frames, num_slices)


def test_capture_failure_degrades_to_eager(golden_cases):
    buckets = (BucketKey("exact", 2, 25),)
    model, arena, manager, engine, _, metrics = _setup(str(TINY), buckets, routine_cls=FailingRoutine)
    state = manager.buckets[buckets[0]]
    assert state.status == "eager" and "forced capture failure" in state.reason
    failures = metrics.graph_capture_failures.labels(component="exact", bucket="b2xt25")._value.get()
    assert failures == 1
    codes, full = golden_cases["codes"], golden_cases["full"][:, 0]
    slots = [arena.allocate(), arena.allocate()]
    audio = engine.decode([DecodeItem(codes[b, :, :25], slots[b], 0) for b in range(2)])
    assert (audio[0] - full[0, : 25 * 48]).abs().max().item() <= 1e-4
    assert metrics.graph_misses.labels(component="exact", reason="not_captured")._value.get() == 1


def test_lazy_capture_respects_its_bound(golden_cases):
    buckets = (BucketKey("exact", 1, 25),)
    model, arena, manager, engine, _, metrics = _setup(str(TINY), buckets, mode="startup_lazy", max_lazy=1)
    codes = golden_cases["codes"][0]
    slot = arena.allocate()
    engine.decode([DecodeItem(codes[:, :30], slot, 0)])  # no bucket holds 30 frames: one lazy extra (b1 x t32)
    assert manager.buckets[BucketKey("exact", 1, 32)].status == "captured" and manager.lazy_captures == 1
    engine.decode([DecodeItem(codes[:, 30:40], slot, 0)])  # fits b1xt25: replay
    slot2 = arena.allocate()
    engine.decode([DecodeItem(codes[:, :33], slot2, 0)])  # would need b1xt40: over the bound, runs eager
    assert BucketKey("exact", 1, 40) not in manager.buckets and manager.lazy_captures == 1
    assert metrics.graph_misses.labels(component="exact", reason="frames_too_long")._value.get() == 1


def test_graph_memory_budget_slices_or_skips_buckets_by_name():
    """Over the budget, a bucket is captured in time slices when they fit (float32 b32 x t25, 6.1 GiB whole, in
    2 GiB beside b1 x t25), else skipped by name and run eager (under 8 MiB even one frame per slice does not
    fit)."""
    buckets = (BucketKey("exact", 32, 25), BucketKey("exact", 1, 25))
    budget = 2 << 30
    model, arena, manager, engine, _, metrics = _setup("default", buckets, budget=budget)
    big, small = manager.buckets[buckets[0]], manager.buckets[buckets[1]]
    print("graph memory summary:", manager.summary())
    assert big.status == "captured" and big.num_slices >= 2 and big.profile_bytes <= budget, manager.summary()
    assert small.status == "captured" and manager.pool_bytes <= budget
    key = (BucketKey("exact", 32, 25),)
    model, arena, manager, engine, _, metrics = _setup("default", key, budget=8 << 20)
    big = manager.buckets[key[0]]
    assert big.status == "skipped" and "max_graph_memory_bytes" in big.reason, manager.summary()
    assert "time slices" in big.reason  # what was tried is said
    slots = [arena.allocate() for _ in range(2)]
    out = engine.decode([DecodeItem(_codes(model, 25, s), s, 0) for s in slots])  # b32 was skipped: eager
    assert [o.numel() for o in out] == [25 * 1920] * 2
    assert metrics.graph_misses.labels(component="exact", reason="not_captured")._value.get() == 1


def test_capture_is_foreseen_and_can_be_left_to_another_thread(golden_cases):
    """The step plan says, without capturing, when a batch needs a capture first (the server then runs it in
    the worker thread, never on the loop thread); ``decode(may_capture=False)`` runs such a batch eager and
    leaves the capture for later. Audio is the same either way."""
    buckets = (BucketKey("exact", 1, 25),)
    model, arena, manager, engine, _, metrics = _setup(str(TINY), buckets, mode="lazy", max_lazy=1)
    codes, full = golden_cases["codes"][0], golden_cases["full"][0, 0]
    slot = arena.allocate()
    exact, window = MODES["exact"], MODES["window"]
    plan = engine.plan(exact, [10])
    assert (plan.bucket, plan.capture_first, plan.padded_frames) == (buckets[0], True, 15)
    assert engine.plan(exact, [30]).capture_first and manager.lazy_captures == 0  # an extra (b1xt32)
    first = engine.decode([DecodeItem(codes[:, :10], slot, 0)], may_capture=False)[0]  # eager, nothing captured
    assert manager.buckets[buckets[0]].status == "pending"
    assert metrics.graph_misses.labels(component="exact", reason="capture_deferred")._value.get() == 1
    second = engine.decode([DecodeItem(codes[:, 10:20], slot, 0)])[0]  # captured now, then replayed
    assert manager.buckets[buckets[0]].status == "captured"
    assert (engine.plan(exact, [10]).bucket, engine.plan(exact, [10]).capture_first) == (buckets[0], False)
    torch.testing.assert_close(torch.cat([first, second]), full[: 20 * 48], rtol=0, atol=1e-4)
    engine.decode([DecodeItem(codes[:, 20:40], slot, 0)])  # 20 frames: b1xt25 again
    extra = engine.plan(exact, [30])
    assert (extra.bucket, extra.reason, extra.capture_first) == (BucketKey("exact", 1, 32), "frames_too_long", True)
    no_bucket = engine.plan(window, [10])
    assert (no_bucket.bucket, no_bucket.reason, no_bucket.slices) == (None, "no_buckets", ((0, 10),))


def test_exact_buckets_up_to_batch_64_fit_the_default_budget():
    """Issue 21 item 3: the default model in bfloat16, exact buckets b1..b64 x t1, t25 under the default 2 GiB
    budget: every bucket is captured, those over the budget whole in time slices (b64 x t25), sized after the
    others; the pool stays within the budget. b32 x t25 fits whole (1772 MiB on the H200) since the transposed
    convs became one GEMM and the Snake kernels write channels-last: a memory regression would slice it again.
    A full b64 x t25 batch replays its graph and sounds like the eager step (only rounding differs in bfloat16: SNR
    over 20 dB). Prints the summary."""
    buckets = build_buckets("exact", (1, 2, 4, 8, 16, 32, 64), QWEN3.exact_frames)
    budget = ServerConfig().graphs.max_graph_memory_bytes
    model, arena, manager, engine, eager, metrics = _setup("default", buckets, num_slots=70, budget=budget,
                                                           dtype="bfloat16", max_frames=25)
    for state in manager.buckets.values():
        print(f"{state.key.label:>8s} {state.status:8s} slices {state.num_slices:2d} profile "
              f"{state.profile_bytes / 2**20:7.1f} MiB pool +{state.pool_bytes / 2**20:7.1f} MiB {state.reason}")
    print(f"pool {manager.pool_bytes / 2**20:.1f} MiB of {budget / 2**20:.0f} MiB")
    assert all(s.status == "captured" for s in manager.buckets.values()), manager.summary()
    assert manager.pool_bytes <= budget and manager.largest_captured_batch("exact") == 64
    assert manager.buckets[BucketKey("exact", 64, 25)].num_slices >= 2
    assert manager.buckets[BucketKey("exact", 32, 25)].num_slices == 1, manager.summary()
    slots = [arena.allocate() for _ in range(64)]
    items = [DecodeItem(_codes(model, 25, r), s, 0) for r, s in enumerate(slots)]
    snap = _snapshot(arena)
    graph_audio = torch.stack(engine.decode(items)).float()  # [64, 25 * 1920]
    _restore(arena, snap)
    eager_audio = torch.stack(eager.decode(items)).float()
    snr_db = 10 * torch.log10(eager_audio.pow(2).sum() / (graph_audio - eager_audio).pow(2).sum()).item()
    print(f"b64xt25 sliced graph vs eager, bfloat16: SNR {snr_db:.1f} dB")
    assert snr_db > 20
    assert metrics.graph_replays.labels(component="exact", bucket="b64xt25")._value.get() == 1


def test_a_bucket_over_the_memory_budget_is_captured_in_time_slices():
    """A bucket whose graph needs more than ``max_graph_memory_bytes`` is captured as exact-streaming time
    slices (a smaller peak) instead of being skipped, and replays the same audio as eager (default model,
    float32, TF32 off; rows of 25, 13 and 1 frames in a b8 x t25 bucket, two steps)."""
    key = BucketKey("exact", 8, 25)
    whole = _setup("default", (key,), max_frames=25)[2].buckets[key]
    assert whole.status == "captured" and whole.num_slices == 1
    budget = int(whole.profile_bytes * 0.6)
    model, arena, manager, engine, eager, _ = _setup("default", (key,), max_frames=25, budget=budget)
    state = manager.buckets[key]
    print(f"b8xt25: whole {whole.profile_bytes / 2**20:.1f} MiB; budget {budget / 2**20:.1f} MiB -> "
          f"{state.num_slices} slices, {state.profile_bytes / 2**20:.1f} MiB")
    assert state.status == "captured" and state.num_slices >= 2 and state.profile_bytes <= budget
    slots = [arena.allocate() for _ in range(3)]
    for step in range(2):
        items = [DecodeItem(_codes(model, n, 10 * step + r), slots[r], 0) for r, n in enumerate((25, 13, 1))]
        snap = _snapshot(arena)
        graph_audio = engine.decode(items)
        after_graph = _snapshot(arena)
        _restore(arena, snap)
        eager_audio = eager.decode(items)  # leaves the eager state for the next step
        assert max((g - e).abs().max().item() for g, e in zip(graph_audio, eager_audio)) <= 1e-5
        for k, t in arena.tensors.items():  # activations up to ~10: float32 rounding relative to their size
            # (a slice's GEMMs have fewer rows than the whole step's, so cuBLAS may sum in another order)
            ref = t[slots]
            assert (after_graph[0][k][slots] - ref).abs().max().item() <= 1e-4 * max(1.0, ref.abs().max().item()), k
        assert torch.equal(after_graph[1], arena.positions)
