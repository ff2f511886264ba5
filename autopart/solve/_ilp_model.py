"""The ILP's PuLP model over runs of identical blocks (built by ``autopart.solve.ilp``).

A run is a maximal stretch of consecutive blocks with equal time, forward, cut
communication, static, activation, kept-input, workspace and output figures (the
decoder layers of an LLM). The block-level model places blocks with cumulative
binaries ``y[b, s] = 1`` iff block ``b`` sits in a stage ``<= s`` (monotone in both
indices). Every stage term is either a sum over its blocks or a max over them, so
inside a run only how many of the run's blocks lie in stages ``<= s`` matters:

    first[k, s] = y[start_k, s],   last[k, s] = y[end_k - 1, s]            (binaries)
    count[k, s] = sum_{b in run k} y[b, s]                    (integer, 0 .. size_k)
    first[k, s] + (size_k - 1) * last[k, s] <= count[k, s]
                                             <= last[k, s] + (size_k - 1) * first[k, s]

Any such integers map to exactly one monotone ``y`` (the first ``count`` blocks of
the run), so the model is the block-level one, exactly, with 2 binaries and one
integer per run and stage instead of ``size_k`` binaries (and none of their
symmetry). A chain of distinct blocks gives runs of size 1: ``first = last = count
= y``. With ``n[k, s] = count[k, s] - count[k, s - 1]`` the blocks of run k in stage s:

    stage s holds a block of run k    p[k, s] = first[k, s] - last[k, s - 1]
    stage s starts at run k's start   first[k, s] - first[k, s - 1]
    stage s (not the last) ends in k  first[k, s] - first[k + 1, s]

(the first is exact because a stage is non-empty: if the cut before stage ``s`` is
inside run ``k``, stage ``s`` holds that run's next block). Recompute multiplies
``n`` by ``rc[s]`` through ``U[k, s]`` (the usual big-M product, M = size_k).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from autopart.solve.chain import Chain

_SAME = 1e-12
"""Relative tolerance for two blocks' figures to count as identical (prefix-sum noise)."""


@dataclass(frozen=True, slots=True)
class _Run:
    """Blocks ``start .. start + size - 1``, all with the per-block figures below."""

    start: int
    size: int
    time: float
    fwd: float
    comm: float
    static: float
    act: float
    kept: float
    work: float
    act_max: float
    out: float


def block_runs(chain: Chain) -> list[_Run]:
    """Maximal runs of consecutive blocks that every stage term treats alike."""
    n = chain.num_blocks
    prefixes = [chain.time_prefix[0], chain.fwd_prefix, chain.static_prefix,
                chain.act_prefix[0], chain.act_prefix[1]]
    table = np.stack([np.diff(p.astype(np.float64)) for p in prefixes]
                     + [chain.comm_at[1:], chain.transient_table[0][0],
                        chain.transient_table[1][0], chain.out_table[0][:n]], axis=1)
    starts = [0] + [b for b in range(1, n) if not np.allclose(
        table[b], table[b - 1], rtol=_SAME, atol=0.0)]
    runs = []
    for start, stop in zip(starts, [*starts[1:], n]):
        size = stop - start
        sums = [float(p[stop] - p[start]) / size for p in prefixes]
        runs.append(_Run(start, size, sums[0], sums[1], float(chain.comm_at[start + 1]),
                         *sums[2:], *(float(v) for v in table[start, 6:])))
    return runs


class RunModel:
    """Variables and constraints of the split; ``first/last/count`` hold vars or ints."""

    def __init__(self, chain: Chain, stage_ranks: Sequence[int], in_flight: Sequence[int],
                 limit_bytes: float | None, allow_recompute: bool) -> None:
        import pulp

        self.pulp = pulp
        self.n = chain.num_blocks
        self.num_stages = len(stage_ranks)
        self.stage_ranks = list(stage_ranks)
        self.in_flight = [int(k) for k in in_flight]
        self.limit_bytes = limit_bytes
        self.runs = block_runs(chain)
        self.num_microbatches = chain.num_microbatches
        self.prob = pulp.LpProblem("autopart_stages", pulp.LpMinimize)
        self.var = getattr(self.prob, "add_variable", pulp.LpVariable)  # PuLP >= 3.3 API
        stages = range(self.num_stages)
        self.first = [[self._y(run.start, s, f"e_{k}_{s}") for s in stages]
                      for k, run in enumerate(self.runs)]
        self.last = [[self._y(run.start + run.size - 1, s, f"f_{k}_{s}") if run.size > 1
                      else self.first[k][s] for s in stages] for k, run in enumerate(self.runs)]
        self.count = [[self._count(k, s) for s in stages] for k in range(len(self.runs))]
        self.rc = ([self.var(f"rc_{s}", cat="Binary") for s in stages]
                   if allow_recompute and limit_bytes is not None else None)
        self.u = [[self._product(k, s) for s in stages] for k in range(len(self.runs))]
        self._structure()
        self._rank_counts()
        if limit_bytes is not None:
            self._memory()

    def _rank_counts(self) -> None:
        """Integer ``N[k, r]``: blocks of run k on rank r, a branching handle for solvers.

        Redundant for the integer program (sums of integers) but it lets branch and
        bound split on "rank r holds at most / at least N layers", which is what
        proves the balance; HiGHS needs it to close memory-bound cases in time.
        """
        for k, run in enumerate(self.runs):
            if run.size < 3:
                continue
            for rank in sorted(set(self.stage_ranks)):
                total = self.pulp.lpSum(self.num_in(k, s) for s, r in enumerate(self.stage_ranks)
                                        if r == rank)
                held = self.var(f"n_{k}_r{rank}", 0, run.size, cat="Integer")
                self.prob += held == total

    def _fixed(self, b: int, s: int) -> int | None:
        """``y[b, s]`` when the stage count alone decides it (earlier stages are non-empty)."""
        if s >= b or s == self.num_stages - 1:
            return 1
        if s < self.num_stages - (self.n - b):
            return 0  # later stages need the blocks after b
        return None

    def _y(self, b: int, s: int, name: str):
        fixed = self._fixed(b, s)
        return self.var(name, cat="Binary") if fixed is None else fixed

    def _count(self, k: int, s: int):
        run, e, f = self.runs[k], self.first[k][s], self.last[k][s]
        if run.size <= 2:
            return e if run.size == 1 else e + f
        fixed = [self._fixed(b, s) for b in range(run.start, run.start + run.size)]
        lo, hi = fixed.count(1), run.size - fixed.count(0)
        if lo == hi:
            return lo
        count = self.var(f"c_{k}_{s}", lo, hi, cat="Integer")
        self.le(e + (run.size - 1) * f, count)
        self.le(count, f + (run.size - 1) * e)
        return count

    def blocks_up_to(self, s: int):
        """Blocks in stages ``<= s`` (the position of the cut after stage ``s``)."""
        return self.pulp.lpSum(self.count[k][s] for k in range(len(self.runs)))

    def num_in(self, k: int, s: int):
        """``n[k, s]``: blocks of run k in stage s."""
        return self.count[k][s] - (self.count[k][s - 1] if s else 0)

    def holds(self, k: int, s: int):
        """``p[k, s]``: 1 iff stage s holds a block of run k."""
        return self.first[k][s] - (self.last[k][s - 1] if s else 0)

    def _cap(self, k: int, s: int, per_block: float) -> int:
        """Most blocks of run k that fit stage s's memory when each takes ``per_block``."""
        size = self.runs[k].size
        if per_block <= 0:
            return size
        return min(size, int(self.limit_bytes // per_block))

    def _product(self, k: int, s: int):
        """``U[k, s] = n[k, s] * rc[s]`` (recomputed blocks of run k in stage s).

        The big-Ms are the blocks that fit the memory limit on their own with and
        without recompute (every other memory term is non-negative).
        """
        num = self.num_in(k, s)
        if self.rc is None or isinstance(num, int) and num == 0:
            return 0
        run, rc, k_s = self.runs[k], self.rc[s], self.in_flight[s]
        kept_cap = self._cap(k, s, run.static + k_s * run.kept)
        u = self.var(f"u_{k}_{s}", 0, kept_cap)
        self.le(u, num)
        self.le(u, kept_cap * rc)
        self.le(num - u, self._cap(k, s, run.static + k_s * run.act) * (1 - rc))
        return u

    def le(self, lhs, rhs) -> None:
        """Add ``lhs <= rhs`` unless both sides are constants (then it must hold)."""
        expr = lhs - rhs
        if isinstance(expr, (int, float)):
            assert expr <= 0, (lhs, rhs)
        else:
            self.prob += expr <= 0

    def _structure(self) -> None:
        num_runs, lp_sum = len(self.runs), self.pulp.lpSum
        for s in range(self.num_stages):
            for k in range(num_runs):
                if s + 1 < self.num_stages:
                    self.le(self.first[k][s], self.first[k][s + 1])
                    if self.runs[k].size > 1:
                        self.le(self.last[k][s], self.last[k][s + 1])
                    if self.runs[k].size > 2:
                        self.le(self.count[k][s], self.count[k][s + 1])
                if self.runs[k].size > 1:
                    self.le(self.last[k][s], self.first[k][s])
                if k + 1 < num_runs:
                    self.le(self.first[k + 1][s], self.last[k][s])
            self.le(1, lp_sum(self.num_in(k, s) for k in range(num_runs)))

    def stage_time(self, s: int):
        """``time_s`` as a linear expression."""
        lp_sum, runs = self.pulp.lpSum, self.runs
        expr = lp_sum(run.time * self.num_in(k, s) + run.fwd * self.u[k][s]
                      for k, run in enumerate(runs))
        if s + 1 < self.num_stages:  # the cut after the stage's last block
            expr += lp_sum(run.comm * (self.first[k][s] - (self.first[k + 1][s]
                                                           if k + 1 < len(runs) else 0))
                           for k, run in enumerate(runs))
        return expr

    def _memory(self) -> None:
        """Every rank's memory (exact sum over its stages) stays within the limit."""
        lp_sum, new_var = self.pulp.lpSum, self.var
        in_flight, limit_bytes = self.in_flight, self.limit_bytes
        # Bytes in units of ~1e-4 of the limit keep coefficients near 1 (HiGHS needs it).
        unit = max(1.0, limit_bytes / 1e4)
        runs = [dataclasses.replace(r, static=r.static / unit, act=r.act / unit,
                                    kept=r.kept / unit, work=r.work / unit,
                                    act_max=r.act_max / unit, out=r.out / unit)
                for r in self.runs]
        m = self.num_microbatches
        for rank in sorted(set(self.stage_ranks)):
            transient = new_var(f"tr_{rank}", 0)
            total = transient
            for s in (s for s, r in enumerate(self.stage_ranks) if r == rank):
                buffers, rebuilt = new_var(f"buf_{s}", 0), new_var(f"ma_{s}", 0)
                for k, run in enumerate(runs):
                    holds = self.holds(k, s)
                    if isinstance(holds, int) and holds == 0:
                        continue
                    self.le(m * run.out * holds, buffers)
                    if k:
                        starts = self.first[k][s] - (self.first[k][s - 1] if s else 0)
                        self.le(m * runs[k - 1].out * starts, buffers)
                    self.le(run.work * holds + rebuilt, transient)
                    if self.rc is not None:
                        self.le(run.act_max * (holds + self.rc[s] - 1), rebuilt)
                held = lp_sum(run.act * self.num_in(k, s) - (run.act - run.kept) * self.u[k][s]
                              for k, run in enumerate(runs))
                total += (lp_sum(run.static * self.num_in(k, s) for k, run in enumerate(runs))
                          + int(in_flight[s]) * held + buffers
                          + (m + int(in_flight[s])) * self._end_out(runs, s))
            self.prob += total <= limit_bytes / unit, f"memory_rank_{rank}"

    def _end_out(self, runs: Sequence[_Run], s: int):
        """Output bytes of stage ``s``'s last block (0 for the last stage)."""
        if s + 1 == self.num_stages:
            return 0
        return self.pulp.lpSum(run.out * (self.first[k][s] - (self.first[k + 1][s]
                                                              if k + 1 < len(runs) else 0))
                               for k, run in enumerate(runs))

    def ends(self) -> list[int]:
        """Stage end positions of the solved model."""
        value = self.pulp.value
        return [sum(round(value(c) or 0) for c in column) for column in zip(*self.count)]


_MAX_SUBSET_SUMS = 1 << 16
"""Past this many distinct subset sums the rank-time floor falls back to the average."""


def rank_time_floor(runs: Sequence[_Run], stage_ranks: Sequence[int], min_comm: float) -> float:
    """A lower bound on the slowest rank's time that knows block times are indivisible.

    Rank ``r`` takes ``B_r`` (F+B+W of its blocks, a subset sum of block times) plus at
    least ``e_r`` (``min_comm`` per stage of r that is not the last; recompute only
    adds). If every rank takes at most ``T`` then ``B_r <= best(T - e_r)``, the largest
    subset sum not above ``T - e_r``, and the ``B_r`` add up to the total, so the
    slowest rank takes at least the smallest ``T`` with ``sum_r best(T - e_r) >= total``.
    (Falls back to the average when the subset sums are too many to list.)
    """
    num_ranks = len(set(stage_ranks))
    extra = np.array([min_comm * sum(1 for s, q in enumerate(stage_ranks)
                                     if q == r and s + 1 < len(stage_ranks))
                      for r in sorted(set(stage_ranks))])
    total = sum(run.time * run.size for run in runs)
    average = (total + extra.sum()) / num_ranks
    simple = max(average, max(run.time for run in runs))
    sums = np.zeros(1)
    for run in runs:
        sums = np.unique(np.round((sums[:, None] + run.time * np.arange(run.size + 1)).ravel(),
                                  9))
        if len(sums) > _MAX_SUBSET_SUMS:
            return simple
    tol = 1e-9 * (len(runs) + 1) + 1e-12 * total  # covers the rounding of the sums above
    candidates = np.unique((sums[:, None] + np.unique(extra)[None, :]).ravel())
    candidates = candidates[candidates >= simple - tol]

    def fits(bound: float) -> bool:
        best = sums[np.searchsorted(sums, bound - extra + tol, side="right") - 1]
        return float(best.sum()) >= total - tol

    lo, hi = 0, len(candidates) - 1  # the largest candidate (all blocks on each rank) fits
    while lo < hi:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if fits(float(candidates[mid])) else (mid + 1, hi)
    return max(simple, float(candidates[lo]) - tol)
