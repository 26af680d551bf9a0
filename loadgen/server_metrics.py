"""Reading a sidecar's Prometheus exposition (``/metrics``): the counters a bench level reads before and after it,
one sample's value, a counter's growth."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families


def scrape_counters(text: str) -> dict[str, float]:
    """Sum every sample of the metrics the bench reads, by sample name (labels summed over)."""
    wanted = ("code2wav_sidecar_batch_size", "code2wav_sidecar_graph_replays", "code2wav_sidecar_graph_misses",
              "code2wav_sidecar_chunk_latency_seconds", "code2wav_sidecar_engine_step_seconds",
              "code2wav_sidecar_batch_wait_seconds")
    sums: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        if not family.name.startswith(wanted):
            continue
        for sample in family.samples:
            sums[sample.name] = sums.get(sample.name, 0.0) + sample.value
    return sums


def metric_value(text: str, name: str, **labels: str) -> float:
    """The sum of the samples named ``name`` whose labels include ``labels``."""
    total = 0.0
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name and all(sample.labels.get(k) == v for k, v in labels.items()):
                total += sample.value
    return total


def counter_delta(after: dict[str, float], before: dict[str, float], name: str) -> float:
    """How much the sample ``name`` grew between two ``scrape_counters``."""
    return after.get(name, 0.0) - before.get(name, 0.0)


def scrape(metrics_url: str | None) -> dict[str, float] | None:
    if metrics_url is None:
        return None
    import urllib.request

    try:
        with urllib.request.urlopen(metrics_url, timeout=5) as resp:
            return scrape_counters(resp.read().decode())
    except OSError:
        return None
