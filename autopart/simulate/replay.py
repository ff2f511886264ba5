"""Replay a ``Plan``: the one way a plan's step is simulated (plan, simulate, verify)."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from autopart.cost.rank import (
    post_charges_ms,
    shared_grad_sync_ms,
    stage_costs_of_plan,
    step_overhead_ms,
)
from autopart.cost.stage import StageCost
from autopart.schedules import schedule_info, stage_to_rank
from autopart.schema import Plan, TrainingSetup
from autopart.simulate.engine import SimResult, duration_table, simulate
from autopart.simulate.levels import level_plan
from autopart.simulate.orders import paused_gc

__all__ = ["simulate_plan", "with_step_overhead"]


def with_step_overhead(result: SimResult, setup: TrainingSetup,
                       costs: Sequence[StageCost] = (), schedule: str = "",
                       virtual_stages: int = 1, num_microbatches: int | None = None
                       ) -> SimResult:
    """``result`` with the runtime's per-step work outside the schedule added.

    That is its fixed work (``rank_cost.step_overhead_ms``) and, given the stages' ``costs``
    and ``schedule``, the sum of a weight held on several ranks (tied embedding/head,
    split head) over its holders (``rank_cost.shared_grad_sync_ms``). Every rank waits for
    it, so step and idle times grow by it; busy times and the events stay the schedule's.
    With ``setup.router_loss_pass`` the MoE router loss's counting pass is added too
    (``counting_pass_ms``; it needs ``costs``).

    Args:
        result: A simulated step.
        setup: The training setup, whose ``runtime_overhead`` holds the per-step ms.
        costs: The stages' costs (none: no shared-weight sum is counted).
        schedule: The schedule's name (it places the stages on ranks).
        virtual_stages: Stages per rank.
        num_microbatches: The step's microbatches (default ``setup.num_microbatches``).

    Returns:
        The step with the overhead added (``result`` itself when there is none).
    """
    extra = step_overhead_ms(setup)
    if costs:
        style = schedule_info(schedule).style
        pp_size = len(costs) // virtual_stages
        ranks = [stage_to_rank(s, pp_size, virtual_stages, style) for s in range(len(costs))]
        extra += shared_grad_sync_ms(costs, ranks, setup)
        if setup.router_loss_pass:
            extra += counting_pass_ms(costs, schedule=schedule, pp_size=pp_size,
                                      virtual_stages=virtual_stages,
                                      num_microbatches=num_microbatches or setup.num_microbatches,
                                      setup=setup, step_ms=result.step_ms)
    if extra <= 0:
        return result
    step = result.step_ms + extra
    idle = tuple(step - b for b in result.rank_busy_ms)
    return dataclasses.replace(result, step_ms=step, rank_idle_ms=idle,
                               bubble_fraction=sum(idle) / (len(idle) * step))


def simulate_plan(plan: Plan, *, record_events: bool = True,
                  costs: Sequence[StageCost] | None = None) -> SimResult:
    """Simulate one training step of ``plan`` from what the plan records.

    The stage costs, schedule, pp, virtual stages and microbatches are the plan's;
    the link bandwidth and latency and the runtime's per-step work come from
    ``plan.setup``. No profile is needed,
    so this is exactly the step ``autopart plan`` predicted.

    Args:
        plan: The plan to replay.
        record_events: Keep every action's start and end (for timelines and
            traces); ``False`` is faster when only the figures are needed.
        costs: The stages' costs to use instead of the plan's (what-ifs on its cuts,
            e.g. calibrated times).

    Returns:
        Step time, bubble, per-rank busy, idle and peak memory, and the events.

    Raises:
        PlanError: The plan's schedule is unknown or its stages do not match
            ``pp_size * virtual_stages``.
    """
    costs = list(costs) if costs is not None else stage_costs_of_plan(plan)
    result = simulate(costs, schedule=plan.schedule, pp_size=plan.pp_size,
                      virtual_stages=plan.virtual_stages,
                      num_microbatches=plan.num_microbatches, setup=plan.setup,
                      record_events=record_events)
    return with_step_overhead(result, plan.setup, costs, plan.schedule, plan.virtual_stages,
                              plan.num_microbatches)


def counting_pass_ms(stage_costs: Sequence[StageCost], *, schedule: str, pp_size: int,
                     virtual_stages: int, num_microbatches: int, setup: TrainingSetup,
                     step_ms: float) -> float:
    """The MoE router loss's counting pass before each step (``autopart.runtime.aux_loss``).

    Split-backward schedules run one whole step for it (torch cannot switch their stages
    to forward-only): ``step_ms``, the schedule's own step. The others run the schedule
    forward-only (``schedule.eval``): the same order with no backward and no gradient
    sends, each forward at its training price (it runs without autograd: this errs high)
    times the scale a run measured (``RuntimeOverhead.count_pass_scale``).
    ``stage_costs`` must be ``pp_size * virtual_stages`` (``simulate`` checks).
    """
    split = schedule_info(schedule).split_backward
    if split:
        return step_ms
    charges = post_charges_ms(setup, schedule, pp_size, virtual_stages)
    table = duration_table(stage_costs, split, setup, charges)
    num = len(stage_costs)
    table[num:3 * num] = 0.0  # B and W
    table[4 * num:] = 0.0  # gradient sends
    with paused_gc():
        levels = level_plan(schedule, pp_size, virtual_stages, num_microbatches)
        ms = float(levels.run(table.reshape(-1, 1))[1][0])
    overhead = setup.runtime_overhead
    return ms * (overhead.count_pass_scale if overhead is not None else 1.0)
