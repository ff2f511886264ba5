"""Solve phase: exact DP, ILP, public baselines, and the plan search.

``make_plan(profile, PlanOptions(...))`` (or ``make_plan(profile, pp_size=...)``) is the
entry point; with ``devices`` it searches the tp x pp x dp mesh (``plan_mesh``, which also
returns every mesh tried); ``plan_again`` predicts a plan's split from another profile.
``solve_dp``, ``solve_ilp`` and ``baseline_split`` are public for tools and benchmarks that
want one piece;
``PARTITIONS`` and ``SOLVERS`` are the values ``make_plan`` accepts.
"""

from autopart.solve.baselines import baseline_split
from autopart.solve.dp import solve_dp
from autopart.solve.entry import make_plan, plan_again
from autopart.solve.ilp import ILPLimits, solve_ilp
from autopart.solve.mesh import plan_mesh
from autopart.solve.options import PlanOptions
from autopart.solve.search import PARTITIONS, SOLVERS

# Public entry points of the solve phase; everything else is internal.
__all__ = ["PARTITIONS", "SOLVERS", "PlanOptions", "baseline_split", "make_plan", "plan_again",
           "plan_mesh", "solve_dp", "solve_ilp", "ILPLimits"]
