"""Every xPyD split of N engines simulated at one rate (search/goodput.py searches their goodputs), and N dual-role
engines under the adaptive policy; the best split per engine, and the smallest number of engines whose best split
meets a target rate."""

from __future__ import annotations

from dataclasses import dataclass, replace

from pdserve.planner.model.adaptive import AdaptiveTargets
from pdserve.planner.model.host_effects import NO_HOST_EFFECTS, HostEffects
from pdserve.planner.model.metrics import meets_target, predicted_metrics
from pdserve.planner.model.simulator import ClusterSpec, SimRequest, StepModel, simulate, simulate_tiers
from pdserve.planner.model.workload import Workload
from pdserve.bench.sweep_results import ATTAINMENT_TARGET


@dataclass(frozen=True)
class PlanSettings:
    model: StepModel
    workload: Workload
    slos_ms: dict[str, float]
    cluster: ClusterSpec  # policies and engine settings; its engine counts are replaced per split
    burstiness: float = 1.0
    seed: int = 0
    exact_up_to: int = 8  # whole-cluster simulation up to this many engines, one engine per tier above
    effects: HostEffects = NO_HOST_EFFECTS  # what the CPU host adds (none on a GPU profile)


def simulate_split(settings: PlanSettings, num_prefill: int, num_decode: int, rate: float,
                   stop_below_target: bool = False, adaptive: bool = False) -> tuple[list[SimRequest], int]:
    """The split's simulated requests at `rate` (above exact_up_to engines: one decode engine's share), and how many
    requests the run has; with stop_below_target, BudgetExceeded as soon as the run cannot reach the attainment
    target. adaptive: num_decode dual-role engines under the adaptive policy (num_prefill 0), always simulated whole
    (its engines' choices depend on each other), without the host's effects above exact_up_to as a split's."""
    targets = AdaptiveTargets.from_slos_ms(settings.slos_ms) if adaptive else None
    spec = replace(settings.cluster, num_prefill=num_prefill, num_decode=num_decode, adaptive=targets)
    arrivals, prompt_lens, output_lens = settings.workload.at_rate(rate, settings.burstiness, settings.seed)
    exact = num_prefill + num_decode <= settings.exact_up_to
    run = simulate if exact or adaptive else simulate_tiers
    effects = settings.effects.unshared() if adaptive and not exact else settings.effects
    stop_below = (settings.slos_ms, ATTAINMENT_TARGET) if stop_below_target else None
    return run(spec, settings.model, arrivals, prompt_lens, output_lens, stop_below, effects), len(arrivals)


def run_split(settings: PlanSettings, num_prefill: int, num_decode: int, rate: float,
              stop_below_target: bool = False, adaptive: bool = False) -> dict:
    """The split's predicted metrics at `rate` (adaptive: N = num_decode dual-role engines); with stop_below_target,
    BudgetExceeded as soon as the run cannot reach the attainment target (a goodput probe needs no more)."""
    requests, num_requests = simulate_split(settings, num_prefill, num_decode, rate, stop_below_target, adaptive)
    metrics = predicted_metrics(requests, settings.slos_ms)
    sampled = num_requests / len(requests)  # one decode engine's share stands for all of them (simulate_tiers)
    for key in ("request_throughput", "request_goodput"):
        if metrics[key] is not None:
            metrics[key] *= sampled
    return metrics


def splits_of(num_engines: int) -> list[tuple[int, int]]:
    """(x, y) for every xPyD with x + y = N and at least one decode engine; 0P = colocated."""
    return [(x, num_engines - x) for x in range(num_engines)]


def capacity_guess(settings: PlanSettings, num_engines: int) -> float:
    """A first rate for the goodput search: what N engines finish if each serves one request at a time."""
    model, workload = settings.model, settings.workload
    prompt = sum(workload.prompt_lens) / len(workload)
    output = sum(workload.output_lens) / len(workload)
    prefill = model.step_seconds(0, 0, int(prompt), prompt * prompt)
    decode = output * model.step_seconds(1, int(prompt + output / 2), 0, 0.0)
    return num_engines / max(prefill + decode, 1e-9)


def split_row(num_prefill: int, num_decode: int, num_engines: int, rate: float, goodput: float, metrics: dict,
              config: str | None = None) -> dict:
    """A split's line of the plan: its layout, the rate it was judged at, its goodput and metrics there."""
    row = {"config": config or f"{num_prefill}P{num_decode}D", "num_prefill": num_prefill, "num_decode": num_decode,
           "num_engines": num_engines, "request_rate": rate, "goodput": goodput,
           "goodput_per_engine": goodput / num_engines}
    row.update({k: metrics.get(k) for k in ("slo_attainment", "median_ttft_ms", "p90_ttft_ms", "median_tpot_ms",
                                            "p90_tpot_ms", "preemptions")})
    return row


def plan_splits(settings: PlanSettings, num_engines: int, rate: float) -> list[dict]:
    """One row per split: its metrics at `rate` (goodput.search_splits searches goodputs instead)."""
    rows = []
    for x, y in splits_of(num_engines):
        metrics = run_split(settings, x, y, rate)
        rows.append(split_row(x, y, num_engines, rate, metrics["request_goodput"] or 0.0, metrics))
    return rows


def plan_adaptive(settings: PlanSettings, num_engines: int, rate: float) -> dict:
    """The adaptive layout's row at `rate`: num_engines dual-role engines (goodput.search_adaptive searches its
    goodput instead)."""
    metrics = run_split(settings, 0, num_engines, rate, adaptive=True)
    return split_row(0, num_engines, num_engines, rate, metrics["request_goodput"] or 0.0, metrics, "adaptive")


def recommend(rows: list[dict]) -> dict | None:
    """The split with the best goodput per engine, fewer prefill engines on a tie; None when no split has any
    goodput (no split meets the SLOs at the rate): nothing to recommend, as `plan --validate` judges it."""
    if not any(row["goodput_per_engine"] > 0 for row in rows):
        return None
    return max(rows, key=lambda row: (row["goodput_per_engine"], -row["num_prefill"]))


def smallest_engines(settings: PlanSettings, target_rate: float, max_engines: int) -> dict | None:
    """The fewest engines (<= max_engines) with a split meeting target_rate, and that split; None if none."""
    def best_at(num_engines: int) -> dict | None:
        passing = [(x, y, run_split(settings, x, y, target_rate)) for x, y in splits_of(num_engines)]
        passing = [(x, y, m) for x, y, m in passing if meets_target(m)]
        if not passing:
            return None
        x, y, metrics = min(passing, key=lambda item: -item[2]["slo_attainment"])
        return {"num_engines": num_engines, "config": f"{x}P{y}D", "slo_attainment": metrics["slo_attainment"]}

    low, high, found = 1, max_engines, None
    while low <= high:  # attainment grows with engines: bisect on N
        middle = (low + high) // 2
        best = best_at(middle)
        if best is not None:
            found, high = best, middle - 1
        else:
            low = middle + 1
    return found
