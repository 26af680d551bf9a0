"""The flags of the soak with faults (``soak.py``): load, faults, the pool's kill and restart, the reference check."""

from __future__ import annotations

import argparse

from code2wav.sidecar.cli_checks import DEVICE_HELP, OneLineParser, device_arg, float_above, int_at_least, output_file
from code2wav.sidecar.cli_help import DTYPE_CHOICES


def soak_parser(description: str) -> argparse.ArgumentParser:
    """The soak's flags (``description``: its module's first paragraph)."""
    p = OneLineParser(prog="python -m code2wav.loadgen.soak", description=description)
    p.add_argument("--model", default="default")
    p.add_argument("--device", type=device_arg, default="cuda", help=DEVICE_HELP)
    p.add_argument("--dtype", default="bfloat16", choices=DTYPE_CHOICES)
    p.add_argument("--duration-s", type=float_above(0), default=600.0)
    p.add_argument("--clients", type=int_at_least(1), default=4, help="client processes")
    p.add_argument("--streams-per-client", type=int_at_least(1), default=None)
    p.add_argument("--capacity-streams", type=int_at_least(1), default=None,
                   help="real-time streams the sidecar sustains (measured before, e.g. by the bench)")
    p.add_argument("--fraction", type=float_above(0), default=0.8, help="of --capacity-streams")
    p.add_argument("--chunk-frames", type=int_at_least(1), default=25)
    p.add_argument("--stream-frames", type=int_at_least(1), default=250, help="mean frames per stream (each 0.5x to "
                   "1.5x)")
    p.add_argument("--frame-rate-hz", type=float_above(0), default=None, help="default: the model's (e.g. 12.5)")
    p.add_argument("--timeout-s", type=float_above(0), default=10.0, help="the clients' request timeout")
    p.add_argument("--kill-every-s", type=float_above(0, inclusive=True), default=30.0,
                   help="SIGKILL one client process this often (0: never)")
    p.add_argument("--restart-sidecar-at-s", type=float_above(0), default=None, help="SIGTERM and restart the "
                   "sidecar once")
    p.add_argument("--spawn-probe-every-s", type=float_above(0, inclusive=True), default=0.0,
                   help="start a process that only imports what a client imports, this often, the first after half "
                        "of it (0: never); the report's spawn_probes says when, to compare with the kills' windows")
    p.add_argument("--sidecars", type=int_at_least(1), default=1, help="sidecars to start (several: each client "
                   "process is a SidecarPool over all of them)")
    p.add_argument("--kill-sidecar-at-s", type=float_above(0), default=None, help="SIGKILL one sidecar once (with "
                   "--sidecars 2 or more); the report's `pool` part says what it did to the others")
    p.add_argument("--kill-sidecar", type=int_at_least(0), default=1, help="which sidecar (index) to SIGKILL")
    p.add_argument("--restart-killed-at-s", type=float_above(0), default=None, help="start the killed sidecar again "
                   "(same address)")
    p.add_argument("--check-slots", type=int_at_least(0), default=0, help="each client process records the streams "
                   "of its first K slots; at the end they are decoded again, alone, and compared (soak_check.py)")
    p.add_argument("--check-atol", type=float_above(0, inclusive=True), default=None, help="the largest difference "
                   "allowed there (default: float32's 1e-5 on CPU, 1e-4 on CUDA; none in bfloat16/float16)")
    p.add_argument("--check-min-snr-db", type=float, default=None, help="the lowest signal-to-difference ratio "
                   "allowed there (default: 20 dB in bfloat16/float16; none in float32)")
    p.add_argument("--sidecar-arg", action="append", default=[], help="extra `serve` argument (repeatable)")
    p.add_argument("--no-failover", action="store_true", help="the clients' pools without failover: the killed "
                   "sidecar's streams end with stream_lost instead of moving to the others")
    p.add_argument("--killed-sidecar-arg", action="append", default=[], help="extra `serve` argument of the sidecar "
                   "--kill-sidecar names only, after the others (repeatable; e.g. a larger --max-streams: the pools "
                   "place streams by capacity, so it carries more of them when it is killed)")
    p.add_argument("--workdir", default=None)
    p.add_argument("--out", type=output_file(), default=None, help="write the report here (JSON)")
    return p
