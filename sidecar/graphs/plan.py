"""Graph plan (policy): which ``(batch, frames)`` buckets exist, and which bucket a runtime batch uses.

Pure functions, computed once, tested on CPU. The mechanism (``manager.py``) trusts the key it is handed.

- exact mode: buckets over ``(batch, new_frames)``; window mode: buckets over ``(batch, window_frames)`` (left
  context + new frames). Which sizes exist is each decoder family's ``graph_buckets`` (the chunk shapes its
  clients send, e.g. a 1-frame first chunk then 25-frame chunks under vLLM-Omni), unless the config
  names them; the bucket set is every batch size times every frame count.
A batch maps to the smallest bucket with ``batch >= rows`` and ``frames >= longest chunk``; the difference
is padding (rows that use the scratch slot, frames past each row's length). No bucket: a reason, eager.
"""

from __future__ import annotations

from dataclasses import dataclass

@dataclass(frozen=True, order=True)
class BucketKey:
    mode: str
    batch: int
    frames: int

    @property
    def label(self) -> str:
        return f"b{self.batch}xt{self.frames}"

    @property
    def cost(self) -> int:
        return self.batch * self.frames


@dataclass(frozen=True)
class Dispatch:
    """The bucket a batch runs in, with its padding; or ``key is None`` and the reason it runs eager."""

    key: BucketKey | None
    padding_rows: int = 0
    padded_frames: int = 0
    reason: str = ""


def padding_of(key: BucketKey, row_frames: list[int] | tuple[int, ...]) -> tuple[int, int]:
    """``(padding rows, padded frames)`` of ``row_frames``'s rows in bucket ``key``: the rows past the batch's, and
    the frames of padding over all the bucket's rows."""
    padding_rows = key.batch - len(row_frames)
    return padding_rows, sum(key.frames - f for f in row_frames) + padding_rows * key.frames


def build_buckets(mode: str, batch_sizes: tuple[int, ...], frames: tuple[int, ...]) -> tuple[BucketKey, ...]:
    if any(b < 1 for b in batch_sizes) or any(f < 1 for f in frames):
        raise ValueError("bucket batch sizes and frame counts must be >= 1")
    return tuple(sorted({BucketKey(mode, b, f) for b in batch_sizes for f in frames}, key=lambda k: -k.cost))


def dispatch(buckets: tuple[BucketKey, ...], mode: str, num_rows: int, row_frames: list[int]) -> Dispatch:
    """Smallest bucket of ``mode`` that holds ``num_rows`` rows of up to ``max(row_frames)`` frames."""
    if num_rows < 1:
        return Dispatch(None, reason="empty")
    longest = max(row_frames)
    candidates = [k for k in buckets if k.mode == mode]
    if not candidates:
        return Dispatch(None, reason="no_buckets")
    fitting = [k for k in candidates if k.batch >= num_rows and k.frames >= longest]
    if not fitting:
        if all(k.batch < num_rows for k in candidates):
            return Dispatch(None, reason="batch_too_large")
        return Dispatch(None, reason="frames_too_long")
    best = min(fitting, key=lambda k: (k.cost, k.batch))
    return Dispatch(best, *padding_of(best, row_frames))


def extra_bucket(mode: str, num_rows: int, longest_frames: int, max_batch: int, max_frames: int) -> BucketKey | None:
    """A bucket to capture lazily for a batch no configured bucket holds: rows rounded up to a power of two,
    frames rounded up to a multiple of 8; None when it would exceed the configured maxima."""
    batch = 1 << max(0, (num_rows - 1).bit_length())
    frames = -(-longest_frames // 8) * 8
    if batch > max_batch or frames > max_frames:
        return None
    return BucketKey(mode, batch, frames)


class PaddingTable:
    """``dispatch`` answers for one mode and one set of buckets, computed once for every ``(rows, longest
    frames)`` up to the largest bucket; a batch beyond it gets ``dispatch``'s reason. Pure: no device."""

    def __init__(self, buckets: tuple[BucketKey, ...], mode: str) -> None:
        self.buckets = tuple(k for k in buckets if k.mode == mode)
        self.mode = mode
        self.max_rows = max((k.batch for k in self.buckets), default=0)
        self.max_frames = max((k.frames for k in self.buckets), default=0)
        self._table = [[dispatch(self.buckets, mode, rows, [frames]).key for frames in range(self.max_frames + 1)]
                       for rows in range(self.max_rows + 1)]  # [rows][longest frames] -> bucket or None

    def lookup(self, num_rows: int, row_frames: list[int]) -> Dispatch:
        longest = max(row_frames, default=0)
        if not (1 <= num_rows <= self.max_rows and 1 <= longest <= self.max_frames):
            return dispatch(self.buckets, self.mode, num_rows, row_frames)  # the reason (or an empty batch)
        key = self._table[num_rows][longest]
        if key is None:
            return dispatch(self.buckets, self.mode, num_rows, row_frames)
        return Dispatch(key, *padding_of(key, row_frames))


MAX_SLICED_PROFILES = 3
"""Slice counts measured per bucket while sizing it for the graph memory budget (each a warm-up and a capture;
a compiled step compiles each): the proportional estimate (``slices_for_budget``), then ``refine_slices``."""


def time_slices(frames: int, num_slices: int) -> tuple[tuple[int, int], ...]:
    """``(start, length)`` of ``num_slices`` contiguous slices covering ``frames`` (lengths differ by at most one,
    longer first). A bucket captured in slices runs its step as that many exact-streaming sub-steps, one after
    the other, each row's state carried from one to the next: same audio (exact streaming), a smaller peak."""
    if not 1 <= num_slices <= frames:
        raise ValueError(f"num_slices must be in [1, {frames}], got {num_slices}")
    base, extra = divmod(frames, num_slices)
    out, start = [], 0
    for i in range(num_slices):
        length = base + (1 if i < extra else 0)
        out.append((start, length))
        start += length
    return tuple(out)


def slices_for_budget(profile_bytes: int, budget_bytes: int, frames: int) -> int | None:
    """The fewest time slices whose graph memory should fit ``budget_bytes``, from the unsliced ``profile_bytes``
    (an estimate: memory scales with the longest slice's frames); None if even one frame per slice would not.
    The caller measures the sliced graph again before trusting it."""
    for num_slices in range(1, frames + 1):
        longest = -(-frames // num_slices)
        if profile_bytes * longest <= budget_bytes * frames:
            return num_slices
    return None


def refine_slices(frames: int, measured: list[tuple[int, int]], budget_bytes: int) -> int | None:
    """The next slice count to try after the step measured over ``budget_bytes``. ``measured``: ``(longest
    slice's frames, bytes)`` of each profile so far, the whole step first, the last one over the budget. Fit
    ``bytes = fixed + per_frame * longest`` through the last two (the nearest: memory is not linear over the
    whole range; a part of it does not shrink with the slice) and take the fewest slices, more than the last
    count, whose longest slice fits. None when none can: the line says even one frame per slice is over, or
    the last slicing did not shrink the step. The caller measures again."""
    (frames_a, bytes_a), (frames_b, bytes_b) = measured[-2], measured[-1]
    if frames_b <= 1 or frames_b >= frames_a or bytes_b >= bytes_a:
        return None
    per_frame = (bytes_a - bytes_b) / (frames_a - frames_b)  # bytes per frame of the longest slice
    fixed = bytes_b - per_frame * frames_b  # weights' workspace, the outputs, allocator rounding
    fitting_frames = int((budget_bytes - fixed) // per_frame)  # the longest slice that should fit (< frames_b)
    if fitting_frames < 1:
        return None
    return -(-frames // fitting_frames)  # more slices than last time, since the longest is shorter
