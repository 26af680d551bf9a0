"""What this host gives any Python + ZeroMQ design: one-way ipc:// latency and the cost of a fixed piece of
Python, each after the thread idled for a step's length in three ways (slept, spun, or not at all).

One-way latency: a sender process stamps ``time.monotonic_ns()`` into a 300-byte message (about a CUDA IPC
``decode`` header) and the receiver subtracts its own clock on arrival (one host, one clock). The receiver
either blocks in ``recv()`` or busy-polls ``recv(NOBLOCK)``; the sender waits ``GAP_US`` between messages by
sleeping or by spinning. No torch, no GPU: this is the floor under the sidecar's way in.

    python loadgen/probes/zmq_floor.py            # N=2000 GAP_US=5000
    PIN=2,4 YIELD=1 CASES=polls:spin python loadgen/probes/zmq_floor.py   # pinned, yielding variant
"""

from __future__ import annotations

import multiprocessing as mp
import os
import statistics
import struct
import tempfile
import time

import zmq

N = int(os.environ.get("N", "2000"))
PIN = os.environ.get("PIN", "")  # "RECV_CPU,SEND_CPU": pin each process (its ZeroMQ I/O thread too) to one CPU
YIELD = os.environ.get("YIELD") == "1"  # sched_yield() in every poll/spin turn (lets a woken thread run)
CASES = os.environ.get("CASES", "blocks:sleep,blocks:spin,polls:sleep,polls:spin")
GAP_NS = int(os.environ.get("GAP_US", "5000")) * 1000
PAYLOAD_NBYTES = 300


def _wait(gap_ns: int, how: str) -> None:
    if how == "sleep":
        time.sleep(gap_ns / 1e9)
    elif how == "spin":
        end = time.monotonic_ns() + gap_ns
        while time.monotonic_ns() < end:
            if YIELD:
                os.sched_yield()


def _pin(index: int) -> None:
    if PIN:
        os.sched_setaffinity(0, {int(PIN.split(",")[index])})  # before the context: its I/O thread inherits it


def _receiver(address: str, poll: bool, count: int, out) -> None:
    _pin(0)
    ctx = zmq.Context()
    sock = ctx.socket(zmq.PULL)
    sock.bind(address)
    out.put("bound")
    one_way_ns = []
    for _ in range(count):
        if poll:
            while True:
                try:
                    data = sock.recv(zmq.NOBLOCK)
                    break
                except zmq.Again:
                    if YIELD:
                        os.sched_yield()
        else:
            data = sock.recv()
        one_way_ns.append(time.monotonic_ns() - struct.unpack_from("q", data)[0])
    out.put(one_way_ns)
    sock.close(0)
    ctx.term()


def one_way(poll: bool, sender_wait: str) -> list[int]:
    with tempfile.TemporaryDirectory() as tmp:
        address = f"ipc://{tmp}/floor.sock"
        out = mp.Queue()
        proc = mp.Process(target=_receiver, args=(address, poll, N, out))
        proc.start()
        out.get()
        _pin(1)
        ctx = zmq.Context()
        sock = ctx.socket(zmq.PUSH)
        sock.connect(address)
        time.sleep(0.2)
        pad = b"x" * (PAYLOAD_NBYTES - 8)
        for _ in range(N):
            _wait(GAP_NS, sender_wait)
            sock.send(struct.pack("q", time.monotonic_ns()) + pad)
        result = out.get()
        proc.join()
        sock.close(0)
        ctx.term()
        if PIN:
            os.sched_setaffinity(0, range(os.cpu_count() or 1))
    return result[N // 10:]


def _work() -> int:
    """A fixed piece of Python of the size of one of the sidecar's steps (dicts, attribute lookups, calls)."""
    total = 0
    for i in range(200):
        record = {"stream_id": "s", "seq": i, "shape": (16, 25)}
        total += record["seq"] + len(record["shape"]) + len(str(i))
    return total


def python_cost(how: str) -> list[int]:
    costs = []
    for _ in range(N // 4):
        _wait(GAP_NS, how)
        t0 = time.perf_counter_ns()
        _work()
        costs.append(time.perf_counter_ns() - t0)
    return costs


def _p(values: list[int], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] / 1e3


def main() -> None:
    print(f"cpus={os.cpu_count()} gap={GAP_NS / 1e3:.0f} us n={N} pin={PIN or 'no'} yield={YIELD}")
    for case in CASES.split(","):
        mode, sender_wait = case.split(":")
        poll = mode == "polls"
        lat = one_way(poll, sender_wait)
        print(f"one-way ipc://, receiver {'polls  ' if poll else 'blocks '}, sender {sender_wait:5s} between: "
              f"p50 {_p(lat, 0.5):6.1f} us  p90 {_p(lat, 0.9):6.1f} us")
    for how in os.environ.get("WORK", "none,spin,sleep").split(","):
        cost = python_cost(how)
        print(f"fixed Python work after {how:5s}: p50 {_p(cost, 0.5):6.1f} us  (min {min(cost) / 1e3:.1f}, "
              f"mean {statistics.mean(cost) / 1e3:.1f})")


if __name__ == "__main__":
    main()
