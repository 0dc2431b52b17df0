"""`pdserve sweep`'s parts on their own: xPyD parsing, CPU/GPU plans, the goodput search, SLO attainment,
/metrics differences, summary.csv and the plots from synthetic results."""

from __future__ import annotations

import math
import re
from pathlib import Path

import pytest

from pdserve.bench.sweep_cluster import ClusterSpec, up_command
from pdserve.bench.sweep_goodput import find_goodput
from pdserve.bench.sweep_layouts import (
    Layout,
    cpu_plan,
    device_plan,
    parse_devices,
    parse_external,
    parse_layout,
    parse_layouts,
)
from pdserve.bench.sweep_metrics import QueueSampler, counter_deltas, counters_by_engine, summarize_counters
from pdserve.bench.sweep_results import (
    SUMMARY_COLUMNS,
    RunInfo,
    goodput_from_rows,
    read_csv,
    slo_attainment,
    summary_row,
    write_csv,
)

# ---- layouts ----


@pytest.mark.parametrize("text, prefill, decode", [("1P1D", 1, 1), ("0p2d", 0, 2), (" 12P3D ", 12, 3)])
def test_xpyd_parses(text, prefill, decode):
    layout = parse_layout(text)
    assert (layout.num_prefill, layout.num_decode, layout.num_engines) == (prefill, decode, prefill + decode)
    assert layout.name == f"{prefill}P{decode}D"


@pytest.mark.parametrize("text, says", [("1P", "not xPyD"), ("P1D", "not xPyD"), ("1D1P", "not xPyD"),
                                        ("-1P1D", "not xPyD"), ("1.5P1D", "not xPyD"), ("", "not xPyD"),
                                        ("2P0D", "no decode engine")])
def test_bad_xpyd_is_refused_with_the_fix(text, says):
    with pytest.raises(ValueError, match=says) as error:
        parse_layout(text)
    assert "1P1D" in str(error.value)


def test_a_layout_listed_twice_is_refused():
    with pytest.raises(ValueError, match="1P1D given twice"):
        parse_layouts(["1P1D", "0P2D", "1p1d"])
    assert [layout.name for layout in parse_layouts(["2P1D", "0P2D"])] == ["2P1D", "0P2D"]


def test_adaptive_takes_as_many_dual_role_engines_as_the_largest_static_layout():
    layouts = parse_layouts(["1P2D", "0P2D", "adaptive"])
    assert [(layout.name, layout.num_dual, layout.num_engines) for layout in layouts] == [
        ("1P2D", 0, 3), ("0P2D", 0, 2), ("adaptive:3", 3, 3)]
    assert [layout.name for layout in parse_layouts(["Adaptive"])] == ["adaptive"]  # alone: 2 engines
    assert parse_layout("adaptive:4").num_engines == 4
    with pytest.raises(ValueError, match="adaptive:N with N >= 1"):
        parse_layout("adaptive:0")
    with pytest.raises(ValueError, match="given twice"):
        parse_layouts(["1P1D", "adaptive", "adaptive:2"])


def test_an_adaptive_layout_starts_up_with_dual_role_engines(tmp_path):
    spec = ClusterSpec(model="m", device="cpu", pin_cpus=False)
    command = up_command(spec, parse_layout("adaptive:3"), tmp_path)
    assert command[command.index("--num-engines") + 1] == "3" and "--adaptive" in command
    assert "--num-prefill" not in command and "--num-decode" not in command
    static = up_command(spec, parse_layout("1P1D"), tmp_path)
    assert "--adaptive" not in static and static[static.index("--num-prefill") + 1] == "1"


def test_external_servers():
    server = parse_external("hf=http://127.0.0.1:8000/")
    assert (server.name, server.url, server.num_engines) == ("hf", "http://127.0.0.1:8000", 1)
    assert parse_external("vllm = http://gpu-box:8000/v1/").url == "http://gpu-box:8000"
    for bad in ("http://127.0.0.1:8000", "hf=127.0.0.1:8000", "=http://x", "1P1D=http://x"):
        with pytest.raises(ValueError, match="--base-url"):
            parse_external(bad)


def test_cpu_plan_gives_one_core_per_engine_as_far_as_cores_allow():
    assert cpu_plan(Layout(1, 1), [5, 3, 1, 7]) == [1, 3]
    assert cpu_plan(Layout(2, 1), [0, 1, 2, 3], cores_per_engine=1) == [0, 1, 2]
    assert cpu_plan(Layout(1, 1), list(range(8)), cores_per_engine=2) == [0, 1, 2, 3]
    assert cpu_plan(Layout(2, 2), [0, 1]) == [0, 1]  # fewer cores than engines: they share all there are
    with pytest.raises(ValueError, match="--cores-per-engine"):
        cpu_plan(Layout(1, 1), [0, 1], cores_per_engine=0)


def test_device_plan_gives_one_gpu_per_engine():
    assert device_plan(Layout(1, 2), None) == (["0"], ["1", "2"])
    assert device_plan(Layout(0, 2), parse_devices("4, 5,6")) == ([], ["4", "5"])
    with pytest.raises(ValueError, match="needs 3 GPUs"):
        device_plan(Layout(2, 1), ["0", "1"])
    with pytest.raises(ValueError, match="empty"):
        parse_devices(" , ")


# ---- the goodput search ----


def step_attainment(threshold: float, calls: list[float]):
    """Attainment 1.0 up to `threshold` req/s, then falling (0.85 just above it)."""
    def attainment(rate: float) -> float:
        calls.append(rate)
        return 1.0 if rate <= threshold else max(0.0, 0.85 - (rate - threshold))
    return attainment


@pytest.mark.parametrize("threshold", [0.3, 2.7, 5.0, 37.0])
def test_goodput_search_brackets_then_bisects(threshold):
    calls: list[float] = []
    search = find_goodput(step_attainment(threshold, calls), start_rate=1.0, steps=6)
    assert search.rate <= threshold < search.upper_bound
    assert search.upper_bound - search.rate <= max(threshold, 1.0) / 2 ** 5  # six halvings of the bracket
    assert [rate for rate, _ in search.probes] == calls  # every probe is recorded once, in order
    assert len(set(calls)) == len(calls)


def test_goodput_search_starts_from_rates_already_measured():
    calls: list[float] = []
    known = {1.0: 1.0, 2.0: 0.95, 4.0: 0.4, 8.0: 0.1}
    search = find_goodput(step_attainment(3.0, calls), start_rate=1.0, known=known, steps=3)
    assert calls == [3.0, 3.5, 3.25]  # bisection between 2 (met) and 4 (missed) only
    assert (search.rate, search.upper_bound) == (3.0, 3.25)


def test_goodput_search_when_nothing_or_everything_meets_the_slos():
    nothing = find_goodput(lambda rate: 0.5, start_rate=1.0, steps=2, max_doublings=3)
    assert nothing.rate == 0.0 and nothing.upper_bound == 0.125
    everything = find_goodput(lambda rate: 1.0, start_rate=1.0, steps=2, max_doublings=3)
    assert everything.rate == 8.0 and everything.upper_bound is None
    with pytest.raises(ValueError, match="start rate"):
        find_goodput(lambda rate: 1.0, start_rate=0.0)


# ---- SLOs and summary rows ----


def synthetic_result(ttfts_s, e2els_s, output_lens, errors) -> dict:
    return {"ttfts": ttfts_s, "e2els": e2els_s, "output_lens": output_lens, "errors": errors,
            "itls": [[(e - t) / max(n - 1, 1)] * max(n - 1, 0) for t, e, n in zip(ttfts_s, e2els_s, output_lens)]}


def test_slo_attainment_counts_every_request_failed_ones_as_misses():
    # TPOT = (e2el - ttft) / (n - 1): 10 ms, 10 ms, 30 ms, (failed)
    result = synthetic_result([0.1, 0.3, 0.1, 0.0], [0.13, 0.33, 0.19, 0.0], [4, 4, 4, 0], ["", "", "", "HTTP 500"])
    assert slo_attainment(result, {"ttft": 200}) == pytest.approx(2 / 4)
    assert slo_attainment(result, {"tpot": 20}) == pytest.approx(2 / 4)
    assert slo_attainment(result, {"ttft": 200, "tpot": 20}) == pytest.approx(1 / 4)
    assert slo_attainment(result, {"e2el": 1000}) == pytest.approx(3 / 4)
    assert slo_attainment(result, {}) is None
    del result["e2els"]  # E2EL from TTFT + ITLs when a result has no e2els
    assert slo_attainment(result, {"ttft": 200, "tpot": 20}) == pytest.approx(1 / 4)


# ---- /metrics ----

ENGINES = ("prefill", "decode")


def exposition(counters: dict[str, tuple[float | None, float | None]], router_cpu_s: float,
               waiting: tuple[float, float] | None = None) -> str:
    """/metrics text as the router serves it: each pdserve counter's (prefill-0, decode-0) totals (None: that
    engine has none), the engines' waiting gauges, and the router's own CPU."""
    lines = []
    families = [(name, "counter", "_total", values) for name, values in counters.items()]
    families += [("num_requests_waiting", "gauge", "", waiting)] if waiting else []
    for name, kind, suffix, values in families:
        lines.append(f"# TYPE pdserve_{name} {kind}")
        lines += [f'pdserve_{name}{suffix}{{engine="{role}-0",role="{role}"}} {float(value)!r}'
                  for role, value in zip(ENGINES, values) if value is not None]
    return "\n".join([*lines, "# TYPE process_cpu_seconds counter", f"process_cpu_seconds_total {router_cpu_s!r}", ""])


BEFORE = exposition({"kv_bytes_sent": (1000, None), "kv_bytes_received": (None, 1000), "kv_transfers": (2, 2),
                     "kv_transfer_seconds": (0.01, 0.2), "prefix_cache_queries": (100, 100),
                     "prefix_cache_hits": (10, 50)}, router_cpu_s=12.5)
AFTER = exposition({"kv_bytes_sent": (5000, None), "kv_bytes_received": (None, 5000), "kv_transfers": (6, 6),
                    "kv_transfer_seconds": (0.05, 0.6), "prefix_cache_queries": (300, 30),
                    "prefix_cache_hits": (60, 3)}, router_cpu_s=14.0, waiting=(3, 1))


def samples_of(text: str):
    from prometheus_client.parser import text_string_to_metric_families

    return [sample for family in text_string_to_metric_families(text) for sample in family.samples]


def test_metrics_differences_per_run():
    deltas = counter_deltas(counters_by_engine(samples_of(BEFORE)), counters_by_engine(samples_of(AFTER)))
    summary = summarize_counters(deltas)
    assert summary["kv_bytes_sent"] == 4000 and summary["kv_bytes_received"] == 4000
    assert summary["kv_transfers"] == 4  # the decode side's count, not both sides'
    assert summary["mean_kv_wait_ms"] == pytest.approx(1000 * 0.4 / 4)
    assert summary["mean_kv_transfer_exposed_ms"] == pytest.approx(1000 * 0.04 / 4)
    # the decode engine restarted (its counters went down): it counts from zero
    assert summary["prefix_cache_queries"] == 200 + 30 and summary["prefix_cache_hits"] == 50 + 3
    assert summary["prefix_cache_hit_rate"] == pytest.approx(53 / 230)
    assert summary["server_cpu_s"] == pytest.approx(1.5)  # the router's own CPU during the run
    assert summarize_counters({})["mean_kv_wait_ms"] is None


def dual_exposition(sides: dict[tuple[str, str], dict[str, float]]) -> str:
    """/metrics text of dual-role engines as the router serves it: each KV counter once per (engine, side), the
    prefix-cache counters under role "dual"."""
    names = sorted({name for values in sides.values() for name in values})
    lines = []
    for name in names:
        lines.append(f"# TYPE pdserve_{name} counter")
        lines += [f'pdserve_{name}_total{{engine="{engine}",role="{role}"}} {float(values.get(name, 0))!r}'
                  for (engine, role), values in sides.items()]
    lines += ["# TYPE pdserve_prefix_cache_queries counter",
              *(f'pdserve_prefix_cache_queries_total{{engine="engine-{i}",role="dual"}} 0.0' for i in (0, 1))]
    return "\n".join([*lines, ""])


def test_transfers_between_dual_engines_count_once_on_their_decode_side():
    """engine-0 prefilled 3 prompts that engine-1 pulled, engine-1 prefilled 1 that engine-0 pulled: 4 transfers, not
    8; the KV wait is the decode sides' mean, the exposed time the prefill sides'."""
    before = dual_exposition({("engine-0", "prefill"): {}, ("engine-0", "decode"): {},
                              ("engine-1", "prefill"): {}, ("engine-1", "decode"): {}})
    after = dual_exposition({
        ("engine-0", "prefill"): {"kv_bytes_sent": 3000, "kv_transfers": 3, "kv_transfer_seconds": 0.03},
        ("engine-0", "decode"): {"kv_bytes_received": 1000, "kv_transfers": 1, "kv_transfer_seconds": 0.2},
        ("engine-1", "prefill"): {"kv_bytes_sent": 1000, "kv_transfers": 1, "kv_transfer_seconds": 0.01},
        ("engine-1", "decode"): {"kv_bytes_received": 3000, "kv_transfers": 3, "kv_transfers_failed": 1,
                                 "kv_transfer_seconds": 0.6}})
    summary = summarize_counters(counter_deltas(counters_by_engine(samples_of(before)),
                                                counters_by_engine(samples_of(after))))
    assert summary["kv_transfers"] == 4 and summary["kv_transfers_failed"] == 1
    assert summary["kv_bytes_sent"] == summary["kv_bytes_received"] == 4000
    assert summary["mean_kv_wait_ms"] == pytest.approx(1000 * 0.8 / 4)
    assert summary["mean_kv_transfer_exposed_ms"] == pytest.approx(1000 * 0.04 / 4)


def test_queue_sampler_sums_engines_per_sample():
    sampler = QueueSampler("http://unused")
    sampler.add(samples_of(AFTER))
    sampler.add(samples_of(AFTER.replace("} 3.0", "} 7.0")))
    summary = sampler.summary()
    assert summary["max_waiting"] == 8.0 and summary["mean_waiting"] == 6.0
    assert summary["max_queued_prefill_tokens"] is None  # never reported


# ---- summary.csv and plots ----


def synthetic_rows() -> list[dict]:
    rows = []
    for config, engines, slope in (("1P1D", 2, 1.0), ("0P2D", 2, 2.0)):
        for rate in (1.0, 2.0, 4.0):
            n = 4
            ttft = 0.05 * slope * rate
            result = {"completed": n, "failed": 0, "duration": 4 / rate, "total_input_tokens": 64,
                      "total_output_tokens": 16, "request_throughput": rate, "output_throughput": 4 * rate,
                      "p90_ttft_ms": 1000 * ttft, "p90_tpot_ms": 10 * slope, "p99_itl_ms": 12 * slope * rate,
                      **synthetic_result([ttft] * n, [ttft + 0.03 * slope] * n, [4] * n, [""] * n)}
            info = RunInfo(config, engines, "sweep", rate, None, 1 if config == "1P1D" else 0, engines - 1)
            rows.append(summary_row(info, result, {"kv_bytes_sent": 10.0 * rate}, {"ttft": 250}, f"{config}.json"))
    return rows


def test_summary_csv_round_trips_and_goodput_from_listed_rates(tmp_path):
    rows = synthetic_rows()
    write_csv(tmp_path / "summary.csv", rows, SUMMARY_COLUMNS)
    back = read_csv(tmp_path / "summary.csv")
    assert len(back) == 6 and list(back[0]) == SUMMARY_COLUMNS
    assert back[0]["config"] == "1P1D" and back[0]["request_rate"] == 1.0 and back[0]["kv_bytes_sent"] == 10.0
    assert back[0]["max_concurrency"] is None and back[0]["error"] is None
    # TTFT = 50 ms x slope x rate against a 250 ms SLO: 1P1D meets it up to 4, 0P2D up to 2
    assert [row["slo_attainment"] for row in back if row["config"] == "0P2D"] == [1.0, 1.0, 0.0]
    assert goodput_from_rows(back, "1P1D") == (4.0, None) and goodput_from_rows(back, "0P2D") == (2.0, 4.0)
    assert goodput_from_rows(back, "2P1D") is None


def test_plots_are_written_and_load(tmp_path):
    from matplotlib.image import imread

    from pdserve.bench.sweep_plots import load_axis, series, write_plots

    rows = synthetic_rows()
    rows.append({**rows[0], "request_rate": math.inf})  # not plottable against rate: left out
    goodputs = [{"config": "1P1D", "goodput_per_engine": 2.0, "upper_bound": None},
                {"config": "0P2D", "goodput_per_engine": 1.0, "upper_bound": 4.0}]
    written = write_plots(rows, goodputs, tmp_path)
    names = {"ttft_p90.png", "tpot_p90.png", "itl_p99.png", "slo_attainment.png", "goodput_per_engine.png"}
    assert {path.name for path in written} == names
    for name in names:
        image = imread(tmp_path / name)
        assert image.ndim == 3 and image.shape[0] > 100 and image.shape[1] > 100
    assert load_axis(rows) == ("request_rate", "request rate (req/s)")
    lines = series(rows, "request_rate", "p90_ttft_ms")
    assert set(lines) == {"1P1D", "0P2D"} and lines["0P2D"] == ([1.0, 2.0, 4.0], [100.0, 200.0, 400.0])


def test_concurrency_sweeps_plot_against_concurrency():
    from pdserve.bench.sweep_plots import load_axis, series

    rows = [{"config": "1P1D", "request_rate": math.inf, "max_concurrency": c, "p90_ttft_ms": 10.0 * c}
            for c in (1, 4)]
    assert load_axis(rows)[0] == "max_concurrency"
    assert series(rows, "max_concurrency", "p90_ttft_ms") == {"1P1D": ([1, 4], [10.0, 40.0])}


def test_the_comparison_names_the_winner_and_by_how_much():
    from pdserve.bench.sweep_report import compare, describe_workload, markdown_table

    rows = synthetic_rows()  # 1P1D meets the 250 ms TTFT SLO up to 4 req/s, 0P2D up to 2
    goodputs = [{"config": "1P1D", "num_engines": 2, "goodput": 4.0, "goodput_per_engine": 2.0, "upper_bound": None},
                {"config": "0P2D", "num_engines": 2, "goodput": 2.0, "goodput_per_engine": 1.0, "upper_bound": 4.0}]
    comparison = compare(rows, goodputs, {"ttft": 250})
    assert comparison.winner == "1P1D"
    assert comparison.sentence == ("1P1D wins: at least 2 req/s per engine (4 in total on 2) against 0P2D's 1 req/s "
                                   "per engine (2 in total on 2), 2.00x (+100%).")
    assert comparison.headers == ["layout", "engines", "goodput (req/s)", "per engine", "attainment @ 1 req/s",
                                  "attainment @ 2 req/s", "attainment @ 4 req/s", "TTFT p50 (ms)", "TTFT p90 (ms)",
                                  "TPOT p50 (ms)", "TPOT p90 (ms)", "at the highest rate within the SLOs"]
    winner, other = comparison.cells
    assert winner[:4] == ["1P1D (winner)", "2", ">= 4", ">= 2"] and winner[4:7] == ["100%"] * 3
    assert other[:7] == ["0P2D", "2", "2", "1", "100%", "100%", "0%"]
    assert other[8] == "200" and other[-1] == "2 req/s"  # TTFT p90 where 0P2D last met the SLOs
    assert markdown_table(comparison).splitlines()[2].startswith("| 1P1D (winner) | 2 | >= 4 |")
    assert describe_workload(rows) == "about 16 tokens in / 4 out per request, 4 requests per run"
    # no rate within the SLOs: the latencies at the lightest load, said as such
    missed = compare([{**row, "slo_attainment": 0.0} for row in rows],
                     [{**g, "goodput": 0.0, "goodput_per_engine": 0.0} for g in goodputs], {"ttft": 1})
    assert missed.winner is None and missed.cells[1][8:] == ["100", "-", "20", "none met; at 1 req/s"]
    assert missed.sentence.endswith("lower the rates or loosen the SLOs.")  # a tie at 0%: none came closer
    near = [{**row, "slo_attainment": 0.5 if row["config"] == "0P2D" else 0.25} for row in rows]
    assert compare(near, [], {"ttft": 1}).sentence.endswith(" Closest: 0P2D, 50% within the SLOs at 1 req/s "
                                                           "(1P1D: 25%).")


def test_a_sweep_without_a_finite_rate_compares_layouts_by_attainment():
    """--max-concurrencies or a phased schedule runs at rate inf, where goodput in req/s is not defined: the
    sentence must not say no layout met the SLOs when one kept every request within them."""
    from pdserve.bench.sweep_report import compare

    rows = [{**row, "request_rate": math.inf, "max_concurrency": 8,
             "slo_attainment": 1.0 if row["config"] == "1P1D" else 0.75}
            for row in synthetic_rows() if row["request_rate"] == 1]
    goodputs = [{"config": c, "num_engines": 2, "goodput": 0.0, "goodput_per_engine": 0.0, "upper_bound": None}
                for c in ("1P1D", "0P2D")]
    comparison = compare(rows, goodputs, {"ttft": 250})
    assert comparison.winner == "1P1D"
    assert comparison.sentence.startswith("1P1D wins: 100% of requests within the SLOs against 0P2D's 75%, 25 points")
    tied = compare([{**row, "slo_attainment": 1.0} for row in rows], goodputs, {"ttft": 250})
    assert tied.winner is None and tied.sentence.startswith("No winner: 1P1D and 0P2D both kept 100% within the SLOs")


@pytest.mark.parametrize("goodputs, says", [
    ([(4.0, None), (4.0, None)], "No winner: 1P1D and 0P2D tie at at least 2 req/s per engine"),
    ([(0.0, 1.0), (0.0, 1.0)], "No layout kept 90% of requests within the SLOs"),
    ([(2.0, 4.0), (0.0, 1.0)], "1P1D wins: 1 req/s per engine (2 in total on 2), while 0P2D met the SLOs"),
])
def test_ties_and_no_answer_are_said_plainly(goodputs, says):
    from pdserve.bench.sweep_report import pick_winner

    found = [{"config": config, "num_engines": 2, "goodput": rate, "goodput_per_engine": rate / 2, "upper_bound": upper}
             for config, (rate, upper) in zip(("1P1D", "0P2D"), goodputs)]
    winner, sentence = pick_winner(found, {"ttft": 250})
    assert sentence.startswith(says), sentence
    assert winner == ("1P1D" if "wins" in says else None)
    assert pick_winner(found, {}) == (None, "No SLOs were given, so there is no goodput to compare: pass --goodput "
                                            "ttft:MS tpot:MS.")


def test_one_rate_is_drawn_as_bars_and_many_as_lines_with_every_marker_visible():
    from matplotlib.lines import Line2D
    from matplotlib.patches import Rectangle

    from pdserve.bench.sweep_plots import PlotContext, load_figure, pyplot, series

    plt = pyplot()
    context = PlotContext("about 16 tokens in / 4 out per request; TTFT <= 250 ms", {"ttft": 250}, "1P1D")
    one_rate = [row for row in synthetic_rows() if row["request_rate"] == 2.0]
    figure = load_figure(plt, series(one_rate, "request_rate", "p90_ttft_ms"), "request rate (req/s)",
                         "TTFT p90 (ms)", context, (250, "SLO 250 ms"))
    axes = figure.axes[0]
    bars = [patch for patch in axes.patches if isinstance(patch, Rectangle)]
    assert [bar.get_height() for bar in bars] == [100.0, 200.0]
    assert [label.get_text() for label in axes.get_xticklabels()] == ["1P1D (winner)", "0P2D"]
    assert [line.get_ydata()[0] for line in axes.lines] == [250]  # the SLO line, and no one-dot line plot
    assert "TTFT ≤ 250 ms" in axes.get_title() and axes.get_xlabel() == "at request rate 2"
    plt.close(figure)

    figure = load_figure(plt, series(synthetic_rows(), "request_rate", "p90_ttft_ms"), "request rate (req/s)",
                         "TTFT p90 (ms)", context, (250, "SLO 250 ms"))
    lines = [line for line in figure.axes[0].lines if len(line.get_xdata()) > 1]
    assert [line.get_label() for line in lines] == ["1P1D (winner)", "0P2D", "SLO 250 ms"]
    drawn = lines[:2]
    assert drawn[0].get_marker() != drawn[1].get_marker()  # distinct shapes, the later one smaller and on top
    assert drawn[0].get_markersize() > drawn[1].get_markersize() and drawn[1].get_zorder() > drawn[0].get_zorder()
    assert not figure.axes[0].patches
    plt.close(figure)


def test_bars_without_an_slo_line_have_no_legend_to_warn_about():
    """One rate and no SLO: the bars name their servers on the axis, so there is no legend, and matplotlib's
    'No artists with labels' warning (printed three times by such a sweep) is not raised."""
    import warnings

    from pdserve.bench.sweep_plots import PlotContext, load_figure, pyplot, series

    plt = pyplot()
    one_rate = [row for row in synthetic_rows() if row["request_rate"] == 2.0]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        figure = load_figure(plt, series(one_rate, "request_rate", "p90_ttft_ms"), "request rate (req/s)",
                             "TTFT p90 (ms)", PlotContext("about 16 tokens in / 4 out per request", {}, None), None)
    assert figure.axes[0].get_legend() is None
    plt.close(figure)


# ---- the plan and the bench command ----


def sweep_args(*argv: str):
    from pdserve.cli import build_parser

    return build_parser().parse_args(["sweep", "--model", "/models/m", "--no-plots", *argv])


@pytest.mark.parametrize("argv, says", [
    ((), "no load given"),
    (("--configs", "--request-rates", "1"), "nothing to benchmark"),
    (("--request-rates", "0"), "every rate must be > 0"),
    (("--max-concurrencies", "0"), "every cap must be >= 1"),
    (("--request-rates", "1", "--num-prompts", "0"), "--num-prompts 0"),
    (("--find-goodput",), "needs SLOs"),
    (("--request-rates", "1", "--devices", "0,1"), "add --device cuda"),
    (("--request-rates", "1", "--device", "cuda", "--configs", "1P1D", "2P2D", "--devices", "0,1"), "needs 4 GPUs"),
    (("--request-rates", "1", "--device", "cuda", "--configs", "1P1D", "0P2D", "--devices", "0,1"), None),
    (("--request-rates", "1", "--warmup", "-1"), "--warmup -1"),
    (("--request-rates", "1", "--up-args", "--dtype float32 --port=9000"), "--up-args sets --port"),
    (("--request-rates", "1", "--bench-args", "--seed 3 --request-rate 2"), "sets --request-rate, --seed"),
    (("--request-rates", "1", "--bench-args", "--tokenizer 'unclosed"), "quote it"),
    (("--request-rates", "1", "0.0001", "--num-prompts", "50"), "more than a day"),
    (("--request-rates", "1", "--reference-requests", "-1"), "--reference-requests -1"),
    (("--request-rates", "1", "--reference-requests", "2", "--reference-output-len", "0"), "of 1 or more tokens"),
])
def test_the_plan_is_checked_before_anything_starts(argv, says):
    from pdserve.bench.sweep import build_plan

    if says is None:
        assert build_plan(sweep_args(*argv)).cluster.devices == ["0", "1"]
        return
    with pytest.raises(ValueError, match=says):
        build_plan(sweep_args(*argv))


@pytest.mark.parametrize("up_args, native_bf16, expected", [
    ([], True, "bfloat16"), ([], False, "float32"), (["--dtype", "float16"], True, "float16"),
    (["--dtype=half"], False, "float16"), (["--dtype", "float32"], True, "float32")])
def test_the_sweep_records_the_dtype_its_engines_resolve(model_factory, monkeypatch, up_args, native_bf16, expected):
    """On CPU, auto follows the CPU's native bf16 as the engines' own resolution does; --up-args' --dtype wins."""
    from pdserve.bench.sweep_cluster import engines_dtype
    from pdserve.engine import config

    monkeypatch.setattr(config, "cpu_has_native_bf16", lambda: native_bf16)
    assert engines_dtype(model_factory(), up_args, "cpu") == expected


def test_a_sweep_run_records_its_engines_dtype_and_an_external_server_none(tmp_path, monkeypatch):
    from pdserve.bench import sweep_runs

    def bench_saving_an_empty_result(command: list[str], timeout_s, cores) -> str:
        Path(command[command.index("--save-result") + 1]).write_text("{}")
        return ""

    monkeypatch.setattr(sweep_runs, "_run", bench_saving_an_empty_result)
    options = sweep_runs.BenchOptions(model="m", num_prompts=1, metrics_interval_s=60.0)
    for info, expected in ((RunInfo("1P1D", 2, "sweep", 1.0, None, 1, 1, "bfloat16"), {"dtype": "bfloat16"}),
                           (RunInfo("vllm", 1, "sweep", 1.0, None), {})):
        _, result = sweep_runs.run_bench(options, "http://127.0.0.1:9", info, tmp_path, {})
        assert {k: v for k, v in result["sweep"].items() if k == "dtype"} == expected


def test_loads_and_bench_command(tmp_path):
    from pdserve.bench.sweep import build_plan
    from pdserve.bench.sweep_runs import bench_command, run_name

    plan = build_plan(sweep_args("--request-rates", "1", "inf", "--max-concurrencies", "4", "--dataset", "random",
                                 "--input-len", "16", "--seed", "7", "--goodput", "ttft:500", "tpot:50",
                                 "--bench-args", "--request-timeout 30"))
    assert plan.loads == [(1.0, 4), (math.inf, 4)]
    info = RunInfo("1P1D", 2, "sweep", math.inf, 4, 1, 1)
    command = bench_command(plan.bench, "http://h:1", info, tmp_path / "r.json", run_index=1)
    text = " ".join(command)
    assert "--base-url http://h:1 --model /models/m --num-prompts 50 --request-rate inf --seed 8" in text
    assert "--dataset random --input-len 16" in text and "--max-concurrency 4 --ignore-eos" in text
    assert "--goodput ttft:500 tpot:50" in text and "--request-timeout 30" in text
    assert command[-4:] == ["--metadata", "config=1P1D", "rate=inf", "phase=sweep"]
    assert run_name(info) == "1P1D_rateinf_conc4"


# ---- SLOs from an unloaded pass (--slo-factors) ----


def test_slo_factors_parse_and_bad_ones_are_refused():
    from pdserve.bench.sweep_unloaded import parse_slo_factors

    assert parse_slo_factors(["ttft:4", "TPOT:1.3"]) == {"ttft": 4.0, "tpot": 1.3}
    assert parse_slo_factors(None) == {}
    for bad in ("ttft", "ttft:0.9", "itl:2", "tpot:x", "tpot:inf"):
        with pytest.raises(ValueError, match="METRIC:FACTOR"):
            parse_slo_factors([bad])


def unloaded_row(config: str, ttft_ms, tpot_ms, error: str = "") -> dict:
    return {"config": config, "phase": "unloaded", "completed": 0 if error else 4, "error": error,
            "median_ttft_ms": ttft_ms, "median_tpot_ms": tpot_ms}


def test_slos_are_factors_of_the_lowest_unloaded_median():
    from pdserve.bench.sweep_unloaded import goodput_flags, slos_from_unloaded

    rows = [unloaded_row("1P1D", 3275.8, 82.5), unloaded_row("0P2D", 2774.4, 72.7),
            unloaded_row("2P2D", 10.0, 1.0, error="pdserve bench exited"),  # a failed run is no base
            {**unloaded_row("0P2D", 1.0, 1.0), "phase": "sweep"}]  # nor is a loaded run
    slos, basis = slos_from_unloaded(rows, {"ttft": 4.0, "tpot": 1.3})
    assert slos == {"ttft": math.ceil(4 * 2774.4), "tpot": math.ceil(1.3 * 72.7)}  # 11098, 95
    assert basis["tpot"] == {"factor": 1.3, "unloaded_median_ms": 72.7, "from_config": "0P2D", "slo_ms": 95.0}
    assert goodput_flags(slos) == ["ttft:11098", "tpot:95"]


def test_slos_without_an_unloaded_measurement_say_why():
    from pdserve.bench.sweep_unloaded import slos_from_unloaded

    with pytest.raises(ValueError, match="no server completed its unloaded run"):
        slos_from_unloaded([unloaded_row("1P1D", None, None, error="pdserve up exited")], {"ttft": 4})
    with pytest.raises(ValueError, match="measured no TPOT"):
        slos_from_unloaded([unloaded_row("1P1D", 30.0, None)], {"tpot": 2})


@pytest.mark.parametrize("argv, says", [
    (("--request-rates", "1", "--goodput", "ttft:500", "--slo-factors", "ttft:4"), "give one of them"),
    (("--request-rates", "1", "--slo-factors", "ttft:4", "--unloaded-prompts", "0"), "--unloaded-prompts 0"),
    (("--request-rates", "1", "--slo-factors", "tpot:0.5"), "factor >= 1"),
])
def test_slo_factors_in_the_plan_are_checked(argv, says):
    from pdserve.bench.sweep import build_plan

    with pytest.raises(ValueError, match=says):
        build_plan(sweep_args(*argv))


def test_slo_factors_alone_are_enough_for_the_goodput_search():
    from pdserve.bench.sweep import build_plan
    from pdserve.bench.sweep_runs import run_name

    plan = build_plan(sweep_args("--find-goodput", "--slo-factors", "ttft:4", "tpot:1.5", "--unloaded-prompts", "3"))
    assert (plan.slos, plan.slo_factors, plan.unloaded_prompts) == ({}, {"ttft": 4.0, "tpot": 1.5}, 3)
    assert run_name(RunInfo("0P2D", 2, "unloaded", math.inf, 1, 0, 2)) == "0P2D_rateinf_conc1_unloaded"


@pytest.mark.parametrize("argv, says", [
    (("--bench-args", "--request-timeout inf"), "--request-timeout inf must be a positive, finite number"),
    (("--bench-args", "--bogus 3"), "pdserve bench takes no --bogus 3"),
    (("--bench-args", "--warmup many"), "argument --warmup: invalid int value: 'many'"),
    (("--dataset", "jsonl"), "--dataset jsonl reads a file: pass --dataset-path FILE"),
])
def test_flags_bench_would_refuse_are_refused_before_any_layout_starts(argv, says):
    from pdserve.bench.sweep import build_plan

    with pytest.raises(ValueError, match=re.escape(says)):
        build_plan(sweep_args("--request-rates", "1", *argv))


def test_reference_runs_take_their_own_output_length():
    from pdserve.bench.sweep import with_output_len

    given = ["--dataset", "random", "--output-len", "256", "--input-len", "128"]
    assert with_output_len(given, 32) == ["--dataset", "random", "--input-len", "128", "--output-len", "32"]
    assert with_output_len(["--input-len", "128"], 8) == ["--input-len", "128", "--output-len", "8"]


def test_raw_runs_go_outside_the_repository_unless_a_folder_is_named(tmp_path):
    import tempfile

    from pdserve.bench.sweep import build_plan

    default = build_plan(sweep_args("--request-rates", "1")).output_dir
    assert default.parent == Path(tempfile.gettempdir()) / "pdserve-sweeps"
    assert Path(__file__).resolve().parents[2] not in default.resolve().parents
    named = build_plan(sweep_args("--request-rates", "1", "--output-dir", str(tmp_path / "mine"))).output_dir
    assert named == tmp_path / "mine"


def test_a_load_at_a_listed_rate_counts_its_arrival_span_in_the_time_left():
    from pdserve.bench.sweep import Sweep, build_plan

    plan = build_plan(sweep_args("--request-rates", "0.1", "0.2", "inf", "--num-prompts", "24",
                                 "--reference-requests", "3", "--warmup", "2"))
    # warm-up, then a reference run before each load, and one after the last
    sweep = Sweep(plan)
    assert sweep.server_floors() == [0, 0, 240, 0, 120, 0, 0, 0]
    assert sweep.points_per_server(sweep.run_server) == 8


def test_tied_goodputs_are_separated_by_the_next_load():
    """Both layouts meet the SLOs at 1 req/s and miss at 2 and 4: the one that kept more requests within them at 2
    req/s wins, said with both figures; equal there too, no winner."""
    from pdserve.bench.sweep_report import compare

    attainment = {("1P1D", 1.0): 1.0, ("0P2D", 1.0): 0.95, ("1P1D", 2.0): 0.8, ("0P2D", 2.0): 0.55,
                  ("1P1D", 4.0): 0.1, ("0P2D", 4.0): 0.3}
    rows = [{**row, "slo_attainment": attainment[row["config"], row["request_rate"]]} for row in synthetic_rows()]
    goodputs = [{"config": c, "num_engines": 2, "goodput": 1.0, "goodput_per_engine": 0.5, "upper_bound": 2.0}
                for c in ("0P2D", "1P1D")]
    comparison = compare(rows, goodputs, {"ttft": 250})
    assert comparison.winner == "1P1D"
    assert comparison.sentence == ("1P1D wins on the next load: both reach 0.5 req/s per engine (1 in total on 2), "
                                   "and at 2 req/s 1P1D kept 80% of requests within the SLOs against 0P2D's 55% "
                                   "(25 points).")
    even = [{**row, "slo_attainment": 0.5 if row["request_rate"] > 1 else 1.0} for row in rows]
    assert compare(even, goodputs, {"ttft": 250}).winner is None
