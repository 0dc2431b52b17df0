"""The prefill engine's busy time in a sweep run against the simulator's for the same requests: separates the
prefill step model (and the machine's speed of the moment) from the queueing model in `plan --validate`, as
step_check.py does for the decode steps.

With one prefill engine every prompt is computed there in the order it came (batched up to the token budget), and
its first token leaves when it is done. Walking the requests in the order of their first tokens, the engine was busy
from the later of the request's arrival and the previous first token until the request's own first token; the sum
over the run is its busy time, whatever the queue did. The same sum over the simulated requests, with the same
arrivals, gives the ratio: x1.0 when the prompts took what the profile says (the delays the simulator adds
around a prompt are in both sums; what it leaves out, such as the router's own time before the engine, reads
as a slower engine), x1.1 when the engine ran 10% slower (a little under it when steps have a fixed cost and
the slower engine batched more prompts a step). With several prefill engines, which request sat on which is
not recorded, and a prompt prefilled on its decode engine (local prefill) is no prefill engine's: no ratio."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from pdserve.planner.model.simulator import SimRequest


def busy_seconds(arrivals: Sequence[float], first_tokens: Sequence[float]) -> float:
    """One FIFO server's busy time from when each job came and when it left: the sum, in order of leaving, of each
    job's first token minus the later of its arrival and the previous job's first token."""
    busy, previous = 0.0, -np.inf
    for index in np.argsort(np.asarray(first_tokens), kind="stable"):
        start = max(arrivals[index], previous)
        busy += first_tokens[index] - start
        previous = first_tokens[index]
    return busy


def prefill_busy_ratio(run: dict, requests: Sequence[SimRequest], num_prefill: int) -> float | None:
    """Measured over simulated busy time of the run's one prefill engine. None with no prefill engine or more than
    one, when the simulation prefilled a prompt on a decode engine, or when a request failed in either (its prompt's
    work would fall into the next one's busy time on one side only)."""
    errors = run.get("errors") or [""] * len(run["ttfts"])
    if (num_prefill != 1 or any(errors) or len(requests) != len(errors)
            or not all(r.remote and r.first_token is not None for r in requests)):
        return None
    arrivals = [r.arrival for r in requests]  # the run's own: the replay draws them from its rate and seed
    measured_busy = busy_seconds(arrivals, [arrival + ttft for arrival, ttft in zip(arrivals, run["ttfts"])])
    simulated_busy = busy_seconds(arrivals, [r.first_token for r in requests])
    return measured_busy / simulated_busy if simulated_busy > 0 else None
