"""What a bench run leaves behind: the report (JSON, also when the run was interrupted), the table, the plot."""

from __future__ import annotations

import importlib
import json
from dataclasses import dataclass, field
from pathlib import Path

from .drive import FRAME_S

PLOT_HINT = "--plot needs matplotlib: pip install matplotlib (or install the bench extra: pip install -e '.[bench]')"


class PlotUnavailable(RuntimeError):
    pass


def check_plot_available() -> None:
    """Fail at the start of a run, not at its end, when ``--plot`` cannot be drawn."""
    try:
        importlib.import_module("matplotlib")
    except ImportError as exc:
        raise PlotUnavailable(f"{PLOT_HINT} ({exc})") from exc


@dataclass
class BenchReport:
    environment: dict
    settings: dict
    baselines: list[dict] = field(default_factory=list)
    results: list[dict] = field(default_factory=list)
    interrupted: str | None = None  # what was running when Ctrl-C came; None for a complete run
    vllm_omni_stock: dict = field(default_factory=dict)  # the stock baseline's start-up, graphs, shim (stock_bench)
    voxcpm2_upstream: dict = field(default_factory=dict)  # upstream VoxCPM2 AudioVAE: cross-check, ratios (latents)
    compute: dict = field(default_factory=dict)  # FLOPs per audio-second, peak, ceiling (flops.py; with baselines)

    def as_json(self) -> dict:
        out = {"environment": self.environment, "baselines": self.baselines, "results": self.results,
               "settings": self.settings, "vllm_omni_stock": self.vllm_omni_stock}
        if self.voxcpm2_upstream:
            out["voxcpm2_upstream"] = self.voxcpm2_upstream
        if self.compute:
            out["compute"] = self.compute
        if self.interrupted is not None:
            out["interrupted"] = self.interrupted
        return out

    def write(self, path: str) -> None:
        Path(path).write_text(json.dumps(self.as_json(), indent=2) + "\n")

    def reference(self) -> dict | None:
        """The baseline every sidecar figure is a ratio to: what vLLM-Omni 0.30 does per chunk today, its own
        Code2Wav at batch 1 (``vllm-omni-stock-b1``); for a latents model (VoxCPM2), upstream's own streaming decode
        of one 4-frame patch (``voxcpm2-upstream-stream-b1-t4``); the stateless window decode where neither is."""
        for name in ("vllm-omni-stock-b1", "voxcpm2-upstream-stream-b1-t4", "window-eager-b1"):
            found = next((b for b in self.baselines if b["name"] == name), None)
            if found is not None:
                return found
        return None

    def title(self) -> str:
        env = self.environment
        return (f"code2wav-sidecar bench: {env['gpu'] or env['device']}, {env['dtype']}, model {env['model']}, "
                f"{self.settings['arrival']}")


def _fmt(value, spec: str) -> str:
    if value is None:
        return "-".rjust(int(spec.split(".")[0]))
    return format(value, spec)


def ceiling_fraction(audio_s_per_s: float, compute: dict) -> float | None:
    """``audio_s_per_s`` as a fraction of the compute ceiling (``compute``: the report's entry, flops.py); None
    when the peak is unknown."""
    ceiling = compute.get("ceiling_audio_s_per_s") if compute else None
    return audio_s_per_s / ceiling if ceiling else None


def _ceiling_pct(audio_s_per_s: float, compute: dict) -> float | None:
    fraction = ceiling_fraction(audio_s_per_s, compute)
    return None if fraction is None else 100 * fraction


def print_compute(compute: dict) -> None:
    if not compute:
        return
    ceiling = compute.get("ceiling_audio_s_per_s")
    peak = compute.get("peak_flops")
    print(f"\ncompute: {compute['flops_per_audio_s'] / 1e9:.1f} GFLOP per audio-second (matmul + conv, counted); "
          + (f"peak {peak / 1e12:.0f} TFLOP/s ({compute['peak_source']}), ceiling {ceiling:.0f} audio-s/s; "
             "ceil% = audio-s/s / ceiling" if ceiling else f"peak {compute['peak_source']}"))


def upstream_twin(report: BenchReport, row: dict) -> dict | None:
    """The upstream baseline (vLLM-Omni's stock Code2Wav, or VoxCPM2's own module) measured at ``row``'s batch and
    frame count in the same run, if any: what an in-process row's latency is a ratio to."""
    for b in report.baselines:
        upstream = b["name"].startswith(("vllm-omni-stock", "voxcpm2-upstream"))
        if upstream and b is not row and b["batch"] == row["batch"] and b["new_frames"] == row["new_frames"]:
            return b
    return None


def print_table(report: BenchReport) -> None:
    baselines, rows, ref = report.baselines, report.results, report.reference()
    compute = report.compute
    print_compute(compute)
    if baselines:
        print("\nin-process baselines (same device, model, dtype)"
              + (f"; x_thru = audio-s/s / {ref['name']}'s" if ref else "")
              + "; x_p50 = p50 / the upstream row of the same batch and frames")
        width = max(18, *(len(b["name"]) for b in baselines))
        print(f"{'baseline':<{width}} {'batch':>5} {'frames':>6} {'p50_ms':>8} {'p95_ms':>8} {'audio_s/s':>10} "
              f"{'x_thru':>7} {'x_p50':>6} {'ceil%':>6}")
        for b in baselines:
            x_thru = b["audio_s_per_s"] / ref["audio_s_per_s"] if ref and ref["audio_s_per_s"] else None
            twin = upstream_twin(report, b)
            x_p50 = b["latency_ms_p50"] / twin["latency_ms_p50"] if twin and twin["latency_ms_p50"] else None
            print(f"{b['name']:<{width}} {b['batch']:>5} {b['new_frames']:>6} {b['latency_ms_p50']:>8.2f} "
                  f"{b['latency_ms_p95']:>8.2f} {b['audio_s_per_s']:>10.4g} {_fmt(x_thru, '7.2f')} "
                  f"{_fmt(x_p50, '6.2f')} {_fmt(_ceiling_pct(b['audio_s_per_s'], compute), '6.2f')}")
    if not rows:
        print("\nno sidecar level finished")
        return
    print("\nthrough the sidecar" + (f" (x = ratio to {ref['name']})" if ref else "")
          + "; refused = streams the server answered busy (at capacity)")
    print(f"{'conc':>5} {'mode':>6} {'arrival':>8} {'p50_ms':>8} {'p95_ms':>8} {'p99_ms':>8} {'first_p50':>9} "
          f"{'audio_s/s':>10} {'x_thru':>7} {'x_p50':>6} {'batch':>6} {'graph':>6} {'refused':>7} {'err':>4} "
          f"{'ceil%':>6}")
    for r in rows:
        x_thru = r["audio_s_per_s"] / ref["audio_s_per_s"] if ref and ref["audio_s_per_s"] else None
        x_p50 = r["chunk_latency_ms_p50"] / ref["latency_ms_p50"] if ref and r["chunk_latency_ms_p50"] else None
        print(f"{r['concurrency']:>5} {r['mode']:>6} {r['arrival']:>8} {_fmt(r['chunk_latency_ms_p50'], '8.2f')} "
              f"{_fmt(r['chunk_latency_ms_p95'], '8.2f')} {_fmt(r['chunk_latency_ms_p99'], '8.2f')} "
              f"{_fmt(r['first_chunk_latency_ms_p50'], '9.2f')} {r['audio_s_per_s']:>10.4g} {_fmt(x_thru, '7.2f')} "
              f"{_fmt(x_p50, '6.2f')} {_fmt(r['mean_batch_size'], '6.1f')} {_fmt(r['graph_hit_rate'], '6.2f')} "
              f"{r.get('refused_streams', 0):>7} {r['errors']:>4} "
              f"{_fmt(_ceiling_pct(r['audio_s_per_s'], compute), '6.2f')}")
        for address, part in (r.get("sidecars") or {}).items():  # a pool's level: each sidecar's share
            print(f"{'':>5}   {part['streams']:>5} streams {_fmt(part['chunk_latency_ms_p50'], '8.2f')} "
                  f"{_fmt(part['chunk_latency_ms_p99'], '8.2f')} p50/p99_ms {part['audio_s_per_s']:>10.4g} audio-s/s "
                  f"{part['refused_streams']:>3} refused {part['errors']:>3} err  {address}")
    if any(r.get("server_mean_ms") for r in rows):
        print("\nserver-side means from /metrics (ms): arrival->reply, engine step, wait for batch")
        nan = float("nan")
        for r in rows:
            sm = r.get("server_mean_ms") or {}
            print(f"{r['concurrency']:>5}  reply {sm.get('server_chunk_latency', nan):8.2f}  "
                  f"step {sm.get('engine_step', nan):8.2f}  wait {sm.get('batch_wait', nan):8.2f}  "
                  f"client-seen mean {r['mean_chunk_latency_ms'] or nan:8.2f}")


def plot(path: str, report: BenchReport) -> None:
    import matplotlib.pyplot as plt

    fig = draw(report)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def draw(report: BenchReport):
    """Latency and throughput against concurrency, with the in-process baselines and the real-time lines: a chunk
    must come back within its own audio's duration, and each stream consumes one audio-second per second."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows, baselines = report.results, report.baselines
    conc = [r["concurrency"] for r in rows]
    chunk_s = report.settings.get("chunk_frames", 25) * FRAME_S
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
    for key, label in (("chunk_latency_ms_p50", "p50"), ("chunk_latency_ms_p99", "p99")):
        ax1.plot(conc, [r[key] for r in rows], marker="o", label=f"sidecar {label}")
    ax2.plot(conc, [r["audio_s_per_s"] for r in rows], marker="o", label="sidecar")
    styles = ("--", ":", "-.")
    for i, b in enumerate(baselines):
        style = {"linestyle": styles[i % len(styles)], "linewidth": 1.2, "color": f"C{i + 2}"}
        ax1.axhline(b["latency_ms_p50"], label=f"{b['name']} p50 (in-process)", **style)
        ax2.axhline(b["audio_s_per_s"], label=f"{b['name']} (in-process)", **style)
    realtime = {"color": "black", "linewidth": 1.0, "alpha": 0.6}
    ax1.axhline(chunk_s * 1e3, label=f"real time: a chunk's own audio ({chunk_s:g} s)", **realtime)
    span = [min(conc, default=1), max(conc, default=1)]
    ax2.plot(span, span, label="real time: 1 audio-s/s per stream", **realtime)
    ax1.set_yscale("log")
    for ax, ylabel in ((ax1, "chunk latency (ms)"), (ax2, "audio seconds decoded per second")):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("concurrent streams")
        ax.set_ylabel(ylabel)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
    fig.suptitle(report.title() + (" (interrupted)" if report.interrupted else ""), fontsize=9)
    fig.tight_layout()
    return fig


def load(path: str) -> BenchReport:
    with open(path) as f:
        raw = json.load(f)
    return BenchReport(raw["environment"], raw["settings"], raw["baselines"], raw["results"], raw.get("interrupted"),
                       raw.get("vllm_omni_stock", {}), raw.get("voxcpm2_upstream", {}), raw.get("compute", {}))
