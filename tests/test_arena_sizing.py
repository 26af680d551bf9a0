"""Arena sizing policy (sidecar/arena_sizing.py) and the compile settings, on the CPU."""

from __future__ import annotations


import pytest
import torch

from code2wav.sidecar.config import state_memory_bytes
from code2wav.sidecar.arena_sizing import (CPU_STATE_MEMORY_BYTES, MAX_SLOTS, ArenaSizingError, plan_arena)
from code2wav.sidecar.config import ConfigError, load_config
from code2wav.sidecar.models.qwen3_tts import SHIPPED, random_model
from code2wav.sidecar.state_store import slot_nbytes

GiB = 1 << 30


@pytest.fixture(scope="module")
def shipped_layout() -> dict[str, tuple[int, ...]]:
    return random_model(SHIPPED, seed=0).state_layout()


def _auto(per_stream: int, free: int | None, reserve: int = 2 * GiB, margin: int = 8 * GiB, cap: int = 4096):
    return plan_arena(per_stream, max_streams=None, state_memory_bytes=None, free_device_bytes=free,
                      graph_reserve_bytes=reserve, margin_bytes=margin, auto_max_streams=cap)


def test_an_h200_holds_over_2000_bf16_streams_by_default(shipped_layout):
    per_stream = slot_nbytes(shipped_layout, torch.bfloat16)
    cfg = load_config()
    free_after_weights = 139 * GiB
    plan = plan_arena(per_stream, max_streams=cfg.streams.max_streams,
                      state_memory_bytes=state_memory_bytes(cfg), free_device_bytes=free_after_weights,
                      graph_reserve_bytes=cfg.graphs.max_graph_memory_bytes,
                      margin_bytes=cfg.streams.state_memory_margin_bytes, auto_max_streams=cfg.streams.auto_max_streams)
    assert plan.source == "free_device_memory"
    assert plan.num_slots == cfg.streams.auto_max_streams >= 2000  # capped: the H200 could hold far more
    # the old fixed 2 GiB budget held fewer than 1000 (826 on the H200 run of issue 21)
    assert plan_arena(per_stream, max_streams=None, state_memory_bytes=2 * GiB, free_device_bytes=None,
                      graph_reserve_bytes=0, margin_bytes=0, auto_max_streams=4096).num_slots < 1000


def test_budget_is_free_memory_less_graph_reserve_and_margin():
    per_stream = 1_000_000
    plan = _auto(per_stream, free=20 * GiB, reserve=2 * GiB, margin=8 * GiB, cap=1 << 20)
    assert plan.budget_bytes == 10 * GiB
    assert plan.num_slots == 10 * GiB // per_stream
    assert _auto(per_stream, free=20 * GiB, reserve=4 * GiB, margin=8 * GiB, cap=1 << 20).num_slots == \
        8 * GiB // per_stream
    assert _auto(per_stream, free=20 * GiB, cap=100).num_slots == 100
    assert _auto(per_stream, free=1 << 50, cap=1 << 30).num_slots == MAX_SLOTS


def test_explicit_settings_override_the_measurement():
    per_stream = 1_000_000
    common = dict(free_device_bytes=100 * GiB, graph_reserve_bytes=2 * GiB, margin_bytes=8 * GiB, auto_max_streams=4096)
    plan = plan_arena(per_stream, max_streams=37, state_memory_bytes=GiB, **common)
    assert (plan.num_slots, plan.source) == (37, "max_streams")
    plan = plan_arena(per_stream, max_streams=None, state_memory_bytes=GiB, **common)
    assert (plan.num_slots, plan.source) == (GiB // per_stream, "state_memory_bytes")


def test_cpu_keeps_the_fixed_default():
    plan = _auto(1_000_000, free=None)
    assert (plan.num_slots, plan.budget_bytes, plan.source) == (CPU_STATE_MEMORY_BYTES // 1_000_000,
                                                                CPU_STATE_MEMORY_BYTES, "cpu_default")


def test_no_room_is_a_clear_error():
    with pytest.raises(ArenaSizingError, match="state_memory_margin_bytes.*--max-streams"):
        _auto(1_000_000, free=9 * GiB, reserve=2 * GiB, margin=8 * GiB)
    with pytest.raises(ValueError):
        _auto(0, free=9 * GiB)


def test_describe_names_the_source():
    text = _auto(1_000_000, free=20 * GiB).describe(1_000_000)
    assert "4096 slots" in text and "free_device_memory" in text


def test_a_removed_key_is_named_with_why_it_went():
    with pytest.raises(ConfigError, match=r"'graphs.cudnn_benchmark' was removed \(the dense convs' forms are timed"):
        load_config(overrides={"graphs": {"cudnn_benchmark": True}})
    with pytest.raises(ConfigError, match="'graphs.cap_batch_to_buckets' was removed .* delete it from the config"):
        load_config(overrides={"graphs": {"cap_batch_to_buckets": False}})
    with pytest.raises(ConfigError, match=r"'graphs.compile' was removed \(the torch.compile'd step lost"):
        load_config(overrides={"graphs": {"compile": True}})
