"""Reading a Prometheus endpoint (Triton's metrics port) back: its text parsed by prometheus_client into
samples keyed by name and labels. For clients, benchmarks and load tests; the model publishes with
serving/metrics.py."""

from __future__ import annotations

import urllib.request

from prometheus_client.parser import text_string_to_metric_families

# (sample name, frozenset of (label, value) pairs) -> value
Samples = dict[tuple[str, frozenset[tuple[str, str]]], float]


def parse_samples(text: str) -> Samples:
    """Prometheus text exposition -> Samples. A counter's samples end in `_total`, as OpenMetrics names them:
    prometheus_client adds it where the text left it out (Triton's `nv_*` counters)."""
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def scrape(metrics_url: str, timeout_s: float = 5.0) -> Samples:
    """The endpoint's samples now; raises OSError when it does not answer."""
    with urllib.request.urlopen(metrics_url, timeout=timeout_s) as reply:
        return parse_samples(reply.read().decode("utf-8", "replace"))


def matching(samples: Samples, name: str, **labels: str) -> list[float]:
    """Values of the samples called `name` that carry (at least) `labels`."""
    want = set(labels.items())
    return [value for (n, have), value in samples.items() if n == name and want <= have]


def sample(samples: Samples, name: str, **labels: str) -> float | None:
    """The one sample called `name` with `labels`; None when there is none or more than one."""
    found = matching(samples, name, **labels)
    return found[0] if len(found) == 1 else None
