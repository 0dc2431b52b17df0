"""Monitoring with real parts: a real `pdserve up` scraped by a real Prometheus (Debian's `prometheus`
package; .ci/run installs it), PromQL over the request histograms, `promtool check config` on the shipped
config, and the shipped Grafana dashboard checked against what /metrics really exposes."""

from __future__ import annotations

import json
import math
import re
import shutil
import socket
import subprocess
import time
from pathlib import Path

import httpx
import openai
import pytest
import yaml

from tests.router.conftest import REPO, UpProcess, scrape

pytestmark = pytest.mark.monitoring

MONITORING = REPO / "deploy" / "monitoring"
DASHBOARD = MONITORING / "grafana" / "dashboards" / "pdserve.json"
PROMETHEUS_TIMEOUT_S = 60
needs_prometheus = pytest.mark.skipif(
    shutil.which("prometheus") is None or shutil.which("promtool") is None,
    reason="no prometheus/promtool on PATH: install Debian's `prometheus` package (.ci/run does)")


@pytest.fixture(scope="module")
def served(model_factory, tmp_path_factory):
    """1P1D with a few streamed requests behind it, so every histogram and engine series has samples."""
    up = UpProcess(model_factory("llama"), tmp_path_factory.mktemp("up-monitoring"), "--num-prefill", "1",
                   "--num-decode", "1")
    yield up
    assert up.stop() == 0, up.logs()


def send_requests(url: str, count: int = 3) -> None:
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0)
    for index in range(count):
        stream = client.completions.create(model=client.models.list().data[0].id, prompt=f"count {index}:",
                                           max_tokens=6, temperature=0, stream=True)
        assert sum(1 for _ in stream) >= 1


def dashboard_exprs() -> list[str]:
    dashboard = json.loads(DASHBOARD.read_text())
    return [target["expr"] for panel in dashboard["panels"] for target in panel["targets"]]


def test_every_metric_the_dashboard_queries_is_in_metrics(served):
    send_requests(served.url)
    exposed = set(scrape(served.url))  # sample names: _total, _bucket, _sum, _count included
    queried = {name for expr in dashboard_exprs() for name in re.findall(r"\bpdserve_[a-z_]+\b", expr)}
    assert len(queried) >= 15
    assert sorted(queried - exposed) == []
    titles = {panel["title"] for panel in json.loads(DASHBOARD.read_text())["panels"]}
    assert {"Time to first token", "Time per output token", "Inter-token latency", "End-to-end latency",
            "KV blocks used per engine", "Prefix-cache hit rate", "Engines up"} <= titles


def test_itl_histogram_counts_one_gap_per_token_after_the_first(served):
    before = scrape(served.url).get("pdserve_inter_token_latency_seconds_count", {}).get((), 0.0)
    client = openai.OpenAI(base_url=f"{served.url}/v1", api_key="unused", max_retries=0)
    answer = client.completions.create(model=client.models.list().data[0].id, prompt="gaps", max_tokens=5,
                                       temperature=0, extra_body={"ignore_eos": True})
    assert answer.usage.completion_tokens == 5
    after = scrape(served.url)["pdserve_inter_token_latency_seconds_count"][()]
    # a non-streamed request is relayed token by token too: at most 4 gaps for 5 tokens (fewer if the
    # engine delivered several tokens in one message), at least 1
    assert 1 <= after - before <= 4


@needs_prometheus
def test_promtool_accepts_the_shipped_config():
    result = subprocess.run(["promtool", "check", "config", str(MONITORING / "prometheus.yml")],
                            check=False, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture
def prometheus(served, tmp_path):
    """A real Prometheus with the shipped config, pointed at this test's router, scraping every second."""
    config = yaml.safe_load((MONITORING / "prometheus.yml").read_text())
    config["global"]["scrape_interval"] = "1s"
    config["scrape_configs"][0]["static_configs"][0]["targets"] = [served.url.removeprefix("http://")]
    (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(config))
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    with open(tmp_path / "prometheus.log", "w") as log:
        process = subprocess.Popen(["prometheus", f"--config.file={tmp_path / 'prometheus.yml'}",
                                    f"--storage.tsdb.path={tmp_path / 'data'}",
                                    f"--web.listen-address=127.0.0.1:{port}"], stdout=log, stderr=subprocess.STDOUT)
        try:
            wait_for(lambda: query(url, 'up{job="pdserve"}') == [1.0], "Prometheus scraping the router",
                     tmp_path / "prometheus.log")
            yield url
        finally:
            process.terminate()
            process.wait(timeout=30)


def query(url: str, promql: str) -> list[float] | None:
    """The values of an instant query, or None when Prometheus is not answering yet."""
    try:
        body = httpx.get(f"{url}/api/v1/query", params={"query": promql}, timeout=5).json()
    except (httpx.HTTPError, ValueError):
        return None
    assert body["status"] == "success", (promql, body)
    return [float(item["value"][1]) for item in body["data"]["result"]]


def wait_for(predicate, what: str, log: Path) -> None:
    deadline = time.monotonic() + PROMETHEUS_TIMEOUT_S
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.5)
    raise AssertionError(f"timed out waiting for {what}; Prometheus said:\n{log.read_text()[-3000:]}")


@needs_prometheus
def test_prometheus_computes_ttft_quantiles_and_every_dashboard_query(served, prometheus, tmp_path):
    send_requests(served.url)  # after Prometheus's first scrape, so rate() sees the counts rise
    ttft_p90 = "histogram_quantile(0.9, sum by (le) (rate(pdserve_time_to_first_token_seconds_bucket[1m])))"

    def finite_quantile() -> bool:
        values = query(prometheus, ttft_p90)
        return bool(values) and all(math.isfinite(value) and value > 0 for value in values)

    wait_for(finite_quantile, "a finite TTFT p90 from Prometheus", tmp_path / "prometheus.log")
    assert query(prometheus, "sum(pdserve_engine_up)") == [2.0]
    for expr in dashboard_exprs():  # valid PromQL over real series (an error fails inside query())
        assert query(prometheus, expr.replace("$__rate_interval", "1m")) is not None, expr
