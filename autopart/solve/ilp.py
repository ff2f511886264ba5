"""Integer program (PuLP) for placements where a rank holds several stages.

Same stage ``time`` and ``memory`` terms as ``autopart.solve._chain``, but summed
per rank exactly: rank ``r`` holds stages ``{s : stage_to_rank(s) = r}`` and

    minimize   (m - 1) * max_r R_r  +  (1 / v) * sum_s time_s,   R_r = sum_{s on r} time_s
    subject to sum_{s on r} (static_s + k_s * act_s + buffers_s) + max_{s on r} transient_s
               <= limit                                                   (every rank r)

With ``v = 1`` this is the DP's objective (1) with ``w = m - 1``. Blocks are placed
with the cumulative variables ``y[b, s] = 1`` iff block ``b`` sits in a stage
``<= s``: monotone in both indices, so contiguity is two families of ``<=`` and the
cut after block ``b`` closing stage ``s`` is ``y[b, s] - y[b + 1, s]``; this is much
tighter than assignment plus contiguity constraints. ``u[b, s] = x[b, s] AND rc[s]``
linearizes recompute. PuLP is imported inside the functions only.
"""

from __future__ import annotations

import importlib.util
import logging
import warnings
from collections.abc import Sequence
from dataclasses import dataclass

from autopart.solve._chain import Chain

__all__ = ["ILPSolution", "solve_ilp"]

_LOG = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class ILPSolution:
    """The ILP's split, its status and, when stopped early, the gap to the bound."""

    bounds: tuple[tuple[int, int], ...]
    recompute: tuple[bool, ...]
    objective_ms: float
    status: str
    """``optimal`` or ``time_limit`` (a feasible plan, maybe not optimal)."""
    backend: str
    gap: float | None
    """Relative gap to the best bound; 0 when optimal, None when the backend hides it."""


def _backend(name: str, time_limit_s: float):
    import pulp

    if name == "auto":
        name = "highs" if importlib.util.find_spec("highspy") is not None else "cbc"
    if name == "highs":
        return "highs", pulp.HiGHS(msg=False, timeLimit=time_limit_s, threads=1)
    if name == "cbc":
        with warnings.catch_warnings():  # PuLP 3.3 flags its bundled CBC for PuLP 4.0
            warnings.simplefilter("ignore", DeprecationWarning)
            return "cbc", pulp.PULP_CBC_CMD(msg=0, timeLimit=time_limit_s, threads=1)
    raise ValueError(f"unknown ILP backend {name!r}; choose auto, highs or cbc")


class _Model:
    """Builds the PuLP problem; ``y`` holds variables or the constants 0/1."""

    def __init__(self, chain: Chain, stage_ranks: Sequence[int], allow_recompute: bool) -> None:
        import pulp

        self.pulp = pulp
        self.chain = chain
        self.n = chain.num_blocks
        self.num_stages = len(stage_ranks)
        self.stage_ranks = list(stage_ranks)
        self.prob = pulp.LpProblem("autopart_stages", pulp.LpMinimize)
        self.var = getattr(self.prob, "add_variable", pulp.LpVariable)  # PuLP >= 3.3 API
        n, num_stages = self.n, self.num_stages
        self.y: list[list] = []
        for b in range(n):
            row = []
            for s in range(num_stages):
                if s >= b or s == num_stages - 1:
                    row.append(1)  # block b cannot sit past stage b: earlier stages are non-empty
                elif s < num_stages - (n - b):
                    row.append(0)  # later stages need the blocks after b
                else:
                    row.append(self.var(f"y_{b}_{s}", cat="Binary"))
            self.y.append(row)
        self.x = [[self.y[b][s] - (self.y[b][s - 1] if s else 0) for s in range(num_stages)]
                  for b in range(n)]
        self.rc = ([self.var(f"rc_{s}", cat="Binary") for s in range(num_stages)]
                   if allow_recompute else None)
        self.u = None
        if self.rc is not None:
            self.u = [[self.var(f"u_{b}_{s}", 0, 1) for s in range(num_stages)]
                      for b in range(n)]
        self._structure()

    def _structure(self) -> None:
        prob, y, x = self.prob, self.y, self.x
        for b in range(self.n):
            for s in range(self.num_stages):
                if s + 1 < self.num_stages and not isinstance(y[b][s], int):
                    prob += y[b][s] <= y[b][s + 1]
                if b + 1 < self.n and not isinstance(y[b + 1][s], int):
                    prob += y[b + 1][s] <= y[b][s]
                if self.u is not None:
                    prob += self.u[b][s] <= x[b][s]
                    prob += self.u[b][s] <= self.rc[s]
                    prob += self.u[b][s] >= x[b][s] + self.rc[s] - 1
        for s in range(self.num_stages):
            prob += self.pulp.lpSum(x[b][s] for b in range(self.n)) >= 1

    def stage_time(self, s: int):
        """``time_s`` as a linear expression."""
        chain, lp_sum = self.chain, self.pulp.lpSum
        q0, fwd = chain.time_prefix[0], chain.fwd_prefix
        expr = lp_sum(float(q0[b + 1] - q0[b]) * self.x[b][s] for b in range(self.n))
        if self.u is not None:
            expr += lp_sum(float(fwd[b + 1] - fwd[b]) * self.u[b][s] for b in range(self.n))
        if s + 1 < self.num_stages:
            expr += lp_sum(float(chain.comm_at[b + 1]) * (self.y[b][s] - self.y[b + 1][s])
                           for b in range(self.n - 1))
        return expr

    def add_memory(self, in_flight: Sequence[int], limit_bytes: float) -> None:
        """Every rank's memory (exact sum over its stages) stays within ``limit_bytes``."""
        chain, lp_sum, new_var = self.chain, self.pulp.lpSum, self.var
        n = self.n
        static = [int(v) for v in chain.static_prefix[1:] - chain.static_prefix[:-1]]
        act = [int(v) for v in chain.act_prefix[0][1:] - chain.act_prefix[0][:-1]]
        kept = [int(v) for v in chain.act_prefix[1][1:] - chain.act_prefix[1][:-1]]
        work = [float(v) for v in chain.transient_table[0][0]]
        act_max = [float(v) for v in chain.transient_table[1][0]]
        out = [float(v) for v in chain.out_table[0]]
        for rank in sorted(set(self.stage_ranks)):
            transient = new_var(f"tr_{rank}", 0)
            total = transient
            for s in (s for s, r in enumerate(self.stage_ranks) if r == rank):
                buffers = new_var(f"buf_{s}", 0)
                rebuilt = new_var(f"ma_{s}", 0)
                for b in range(n):
                    self.prob += buffers >= 2 * out[b] * self.x[b][s]
                    if b:
                        self.prob += buffers >= 2 * out[b - 1] * self.x[b][s]
                    self.prob += transient >= work[b] * self.x[b][s] + rebuilt
                    if self.u is not None:
                        self.prob += rebuilt >= act_max[b] * self.u[b][s]
                held = lp_sum(act[b] * self.x[b][s] for b in range(n))
                if self.u is not None:
                    held -= lp_sum((act[b] - kept[b]) * self.u[b][s] for b in range(n))
                total += (lp_sum(static[b] * self.x[b][s] for b in range(n))
                          + int(in_flight[s]) * held + buffers)
            self.prob += total <= limit_bytes, f"memory_rank_{rank}"

    def solution(self) -> tuple[tuple[tuple[int, int], ...], tuple[bool, ...]]:
        """Stage bounds and recompute flags of the solved model."""
        stage_of = []
        for b in range(self.n):
            values = [v if isinstance(v, int) else round(v.value() or 0) for v in self.y[b]]
            stage_of.append(values.index(1))
        bounds = []
        for s in range(self.num_stages):
            members = [b for b, t in enumerate(stage_of) if t == s]
            bounds.append((members[0], members[-1] + 1))
        flags = tuple(bool(self.rc is not None and round(self.rc[s].value() or 0))
                      for s in range(self.num_stages))
        return tuple(bounds), flags


def rank_objective(chain: Chain, bounds: Sequence[tuple[int, int]], recompute: Sequence[bool],
                   stage_ranks: Sequence[int], num_microbatches: int) -> float:
    """The ILP objective of a given split (used to re-evaluate and in tests)."""
    times = [chain.stage_time(i, j, int(r)) for (i, j), r in zip(bounds, recompute)]
    rank_ms: dict[int, float] = {}
    for t, rank in zip(times, stage_ranks):
        rank_ms[rank] = rank_ms.get(rank, 0.0) + t
    num_virtual = len(times) // len(rank_ms)
    return (num_microbatches - 1) * max(rank_ms.values()) + sum(times) / num_virtual


def solve_ilp(chain: Chain, *, stage_ranks: Sequence[int], in_flight: Sequence[int],
              num_microbatches: int, limit_bytes: float | None = None,
              allow_recompute: bool = True, backend: str = "auto",
              time_limit_s: float = 60.0) -> ILPSolution | None:
    """Solve the rank-level program; ``None`` when no split fits ``limit_bytes``.

    ``stage_ranks[s]`` is the rank of stage ``s`` (``autopart.schedules.stage_to_rank``),
    ``in_flight[s]`` its in-flight microbatches. ``backend``: ``auto`` (HiGHS when
    highspy is installed, else CBC), ``highs`` or ``cbc``.
    """
    import pulp

    num_stages = len(stage_ranks)
    if not 1 <= num_stages <= chain.num_blocks:
        raise ValueError(f"num_stages ({num_stages}) must be in 1..{chain.num_blocks}")
    name, solver = _backend(backend, time_limit_s)
    model = _Model(chain, stage_ranks, allow_recompute and limit_bytes is not None)
    times = [model.stage_time(s) for s in range(num_stages)]
    slowest = model.var("slowest_rank_ms", 0)
    for rank in sorted(set(stage_ranks)):
        model.prob += slowest >= pulp.lpSum(t for t, r in zip(times, stage_ranks) if r == rank)
    num_virtual = num_stages // len(set(stage_ranks))
    model.prob += (num_microbatches - 1) * slowest + pulp.lpSum(times) * (1.0 / num_virtual)
    if limit_bytes is not None:
        model.add_memory(in_flight, limit_bytes)
    model.prob.solve(solver)
    if model.prob.sol_status not in (pulp.LpSolutionOptimal, pulp.LpSolutionIntegerFeasible):
        _LOG.info("ILP found no plan (status %s)", pulp.LpStatus[model.prob.status])
        return None
    optimal = model.prob.sol_status == pulp.LpSolutionOptimal
    gap = 0.0 if optimal else _highs_gap(model.prob) if name == "highs" else None
    bounds, flags = model.solution()
    objective = rank_objective(chain, bounds, flags, stage_ranks, num_microbatches)
    return ILPSolution(bounds, flags, objective, "optimal" if optimal else "time_limit",
                       name, gap)


def _highs_gap(prob) -> float | None:
    try:
        return float(prob.solverModel.getInfo().mip_gap)
    except AttributeError:
        return None
