"""Metrics from the first scrape: every series that the shipped Grafana dashboard and Prometheus alert rules query
exists on a fresh CPU sidecar, before any traffic, with value 0 (counters, histogram counts) - so ``rate()``
panels show 0 instead of nothing and ``absent()``-style alerts stay quiet on a healthy server.

The queries are read from ``deploy/grafana/dashboards/*.json`` and ``deploy/prometheus/*.yml`` and parsed with a
small PromQL tokenizer (below): every vector selector gives a metric name and its label matchers; labels pinned
with ``=`` must exist with that value, and labels named in ``by``/``on``/``ignoring`` clauses must be carried by
the series. The server is a real one (tests/conftest.py ``start_sidecar``), scraped over HTTP.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families

from code2wav.proto import REGION_ACCESS, STREAM_MODES, ErrorCode
from code2wav.sidecar.config import ServerConfig
from code2wav.sidecar.graphs.plan import build_buckets
from code2wav.sidecar.models.qwen3_tts.family import QWEN3_TTS
from conftest import ROOT, start_sidecar

PREFIX = "code2wav_sidecar_"
DASHBOARDS = ROOT / "deploy" / "grafana" / "dashboards"
RULES = ROOT / "deploy" / "prometheus"
# labels Prometheus or the histogram format adds, not the sidecar's series
SCRAPE_LABELS = {"instance", "job", "le"}
KEYWORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "and", "or", "unless", "bool",
            "offset", "inf", "nan"}
AGGREGATIONS = {"sum", "min", "max", "avg", "count", "group", "stddev", "stdvar", "topk", "bottomk", "quantile",
                "count_values", "limitk", "limit_ratio"}  # may be followed by a grouping clause, not "("
GROUPING = {"by", "without", "on", "ignoring", "group_left", "group_right"}


# ------------------------------------------------------------------------------------------------ PromQL
@dataclass(frozen=True)
class Selector:
    name: str
    matchers: tuple[tuple[str, str, str], ...]  # (label, op, value)


_TOKEN = re.compile(r"""
    (?P<space>\s+)
  | (?P<string>"(?:[^"\\]|\\.)*"|'(?:[^'\\]|\\.)*')
  | (?P<duration>\[[^\]]*\])
  | (?P<number>\d+(?:\.\d+)?(?:e[+-]?\d+)?)
  | (?P<ident>[A-Za-z_:][A-Za-z0-9_:]*)
  | (?P<op>=~|!~|!=|==|>=|<=|[-+*/%^<>=,(){}])
""", re.X)


def _tokens(expr: str) -> list[tuple[str, str]]:
    out, pos = [], 0
    while pos < len(expr):
        m = _TOKEN.match(expr, pos)
        if m is None:
            raise ValueError(f"cannot tokenize PromQL at {expr[pos:pos + 20]!r} in {expr!r}")
        pos = m.end()
        if m.lastgroup != "space":
            out.append((m.lastgroup, m.group()))
    return out


def parse_promql(expr: str) -> tuple[list[Selector], set[str]]:
    """(vector selectors, labels named in grouping clauses) of one expression. A Grafana template query
    ``label_values(metric, label)`` gives the selector ``metric`` and the grouping label ``label``."""
    m = re.fullmatch(r"\s*label_values\((?P<metric>[^,]+),\s*(?P<label>\w+)\)\s*", expr)
    if m:
        return [Selector(m.group("metric").strip(), ())], {m.group("label")}
    toks = _tokens(expr)
    selectors, grouping = [], set()
    i = 0
    while i < len(toks):
        kind, text = toks[i]
        nxt = toks[i + 1][1] if i + 1 < len(toks) else ""
        if kind == "ident" and text in GROUPING:
            i += 1
            if i < len(toks) and toks[i][1] == "(":  # a label list: by (a, b)
                i += 1
                while toks[i][1] != ")":
                    if toks[i][0] == "ident":
                        grouping.add(toks[i][1])
                    i += 1
            i += 1
            continue
        if kind == "ident" and text.lower() not in KEYWORDS | AGGREGATIONS and nxt != "(":
            matchers = []
            i += 1
            if i < len(toks) and toks[i][1] == "{":
                i += 1
                while toks[i][1] != "}":
                    if toks[i][1] == ",":
                        i += 1
                        continue
                    label, op, value = toks[i][1], toks[i + 1][1], toks[i + 2][1]
                    matchers.append((label, op, value[1:-1]))
                    i += 3
                i += 1
            selectors.append(Selector(text, tuple(matchers)))
            continue
        i += 1
    return selectors, grouping


def _panels(board: dict) -> list[dict]:
    out = []
    for panel in board.get("panels", []):
        out.append(panel)
        out += panel.get("panels", [])
    return out


def shipped_queries() -> list[tuple[str, str]]:
    """(where, expr) of every query in the dashboards (targets, template variables) and the alert rules."""
    queries = []
    for path in sorted(DASHBOARDS.glob("*.json")):
        board = json.loads(path.read_text())
        for panel in _panels(board):
            for target in panel.get("targets", []):
                if target.get("expr"):
                    queries.append((f"{path.name} {panel.get('title')!r}", target["expr"]))
        for var in board.get("templating", {}).get("list", []):
            if var.get("type") == "query":
                q = var["query"]["query"] if isinstance(var["query"], dict) else var["query"]
                queries.append((f"{path.name} variable {var['name']}", q))
    for path in sorted(RULES.glob("*.y*ml")):
        for group in (yaml.safe_load(path.read_text()) or {}).get("groups", []):
            for rule in group["rules"]:
                queries.append((f"{path.name} {rule.get('alert') or rule.get('record')}", rule["expr"]))
    return queries


def test_promql_parser_finds_selectors_matchers_and_grouping_labels():
    expr = ('sum by (instance, code) (rate(code2wav_sidecar_errors_total{instance=~"$instance"}[5m])) '
            '/ ignoring(kind) code2wav_sidecar_arena_slots{kind="total", model!="x"} > 0.1 or vector(0)')
    selectors, grouping = parse_promql(expr)
    assert selectors == [Selector(PREFIX + "errors_total", (("instance", "=~", "$instance"),)),
                         Selector(PREFIX + "arena_slots", (("kind", "=", "total"), ("model", "!=", "x")))]
    assert grouping == {"instance", "code", "kind"}
    assert parse_promql('up{job="code2wav-sidecar"} == 0')[0] == [Selector("up", (("job", "=", "code2wav-sidecar"),))]
    assert parse_promql("label_values(code2wav_sidecar_ready, instance)") == (
        [Selector(PREFIX + "ready", ())], {"instance"})


# ------------------------------------------------------------------------------------------------ live
@pytest.fixture(scope="module")
def first_scrape(tmp_path_factory) -> dict[str, list[tuple[dict[str, str], float]]]:
    """Samples by name ((labels, value) pairs) of a fresh CPU sidecar's first scrape, before any traffic."""
    running = start_sidecar(tmp_path_factory.mktemp("first-scrape"))
    try:
        text = running.scrape()
    finally:
        running.stop()
    samples: dict[str, list[tuple[dict[str, str], float]]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples.setdefault(sample.name, []).append((dict(sample.labels), sample.value))
    return samples


def test_every_queried_series_exists_at_start_up(first_scrape):
    queries = shipped_queries()
    checked, missing = set(), []
    for where, expr in queries:
        selectors, grouping = parse_promql(expr)
        ours = [s for s in selectors if s.name.startswith(PREFIX)]
        for sel in ours:
            rows = first_scrape.get(sel.name, [])
            pinned = {label: value for label, op, value in sel.matchers if op == "=" and "$" not in value}
            if not any(all(labels.get(k) == v for k, v in pinned.items()) for labels, _ in rows):
                missing.append(f"{where}: {sel.name}{pinned or ''} has no sample")
            checked.add(sel.name)
        carried = {label for sel in ours for labels, _ in first_scrape.get(sel.name, []) for label in labels}
        if ours and not grouping - SCRAPE_LABELS <= carried:
            missing.append(f"{where}: no series carries {sorted(grouping - SCRAPE_LABELS - carried)}")
    assert missing == [], "\n".join(missing)
    # the parser really read the shipped files: the series the issue names are among those checked
    assert {PREFIX + n for n in ("errors_total", "ipc_chunks_total", "ipc_regions", "ipc_register_failures_total",
                                 "graph_replays_total", "graph_misses_total", "chunks_total")} <= checked
    assert len(checked) >= 20


def _values(first_scrape, name: str, label: str) -> dict[str, float]:
    return {labels[label]: value for labels, value in first_scrape.get(name, []) if label in labels}


def test_labelled_series_start_at_zero_for_every_label_value(first_scrape):
    assert _values(first_scrape, PREFIX + "errors_total", "code") == {c.value: 0.0 for c in ErrorCode}
    assert _values(first_scrape, PREFIX + "ipc_chunks_total", "direction") == {"codes_in": 0.0, "audio_out": 0.0}
    assert _values(first_scrape, PREFIX + "ipc_regions", "access") == {a: 0.0 for a in REGION_ACCESS}
    assert _values(first_scrape, PREFIX + "ipc_register_failures_total", "reason") == {
        "unsupported": 0.0, "different_gpu": 0.0, "open_failed": 0.0}
    for name in ("chunks_total", "frames_total", "audio_seconds_total", "streams_opened_total",
                 "chunk_latency_seconds_count", "batch_size_count", "engine_step_seconds_count"):
        assert _values(first_scrape, PREFIX + name, "mode") == {m: 0.0 for m in STREAM_MODES}, name
    # graph hits per configured bucket (the server's default config), misses per component, on a CPU server too
    gcfg = ServerConfig().graphs.for_family(QWEN3_TTS.graph_buckets)  # the default model's family
    buckets = build_buckets("exact", gcfg.exact_batch_sizes, gcfg.exact_frames) + build_buckets(
        "window", gcfg.window_batch_sizes, gcfg.window_frames)
    replays = {(labels["component"], labels["bucket"]): v
               for labels, v in first_scrape[PREFIX + "graph_replays_total"]}
    assert replays == {(k.mode, k.label): 0.0 for k in buckets}
    misses = {labels["component"] for labels, v in first_scrape[PREFIX + "graph_misses_total"] if v == 0.0}
    assert misses == set(STREAM_MODES)
    # nothing has happened yet: every counter and histogram count is 0 (but the garbage collections of the start-up)
    moved = {name: rows for name, rows in first_scrape.items() if name.startswith(PREFIX)
             and name.endswith(("_total", "_count")) and any(v != 0.0 for _, v in rows)
             and name != PREFIX + "gc_pause_seconds_count"}
    assert {labels["generation"] for labels, _ in first_scrape[PREFIX + "gc_pause_seconds_count"]} == {"0", "1", "2"}
    assert moved == {}
    assert first_scrape[PREFIX + "ready"] == [({}, 1.0)]


def test_rules_and_dashboard_are_the_files_the_test_reads():
    """Guards the test itself: the shipped files exist where it looks and yield queries."""
    assert list(DASHBOARDS.glob("*.json")) and (RULES / "alerts.yml").is_file()
    names = {sel.name for _, expr in shipped_queries() for sel in parse_promql(expr)[0]}
    assert PREFIX + "errors_total" in names and "up" in names


def test_the_cached_children_are_the_series_start_series_made():
    """The per-chunk code counts through children looked up once (``mode_series``, ``ipc_*``): they must be the
    children ``start_series`` created and the exposition shows, not look-alikes in no registry."""
    from prometheus_client import CollectorRegistry, generate_latest

    from code2wav.sidecar.metrics import Metrics

    metrics = Metrics(CollectorRegistry())
    metrics.start_series("m")
    series = metrics.mode_series("m", "exact")
    assert series is metrics.mode_series("m", "exact")
    assert series.chunks is metrics.chunks.labels(model="m", mode="exact")
    assert series.step_seconds is metrics.step_seconds.labels(mode="exact")
    series.chunks.inc(3)
    metrics.ipc_codes_in.inc(2)
    text = generate_latest(metrics.registry).decode()
    assert 'code2wav_sidecar_chunks_total{mode="exact",model="m"} 3.0' in text
    assert 'code2wav_sidecar_ipc_chunks_total{direction="codes_in"} 2.0' in text


def test_build_info_and_process_metrics_are_in_the_first_scrape(first_scrape):
    """What runs, from the first scrape (a real server over HTTP): ``build_info`` = 1 with the package version,
    torch, CUDA, model labels; and the process collector's series (Linux: read from /proc)."""
    import platform

    import torch

    import code2wav

    ((labels, value),) = first_scrape[PREFIX + "build_info"]
    assert value == 1.0 and set(labels) == {"version", "torch", "cuda", "gpu", "model", "dtype"}
    assert labels["version"] == code2wav.__version__ and labels["torch"] == torch.__version__
    assert labels["cuda"] == (torch.version.cuda or "none") and labels["model"] == "qwen3-tts-12hz"  # the tiny model
    assert labels["dtype"] == "float32" and labels["gpu"] == "none"  # the CPU server's, as bootstrap passes them
    assert first_scrape["python_info"][0][0]["version"] == platform.python_version()
    if platform.system() == "Linux":
        for name in ("process_cpu_seconds_total", "process_resident_memory_bytes", "process_virtual_memory_bytes",
                     "process_start_time_seconds", "process_open_fds", "process_max_fds"):
            ((labels, value),) = first_scrape[name]
            assert labels == {} and value > 0, name
        assert first_scrape["process_resident_memory_bytes"][0][1] > 50 * 2**20  # torch alone is larger


def test_the_heap_is_frozen_and_its_collections_timed_from_the_start(first_scrape):
    """``run_server`` froze start-up's objects out of the collector (sidecar/gc_pauses.py) and timed each collection
    from the start: the freeze's own full collection is in the histogram."""
    ((_, frozen),) = first_scrape[PREFIX + "gc_frozen_objects"]
    assert frozen > 50_000  # torch, the model, the server: far more than the sidecar makes per stream
    full = [value for labels, value in first_scrape[PREFIX + "gc_pause_seconds_count"] if labels["generation"] == "2"]
    assert full and full[0] >= 1


def test_build_info_names_the_models_dtype_and_gpu():
    from prometheus_client import CollectorRegistry
    from prometheus_client.parser import text_string_to_metric_families as parse

    from code2wav.sidecar.metrics import Metrics, gpu_name

    metrics = Metrics(CollectorRegistry())
    metrics.start_series("m", dtype="bfloat16", device="cpu")
    metrics.start_series("m", dtype="float32", device="cpu")  # a second call replaces the series
    rows = [s for f in parse(metrics.exposition().decode()) for s in f.samples if s.name == PREFIX + "build_info"]
    assert [(r.labels["model"], r.labels["dtype"], r.labels["gpu"], r.value) for r in rows] == [
        ("m", "float32", "none", 1.0)]
    assert gpu_name("unknown") == "unknown" and gpu_name("cpu") == "none"
