"""`pdserve plan --find-goodput`: each split's goodput (the highest rate at which >= 90% of requests meet every
SLO) on a fixed grid of rates, searched from its neighbouring split's goodput; the splits in fixed chains that a
pool of processes searches side by side, with the same result for any number of workers (docs/benchmarking/plan.md)."""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass

from pdserve.planner.model.metrics import meets_target
from pdserve.planner.search.recommend import PlanSettings, capacity_guess, run_split, split_row, splits_of
from pdserve.planner.model.simulator import BudgetExceeded

RATE_STEPS = 32  # grid rates per doubling: a goodput is within 2 ** (1 / 32) - 1 = 2.2% of the next rate, which missed
HIGHEST_INDEX = round(math.log2(1e6) * RATE_STEPS)  # above ~1e6 req/s a split is called unbounded
LOWEST_DROP = 12 * RATE_STEPS  # below start / 4096 a split is called unable to meet the SLOs at any rate
DECODE_WORK = 3.0  # a simulated decode request's CPU against a prefill request's (per split, docs/design/planner-model.md)


def grid_rate(index: int) -> float:
    return 2.0 ** (index / RATE_STEPS)


def grid_index(rate: float) -> int:
    return round(math.log2(rate) * RATE_STEPS)


@dataclass(frozen=True)
class Goodput:
    rate: float  # the highest grid rate that met the target with the next one missing it; 0 none, inf unbounded
    index: int | None  # its grid index (None for 0 and inf)
    metrics: dict  # the split's metrics at that rate ({} for 0 and inf)
    probes: int  # simulations the search ran


def grid_search(meets: Callable[[int], bool], start: int, first_step: int, lowest: int, highest: int
                ) -> tuple[int | None, int | None]:
    """(low, low + 1): neighbouring grid indexes where meets() flips from True to False, from start: steps of
    first_step, first_step, then doubling, up while it passes or down while it misses, then bisection.
    (None, high) when nothing down to `lowest` passes; (low, None) when everything up to `highest` does."""
    start = max(lowest, min(start, highest))
    passed = meets(start)
    low, high = (start, None) if passed else (None, start)
    step, num_steps = first_step, 0
    while low is None or high is None:
        probe = low + step if passed else high - step
        if not lowest <= probe <= highest:
            return low, high
        if meets(probe):
            low = probe
        else:
            high = probe
        num_steps += 1
        step = step if num_steps < 2 else step * 2
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (middle, high) if meets(middle) else (low, middle)
    return low, high


def find_goodput(settings: PlanSettings, num_prefill: int, num_decode: int, start: int, first_step: int = 1,
                 adaptive: bool = False) -> Goodput:
    """The split's goodput on the rate grid, searched from grid index `start` (adaptive: num_decode dual-role engines
    under the adaptive policy). A probe that meets the target ran in full, so the metrics at the rate found are that
    probe's, not a run of their own."""
    passed: dict[int, dict] = {}
    probes = 0

    def meets(index: int) -> bool:
        nonlocal probes
        probes += 1
        try:
            metrics = run_split(settings, num_prefill, num_decode, grid_rate(index), stop_below_target=True,
                                adaptive=adaptive)
        except BudgetExceeded:
            return False
        if meets_target(metrics):
            passed[index] = metrics
            return True
        return False

    low, high = grid_search(meets, start, first_step, start - LOWEST_DROP, HIGHEST_INDEX)
    if low is None:
        return Goodput(0.0, None, {}, probes)
    if high is None:
        return Goodput(math.inf, None, {}, probes)
    return Goodput(grid_rate(low), low, passed[low], probes)


def ttft_binds(metrics: dict, slos_ms: dict[str, float]) -> bool:
    """Whether at a split's goodput its p90 TTFT is nearer its limit than its p90 TPOT (the prefill side binds)."""
    def share(name: str) -> float:
        value = metrics.get(f"p90_{name}_ms")
        return value / slos_ms[name] if value is not None and name in slos_ms else 0.0

    return share("ttft") > share("tpot")


def next_start(found: list[tuple[int, int, int, bool]], num_prefill: int, num_decode: int) -> int:
    """Where a split's search starts, from its chain's goodputs so far, (x, y, grid index, TTFT binds) each: the last
    one, scaled as the tier that bounds it scales (after two: a goodput that rose with x is bound by the prefill
    engines, one that fell by the decode engines; after one: the prefill engines when TTFT binds), by the power
    the last two splits showed (1 with only one)."""
    x1, y1, last, ttft_bound = found[-1]
    if len(found) < 2:
        prefill_bound, power = ttft_bound, 1.0
    else:
        x0, y0, before, _ = found[-2]
        prefill_bound = last > before
        span = math.log2(x1 / x0) if prefill_bound else math.log2(y1 / y0)
        power = min(2.0, max(0.5, (last - before) / (RATE_STEPS * span)))
    step = math.log2(num_prefill / x1) if prefill_bound else math.log2(num_decode / y1)
    return round(last + power * RATE_STEPS * step)


def search_chain(settings: PlanSettings, num_engines: int, splits: list[tuple[int, int]], start: int,
                 done=None) -> list[dict]:
    """Rows of consecutive splits, each searched from the goodputs found before it in this chain (colocated 0PND
    aside: its goodput does not scale with a tier); without one, from `start` with doubling steps. `done.put(line)`
    (a queue, or None) hears of each split as it ends."""
    rows, found = [], []
    for x, y in splits:
        if found:
            goodput = find_goodput(settings, x, y, next_start(found, x, y))
        else:
            goodput = find_goodput(settings, x, y, start, first_step=RATE_STEPS)
        if goodput.index is not None and x > 0:
            found.append((x, y, goodput.index, ttft_binds(goodput.metrics, settings.slos_ms)))
        row = split_row(x, y, num_engines, goodput.rate, goodput.rate, goodput.metrics)
        row["probes"] = goodput.probes
        rows.append(row)
        if done is not None:
            done.put(f"{row['config']} searched: goodput {row['goodput']:.3g} req/s ({goodput.probes} simulations)")
    return rows


def search_adaptive(settings: PlanSettings, num_engines: int, static_rows: list[dict]) -> dict:
    """The adaptive layout's goodput row, searched from the best static split's goodput (from the first guess with
    doubling steps when no split has one)."""
    found = [row["goodput"] for row in static_rows if 0 < row["goodput"] < math.inf]
    if found:
        goodput = find_goodput(settings, 0, num_engines, grid_index(max(found)), adaptive=True)
    else:
        start = grid_index(capacity_guess(settings, num_engines))
        goodput = find_goodput(settings, 0, num_engines, start, first_step=RATE_STEPS, adaptive=True)
    row = split_row(0, num_engines, num_engines, goodput.rate, goodput.rate, goodput.metrics, "adaptive")
    row["probes"] = goodput.probes
    return row


def split_work(num_prefill: int, num_decode: int) -> float:
    """A split's share of the search's work: requests per simulated engine of each tier (simulate_tiers), a
    decode engine's about 3x a prefill engine's (docs/design/planner-model.md)."""
    return (1 / num_prefill if num_prefill else 0.0) + DECODE_WORK / num_decode


def chains_of(num_engines: int) -> list[list[tuple[int, int]]]:
    """The splits as two runs of neighbours with about the same work (one when there is one split)."""
    splits = splits_of(num_engines)
    works = [split_work(x, y) for x, y in splits]
    total, before, cut = sum(works), 0.0, 1
    for cut in range(1, len(splits)):
        before += works[cut - 1]
        if before + works[cut] / 2 >= total / 2:
            break
    return [chain for chain in (splits[:cut], splits[cut:]) if chain]


def search_splits(settings: PlanSettings, num_engines: int, jobs: int = 1, show_progress: bool = False
                  ) -> list[dict]:
    """Every split's goodput row, in split order. Each chain starts from the same guess, so the rows do not depend
    on `jobs` (the processes searching chains at once) or on which chain ends first. show_progress: a bar on a
    terminal, else a line per split searched, on stderr (pdserve/progress.py)."""
    from pdserve.progress import Progress

    chains = chains_of(num_engines)
    start = grid_index(capacity_guess(settings, num_engines))
    total = sum(len(chain) for chain in chains)
    progress = Progress(total, "pdserve plan: goodput search", unit="split") if show_progress else None
    report = SplitReport(progress)
    try:
        if jobs <= 1 or len(chains) == 1:
            results = [search_chain(settings, num_engines, chain, start, report if progress else None)
                       for chain in chains]
        else:
            results = search_in_pool(settings, num_engines, chains, start, min(jobs, len(chains)), report, total)
    finally:
        report.close()
    return [row for rows in results for row in rows]


class SplitReport:
    """A split searched, on the progress display (nothing without one)."""

    def __init__(self, progress) -> None:
        self.progress = progress

    def put(self, line: str) -> None:
        if self.progress is not None:
            self.progress.start(line)
            self.progress.finish()

    def close(self) -> None:
        if self.progress is not None:
            self.progress.close()


def search_in_pool(settings: PlanSettings, num_engines: int, chains: list, start: int, workers: int,
                   report: SplitReport, total: int) -> list[list[dict]]:
    """The chains searched by `workers` processes; each split's end reported as the workers send it."""
    from multiprocessing import Manager
    from queue import Empty

    with Manager() if report.progress else contextlib.nullcontext() as manager, ProcessPoolExecutor(max_workers=workers) as pool:
        queue = manager.Queue() if report.progress else None
        futures = [pool.submit(search_chain, settings, num_engines, chain, start, queue) for chain in chains]
        heard = 0
        while queue is not None and heard < total:
            try:
                report.put(queue.get(timeout=0.2))
                heard += 1
            except Empty:
                if any(future.done() and future.exception() for future in futures):
                    break  # result() below raises the worker's error
        return [future.result() for future in futures]

