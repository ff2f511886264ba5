"""Integer program (PuLP) for placements where a rank holds several stages.

Same stage ``time`` and ``memory`` terms as ``autopart.solve.chain``, but summed
per rank exactly: rank ``r`` holds stages ``{s : stage_to_rank(s) = r}`` and

    minimize   (m - 1) * max_r R_r  +  (1 / v) * sum_s time_s,   R_r = sum_{s on r} time_s
    subject to sum_{s on r} (static_s + k_s * act_s + buffers_s) + max_{s on r} transient_s
               <= limit                                                   (every rank r)

With ``v = 1`` this is the DP's objective (1) with ``w = m - 1``. The model
(``autopart.solve._ilp_model``) places blocks with cumulative variables (block ``b``
sits in a stage ``<= s``), aggregated over runs of identical blocks: two binaries
and one integer per run and stage, exact for any chain (a chain of distinct blocks
is the plain block-level model). What makes it prove optimality quickly:

* integer ``N[k, r]``, the blocks of run ``k`` on rank ``r``, to branch on;
* a floor on ``max_r R_r`` from subset sums of block times (``rank_time_floor``),
  which the LP's average ``sum_r R_r / pp`` misses when blocks are indivisible;
* big-Ms for recompute from how many blocks fit the limit on their own.

A solver calls a plan optimal within a relative gap of ``_GAP_REL``. PuLP is
imported inside the functions only.
"""

from __future__ import annotations

import contextlib
import ctypes
import hashlib
import importlib.util
import logging
import os
import sys
import warnings
from collections.abc import Sequence
from dataclasses import dataclass

from autopart.solve._ilp_model import RunModel, rank_time_floor
from autopart.solve.chain import Chain

__all__ = ["ILPLimits", "solve_ilp"]

_LOG = logging.getLogger(__name__)

_GAP_REL = 1e-9
"""Relative gap at which a solver may call its plan optimal (HiGHS defaults to 1e-4)."""
_TIE_WEIGHT = 1e-5
"""The tie-break term's largest value, relative to the blocks' total time."""


@dataclass(frozen=True, slots=True)
class ILPLimits:
    """Which solver runs the ILP and how much work it may do."""

    backend: str = "auto"
    """``auto`` (HiGHS when highspy is installed, else CBC), ``highs`` or ``cbc``."""
    max_nodes: int | None = 100_000
    """Branch-and-bound nodes the solver may explore: a bound on work, so the answer does
    not depend on the machine or its load. When hit, the best split found is returned
    with status ``limit`` and its gap."""
    time_limit_s: float | None = None
    """An optional wall-clock limit as well (``None``: none); a split it cuts off depends
    on the machine's speed."""


@dataclass(frozen=True, slots=True)
class ILPSolution:
    """The ILP's split, its status and, when stopped early, the gap to the bound."""

    bounds: tuple[tuple[int, int], ...]
    recompute: tuple[bool, ...]
    objective_ms: float
    status: str
    """``optimal`` (for the model above) or ``limit`` (the node or time limit stopped
    the solver: a feasible plan, maybe not optimal)."""
    backend: str
    gap: float | None
    """Relative gap to the best bound; 0 when optimal, None when the backend hides it."""


def _backend(name: str, time_limit_s: float | None, max_nodes: int | None):
    import pulp

    if name == "auto":
        name = "highs" if importlib.util.find_spec("highspy") is not None else "cbc"
    if name == "highs":
        extra = {} if max_nodes is None else {"mip_max_nodes": int(max_nodes)}
        return "highs", _node_limited_highs()(msg=False, timeLimit=time_limit_s, threads=1,
                                              gapRel=_GAP_REL, gapAbs=0.0, **extra)
    if name == "cbc":
        with warnings.catch_warnings():  # PuLP 3.3 flags its bundled CBC for PuLP 4.0
            warnings.simplefilter("ignore", DeprecationWarning)
            # CBC's integer preprocessing returned a split 11% above the optimum as
            # "optimal" on a 2-block chain (tests/test_solve_ilp.py); without it CBC agrees
            # with HiGHS and brute force
            return "cbc", pulp.PULP_CBC_CMD(msg=0, timeLimit=time_limit_s, threads=1,
                                           gapRel=_GAP_REL, gapAbs=0.0,
                                           maxNodes=max_nodes, options=["preprocess off"])
    raise ValueError(f"unknown ILP backend {name!r}; choose auto, highs or cbc")


def _node_limited_highs():
    """PuLP's HiGHS interface, reading the incumbent when ``mip_max_nodes`` stops the search.

    HiGHS reports a node limit as ``kSolutionLimit``, a status PuLP 3.3's
    ``findSolutionValues`` has no entry for (it raises ``KeyError``). Under that status
    the incumbent is read as PuLP reads it under a time limit; every other status goes
    to PuLP unchanged.
    """
    import highspy
    import pulp

    class NodeLimitedHiGHS(pulp.HiGHS):
        def findSolutionValues(self, lp):  # noqa: N802 (PuLP's name)
            model = lp.solverModel
            if model.getModelStatus() != highspy.HighsModelStatus.kSolutionLimit:
                return super().findSolutionValues(lp)
            values = list(model.getSolution().col_value)
            if not values or model.getObjectiveValue() == float("inf"):
                return pulp.LpStatusNotSolved, pulp.LpSolutionNoSolutionFound
            for var in lp.variables():
                var.varValue = values[var.index]
            return pulp.LpStatusOptimal, pulp.LpSolutionIntegerFeasible

    return NodeLimitedHiGHS


@contextlib.contextmanager
def _native_stdout_silenced():
    """Keep the solver's native output off file descriptor 1.

    highspy prints its banner from C++ when PuLP constructs it, whatever ``msg`` says,
    and ``autopart plan --format json`` writes the plan to stdout: the banner would
    precede the JSON. The C library's buffers are flushed before stdout comes back.
    """
    sys.stdout.flush()
    saved = os.dup(1)
    try:
        with open(os.devnull, "w") as devnull:
            os.dup2(devnull.fileno(), 1)
            try:
                yield
            finally:
                with contextlib.suppress(OSError, AttributeError):
                    ctypes.CDLL(None).fflush(None)
    finally:
        os.dup2(saved, 1)
        os.close(saved)


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
              allow_recompute: bool = True, limits: ILPLimits = ILPLimits()
              ) -> ILPSolution | None:
    """Split ``chain`` into stages minimizing the rank-level step time (PuLP).

    Unlike ``solve_dp``, which bounds the slowest stage, this sums each rank's
    stages, so it is exact for ``v > 1``: ``(m - 1) * max_rank sum + sum / v``.

    Args:
        chain: The blocks' costs under one training setup (``autopart.solve.chain``).
        stage_ranks: Per stage, its rank (``autopart.schedules.stage_to_rank``).
        in_flight: Per stage, the microbatches of activations it holds at its peak.
        num_microbatches: ``m``.
        limit_bytes: Each rank's memory limit (``None``: unlimited).
        allow_recompute: Let a stage recompute its forward to fit the limit.
        limits: The backend and its node and time limits (``ILPLimits``).

    Returns:
        The split with its recompute flags, objective, status and gap, or ``None``
        when no split fits ``limit_bytes``.

    Raises:
        ValueError: More stages than blocks, or an unknown ``backend``.
    """
    num_stages = len(stage_ranks)
    if not 1 <= num_stages <= chain.num_blocks:
        raise ValueError(f"num_stages ({num_stages}) must be in 1..{chain.num_blocks}")
    key = (_chain_key(chain), tuple(stage_ranks), tuple(in_flight), num_microbatches,
           limit_bytes, allow_recompute, limits)
    if key not in _SOLVED:
        if len(_SOLVED) >= _SOLVED_MAX:
            del _SOLVED[next(iter(_SOLVED))]
        _SOLVED[key] = _solve(chain, stage_ranks, in_flight, num_microbatches, limit_bytes,
                              allow_recompute, limits)
    return _SOLVED[key]


_SOLVED: dict[tuple, ILPSolution | None] = {}
"""Answers of ``solve_ilp`` by problem: a plan's search asks the same coarsest chain at
every level and microbatch count it tries (tiny-llama at pp 8 under Interleaved 1F1B:
12 solves of 3 problems, 10-25 s each)."""
_SOLVED_MAX = 64


def _chain_key(chain: Chain) -> str:
    """A digest of everything in ``chain`` the ILP reads (chains are rebuilt per level)."""
    digest = hashlib.sha256(str(chain.num_microbatches).encode())
    arrays = [*chain.time_prefix, chain.fwd_prefix, chain.comm_at, chain.static_prefix,
              *chain.act_prefix, *chain.transient_table, chain.out_table, chain.cut_out,
              *(chain.static_ends or ())]
    for array in arrays:
        digest.update(array.tobytes())
        digest.update(str(array.shape).encode())
    return digest.hexdigest()


def _solve(chain: Chain, stage_ranks: Sequence[int], in_flight: Sequence[int],
           num_microbatches: int, limit_bytes: float | None, allow_recompute: bool,
           limits: ILPLimits) -> ILPSolution | None:
    """``solve_ilp`` itself, uncached."""
    import pulp

    num_stages = len(stage_ranks)
    name, solver = _backend(limits.backend, limits.time_limit_s, limits.max_nodes)
    model = RunModel(chain, stage_ranks, in_flight, limit_bytes, allow_recompute)
    times = [model.stage_time(s) for s in range(num_stages)]
    min_comm = float(chain.comm_at[1:-1].min()) if chain.num_blocks > 1 else 0.0
    slowest = model.var("slowest_rank_ms", rank_time_floor(model.runs, stage_ranks, min_comm))
    for rank in sorted(set(stage_ranks)):
        model.prob += slowest >= pulp.lpSum(t for t, r in zip(times, stage_ranks) if r == rank)
    num_virtual = num_stages // len(set(stage_ranks))
    # Ties between equally fast splits break toward earlier cuts, the same for every
    # backend: a perturbation of at most _TIE_WEIGHT of the step on the cut positions.
    tie = _TIE_WEIGHT * chain.total_time_ms / max(1, chain.num_blocks * num_stages)
    model.prob += ((num_microbatches - 1) * slowest + pulp.lpSum(times) * (1.0 / num_virtual)
                   + tie * pulp.lpSum(model.blocks_up_to(s) for s in range(num_stages - 1)))
    with _native_stdout_silenced():
        model.prob.solve(solver)
    if model.prob.sol_status not in (pulp.LpSolutionOptimal, pulp.LpSolutionIntegerFeasible):
        _LOG.info("ILP found no plan (status %s)", pulp.LpStatus[model.prob.status])
        return None
    optimal = model.prob.sol_status == pulp.LpSolutionOptimal
    gap = 0.0 if optimal else _highs_gap(model.prob) if name == "highs" else None
    ends = model.ends()
    bounds = tuple(zip([0, *ends[:-1]], ends))
    flags = tuple(bool(round(pulp.value(r) or 0)) for r in model.rc or [0] * num_stages)
    objective = rank_objective(chain, bounds, flags, stage_ranks, num_microbatches)
    return ILPSolution(bounds, flags, objective, "optimal" if optimal else "limit",
                       name, gap)


def _highs_gap(prob) -> float | None:
    try:
        return float(prob.solverModel.getInfo().mip_gap)
    except AttributeError:
        return None
