"""How much slower each term of a decode step runs while another engine of the host works: the co-run factors of
the weights part (the fit's intercept and per-sequence terms) and of the KV reads (its context term), from the
co-run step that `pdserve profile` measures (planner/profile/corun.py) and the profile's decode fit.

Two CPU engines on one host share its caches and memory bandwidth. A step over short contexts reads mostly weights
and is barely slowed (x0.97-1.04 on the demo model); a step over 1,000-token contexts also reads its KV, and the
neighbour adds about 1.5x the fit's context term. One factor for the whole
step cannot price both, so the co-run step times short and long contexts and the split is fitted:

    corun - alone = (f_weights - 1) * (alone - kv) + (f_kv - 1) * kv,   kv = d_context * context   (per shape)

in least squares of the relative error, corun / alone being the shape's paired ratio. Shapes whose KV part is small
fix f_weights; the long-context shape fixes f_kv. Without a long-context shape (an older profile, --quick) both
factors are the mean ratio, as before.

The fit is bounded below by MIN_FACTOR: a neighbour does not make a term faster, and ratios a few percent under 1
are timer noise. Unbounded, two noisy short-context shapes whose KV shares differ only by chance extrapolated to
factors such as weights 2.5 and KV reads -0.56 (a clean-clone CI run of `pdserve profile --quick`).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

MIN_KV_SHARE_SPREAD = 0.15  # the shapes' KV shares must differ by this much to tell the two factors apart
MIN_FACTOR = 0.9  # no term runs faster beside a neighbour; a paired ratio this far under 1 is noise


@dataclass(frozen=True)
class CoRun:
    """Multipliers of a decode step's weights part and of its KV reads while another engine works beside it."""
    weights: float = 1.0
    kv_reads: float = 1.0

    @classmethod
    def uniform(cls, factor: float) -> CoRun:
        return cls(factor, factor)

    def at_least(self, other: CoRun) -> CoRun:
        """Each term's larger factor (two kinds of neighbour at once: the worse of them, term by term)."""
        return CoRun(max(self.weights, other.weights), max(self.kv_reads, other.kv_reads))


NO_CORUN = CoRun()


def corun_terms(measured: dict | None, per_context: float) -> CoRun:
    """The factors of one kind of neighbour (machine["decode_corun"] or its "beside_decode"), given the decode
    fit's seconds per context token on the same clock (the CPU clock of the co-run rows)."""
    if not measured:
        return NO_CORUN
    rows = list((measured.get("batches") or {}).values())
    if not rows or any("context" not in row for row in rows):  # skipped, or a profile from before the split
        return CoRun.uniform(float(measured.get("factor", 1.0)))
    alone = np.array([row["alone_cpu_s"] for row in rows])  # (shapes,)
    ratios = np.array([row["cpu_ratio"] for row in rows])  # (shapes,): paired per round
    kv = np.minimum(per_context * np.array([float(row["context"]) for row in rows]), alone)
    share = kv / alone
    if share.max() - share.min() < MIN_KV_SHARE_SPREAD:
        return CoRun.uniform(float(ratios.mean()))
    terms = np.stack([alone - kv, kv], axis=1) / alone[:, None]  # (shapes, 2), each row relative to its step
    weights, kv_reads = bounded_least_squares(terms, ratios - 1.0, lower=MIN_FACTOR - 1.0)
    return CoRun(1.0 + weights, 1.0 + kv_reads)


def bounded_least_squares(terms: np.ndarray, target: np.ndarray, lower: float) -> tuple[float, float]:
    """argmin |terms @ x - target| over x >= lower, for two unknowns: the unbounded solution if it is feasible,
    else the best of the candidates with one or both unknowns on the bound (terms: (rows, 2))."""
    (free_a, free_b), *_ = np.linalg.lstsq(terms, target, rcond=None)
    if min(free_a, free_b) >= lower:
        return float(free_a), float(free_b)
    candidates = [(lower, lower)]
    for fixed in (0, 1):
        other = 1 - fixed
        column = terms[:, other]
        rest = target - terms[:, fixed] * lower
        value = max(lower, float(column @ rest / (column @ column))) if column @ column > 0 else lower
        candidates.append((lower, value) if fixed == 0 else (value, lower))

    def residual(x: tuple[float, float]) -> float:
        return float(np.sum((terms @ np.array(x) - target) ** 2))

    return min(candidates, key=residual)
