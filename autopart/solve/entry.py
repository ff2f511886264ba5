"""The public ``make_plan``: one mesh (``autopart.solve.search``) or a search over meshes
(``autopart.solve.mesh``, when ``devices`` is set)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from autopart.errors import PlanError
from autopart.schema import Plan, Profile
from autopart.solve.mesh import plan_mesh
from autopart.solve.options import PlanOptions
from autopart.solve.search import plan_pipeline

__all__ = ["make_plan", "plan_again"]


def make_plan(profile: Profile, options: PlanOptions | None = None, /, *,
              progress: Callable[[int, int, str], None] | None = None,
              **fields: Any) -> Plan:
    """Plan the pipeline of ``profile``: the fastest simulated step that fits memory.

    ``auto`` granularity loops over the levels the profile offers (its measured level,
    with the coarser ones as seeds; the ``slice`` level where halves can be cut by units)
    and over the head whole or cut by vocabulary, and keeps the fastest plan
    (``autopart.solve.choices``).

    Args:
        profile: Per-block costs (``autopart profile``).
        options: What to plan (``PlanOptions``); ``fields`` replace its fields, so
            ``make_plan(profile, pp_size=8, num_microbatches=32)`` works alone.
        progress: ``progress(done, total, what)`` after each searched configuration.
        **fields: ``PlanOptions`` fields.

    Returns:
        The plan, with the baselines simulated beside it and notes on why it looks the way
        it does. With ``devices`` set, the chosen mesh's plan (``plan_mesh`` has the others).

    Raises:
        PlanError: A bad option (pp, partition, solver, v, precision, target, cuts, ...).
        InfeasibleError: Nothing fits; the message names the memory that would fit.
    """
    opts = PlanOptions.of(options, **fields)
    if opts.devices is not None:
        return plan_mesh(profile, opts, progress=progress).plan
    return plan_pipeline(profile, opts, progress)


def plan_again(profile: Profile, plan: Plan, **fields: Any) -> Plan:
    """``plan``'s split predicted from ``profile``, another profile of the same model (one
    calibrated from a run, one taken by another timing method).

    The new plan keeps ``plan``'s cuts and granularity, schedule, v and m, data-parallel
    setup, optimizer, precision and memory limit; the costs are ``profile``'s, the
    pipeline link's too (its machine check, or a latency calibration moved).

    Args:
        profile: The profile to predict from.
        plan: The plan whose choices are kept.
        **fields: ``PlanOptions`` fields to change as well.

    Returns:
        The plan, simulated on ``profile``'s costs.

    Raises:
        PlanError: ``plan`` is tensor-parallel (a split is fixed for one pipeline only), or
            its cuts name no block of ``profile``.
        InfeasibleError: The split no longer fits ``plan``'s memory limit.
    """
    if plan.tp_size > 1:
        raise PlanError(f"a tp {plan.tp_size} plan's split cannot be planned again: cuts fix "
                        f"one pipeline's split; plan the mesh again with --devices")
    setup = plan.setup
    precision = setup.precision
    options = {"pp_size": plan.pp_size, "num_microbatches": plan.num_microbatches,
               "schedule": plan.schedule, "virtual_stages": plan.virtual_stages,
               "cuts": tuple(plan.pipeline_cuts), "granularity": plan.granularity,
               "dp_size": plan.dp_size, "zero_stage": plan.zero_stage,
               "reshard_after_forward": plan.reshard_after_forward,
               "optimizer": setup.optimizer, "memory_limit_bytes": setup.memory_limit_bytes,
               "precision": None if precision == "custom" else precision,
               "split_head": True if plan.head_shards else None}
    return make_plan(profile, **{**options, **fields})
