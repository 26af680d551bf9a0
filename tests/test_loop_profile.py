"""The loop thread's profile (``profile_loop``, ``sidecar/loop_profile.py``) and ``bench --stages --stages-loop-profile``
(``loadgen/loop_table.py``), against real spawned sidecars: off, both endpoints are 404; on, a stop without a start
is 409, and a window opened before the first timed chunk and closed after the last one counts each of those chunks
exactly once in the functions every chunk passes (the warm-up chunks and the stream's open left out)."""

from __future__ import annotations

import json

import pytest

from code2wav.loadgen.loop_table import LoopProfileWindow, per_chunk
from code2wav.loadgen.stages import run_stream
from code2wav.sidecar.loop_profile import LOOP_PROFILE_PATH, LOOP_PROFILE_START_PATH, function_name
from conftest import start_sidecar
from test_chunk_stages import run_stages_bench

NUM_CHUNKS = 7
WARMUP = 3


def test_function_names_start_at_their_package() -> None:
    assert function_name("/x/site/code2wav/sidecar/stepper.py", 200, "step") == "sidecar/stepper.py:200(step)"
    assert function_name("/w/main/sidecar/stepper.py", 9, "run") == "sidecar/stepper.py:9(run)"
    assert (function_name("/v/lib/python3.12/site-packages/zmq/sugar/socket.py", 638, "send")
            == "zmq/sugar/socket.py:638(send)")
    assert function_name("~", 0, "<built-in method time.monotonic>") == "~:0(<built-in method time.monotonic>)"
    # a checkout in a folder named code2wav with its virtualenv inside: the last anchor counts
    assert (function_name("/c/code2wav/.venv/lib/python3.11/site-packages/zmq/sugar/socket.py", 638, "send")
            == "zmq/sugar/socket.py:638(send)")


def _busy(n: int) -> int:
    return sum(i * i for i in range(n))


def test_the_profile_answers_its_window_and_ends_by_itself(monkeypatch) -> None:
    """In-process, on an event loop as the metrics endpoint runs it: a stop without a start is 409; a start drops a
    running profile; the rows count the window's calls; a profile left running ends after MAX_PROFILE_S."""
    import asyncio

    from code2wav.sidecar import loop_profile

    async def run() -> None:
        profile = loop_profile.LoopProfile()
        assert profile.stop()[0] == 409
        assert profile.start()[0] == 200
        _busy(10)
        assert profile.start()[0] == 200  # the first window is dropped: its call is not counted below
        for _ in range(3):
            _busy(1000)
        status, body = profile.stop()
        document = json.loads(body)
        assert status == 200 and document["seconds"] > 0
        (busy,) = [row for row in document["functions"] if row["function"].endswith("(_busy)")]
        assert busy["calls"] == 3 and 0 < busy["self_s"] <= busy["cumulative_s"] + 1e-9
        assert document["self_s_total"] >= sum(row["self_s"] for row in document["functions"]) - 1e-9
        assert profile.stop()[0] == 409
        monkeypatch.setattr(loop_profile, "MAX_PROFILE_S", 0.05)
        assert profile.start()[0] == 200
        await asyncio.sleep(0.2)
        assert profile.stop()[0] == 409  # ended by itself

    asyncio.run(run())


def test_the_endpoints_are_404_with_the_key_off(sidecar) -> None:
    assert sidecar.http_status(LOOP_PROFILE_START_PATH) == 404
    assert sidecar.http_status(LOOP_PROFILE_PATH) == 404


def test_a_window_counts_each_timed_chunk_once(tmp_path) -> None:
    config = tmp_path / "sidecar.yaml"
    config.write_text("profile_loop: true\n")
    spawned = start_sidecar(tmp_path, "--config", str(config))
    try:
        assert spawned.http_status(LOOP_PROFILE_PATH) == 409  # nothing started
        window = LoopProfileWindow(spawned)
        run_stream(spawned.address, "host", None, NUM_CHUNKS, WARMUP, 2, window=window)
        assert spawned.http_status(LOOP_PROFILE_PATH) == 409  # the window's stop ended it
    finally:
        spawned.stop()
    document = window.document
    assert document is not None and document["seconds"] > 0
    calls = {row["function"].split(":")[0] + "(" + row["function"].split("(", 1)[1]: row["calls"]
             for row in document["functions"]}
    # each timed chunk came in, was accepted and completed once; nothing of the warm-up or the open is in the window
    assert calls["sidecar/chunk_flow.py(decode)"] == NUM_CHUNKS
    assert calls["sidecar/chunk_flow.py(complete)"] == NUM_CHUNKS
    assert "sidecar/sessions.py(_open)" not in calls
    rows = document["functions"]
    assert [row["self_s"] for row in rows] == sorted((row["self_s"] for row in rows), reverse=True)
    assert all(0 <= row["self_s"] <= row["cumulative_s"] + 1e-9 for row in rows if row["calls"] == 1)
    table = per_chunk(document, NUM_CHUNKS, 3)
    assert len(table["functions"]) == 3 and table["chunks"] == NUM_CHUNKS
    assert table["functions"][0]["self_us"] == pytest.approx(rows[0]["self_s"] * 1e6 / NUM_CHUNKS)
    assert table["self_us_total"] == pytest.approx(document["self_s_total"] * 1e6 / NUM_CHUNKS)
    assert document["self_s_total"] >= sum(row["self_s"] for row in rows) - 1e-9


def test_the_bench_prints_and_writes_the_loop_profile(tmp_path) -> None:
    stdout, report = run_stages_bench(tmp_path, 5, "--stages-loop-profile", "4")
    assert "the sidecar's loop thread per chunk, inputs on the host" in stdout
    assert report["settings"]["stages_loop_profile"] == 4
    (table,) = report["stages"]
    profile = table["loop_profile"]
    assert profile["chunks"] == 5 and len(profile["functions"]) == 4
    self_us = [row["self_us"] for row in profile["functions"]]
    assert self_us == sorted(self_us, reverse=True) and profile["self_us_total"] >= sum(self_us)
