"""The public ``make_plan``: one mesh (``autopart.solve.search``) or a search over meshes
(``autopart.solve.mesh``, when ``devices`` is set)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from autopart.schema import Plan, Profile
from autopart.solve.mesh import plan_mesh
from autopart.solve.options import PlanOptions
from autopart.solve.search import plan_pipeline

__all__ = ["make_plan"]


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
