"""Exact dynamic programming for contiguous pipeline stages over a block chain.

Objective (``work``/``neck``/``comm``/``memory`` as in ``autopart.solve.chain``):
split the ``n`` blocks into ``S`` contiguous, non-empty stages ``[i_s, j_s)``, each
with a recompute flag ``r_s``, to minimize

    w * max_s neck_s  +  sum_s work_s  +  2 * sum_(s < S-1) comm(j_s)        (1)

subject to ``memory(i_s, j_s, r_s, in_flight[s]) <= limit[s]`` for every stage.
With ``w = m - 1`` and one stage per rank, (1) is the classic step time: fill/drain
of every stage once, each cut crossed twice (activations forward, gradients back),
then ``m - 1`` rounds of the slowest stage, whose round includes the transfers the
rank waits on (``blocking``: 1F1B's batched send/recv; GPipe's sends overlap). It is
what the simulator (``autopart.simulate``) computes on uniform chains under GPipe, and
under 1F1B with pp = 2; under 1F1B with more stages it is an upper bound (a middle
stage's last round overlaps one transfer: one cut's ``comm`` too much on uniform
chains), as it is wherever a cut's transfer outlasts the compute it overlaps.

Algorithm. Write ``sum_s work_s + 2 * sum comm = C + X`` where ``C`` (all blocks'
F+B+W) is fixed and ``X`` (cut communication + recomputed forwards) depends on the
plan. For a bottleneck bound ``B`` let ``g(B) = min X`` over plans with every
``neck_s <= B``.

1. ``B*`` = smallest feasible bottleneck: bisection over the sorted distinct stage
   times with a boolean reachability DP (``_feasible``), O(S * n) vectorized.
2. ``g(B)`` is a min-sum DP: ``f_s[j] = comm(j) + min(min_{i in W0} f_{s-1}[i],
   F[j] + min_{i in W1} (f_{s-1}[i] - F[i]))`` where the windows ``W_r = [lo_r(j),
   j-1]`` hold the starts whose stage meets ``B`` and the memory limit (a window
   because neck and memory only shrink as the start moves right; see ``chain``), and
   ``comm(j)`` counts both directions.
   Window minima come from sparse tables: O(S * n log n) vectorized.
3. Exactness: let ``P*`` be optimal and ``B' = max neck_s(P*)``, a neck
   ``>= B*``. ``g(B') <= X(P*)``, so ``w*B' + C + g(B') <= obj(P*)``, and the DP's
   plan at ``B'`` has objective ``<= w*B' + C + g(B')``. Hence the optimum is
   ``min_B w*B + C + g(B)`` over stage times ``B >= B*``. ``g`` is a non-increasing
   step function, so within a plateau the smallest ``B`` wins: we visit plateau
   starts in increasing order (bisection for the first ``B`` with a smaller ``g``)
   and stop once ``w*B + C + X_low`` cannot beat the best, ``X_low`` being the
   ``S - 1`` cheapest cuts, both ways (a lower bound on ``X``). With ``w = 0`` step 2 at
   ``B = inf`` is the answer.

For ``virtual_stages > 1`` the caller passes the ``S = pp * v`` stages with a
per-stage limit (``autopart.solve.search`` uses ``limit / v``); the ILP handles exact
rank sums.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from autopart.solve.chain import Chain, range_query, range_table

__all__ = ["plan_objective", "solve_dp"]


@dataclass(frozen=True, slots=True)
class DPSolution:
    """An optimal split: stage ``s`` holds blocks ``bounds[s][0] .. bounds[s][1] - 1``."""

    bounds: tuple[tuple[int, int], ...]
    recompute: tuple[bool, ...]
    objective_ms: float
    bottleneck_ms: float
    num_evaluations: int
    """Min-sum DP runs (for benchmarks and tests; not part of any plan)."""


def plan_objective(chain: Chain, bounds: Sequence[tuple[int, int]],
                   recompute: Sequence[bool], weight: float,
                   blocking: bool = False) -> tuple[float, float]:
    """Objective (1) and the bottleneck (the largest neck) of a given split."""
    necks = [chain.neck_time(i, j, int(r), blocking) for (i, j), r in zip(bounds, recompute)]
    total = sum(chain.stage_time(i, j, int(r)) + chain.comm_at[j]
                for (i, j), r in zip(bounds, recompute))
    return weight * max(necks) + total, max(necks)


class _Windows:
    """Per-stage feasible-start windows for one bottleneck bound."""

    def __init__(self, chain: Chain, in_flight: Sequence[int],
                 limits: Sequence[float | None], recompute: bool, blocking: bool,
                 split: bool = False) -> None:
        self.chain, self.blocking = chain, blocking
        plain = 2 if split else 0  # zero-bubble stages hold the B-to-W gradients too
        for limit in set(limits):
            ks = [k for k, lim in zip(in_flight, limits) if lim == limit]
            chain.prepare_lo_memory(plain, ks, limit)
            if recompute:
                chain.prepare_lo_memory(1, ks, limit)
        self.mem = [(chain.lo_memory(plain, k, lim),
                     chain.lo_memory(1, k, lim) if recompute else None)
                    for k, lim in zip(in_flight, limits)]
        # Recompute helps a stage only where it admits earlier starts than no recompute.
        self.use_rc = [rc is not None and bool((rc < m0).any()) for m0, rc in self.mem]

    def at(self, bound_ms: float) -> list[tuple[np.ndarray, np.ndarray | None]]:
        chain, blocking = self.chain, self.blocking
        times = [(chain.lo_time(0, bound_ms, blocking, first),
                  chain.lo_time(1, bound_ms, blocking, first) if any(self.use_rc) else None)
                 for first in (True, False)]
        return [(np.maximum(times[s > 0][0], m0),
                 np.maximum(times[s > 0][1], m1) if use else None)
                for s, ((m0, m1), use) in enumerate(zip(self.mem, self.use_rc))]


def _feasible(windows: list[tuple[np.ndarray, np.ndarray | None]], n: int) -> bool:
    """Is position n reachable after exactly len(windows) non-empty stages?"""
    reach = np.zeros(n + 1, dtype=np.int64)
    reach[0] = 1
    ends = np.arange(n + 1)
    for lo0, lo1 in windows:
        lo = lo0 if lo1 is None else np.minimum(lo0, lo1)
        count = np.concatenate([[0], np.cumsum(reach)])
        reach = (count[ends] - count[lo] > 0).astype(np.int64)
    return bool(reach[n])


def _window_min(values: np.ndarray, lo: np.ndarray) -> np.ndarray:
    """``min(values[lo[j]:j])`` for every j (inf for an empty window)."""
    ends = np.arange(len(values))
    empty = lo >= ends
    start = np.where(empty, np.maximum(ends - 1, 0), lo)
    stop = np.maximum(ends, 1)
    table = range_table(values, np.minimum, int((stop - start).max()))
    return np.where(empty, np.inf, range_query(table, np.minimum, start, stop))


def _min_sum(chain: Chain, windows: list[tuple[np.ndarray, np.ndarray | None]]
             ) -> tuple[float, list[np.ndarray]]:
    """Min X over plans inside ``windows``; returns it and every stage's f array."""
    n = chain.num_blocks
    fwd = chain.fwd_prefix
    f = np.full(n + 1, np.inf)
    f[0] = 0.0
    history = [f]
    for lo0, lo1 in windows:
        best = _window_min(f, lo0)
        if lo1 is not None:
            best = np.minimum(best, _window_min(f - fwd, lo1) + fwd)
        f = 2 * chain.comm_at + best
        history.append(f)
    return float(f[n]), history


def _backtrack(chain: Chain, windows: list[tuple[np.ndarray, np.ndarray | None]],
               history: list[np.ndarray]) -> tuple[list[tuple[int, int]], list[bool]]:
    """Recover the stages from the DP arrays (ties: no recompute, earliest start)."""
    fwd = chain.fwd_prefix
    j = chain.num_blocks
    bounds: list[tuple[int, int]] = []
    flags: list[bool] = []
    for s in range(len(windows) - 1, -1, -1):
        prev = history[s]
        lo0, lo1 = windows[s]
        cand0 = prev[lo0[j]:j]
        v0 = cand0.min() if len(cand0) else np.inf
        v1 = np.inf
        if lo1 is not None and lo1[j] < j:
            cand1 = prev[lo1[j]:j] - fwd[lo1[j]:j]
            v1 = cand1.min() + fwd[j]
        if v0 <= v1:
            i = int(lo0[j] + np.argmin(cand0))
        else:
            i = int(lo1[j] + np.argmin(cand1))
        bounds.append((i, j))
        flags.append(bool(v1 < v0))
        j = i
    assert j == 0, j
    return bounds[::-1], flags[::-1]


def _smallest_bottleneck(chain: Chain, windows_of: _Windows, candidates: np.ndarray,
                         num_stages: int) -> int:
    """Index in ``candidates`` of the smallest feasible bottleneck ``B*``."""
    n = chain.num_blocks
    single = chain.time_prefix[0][1:] - chain.time_prefix[0][:-1]
    if windows_of.blocking:
        single = single + chain.comm_at[1:]
    lower = max(chain.total_time_ms / num_stages, float(single.min()))
    lo = int(np.searchsorted(candidates, lower * (1 - 1e-9), side="left"))
    hi = len(candidates) - 1  # every stage meets the largest stage time
    while lo < hi:
        mid = (lo + hi) // 2
        if _feasible(windows_of.at(float(candidates[mid])), n):
            hi = mid
        else:
            lo = mid + 1
    return lo


def _cheapest_cuts(chain: Chain, num_stages: int) -> float:
    """Lower bound on X: the ``S - 1`` cheapest cut positions, both ways (recompute
    costs >= 0)."""
    cuts = np.sort(chain.comm_at[1:-1])
    return 2 * float(cuts[: num_stages - 1].sum())


def solve_dp(chain: Chain, *, num_stages: int, in_flight: Sequence[int],
             limits_bytes: Sequence[float | None], weight: float,
             allow_recompute: bool = True, blocking: bool = False,
             split: bool = False) -> DPSolution | None:
    """Split ``chain`` into contiguous stages minimizing objective (1) exactly.

    Args:
        chain: The blocks' costs under one training setup (``autopart.solve.chain``).
        num_stages: Stages to cut, ``pp * v``.
        in_flight: Per stage, the microbatches of activations it holds at its peak.
        limits_bytes: Per stage, its memory limit (``None``: unlimited).
        weight: ``w`` in (1); ``num_microbatches - 1`` gives the 1F1B step time.
        allow_recompute: Let a stage recompute its forward to fit its limit.
        blocking: The schedule waits on its sends (``ScheduleInfo.blocking_sends``):
            each stage's steady-state round includes its cuts' transfers.
        split: The schedule runs B and W apart (zero-bubble): a stage's memory counts
            the gradients its microbatches hold from B to W (``chain``'s ``act_2``).

    Returns:
        The optimal split with its recompute flags, objective and bottleneck, or
        ``None`` when no split fits the limits.

    Raises:
        ValueError: ``num_stages`` is not in ``1..chain.num_blocks``, or ``in_flight``
            / ``limits_bytes`` do not have one entry per stage.
    """
    n = chain.num_blocks
    if not 1 <= num_stages <= n:
        raise ValueError(f"num_stages ({num_stages}) must be in 1..{n} (the number of blocks)")
    if len(in_flight) != num_stages or len(limits_bytes) != num_stages:
        raise ValueError("in_flight and limits_bytes need one entry per stage")
    windows_of = _Windows(chain, in_flight, limits_bytes, allow_recompute, blocking, split)
    if not _feasible(windows_of.at(math.inf), n):
        return None
    num_evaluations = 0

    def evaluate(bound_ms: float) -> tuple[float, tuple[float, list, list]]:
        nonlocal num_evaluations
        num_evaluations += 1
        windows = windows_of.at(bound_ms)
        x, history = _min_sum(chain, windows)
        bounds, flags = _backtrack(chain, windows, history)
        return x, (*plan_objective(chain, bounds, flags, weight, blocking), bounds, flags)

    if weight <= 0:
        _, (obj, neck, bounds, flags) = evaluate(math.inf)
        return DPSolution(tuple(bounds), tuple(flags), obj, neck, num_evaluations)
    candidates = _stage_times(chain, any(windows_of.use_rc), blocking)
    idx = _smallest_bottleneck(chain, windows_of, candidates, num_stages)
    _, best = evaluate(float(candidates[idx]))
    x_low = _cheapest_cuts(chain, num_stages)
    if best[0] - weight * best[1] - chain.total_time_ms > x_low + 1e-9 * max(1.0, x_low):
        x_low, free_plan = evaluate(math.inf)  # g(inf): the exact lower bound on X
        best = min(best, free_plan, key=lambda plan: plan[0])
    cursor_ms = math.inf
    while True:
        # Only a bottleneck below hi_ms can beat the best objective found so far.
        hi_ms = min(cursor_ms, (best[0] - chain.total_time_ms - x_low) / weight)
        top = int(np.searchsorted(candidates, hi_ms, side="left")) - 1
        if top <= idx:
            break
        x, plan = evaluate(float(candidates[top]))
        best = min(best, plan, key=lambda p: p[0])
        # g equals x on [plan's bottleneck, candidates[top]]: that plan covers it. Below,
        # g >= x, so nothing there beats w * B* + C + x.
        if weight * candidates[idx] + chain.total_time_ms + x >= best[0]:
            break
        cursor_ms = min(plan[1], float(candidates[top]))
    obj, neck, bounds, flags = best
    return DPSolution(tuple(bounds), tuple(flags), obj, neck, num_evaluations)


def _stage_times(chain: Chain, recompute: bool, blocking: bool) -> np.ndarray:
    """Sorted distinct necks, cached on the chain (shared by every v)."""
    key = ("stage_times", recompute, blocking)
    cached = chain.cache.get(key)
    if cached is None:
        cached = chain.all_stage_times(recompute, blocking)
        chain.cache[key] = cached
    return cached


def min_fitting_limit(chain: Chain, *, in_flight: Sequence[int], num_virtual: int = 1,
                      allow_recompute: bool = True, resolution_bytes: int = 1 << 20,
                      split: bool = False) -> int:
    """Smallest device memory (within ``resolution_bytes``) for which a split fits.

    Uses the DP's model: each of the ``len(in_flight)`` stages gets ``limit /
    num_virtual`` (``split``: a zero-bubble schedule, as in ``solve_dp``). The
    returned limit is feasible (rounded up to the resolution).
    """
    n, num_stages = chain.num_blocks, len(in_flight)

    def fits(limit: int) -> bool:
        windows = _Windows(chain, in_flight, [limit / num_virtual] * num_stages,
                           allow_recompute, blocking=False, split=split)
        return _feasible(windows.at(math.inf), n)

    lo = 0
    hi = num_virtual * chain.stage_memory(0, n, 2 if split else 0, max(in_flight))  # all fit
    hi = -(-hi // resolution_bytes) * resolution_bytes
    while hi - lo > resolution_bytes:
        mid = (lo + hi) // 2 // resolution_bytes * resolution_bytes
        if mid <= lo:
            break
        if fits(mid):
            hi = mid
        else:
            lo = mid
    return hi
