"""A pool's ``submit_batch``: the items split by the sidecar their streams live on, one ``decode`` message per
sidecar, and one future that gives the results in the items' order.

``client`` imports ``proto``, zmq, torch and numpy; it never imports ``sidecar``.
"""

from __future__ import annotations

import threading
from concurrent.futures import Future
from typing import Any, Callable, Sequence

from .client import BatchItem
from .errors import InvalidArgument, SidecarError
from .pool_member import PoolMember
from .sender import set_exception, set_result
from .stream import Stream

__all__ = ["submit_pooled_batch"]


def _submit_part(member: PoolMember, items: list[BatchItem], timeout_s: float | None) -> Future[list[Any]]:
    """One sidecar's share; refused before sending (a lost stream, a bad chunk) reads as its items' error, so the
    other sidecars' shares still go (the single client raises at once: it has nothing else in flight)."""
    try:
        return member.client.submit_batch(items, return_exceptions=True, timeout_s=timeout_s)
    except SidecarError as exc:
        failed: Future[list[Any]] = Future()
        failed.set_exception(exc)
        return failed


def submit_pooled_batch(items: Sequence[BatchItem], home_of: Callable[[Stream], PoolMember | None],
                        return_exceptions: bool, timeout_s: float | None) -> Future[list[Any]]:
    """``home_of(stream)``: the member the stream was opened on. Errors as the single client gives them: the
    first (in the items' order) once every result is in, or each in its place with ``return_exceptions``."""
    groups: dict[int, tuple[PoolMember, list[int]]] = {}
    for index, item in enumerate(items):
        member = home_of(item[0])
        if member is None or member.client is None:
            raise InvalidArgument(f"stream {item[0].stream_id!r} was not opened by this pool")
        groups.setdefault(id(member), (member, []))[1].append(index)
    if len(groups) == 1:  # one sidecar: its own batch, as the single client sends it
        ((member, _),) = groups.values()
        return member.client.submit_batch(items, return_exceptions=return_exceptions, timeout_s=timeout_s)
    parts = [(indices, _submit_part(member, [items[i] for i in indices], timeout_s))
             for member, indices in groups.values()]
    future: Future[list[Any]] = Future()
    remaining = [len(parts)]
    lock = threading.Lock()

    def one_done(_: Future) -> None:
        with lock:
            remaining[0] -= 1
            if remaining[0]:
                return
        out: list[Any] = [None] * len(items)
        for indices, part in parts:
            error = part.exception()
            values = [error] * len(indices) if error is not None else part.result()
            for index, value in zip(indices, values):
                out[index] = value
        first = next((value for value in out if isinstance(value, SidecarError)), None)
        if first is not None and not return_exceptions:
            set_exception(future, first)
        else:
            set_result(future, out)

    for _, part in parts:
        part.add_done_callback(one_done)
    return future
