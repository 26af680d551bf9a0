"""CPU tests of the graph dispatcher's padding tables (pure policy: built once per set of usable buckets)."""

from __future__ import annotations

import pytest

from code2wav.sidecar.graphs.plan import BucketKey, PaddingTable, build_buckets
from code2wav.sidecar.models.qwen3_tts.family import GRAPH_BUCKETS as QWEN3  # the default model's buckets

EXACT = build_buckets("exact", QWEN3.exact_batch_sizes, QWEN3.exact_frames)
WINDOW = build_buckets("window", QWEN3.window_batch_sizes, QWEN3.window_frames)


@pytest.mark.parametrize("rows,frames,expected,pad_rows,pad_frames", [
    (1, [1], (1, 1), 0, 0),
    (1, [25], (1, 25), 0, 0),
    (3, [25, 1, 7], (4, 25), 1, 24 + 18 + 25),
    (5, [1, 1, 1, 1, 1], (8, 1), 3, 3),
    (2, [1, 2], (2, 25), 0, 24 + 23),
    (16, [25] * 16, (16, 25), 0, 0),
    (9, [3] * 9, (16, 25), 7, 9 * 22 + 7 * 25),
])
def test_table_picks_the_smallest_fitting_bucket_and_counts_its_padding(rows, frames, expected, pad_rows, pad_frames):
    table = PaddingTable(EXACT + WINDOW, "exact")
    choice = table.lookup(rows, frames)
    assert choice.key == BucketKey("exact", *expected)
    assert (choice.padding_rows, choice.padded_frames) == (pad_rows, pad_frames)


def test_table_keeps_to_its_mode_and_gives_the_reason_beyond_its_buckets():
    exact, window = PaddingTable(EXACT + WINDOW, "exact"), PaddingTable(EXACT + WINDOW, "window")
    assert (exact.max_rows, exact.max_frames, window.max_rows, window.max_frames) == (16, 25, 8, 50)
    assert window.lookup(3, [50, 12, 40]).key == BucketKey("window", 4, 50)
    assert window.lookup(3, [50, 12, 40]).padded_frames == 0 + 38 + 10 + 50
    assert exact.lookup(17, [1] * 17).reason == "batch_too_large"
    assert exact.lookup(1, [26]).reason == "frames_too_long"
    assert exact.lookup(0, []).reason == "empty"
    assert PaddingTable(WINDOW, "exact").lookup(1, [1]).reason == "no_buckets"


def test_table_without_a_failed_bucket_falls_to_the_next_larger_one():
    usable = tuple(k for k in EXACT if k != BucketKey("exact", 4, 25))  # its capture failed
    choice = PaddingTable(usable, "exact").lookup(3, [25, 1, 7])
    assert choice.key == BucketKey("exact", 8, 25) and choice.padding_rows == 5
