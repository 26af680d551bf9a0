"""Named bench scenarios: the flag sets behind the figures the docs quote, as data.

``code2wav-sidecar bench --scenario NAME[,NAME]`` runs each named scenario's runs in turn; a run is one bench
invocation with the scenario's flags, then the flags given on the command line (argparse keeps the last value, so
an explicit flag overrides the scenario's; ``--serve-arg`` adds to it). A scenario of several runs (one stream
inline and over CUDA IPC; VoxCPM2 in both dtypes) names each run, and with more than one run in an invocation each
run's ``--json``, ``--plot`` and ``--sidecar-log`` get ``-NAME`` before their suffix
(``bench.json`` -> ``bench-one-stream-ipc.json``). The report's settings record the run's name (``scenario``).

The figures are those of an H200 with the default model (Qwen3-TTS 12 Hz decoder architecture, random weights) in
bfloat16 unless a scenario says otherwise; ``--device cpu --dtype float32`` and small ``--baseline-iters`` or
``--frames`` make any of them a quick check on a CPU.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import PurePath
from types import MappingProxyType

QWEN3_BF16 = ("--model", "default", "--device", "cuda", "--dtype", "bfloat16")
VOXCPM2 = ("--model", "voxcpm2-default", "--device", "cuda")
PATCHES = ("--first-chunk-frames", "4", "--chunk-frames", "4")  # VoxCPM2's LM emits 4-frame patches


@dataclass(frozen=True)
class Scenario:
    summary: str
    runs: tuple[tuple[str, tuple[str, ...]], ...]  # (run name, bench flags); one run: its name is ""


SCENARIOS: MappingProxyType[str, Scenario] = MappingProxyType({
    "inprocess": Scenario(
        "the exact graph steps in-process at b1 x 1, b1 x 25, b16 x 25, b64 x 25 (and b16/b64 x 1), no sidecar, "
        "no stock baseline",
        (("", (*QWEN3_BF16, "--no-sidecar", "--baseline", "none", "--baseline-iters", "30",
               "--baseline-batch", "1,16,64", "--baseline-frames", "1,25")),)),
    "stock": Scenario(
        "vLLM-Omni 0.30's own Code2Wav in-process (batch 1 and 4) beside the sidecar's steps at batch 1, "
        "no sidecar (needs vllm-omni 0.30)",
        (("", (*QWEN3_BF16, "--no-sidecar", "--baseline", "vllm-omni-stock", "--baseline-iters", "50",
               "--baseline-batch", "1", "--baseline-frames", "1,25", "--stock-batch", "1,4")),)),
    "sidecar": Scenario(
        "a spawned sidecar at 1, 64 and 256 streams, closed loop, 301-frame streams, no in-process baselines",
        (("", (*QWEN3_BF16, "--concurrency", "1,64,256", "--frames", "301", "--no-baselines")),)),
    "realtime": Scenario(
        "open-loop real-time streams (a 25-frame chunk every 2 s per stream) at 2304 and 2816 streams",
        (("", (*QWEN3_BF16, "--arrival", "realtime", "--concurrency", "2304,2816", "--frames", "101",
               "--no-baselines")),)),
    "one-stream": Scenario(
        "one stream through a spawned sidecar, codes inline (host) and over CUDA IPC (device)",
        (("inline", (*QWEN3_BF16, "--concurrency", "1", "--frames", "101", "--no-baselines", "--inputs-on", "host")),
         ("ipc", (*QWEN3_BF16, "--concurrency", "1", "--frames", "101", "--no-baselines", "--inputs-on",
                  "device")))),
    "full": Scenario(
        "everything in one run, as the README's table: the in-process steps, vLLM-Omni stock, the sidecar at 1, 64 "
        "and 256 streams, and the profile of an eager b16 step",
        (("", (*QWEN3_BF16, "--concurrency", "1,64,256", "--frames", "301", "--baseline-iters", "50",
               "--baseline-batch", "1,16,64", "--stock-batch", "1,4", "--profile-batch", "16")),)),
    "transport": Scenario(
        "the per-chunk cost of the wire: inline bytes and CUDA IPC against the same decode in-process",
        (("", (*QWEN3_BF16, "--transport", "--concurrency", "1,1,64", "--transport-chunks", "1000")),)),
    "stages": Scenario(
        "where one chunk's time goes at concurrency 1, stage by stage (client, wire, sidecar decode, wait, launch, "
        "device, reply, wire, client), inputs on the host and on the GPU (armed, and codes events), and the hand-off "
        "on the GPU's clock, armed against codes events (bench --stages)",
        (("", (*QWEN3_BF16, "--stages", "--stages-chunks", "500")),)),
    "voxcpm2": Scenario(
        "VoxCPM2's AudioVAE: its exact graph steps at 1/64 x 4/25 frames beside upstream's own module, in-process, "
        "float32 and bfloat16",
        tuple((dtype, (*VOXCPM2, "--dtype", dtype, "--no-sidecar", "--baseline-iters", "20", "--baseline-batch",
                       "1,64", "--baseline-frames", "4,25", "--chunk-frames", "4"))
              for dtype in ("float32", "bfloat16"))),
    "voxcpm2-one-stream": Scenario(
        "VoxCPM2, float32: one stream of 4-frame patches through a spawned sidecar, latents inline and over CUDA "
        "IPC",
        tuple((name, (*VOXCPM2, "--dtype", "float32", "--concurrency", "1", "--frames", "101", *PATCHES,
                      "--no-baselines", "--inputs-on", where))
              for name, where in (("inline", "host"), ("ipc", "device")))),
    "voxcpm2-realtime": Scenario(
        "VoxCPM2, float32: open-loop real-time streams (a 4-frame patch every 160 ms) at 256, 512 and 1024 streams",
        (("", (*VOXCPM2, "--dtype", "float32", "--arrival", "realtime", "--concurrency", "256,512,1024",
               "--frames", "101", *PATCHES, "--no-baselines")),)),
})  # read-only: the table is data

OUTPUT_FLAGS = ("--json", "--plot", "--sidecar-log")


@dataclass(frozen=True)
class Run:
    label: str  # the scenario's name, with the run's: "one-stream-ipc"
    argv: tuple[str, ...]  # the scenario's flags, then the explicit ones


def names_of(text: str) -> list[str]:
    """``"inprocess,sidecar"`` -> the names, each checked (a clear error naming the known ones otherwise)."""
    names = [n.strip() for n in text.split(",") if n.strip()]
    unknown = [n for n in names if n not in SCENARIOS]
    if unknown or not names:
        raise ValueError(f"--scenario {text!r}: unknown {unknown or 'empty'}; known: {', '.join(SCENARIOS)}")
    return names


def split_scenario(argv: list[str]) -> tuple[str | None, list[str]]:
    """``(the --scenario value, the other arguments)``; ``--scenario X`` and ``--scenario=X`` (the last wins)."""
    value, rest, i = None, [], 0
    while i < len(argv):
        arg = argv[i]
        if arg == "--scenario":
            if i + 1 >= len(argv):
                raise ValueError("--scenario needs a value: a name, or names separated by commas")
            value, i = argv[i + 1], i + 2
            continue
        if arg.startswith("--scenario="):
            value = arg.split("=", 1)[1]
        else:
            rest.append(arg)
        i += 1
    return value, rest


def expand(text: str, explicit: list[str]) -> list[Run]:
    """Every run of the scenarios named in ``text``, in order, with the ``explicit`` flags after the scenario's
    (so they override it); with more than one run, each output flag's path gets the run's label."""
    runs = [Run(name + (f"-{run}" if run else ""), (*flags, *explicit))
            for name in names_of(text) for run, flags in SCENARIOS[name].runs]
    if len(runs) == 1:
        return runs
    return [Run(r.label, tuple(labelled_outputs(list(r.argv), r.label))) for r in runs]


def labelled_outputs(argv: list[str], label: str) -> list[str]:
    """``argv`` with every ``--json``/``--plot``/``--sidecar-log`` path given ``-label`` before its suffix."""
    out, i = [], 0
    while i < len(argv):
        arg = argv[i]
        flag, eq, value = arg.partition("=")
        if flag in OUTPUT_FLAGS and eq:
            out.append(f"{flag}={with_label(value, label)}")
        elif arg in OUTPUT_FLAGS and i + 1 < len(argv):
            out += [arg, with_label(argv[i + 1], label)]
            i += 1
        else:
            out.append(arg)
        i += 1
    return out


def with_label(path: str, label: str) -> str:
    p = PurePath(path)
    return str(p.with_name(f"{p.stem}-{label}{p.suffix}"))


def help_text() -> str:
    """The scenarios as ``bench --help`` lists them: name, what it measures, its flags."""
    lines = ["scenarios (--scenario NAME[,NAME]; flags given on the command line override a scenario's):"]
    for name, scenario in SCENARIOS.items():
        lines.append(f"  {name}: {scenario.summary}")
        for run, flags in scenario.runs:
            lines.append(f"      {run + ': ' if run else ''}{' '.join(flags)}")
    return "\n".join(lines)
