"""Drive a running sidecar with concurrent synthetic streams and measure what a runner sees."""

from __future__ import annotations

import asyncio
import dataclasses
import random
import statistics
import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from code2wav.client import SidecarClient, SidecarPool
from code2wav.client.errors import Busy, SidecarError

from code2wav.sidecar.gc_pauses import FrozenWhile

from .inputs import InputContract, synthetic_inputs
from .server_metrics import counter_delta, scrape
from .traffic import chunk_sizes

FRAME_S = 0.08  # 12.5 frames per second (Qwen3-TTS); open-loop levels use the served model's frame period
REALTIME_STAGGER_S = 2.0  # open loop: streams start at random within this long
MIN_STREAMS = 16
"""Closed loop, by default: each of the level's ``concurrency`` slots runs streams back to back until the level has
run at least this many (one per slot above 16), so the first-chunk percentiles at low concurrency are not one
sample."""


def realtime_level_s(num_frames: int) -> float:
    """How long an open-loop level lasts at least: the last stream starts within the stagger, then its frames
    arrive at the talker's pace."""
    return REALTIME_STAGGER_S + num_frames * FRAME_S


@dataclass
class LevelResult:
    concurrency: int
    mode: str
    arrival: str
    chunks: int
    errors: int  # streams that ended on an error other than busy
    wall_s: float
    audio_s: float
    chunk_latency_ms: list[float] = field(default_factory=list, repr=False)
    first_chunk_latency_ms: list[float] = field(default_factory=list, repr=False)
    mean_batch_size: float | None = None
    loadgen_cpu_s: float | None = None  # CPU seconds of this (the load generator's) process over the level
    started_s: float = 0.0  # the level's clock (time.perf_counter: one clock for every process of a Linux host)
    graph_hit_rate: float | None = None
    server_ms: dict = field(default_factory=dict)  # mean server-side times from /metrics (a profile)
    error_samples: list[str] = field(default_factory=list)
    refused_streams: int = 0  # the server answered busy (at capacity): refused at this load, not a failure
    streams: int = 0  # streams opened and run (closed loop: slots x rounds)
    ipc_chunks: int = 0  # chunks the clients sent by CUDA IPC (the others went inline)
    refused_samples: list[str] = field(default_factory=list)
    by_sidecar: dict[str, LevelResult] | None = None  # a pool's: the streams of each sidecar (None: one sidecar)

    def part(self, stream) -> LevelResult | None:
        """The per-sidecar result ``stream``'s figures also go to (a pool's level), else None."""
        if self.by_sidecar is None:
            return None
        address = stream.sender.address  # the sidecar that opened it: a stream stays there
        if address not in self.by_sidecar:
            self.by_sidecar[address] = LevelResult(self.concurrency, self.mode, self.arrival, 0, 0, 0.0, 0.0)
        return self.by_sidecar[address]

    def record_error(self, exc: SidecarError) -> None:
        if isinstance(exc, Busy):
            self.refused_streams += 1
            samples = self.refused_samples
        else:
            self.errors += 1
            samples = self.error_samples
        if len(samples) < 5:
            samples.append(f"{type(exc).__name__}: {exc}")

    @property
    def audio_s_per_s(self) -> float:
        return self.audio_s / self.wall_s if self.wall_s > 0 else 0.0


def percentile(values: list[float], q: float) -> float | None:
    if not values:
        return None
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, round(q / 100 * (len(ordered) - 1))))]


async def _open(client: SidecarClient, stream_id: str, mode: str, result: LevelResult, early_audio: bool = False):
    """The stream, or None when the server refused it (busy: counted as refused) or failed (an error)."""
    try:
        extra = {"early_audio": True} if early_audio else {}  # (a pool's open takes no early_audio)
        return await asyncio.wrap_future(client.submit_open_stream(stream_id, mode=mode, **extra))
    except SidecarError as exc:
        result.record_error(exc)
        return None


AUDIO_READY_TIMEOUT_S = 120.0
"""How long the bench waits for CUDA audio to be ready on the GPU before it fails (the client's own timeout)."""


async def _audio_ready(cuda_stream, spin: bool) -> None:
    """Wait until the CUDA audio of the chunk just decoded is ready: a CUDA IPC reply comes before the sidecar's
    step ends, and the audio is ready in the order of ``cuda_stream``, the stream the chunk was submitted on (one
    per concurrency slot of the bench, so one slot's wait never queues behind another's later step). ``spin``: one caller
    spins in its sync, as a runner's one thread does; with many, each waits in a worker thread on a blocking event
    (dozens spinning would take the CPUs the sidecar and the client's I/O thread need; ``transport_bench.py``)."""
    if spin:
        cuda_stream.synchronize()
        return
    done = torch.cuda.Event(blocking=True)
    done.record(cuda_stream)
    try:
        await asyncio.wait_for(asyncio.get_running_loop().run_in_executor(None, done.synchronize),
                               AUDIO_READY_TIMEOUT_S)
    except asyncio.TimeoutError:
        raise RuntimeError(f"CUDA audio not ready on the GPU after {AUDIO_READY_TIMEOUT_S:.0f} s") from None


async def _one_stream(stream, mode: str, codes, sizes: list[int], arrival: str,
                      start_at_s: float, sample_rate_hz: int, result: LevelResult, frame_s: float = FRAME_S,
                      spin: bool = True, cuda_stream=None) -> None:
    """``cuda_stream``: the slot's own CUDA stream when ``codes`` are on the GPU (``_audio_ready``), else None."""
    now = time.perf_counter()
    if start_at_s > now:
        await asyncio.sleep(start_at_s - now)
    t_start = time.perf_counter()
    frames_done = 0
    part = result.part(stream)
    for i, n in enumerate(sizes):
        t0 = time.perf_counter()
        if arrival == "realtime":
            # Open loop: the talker emits a frame every ``frame_s`` (the model's frame period: 80 ms at 12.5 Hz,
            # 40 ms at 25 Hz), so a chunk exists once its last frame does. Latency counts from that moment, also
            # when the previous reply came late (overload shows up).
            t0 = t_start + (frames_done + n) * frame_s
            delay = t0 - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
        try:
            with torch.cuda.stream(cuda_stream):  # (None: no-op) CUDA inputs are copied, and audio ready, on it
                submitted = stream.submit(codes[:, frames_done:frames_done + n], final=(i == len(sizes) - 1))
            wav = await asyncio.wrap_future(submitted)
        except SidecarError as exc:  # busy mid-stream (queue full) counts as refused at this load
            for target in (result, part):
                if target is not None:
                    target.record_error(exc)
            return
        if wav.is_cuda:
            await _audio_ready(cuda_stream, spin)
        latency_ms = (time.perf_counter() - t0) * 1e3
        for target in (result, part):
            if target is not None:
                (target.first_chunk_latency_ms if i == 0 else target.chunk_latency_ms).append(latency_ms)
                target.chunks += 1
                target.audio_s += wav.numel() / sample_rate_hz
        frames_done += n


async def _slot(client: SidecarClient, stream_id: str, stream, rounds: int, mode: str, codes, sizes: list[int],
                arrival: str, start_at_s: float, sample_rate_hz: int, result: LevelResult, frame_s: float,
                spin: bool, cuda_stream=None, early_audio: bool = False) -> None:
    """One concurrency slot: ``stream`` (already open), then ``rounds - 1`` more streams, each opened when the
    previous one ended, all submitted on the slot's ``cuda_stream`` (GPU inputs) as a runner submits on its own."""
    for r in range(rounds):
        if r:
            stream = await _open(client, f"{stream_id}-r{r}", mode, result, early_audio)
            if stream is None:
                return
        result.streams += 1
        if (part := result.part(stream)) is not None:
            part.streams += 1
        await _one_stream(stream, mode, codes, sizes, arrival, start_at_s, sample_rate_hz, result, frame_s, spin,
                          cuda_stream)


@dataclass(frozen=True)
class Level:
    """What a level runs, but for how many streams: the bench's flags (``SidecarPhase``), one value for the bench's
    own levels, its warm-up and every driving process (``drivers.py``)."""
    mode: str
    num_frames: int
    first_chunk_frames: int
    chunk_frames: int
    arrival: str
    min_streams: int  # closed loop: streams the level runs at least, ``ceil(min_streams / accepted)`` per slot
    input_device: torch.device | None  # a CUDA device: the streams' inputs there (CUDA IPC); None: on the host
    early_audio: bool

    def warm_up(self) -> Level:
        """One untimed closed-loop stream per slot, of this level's shape."""
        return dataclasses.replace(self, arrival="closed", min_streams=1)


async def run_level(clients: list[SidecarClient] | list[SidecarPool], level: Level, concurrency: int,
                    metrics_url: str | None, tag: str, before_clock: Callable[[], None] | None = None) -> LevelResult:
    """``concurrency`` streams of ``level``. ``min_streams`` (closed loop): streams the level runs at least,
    ``ceil(min_streams / accepted)`` in turn per slot the server accepted (a refused reopen in a later round counts as
    refused too). ``input_device``: a CUDA device puts every stream's inputs there, as a talker leaves them (the
    client then sends them by CUDA IPC and the audio comes back on that device; latency counts until it is ready
    there); None keeps them on the host (inline bytes both ways). ``early_audio``: streams opened with early audio
    (their CUDA IPC chunks answered at launch). ``before_clock``: called once the streams are open and their inputs
    made, right before the level's clock starts (``drivers.py``: the processes of one level start together)."""
    mode, num_frames, arrival, min_streams = level.mode, level.num_frames, level.arrival, level.min_streams
    input_device, early_audio = level.input_device, level.early_audio
    info = clients[0].models[0]
    sizes = chunk_sizes(num_frames, level.first_chunk_frames, level.chunk_frames)
    result = LevelResult(concurrency=concurrency, mode=mode, arrival=arrival, chunks=0, errors=0, wall_s=0.0,
                         audio_s=0.0, by_sidecar={} if isinstance(clients[0], SidecarPool) else None)
    # every stream of the level is opened first, so the streams the server refuses (busy: no arena slot) are
    # those over its capacity at this load, whatever the timing of the others
    streams = await asyncio.gather(*(_open(clients[i % len(clients)], f"{tag}-{concurrency}-{i}", mode, result,
                                           early_audio) for i in range(concurrency)))
    accepted = sum(stream is not None for stream in streams)
    rounds = 1 if arrival == "realtime" else max(1, -(-min_streams // max(1, accepted)))
    before = scrape(metrics_url)
    ipc_before = sum(c.ipc_stats.get("ipc_chunks", 0) for c in clients)
    rng = random.Random(concurrency)
    frame_s = info.samples_per_frame / info.sample_rate  # the model's frame period
    inputs = [synthetic_inputs(InputContract.of(info), num_frames, seed=i)  # [Q, T] codes or [D, T] latents
              for i in range(len(streams))]
    cuda_streams: list = [None] * len(streams)
    if input_device is not None:
        inputs = [t.to(input_device) for t in inputs]
        # one CUDA stream per slot, used once before the clock starts and then by each of the slot's streams in
        # turn, as a runner submits every request on its own long-lived stream; with a new pool stream per stream
        # (before), a stream's first chunk could also be its CUDA stream's first work (docs/design-notes.md, "One
        # stream with its inputs on the GPU")
        cuda_streams = [torch.cuda.Stream(input_device) for _ in streams]
        for cuda_stream in cuda_streams:
            with torch.cuda.stream(cuda_stream):
                torch.ones(1, device=input_device).add_(1)
        torch.cuda.synchronize(input_device)  # inputs there before any slot's CUDA stream reads them
    if before_clock is not None:  # several driving processes: each waits here until all have opened theirs
        before_clock()
    # this process drives every stream: its heap is frozen for the level (sidecar/gc_pauses.py), so no full garbage
    # collection of it (torch, the clients, thousands of streams) stalls them all at once
    with FrozenWhile():
        t0 = result.started_s = time.perf_counter()
        cpu0_s = time.process_time()
        stagger_s = REALTIME_STAGGER_S if arrival == "realtime" else 0.0
        tasks = []
        for i, stream in enumerate(streams):
            start_at_s = t0 + rng.random() * stagger_s
            if stream is None:
                continue
            tasks.append(_slot(clients[i % len(clients)], f"{tag}-{concurrency}-{i}", stream, rounds, mode,
                               inputs[i], sizes, arrival, start_at_s, info.sample_rate, result, frame_s,
                               spin=accepted == 1, cuda_stream=cuda_streams[i], early_audio=early_audio))
        await asyncio.gather(*tasks)
    result.wall_s = time.perf_counter() - t0
    result.loadgen_cpu_s = time.process_time() - cpu0_s
    for part in (result.by_sidecar or {}).values():
        part.wall_s = result.wall_s  # each sidecar's share of the same interval
    result.ipc_chunks = sum(c.ipc_stats.get("ipc_chunks", 0) for c in clients) - ipc_before
    fill_server_figures(result, before, scrape(metrics_url))
    return result


def fill_server_figures(result: LevelResult, before: dict[str, float] | None,
                        after: dict[str, float] | None) -> None:
    """The server's figures over a level, from its counters scraped before and after it (none without both): the
    mean batch size, the server-side means, the graph hit rate."""
    if before is not None and after is not None:
        count = counter_delta(after, before, "code2wav_sidecar_batch_size_count")
        if count:
            result.mean_batch_size = counter_delta(after, before, "code2wav_sidecar_batch_size_sum") / count
        for name, key in (("chunk_latency_seconds", "server_chunk_latency"), ("engine_step_seconds", "engine_step"),
                          ("batch_wait_seconds", "batch_wait")):
            n = counter_delta(after, before, f"code2wav_sidecar_{name}_count")
            if n:
                result.server_ms[key] = 1e3 * counter_delta(after, before, f"code2wav_sidecar_{name}_sum") / n
        hits = counter_delta(after, before, "code2wav_sidecar_graph_replays_total")
        misses = counter_delta(after, before, "code2wav_sidecar_graph_misses_total")
        if hits + misses:
            result.graph_hit_rate = hits / (hits + misses)


def _round(value: float | None, digits: int) -> float | None:
    return None if value is None else round(value, digits)


def significant(value: float, digits: int = 4) -> float:
    """``value`` to ``digits`` significant digits: a throughput means as much at 0.01 as at 800 audio-s/s."""
    return float(f"{value:.{digits}g}")


def summarize(result: LevelResult) -> dict:
    """One level's row, rounded to what the figures mean: client-seen latencies to 10 us (ms, 2 decimals; the
    wire and the scheduler jitter more than that), server means to 1 us, throughput to 4 significant digits, the mean
    batch size to 0.01, the graph hit rate to 0.001, wall time to 10 ms."""
    lat, first = result.chunk_latency_ms, result.first_chunk_latency_ms

    def ms(q: float, values: list[float]) -> float | None:
        return _round(percentile(values, q), 2)

    return {
        "concurrency": result.concurrency, "mode": result.mode, "arrival": result.arrival,
        "streams": result.streams, "refused_streams": result.refused_streams,
        "refused_samples": result.refused_samples,
        "chunks": result.chunks, "ipc_chunks": result.ipc_chunks, "errors": result.errors,
        "error_samples": result.error_samples,
        "chunk_latency_ms_p50": ms(50, lat), "chunk_latency_ms_p95": ms(95, lat), "chunk_latency_ms_p99": ms(99, lat),
        "first_chunk_latency_ms_p50": ms(50, first), "first_chunk_latency_ms_p99": ms(99, first),
        "audio_s_per_s": significant(result.audio_s_per_s), "realtime_streams": int(result.audio_s_per_s),
        "mean_batch_size": _round(result.mean_batch_size, 2), "graph_hit_rate": _round(result.graph_hit_rate, 3),
        "server_mean_ms": {k: round(v, 3) for k, v in result.server_ms.items()},
        "wall_s": round(result.wall_s, 2),
        # the load generator's own CPU (every thread of this process) per second of the level: near or over 1, its
        # asyncio thread and the clients' I/O threads (one GIL) may be what the latencies measure
        "loadgen_cpu_s_per_s": (_round(result.loadgen_cpu_s / result.wall_s, 2)
                                if result.loadgen_cpu_s is not None and result.wall_s > 0 else None),
        "mean_chunk_latency_ms": _round(statistics.fmean(lat), 2) if lat else None,
        **({"sidecars": {address: _sidecar_row(part) for address, part in sorted(result.by_sidecar.items())}}
           if result.by_sidecar is not None else {}),
    }


def _sidecar_row(part: LevelResult) -> dict:
    """One sidecar's figures within a pool's level (the streams placed there)."""
    row = summarize(part)
    keep = ("streams", "chunks", "errors", "refused_streams", "chunk_latency_ms_p50", "chunk_latency_ms_p99",
            "first_chunk_latency_ms_p50", "audio_s_per_s")
    return {key: row[key] for key in keep}
