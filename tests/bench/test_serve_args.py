"""`pdserve bench` arguments: SLOs, metadata, base URLs and option checks, each refusal naming the fix."""

from __future__ import annotations

import pytest

from pdserve.bench.serve import base_url_of, check_args
from pdserve.bench.serve_metrics import parse_slos
from pdserve.bench.serve_results import METRIC_KEYS, parse_metadata
from pdserve.cli import build_parser


def bench_args(*argv: str):
    return build_parser().parse_args(["bench", *argv])


def test_goodput_slos_are_parsed_in_milliseconds():
    """One parser for bench's --goodput, sweep's --goodput and plan's --slo."""
    assert parse_slos(["ttft:2000", "TPOT:50.5", "e2el:9000"]) == {"ttft": 2000.0, "tpot": 50.5, "e2el": 9000.0}
    assert parse_slos(None) == {}


@pytest.mark.parametrize("item", ["itl:5", "ttft", "ttft:", "ttft:abc", "tpot:0", "e2el:-3", "ttft:inf", "ttft:nan"])
def test_bad_goodput_slos_are_refused(item):
    with pytest.raises(ValueError, match="--goodput .*METRIC:MILLISECONDS"):
        parse_slos([item])


def test_metadata_is_key_value_and_cannot_shadow_a_result():
    assert parse_metadata(["config=1P1D", "note=a=b"], set(METRIC_KEYS)) == {"config": "1P1D", "note": "a=b"}
    with pytest.raises(ValueError, match="not KEY=VALUE"):
        parse_metadata(["config"], set())
    with pytest.raises(ValueError, match="'mean_ttft_ms' is a result key"):
        parse_metadata(["mean_ttft_ms=1"], set(METRIC_KEYS))


def test_base_urls_pasted_with_v1_or_a_slash_are_the_server_root():
    assert base_url_of("http://h:8000/v1/") == base_url_of("http://h:8000/") == "http://h:8000"


@pytest.mark.parametrize(("argv", "message"), [
    (("--num-prompts", "0"), "--num-prompts 0 must be at least 1"),
    (("--max-concurrency", "0"), "--max-concurrency 0"),
    (("--request-rate", "0"), "--request-rate 0.0 must be above 0"),
    (("--burstiness", "-1"), "--burstiness -1.0"),
    (("--dataset", "sharegpt"), "pass --dataset-path FILE"),
    (("--base-url", "127.0.0.1:8000"), "not an http"),
    (("--request-timeout", "0"), "--request-timeout"),
    (("--request-timeout", "inf"), "--request-timeout inf must be a positive, finite number"),
    (("--request-rate", "1e-300", "--num-prompts", "5"),
     r"--request-rate 1e-300 spreads --num-prompts 5 over about 4e\+300 s of arrivals, more than a day \(86400 s\): "
     "raise --request-rate, or use inf for all at once"),
    (("--request-rate", "0.01"), r"--num-prompts 1000 over about 9\.99e\+04 s"),  # the default 1000 prompts
])
def test_bad_options_are_refused_before_anything_runs(argv, message):
    with pytest.raises(ValueError, match=message):
        check_args(bench_args(*argv))


@pytest.mark.parametrize(("rate", "num_prompts"), [("inf", "1000000"), ("0.1", "50"), ("0.1", "8641"),
                                                   ("1e-300", "1")])
def test_rates_whose_arrivals_end_within_a_day_are_taken(rate, num_prompts):
    # the last of N arrivals comes after N - 1 gaps: 8641 at 0.1/s is exactly a day, and 1 request is sent at once
    check_args(bench_args("--request-rate", rate, "--num-prompts", num_prompts))


def test_defaults_follow_vllm_bench_serve():
    args = bench_args()
    check_args(args)
    assert (args.num_prompts, args.input_len, args.request_rate, args.burstiness) == (1000, 1024, float("inf"), 1.0)
    assert args.endpoint == "/v1/completions" and args.dataset == "random" and args.max_concurrency is None
