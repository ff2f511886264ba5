"""Solve phase: exact DP, ILP, public baselines, and the plan search.

``make_plan(profile, pp_size=...)`` is the entry point; ``solve_dp`` / ``solve_ilp``
and the baseline splits are public for tools and benchmarks that want one piece.
"""

from autopart.solve.assemble import evaluate_split, plan_from_split
from autopart.solve.baselines import BASELINES, baseline_split
from autopart.solve.dp import DPSolution, min_fitting_limit, solve_dp
from autopart.solve.ilp import ILPSolution, solve_ilp
from autopart.solve.search import PARTITIONS, SOLVERS, make_plan

# Public entry points of the solve phase.
__all__ = [
    "BASELINES",
    "PARTITIONS",
    "SOLVERS",
    "DPSolution",
    "ILPSolution",
    "baseline_split",
    "evaluate_split",
    "make_plan",
    "min_fitting_limit",
    "plan_from_split",
    "solve_dp",
    "solve_ilp",
]
