"""The phases of a bench run, and the progress lines they print.

A phase is a named list of steps that adds to the report. ``run_phases`` runs them in order and prints, on
stderr, what runs and about how long the phase has left. To add a phase (another baseline, another decoder
family), subclass ``Phase``: ``plan`` lists its steps (with a relative weight, or a duration known in advance),
``run_step`` does one and writes into the ``BenchReport``; ``__enter__``/``__exit__`` set up and tear down what
the steps share (a model, a spawned sidecar). Then add it to ``bench.build_phases``.
"""

from __future__ import annotations

import asyncio
import sys
import time
from dataclasses import asdict, dataclass

import torch

from code2wav.client import SidecarClient, SidecarPool
from code2wav.client.discovery import parse_pool_address

from .drive import Level, realtime_level_s, run_level, significant, summarize
from .drivers import Drivers
from .report import BenchReport
from .spawn import SpawnedSidecar, spawn_sidecar
from .traffic import chunk_sizes


@dataclass(frozen=True)
class Step:
    label: str
    weight: float = 1.0  # relative cost within the phase, for the time-left estimate (0: not counted)
    expected_s: float | None = None  # when its duration is known in advance (an open-loop level)


class Phase:
    name = "phase"

    def plan(self) -> list[Step]:
        raise NotImplementedError

    def run_step(self, index: int, step: Step, report: BenchReport) -> str:
        """Do one step; returns a short summary for the progress line."""
        raise NotImplementedError

    def __enter__(self) -> Phase:
        return self

    def __exit__(self, *exc) -> None:
        return None


class Progress:
    """Progress lines on stderr: the phase, the step, and about how long the phase has left (steps with a known
    duration count it; the others are estimated from the weights of the steps done so far)."""

    def __init__(self, stream=None, clock=time.monotonic) -> None:
        self.stream = stream or sys.stderr
        self.clock = clock

    def say(self, text: str) -> None:
        print(f"[bench] {text}", file=self.stream, flush=True)

    @staticmethod
    def time_left_s(steps: list[Step], done: int, elapsed_s: list[float]) -> float | None:
        """Seconds left for ``steps[done:]``; None when a step has neither a known duration nor a rate yet."""
        timed = [(s, t) for s, t in zip(steps[:done], elapsed_s) if s.expected_s is None and s.weight > 0]
        rate = sum(t for _, t in timed) / sum(s.weight for s, _ in timed) if timed else None
        left = 0.0
        for step in steps[done:]:
            if step.expected_s is not None:
                left += step.expected_s
            elif rate is None:
                return None
            else:
                left += rate * step.weight
        return left

    def left_text(self, steps: list[Step], done: int, elapsed_s: list[float]) -> str:
        if done == len(steps):
            return "phase done"
        left = self.time_left_s(steps, done, elapsed_s)
        return "time left unknown until a step is done" if left is None else f"about {_duration(left)} left"


def _duration(seconds: float) -> str:
    if seconds < 10:
        return f"{seconds:.1f} s"
    return f"{seconds:.0f} s" if seconds < 120 else f"{seconds / 60:.0f} min"


def run_phases(phases: list[Phase], report: BenchReport, progress: Progress) -> None:
    """Run every phase; on Ctrl-C, mark the report with what was running and re-raise (the caller writes it)."""
    for number, phase in enumerate(phases, 1):
        steps = phase.plan()
        elapsed: list[float] = []
        progress.say(f"phase {number}/{len(phases)} {phase.name}: {len(steps)} steps "
                     f"({', '.join(s.label for s in steps)}); {progress.left_text(steps, 0, elapsed)}")
        label = "setting up"
        try:
            with phase:
                for i, step in enumerate(steps):
                    label = step.label
                    progress.say(f"{phase.name} {i + 1}/{len(steps)}: {step.label} ...")
                    t0 = progress.clock()
                    summary = phase.run_step(i, step, report)
                    elapsed.append(progress.clock() - t0)
                    label = f"after {step.label}"
                    progress.say(f"{phase.name} {i + 1}/{len(steps)}: {step.label} done in "
                                 f"{_duration(elapsed[-1])}" + (f": {summary}" if summary else "")
                                 + f"; {progress.left_text(steps, i + 1, elapsed)}")
        except KeyboardInterrupt:
            report.interrupted = f"{phase.name}: {label}"
            progress.say(f"interrupted during {report.interrupted}; keeping what finished")
            raise


class BaselinesPhase(Phase):
    """In-process baselines on the same device, model and dtype as the sidecar (baselines.py)."""

    name = "baselines"

    def __init__(self, args, device: torch.device) -> None:
        self.args, self.device = args, device
        self.batches = tuple(int(x) for x in args.baseline_batch.split(",") if x)
        self.frames = tuple(int(x) for x in (args.baseline_frames or str(args.chunk_frames)).split(",") if x)
        self.model = None

    def plan(self) -> list[Step]:
        frames = "" if self.frames == (self.args.chunk_frames,) else f" x {','.join(map(str, self.frames))} frames"
        steps = [Step("load model, count its FLOPs", weight=0),  # no rate for the time-left estimate
                 Step(f"baselines (window b1, exact b{','.join(map(str, self.batches))}{frames}, "
                      f"{self.args.baseline_iters} iterations each)", weight=2 + len(self.batches) * len(self.frames))]
        steps.append(Step("vllm-omni-stock: vLLM-Omni 0.30's own Code2Wav (same weights, codes, dtype, device)",
                          weight=2))
        steps.append(Step("voxcpm2-upstream: VoxCPM2's own AudioVAE V2 (latents models; same weights, dtype, "
                          "device)" + (", then torch.compile" if self.args.upstream_compile else ""), weight=2))
        if self.args.profile_batch:
            steps.append(Step(f"profile an eager exact step at batch {self.args.profile_batch}"))
        return steps

    def run_step(self, index: int, step: Step, report: BenchReport) -> str:
        args = self.args
        if index == 0:
            from code2wav.sidecar.models import load_model

            from .flops import compute_summary

            self.model = load_model(args.model, self.device, args.dtype)
            report.compute = compute_summary(self.model, report.environment.get("gpu"), args.dtype,
                                             getattr(args, "peak_tflops", None))
            ceiling = report.compute["ceiling_audio_s_per_s"]
            return (f"{report.compute['flops_per_audio_s'] / 1e9:.1f} GFLOP per audio-second"
                    + (f", ceiling {ceiling:.0f} audio-s/s" if ceiling else ""))
        if index == 1:
            from .baselines import run_baselines

            found = run_baselines(self.model, new_frames=args.chunk_frames, iters=args.baseline_iters,
                                  warmup=getattr(args, "baseline_warmup", 3), batch_sizes=self.batches,
                                  frames=self.frames)
            report.baselines = [_rounded_baseline(asdict(b)) for b in found]
            return ", ".join(f"{b['name']} p50 {b['latency_ms_p50']:.2f} ms" for b in report.baselines[:3])
        if index == 2:
            from .stock_bench import run_stock_phase

            stock = run_stock_phase(args, self.model)  # vLLM-Omni 0.30's own Code2Wav, same device/dtype/weights
            report.baselines += [_rounded_baseline(r) for r in stock.pop("rows", [])]
            report.vllm_omni_stock = stock
            return stock.get("skipped", "") or f"vllm_shim={str(stock.get('vllm_shim')).lower()}"
        if index == 3:
            from .voxcpm2_upstream import run_upstream_step

            upstream = run_upstream_step(args, self.model, report.baselines)
            report.baselines += [_rounded_baseline(r) for r in upstream.pop("rows", [])]
            report.voxcpm2_upstream = upstream
            return upstream.get("skipped", "") or "; ".join(f"{k} {v}x" for k, v in upstream["ratios"].items())
        from .baselines import profile_kernels

        print(f"\nprofile: one eager exact step, batch {args.profile_batch} x {args.chunk_frames} frames")
        print(profile_kernels(self.model, args.profile_batch, args.chunk_frames))
        return ""

    def __exit__(self, *exc) -> None:
        self.model = None
        if self.device.type == "cuda":
            torch.cuda.empty_cache()


def _rounded_baseline(row: dict) -> dict:
    """Latencies to 1 us (in-process steps are steady to a few us), throughput to 4 significant digits."""
    return {**row, "latency_ms_p50": round(row["latency_ms_p50"], 3), "latency_ms_p95": round(row["latency_ms_p95"], 3),
            "audio_s_per_s": significant(row["audio_s_per_s"])}


class SidecarPhase(Phase):
    """Concurrency levels of synthetic vLLM-Omni-shaped streams through a sidecar (spawned, or ``--address``)."""

    name = "sidecar"

    def __init__(self, args, device: torch.device) -> None:
        self.args, self.device = args, device
        self.levels = [int(x) for x in args.concurrency.split(",") if x]
        self.spawned: SpawnedSidecar | None = None
        self.clients: list[SidecarClient] | list[SidecarPool] = []
        self.metrics_url = args.metrics_url
        self.runner = None  # asyncio.Runner: one event loop for every level (Ctrl-C cancels its task)
        self.drivers: Drivers | None = None  # --drivers > 1: the processes that drive the streams instead
        input_device = device if args.inputs_on == "device" else None  # inputs by CUDA IPC (main checked)
        self.level = Level(args.mode, args.frames, args.first_chunk_frames, args.chunk_frames, args.arrival,
                           args.min_streams, input_device, args.early_audio)

    def plan(self) -> list[Step]:
        a = self.args
        chunks_per_stream = len(chunk_sizes(a.frames, a.first_chunk_frames, a.chunk_frames))
        if a.arrival == "realtime":
            return [Step(f"{n} real-time streams", expected_s=realtime_level_s(a.frames)) for n in self.levels]
        return [Step(f"{n} closed-loop streams", weight=max(1, -(-a.min_streams // n)) * n * chunks_per_stream)
                for n in self.levels]

    def __enter__(self) -> SidecarPhase:
        try:
            return self._start()
        except BaseException:  # a failed start still stops what it started (``with`` does not call __exit__ then)
            self.__exit__(*sys.exc_info())
            raise

    def _start(self) -> SidecarPhase:
        a = self.args
        address = a.address
        if address is None:
            self.spawned = spawn_sidecar("--model", a.model, "--device", str(self.device), "--dtype", a.dtype,
                                         *a.serve_arg)
            address, self.metrics_url = self.spawned.address, self.spawned.metrics_url
            print(self.spawned.banner(), flush=True)
        # several sidecars (a comma-separated list, or dns://NAME:PORT): each connection is a pool over them all,
        # and every level also reports each sidecar's figures ("sidecars" in its row)
        pooled = parse_pool_address(address).pooled
        connect = SidecarPool if pooled else SidecarClient
        if a.drivers > 1:  # the streams driven from that many processes (loadgen/drivers.py), each warmed up
            self.drivers = Drivers(a.drivers, address, max(1, a.clients), a.server_key, self.level.warm_up())
            return self
        self.clients = [connect(address, timeout_s=120, curve_server_key=a.server_key)
                        for _ in range(max(1, a.clients))]
        if hasattr(asyncio, "Runner"):  # Python 3.11+; 3.10 runs each level in its own asyncio.run
            self.runner = asyncio.Runner()
        self._warm_up()
        return self

    def _warm_up(self) -> None:
        """One untimed closed-loop stream per client connection, of the levels' shape, before the first level: a
        server's first requests pay one-time costs (allocator growth, first replay of each bucket, lazy imports on
        both sides) that a serving sidecar paid long ago; without this, c=1's single first chunk measured them."""
        run = self.runner.run if self.runner is not None else asyncio.run
        run(run_level(self.clients, self.level.warm_up(), len(self.clients), None, tag="warmup"))

    def run_step(self, index: int, step: Step, report: BenchReport) -> str:
        if self.drivers is not None:
            result = self.drivers.run_level(self.level, self.levels[index], self.metrics_url)
        else:
            run = self.runner.run if self.runner is not None else asyncio.run
            result = run(run_level(self.clients, self.level, self.levels[index], self.metrics_url, tag="bench"))
        return self._row(result, report)

    @staticmethod
    def _row(result, report: BenchReport) -> str:
        row = summarize(result)
        report.results.append(row)
        return (f"{row['chunks']} chunks, {row['audio_s_per_s']:.4g} audio-s/s, p50 {row['chunk_latency_ms_p50']} ms, "
                f"{row['refused_streams']} refused (busy), {row['errors']} errors")

    def __exit__(self, *exc) -> None:
        if self.drivers is not None:
            self.drivers.close()
        if self.runner is not None:
            self.runner.close()
        for client in self.clients:
            client.close()
        if self.spawned is not None:
            self.spawned.stop(log_copy=self.args.sidecar_log)
