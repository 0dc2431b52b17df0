"""`pdserve bench` metrics against values computed by hand from synthetic timestamps (vLLM's definitions)."""

from __future__ import annotations

import math

import pytest

from pdserve.bench.serve_metrics import RequestResult, compute_metrics, tpot

# A: first text at 0.10 s, then chunks at 0.15, 0.25, 0.30 (the end): 4 tokens.
A = RequestResult(success=True, input_len=10, output_len=4, ttft=0.10, itls=[0.05, 0.10, 0.05], latency=0.30)
# B: one token, so no TPOT.
B = RequestResult(success=True, input_len=20, output_len=1, ttft=0.20, itls=[], latency=0.20)
# C: 2 tokens, the second 0.1 s after the first, the stream ends 0.1 s later.
C = RequestResult(success=True, input_len=30, output_len=2, ttft=0.30, itls=[0.10], latency=0.50)
FAILED = RequestResult(success=False, error="HTTP 500: boom", input_len=40)
RESULTS = [A, B, C, FAILED]


def test_tpot_is_the_time_after_the_first_token_per_later_token():
    assert tpot(A) == pytest.approx((0.30 - 0.10) / 3)
    assert tpot(C) == pytest.approx(0.20)
    assert tpot(B) is None


def test_counts_and_throughputs_count_completed_requests_only():
    metrics = compute_metrics(RESULTS, duration_s=2.0)
    assert (metrics["completed"], metrics["failed"]) == (3, 1)
    assert (metrics["total_input_tokens"], metrics["total_output_tokens"]) == (60, 7)
    assert metrics["duration"] == 2.0
    assert metrics["request_throughput"] == pytest.approx(1.5)
    assert metrics["output_throughput"] == pytest.approx(3.5)
    assert metrics["total_token_throughput"] == pytest.approx(33.5)
    assert metrics["request_goodput"] is None and metrics["slo_attainment"] is None


def test_latency_statistics_in_milliseconds():
    metrics = compute_metrics(RESULTS, duration_s=2.0)
    # TTFT 100, 200, 300 ms; percentiles interpolate linearly between ranks (numpy's default, as vLLM)
    assert metrics["mean_ttft_ms"] == pytest.approx(200.0)
    assert metrics["median_ttft_ms"] == pytest.approx(200.0)
    assert metrics["std_ttft_ms"] == pytest.approx(math.sqrt(20000 / 3))
    assert metrics["p90_ttft_ms"] == pytest.approx(280.0)
    assert metrics["p95_ttft_ms"] == pytest.approx(290.0)
    assert metrics["p99_ttft_ms"] == pytest.approx(298.0)
    # TPOT of A and C only (B has one token): 66.67 and 200 ms
    assert metrics["mean_tpot_ms"] == pytest.approx((200 / 3 + 200) / 2)
    assert metrics["p90_tpot_ms"] == pytest.approx(200 / 3 + 0.9 * (200 - 200 / 3))
    # ITL: every gap of every completed request, 50, 100, 50, 100 ms
    assert metrics["mean_itl_ms"] == pytest.approx(75.0)
    assert metrics["std_itl_ms"] == pytest.approx(25.0)
    assert metrics["p99_itl_ms"] == pytest.approx(100.0)
    # E2EL 300, 200, 500 ms
    assert metrics["mean_e2el_ms"] == pytest.approx(1000 / 3)
    assert metrics["median_e2el_ms"] == pytest.approx(300.0)


@pytest.mark.parametrize(("slos", "num_good"), [
    ({"ttft": 250, "tpot": 100}, 2),  # C's TTFT (300) misses; B's TPOT counts as 0
    ({"tpot": 100}, 2),  # C's TPOT (200) misses
    ({"e2el": 250}, 1),  # only B ends within 250 ms
    ({"ttft": 1000, "tpot": 1000, "e2el": 1000}, 3),
])
def test_goodput_counts_requests_within_every_slo(slos, num_good):
    metrics = compute_metrics(RESULTS, duration_s=2.0, slos_ms=slos)
    assert metrics["request_goodput"] == pytest.approx(num_good / 2.0)
    assert metrics["slo_attainment"] == pytest.approx(num_good / 4)  # the failed request is a miss


def test_a_run_without_completions_reports_zeros():
    metrics = compute_metrics([FAILED], duration_s=1.0, slos_ms={"ttft": 100})
    assert metrics["completed"] == 0 and metrics["failed"] == 1
    assert metrics["mean_ttft_ms"] == 0.0 and metrics["p99_tpot_ms"] == 0.0
    assert metrics["request_goodput"] == 0.0 and metrics["slo_attainment"] == 0.0
