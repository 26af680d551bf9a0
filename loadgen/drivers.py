"""A level's streams driven from several processes (``bench --drivers N``), so the load generator is not what a level
measures.

One bench process drives every stream with one asyncio thread and its clients' I/O threads, all under one GIL: at
thousands of real-time streams its own CPU (the ``loadgen_cpu_s_per_s`` of a level's row) reaches a core, and chunks
then wait in the bench, not in the sidecar. ``Drivers`` starts ``N`` processes (``spawn``), each with its own clients
to the same sidecar, warmed up like the bench's own; a level gives each its share of the streams (``shares``), each
opens them and says so, all start their clocks when every one has (``perf_counter``: one clock for the host's
processes), and the parent merges their figures (``merge``) and reads the server's around the whole level.

Only our own processes talk over these pipes (the level's parameters in, a result's plain fields out).
"""

from __future__ import annotations

import asyncio
import dataclasses
import multiprocessing

from .drive import Level, LevelResult, fill_server_figures, run_level
from .server_metrics import scrape

READY_TIMEOUT_S = 300.0
"""How long a driver may take to connect and warm up (its first chunk may wait for the sidecar's own start)."""


def shares(concurrency: int, count: int) -> list[int]:
    """``concurrency`` streams over ``count`` drivers, as even as they go (the first ones take the remainder); a
    driver with no stream sits the level out. Pure."""
    return [concurrency // count + (i < concurrency % count) for i in range(count)]


def merge(concurrency: int, parts: list[LevelResult]) -> LevelResult:
    """One level's figures from its drivers': counts and audio summed, latencies joined, the wall time from the
    first clock's start to the last one's end (one clock for every process), the busiest driver's CPU (the one that
    would saturate first), the first error and refusal samples."""
    first = parts[0]
    started_s = min(p.started_s for p in parts)
    ended_s = max(p.started_s + p.wall_s for p in parts)
    merged = LevelResult(concurrency, first.mode, first.arrival, sum(p.chunks for p in parts),
                         sum(p.errors for p in parts), ended_s - started_s, sum(p.audio_s for p in parts),
                         started_s=started_s)
    for p in parts:
        merged.chunk_latency_ms += p.chunk_latency_ms
        merged.first_chunk_latency_ms += p.first_chunk_latency_ms
        merged.refused_streams += p.refused_streams
        merged.streams += p.streams
        merged.ipc_chunks += p.ipc_chunks
        merged.error_samples = (merged.error_samples + p.error_samples)[:5]
        merged.refused_samples = (merged.refused_samples + p.refused_samples)[:5]
    cpu = [p.loadgen_cpu_s for p in parts if p.loadgen_cpu_s is not None]
    merged.loadgen_cpu_s = max(cpu) if cpu else None
    return merged


def _driver_main(conn, index: int, address: str, num_clients: int, server_key: str | None, warm_up: Level) -> None:
    """A driver process: its clients, one warm-up stream each, then one level per message until ``None``."""
    from code2wav.client import SidecarClient

    clients = [SidecarClient(address, timeout_s=120, curve_server_key=server_key) for _ in range(num_clients)]
    runner = asyncio.Runner()
    try:
        runner.run(run_level(clients, warm_up, len(clients), None, tag=f"warmup-d{index}"))
        conn.send("ready")
        while (order := conn.recv()) is not None:
            level, concurrency = order

            def opened() -> None:  # every driver's streams open before any clock starts
                conn.send("opened")
                if conn.recv() != "go":
                    raise RuntimeError("the bench stopped the level")

            try:
                result = runner.run(run_level(clients, level, concurrency, None, tag=f"bench-d{index}",
                                              before_clock=opened))
            except Exception as exc:  # noqa: BLE001 - told to the parent, which fails the level with it
                conn.send(("failed", f"{type(exc).__name__}: {exc}"))
                continue
            conn.send(dataclasses.asdict(result))
    finally:
        runner.close()
        for client in clients:
            client.close()
        conn.close()


class Drivers:
    """``count`` driving processes for one sidecar at ``address``, each with ``num_clients`` connections."""

    def __init__(self, count: int, address: str, num_clients: int, server_key: str | None, warm_up: Level) -> None:
        ctx = multiprocessing.get_context("spawn")  # no fork of a process with threads and a CUDA context
        self._conns, self._procs = [], []
        self._in_level = False  # a level was sent and not all of it came back
        try:
            for index in range(count):
                parent, child = ctx.Pipe()
                proc = ctx.Process(target=_driver_main, args=(child, index, address, num_clients, server_key, warm_up),
                                   name=f"bench-driver-{index}", daemon=True)
                proc.start()
                child.close()
                self._conns.append(parent)
                self._procs.append(proc)
            for index, conn in enumerate(self._conns):
                if not conn.poll(READY_TIMEOUT_S) or conn.recv() != "ready":
                    raise RuntimeError(f"bench driver {index} did not warm up within {READY_TIMEOUT_S:g} s (its "
                                       "output above says why)")
        except BaseException:
            self.close()
            raise

    def run_level(self, level: Level, concurrency: int, metrics_url: str | None) -> LevelResult:
        """The level over every driver at once: each opens its streams, then all start their clocks together; the
        server's figures are read around all of it. A driver that fails or dies fails the level, naming it."""
        before = scrape(metrics_url)
        running = []
        self._in_level = True
        for index, share in enumerate(shares(concurrency, len(self._conns))):
            if share:  # closed loop: its share of the streams to run at least, too
                own = dataclasses.replace(level, min_streams=max(1, -(-level.min_streams * share // concurrency)))
                self._conns[index].send((own, share))
                running.append(index)
        for index in running:
            if (said := self._recv(index)) != "opened":
                raise RuntimeError(f"bench driver {index} failed the level before its clock: {said[1]}")
        for index in running:
            self._conns[index].send("go")
        parts = []
        for index in running:
            fields = self._recv(index)
            if isinstance(fields, tuple):
                raise RuntimeError(f"bench driver {index} failed the level: {fields[1]}")
            parts.append(LevelResult(**{k: v for k, v in fields.items() if k != "by_sidecar"}))
        self._in_level = False
        result = merge(concurrency, parts)
        fill_server_figures(result, before, scrape(metrics_url))
        return result

    def _recv(self, index: int):
        try:
            return self._conns[index].recv()
        except EOFError:
            proc = self._procs[index]
            proc.join(timeout=5)
            raise RuntimeError(f"bench driver {index} ended during the level (exit code {proc.exitcode}; its output "
                               "above says why)") from None

    def close(self) -> None:
        """Each driver told to stop; one still in a level (the bench stopped or failed it) is terminated."""
        for conn in self._conns:
            try:
                conn.send(None)
            except OSError:
                pass
        for proc in self._procs:
            if self._in_level:
                proc.terminate()
            proc.join(timeout=30)
            if proc.is_alive():
                proc.kill()
        for conn in self._conns:
            conn.close()
        self._conns, self._procs = [], []
