"""Per-call timestamps for the probes: both processes stamp ``time.perf_counter()`` (one host clock)."""
import time


def wrap(obj, name, key_in=None, key_out=None, *, marks: dict):
    """Replace ``obj.name`` with a version that stamps ``marks[key_in]`` before its first call of a chunk and
    ``marks[key_out]`` after every call (the caller clears ``marks`` per chunk)."""
    orig = getattr(obj, name)

    def stamped(*args, **kwargs):
        if key_in:
            marks.setdefault(key_in, time.perf_counter())
        result = orig(*args, **kwargs)
        if key_out:
            marks[key_out] = time.perf_counter()
        return result

    setattr(obj, name, stamped)
