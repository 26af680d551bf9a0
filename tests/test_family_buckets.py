"""Graph buckets come from the model's family unless the config names them (policy, CPU): Qwen3-TTS's clients
send 1-frame then 25-frame chunks, VoxCPM2's talker 4-frame latent patches; a config list overrides its field
only; every registered family's defaults are valid buckets."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from code2wav.sidecar.bootstrap import configured_buckets, routine_shapes, with_family_buckets
from code2wav.sidecar.config import ServerConfig, load_config
from code2wav.sidecar.graphs.plan import build_buckets, dispatch
from code2wav.sidecar.models import FAMILIES, GraphBuckets, load_model
from conftest import VOXCPM2_TINY


def _labels(cfg: ServerConfig, mode: str) -> set[str]:
    return {k.label for k in configured_buckets(cfg.graphs) if k.mode == mode}


@pytest.mark.parametrize("family", FAMILIES, ids=lambda f: f.name)
def test_every_family_has_valid_default_buckets(family):
    b = family.graph_buckets
    assert isinstance(b, GraphBuckets)
    exact = build_buckets("exact", b.exact_batch_sizes, b.exact_frames)
    window = build_buckets("window", b.window_batch_sizes, b.window_frames)
    assert len(exact) == len(b.exact_batch_sizes) * len(b.exact_frames) and window


def test_unset_bucket_lists_take_the_model_familys_defaults(tmp_path):
    qwen3 = load_model("default", "cpu", "float32")
    voxcpm2 = load_model(str(VOXCPM2_TINY), "cpu", "float32")
    cfg = ServerConfig()
    assert cfg.graphs.exact_frames is None  # unset until the model is known
    q = with_family_buckets(cfg, qwen3)
    assert q.graphs.exact_frames == (1, 25) and q.graphs.exact_batch_sizes == (1, 2, 4, 8, 16)
    assert _labels(q, "window") == {"b1xt50", "b2xt50", "b4xt50", "b8xt50"}
    v = with_family_buckets(cfg, voxcpm2)
    assert v.graphs.exact_frames == (4, 25) and v.graphs.exact_batch_sizes == (1, 2, 4, 8, 16, 32, 64)
    assert "b64xt4" in _labels(v, "exact") and _labels(v, "window") == {"b1xt24", "b2xt24", "b4xt24", "b8xt24"}
    # a 4-frame patch batch of 40 rows runs in b64 x t4 with no frame padding; a 1-frame tail pads to 4
    d = dispatch(configured_buckets(v.graphs), "exact", 40, [4] * 40)
    assert (d.key.label, d.padding_rows) == ("b64xt4", 24)
    assert dispatch(configured_buckets(v.graphs), "exact", 1, [1]).key.label == "b1xt4"
    # the other settings of the section are kept
    assert v.graphs.max_graph_memory_bytes == cfg.graphs.max_graph_memory_bytes


def test_a_configured_list_overrides_only_its_field(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("graphs:\n  exact_frames: [4, 8]\n")
    cfg = load_config(path, {})
    v = with_family_buckets(cfg, load_model(str(VOXCPM2_TINY), "cpu", "float32"))
    assert v.graphs.exact_frames == (4, 8)
    assert v.graphs.exact_batch_sizes == (1, 2, 4, 8, 16, 32, 64) and v.graphs.window_frames == (24,)


def test_bucket_sizes_below_one_are_refused_at_load(tmp_path):
    path = tmp_path / "c.yaml"
    path.write_text("graphs:\n  exact_frames: [0, 25]\n")
    with pytest.raises((ValidationError, ValueError), match="exact_frames"):
        load_config(path, {})


def test_a_mode_with_no_buckets_gets_no_graph_routine(tmp_path):
    """``window_batch_sizes: []`` turns window graphs off: no static buffers for that mode (it runs eager), where
    it used to stop start-up with ``max() iterable argument is empty`` (found on the H200)."""
    path = tmp_path / "c.yaml"
    path.write_text("graphs:\n  exact_batch_sizes: [1, 8]\n  exact_frames: [4]\n  window_batch_sizes: []\n")
    voxcpm2 = load_model(str(VOXCPM2_TINY), "cpu", "float32")
    cfg = with_family_buckets(load_config(path), voxcpm2)
    assert _labels(cfg, "window") == set()
    assert routine_shapes(cfg.graphs, max_forward_frames=256) == {"exact": (8, 256)}
    assert routine_shapes(with_family_buckets(ServerConfig(), voxcpm2).graphs, 16) == {"exact": (64, 25),
                                                                                          "window": (8, 24)}
