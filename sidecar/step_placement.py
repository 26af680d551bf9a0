"""Policy: where a step runs. The mechanism is ``stepper.Stepper``; these are pure functions of what it knows when a
batch is formed, tested on the CPU (``tests/test_step_placement.py``).

- **Pipelined**: launched from the worker thread, possibly beside another step in flight; the waiter thread waits
  for the device and the worker takes the rows out. For batches of inline chunks while other streams could send.
- **On the loop thread**, alone, a graph replay on a GPU: the loop thread queues the step (CUDA IPC codes copied into
  its inputs on the device, checked there), the copies of its host rows' audio and its outcomes into pinned memory
  behind it, and polls (or, without busy polling, the worker waits for) the step's completion event; then it takes
  the rows out and queues the CUDA IPC audio rows' copies into their regions. No thread hand-off before the launch,
  one at most after it, and the loop keeps receiving while the device runs. The host work that stays on the loop:
  the batch's staging (stacking its host inputs), the pinned copies' allocation, a copy per row.
- **In the worker thread**, alone: anything else (CUDA IPC codes a window stream keeps as context, which the step
  reads to the host and waits for; eager steps, which on the CPU run the model on the thread that launches them and
  on a GPU may first measure and compile kernels for a new shape, for seconds; a capture first; a region being
  opened or closed).

A capture holds the thread for up to seconds and must not overlap a replay, and a region op in the worker must not
overlap a step on the loop thread: both keep a step off the loop thread and out of the pipeline.
"""

from __future__ import annotations

__all__ = ["all_inline", "reads_inputs_on_host", "pipelined", "on_loop"]


def all_inline(batch: list) -> bool:
    """Every chunk of ``batch`` travels as inline bytes both ways (no client region to read or write)."""
    return all(job.audio_out is None and job.ipc_codes is None for job in batch)


def pipelined(batch: list, capture_first: bool, max_steps_in_flight: int, in_flight: int, open_streams: int) -> bool:
    """A step may run beside another one in flight: its chunks are inline both ways, it captures nothing first, and
    some other open stream could send a chunk meanwhile (else nothing could overlap it, and a step alone replies
    without the waiter thread's hand-off: one stream's latency)."""
    return (max_steps_in_flight > 1 and not capture_first and (in_flight > 0 or open_streams > len(batch))
            and all_inline(batch))


def reads_inputs_on_host(batch: list) -> bool:
    """Some chunk's inputs come from a client region into a stream that keeps its inputs (a window stream's context):
    the step reads them to the host first (``StreamMode.keeps_inputs``), waiting for the device."""
    return any(job.ipc_codes is not None and job.stream.mode.keeps_inputs for job in batch)


def on_loop(batch: list, capture_first: bool, replays_graph: bool, region_ops_running: bool,
            launches_async: bool) -> bool:
    """A step alone runs on the loop thread when it replays a captured graph on a device that runs a queued step by
    itself (``launches_async``: a GPU) and reads no inputs to the host first. An eager step stays off the loop: its
    host work is open-ended (a shape met for the first time, with graphs off, has its kernel forms measured and
    compiled: seconds in which the loop would answer no ping). Never while a region is opened or closed in the
    worker, nor when the plan captures a graph first."""
    if region_ops_running or capture_first or not replays_graph or not launches_async:
        return False
    return not reads_inputs_on_host(batch)
