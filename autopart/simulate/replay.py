"""Replay a ``Plan``: the one way a plan's step is simulated (plan, simulate, verify)."""

from __future__ import annotations

from autopart.cost import stage_costs_of_plan
from autopart.schema import Plan
from autopart.simulate.engine import SimResult, simulate

__all__ = ["simulate_plan"]


def simulate_plan(plan: Plan, *, record_events: bool = True) -> SimResult:
    """Simulate one training step of ``plan`` from what the plan records.

    The stage costs, schedule, pp, virtual stages and microbatches are the plan's;
    the link bandwidth and latency come from ``plan.setup``. No profile is needed,
    so this is exactly the step ``autopart plan`` predicted.

    Args:
        plan: The plan to replay.
        record_events: Keep every action's start and end (for timelines and
            traces); ``False`` is faster when only the figures are needed.

    Returns:
        Step time, bubble, per-rank busy, idle and peak memory, and the events.

    Raises:
        PlanError: The plan's schedule is unknown or its stages do not match
            ``pp_size * virtual_stages``.
    """
    return simulate(stage_costs_of_plan(plan), schedule=plan.schedule, pp_size=plan.pp_size,
                    virtual_stages=plan.virtual_stages, num_microbatches=plan.num_microbatches,
                    setup=plan.setup, record_events=record_events)
