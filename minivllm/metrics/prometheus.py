"""Prometheus text exposition of the metrics snapshot (the server's GET /metrics)."""

from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.core import Metric as Family

from minivllm.metrics.reader import Counter, Gauge, Histogram, Metric


class SnapshotCollector:
    """Builds the metric families from a fresh snapshot at every scrape."""

    def __init__(self, snapshot: Callable[[], list[Metric]]) -> None:
        self.snapshot = snapshot

    def collect(self) -> Iterator[Family]:
        families: dict[str, Family] = {}
        for m in self.snapshot():
            label_names = list(m.labels)
            family = families.get(m.name)
            if family is None:
                if isinstance(m, Counter):
                    family = CounterMetricFamily(m.name, m.help, labels=label_names)
                elif isinstance(m, Gauge):
                    family = GaugeMetricFamily(m.name, m.help, labels=label_names)
                else:
                    family = HistogramMetricFamily(m.name, m.help, labels=label_names)
                families[m.name] = family
            values = list(m.labels.values())
            if isinstance(m, Histogram):
                family.add_metric(values, list(m.buckets.items()), m.sum)
            else:
                family.add_metric(values, m.value)
        yield from families.values()


def render(snapshot: Callable[[], list[Metric]]) -> bytes:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(SnapshotCollector(snapshot))
    return generate_latest(registry)
