"""Where a step runs (``sidecar/step_placement.py``): the policy as a table, and the loop-thread path of inline chunks
(a GPU's step alone at one stream) exercised on the CPU against the golden decode.

On the CPU the forward runs on the thread that launches it, so the server keeps inline steps in the worker there
(``Stepper.launches_async`` is False), and a GPU only in graph replays. The mechanism test turns it on in a real
in-process server (sockets, sessions, scheduler, engine), its eager steps taken for replays: the loop thread then
launches the step, waits for it (already done on the CPU) and takes the rows out, as it does on a GPU (the event,
the pinned copies and the graph's staging only the CUDA tests reach); the audio must equal the one-shot golden
decode within the exact mode's 1e-5, and every step of the stream must have been launched and finished there."""

from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest
import torch

from code2wav.client import SidecarClient
from code2wav.sidecar.config import load_config
from code2wav.sidecar.modes import mode_for
from code2wav.sidecar.step_placement import all_inline, on_loop, pipelined, reads_inputs_on_host
from conftest import TINY
from test_family_toy import InProcessServer

EXACT_STREAM = SimpleNamespace(mode=mode_for(True))
WINDOW_STREAM = SimpleNamespace(mode=mode_for(False))  # keeps its inputs (on the host) as the next chunk's context
INLINE = SimpleNamespace(audio_out=None, ipc_codes=None, stream=EXACT_STREAM)
IPC_BOTH = SimpleNamespace(audio_out=object(), ipc_codes=object(), stream=EXACT_STREAM)
IPC_OUT = SimpleNamespace(audio_out=object(), ipc_codes=None, stream=EXACT_STREAM)  # audio into a client region
IPC_IN = SimpleNamespace(audio_out=None, ipc_codes=object(), stream=EXACT_STREAM)  # codes from a client region
IPC_IN_WINDOW = SimpleNamespace(audio_out=None, ipc_codes=object(), stream=WINDOW_STREAM)


@pytest.mark.parametrize("batch, capture_first, max_in_flight, in_flight, open_streams, expected", [
    ([INLINE], False, 2, 0, 2, True),  # another stream could send meanwhile
    ([INLINE], False, 2, 1, 1, True),  # a step is in flight already
    ([INLINE], False, 2, 0, 1, False),  # one stream: nothing could overlap it, it runs alone
    ([INLINE, INLINE], False, 2, 0, 2, False),  # the batch is every open stream
    ([INLINE], False, 1, 0, 5, False),  # one step at a time (the CPU's default)
    ([INLINE], True, 2, 0, 5, False),  # a capture first must not overlap a replay
    ([INLINE, IPC_IN], False, 2, 0, 5, False),  # a client region is read: alone
    ([IPC_OUT], False, 2, 1, 5, False),
])
def test_pipelined_takes_only_inline_steps_that_something_could_overlap(batch, capture_first, max_in_flight,
                                                                        in_flight, open_streams, expected):
    assert pipelined(batch, capture_first, max_in_flight, in_flight, open_streams) is expected


@pytest.mark.parametrize("batch, capture_first, replays_graph, region_ops, launches_async, expected", [
    ([INLINE], False, True, False, True, True),  # a GPU graph step of inline chunks: launched by the loop, end polled
    ([INLINE], False, False, False, True, False),  # eager on a GPU: a new shape's kernels measured, for seconds
    ([INLINE], False, True, False, False, False),  # the CPU: the forward would run on the loop thread
    ([IPC_OUT, IPC_BOTH], False, True, False, True, True),  # audio into regions, codes copied on the device
    ([IPC_IN], False, True, False, True, True),  # codes copied and checked on the device: nothing read to the host
    ([INLINE, IPC_OUT, IPC_IN], False, True, False, True, True),  # mixed: the same launch, the same wait
    ([IPC_OUT], False, False, False, True, False),  # eager, audio to regions: off the loop all the same
    ([IPC_IN_WINDOW], False, True, False, True, False),  # a window stream's codes read to the host first: the worker
    ([INLINE, IPC_IN_WINDOW], False, True, False, True, False),
    ([INLINE], True, True, False, True, False),  # a capture holds the thread for seconds
    ([IPC_OUT], False, True, True, True, False),  # a region is being opened or closed in the worker
])
def test_a_step_alone_runs_on_the_loop_only_where_the_loop_need_not_wait(batch, capture_first, replays_graph,
                                                                         region_ops, launches_async, expected):
    assert on_loop(batch, capture_first, replays_graph, region_ops, launches_async) is expected
    assert all_inline(batch) is all(job is INLINE for job in batch)
    assert reads_inputs_on_host(batch) is any(job is IPC_IN_WINDOW for job in batch)


class _LoopLaunches:
    """A server's preparation (``InProcessServer(prepare=...)``): the GPU's placement of inline steps alone, and a
    record of the steps queued through ``Engine.launch`` (the worker's ``engine_step`` uses ``execute_checked``) and
    of the threads that launched and finished them."""

    def __init__(self) -> None:
        self.inline_steps = 0
        self.threads: set[str] = set()

    def __call__(self, server) -> None:
        server.stepper.launches_async = True
        engine = server.engine
        launch, finish = engine.launch, engine.finish

        def launched_here(plan, items):
            self.inline_steps += 1
            self.threads.add(threading.current_thread().name)
            return launch(plan, items)

        def finished_here(step):
            self.threads.add(threading.current_thread().name)
            return finish(step)

        engine.launch, engine.finish = launched_here, finished_here


def test_inline_chunks_launched_by_the_loop_equal_the_golden_decode(tmp_path, golden_cases, monkeypatch):
    from code2wav.sidecar import stepper as stepper_module

    real_on_loop = stepper_module.on_loop
    # the CPU has no graphs: its eager steps stand in for a GPU's graph replays (the policy is tested above)
    monkeypatch.setattr(stepper_module, "on_loop", lambda batch, capture_first, _replays_graph, region_ops, on_gpu:
                        real_on_loop(batch, capture_first, True, region_ops, on_gpu))
    cfg = load_config(None, {"address": f"ipc://{tmp_path}/s.sock", "model": str(TINY), "device": "cpu",
                             "metrics_port": 0, "streams": {"max_streams": 4}})
    launches = _LoopLaunches()
    running = InProcessServer(cfg, prepare=launches)
    try:
        codes, full = golden_cases["codes"][0], golden_cases["full"][0, 0]  # [Q, T], [T * U]
        with SidecarClient(running.server.address) as client:
            stream = client.open_stream("s")
            cuts = [0, 1, 7, 19, 20, 33, codes.shape[1]]  # a 1-frame first chunk, then uneven ones
            parts = [stream.decode(codes[:, a:b], final=b == cuts[-1]) for a, b in zip(cuts, cuts[1:])]
        audio = torch.cat(parts)  # [T * U]
    finally:
        running.stop()
    assert launches.inline_steps == len(cuts) - 1  # every chunk's step took the loop-thread path
    assert launches.threads == {running.thread_name}  # queued and taken out there: no hand-off to the worker
    assert audio.shape == full.shape
    assert torch.allclose(audio, full, atol=1e-5, rtol=0), (audio - full).abs().max()
