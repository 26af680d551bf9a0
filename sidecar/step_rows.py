"""A step's rows split by their outcomes (the engine commits only rows that were ready, whose inputs pass the device
check and whose audio and new state are finite: ``forward.ROW_*``)."""

from __future__ import annotations

from code2wav.proto import ErrorCode

from .forward import ROW_BAD_INPUTS, ROW_COMMITTED, ROW_NOT_READY

NOT_FINITE_MESSAGE = ("the decoder's audio or new state for seq {seq} is not finite (overflow): the chunk was not "
                      "committed and the stream continues from its last good state; send seq {seq} again with "
                      "other inputs")
NOT_READY_MESSAGE = ("seq {seq}'s codes were not ready: doorbell word {word} of region {region} had not reached "
                     "codes_token {token} {wait_s:g}s after the step queued its wait (armed_wait_s), so the sidecar "
                     "released the step; the chunk was not committed and the stream continues from its last good "
                     "state; send seq {seq} again once its codes are written")
BAD_INPUTS_MESSAGE = ("seq {seq} holds {what}: the chunk was not committed and the stream continues from its last "
                      "good state; send seq {seq} again with valid inputs")


def split_outcomes(batch: list, audios: list, outcomes: list[int], not_finite, bad_inputs: str,
                   armed_wait_s: float = 0.0, not_ready=None) -> tuple[list, list, list]:
    """Split a step's jobs by their rows' outcomes: ``(done, their audio, refused)``. A row that was not committed
    leaves its stream at its last good state and its chunk is refused: ``invalid_argument`` for inputs the device
    check refused (``bad_inputs``: what they held, ``InputSpec.device_problem``), ``deadline_exceeded`` for an armed
    row whose doorbell was not rung when the sidecar released its wait after ``armed_wait_s`` (counted on
    ``not_ready``, the ``ipc_armed_released`` counter; its region is disarmed, ``Doorbells.released``: the region's
    later chunks go by their codes events), ``internal`` for audio or new state that was not finite (counted on
    ``not_finite``, the ``chunks_not_finite`` counter)."""
    if not any(outcomes):  # every row ROW_COMMITTED (0)
        return batch, audios, []
    refused = []
    for job, outcome in zip(batch, outcomes):
        if outcome == ROW_BAD_INPUTS:
            refused.append((job, ErrorCode.INVALID_ARGUMENT, BAD_INPUTS_MESSAGE.format(seq=job.seq, what=bad_inputs)))
        elif outcome == ROW_NOT_READY:
            ipc = job.ipc_codes
            ipc.armed.doorbells.released = True
            if not_ready is not None:
                not_ready.inc()
            refused.append((job, ErrorCode.DEADLINE_EXCEEDED, NOT_READY_MESSAGE.format(
                seq=job.seq, word=ipc.event_index, region=ipc.region.region_id, token=ipc.armed.token,
                wait_s=armed_wait_s)))
        elif outcome != ROW_COMMITTED:
            refused.append((job, ErrorCode.INTERNAL, NOT_FINITE_MESSAGE.format(seq=job.seq)))
            not_finite.inc()
    kept = [i for i, outcome in enumerate(outcomes) if outcome == ROW_COMMITTED]
    return [batch[i] for i in kept], [audios[i] for i in kept], refused
