"""What the isolated structured-output check costs (engine/grammar.py check_isolated: bounds, then a compile in a
worker process) for a small JSON schema: a worker's start, a schema seen for the first time, a cached verdict;
against the in-process compile it replaced, in the same run:

    python experiments/grammar_check_cost.py [--repeats 200] [--starts 5]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable

from pdserve.engine.grammar import checked_grammar
from pdserve.engine.grammar_limits import check_bounds
from pdserve.engine.grammar_sandbox import GrammarSandbox


def small_schema(i: int) -> str:
    """A 226-character schema; `i` makes each one new to the cache."""
    return json.dumps({"type": "object", "additionalProperties": False, "required": ["ok", "size", "count"],
                       "properties": {"ok": {"type": "boolean"}, "size": {"enum": ["small", f"large{i}"]},
                                      "count": {"type": "integer", "minimum": 0, "maximum": 9}}})


def millis(fn: Callable[[], object]) -> float:
    started = time.perf_counter()
    fn()
    return 1000 * (time.perf_counter() - started)


def isolated(sandbox: GrammarSandbox, spec: str) -> None:
    check_bounds("json", spec)
    if sandbox.check("json", spec) is not None:
        raise SystemExit("the schema does not compile")


def measure(repeats: int, starts: int) -> dict[str, list[float]]:
    timings: dict[str, list[float]] = {"worker start + first check": []}
    for i in range(starts):
        sandbox = GrammarSandbox()
        timings["worker start + first check"].append(millis(lambda: isolated(sandbox, small_schema(i))))
        sandbox.close()
    sandbox = GrammarSandbox()
    for i in range(2):  # both workers started
        isolated(sandbox, small_schema(-1 - i))
    timings["first time, worker running"] = [millis(lambda: isolated(sandbox, small_schema(1000 + i)))
                                             for i in range(repeats)]
    timings["cached verdict"] = [millis(lambda: isolated(sandbox, small_schema(1000 + i))) for i in range(repeats)]
    timings["in-process compile (baseline)"] = [millis(lambda: checked_grammar("json", small_schema(5000 + i)))
                                                for i in range(repeats)]
    sandbox.close()
    return timings


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeats", type=int, default=200)
    parser.add_argument("--starts", type=int, default=5)
    args = parser.parse_args()
    timings = measure(args.repeats, args.starts)
    baseline = statistics.median(timings["in-process compile (baseline)"])
    print(f"{'check':32} {'median ms':>10} {'p90 ms':>9} {'x baseline':>11}")
    for name, values in timings.items():
        values = sorted(values)
        median, p90 = statistics.median(values), values[max(0, int(0.9 * len(values)) - 1)]
        print(f"{name:32} {median:10.3f} {p90:9.3f} {median / baseline:11.2f}")


if __name__ == "__main__":
    main()
