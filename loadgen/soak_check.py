"""The soak's audio check: does a stream's audio, decoded during the soak (faults around it, batched with whatever
other streams were in flight), equal the same codes decoded afterwards, one chunk at a time, on an idle sidecar?

Client side (``soak_client.py --check-slots K``): ``CheckedStreams`` records the codes, ``final`` flags and audio
of the streams of a client's first K slots, and saves them at exit (``torch.save``). Reference side (a process the
driver runs once the clients have exited, the sidecars still up):

    python -m code2wav.loadgen.soak_check --address a,b,c --alive 0,2 --out check.json client0-0.check.pt ...

decodes each recorded stream's chunks again, in order and alone, on the sidecar the stream ran on (or the first
alive one, when that one was killed and is not back), up to its first chunk without audio (a stream cut by a kill
is checked up to the kill), and writes per stream: chunks compared, how many are bit-identical, the largest
absolute difference, the lowest signal-to-difference ratio of a chunk (dB). Where the soak batched a chunk with
other streams the two decodes may differ: a row's batch company changes the order of float sums on some kernels
(tests/test_streaming_kit.py holds it to 1e-5 in float32), and on a GPU a batch runs another bucket's graph, whose
kernels may differ (in bfloat16, a rounding apart: the exact mode's bfloat16 audio is ~30 dB from float32's,
docs/performance.md). The driver judges float32 by ``--check-atol``, bfloat16 by ``--check-min-snr-db``; a
stream decoded with a wrong state, or another stream's audio, is near 0 dB.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import threading
import time
from pathlib import Path

from .spawn import ROOT


class CheckedStreams:
    """The recorded streams of one client process (thread-safe: audio arrives on the client's I/O thread)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.records: list[dict] = []

    def start(self, stream_id: str, sidecar: int) -> _Recording:
        record = {"stream_id": stream_id, "sidecar": sidecar, "t_open": time.time(), "codes": [], "finals": [],
                  "t_sent": [], "audio": [], "errors": []}
        with self.lock:
            self.records.append(record)
        return _Recording(record, self.lock)

    def save(self, path: Path) -> None:
        import torch  # noqa: PLC0415

        with self.lock:
            torch.save(self.records, path)


class _Recording:
    def __init__(self, record: dict, lock: threading.Lock) -> None:
        self.record, self.lock = record, lock

    def sent(self, codes, final: bool, future) -> None:
        """A chunk sent: ``codes`` [Q, n] (not modified after), its audio [n * U] once ``future`` is done."""
        with self.lock:
            index = len(self.record["codes"])
            self.record["codes"].append(codes)
            self.record["finals"].append(final)
            self.record["t_sent"].append(time.time())
            self.record["audio"].append(None)
            self.record["errors"].append(None)

        def done(finished) -> None:
            error = finished.exception()
            with self.lock:
                if error is None:
                    self.record["audio"][index] = finished.result()
                else:
                    self.record["errors"][index] = getattr(getattr(error, "code", None), "value", type(error).__name__)
        future.add_done_callback(done)


def snr_db(reference, diff) -> float:
    """10 log10(sum reference^2 / sum diff^2): inf when equal, -inf for a difference on silence."""
    import math  # noqa: PLC0415

    noise = float((diff * diff).sum())
    if noise == 0.0:
        return float("inf")
    signal_energy = float((reference * reference).sum())
    return 10.0 * math.log10(signal_energy / noise) if signal_energy > 0.0 else float("-inf")


def compare_stream(client, record: dict, stream_id: str) -> dict:
    """Decode ``record``'s chunks up to its first one without audio, alone and in order, as ``stream_id`` on
    ``client``; the comparison with the soak's audio."""
    import torch  # noqa: PLC0415

    decoded = 0
    while decoded < len(record["audio"]) and record["audio"][decoded] is not None:
        decoded += 1
    result = {"stream_id": record["stream_id"], "sidecar": record["sidecar"], "t_open": record["t_open"],
              "t_last_sent": record["t_sent"][-1] if record["t_sent"] else record["t_open"],
              "chunks_sent": len(record["codes"]), "chunks_compared": decoded, "bit_identical_chunks": 0,
              "max_abs_diff": 0.0, "min_snr_db": float("inf"), "worst_chunk": None, "worst_chunk_t_sent": None,
              "first_error": next((e for e in record["errors"] if e is not None), None)}
    if decoded == 0:
        return result
    stream = client.open_stream(stream_id)
    for index, (codes, final, soak_audio) in enumerate(zip(record["codes"][:decoded], record["finals"],
                                                             record["audio"])):
        reference = stream.decode(codes, final=final)  # [Q, n] -> [n * U], alone: no other stream in flight
        if soak_audio.shape != reference.shape:
            result["max_abs_diff"], result["min_snr_db"] = float("inf"), float("-inf")
            result["worst_chunk"], result["worst_chunk_t_sent"] = index, record["t_sent"][index]
            continue
        result["bit_identical_chunks"] += int(torch.equal(soak_audio, reference))
        diff = soak_audio.double() - reference.double()  # [n * U]
        if diff.numel():
            result["max_abs_diff"] = max(result["max_abs_diff"], diff.abs().max().item())
            snr = snr_db(reference.double(), diff)
            if snr < result["min_snr_db"]:  # the chunk furthest from the reference: which one, sent when
                result["min_snr_db"], result["worst_chunk"] = snr, index
                result["worst_chunk_t_sent"] = record["t_sent"][index]
    if not stream.closed:
        stream.abort()
    return result


def reference_check(addresses: list[str], alive: list[int], outputs: list[Path], out: Path,
                    env: dict[str, str]) -> list[dict]:
    """The driver's side: this module as a process over what the client processes (``outputs``, their JSON-lines
    files) recorded; its results, none when it failed (said on stderr; the verdict then fails: nothing checked)."""
    recorded = [str(path.with_suffix(".check.pt")) for path in outputs if path.with_suffix(".check.pt").exists()]
    cmd = [sys.executable, "-m", "code2wav.loadgen.soak_check", "--address", ",".join(addresses),
           "--alive", ",".join(str(index) for index in alive), "--out", str(out), *recorded]
    try:
        subprocess.run(cmd, env=env, cwd=ROOT, check=True, timeout=600)
        return json.loads(out.read_text())
    except (subprocess.SubprocessError, OSError, ValueError) as exc:
        print(f"soak: the audio check failed ({exc}); nothing compared", file=sys.stderr, flush=True)
        return []


def check_main(args: argparse.Namespace) -> int:
    import torch  # noqa: PLC0415

    from code2wav.client import SidecarClient  # noqa: PLC0415

    addresses = args.address.split(",")
    alive = [int(i) for i in args.alive.split(",") if i != ""]
    clients = {index: SidecarClient(addresses[index], timeout_s=60) for index in alive}
    results = []
    try:
        for path in args.recorded:
            for number, record in enumerate(torch.load(path, weights_only=False)):
                where = record["sidecar"] if record["sidecar"] in clients else alive[0]
                outcome = compare_stream(clients[where], record, f"check-{Path(path).stem}-{number}")
                results.append({**outcome, "reference_sidecar": where})
    finally:
        for client in clients.values():
            client.close()
    Path(args.out).write_text(json.dumps(results))
    return 0


def _parser() -> argparse.ArgumentParser:
    c = argparse.ArgumentParser(prog="python -m code2wav.loadgen.soak_check", description=__doc__.split("\n\n")[0])
    c.add_argument("--address", required=True, help="the soak's sidecars, comma-separated, in index order")
    c.add_argument("--alive", required=True, help="indices of the sidecars up now, comma-separated")
    c.add_argument("--out", required=True)
    c.add_argument("recorded", nargs="*", help="files the client processes saved (--check-out)")
    return c


if __name__ == "__main__":
    sys.exit(check_main(_parser().parse_args()))
