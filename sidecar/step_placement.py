"""Policy: where a step runs. The mechanism is ``stepper.Stepper``; these are pure functions of what it knows when a
batch is formed, tested on the CPU (``tests/test_step_placement.py``).

- **Pipelined**: launched from the worker thread, possibly beside another step in flight; the waiter thread waits
  for the device and the worker takes the rows out. For batches of inline chunks while other streams could send.
- **On the loop thread**, alone, a graph replay: the loop thread queues the step and does not wait for the device
  there. Either every chunk's audio goes into a client's CUDA IPC region (the replies name events and leave at once;
  codes of such a batch that come from a client region too are read to the host first, one small synchronous
  copy), or every chunk travels inline both ways on a GPU: the audio and commit flags are copied into pinned memory
  behind the step and the loop polls (or, without busy polling, the worker waits for) the step's completion event,
  as it does after a CUDA IPC step. No thread hand-off before the launch, one at most after it. The host work that
  stays on the loop: the batch's staging (stacking its inputs), the pinned copies' allocation, a copy per row.
- **In the worker thread**, alone: anything else (CUDA IPC codes with inline audio, which the step reads to the host
  and waits for; eager steps, which on the CPU run the model on the thread that launches them and on a GPU may first
  measure and compile kernels for a new shape, for seconds; a capture first; a region being opened or closed).

A capture holds the thread for up to seconds and must not overlap a replay, and a region op in the worker must not
overlap a step on the loop thread: both keep a step off the loop thread and out of the pipeline.
"""

from __future__ import annotations

__all__ = ["all_inline", "pipelined", "on_loop"]


def all_inline(batch: list) -> bool:
    """Every chunk of ``batch`` travels as inline bytes both ways (no client region to read or write)."""
    return all(job.audio_out is None and job.ipc_codes is None for job in batch)


def pipelined(batch: list, capture_first: bool, max_steps_in_flight: int, in_flight: int, open_streams: int) -> bool:
    """A step may run beside another one in flight: its chunks are inline both ways, it captures nothing first, and
    some other open stream could send a chunk meanwhile (else nothing could overlap it, and a step alone replies
    without the waiter thread's hand-off: one stream's latency)."""
    return (max_steps_in_flight > 1 and not capture_first and (in_flight > 0 or open_streams > len(batch))
            and all_inline(batch))


def on_loop(batch: list, capture_first: bool, replays_graph: bool, region_ops_running: bool,
            launches_async: bool) -> bool:
    """A step alone runs on the loop thread when it replays a captured graph and the thread need not wait for the
    device there: every chunk's audio goes to a client region, or every chunk is inline both ways and the device
    runs a queued step by itself (``launches_async``: a GPU). An eager step stays off the loop: its host work is
    open-ended (a shape met for the first time, with graphs off, has its kernel forms measured and compiled: seconds
    in which the loop would answer no ping). Never while a region is opened or closed in the worker, nor when the
    plan captures a graph first."""
    if region_ops_running or capture_first or not replays_graph:
        return False
    return all(job.audio_out is not None for job in batch) or (launches_async and all_inline(batch))
