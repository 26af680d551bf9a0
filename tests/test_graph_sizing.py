"""CPU tests for the graph manager's sizing for the memory budget: which buckets wait, what a bucket in time slices
is sized to, what is counted when a capture is thrown away, and the state a failure leaves.

The CUDA runtime is absent here, so the manager's device part (``capture.StepCapture``: warm-up, profile, capture) is
replaced by a memory model (``FakeDevice``; the real one runs in tests/test_cuda_graphs.py on the GPU): a bucket's step
needs ``FIXED + PER_ROW_FRAME * batch * longest slice`` bytes standalone (``profile``), and a real capture into the
shared pool grows it only by what exceeds what the pool already holds (freed blocks are reused; a discarded
capture's growth stays), as the caching allocator does. Everything else is the manager's own code.
"""

from __future__ import annotations

import pytest
import torch

from code2wav.sidecar.graphs.manager import GraphManager
from code2wav.sidecar.graphs.plan import MAX_SLICED_PROFILES, BucketKey
from code2wav.sidecar.metrics import Metrics

MIB = 2**20
FIXED = 100 * MIB
PER_ROW_FRAME = 4 * MIB  # b64 x t25 whole: 6500 MiB; b16 x t25: 1700 MiB
BUDGET = 2048 * MIB
B64, B16, B1 = BucketKey("exact", 64, 25), BucketKey("exact", 16, 25), BucketKey("exact", 1, 25)


class FakeDevice:
    """The memory model, and a record of what happened."""

    def __init__(self, extra_on_capture: dict[BucketKey, int] | None = None) -> None:
        self.pool_reserved = 0  # what the shared pool holds
        self.captured: list[tuple[BucketKey, int]] = []  # (bucket, slices) in capture order
        self.profiles: list[tuple[BucketKey, int]] = []
        self.extra_on_capture = extra_on_capture or {}  # a real capture that needs more than its profile
        self.fail: set[tuple[object, BucketKey, int]] = set()  # (routine, bucket, slices) whose warm-up raises

    @staticmethod
    def need(key: BucketKey, num_slices: int) -> int:
        return FIXED + PER_ROW_FRAME * key.batch * -(-key.frames // num_slices)

    def install(self, manager: GraphManager) -> None:
        manager.steps = self  # the manager's StepCapture

    # ------------------------------------------------------------------ capture.StepCapture's interface
    def warmup(self, routine, key: BucketKey, num_slices: int) -> int:
        if (routine, key, num_slices) in self.fail:
            raise RuntimeError(f"forced failure of {key.label} in {num_slices}")
        return 0  # live peak: no block reserved in this model

    def profile(self, routine, key: BucketKey, num_slices: int, live_peak_bytes: int) -> int:
        self.profiles.append((key, num_slices))
        return self.need(key, num_slices)

    def capture(self, routine, key: BucketKey, num_slices: int, pool, block_bytes: int):
        before = self.pool_reserved
        self.pool_reserved = max(self.pool_reserved, self.need(key, num_slices) + self.extra_on_capture.get(key, 0))
        self.captured.append((key, num_slices))
        return object(), torch.zeros(1), before

    def reserved_bytes(self) -> int:
        return self.pool_reserved

    def sync(self) -> None:
        return None


@pytest.fixture
def no_cuda_runtime(monkeypatch):
    """The manager's constructor and capture guard ask the CUDA runtime for a pool, a stream and the capture
    state; on CPU there is none, so these three answer as an idle device would."""
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: None)
    monkeypatch.setattr(torch.cuda, "Stream", lambda device: None)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)


def _manager(buckets, device: FakeDevice) -> tuple[GraphManager, object]:
    plain = object()
    manager = GraphManager({"exact": plain}, tuple(buckets), torch.device("cpu"), Metrics(),
                           max_graph_memory_bytes=BUDGET)
    device.install(manager)
    return manager, plain


def test_a_bucket_over_the_budget_waits_for_those_that_fit_and_takes_what_they_left(no_cuda_runtime):
    device = FakeDevice()
    manager, _ = _manager((B64, B16, B1), device)
    manager.capture_startup()
    b64, b16, b1 = (manager.buckets[k] for k in (B64, B16, B1))
    assert [k for k, _ in device.captured] == [B16, B1, B64]  # b64 first profiled, then captured last
    assert b16.status == b1.status == "captured" and b16.num_slices == b1.num_slices == 1
    # sized to the largest captured bucket (1700 MiB; 2048 - 1700 left would be less): 5 slices of 5 frames
    assert b64.status == "captured" and b64.num_slices == 5 and b64.profile_bytes == device.need(B64, 5)
    assert b64.profile_bytes <= b16.profile_bytes and b64.pool_bytes == 0  # it reuses b16's blocks
    assert manager.pool_bytes == device.pool_reserved == b16.profile_bytes <= BUDGET
    assert device.profiles.count((B64, 1)) == 1  # its whole profile is measured once, not again when sized


def test_a_failed_capture_leaves_the_bucket_eager_with_its_whole_size(no_cuda_runtime):
    device = FakeDevice()
    manager, plain = _manager((B64, B16), device)
    device.fail.add((plain, B64, 5))  # the sliced warm-up raises
    manager.capture_startup()
    b64 = manager.buckets[B64]
    assert b64.status == "eager" and "forced failure of b64xt25 in 5" in b64.reason
    assert (b64.num_slices, b64.profile_bytes) == (1, device.need(B64, 1))
    assert manager.buckets[B16].status == "captured"


def test_a_capture_thrown_away_over_the_budget_is_still_counted_in_the_pool(no_cuda_runtime):
    """b1 x t25 profiles small but its real capture grows the pool past the budget: it is skipped, and what it
    grew stays counted (those blocks stay reserved in the shared pool)."""
    device = FakeDevice(extra_on_capture={B1: 2000 * MIB})
    manager, _ = _manager((B16, B1), device)
    manager.capture_startup()
    b1 = manager.buckets[B1]
    assert b1.status == "skipped" and "would grow graph memory" in b1.reason and "stays in the pool" in b1.reason
    assert (b1.num_slices, b1.profile_bytes) == (1, device.need(B1, 1))
    assert manager.pool_bytes == device.pool_reserved > BUDGET  # honest: the pool holds more than the budget now


def test_sizing_measures_at_most_a_few_slice_counts_and_says_what_it_tried(no_cuda_runtime, monkeypatch):
    """A step whose memory hardly shrinks with the slice (a large fixed part) cannot fit: the manager measures
    at most MAX_SLICED_PROFILES slice counts, then skips the bucket naming each size it measured."""
    monkeypatch.setattr(FakeDevice, "need", staticmethod(lambda key, n: 2000 * MIB + 30 * MIB * -(-key.frames // n)
                                                         * key.batch // 16))
    device = FakeDevice()
    manager, _ = _manager((B64,), device)
    manager.capture_startup()
    b64 = manager.buckets[B64]
    sliced = [n for k, n in device.profiles if k == B64 and n > 1]
    assert b64.status == "skipped" and 1 <= len(sliced) <= MAX_SLICED_PROFILES
    assert all(f"MiB in {n}" in b64.reason for n in sliced) and "max_graph_memory_bytes" in b64.reason
    assert (b64.num_slices, b64.profile_bytes) == (1, device.need(B64, 1)) and device.captured == []


def test_max_split_size_is_read_from_the_allocator_config():
    """The one-block reservation is skipped for a block the caching allocator would never split."""
    from code2wav.sidecar.graphs.capture import max_split_bytes

    assert max_split_bytes({}) == float("inf")
    assert max_split_bytes({"PYTORCH_CUDA_ALLOC_CONF": "expandable_segments:False,max_split_size_mb:512"}) == 512 * MIB
    assert max_split_bytes({"PYTORCH_ALLOC_CONF": "max_split_size_mb:64"}) == 64 * MIB
    assert max_split_bytes({"PYTORCH_CUDA_ALLOC_CONF": "garbage_collection_threshold:0.6"}) == float("inf")
