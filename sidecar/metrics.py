"""Prometheus metrics (one registry per server, passed around; no module globals) and the HTTP endpoint.

Names are prefixed ``code2wav_sidecar_``. Labels are bounded sets (model, mode, code, component, bucket);
never request or stream ids.

Every labelled series that the shipped Grafana dashboard and alert rules query exists from the first scrape with
value 0 (``Metrics.start_series``, called once the model is loaded), on a CPU server too: a ``rate()`` panel of
a counter that has never moved shows 0 instead of nothing, and an ``absent()`` alert does not fire on a healthy
server. The label values below are the bounded sets the server uses (tests/test_metrics_first_scrape.py scrapes
a fresh server for each of them). From the first scrape too: ``code2wav_sidecar_build_info`` (value 1; what runs:
package version, torch, CUDA, GPU, model, dtype) and the process metrics (``process_*``: CPU seconds, resident
memory, open file descriptors, start time; Linux) and ``python_info``.
"""

from __future__ import annotations

import asyncio
import http
import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    PlatformCollector,
    ProcessCollector,
    generate_latest,
)

from code2wav import __version__
from code2wav.proto import REGION_ACCESS, STREAM_MODES, ErrorCode

log = logging.getLogger(__name__)

LATENCY_BUCKETS_S = (0.0005, 0.001, 0.002, 0.004, 0.006, 0.008, 0.012, 0.016, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0,
                     2.5, 5.0)
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)
GC_PAUSE_BUCKETS_S = (0.0001, 0.0005, 0.001, 0.002, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25)

STREAM_CLOSE_REASONS = ("final", "finish", "abort", "bye", "rehandshake", "ttl")
"""Why a stream closed (sessions.py): its final chunk, finish(), abort(), its client's bye or re-handshake, TTL."""
GRAPH_MISS_REASONS = ("no_buckets", "batch_too_large", "frames_too_long", "not_captured", "capture_deferred")
"""Why a batch ran eager although graphs are on (graphs/plan.py ``dispatch``, engine.py ``_try_graph``)."""
IPC_DIRECTIONS = ("codes_in", "audio_out")
IPC_REGISTER_FAILURE_REASONS = ("unsupported", "different_gpu", "open_failed")
"""Why a CUDA IPC region registration was refused (ipc/regions.py)."""
BUILD_INFO_LABELS = ("version", "torch", "cuda", "gpu", "model", "dtype")
UNKNOWN = "unknown"
"""A build_info label whose value the caller did not give (``start_series`` without ``dtype``/``device``)."""


def gpu_name(device: str) -> str:
    """The GPU a server on ``device`` (``cpu``, ``cuda``, ``cuda:N``) runs on: the device's name, ``none`` on CPU."""
    if device == UNKNOWN:
        return UNKNOWN
    parsed = torch.device(device)
    if parsed.type != "cuda":
        return "none"
    return torch.cuda.get_device_name(parsed)


@dataclass(frozen=True)
class ModeSeries:
    """One (model, mode)'s labelled children, looked up once: ``.labels()`` costs a few microseconds per call
    (a lock, a key tuple, a dict), and a chunk at concurrency 1 made nine such calls on its way."""

    chunks: Any
    frames: Any
    audio_seconds: Any
    chunk_latency: Any
    step_seconds: Any
    batch_size: Any


class Metrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        p = "code2wav_sidecar_"
        ProcessCollector(registry=r)  # process_*: reads /proc, so Linux only (elsewhere it exports nothing)
        PlatformCollector(registry=r)  # python_info
        self.build_info = Gauge(p + "build_info", "1, labelled with what runs: package version, torch, CUDA "
                                "(none: a CPU build of torch), GPU (none: served on CPU), model, dtype",
                                list(BUILD_INFO_LABELS), registry=r)
        self.auth_refused = Counter(p + "auth_refused", "Clients refused: a CURVE key not in the allow-list "
                                    "(unknown_key) or a session owned by another client (session_owner)",
                                    ["reason"], registry=r)
        self.shutdown_unsent = Counter(p + "shutdown_replies_unsent", "Replies handed to the socket after the stop "
                                       "signal that may not have been sent: the socket still held queued replies "
                                       "when shutdown_timeout_s ran out (at most this many were dropped)", registry=r)
        self.steps_overlapped = Counter(p + "steps_overlapped", "Steps launched while another step was still in "
                                        "flight on the device (scheduler.max_steps_in_flight 2)", registry=r)
        self.chunks_not_finite = Counter(p + "chunks_not_finite", "Chunks whose audio or new decoder state came out "
                                         "non-finite (NaN/inf): answered internal, not committed", registry=r)
        self.chunks_answered_early = Counter(p + "chunks_answered_early", "CUDA IPC chunks of early-audio streams "
                                             "whose reply left at their step's launch, before its outcome was read",
                                             registry=r)
        self.chunks_refused_after_early_audio = Counter(
            p + "chunks_refused_after_early_audio", "Early-answered chunks that their step then refused (their slot "
            "zeroed, their stream back to their seq; told with the next chunk's failed_seq)", registry=r)
        self.chunks = Counter(p + "chunks", "Chunks decoded successfully", ["model", "mode"], registry=r)
        self.frames = Counter(p + "frames", "Codec frames decoded (context frames included)", ["model", "mode"],
                              registry=r)
        self.audio_seconds = Counter(p + "audio_seconds", "Seconds of audio returned", ["model", "mode"], registry=r)
        self.chunk_latency = Histogram(p + "chunk_latency_seconds", "Chunk arrival to reply", ["mode"],
                                       buckets=LATENCY_BUCKETS_S, registry=r)
        self.errors = Counter(p + "errors", "Errors returned to clients, by code", ["code"], registry=r)
        self.active_streams = Gauge(p + "active_streams", "Streams open now", registry=r)
        self.streams_opened = Counter(p + "streams_opened", "Streams opened", ["mode"], registry=r)
        self.streams_closed = Counter(p + "streams_closed", "Streams closed, by reason", ["reason"], registry=r)
        self.clients = Gauge(p + "connected_clients", "Clients that completed the handshake", registry=r)
        self.queue_depth = Gauge(p + "queue_depth", "Chunks waiting for the engine", registry=r)
        self.batch_size = Histogram(p + "batch_size", "Chunks per engine forward", ["mode"], buckets=BATCH_BUCKETS,
                                    registry=r)
        self.batch_wait = Histogram(p + "batch_wait_seconds", "Time a chunk waited for its batch",
                                    buckets=LATENCY_BUCKETS_S, registry=r)
        self.step_seconds = Histogram(p + "engine_step_seconds", "Engine forward time per batch", ["mode"],
                                      buckets=LATENCY_BUCKETS_S, registry=r)
        self.state_bytes_per_stream = Gauge(p + "state_bytes_per_stream", "Decoder state bytes per stream",
                                            ["model"], registry=r)
        self.arena_slots = Gauge(p + "arena_slots", "State arena slots", ["model", "kind"], registry=r)
        self.ready = Gauge(p + "ready", "1 once the model is loaded and the socket bound", registry=r)
        self.gc_pause_seconds = Histogram(p + "gc_pause_seconds", "Python garbage collections of the sidecar process "
                                          "and how long each stopped it, by generation (2: a full one)",
                                          ["generation"], buckets=GC_PAUSE_BUCKETS_S, registry=r)
        # every series from the first scrape, looked up once: ``observe_gc_pause`` runs inside collections
        self._gc_pauses = [self.gc_pause_seconds.labels(str(generation)) for generation in range(3)]
        self.gc_frozen_objects = Gauge(p + "gc_frozen_objects", "Objects frozen out of the collector once the "
                                       "server was ready (gc.freeze): no collection walks them", registry=r)
        graph = ["component", "bucket"]
        self.graph_replays = Counter(p + "graph_replays", "CUDA graph replays", graph, registry=r)
        self.graph_misses = Counter(p + "graph_misses", "Batches that ran eager, by reason", ["component", "reason"],
                                    registry=r)
        self.graph_captures = Counter(p + "graph_captures", "CUDA graphs captured", graph, registry=r)
        self.graph_capture_failures = Counter(p + "graph_capture_failures", "Captures that failed (bucket eager)",
                                              graph, registry=r)
        self.graph_capture_seconds = Gauge(p + "graph_capture_seconds", "Capture time per bucket", graph, registry=r)
        self.graph_bytes = Gauge(p + "graph_bytes", "Graph pool bytes added by each bucket", graph, registry=r)
        self.graph_pool_bytes = Gauge(p + "graph_pool_bytes", "Bytes held by the shared graph pool", registry=r)
        self.ipc_regions = Gauge(p + "ipc_regions", "Client CUDA IPC regions open now", ["access"], registry=r)
        self.ipc_register_failures = Counter(p + "ipc_register_failures", "Region registrations refused, by reason",
                                             ["reason"], registry=r)
        self.ipc_chunks = Counter(p + "ipc_chunks", "Chunks whose codes or audio used a CUDA IPC region",
                                  ["direction"], registry=r)
        self.ipc_codes_deferred = Counter(p + "ipc_codes_deferred", "CUDA IPC chunks put back in the queue because "
                                          "their codes event was not complete when their batch formed", registry=r)
        self.ipc_armed_chunks = Counter(p + "ipc_armed_chunks", "Armed CUDA IPC chunks (codes_token) taken into a "
                                        "step: it waited on the GPU for their codes' doorbell", registry=r)
        self.ipc_armed_released = Counter(p + "ipc_armed_released", "Armed chunks refused not ready: their doorbell "
                                          "word was not rung when the sidecar released the step's waits "
                                          "(armed_wait_s); deadline_exceeded, their region disarmed", registry=r)
        self.input_pickups = Counter(p + "input_pickups", "Times the loop found input waiting: polled = taken by "
                                     "busy polling (busy_poll_us), woken = after sleeping", ["how"], registry=r)
        for how in ("polled", "woken"):
            self.input_pickups.labels(how=how)
        self.ipc_codes_in = self.ipc_chunks.labels(direction="codes_in")
        self.ipc_audio_out = self.ipc_chunks.labels(direction="audio_out")
        self._mode_series: dict[tuple[str, str], ModeSeries] = {}

    def observe_gc_pause(self, generation: int, seconds: float) -> None:
        """One garbage collection of the process (``gc_pauses.GcPauses``' observer). It runs inside the collection,
        which may have started in a scrape holding the histogram's own lock: so no ``labels`` here (that lock is not
        reentrant), only the series looked up at start."""
        self._gc_pauses[generation].observe(seconds)

    def mode_series(self, model: str, mode: str) -> ModeSeries:
        """``(model, mode)``'s per-chunk and per-step children (made on first use, then reused)."""
        series = self._mode_series.get((model, mode))
        if series is None:
            series = ModeSeries(self.chunks.labels(model=model, mode=mode), self.frames.labels(model=model, mode=mode),
                                self.audio_seconds.labels(model=model, mode=mode), self.chunk_latency.labels(mode=mode),
                                self.step_seconds.labels(mode=mode), self.batch_size.labels(mode=mode))
            self._mode_series[(model, mode)] = series
        return series

    def start_series(self, model: str, graph_buckets: tuple[tuple[str, str], ...] = (), *, dtype: str = UNKNOWN,
                     device: str = UNKNOWN) -> None:
        """Create every labelled series the dashboard and the alerts query, at 0: per-mode counters and
        histograms of ``model``, errors for every protocol code, stream closes by reason, the CUDA IPC series and,
        for each configured ``(component, bucket)`` graph bucket, its replays and captures (graph misses per
        component and reason); and ``build_info`` for ``model`` served in ``dtype`` (e.g. ``float32``) on
        ``device`` (e.g. ``cuda:0``). A child created here is the one later ``.labels(...)`` calls return."""
        self.set_build_info(model, dtype, device)
        for mode in STREAM_MODES:
            for counter in (self.chunks, self.frames, self.audio_seconds):
                counter.labels(model=model, mode=mode)
            for per_mode in (self.chunk_latency, self.batch_size, self.step_seconds, self.streams_opened):
                per_mode.labels(mode=mode)
            for reason in GRAPH_MISS_REASONS:
                self.graph_misses.labels(component=mode, reason=reason)
        for code in ErrorCode:
            self.errors.labels(code=code.value)
        for reason in STREAM_CLOSE_REASONS:
            self.streams_closed.labels(reason=reason)
        for access in REGION_ACCESS:
            self.ipc_regions.labels(access=access)
        for direction in IPC_DIRECTIONS:
            self.ipc_chunks.labels(direction=direction)
        for reason in IPC_REGISTER_FAILURE_REASONS:
            self.ipc_register_failures.labels(reason=reason)
        for component, bucket in graph_buckets:
            for per_bucket in (self.graph_replays, self.graph_captures, self.graph_capture_failures,
                               self.graph_capture_seconds, self.graph_bytes):
                per_bucket.labels(component=component, bucket=bucket)

    def set_build_info(self, model: str, dtype: str = UNKNOWN, device: str = UNKNOWN) -> None:
        """``build_info`` = 1 with this process's labels (one series: a previous one is removed)."""
        self.build_info.clear()
        self.build_info.labels(version=__version__, torch=torch.__version__, cuda=torch.version.cuda or "none",
                               gpu=gpu_name(device), model=model, dtype=dtype).set(1)

    def exposition(self) -> bytes:
        return generate_latest(self.registry)


class HealthServer:
    """Minimal HTTP/1.1 server for ``/metrics``, ``/healthz`` and ``/readyz`` on the event loop, and JSON ``routes``
    (path -> the maker of its ``(HTTP status, body)``; e.g. ``/debug/chunk-stages`` with ``trace_chunks`` on). Every
    handler runs on the loop thread."""

    def __init__(self, metrics: Metrics, is_ready: Callable[[], bool],
                 routes: dict[str, Callable[[], tuple[int, bytes]]] | None = None) -> None:
        self.metrics = metrics
        self.is_ready = is_ready
        self.routes = dict(routes or {})
        self._server: asyncio.base_events.Server | None = None
        self.port = 0

    async def start(self, host: str, port: int) -> int:
        self._server = await asyncio.start_server(self._handle, host, port)
        self.port = self._server.sockets[0].getsockname()[1]
        return self.port

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            await self._server.wait_closed()

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            request_line = await asyncio.wait_for(reader.readline(), timeout=5)
            while (await asyncio.wait_for(reader.readline(), timeout=5)) not in (b"\r\n", b"\n", b""):
                pass  # headers are not needed
            parts = request_line.decode("latin-1").split()
            path = parts[1].split("?", 1)[0] if len(parts) >= 2 else ""
            if path == "/metrics":
                status, ctype, body = "200 OK", CONTENT_TYPE_LATEST, self.metrics.exposition()
            elif path == "/healthz":
                status, ctype, body = "200 OK", "text/plain", b"ok\n"
            elif path == "/readyz":
                ready = self.is_ready()
                status = "200 OK" if ready else "503 Service Unavailable"
                ctype, body = "text/plain", b"ready\n" if ready else b"not ready\n"
            elif path in self.routes:
                code, body = self.routes[path]()
                status, ctype = f"{code} {http.HTTPStatus(code).phrase}", "application/json"
            else:
                status, ctype, body = "404 Not Found", "text/plain", b"not found\n"
            head = f"HTTP/1.1 {status}\r\nContent-Type: {ctype}\r\nContent-Length: {len(body)}\r\nConnection: close\r\n\r\n"
            writer.write(head.encode("latin-1") + body)
            await writer.drain()
        except (asyncio.TimeoutError, ConnectionError):
            pass
        finally:
            writer.close()
