"""``bench --stages``: the stage stamps of one chunk at concurrency 1, from a real spawned sidecar with ``trace_chunks``
on (``sidecar/chunk_trace.py``, served at ``/debug/chunk-stages``) and a real client with a ``CallTrace``
(``client/call_trace.py``), joined by ``(stream_id, seq)`` (``loadgen/stage_table.py``).

What must hold (no timings are asserted, only their order and arithmetic): the endpoint is 404 with the key off; the
sidecar's ring keeps the last ``trace_chunks`` chunks; every chunk the client and the sidecar both recorded joins;
every stage is >= 0 (each stamp of the two processes lies where the chunk's way puts it: one clock for both); per
chunk the stages add up to the caller's round trip, and the table's means and shares to its mean and 100 %; the key
is validated."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from code2wav.client import SidecarClient
from code2wav.loadgen.stage_table import STAGES, STAMPS, join, stage_us, summarize
from code2wav.loadgen.stages import run_stream
from code2wav.sidecar.chunk_trace import CHUNK_STAGES_PATH, STAGE_STAMPS
from code2wav.sidecar.config import ConfigError, load_config
from conftest import ROOT, TINY, start_sidecar

# the checkout first, then what PYTHONPATH already names (the GPU machine installs the package there: .ci/gpu-run)
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p),
       "PYTHONUNBUFFERED": "1"}
CAPACITY = 8
WARMUP = 2
NUM_CHUNKS = 10
CHUNK_FRAMES = 3


def _traced_sidecar(tmp_path, capacity: int, extra_yaml: str = ""):
    config = tmp_path / "sidecar.yaml"
    config.write_text(f"trace_chunks: {capacity}\n{extra_yaml}")
    return start_sidecar(tmp_path, "--config", str(config))


def test_the_endpoint_is_404_with_the_key_off(sidecar):
    assert sidecar.http_status(CHUNK_STAGES_PATH) == 404
    assert sidecar.http_status("/metrics") == 200


@pytest.mark.parametrize("path", ["alone", "pipelined"])
def test_one_stream_joins_every_recorded_chunk_and_its_stages_add_up(tmp_path, path):
    """``alone``: each step waits for the device (the CPU's default, and every step at one stream); ``pipelined``:
    two steps may be in flight and another stream is open (idle), so the stepper launches on the worker and takes
    the results there afterwards (``Stepper._pipelined_step``: the CUDA path of inline chunks under load)."""
    pipelined = "scheduler: {max_steps_in_flight: 2}\n" if path == "pipelined" else ""
    spawned = _traced_sidecar(tmp_path, CAPACITY, pipelined)
    try:
        with SidecarClient(spawned.address) as other:
            idle = other.open_stream("idle") if path == "pipelined" else None
            calls, client_chunks, ipc = run_stream(spawned.address, "host", None, NUM_CHUNKS, WARMUP, CHUNK_FRAMES)
            document = json.loads(spawned.get(CHUNK_STAGES_PATH))
            del idle
    finally:
        spawned.stop()
    assert ipc.get("ipc_chunks", 0) == 0  # host inputs: inline bytes
    # the ring: every chunk recorded, the last CAPACITY kept, each with every stamp, in order
    assert document["capacity"] == CAPACITY and document["recorded"] == WARMUP + NUM_CHUNKS
    assert document["stamps"] == list(STAGE_STAMPS)
    records = document["chunks"]
    assert [r["seq"] for r in records] == list(range(WARMUP + NUM_CHUNKS - CAPACITY, WARMUP + NUM_CHUNKS))
    for record in records:
        stamps = [record[name] for name in STAGE_STAMPS]
        assert all(stamps) and stamps == sorted(stamps), record
    # the client recorded every call; the timed chunks still in the sidecar's ring join, the older ones do not
    assert len(client_chunks) == WARMUP + NUM_CHUNKS
    joined, missing = join(calls, client_chunks, records)
    assert (len(joined), missing) == (CAPACITY, NUM_CHUNKS - CAPACITY)
    assert [c["seq"] for c in joined] == [r["seq"] for r in records]
    for chunk in joined:
        values = [chunk[name] for name in STAMPS]
        assert values == sorted(values), chunk  # every stage >= 0: the stamps of both processes interleave rightly
        stages = stage_us(chunk)
        assert all(stages[s.name] >= 0 for s in STAGES), stages
        assert sum(stages[s.name] for s in STAGES) == pytest.approx(stages["round_trip"], abs=1e-3)
        assert stages["round_trip"] == (chunk["returned_ns"] - chunk["called_ns"]) / 1e3  # host: ready at return
        assert stages["audio_ready"] == 0
    table = summarize(joined)
    assert table["chunks"] == CAPACITY and [row["stage"] for row in table["stages"]] == [s.name for s in STAGES]
    mean_sum = sum(row["mean_us"] for row in table["stages"])
    assert mean_sum == pytest.approx(table["round_trip"]["mean_us"], abs=0.05 * len(STAGES) + 0.05)
    assert sum(row["share_pct"] for row in table["stages"]) == pytest.approx(100.0, abs=0.05 * len(STAGES))
    for row in (*table["stages"], table["round_trip"]):
        assert 0 <= row["p50_us"] <= row["p90_us"], row


def run_stages_bench(tmp_path, num_chunks: int, *extra: str) -> tuple[str, dict]:
    """``code2wav-sidecar bench --stages`` on the CPU (the tiny model, 2-frame chunks, one warm-up chunk): its
    printed output and its JSON report."""
    out = tmp_path / "stages.json"
    proc = subprocess.run([sys.executable, "-m", "code2wav.sidecar", "bench", "--stages", "--model", str(TINY),
                           "--device", "cpu", "--chunk-frames", "2", "--stages-chunks", str(num_chunks),
                           "--stages-warmup", "1", *extra, "--json", str(out)],
                          capture_output=True, text=True, env=ENV, cwd=ROOT, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:] + proc.stdout[-3000:]
    return proc.stdout, json.loads(out.read_text())


def test_the_bench_prints_and_writes_the_table(tmp_path):
    """``code2wav-sidecar bench --stages`` on the CPU: host inputs only, every timed chunk joined, the JSON's stages
    in order and adding up."""
    stdout, report = run_stages_bench(tmp_path, 6, "--serve-arg=--max-streams", "--serve-arg=4")
    assert "one chunk at concurrency 1, inputs on the host" in stdout and "round_trip" in stdout
    (table,) = report["stages"]
    assert (table["inputs_on"], table["chunks"], table["unmatched"], table["chunk_frames"]) == ("host", 6, 0, 2)
    assert [row["stage"] for row in table["stages"]] == [s.name for s in STAGES]
    assert all(row["p50_us"] >= 0 for row in table["stages"])
    assert sum(row["mean_us"] for row in table["stages"]) == pytest.approx(table["round_trip"]["mean_us"], abs=1.0)


@pytest.mark.cuda
def test_the_bench_measures_host_and_device_inputs_on_cuda(tmp_path):
    """On a GPU: four tables (host, device armed, device by codes events, and with early audio), the device ones'
    chunks all by CUDA IPC, every stage >= 0 at the median; with early audio every chunk but the final one answered
    at launch; the hand-off on the GPU's clock, armed (every chunk) and by codes events."""
    out = tmp_path / "stages.json"
    proc = subprocess.run([sys.executable, "-m", "code2wav.sidecar", "bench", "--stages", "--model", "default",
                           "--device", "cuda", "--stages-chunks", "20", "--stages-warmup", "3", "--json", str(out)],
                          capture_output=True, text=True, env=ENV, cwd=ROOT, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:] + proc.stdout[-3000:]
    results = json.loads(out.read_text())
    host, device, events, early = results["stages"]
    assert [t["inputs_on"] for t in (host, device, events, early)] == ["host", "device", "device-events",
                                                                       "device-early"]
    for table in (host, device, events, early):
        assert (table["chunks"], table["unmatched"]) == (20, 0)
        assert all(row["p50_us"] >= 0 for row in table["stages"])
    assert device["ipc_chunks"] == events["ipc_chunks"] == early["ipc_chunks"] == 23  # warm-up included
    assert host["ipc_chunks"] == 0
    # every early chunk answered at launch but the final one; none of the others
    assert [t["answered_early"] for t in (host, device, events, early)] == [0, 0, 0, 22]
    armed, by_events = results["handoff"]
    assert (armed["armed"], armed["ipc_armed"], armed["ipc_chunks"]) == (True, 23, 23)
    assert (by_events["armed"], by_events["ipc_armed"], by_events["ipc_chunks"]) == (False, 0, 23)
    assert armed["p50_us"] > 0 and by_events["p50_us"] > 0


def test_the_key_is_validated():
    assert load_config().trace_chunks == 0
    assert load_config(overrides={"trace_chunks": 100}).trace_chunks == 100
    with pytest.raises(ConfigError, match="trace_chunks: Input should be greater than or equal to 0"):
        load_config(overrides={"trace_chunks": -1})
    with pytest.raises(ConfigError, match="trace_chunks: Input should be less than or equal to 100000"):
        load_config(overrides={"trace_chunks": 100_001})
    with pytest.raises(ConfigError, match="unknown key 'trace_chunk' \\(did you mean 'trace_chunks'\\?\\)"):
        load_config(overrides={"trace_chunk": 5})


def test_the_bench_refuses_an_address(tmp_path):
    """``--stages`` needs a sidecar with ``trace_chunks`` on, so it spawns its own: ``--address`` is a usage error,
    before anything is spawned."""
    proc = subprocess.run([sys.executable, "-m", "code2wav.sidecar", "bench", "--stages", "--model", str(TINY),
                           "--device", "cpu", "--address", f"ipc://{tmp_path}/none.sock"],
                          capture_output=True, text=True, env=ENV, cwd=ROOT, timeout=120)
    assert proc.returncode == 2
    assert "--stages spawns its own sidecar (with trace_chunks on); it does not take --address" in proc.stderr
    assert "ready:" not in proc.stdout
