"""Which piece of a prediction carries its SLO-attainment error: each request's latency cut into TTFT, first ITL
(the wait for the second token: a disaggregated request's KV transfer) and later ITLs (its decode steps), and the
attainment recomputed with one piece measured and the others predicted. The piece whose swap removes the error is
the part of the model to fix (`pdserve plan --validate`)."""

from __future__ import annotations

from dataclasses import dataclass, replace

from pdserve.planner.model.simulator import SimRequest

PIECES = ("ttft", "first_itl", "later_itls")
PIECE_TITLES = {"ttft": "TTFT", "first_itl": "first ITL", "later_itls": "later ITLs"}


@dataclass(frozen=True)
class Pieces:
    """One request's latency in seconds: TTFT, then the first ITL, then the rest of its output."""
    ttft: float
    first_itl: float
    later_itls: float
    output_len: int

    def meets(self, slos_ms: dict[str, float]) -> bool:
        """bench's rule: TPOT over output_len - 1 tokens (0 for a single token), E2EL from the arrival."""
        decode = self.first_itl + self.later_itls
        latencies_ms = {"ttft": 1000 * self.ttft, "e2el": 1000 * (self.ttft + decode),
                        "tpot": 1000 * decode / (self.output_len - 1) if self.output_len > 1 else 0.0}
        return all(latencies_ms[name] <= limit for name, limit in slos_ms.items())


def predicted_pieces(request: SimRequest) -> Pieces:
    decode = request.finish - request.first_token
    first_itl = request.first_itl if request.first_itl is not None else 0.0
    return Pieces(request.ttft, first_itl, decode - first_itl, request.output_len)


def measured_pieces(run: dict, index: int) -> Pieces | None:
    """From a bench run's arrays (seconds); None if the request failed or its ITLs were not recorded."""
    errors = run.get("errors") or []
    itls = (run.get("itls") or [])[index] if index < len(run.get("itls") or []) else []
    output_len = int(run["output_lens"][index])
    if (index < len(errors) and errors[index]) or (output_len > 1 and not itls):
        return None
    ttft = float(run["ttfts"][index])
    decode = float(run["e2els"][index]) - ttft if run.get("e2els") else float(sum(itls))
    first_itl = float(itls[0]) if itls else 0.0
    return Pieces(ttft, first_itl, decode - first_itl, output_len)


def attainment_with_measured(run: dict, requests: list[SimRequest], slos_ms: dict[str, float]) -> dict[str, float]:
    """Per piece: the predicted attainment with that piece of every request taken from the run instead. Empty
    without SLOs or when a request's measured pieces are missing (failed, or no ITLs recorded)."""
    measured = [measured_pieces(run, request.index) for request in requests]
    if not slos_ms or not requests or any(pieces is None for pieces in measured):
        return {}
    predicted = [predicted_pieces(request) for request in requests]
    result = {}
    for piece in PIECES:
        met = sum(replace(mine, **{piece: getattr(theirs, piece)}).meets(slos_ms)
                  for mine, theirs in zip(predicted, measured))
        result[piece] = met / len(requests)
    return result
