"""One client process of the soak (``loadgen/soak.py`` starts them): real-time streams on a fixed schedule
(open loop), every chunk's outcome counted, in total and by sidecar; JSON lines appended to ``--out`` every half
second (a SIGKILL loses at most that); on SIGTERM it stops sending, waits for every outcome and writes its ``exit``
line. Several addresses (comma-separated) make it a ``SidecarPool`` client: each line then also says where each
new stream was placed. With ``--check-slots K`` the streams of its first K slots are recorded (codes, audio) and
written to ``--check-out`` at exit, for ``soak_check.py``'s reference decode.

    python -m code2wav.loadgen.soak_client --address ipc:///... --out c0.jsonl --duration-s 600 --streams 8
"""

from __future__ import annotations

import argparse
import json
import random
import signal
import sys
import threading
import time
from pathlib import Path

FLUSH_EVERY_S = 0.5


def _outcomes() -> dict:
    return {"sent": 0, "decoded": 0, "bad_audio": 0, "failed": {}}


class _Recorder:
    """Counters and latencies, appended to a JSON-lines file every FLUSH_EVERY_S (a SIGKILL loses at most that)."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.lock = threading.Lock()
        self.sent = self.decoded = self.bad_audio = 0
        self.failed: dict[str, int] = {}  # chunks sent that failed, by error code
        self.failed_unsent: dict[str, int] = {}  # refused before sending (open_stream failed, server down)
        self.by_sidecar: dict[str, dict] = {}  # the same counts by the index of the sidecar the chunk went to
        self.latencies: list[tuple[float, float, int]] = []  # (wall time sent, seconds, sidecar index), since flush
        self.placements: list[tuple[float, int]] = []  # (wall time opened, sidecar index), since the last flush
        self.slips: list[float] = []  # wall times a slot fell behind its schedule (a chunk not sent), since flush
        self.failover = None  # the pool's failover_stats (a SidecarPool with failover): read at each flush

    def sent_to(self, sidecar: int) -> None:
        with self.lock:
            self.sent += 1
            self.by_sidecar.setdefault(str(sidecar), _outcomes())["sent"] += 1

    def placed(self, sidecar: int) -> None:
        with self.lock:
            self.placements.append((time.time(), sidecar))

    def outcome(self, t_sent: float, t0: float, future, want_samples: int, sidecar: int) -> None:
        error = future.exception()
        with self.lock:
            mine = self.by_sidecar[str(sidecar)]
            if error is None:
                if future.result().numel() == want_samples:
                    self.decoded += 1
                    mine["decoded"] += 1
                    self.latencies.append((t_sent, time.monotonic() - t0, sidecar))
                else:
                    self.bad_audio += 1
                    mine["bad_audio"] += 1
            else:
                self.failed[_code(error)] = self.failed.get(_code(error), 0) + 1
                mine["failed"][_code(error)] = mine["failed"].get(_code(error), 0) + 1

    def slipped(self) -> None:
        with self.lock:
            self.slips.append(time.time())

    def unsent(self, error: BaseException) -> None:
        with self.lock:
            self.failed_unsent[_code(error)] = self.failed_unsent.get(_code(error), 0) + 1

    def flush(self, kind: str = "progress") -> None:
        moves = self.failover() if self.failover is not None else None
        if moves is not None and kind != "exit":  # each move's record only once, at exit (up to 4096)
            moves = {name: value for name, value in moves.items() if name != "recent"}
        with self.lock:
            line = {"kind": kind, "t": time.time(), "sent": self.sent, "decoded": self.decoded,
                    "bad_audio": self.bad_audio, "failed": dict(self.failed), "failed_unsent": dict(self.failed_unsent),
                    "by_sidecar": json.loads(json.dumps(self.by_sidecar)), "latencies": self.latencies,
                    "placements": self.placements, "slips": self.slips, "failover": moves}
            self.latencies, self.placements, self.slips = [], [], []
        with open(self.path, "a") as f:
            f.write(json.dumps(line) + "\n")


def _connect(args: argparse.Namespace, addresses: list[str], stop_at: float):
    """A ``SidecarClient`` for one address, a ``SidecarPool`` for several; None if none answered by ``stop_at``."""
    from code2wav.client import SidecarClient, SidecarError, SidecarPool  # noqa: PLC0415

    while time.monotonic() < stop_at:
        try:
            if len(addresses) == 1:
                return SidecarClient(addresses[0], timeout_s=args.timeout_s, connect_timeout_s=2.0,
                                     client_id=f"soak-{args.seed}")
            return SidecarPool(addresses, timeout_s=args.timeout_s, connect_timeout_s=2.0,
                               client_id=f"soak-{args.seed}", failover=not args.no_failover)
        except SidecarError:
            time.sleep(0.5)
    return None


def client_main(args: argparse.Namespace) -> int:
    import torch  # noqa: PLC0415 - the driver does not need torch

    from code2wav.client import SidecarError, SidecarPool  # noqa: PLC0415

    from .soak_check import CheckedStreams  # noqa: PLC0415

    rec = _Recorder(Path(args.out))
    stop_at = time.monotonic() + args.duration_s
    stopping = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stopping.set())
    gen = torch.Generator().manual_seed(args.seed)
    addresses = args.address.split(",")
    client = _connect(args, addresses, stop_at)
    if client is None:
        rec.flush("exit")
        return 1
    pooled = isinstance(client, SidecarPool)
    if pooled and not args.no_failover:
        rec.failover = client.failover_stats
    rec.flush("ready")
    home = (lambda s: addresses.index(client.address_of(s))) if pooled else (lambda s: 0)
    checked = CheckedStreams()
    info = client.models[0]
    frame_rate_hz = args.frame_rate_hz or info.sample_rate / info.samples_per_frame
    period_s = args.chunk_frames / frame_rate_hz
    rng = random.Random(args.seed)
    slots: list[dict] = [{"stream": None, "pos": 0, "len": args.stream_frames,
                          "due": time.monotonic() + i * period_s / args.streams} for i in range(args.streams)]
    futures = []
    last_flush = time.monotonic()
    opened = 0
    while time.monotonic() < stop_at and not stopping.is_set():
        now = time.monotonic()
        for index, slot in enumerate(slots):
            if now < slot["due"]:
                continue
            slot["due"] += period_s  # open loop: the schedule does not wait for replies
            if slot["due"] < now:  # fell behind (e.g. the sidecar was down): skip, do not burst, and take a
                # random phase, or every stream that waited for the restart would send in step from then on
                slot["due"] = now + period_s * (1.0 + rng.random())
                rec.slipped()  # (e.g. an open_stream that waited for a dead sidecar's silence to be noticed)
            stream = slot["stream"]
            if stream is None or stream.closed or stream.lost:
                # a fresh id per attempt: a failed open (e.g. across a sidecar restart) may still have opened
                # the stream on the server; the id is not retried, so that stream is left to the TTL
                stream_id = f"soak-{args.seed}-{opened}"
                opened += 1
                try:
                    stream = client.open_stream(stream_id)
                except SidecarError as exc:
                    rec.unsent(exc)
                    continue
                slot["sidecar"] = home(stream)
                rec.placed(slot["sidecar"])
                # utterance lengths vary (0.5x to 1.5x --stream-frames, whole chunks): streams that started
                # together (after a restart) do not keep ending and reopening together
                num_chunks = max(1, round(args.stream_frames * (0.5 + rng.random()) / args.chunk_frames))
                slot["stream"], slot["pos"], slot["len"] = stream, 0, num_chunks * args.chunk_frames
                slot["check"] = checked.start(stream_id, slot["sidecar"]) if index < args.check_slots else None
            final = slot["pos"] + args.chunk_frames >= slot["len"]
            codes = torch.randint(0, info.codebook_size, (info.num_quantizers, args.chunk_frames), generator=gen)
            try:
                future = stream.submit(codes, final=final)  # [Q, n] -> [n * U]
            except SidecarError as exc:  # e.g. out_of_order: an earlier chunk is in doubt (no reply before the
                rec.unsent(exc)  # sidecar went down, restart not seen yet); the soak drops the stream, no resend
                slot["stream"] = None
                continue
            slot["sidecar"] = home(stream)  # (a stream that moved after a failover: its new sidecar)
            rec.sent_to(slot["sidecar"])
            t_sent, t0 = time.time(), time.monotonic()
            want = args.chunk_frames * info.samples_per_frame
            future.add_done_callback(lambda f, t_sent=t_sent, t0=t0, want=want, sidecar=slot["sidecar"]:
                                     rec.outcome(t_sent, t0, f, want, sidecar))
            if slot["check"] is not None:
                slot["check"].sent(codes, final, future)
            futures.append(future)
            slot["pos"] += args.chunk_frames
            if final:
                slot["stream"] = None
        futures = [f for f in futures if not f.done()]
        if now - last_flush >= FLUSH_EVERY_S:
            rec.flush()
            last_flush = now
        next_due = min(slot["due"] for slot in slots)
        time.sleep(max(0.0, min(next_due - time.monotonic(), 0.05)))
    deadline = time.monotonic() + args.timeout_s + 5.0  # every chunk sent gets its outcome (or counts as lost)
    while any(not f.done() for f in futures) and time.monotonic() < deadline:
        time.sleep(0.05)
    time.sleep(0.1)  # done callbacks run on the client's I/O thread
    client.close()
    if args.check_out:
        checked.save(Path(args.check_out))
    rec.flush("exit")
    return 0


def _code(error: BaseException) -> str:
    """The protocol error code of a client error (its class name for anything else)."""
    return getattr(getattr(error, "code", None), "value", type(error).__name__)


def _parser() -> argparse.ArgumentParser:
    c = argparse.ArgumentParser(prog="python -m code2wav.loadgen.soak_client", description=__doc__.split("\n\n")[0])
    c.add_argument("--address", required=True, help="one address, or several comma-separated (a SidecarPool)")
    c.add_argument("--out", required=True)
    c.add_argument("--duration-s", type=float, required=True)
    c.add_argument("--streams", type=int, required=True)
    c.add_argument("--chunk-frames", type=int, default=25)
    c.add_argument("--stream-frames", type=int, default=250, help="mean frames per stream (each 0.5x to 1.5x)")
    c.add_argument("--frame-rate-hz", type=float, default=None)
    c.add_argument("--timeout-s", type=float, default=10.0)
    c.add_argument("--seed", type=int, default=0)
    c.add_argument("--check-slots", type=int, default=0, help="record the streams of this many slots (0: none)")
    c.add_argument("--check-out", default=None, help="where the recorded streams go at exit (torch.save)")
    c.add_argument("--no-failover", action="store_true", help="a pool without failover (a killed sidecar's "
                   "streams end with stream_lost)")
    return c


if __name__ == "__main__":
    sys.exit(client_main(_parser().parse_args()))
