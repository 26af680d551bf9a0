"""The kernel choices' counts as Prometheus series (``kernels/choice_cache.ChoiceEvents``, read at each scrape).

- ``code2wav_sidecar_kernel_fallbacks_total{reason}``: convs that ran cuDNN because no form could be measured
  (``in_capture``, ``past_shape_cap``) or forms left out because they failed (``<form>_failed``); every known reason
  is exported from the first scrape at 0.
- ``code2wav_sidecar_conv_choices{form, source}``: (conv, shape) decisions by chosen form and where they came from
  (``measured`` at warm-up, read from the ``cache``).
"""

from __future__ import annotations

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from .kernels.choice_cache import ChoiceEvents

FALLBACK_REASONS = ("in_capture", "past_shape_cap", "cudnn_cl_failed", "polyphase_failed", "gemm_failed",
                    "gemm_cl_failed", "gemm_tma_failed", "im2col_failed", "unit_tma_failed")


class KernelChoiceCollector:
    """A custom collector over one server's ``ChoiceEvents``."""

    def __init__(self, events: ChoiceEvents, prefix: str = "code2wav_sidecar_") -> None:
        self.events = events
        self.prefix = prefix

    def collect(self):
        decisions, fallbacks = self.events.snapshot()
        fell = CounterMetricFamily(self.prefix + "kernel_fallbacks", "Convs run by cuDNN unmeasured, or forms left "
                                   "out after failing, by reason", labels=["reason"])
        for reason in sorted(set(FALLBACK_REASONS) | set(fallbacks)):
            fell.add_metric([reason], fallbacks.get(reason, 0))
        yield fell
        chosen = GaugeMetricFamily(self.prefix + "conv_choices", "Conv (module, shape) decisions by chosen form and "
                                   "source (measured, cache, inferred: first seen after start-up)",
                                   labels=["form", "source"])
        for (form, source), count in sorted(decisions.items()):
            chosen.add_metric([form, source], count)
        yield chosen
