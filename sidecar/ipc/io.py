"""Engine-thread device work for chunks that use CUDA IPC regions: read codes in, write audio out.

Codes: a chunk whose client event is not complete yet is not decoded in this step: it goes back to the
queue (and fails with deadline_exceeded after ``codes_event_timeout_s``), so one client's slow producer
never stalls a batch and the engine never waits on a client's unfinished work. A complete event means the
client's work up to it is done (its copy, and its earlier use of any audio slot now written again), so the
engine stream needs no wait on it. A stream that keeps no inputs (exact mode) has its chunk's codes copied on the
device, from the region into the step's inputs, and checked there (``InputSpec.check_rows``: a code outside the
codebook would fault the device for every client, so it is clamped and its row refused, its state kept): no read
to the host and no wait. A window stream keeps its inputs as context on the host: the codes of such IPC chunks are
gathered and copied to the host in one read (the server forms a batch only once the device finished the previous
one, so this waits for nothing else) and checked there like inline codes. Either way the step has read the codes'
bytes before its reply leaves (its outcomes are read back first), so the client may reuse them then.

Armed chunks (``ipc.doorbells``) are never deferred and their events are not queried: the step waits on the GPU for
their doorbell words, and their codes stay on the device like an exact stream's.

Audio: each row is copied from the decoder's output straight into the client's region and the region's next
event is recorded on the engine stream. The reply leaves without waiting for it: it names the event, and
the client orders its own stream after it (``cudaStreamWaitEvent``), so the reply overlaps the decode and
the client still never reads audio that is being written. (Events are recorded round-robin; a client that
waits on an event re-recorded since waits for later work of the same stream, which is still correct.)
"""

from __future__ import annotations

import dataclasses

import torch

from code2wav.proto import ErrorCode

from ..models.family import InputSpec

__all__ = ["count_ipc", "disarm_released", "drop_complete", "incomplete_codes_events", "keep_host_copies", "load_codes",
           "store_audio", "store_rows", "warm_early_kernels", "write_regions"]


def _codes_event(job):
    """The client event recorded after ``job``'s codes were copied (its index was checked on arrival)."""
    return job.ipc_codes.region.opened.events[job.ipc_codes.event_index]


def drop_complete(events: list) -> list:
    """Query each of ``events`` once and keep, in place, those not complete yet; returns the list."""
    events[:] = [event for event in events if not event.query()]
    return events


def disarm_released(jobs: list) -> int:
    """Armed chunks of a region disarmed since they arrived (``Doorbells.released``: one of its chunks was refused
    not ready) go by their codes event instead, like the region's later chunks: a dead client's chunks still queued
    never park another step. Returns how many were disarmed."""
    count = 0
    for job in jobs:
        ipc = job.ipc_codes
        if ipc is not None and ipc.armed is not None and ipc.armed.doorbells.released:
            job.ipc_codes = dataclasses.replace(ipc, armed=None)
            count += 1
    return count


def incomplete_codes_events(jobs: list) -> list:
    """The distinct codes events of ``jobs``' CUDA IPC chunks that are not complete yet (one query each; chunks
    of one message share theirs; armed chunks name none)."""
    events = {id(event): event for event in (_codes_event(job) for job in jobs
                                             if job.ipc_codes is not None and job.ipc_codes.armed is None)}
    return drop_complete(list(events.values()))


def load_codes(jobs: list, spec: InputSpec, now_s: float, codes_event_timeout_s: float,
               incomplete: list) -> tuple[list, list]:
    """Give each IPC job its inputs ``[C, n]``, but not those whose codes event is in ``incomplete``
    (``incomplete_codes_events`` of the batch: the caller queried them): the region's view on the device, unchecked
    (the step checks it), for a stream that keeps no inputs; else host inputs (int64 codes or float32 latents, as
    ``spec`` says) checked against ``spec``. Returns ``(refused, deferred)``: ``(job, code, message)`` for jobs
    refused, and jobs whose codes are not ready yet (to be queued again)."""
    ipc_jobs = [job for job in jobs if job.ipc_codes is not None]
    if not ipc_jobs:
        return [], []
    refused, ready, deferred = [], [], []
    waiting = {id(event) for event in incomplete}
    for job in ipc_jobs:
        if job.ipc_codes.armed is not None:  # the step waits for its doorbell on the device (an exact stream)
            job.codes = job.ipc_codes.view  # [C, n] in the client's region and wire dtype
        elif id(_codes_event(job)) not in waiting:  # complete: the client's copy is done, nothing to wait on
            if job.stream.mode.keeps_inputs:
                ready.append(job)
            else:  # copied and checked by the step on the device
                job.codes = job.ipc_codes.view  # [C, n] in the client's region and wire dtype
        elif now_s - job.arrived_s > codes_event_timeout_s:
            refused.append((job, ErrorCode.DEADLINE_EXCEEDED, f"codes_event {job.ipc_codes.event_index} of region "
                            f"{job.ipc_codes.region.region_id} did not complete within {codes_event_timeout_s:g}s"))
        else:
            deferred.append(job)
    if ready:
        views = [job.ipc_codes.view.reshape(-1) for job in ready]
        flat = views[0] if len(views) == 1 else torch.cat(views)  # [sum Q*n] on device (mixed dtypes promote)
        host = flat.to("cpu", spec.host_dtype())  # the step's one read of all IPC inputs (synchronizes)
        all_valid = spec.problem(host) is None  # the usual case: one check for the whole batch
        start = 0
        for job in ready:
            shape = job.ipc_codes.view.shape
            codes = host[start: start + shape.numel()].view(shape)  # [Q, n]
            start += shape.numel()
            problem = None if all_valid else spec.problem(codes)
            if problem is not None:
                refused.append((job, ErrorCode.INVALID_ARGUMENT, problem))
            else:
                job.codes = codes
    return refused, deferred


def write_regions(jobs: list, audios: list, refused: list | None = None) -> None:
    """Each IPC row of ``jobs`` copied into its client's region, and each region's next event recorded after its rows
    (``job.audio_event``: what the reply names). ``refused``: per job a 0-dim bool on the device, in stream order
    (early audio: the rows' outcomes are not read yet): a refused row's slot is filled with zeros behind its copy,
    so the audio an early reply named is never garbage or NaN."""
    written = {}
    for i, job in enumerate(jobs):
        if job.audio_out is None:
            continue
        job.audio_out.view.copy_(audios[i])  # into the client's memory
        if refused is not None:
            job.audio_out.view.masked_fill_(refused[i], 0.0)  # (a 0-dim mask: the whole slot, on the device)
        region = job.audio_out.region
        written.setdefault(id(region), (region, []))[1].append(job)
    for region, region_jobs in written.values():
        event_index = region.next_event
        region.next_event = (event_index + 1) % len(region.opened.events)
        region.opened.events[event_index].record()  # not waited for here: the reply names it
        for job in region_jobs:
            job.audio_event = event_index


def keep_host_copies(jobs: list, audios: list) -> list:
    """The audio each job keeps for resends (owned tensors): for an IPC row, a host copy queued into pinned memory,
    complete once the job's ``kept_event`` is; other rows' audio as it is."""
    kept = list(audios)
    device = None  # the IPC rows' device (a step's other rows may be host copies already)
    for i, job in enumerate(jobs):
        if job.audio_out is None:
            continue
        # Our own copy for an idempotent resend (the decoder output is reused next step), on the host: a resend is
        # answered on the loop thread, which must never wait on the engine stream (a later step may be parked there
        # on a doorbell wait that only the loop's watchdog releases). One per row, so an idle stream never pins the
        # rows of other streams.
        kept[i] = torch.empty(audios[i].shape, dtype=audios[i].dtype, pin_memory=True)  # [n * U] float32
        kept[i].copy_(audios[i], non_blocking=True)
        device = audios[i].device
    if device is None:
        return kept
    kept_event = torch.cuda.Event()
    # after the host copies, on the stream they were queued on (the audio's device's: on cuda:N it need not be the
    # current device's); a resend waits on it, never behind a later step
    kept_event.record(torch.cuda.current_stream(device))
    for job in jobs:
        if job.audio_out is not None:
            job.kept_event = kept_event
    return kept


def store_audio(jobs: list, audios: list) -> list:
    """Write IPC rows into their regions (``write_regions``); returns the audio each job keeps for resends
    (``keep_host_copies``)."""
    write_regions(jobs, audios)
    return keep_host_copies(jobs, audios)


def count_ipc(jobs: list, metrics) -> None:
    """A step's committed jobs counted by their CUDA IPC audio and inputs."""
    num_out = sum(job.audio_out is not None for job in jobs)
    if num_out:
        metrics.ipc_audio_out.inc(num_out)
    num_in = sum(job.ipc_codes is not None for job in jobs)
    if num_in:
        metrics.ipc_codes_in.inc(num_in)


def store_rows(done: list, audios: list, metrics) -> list:
    """A step's decoded jobs: their CUDA IPC audio rows queued into their regions (``store_audio``) and counted with
    their CUDA IPC inputs; returns the audio each job keeps."""
    if any(job.audio_out is not None for job in done):
        audios = store_audio(done, audios)
    count_ipc(done, metrics)
    return audios


def warm_early_kernels(device: torch.device) -> None:
    """Load, once at start, the kernels early audio launches between a step's launch and its wait (the comparison of
    the rows' outcomes, the masked fill of a slot): a kernel loaded for the first time while a step is parked on a
    doorbell wait returns only when that wait ends (docs/design-notes.md, "The device-armed hand-off"), and the
    loop thread would stall with it. Their vectorised forms depend on alignment and length: each is covered. (No
    kernels to load off a GPU.)"""
    if device.type != "cuda":
        return
    outcomes = torch.zeros(80, dtype=torch.uint8, device=device)  # [80]
    slots = torch.zeros(80, dtype=torch.float32, device=device)  # [80]
    for offset in range(16):
        refused = outcomes[offset: offset + 1 + offset] != 0  # [1 + offset] bool
        for start in range(8):
            slots[start: start + 1 + offset + start].masked_fill_(refused[0], 0.0)
    torch.cuda.synchronize(device)
