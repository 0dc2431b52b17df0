"""The router's /metrics around one benchmark run: counters scraped before and after (KV bytes, transfers and
their time, prefix-cache hits, preemptions), queue gauges sampled while the run lasts (waiting requests,
queued prefill tokens, requests waiting for remote KV). Names are router/metrics.py's."""

from __future__ import annotations

import threading
import urllib.request
from collections import defaultdict
from dataclasses import dataclass, field

from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.samples import Sample

# counter sample name -> (summary field, the role label of the series counted): a KV counter's role is the side of
# the transfer, so a transfer is counted once, on its decode side, even between two dual-role engines (each has
# a series per side: router/metrics.py)
COUNTERS = {
    "pdserve_kv_bytes_sent_total": ("kv_bytes_sent", "prefill"),
    "pdserve_kv_bytes_received_total": ("kv_bytes_received", "decode"),
    "pdserve_kv_transfers_total": ("kv_transfers", "decode"),
    "pdserve_kv_transfers_failed_total": ("kv_transfers_failed", "decode"),
    "pdserve_num_preemptions_total": ("preemptions", None),
    "pdserve_prefix_cache_queries_total": ("prefix_cache_queries", None),
    "pdserve_prefix_cache_hits_total": ("prefix_cache_hits", None),
    "process_cpu_seconds_total": ("server_cpu_s", None),  # the process serving /metrics: pdserve's router
}
TRANSFER_SECONDS = "pdserve_kv_transfer_seconds_total"
TRANSFERS = "pdserve_kv_transfers_total"
# gauge -> summary field stem: the largest and the mean (over samples) of its sum across engines
QUEUE_GAUGES = {
    "pdserve_num_requests_waiting": "waiting",
    "pdserve_queued_prefill_tokens": "queued_prefill_tokens",
    "pdserve_num_requests_waiting_for_remote_kv": "waiting_for_remote_kv",
    "pdserve_num_requests_running": "running",
}
# mean_kv_wait_ms: decode side, KVWant sent to KVDone verified (so it includes waiting in P's queue);
# mean_kv_transfer_exposed_ms: prefill side, prompt computed to KVAck (the transfer compute did not hide).
COUNTER_FIELDS = [name for name, _ in COUNTERS.values()] + ["prefix_cache_hit_rate", "mean_kv_wait_ms",
                                                            "mean_kv_transfer_exposed_ms"]
QUEUE_FIELDS = [f"{kind}_{stem}" for stem in QUEUE_GAUGES.values() for kind in ("max", "mean")]
SUMMARY_FIELDS = COUNTER_FIELDS + QUEUE_FIELDS


def scrape_metrics(url: str, api_key: str | None = None, timeout: float = 10.0) -> list[Sample]:
    """Every sample of the server's /metrics (prometheus text). Raises OSError or ValueError."""
    request = urllib.request.Request(f"{url}/metrics",
                                     headers={"Authorization": f"Bearer {api_key}"} if api_key else {})
    with urllib.request.urlopen(request, timeout=timeout) as response:
        text = response.read().decode("utf-8", errors="replace")
    return [sample for family in text_string_to_metric_families(text) for sample in family.samples]


def counters_by_engine(samples: list[Sample]) -> dict[tuple[str, str, str], float]:
    """{(sample name, engine, role): value} of the per-engine counters."""
    wanted = set(COUNTERS) | {TRANSFER_SECONDS}
    return {(s.name, s.labels.get("engine", ""), s.labels.get("role", "")): s.value
            for s in samples if s.name in wanted}


def counter_deltas(before: dict, after: dict) -> dict[tuple[str, str, str], float]:
    """after - before per engine; an engine that restarted (its counter went down) counts from zero."""
    deltas = {}
    for key, value in after.items():
        previous = before.get(key, 0.0)
        deltas[key] = value - previous if value >= previous else value
    return deltas


def summarize_counters(deltas: dict[tuple[str, str, str], float]) -> dict[str, float | None]:
    summary: dict[str, float | None] = {}
    for sample_name, (field_name, role) in COUNTERS.items():
        summary[field_name] = sum((v for (name, _, r), v in deltas.items()
                                   if name == sample_name and (role is None or r == role)), 0.0)
    queries = summary["prefix_cache_queries"]
    summary["prefix_cache_hit_rate"] = summary["prefix_cache_hits"] / queries if queries else None
    for role, field_name in (("decode", "mean_kv_wait_ms"), ("prefill", "mean_kv_transfer_exposed_ms")):
        seconds = sum(v for (name, _, r), v in deltas.items() if name == TRANSFER_SECONDS and r == role)
        count = sum(v for (name, _, r), v in deltas.items() if name == TRANSFERS and r == role)
        summary[field_name] = 1000.0 * seconds / count if count else None
    return summary


@dataclass
class QueueSampler:
    """Samples the queue gauges every `interval_s` in a thread while a run lasts (`with` block)."""
    url: str
    api_key: str | None = None
    interval_s: float = 1.0
    totals: dict[str, list[float]] = field(default_factory=lambda: defaultdict(list))

    def __post_init__(self) -> None:
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="queue-sampler", daemon=True)

    def __enter__(self) -> QueueSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._stop.set()
        self._thread.join()

    def _loop(self) -> None:
        while not self._stop.wait(self.interval_s):
            try:
                samples = scrape_metrics(self.url, self.api_key, timeout=self.interval_s * 5)
            except (OSError, ValueError):
                continue  # a busy or restarting router: a missed sample, not a failed run
            self.add(samples)

    def add(self, samples: list[Sample]) -> None:
        sums: dict[str, float] = defaultdict(float)
        for sample in samples:
            if sample.name in QUEUE_GAUGES:
                sums[sample.name] += sample.value
        for name in QUEUE_GAUGES:
            if name in sums:
                self.totals[name].append(sums[name])

    def summary(self) -> dict[str, float | None]:
        summary: dict[str, float | None] = {}
        for name, stem in QUEUE_GAUGES.items():
            values = self.totals.get(name, [])
            summary[f"max_{stem}"] = max(values) if values else None
            summary[f"mean_{stem}"] = sum(values) / len(values) if values else None
        return summary


class RunMetrics:
    """`with RunMetrics(url) as metrics:` around a run; then metrics.summary() (all None when the server
    has no pdserve /metrics, e.g. an external server)."""

    def __init__(self, url: str, api_key: str | None = None, interval_s: float = 1.0) -> None:
        self.url = url
        self.api_key = api_key
        self.sampler = QueueSampler(url, api_key, interval_s)
        self.before: dict | None = None
        self.after: dict | None = None

    def _counters(self) -> dict | None:
        try:
            return counters_by_engine(scrape_metrics(self.url, self.api_key))
        except (OSError, ValueError):
            return None

    def __enter__(self) -> RunMetrics:
        self.before = self._counters()
        self.sampler.__enter__()
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.sampler.__exit__()
        self.after = self._counters()

    def summary(self) -> dict[str, float | None]:
        if self.before is None or not self.after:
            counters = dict.fromkeys(COUNTER_FIELDS)
        else:
            counters = summarize_counters(counter_deltas(self.before, self.after))
        return {**counters, **self.sampler.summary()}
