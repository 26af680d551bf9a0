"""What the GPU itself charges for handing a step from one process to another, with no Python on the way.

The question behind it: could a device-side doorbell take the launch off the message path and meet the
<= 150 us target? A "server" process arms steps ahead of time on its own stream (``cuStreamWaitValue32`` on a
doorbell word in the client's memory, then copy-in, a CUDA graph, copy-out, ``cuStreamWriteValue32`` of a done
word); the client copies its codes, rings the doorbell and waits for the done word, all on its own stream.
Compared in the same run, interleaved in rounds:

- ``inproc``    the same graph replayed in the client's process (the baseline);
- ``doorbell``  the armed cross-process step above (no host involvement per step on either side);
- ``zmq``       the host-message handoff the sidecar uses, stripped to its floor: IPC event in, a 16-byte
                ZeroMQ message, the server busy-polls, waits on the event, replays, records an IPC event,
                replies; the client waits on that event;
- ``hostbell``  no ZeroMQ and no parked GPU stream: the client's stream writes the ring word into shared
                pinned host memory after its codes copy; the server's host thread spins on it, launches, and its
                stream writes a done word there after the audio copy; the client's host thread spins on that;
- ``parked``    ``inproc`` while the server has a stream parked on a doorbell that is never rung (does an
                armed, waiting context slow the client's own GPU work through time-slicing?).

Every mode's audio is checked against the in-process result for the same codes before timing, so a broken
ordering shows as a mismatch, not as a fast number. Needs a CUDA GPU; run it under MPS too (see docs/design-notes.md).

    python loadgen/probes/doorbell.py                  # N=400 per round, ROUNDS=3
    MATMULS=120 DIM=1024 python loadgen/probes/doorbell.py

Over 300 lines: one self-contained experiment (server and client processes, three handoffs, one report) that is run
as a single script.
"""

from __future__ import annotations

import ctypes
import os
import tempfile
import time
from multiprocessing import shared_memory

import torch
import torch.multiprocessing as mp
import zmq

N = int(os.environ.get("N", "400"))
ROUNDS = int(os.environ.get("ROUNDS", "3"))
MATMULS = int(os.environ.get("MATMULS", "120"))  # the graph's length: small matmuls, launch-bound like the decoder
DIM = int(os.environ.get("DIM", "1024"))
ROWS = 64
CODES_NUMEL = 16 * 25  # one 25-frame chunk of 16 codebooks
AUDIO_NUMEL = 25 * 1920  # its 24 kHz samples
SLOTS = 2
DEPTH = 2  # steps the server keeps armed ahead
WORD_DOOR, WORD_DONE, WORD_PARK = 0, 1, 2


class StreamMemOps:
    """``cuStreamWaitValue32`` / ``cuStreamWriteValue32`` through the driver API (torch does not expose them)."""

    def __init__(self) -> None:
        lib = ctypes.CDLL("libcuda.so.1")
        self._wait = self._bind(lib, "cuStreamWaitValue32")
        self._write = self._bind(lib, "cuStreamWriteValue32")
        self._register = lib.cuMemHostRegister_v2
        self._register.restype = ctypes.c_int
        self._register.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_uint]
        self._device_pointer = lib.cuMemHostGetDevicePointer_v2
        self._device_pointer.restype = ctypes.c_int
        self._device_pointer.argtypes = [ctypes.POINTER(ctypes.c_uint64), ctypes.c_void_p, ctypes.c_uint]

    def map_host(self, address: int, nbytes: int) -> int:
        """Page-lock ``nbytes`` of host memory at ``address`` (shared with the other process) and return the
        device address the GPU writes it through."""
        result = self._register(address, nbytes, 0x1 | 0x2)  # CU_MEMHOSTREGISTER_PORTABLE | DEVICEMAP
        if result != 0:
            raise RuntimeError(f"cuMemHostRegister failed: CUresult {result}")
        device_address = ctypes.c_uint64()
        result = self._device_pointer(ctypes.byref(device_address), address, 0)
        if result != 0:
            raise RuntimeError(f"cuMemHostGetDevicePointer failed: CUresult {result}")
        return device_address.value

    @staticmethod
    def _bind(lib: ctypes.CDLL, name: str):
        for symbol in (name + "_v2", name):
            fn = getattr(lib, symbol, None)
            if fn is not None:
                fn.restype = ctypes.c_int
                fn.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint32, ctypes.c_uint]
                return fn
        raise RuntimeError(f"libcuda has no {name}")

    def wait_geq(self, stream: torch.cuda.Stream, address: int, value: int) -> None:
        # flags 0 = CU_STREAM_WAIT_VALUE_GEQ: (int32)(*address - value) >= 0, wrap-safe
        result = self._wait(stream.cuda_stream, address, value & 0xFFFFFFFF, 0)
        if result != 0:
            raise RuntimeError(f"cuStreamWaitValue32 failed: CUresult {result}")

    def write(self, stream: torch.cuda.Stream, address: int, value: int) -> None:
        result = self._write(stream.cuda_stream, address, value & 0xFFFFFFFF, 0)  # 0: with a memory barrier
        if result != 0:
            raise RuntimeError(f"cuStreamWriteValue32 failed: CUresult {result}")


class Work:
    """A fixed CUDA graph: codes in a static buffer -> MATMULS small bf16 matmuls -> audio in a static buffer."""

    def __init__(self, device: torch.device) -> None:
        gen = torch.Generator().manual_seed(0)
        self.weight = (torch.randn(DIM, DIM, generator=gen) / DIM**0.5).to(device, torch.bfloat16)  # [D, D]
        self.base = torch.randn(ROWS, DIM, generator=gen).to(device, torch.bfloat16)  # [R, D]
        self.codes = torch.zeros(CODES_NUMEL, dtype=torch.int32, device=device)  # [Q*T]
        self.audio = torch.zeros(AUDIO_NUMEL, dtype=torch.float32, device=device)  # [S]
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                self._body()
        torch.cuda.current_stream().wait_stream(side)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self._body()
        torch.cuda.synchronize()

    def _body(self) -> None:
        h = self.base + (self.codes.float().mean() / 2048).to(torch.bfloat16)  # [R, D]
        for _ in range(MATMULS):
            h = torch.tanh(h @ self.weight)  # [R, D]
        self.audio.copy_(h.flatten()[:AUDIO_NUMEL].float())  # [S]

    def reference(self, codes: torch.Tensor) -> torch.Tensor:
        self.codes.copy_(codes)
        self.graph.replay()
        return self.audio.clone()  # [S]


def _arm(ops, stream, work, words, codes_region, audio_region, seq: int, done_event) -> None:
    slot = seq % SLOTS
    with torch.cuda.stream(stream):
        ops.wait_geq(stream, words.data_ptr() + 4 * WORD_DOOR, seq)
        work.codes.copy_(codes_region[slot])
        work.graph.replay()
        audio_region[slot].copy_(work.audio)
        ops.write(stream, words.data_ptr() + 4 * WORD_DONE, seq)
        done_event.record(stream)


class HostWords:
    """Two int32 words in POSIX shared memory (ring at byte 0, done at byte 64), page-locked and mapped for the
    GPU in each process that attaches. ``.ring.value`` / ``.done.value`` read the memory on every access."""

    NBYTES = 4096

    def __init__(self, ops: StreamMemOps, name: str | None = None) -> None:
        self.shm = shared_memory.SharedMemory(name=name, create=name is None, size=self.NBYTES)
        self.ring = ctypes.c_int32.from_buffer(self.shm.buf, 0)
        self.done = ctypes.c_int32.from_buffer(self.shm.buf, 64)
        device_base = ops.map_host(ctypes.addressof(self.ring), self.NBYTES)
        self.ring_ptr, self.done_ptr = device_base, device_base + 64

    def close(self) -> None:
        del self.ring, self.done  # ctypes views pin the buffer; drop them before closing it
        self.shm.close()


def _server(conn, words, codes_region, audio_region, in_handle, address, shm_name) -> None:
    device = torch.device("cuda", torch.cuda.current_device())
    ops = StreamMemOps()
    host = HostWords(ops, shm_name)
    work = Work(device)
    stream = torch.cuda.Stream()
    park_stream = torch.cuda.Stream()
    events = [torch.cuda.Event() for _ in range(DEPTH + 1)]
    in_event = torch.cuda.Event.from_ipc_handle(device, in_handle)
    out_event = torch.cuda.Event(interprocess=True)
    ctx = zmq.Context()
    sock = ctx.socket(zmq.PAIR)
    sock.bind(address)
    conn.send(out_event.ipc_handle())
    while True:
        command = conn.recv()
        if command[0] == "doorbell":
            first_seq, count = command[1], command[2]
            for seq in range(first_seq, first_seq + count):
                if seq - first_seq >= DEPTH:
                    events[(seq - DEPTH) % len(events)].synchronize()
                _arm(ops, stream, work, words, codes_region, audio_region, seq, events[seq % len(events)])
                if seq - first_seq == min(DEPTH, count) - 1:
                    conn.send("armed")
            stream.synchronize()
            conn.send("done")
        elif command[0] == "zmq":
            for _ in range(command[1]):
                while True:
                    try:
                        message = sock.recv(zmq.NOBLOCK)
                        break
                    except zmq.Again:
                        pass
                seq = int.from_bytes(message[:8], "little")
                slot = seq % SLOTS
                with torch.cuda.stream(stream):
                    stream.wait_event(in_event)
                    work.codes.copy_(codes_region[slot])
                    work.graph.replay()
                    audio_region[slot].copy_(work.audio)
                    out_event.record(stream)
                sock.send(message)
            stream.synchronize()
            conn.send("done")
        elif command[0] == "hostbell":
            first_seq, count = command[1], command[2]
            for seq in range(first_seq, first_seq + count):
                while host.ring.value - seq < 0:
                    pass
                slot = seq % SLOTS
                with torch.cuda.stream(stream):
                    work.codes.copy_(codes_region[slot])
                    work.graph.replay()
                    audio_region[slot].copy_(work.audio)
                    ops.write(stream, host.done_ptr, seq)
            stream.synchronize()
            conn.send("done")
        elif command[0] == "park":
            ops.wait_geq(park_stream, words.data_ptr() + 4 * WORD_PARK, command[1])
            conn.send("parked")
        elif command[0] == "unparked":
            park_stream.synchronize()
            conn.send("done")
        else:
            break
    sock.close(0)
    ctx.term()
    host.close()


def _p(values: list[int], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] / 1e3


def main() -> None:
    device = torch.device("cuda", 0)
    torch.cuda.set_device(device)
    ops = StreamMemOps()
    work = Work(device)
    stream = torch.cuda.current_stream()
    gen = torch.Generator().manual_seed(1)
    noise = torch.randint(0, 48, (8, CODES_NUMEL), generator=gen, dtype=torch.int32)  # [K, Q*T]
    sources = (noise + 240 * torch.arange(8, dtype=torch.int32)[:, None]).to(device)  # [K, Q*T], means 240 apart
    references = [work.reference(sources[k]) for k in range(len(sources))]  # K x [S]
    apart = min((references[a] - references[b]).abs().max().item()
                for a in range(len(references)) for b in range(a + 1, len(references)))
    assert apart > 0.0, "the codes must change the audio, or the checks prove nothing"
    words = torch.zeros(8, dtype=torch.int32, device=device)  # doorbell, done, park
    codes_region = torch.zeros(SLOTS, CODES_NUMEL, dtype=torch.int32, device=device)  # [SLOTS, Q*T]
    audio_region = torch.zeros(SLOTS, AUDIO_NUMEL, dtype=torch.float32, device=device)  # [SLOTS, S]
    in_event = torch.cuda.Event(interprocess=True)
    out = torch.empty(AUDIO_NUMEL, dtype=torch.float32, device=device)
    door_ptr = words.data_ptr() + 4 * WORD_DOOR
    done_ptr = words.data_ptr() + 4 * WORD_DONE
    host = HostWords(ops)
    with tempfile.TemporaryDirectory() as tmp:
        address = f"ipc://{tmp}/doorbell.sock"
        ctx = mp.get_context("spawn")
        parent, child = ctx.Pipe()
        proc = ctx.Process(target=_server, args=(child, words, codes_region, audio_region, in_event.ipc_handle(),
                                                 address, host.shm.name))
        proc.start()
        out_event = torch.cuda.Event.from_ipc_handle(device, parent.recv())
        zctx = zmq.Context()
        sock = zctx.socket(zmq.PAIR)
        sock.connect(address)
        seq = 0

        def inproc(i: int, seq: int) -> torch.Tensor:
            work.codes.copy_(sources[i % len(sources)])
            work.graph.replay()
            out.copy_(work.audio)
            stream.synchronize()
            return out

        def doorbell(i: int, seq: int) -> torch.Tensor:
            slot = seq % SLOTS
            codes_region[slot].copy_(sources[i % len(sources)])
            ops.write(stream, door_ptr, seq)
            ops.wait_geq(stream, done_ptr, seq)
            stream.synchronize()
            return audio_region[slot]

        def hostbell(i: int, seq: int) -> torch.Tensor:
            slot = seq % SLOTS
            codes_region[slot].copy_(sources[i % len(sources)])
            ops.write(stream, host.ring_ptr, seq)
            while host.done.value - seq < 0:
                pass
            return audio_region[slot]

        def zmq_step(i: int, seq: int) -> torch.Tensor:
            slot = seq % SLOTS
            codes_region[slot].copy_(sources[i % len(sources)])
            in_event.record(stream)
            sock.send(seq.to_bytes(8, "little") + bytes(8))
            sock.recv()
            stream.wait_event(out_event)
            stream.synchronize()
            return audio_region[slot]

        modes = {"inproc": inproc, "doorbell": doorbell, "zmq": zmq_step, "hostbell": hostbell,
                 "parked": inproc}
        timings: dict[str, list[int]] = {mode: [] for mode in modes}
        park_value = 0
        worst: dict[str, float] = {}
        for round_index in range(ROUNDS + 1):  # round 0: checks and warm-up, not timed
            check = round_index == 0
            count = 24 if check else N
            for mode, step in modes.items():
                if mode == "doorbell":
                    parent.send(("doorbell", seq + 1, count))
                    assert parent.recv() == "armed"
                elif mode == "zmq":
                    parent.send(("zmq", count))
                elif mode == "hostbell":
                    parent.send(("hostbell", seq + 1, count))
                elif mode == "parked":
                    park_value += 1
                    parent.send(("park", park_value))
                    assert parent.recv() == "parked"
                for i in range(count):
                    seq += 1
                    seq = seq
                    t0 = time.perf_counter_ns()
                    audio = step(i, seq)
                    elapsed = time.perf_counter_ns() - t0
                    if check:
                        error = (audio - references[i % len(references)]).abs().max().item()
                        worst[mode] = max(worst.get(mode, 0.0), error)
                        assert error <= apart / 10, f"{mode}: chunk {i} is off the in-process result by {error}"
                    else:
                        timings[mode].append(elapsed)
                if mode in ("doorbell", "zmq", "hostbell"):
                    assert parent.recv() == "done"
                elif mode == "parked":
                    words[WORD_PARK].fill_(park_value)
                    parent.send(("unparked",))
                    assert parent.recv() == "done"
            if check:
                print(f"checks passed ({count} chunks a mode): max error against the in-process result {worst}, "
                      f"while the codes' audios are {apart:.3g} apart")
        parent.send(("quit",))
        proc.join()
        sock.close(0)
        zctx.term()
    host.close()
    try:
        host.shm.unlink()
    except FileNotFoundError:  # the server's resource tracker (Python < 3.13) may have unlinked it already
        pass
    base = _p(timings["inproc"], 0.5)
    mps = "yes" if os.environ.get("CUDA_MPS_PIPE_DIRECTORY") else "no"
    print(f"graph: {MATMULS} matmuls [{ROWS}x{DIM}]x[{DIM}x{DIM}] bf16; n={N} x {ROUNDS} rounds; MPS pipe set: {mps}")
    for mode, values in timings.items():
        print(f"{mode:9s} p50 {_p(values, 0.5):8.1f} us  p90 {_p(values, 0.9):8.1f} us  "
              f"over inproc p50 {_p(values, 0.5) - base:+8.1f} us")


if __name__ == "__main__":
    main()
