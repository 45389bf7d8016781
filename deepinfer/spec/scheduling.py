"""How many draft tokens each request verifies: DSpark's hardware-aware prefix
scheduler (Algorithm 1 of the paper) and the calibration of the confidences it
consumes (sequential temperature scaling, STS).

What belongs here: CPU bookkeeping over an [R, γ] table of confidences c_{r,k},
the probability that draft position k survives given positions 1..k-1 did, and
the SPS table (target steps per second as a function of the token batch size B,
profiled once at engine start). What does not: computing confidences (the
drafter), profiling SPS (the engine), the accept/reject rule (rejection.py).

A request r verifying ℓ_r drafts puts 1 + ℓ_r tokens in the batch and commits,
in expectation, 1 + Σ_{j<=ℓ_r} a_{r,j} tokens, a_{r,j} = Π_{i<=j} c_{r,i} being
the survival probability. The scheduler maximises expected tokens per second,
Θ = (R + Σ_r Σ_{j<=ℓ_r} a_{r,j}) · SPS(R + Σ_r ℓ_r).

Losslessness constrains the search, not just its cost: c_{r,j+1} may depend on
draft token x_{r,j}, so whether x_{r,j} is verified must be decided before
looking at a_{r,j+1}. ``schedule`` walks the candidates in descending survival
and stops at the first that does not raise Θ: every decision to verify x_{r,j}
then rests on survivals up to a_{r,j}, which depend on x_{r,<j} only.
``full_search`` keeps walking and takes the best Θ anywhere: that choice can
depend on x_{r,j} itself and biases the output (the paper's Appendix A). Use it
only where the confidences cannot see the current draft (the production
variant: a capacity from confidences two steps old, then ``take_top`` of the
live ones) and as a negative control in tests.

Shapes: R requests, γ draft positions, N logged rounds, M = R·γ candidates.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np


@dataclass(frozen=True)
class SPSTable:
    """Target steps per second at token batch size B, from profiled points
    ``((B_1, sps_1), ...)`` with B strictly increasing.

    SPS(B) is the value at the smallest profiled B_i >= B (the next bucket, not an
    interpolation): the engine pads a batch to its captured graph size, so a step
    of B tokens costs what the bucket costs. Beyond the largest point SPS is 0, so
    the scheduler never grows a batch past what was profiled.
    """

    points: tuple[tuple[int, float], ...]
    _sizes: np.ndarray = field(init=False, repr=False, compare=False)
    _sps: np.ndarray = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        sizes = np.array([b for b, _ in self.points], dtype=np.int64)
        sps = np.array([s for _, s in self.points], dtype=np.float64)
        if len(sizes) == 0 or np.any(np.diff(sizes) <= 0) or sizes[0] < 1 or np.any(sps <= 0):
            raise ValueError(f"SPS table needs points with B >= 1 strictly increasing and sps > 0, "
                             f"got {self.points}")
        object.__setattr__(self, "_sizes", sizes)
        object.__setattr__(self, "_sps", sps)

    def __call__(self, batch_tokens: np.ndarray | int) -> np.ndarray:
        i = np.searchsorted(self._sizes, batch_tokens, side="left")
        return np.where(i < len(self._sizes), self._sps[np.minimum(i, len(self._sps) - 1)], 0.0)


def survival(confidences: np.ndarray) -> np.ndarray:
    """a_{r,j} = Π_{i<=j} c_{r,i}: [R, γ] -> [R, γ], non-increasing along j."""
    c = np.asarray(confidences, dtype=np.float64)
    if c.ndim != 2 or np.any(c < 0) or np.any(c > 1):
        raise ValueError(f"confidences must be [R, γ] in [0, 1], got shape {c.shape}")
    return np.cumprod(c, axis=1)


def schedule(confidences: np.ndarray, sps: SPSTable) -> np.ndarray:
    """Algorithm 1 with its early stop: the draft lengths ℓ [R] int64 to verify.

    Candidates (r, j) with a_{r,j} > 0 are taken in descending a (ties: lower j
    first, then lower r), each adding one token to B and a_{r,j} to the expected
    commit τ; the walk stops at the first candidate whose Θ = τ·SPS(B) is not
    above the previous one. Since a is non-increasing along j, each request's
    taken candidates form a prefix 1..ℓ_r.
    """
    rows, gains = _candidates(confidences)
    theta = _throughput(gains, len(confidences), sps)                                 # [M+1]
    improves = theta[1:] > theta[:-1]                                                 # [M]
    taken = len(gains) if improves.all() else int(np.argmin(improves))
    return _lengths(rows[:taken], len(confidences))


def full_search(confidences: np.ndarray, sps: SPSTable) -> np.ndarray:
    """The same walk without the early stop: the prefix of the sorted candidates
    with the highest Θ (the shortest on ties). Optimal when SPS is jagged, but
    lossless only on confidences that do not depend on the drafts being verified
    (see the module docstring): use it to size a capacity from stale confidences,
    never on live ones."""
    rows, gains = _candidates(confidences)
    theta = _throughput(gains, len(confidences), sps)                                 # [M+1]
    return _lengths(rows[:int(np.argmax(theta))], len(confidences))


def take_top(confidences: np.ndarray, budget: int) -> np.ndarray:
    """The ``budget`` draft tokens with the highest live survival, in the same
    order as ``schedule`` (so prefixes, and lossless: the cut is fixed before the
    walk). ℓ [R] int64."""
    rows, _ = _candidates(confidences)
    return _lengths(rows[:max(budget, 0)], len(confidences))


def _candidates(confidences: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The (r, j) with a_{r,j} > 0 in walk order: their rows [M] and a [M]."""
    a = survival(confidences)                                                         # [R, γ]
    r, j = np.nonzero(a > 0)
    order = np.lexsort((r, j, -a[r, j]))                                              # a desc, then j, then r
    return r[order], a[r, j][order]


def _throughput(gains: np.ndarray, num_requests: int, sps: SPSTable) -> np.ndarray:
    """Θ after taking the first 0..M candidates: [M+1]."""
    tau = num_requests + np.concatenate([[0.0], np.cumsum(gains)])                   # [M+1]
    return tau * sps(num_requests + np.arange(len(gains) + 1))


def _lengths(rows: np.ndarray, num_requests: int) -> np.ndarray:
    return np.bincount(rows, minlength=num_requests).astype(np.int64)


# -- sequential temperature scaling -----------------------------------------------------------------

def expected_calibration_error(predicted: np.ndarray, observed: np.ndarray, num_bins: int = 20) -> float:
    """ECE over ``num_bins`` equal-width bins of [0, 1]: Σ_b (n_b / N)·|mean p_b − mean y_b|.
    predicted, observed: [N]."""
    return float(_ece(np.asarray(predicted, dtype=np.float64)[None], np.asarray(observed), num_bins)[0])


def _ece(predicted: np.ndarray, observed: np.ndarray, num_bins: int) -> np.ndarray:
    """ECE of each row of predicted [G, N] against observed [N]: [G]."""
    g, n = predicted.shape
    bins = np.minimum((predicted * num_bins).astype(np.int64), num_bins - 1)          # [G, N]
    flat = (bins + num_bins * np.arange(g)[:, None]).ravel()                          # [G*N]
    p_sum = np.bincount(flat, weights=predicted.ravel(), minlength=g * num_bins)
    y_sum = np.bincount(flat, weights=np.broadcast_to(observed, (g, n)).ravel().astype(np.float64),
                        minlength=g * num_bins)
    # (n_b / N)·|mean p_b − mean y_b| = |Σ_b p − Σ_b y| / N
    return np.abs(p_sum - y_sum).reshape(g, num_bins).sum(1) / n


def fit_sts(logits: np.ndarray, accepted: np.ndarray, grid: np.ndarray | None = None,
            num_bins: int = 20) -> np.ndarray:
    """Per-position temperatures T [γ] for c_k = σ(z_k / T_k), fitted left to right:
    T_k is the grid value minimising the ECE of Π_{i<=k} c_i against ``accepted[:, k]``
    with T_1..T_{k-1} already fixed. logits: [N, γ] confidence logits z from logged
    rounds drafted to full length; accepted: [N, γ] 1 where positions 1..k were all
    accepted. The default grid is 241 log-spaced values in [0.05, 20]."""
    z = np.asarray(logits, dtype=np.float64)
    y = np.asarray(accepted, dtype=np.float64)
    if z.ndim != 2 or z.shape != y.shape:
        raise ValueError(f"logits {z.shape} and accepted {y.shape} must both be [N, γ]")
    grid = np.geomspace(0.05, 20.0, 241) if grid is None else np.asarray(grid, dtype=np.float64)
    temps = np.empty(z.shape[1])
    prefix = np.ones(len(z))                                                          # [N] Π_{i<k} c_i
    for k in range(z.shape[1]):
        candidates = prefix * _sigmoid(z[:, k] / grid[:, None])                       # [G, N]
        best = int(np.argmin(_ece(candidates, y[:, k], num_bins)))
        temps[k] = grid[best]
        prefix = candidates[best]
    return temps


def apply_sts(logits: np.ndarray, temperatures: np.ndarray) -> np.ndarray:
    """Calibrated confidences σ(z / T): logits [R, γ], temperatures [γ] -> [R, γ]."""
    return _sigmoid(np.asarray(logits, dtype=np.float64) / np.asarray(temperatures, dtype=np.float64))


def _sigmoid(x: np.ndarray) -> np.ndarray:
    return 0.5 * (1.0 + np.tanh(0.5 * x))
