"""A step's rows split by their commit flags (the engine commits only rows whose audio and new state are finite)."""

from __future__ import annotations

from code2wav.proto import ErrorCode

NOT_FINITE_MESSAGE = ("the decoder's audio or new state for seq {seq} is not finite (overflow): the chunk was not "
                      "committed and the stream continues from its last good state; send seq {seq} again with "
                      "other inputs")


def split_committed(batch: list, audios: list, committed: list[bool], not_finite) -> tuple[list, list, list]:
    """Split a step's jobs by their rows' commit flags: ``(done, their audio, refused)``; a row whose audio or
    new state was not finite was not committed (its stream keeps its last good state) and its chunk is refused
    (counted on ``not_finite``, the ``chunks_not_finite`` counter)."""
    if all(committed):
        return batch, audios, []
    refused = [(job, ErrorCode.INTERNAL, NOT_FINITE_MESSAGE.format(seq=job.seq))
               for job, ok in zip(batch, committed) if not ok]
    not_finite.inc(committed.count(False))
    return ([job for job, ok in zip(batch, committed) if ok], [a for a, ok in zip(audios, committed) if ok],
            refused)
