"""The per-stage table of ``bench --stages``: one chunk's stamps from the caller, the client library and the sidecar
joined by ``(stream_id, seq)``, cut into consecutive stages, and summarized (p50 / p90 / mean in microseconds, each
stage's share of the round trip).

Every stamp is ``time.monotonic_ns()`` of one host (CLOCK_MONOTONIC is one clock for every process of a Linux host),
so stamps of the two processes subtract directly. The stages are consecutive, from the caller's ``decode()`` call to
its return (or, for inputs on the GPU, to the audio being ready on the caller's CUDA stream), so per chunk they add
up to its round trip exactly, and their means add up to the mean round trip (the shares add up to 100 %; the p50s
need not add up to the round trip's p50).
"""

from __future__ import annotations

from dataclasses import dataclass

from .drive import percentile

STAMPS = ("called_ns", "client_sent_ns", "received_ns", "queued_ns", "taken_ns", "launched_ns", "done_ns",
          "sent_ns", "client_received_ns", "returned_ns", "ready_ns")
"""A joined chunk's stamps in order: the caller's (called, returned, ready), the client library's (client_sent,
client_received: ``client.call_trace``), the sidecar's (the rest: ``sidecar/chunk_trace.py``)."""


@dataclass(frozen=True)
class Stage:
    """The span between two consecutive ``STAMPS``: ``STAGES[i]`` runs from ``STAMPS[i]`` to ``STAMPS[i + 1]``."""

    name: str
    meaning: str


STAGES = (
    Stage("client_send", "decode() called -> the message going into the client's socket (inputs checked, seq "
          "reserved, CUDA IPC copy queued or bytes packed, encoded)"),
    Stage("wire_in", "libzmq both ways, the socket, the sidecar's loop waking or polling -> the loop took the "
          "message off its socket"),
    Stage("sidecar_decode", "the message parsed and checked, the chunk's inputs read, the chunk in the scheduler's "
          "queue"),
    Stage("wait", "queued -> taken into a batch by the stepper"),
    Stage("launch", "the step planned, its items built, inputs copied in, the graph replayed or the eager forward "
          "issued (on the CPU: computed)"),
    Stage("device", "launched -> the step's audio on the host (CUDA IPC audio: its copy into the client's region "
          "queued; early audio: queued right after the launch, the step still running)"),
    Stage("reply", "the chunk committed, its reply assembled and encoded, going into the sidecar's socket"),
    Stage("wire_out", "libzmq both ways -> the client's I/O thread took the reply off its socket"),
    Stage("client_deliver", "the reply parsed and checked, the audio tensor made, the caller's future set -> "
          "decode() returned"),
    Stage("audio_ready", "inputs on the GPU: the caller's sync on its CUDA stream until the audio is ready there (0 "
          "for host inputs; early audio: the step's device time is here)"),
)
assert len(STAGES) == len(STAMPS) - 1  # one stage between each two consecutive stamps


def join(calls: list[dict], client_chunks: dict, sidecar_chunks: list[dict]) -> tuple[list[dict], int]:
    """The chunks stamped by all three, in the order of ``calls`` (the caller's: stream_id, seq, called_ns,
    returned_ns, ready_ns); ``client_chunks``: ``(stream_id, seq) -> (sent_ns, received_ns)``
    (``CallTrace.chunks``); ``sidecar_chunks``: the records of ``/debug/chunk-stages``. Returns the joined chunks
    and how many calls found no match on one side."""
    sidecar = {(r["stream_id"], r["seq"]): r for r in sidecar_chunks}
    joined, missing = [], 0
    for call in calls:
        key = (call["stream_id"], call["seq"])
        if key not in client_chunks or key not in sidecar:
            missing += 1
            continue
        sent_ns, received_ns = client_chunks[key]
        joined.append({**{name: sidecar[key][name] for name in STAMPS if name in sidecar[key]}, **call,
                       "client_sent_ns": sent_ns, "client_received_ns": received_ns})
    return joined, missing


def stage_us(chunk: dict) -> dict[str, float]:
    """One joined chunk's stages in microseconds, and its ``round_trip``."""
    out = {stage.name: (chunk[end] - chunk[start]) / 1e3 for stage, start, end in zip(STAGES, STAMPS, STAMPS[1:])}
    out["round_trip"] = (chunk[STAMPS[-1]] - chunk[STAMPS[0]]) / 1e3
    return out


def summarize(chunks: list[dict]) -> dict:
    """The table of ``chunks`` (joined): per stage p50 / p90 / mean in us (to 0.1 us) and share of the mean round
    trip (to 0.1 %), and the round trip's."""
    per_chunk = [stage_us(chunk) for chunk in chunks]

    def figures(name: str) -> dict:
        values = [row[name] for row in per_chunk]
        mean = sum(values) / len(values)
        return {"p50_us": round(percentile(values, 50), 1), "p90_us": round(percentile(values, 90), 1),
                "mean_us": round(mean, 1), "_mean": mean}

    round_trip = figures("round_trip")
    stages = []
    for stage in STAGES:
        row = figures(stage.name)
        share = row.pop("_mean") / round_trip["_mean"] if round_trip["_mean"] > 0 else 0.0
        stages.append({"stage": stage.name, **row, "share_pct": round(100 * share, 1), "meaning": stage.meaning})
    round_trip.pop("_mean")
    return {"chunks": len(chunks), "stages": stages, "round_trip": round_trip}


def format_table(title: str, table: dict) -> str:
    """The table as ``bench --stages`` prints it."""
    lines = [f"{title}: {table['chunks']} chunks",
             f"{'stage':<15} {'p50_us':>9} {'p90_us':>9} {'mean_us':>9} {'share':>6}"]
    for row in table["stages"]:
        lines.append(f"{row['stage']:<15} {row['p50_us']:>9.1f} {row['p90_us']:>9.1f} {row['mean_us']:>9.1f} "
                     f"{row['share_pct']:>5.1f}%")
    rt = table["round_trip"]
    lines.append(f"{'round_trip':<15} {rt['p50_us']:>9.1f} {rt['p90_us']:>9.1f} {rt['mean_us']:>9.1f} {100.0:>5.1f}%")
    return "\n".join(lines)


def legend() -> str:
    """What each stage spans (printed once under the tables)."""
    return "\n".join(["stages (share: of the mean round trip; the stages' means add up to it):",
                      *(f"  {stage.name}: {stage.meaning}" for stage in STAGES),
                      "  round_trip: decode() called -> returned (inputs on the GPU: -> audio ready)"])
