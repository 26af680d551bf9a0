"""A caller blocked on its call takes the client's I/O role (``Connection.wait``): its reply is received and settled
on its own thread, calls other threads submit meanwhile still leave and complete, and a close hands the role back.

Against the fake ROUTER peer of ``test_client_unit`` (a real ZeroMQ socket on ipc:// in tmp_path).
"""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
import torch

from code2wav.client import SidecarClient, Unavailable
from test_client_unit import FakeSidecar, address, client, expected_audio, fake, make_codes  # noqa: F401


def _record_dispatch_threads(conn: Any, monkeypatch: Any) -> list[str]:
    """The thread name of every message the connection dispatches, from now on (the real dispatch runs)."""
    seen: list[str] = []
    real = conn._dispatch

    def dispatch(frames: list[memoryview], received_ns: int = 0) -> None:
        seen.append(threading.current_thread().name)
        real(frames, received_ns)

    monkeypatch.setattr(conn, "_dispatch", dispatch)
    return seen


def _wait_for(predicate: Any, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.002)


def test_a_blocking_decode_takes_its_reply_on_the_callers_thread(client: SidecarClient, fake: FakeSidecar,
                                                                 monkeypatch: Any) -> None:
    stream = client.open_stream("mine")
    fake.reply_delay_s["mine"] = 0.003  # a step's time: the reply comes once the caller waits
    seen = _record_dispatch_threads(client._conn, monkeypatch)
    for i in range(20):
        codes = make_codes(3, 10 * i)
        assert torch.equal(stream.decode(codes), expected_audio(codes))
    me = threading.current_thread().name
    # the I/O thread takes the heartbeat's pongs; a caller that finds it mid-turn for over 2 ms (a descheduled
    # thread on a loaded machine) leaves the reply to it: so "most", and none before the change
    assert seen.count(me) >= 18, seen
    assert client._conn._io_role is None and not client._conn.on_io_thread


def test_calls_of_other_threads_leave_and_complete_while_a_caller_holds_the_role(
        client: SidecarClient, fake: FakeSidecar, monkeypatch: Any) -> None:
    slow, quick = client.open_stream("slow"), client.open_stream("quick")
    fake.reply_delay_s["slow"] = 1.0
    conn = client._conn
    seen = _record_dispatch_threads(conn, monkeypatch)
    done: dict[str, Any] = {}

    def other() -> None:
        _wait_for(lambda: conn._io_role is not None, 5)  # the main thread waits in the role
        started = time.monotonic()
        try:
            for i in range(10):
                codes = make_codes(2, 100 + 2 * i)
                assert torch.equal(quick.decode(codes), expected_audio(codes))
        except BaseException as exc:  # reported below
            done["error"] = exc
        done["elapsed_s"] = time.monotonic() - started

    thread = threading.Thread(target=other, name="other-caller")
    thread.start()
    slow_codes = make_codes(4, 7)
    assert torch.equal(slow.decode(slow_codes), expected_audio(slow_codes))
    thread.join(5)
    assert "error" not in done, done.get("error")
    assert done["elapsed_s"] < 0.9  # all ten answered while the slow reply was still due
    me = threading.current_thread().name
    assert seen.count(me) >= 11  # the slow reply and the other thread's ten, taken here
    assert quick.next_seq == 10 and slow.next_seq == 1


def test_a_close_while_a_caller_holds_the_role_ends_its_wait(fake: FakeSidecar, address: str) -> None:
    client = SidecarClient(address, timeout_s=10)
    stream = client.open_stream("held")
    fake.reply_delay_s["held"] = 8.0
    closer = threading.Thread(target=lambda: (_wait_for(lambda: client._conn._io_role is not None, 5),
                                               client.close()))
    closer.start()
    started = time.monotonic()
    with pytest.raises(Unavailable, match="closed"):
        stream.decode(make_codes(2))
    assert time.monotonic() - started < 3.0  # not the 8 s reply nor the 10 s timeout
    closer.join(5)
    assert not client._conn._thread.is_alive()


def test_a_blocking_call_from_a_callback_run_in_the_role_is_refused(client: SidecarClient,
                                                                   fake: FakeSidecar) -> None:
    """Callbacks run where the role is held; blocking there would wait on the thread that must receive."""
    first, waiting, other = (client.open_stream(name) for name in ("first", "waiting", "other"))
    fake.reply_delay_s["first"] = 0.1
    fake.reply_delay_s["waiting"] = 0.4
    refused: list[BaseException] = []
    threads: list[str] = []

    def callback(_future: Any) -> None:
        threads.append(threading.current_thread().name)
        try:
            other.decode(make_codes(1), timeout_s=2)
        except RuntimeError as exc:
            refused.append(exc)

    future = first.submit(make_codes(2))
    future.add_done_callback(callback)
    codes = make_codes(3, 20)
    assert torch.equal(waiting.decode(codes), expected_audio(codes))  # the first reply arrives meanwhile
    assert threads == [threading.current_thread().name]
    assert len(refused) == 1 and "blocking call from a future callback" in str(refused[0])
    assert isinstance(future.result(1), torch.Tensor)

