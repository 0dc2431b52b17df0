"""Prometheus metrics of one router (prometheus_client, a registry per router).

Request metrics are recorded as requests end. Engine metrics are read at scrape time from what
the engines last reported (/metrics asks every engine first), so an engine that left routing
simply disappears from the next scrape. Engines report cumulative totals (KV bytes, transfers and their
summed time, prefix-cache lookups), so the KV transfer latency is a mean (seconds / transfers), not a
histogram.
"""

from __future__ import annotations

from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, ProcessCollector
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from pdserve.control.messages import EngineStats, KVSideStats
from pdserve.router.link import EngineLink
from pdserve.router.policies import RoutingPolicy
from pdserve.router.registry import DUAL

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
TPOT_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 1.0, 2.5)

# (name, help, EngineStats field); gauges are levels, counters are the engines' cumulative totals
ENGINE_GAUGES = (
    ("pdserve_kv_blocks_used", "KV cache blocks in use", "kv_blocks_used"),
    ("pdserve_kv_blocks_total", "KV cache blocks the engine has", "kv_blocks_total"),
    ("pdserve_num_requests_waiting", "requests waiting to be scheduled", "num_waiting"),
    ("pdserve_num_requests_running", "requests in the running batch", "num_running"),
    ("pdserve_num_requests_waiting_for_remote_kv", "requests waiting for KV from a prefill engine",
     "num_waiting_for_remote_kv"),
    ("pdserve_queued_prefill_tokens", "prompt tokens waiting to be prefilled", "queued_prefill_tokens"),
)
SIDE = " (role: the side of the transfer; a dual-role engine has a series for each)"
# the KV counters: labelled with the role the engine took in the transfers they count
KV_COUNTERS = (
    ("pdserve_kv_bytes_sent", "KV bytes sent to decode engines" + SIDE, "kv_bytes_sent"),
    ("pdserve_kv_bytes_received", "KV bytes received from prefill engines" + SIDE, "kv_bytes_received"),
    ("pdserve_kv_transfers_failed", "KV transfers that failed" + SIDE, "num_kv_transfers_failed"),
    ("pdserve_kv_transfers", "KV transfers completed: verified (decode side), acked (prefill side)" + SIDE,
     "num_kv_transfers"),
    ("pdserve_kv_transfer_seconds", "summed time of completed KV transfers: decode side, KVWant sent to "
     "KVDone verified; prefill side, prompt computed to KVAck (the part compute did not hide); divide "
     "by pdserve_kv_transfers of the same role for the mean" + SIDE, "kv_transfer_seconds"),
)
ENGINE_COUNTERS = KV_COUNTERS + (
    ("pdserve_num_preemptions", "requests preempted for lack of KV blocks", "num_preemptions"),
    ("pdserve_prefix_cache_queries", "tokens of admitted requests looked up in the prefix cache",
     "prefix_cache_queries"),
    ("pdserve_prefix_cache_hits", "tokens found in the prefix cache (KV reused, not computed); divide by "
     "pdserve_prefix_cache_queries for the hit rate", "prefix_cache_hits"),
)
KV_FIELDS = frozenset(attribute for _, _, attribute in KV_COUNTERS)


class EngineCollector(Collector):
    """Per-engine series, labelled engine (id) and role, from the registry's links. A KV counter's role is the side
    of the transfers it counts: a dual-role engine has a "prefill" and a "decode" series of each (its other series
    say "dual")."""

    def __init__(self, links: dict[str, EngineLink]) -> None:
        self.links = links

    def collect(self) -> Iterator[Metric]:
        labels = ["engine", "role"]
        links = [link for link in self.links.values() if link.info is not None]
        up = GaugeMetricFamily("pdserve_engine_up", "1 while the engine is in routing", labels=labels)
        inflight = GaugeMetricFamily("pdserve_engine_requests_in_flight",
                                     "requests the router has open on the engine", labels=labels)
        for link in links:
            up.add_metric([link.label, link.role], 1.0 if link.up else 0.0)
            inflight.add_metric([link.label, link.role], link.num_inflight)
        yield up
        yield inflight
        reporting = [link for link in links if link.stats is not None]
        for name, help_text, attribute in ENGINE_GAUGES:
            family = GaugeMetricFamily(name, help_text, labels=labels)
            for link in reporting:
                family.add_metric([link.label, link.role], getattr(link.stats, attribute))
            yield family
        for name, help_text, attribute in ENGINE_COUNTERS:
            family = CounterMetricFamily(name, help_text, labels=labels)
            for link in reporting:
                for role, stats in _counter_sources(link, attribute):
                    family.add_metric([link.label, role], getattr(stats, attribute))
            yield family


def _counter_sources(link: EngineLink, attribute: str) -> list[tuple[str, EngineStats | KVSideStats]]:
    """(role label, stats) of an engine's series of one counter: a dual-role engine's KV counters as two series, the
    transfers it made as a prefill engine (role "prefill") and as a decode engine (role "decode"), so that a KV
    counter's role always names the side it counts; any other counter, and every fixed-role engine's, as one."""
    if link.role == DUAL and attribute in KV_FIELDS:
        return [("prefill", link.stats.kv_prefill_side), ("decode", link.stats.kv_decode_side)]
    return [(link.role, link.stats)]


class RoutingCollector(Collector):
    """The routing policy's decisions by path, the adaptive policy's lean changes and each engine's lean now, from
    the policy's own counts (router/policies.py, router/adaptive_policy.py) at scrape time."""

    def __init__(self, policy: RoutingPolicy, links: dict[str, EngineLink]) -> None:
        self.policy = policy
        self.links = links

    def collect(self) -> Iterator[Metric]:
        decisions = CounterMetricFamily("pdserve_router_routing_decisions", "requests routed, by path: local (the "
                                        "decode engine prefills them) or disaggregated (a prefill engine does)",
                                        labels=["path"])
        for path, count in self.policy.decisions.items():
            decisions.add_metric([path], count)
        yield decisions
        changes = CounterMetricFamily("pdserve_router_adaptive_lean_changes", "changes of a dual-role engine's lean "
                                      "(--routing adaptive), by the lean taken: prefill, decode, none",
                                      labels=["lean"])
        for lean, count in self.policy.lean_changes.items():
            changes.add_metric([lean], count)
        yield changes
        leans = GaugeMetricFamily("pdserve_router_adaptive_lean", "each engine's lean now (--routing adaptive): "
                                  "1 prefill, -1 decode, 0 none", labels=["engine", "role"])
        for address, link in sorted(self.links.items()):
            if link.up and link.info is not None:
                leans.add_metric([link.label, link.role], self.policy.lean_of(address))
        yield leans


class RouterMetrics:
    def __init__(self, links: dict[str, EngineLink], policy: RoutingPolicy | None = None) -> None:
        self.registry = CollectorRegistry()
        ProcessCollector(registry=self.registry)  # process_cpu_seconds_total and the rest: the router's own CPU
        self.requests = Counter("pdserve_requests", "HTTP API requests by endpoint and status code",
                                ["endpoint", "status"], registry=self.registry)
        self.finished = Counter("pdserve_finished_choices", "choices finished, by finish reason",
                                ["finish_reason"], registry=self.registry)
        self.in_flight = Gauge("pdserve_requests_in_flight", "API requests being served",
                               registry=self.registry)
        self.prompt_tokens = Counter("pdserve_prompt_tokens", "prompt tokens of finished requests",
                                     registry=self.registry)
        self.generation_tokens = Counter("pdserve_generation_tokens", "tokens generated",
                                         registry=self.registry)
        self.ttft = Histogram("pdserve_time_to_first_token_seconds", "arrival to first token",
                              buckets=LATENCY_BUCKETS, registry=self.registry)
        self.tpot = Histogram("pdserve_time_per_output_token_seconds", "mean time per token after the first",
                              buckets=TPOT_BUCKETS, registry=self.registry)
        self.itl = Histogram("pdserve_inter_token_latency_seconds", "time between a choice's successive token "
                             "deliveries (one observation per delivery after the first)",
                             buckets=TPOT_BUCKETS, registry=self.registry)
        self.e2e = Histogram("pdserve_e2e_request_latency_seconds", "arrival to last token",
                             buckets=LATENCY_BUCKETS, registry=self.registry)
        self.migrations = Counter("pdserve_router_migrations", "streams whose decode engine was lost mid-stream: "
                                  "resumed on another engine, or failed (none within --migration-timeout)",
                                  ["outcome"], registry=self.registry)
        self.registry.register(EngineCollector(links))
        if policy is not None:
            self.registry.register(RoutingCollector(policy, links))
        # labelled series, each looked up once: labels() checks its arguments and takes a lock on every call
        self._requests_of: dict[tuple[str, str], Counter] = {}
        self._finished_of: dict[str, Counter] = {}

    def count_request(self, endpoint: str, status: str) -> None:
        """One answered API request (a handful of endpoints x status codes: a bounded set of series)."""
        series = self._requests_of.get((endpoint, status))
        if series is None:
            series = self._requests_of[(endpoint, status)] = self.requests.labels(endpoint, status)
        series.inc()

    def count_finished(self, finish_reason: str) -> None:
        """One finished choice (stop, length, ...)."""
        series = self._finished_of.get(finish_reason)
        if series is None:
            series = self._finished_of[finish_reason] = self.finished.labels(finish_reason)
        series.inc()

    def count_migration(self, outcome: str) -> None:
        """One migration of a choice: "resumed" or "failed"."""
        self.migrations.labels(outcome).inc()

    def observe_request(self, *, ttft: float | None, e2e: float, num_prompt_tokens: int,
                        num_generated_tokens: int, itls: list[float] = ()) -> None:
        self.e2e.observe(e2e)
        for gap in itls:
            self.itl.observe(gap)
        self.prompt_tokens.inc(num_prompt_tokens)
        self.generation_tokens.inc(num_generated_tokens)
        if ttft is not None:
            self.ttft.observe(ttft)
            if num_generated_tokens > 1:
                self.tpot.observe((e2e - ttft) / (num_generated_tokens - 1))
