"""The monitoring profile with real parts: the shipped Prometheus config passes `promtool check config`,
a real Prometheus scrapes a real `pdserve up` and answers a histogram_quantile over the TTFT histogram,
and every metric the Grafana dashboard queries exists in the router's /metrics."""

from __future__ import annotations

import json
import os
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

from tests.router.conftest import UpProcess, scrape
from tests.router.test_launcher_and_compose import load_compose

REPO = Path(__file__).resolve().parents[2]
MONITORING = REPO / "monitoring"
DASHBOARD = MONITORING / "grafana" / "dashboards" / "pdserve.json"
TTFT_P50 = "histogram_quantile(0.5, sum by (le) (rate(pdserve_time_to_first_token_seconds_bucket[1m])))"


def prometheus_tool(name: str) -> str:
    """The Debian package's binary; CI installs it (.ci/run), elsewhere the test is skipped without it."""
    path = shutil.which(name)
    if path is None:
        if os.environ.get("CI"):
            pytest.fail(f"{name} is missing in CI: .ci/run installs Debian's prometheus package")
        pytest.skip(f"{name} is not installed (apt-get install prometheus)")
    return path


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def dashboard_metrics() -> set[str]:
    panels = json.loads(DASHBOARD.read_text())["panels"]
    expressions = [target["expr"] for panel in panels for target in panel["targets"]]
    return {name for expr in expressions for name in re.findall(r"\bpdserve_[a-z0-9_]+", expr)}


def test_shipped_prometheus_config_passes_promtool():
    result = subprocess.run([prometheus_tool("promtool"), "check", "config", str(MONITORING / "prometheus.yml")],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr


def test_compose_monitoring_profile_mounts_the_shipped_files():
    for name in ("compose.yaml", "compose.cpu.yaml"):
        services = load_compose(name)["services"]
        for service in ("prometheus", "grafana"):
            assert services[service]["profiles"] == ["monitoring"], "only with --profile monitoring"
            for volume in services[service]["volumes"]:
                source = volume.split(":")[0]
                assert not source.startswith("./") or (REPO / source).exists(), f"{name} {service}: {source}"
        assert "router:8000" in (MONITORING / "prometheus.yml").read_text()
    datasource = yaml.safe_load((MONITORING / "grafana/provisioning/datasources/prometheus.yml").read_text())
    uid = datasource["datasources"][0]["uid"]
    panels = json.loads(DASHBOARD.read_text())["panels"]
    assert all(panel["datasource"]["uid"] == uid for panel in panels), "panels use the provisioned data source"
    titles = " ".join(panel["title"] for panel in panels)
    for topic in ("TTFT", "TPOT", "ITL", "End-to-end", "KV blocks", "KV bytes", "KV transfer", "Prefix cache",
                  "Engines up", "429", "499", "Requests per second"):
        assert topic in titles, f"the dashboard has no {topic} panel"


@pytest.fixture(scope="module")
def cluster(tiny_model, tmp_path_factory):
    up = UpProcess(tiny_model, tmp_path_factory.mktemp("up-monitoring"), "--num-prefill", "1", "--num-decode", "1",
                   "--served-model-name", "tiny")
    yield up
    assert up.stop() == 0, up.logs()


@pytest.fixture(scope="module")
def prometheus(cluster, tmp_path_factory):
    """A real Prometheus with the shipped config, its target pointed at the cluster's router."""
    binary = prometheus_tool("prometheus")
    folder = tmp_path_factory.mktemp("prometheus")
    config = yaml.safe_load((MONITORING / "prometheus.yml").read_text())
    config["global"]["scrape_interval"] = "1s"
    config["scrape_configs"][0]["static_configs"][0]["targets"] = [cluster.url.removeprefix("http://")]
    (folder / "prometheus.yml").write_text(yaml.safe_dump(config))
    url = f"http://127.0.0.1:{free_port()}"
    log = open(folder / "prometheus.log", "w")
    process = subprocess.Popen([binary, f"--config.file={folder / 'prometheus.yml'}",
                                f"--storage.tsdb.path={folder / 'data'}", f"--web.listen-address={url[7:]}"],
                               stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_for(lambda: httpx.get(f"{url}/-/ready", timeout=2).status_code == 200, 60, "Prometheus ready",
                 folder / "prometheus.log")
        yield url
    finally:
        process.terminate()
        process.wait(timeout=30)
        log.close()


def wait_for(predicate, timeout: float, what: str, log: Path | None = None):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            result = predicate()
        except httpx.HTTPError:
            result = None
        if result:
            return result
        time.sleep(0.5)
    raise AssertionError(f"{what} not reached in {timeout}s" + (f":\n{log.read_text()[-3000:]}" if log else ""))


def query(prometheus: str, promql: str) -> list[dict]:
    body = httpx.get(f"{prometheus}/api/v1/query", params={"query": promql}, timeout=10).json()
    assert body["status"] == "success", body
    return body["data"]["result"]


def test_prometheus_answers_a_ttft_quantile_for_real_requests(cluster, prometheus):
    client = openai.OpenAI(base_url=f"{cluster.url}/v1", api_key="unused", max_retries=0, timeout=60)
    wait_for(lambda: query(prometheus, 'up{job="pdserve"} == 1'), 30, "the router scraped")
    for index in range(6):
        client.completions.create(model="tiny", prompt=f"request {index}: the KV cache", max_tokens=4)

    def ttft_p50() -> float | None:
        values = [float(sample["value"][1]) for sample in query(prometheus, TTFT_P50)]
        return next((v for v in values if v == v and v > 0), None)  # NaN until two scrapes saw the requests

    p50 = wait_for(ttft_p50, 60, "a TTFT quantile")
    assert 0 < p50 < 60
    assert query(prometheus, 'sum(pdserve_engine_up)')[0]["value"][1] == "2", "both engines up"


def itl_count(url: str) -> float:
    return scrape(url).get("pdserve_inter_token_latency_seconds_count", {}).get((), 0.0)


def test_every_metric_the_dashboard_queries_is_in_metrics(cluster):
    client = openai.OpenAI(base_url=f"{cluster.url}/v1", api_key="unused", max_retries=0, timeout=60)
    before = itl_count(cluster.url)
    client.completions.create(model="tiny", prompt="so that every histogram has a sample", max_tokens=4,
                              stream=False, extra_body={"ignore_eos": True})
    assert 1 <= itl_count(cluster.url) - before <= 3, "one inter-token gap per token delivery after the first"
    shown = set(scrape(cluster.url))
    queried = dashboard_metrics()
    assert len(queried) >= 15
    assert queried <= shown, f"the dashboard queries metrics /metrics does not have: {sorted(queried - shown)}"
