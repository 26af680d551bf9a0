"""A pool's ``submit_batch``: the items split by the sidecar their streams live on, one ``decode`` message per
sidecar, and one future that gives the results in the items' order. Items of ``PooledStream``s
(``submit_pooled_streams``) go through each stream's bookkeeping (history, chunks kept for a move); a stream that is
moving takes its chunk into its queue instead.

``client`` imports ``proto``, zmq, torch and numpy; it never imports ``sidecar``.
"""

from __future__ import annotations

import contextlib
import threading
from concurrent.futures import Future
from typing import Any, Callable, Sequence

from .client import BatchItem
from .errors import InvalidArgument, SidecarError
from .pool_member import PoolMember
from .history import PendingChunk
from .pool_stream import PooledStream
from .sender import set_exception, set_result
from .stream import Stream

__all__ = ["submit_pooled_batch", "submit_pooled_streams"]


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
    return _combined(len(items), parts, return_exceptions)


def _combined(num_items: int, parts: list[tuple[list[int], Future]], return_exceptions: bool) -> Future[list[Any]]:
    """One future over ``parts`` (``(item indices, future of their results as a list)``), in the items' order."""
    future: Future[list[Any]] = Future()
    remaining = [len(parts)]
    lock = threading.Lock()

    def one_done(_: Future) -> None:
        with lock:
            remaining[0] -= 1
            if remaining[0]:
                return
        out: list[Any] = [None] * num_items
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


def _as_list(future: Future) -> Future[list[Any]]:
    """A chunk's future as a one-item list of its audio or its error."""
    listed: Future[list[Any]] = Future()
    future.add_done_callback(lambda done: set_result(listed, [done.exception() or done.result()]))
    return listed


def submit_pooled_streams(items: Sequence[BatchItem], return_exceptions: bool,
                          timeout_s: float | None) -> Future[list[Any]]:
    """``submit_batch`` over ``PooledStream``s: one ``decode`` message per sidecar the streams live on now, each
    chunk kept by its stream until acknowledged (a move sends it again)."""
    groups: dict[int, list[int]] = {}
    parts: list[tuple[list[int], Future]] = []
    for index, item in enumerate(items):
        stream = item[0]
        if not isinstance(stream, PooledStream):
            raise InvalidArgument(f"stream {stream.stream_id!r} was not opened by this pool (or mixes a pool's "
                                  "streams with and without failover)")
        groups.setdefault(id(stream.member), []).append(index)
    for indices in groups.values():
        streams = sorted({id(items[i][0]): items[i][0] for i in indices}.values(), key=id)
        with contextlib.ExitStack() as held:  # each stream's chunks reserved and sent in one order
            for stream in streams:
                held.enter_context(stream.lock)
            parts.extend(_send_group([items[i] for i in indices], indices, timeout_s))
    return _combined(len(items), parts, return_exceptions)


def _send_group(items: list[BatchItem], indices: list[int], timeout_s: float | None) -> list[tuple[list[int], Future]]:
    """(Every stream's lock held.) One sidecar's share: reserved in each stream, sent as one message."""
    parts: list[tuple[list[int], Future]] = []
    sent: list[tuple[int, PooledStream, PendingChunk, Any]] = []
    for index, item in zip(indices, items):
        stream, codes = item[0], item[1]
        options: dict[str, Any] = item[2] if len(item) == 3 else {}  # type: ignore[misc]
        final, context = bool(options.get("final", False)), int(options.get("context_frames", 0))
        try:
            chunk = stream.reserve(codes, final, context, timeout_s)
        except SidecarError as exc:
            failed: Future = Future()
            failed.set_exception(exc)
            parts.append(([index], _as_list(failed)))
            continue
        parts.append(([index], _as_list(chunk.future)))
        if stream.sendable:
            sent.append((index, stream, chunk, (stream.inner, codes, options)))
        else:
            stream.request_move("failover")  # (no-op while a move is under way: it sends the chunk after)
    if not sent:
        return parts
    client = sent[0][1].member.client
    try:
        replies = client.submit_batch([entry for *_, entry in sent], return_exceptions=True, timeout_s=timeout_s)
    except SidecarError as exc:  # refused before sending: each chunk's error (a gone sidecar moves its streams)
        for _, stream, chunk, entry in sent:
            stream.settle(chunk, entry[0], None, exc)
        return parts

    def settled(done: Future) -> None:
        error = done.exception()
        values = [error] * len(sent) if error is not None else done.result()
        for (_, stream, chunk, entry), value in zip(sent, values):
            failed = isinstance(value, BaseException)
            stream.settle(chunk, entry[0], None if failed else value, value if failed else None)

    replies.add_done_callback(settled)
    return parts
