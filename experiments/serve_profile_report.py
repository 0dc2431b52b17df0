"""The served decode step's breakdown from what serve_profile.py gathered: the engine's timed rounds
(serve_profile_entry.py), its threads, the router's and the bench client's CPU; as JSON and markdown."""

from __future__ import annotations

import statistics
from collections import Counter

import step_spans

# the table's order: computation first, then the engine's own work, then the sockets
PART_ORDER = [step_spans.GEMM, step_spans.ATTENTION, step_spans.GATHERS, step_spans.NORMS, step_spans.ROTARY,
              step_spans.NATIVE_LAYERS, step_spans.MODEL_REST, step_spans.SAMPLING, step_spans.RUNNER_INPUTS,
              step_spans.SCHEDULER, step_spans.LOOP_OTHER, step_spans.ZMQ_IN, step_spans.KV_IN, step_spans.ZMQ_OUT,
              step_spans.YIELD, step_spans.WAIT]
ADDS_UP_WITHIN = 0.05  # the named parts cover the measured step to this share


def decode_rounds(rounds: list[dict], batch: int) -> tuple[int, list[dict]]:
    """(batch, rounds that ran only decodes at it); the most common decode batch when none ran at `batch`."""
    decodes = [r for r in rounds if r["num_tokens"] and r["num_decodes"] == r["num_tokens"]]
    chosen = [r for r in decodes if r["num_decodes"] == batch]
    if not chosen and decodes:
        batch = Counter(r["num_decodes"] for r in decodes).most_common(1)[0][0]
        chosen = [r for r in decodes if r["num_decodes"] == batch]
    return batch, chosen


def step_breakdown(rounds: list[dict], batch: int) -> dict:
    """Mean ms per part over the decode rounds at `batch` (means add up; medians would not), the measured step,
    and how much of it no part covers."""
    batch, chosen = decode_rounds(rounds, batch)
    if not chosen:
        raise RuntimeError("the engine ran no decode-only step in the window: raise --num-prompts or --output-len")
    names = sorted({name for r in chosen for name in r["parts_ms"]} - {step_spans.UNACCOUNTED},
                   key=lambda name: PART_ORDER.index(name) if name in PART_ORDER else len(PART_ORDER))
    parts = {name: statistics.fmean(r["parts_ms"].get(name, 0.0) for r in chosen) for name in names}
    walls = [r["wall_ms"] for r in chosen]
    mean_step = statistics.fmean(walls)
    named = sum(parts.values())
    return {
        "batch": batch, "rounds": len(chosen), "step_mean_ms": mean_step, "step_median_ms": statistics.median(walls),
        "parts_ms": parts, "parts_sum_ms": named, "unaccounted_ms": mean_step - named,
        "unaccounted_share": abs(mean_step - named) / mean_step,
        "wait_for_core_ms": statistics.fmean(r["wait_ms"] for r in chosen),
        "on_core_ms": statistics.fmean(r["on_cpu_ms"] for r in chosen),
        "step_less_wait_median_ms": statistics.median(r["wall_ms"] - r["wait_ms"] for r in chosen),
        "decode_batches": dict(sorted(Counter(r["num_decodes"] for r in rounds
                                              if r["num_decodes"] == r["num_tokens"]).items())),
    }


def thread_costs(engine: dict) -> dict:
    """Each of the engine's thread groups over the window: ms on a core and waiting, per round that stepped."""
    num_rounds = max(1, len(engine["rounds"]))
    before, after = engine["threads_before"], engine["threads_after"]
    costs = {}
    for name, end in after.items():
        start = before.get(name, {"on_cpu_ms": 0.0, "wait_ms": 0.0})
        costs[name] = {"on_cpu_ms_per_round": (end["on_cpu_ms"] - start["on_cpu_ms"]) / num_rounds,
                       "wait_ms_per_round": (end["wait_ms"] - start["wait_ms"]) / num_rounds,
                       "threads": end["threads"]}
    return costs


def offline_step(offline: dict, batch: int) -> dict:
    """The offline engine's step at `batch`, broken down as the served one (its unaccounted part is LLM.generate's
    loop, detokenization included), and its step without that loop."""
    step = step_breakdown(offline["rounds"], batch)
    _, chosen = decode_rounds(offline["rounds"], step["batch"])
    steps = [r["wall_ms"] - r["parts_ms"].get(step_spans.UNACCOUNTED, 0.0) for r in chosen]
    waits = [r["parts_ms"].get(step_spans.WAIT, 0.0) for r in chosen]
    return {**step, "round_median_ms": step["step_median_ms"], "step_median_ms": statistics.median(steps),
            "step_less_wait_median_ms": statistics.median(t - w for t, w in zip(steps, waits)),
            "timed_over_plain_generate": offline["generate_timed_s"] / offline["generate_s"]}


def markdown(report: dict) -> str:
    lines = [f"Machine: {report['machine']['cpu']}; load average {report['machine']['loadavg_before']} before, "
             f"{report['machine']['loadavg_after']} after.", ""]
    for mode, run in report["runs"].items():
        lines += run_tables(mode, run)
    if len(report["runs"]) == 2:
        lines += curve_table(report["runs"])
    if report.get("offline"):
        lines += offline_lines(report)
    return "\n".join(lines) + "\n"


def run_tables(mode: str, run: dict) -> list[str]:
    step = run["step"]
    lines = [f"### {run['layout']}, {mode}, {run['dtype']}: decode step at batch {step['batch']} "
             f"({step['rounds']} steps; median {step['step_median_ms']:.2f} ms)", "",
             "| part | ms per step (its wait for a core apart) | share |", "| --- | ---: | ---: |"]
    for name, ms in step["parts_ms"].items():
        lines.append(f"| {name} | {ms:.3f} | {100 * ms / step['step_mean_ms']:.1f}% |")
    lines += [f"| {step_spans.UNACCOUNTED} | {step['unaccounted_ms']:.3f} | "
              f"{100 * step['unaccounted_ms'] / step['step_mean_ms']:.1f}% |",
              f"| **step (measured, mean)** | **{step['step_mean_ms']:.3f}** | 100% |", "",
              f"Read at each step's ends, the engine's main thread ran {step['on_core_ms']:.2f} ms on a core and "
              f"waited {step['wait_for_core_ms']:.2f} ms for one. The engine's threads over the whole load, "
              f"divided by the steps it took:", "",
              "| engine thread | ms on a core per step | ms waiting for a core per step |", "| --- | ---: | ---: |"]
    for name, cost in sorted(run["threads"].items()):
        lines.append(f"| {name} (x{cost['threads']}) | {cost['on_cpu_ms_per_round']:.3f} | "
                     f"{cost['wait_ms_per_round']:.3f} |")
    outside = run["outside"]
    lines += ["", f"Outside the engine, per output token: router {outside['router_cpu_ms_per_token']:.3f} ms of CPU "
              f"(detokenization alone {outside['detokenize_ms_per_token']:.3f} ms), bench client "
              f"{outside['client_cpu_ms_per_token']:.3f} ms. Bench: {run['bench'].get('output_throughput', 0):.1f} "
              f"output tok/s, median ITL {run['bench'].get('median_itl_ms', 0):.1f} ms, median TPOT "
              f"{run['bench'].get('median_tpot_ms', 0):.1f} ms.", ""]
    return lines


def curve_table(runs: dict) -> list[str]:
    curve, plain = runs["curve"], runs["insecure"]
    io = "ZMQbg/IO/0"

    def io_ms(run: dict) -> float:
        return run["threads"].get(io, {}).get("on_cpu_ms_per_round", 0.0)

    rows = [("step, median (ms)", curve["step"]["step_median_ms"], plain["step"]["step_median_ms"]),
            ("zmq in + out on the main thread (ms/step)", zmq_ms(curve), zmq_ms(plain)),
            (f"engine's {io} thread (ms/step)", io_ms(curve), io_ms(plain)),
            ("router CPU (ms/token)", curve["outside"]["router_cpu_ms_per_token"],
             plain["outside"]["router_cpu_ms_per_token"])]
    lines = ["### CURVE against --insecure", "", "| figure | CURVE | insecure | CURVE - insecure |",
             "| --- | ---: | ---: | ---: |"]
    lines += [f"| {name} | {a:.3f} | {b:.3f} | {a - b:+.3f} |" for name, a, b in rows]
    return lines + [""]


def zmq_ms(run: dict) -> float:
    parts = run["step"]["parts_ms"]
    return sum(parts.get(name, 0.0) for name in (step_spans.ZMQ_IN, step_spans.ZMQ_OUT, step_spans.KV_IN))


def offline_lines(report: dict) -> list[str]:
    offline, ratio = report["offline"], report["served_over_offline"]
    served = next(iter(report["runs"].values()))["step"]
    lines = ["### Served against offline", "",
             f"Offline engine, same core, batch {offline['batch']}, {offline['rounds']} steps: median step "
             f"{offline['step_median_ms']:.2f} ms (round with LLM.generate's loop {offline['round_median_ms']:.2f} ms). "
             f"Served median step / offline median step = **{ratio:.2f}x** (goal: at most 1.5x). Less the time "
             f"each step's main thread waited for a core: {offline['step_less_wait_median_ms']:.2f} ms offline, "
             f"served / offline = **{report['served_over_offline_less_wait']:.2f}x**. The timing itself: the offline "
             f"generate took {offline['timed_over_plain_generate']:.3f}x as long timed as untimed.", "",
             "| part (mean ms per step) | served | offline | served / offline |", "| --- | ---: | ---: | ---: |"]
    for name, ms in served["parts_ms"].items():
        other = offline["parts_ms"].get(name, 0.0)
        lines.append(f"| {name} | {ms:.3f} | {other:.3f} | {f'{ms / other:.2f}' if other else '-'} |")
    return lines + [f"| step | {served['step_mean_ms']:.3f} | {offline['step_mean_ms']:.3f} | "
                    f"{served['step_mean_ms'] / offline['step_mean_ms']:.2f} |", ""]
