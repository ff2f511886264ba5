"""Turn the ``plan`` argument of ``auto_pipeline`` into a ``Plan``.

A ``Plan`` is used as is and a path is read on every rank. ``"auto"`` profiles
the model and solves on global rank 0 only (``autopart.profile.profile_model``,
``autopart.solve.make_plan``), then broadcasts the plan JSON so every rank runs
the same plan; a failure on rank 0 is broadcast too and raised on every rank.
"""

from __future__ import annotations

import inspect
import logging
from pathlib import Path
from typing import Any

import torch.distributed as dist
from torch import nn

from autopart.errors import AutopartError, RuntimeSetupError
from autopart.intake import BlockChain
from autopart.runtime.groups import Groups
from autopart.schema import Plan

__all__ = ["resolve_plan"]

logger = logging.getLogger(__name__)


def resolve_plan(plan: Plan | str | Path, source: nn.Module | str, chain: BlockChain,
                 groups: Groups | None, device_type: str,
                 plan_options: dict[str, Any] | None = None) -> Plan:
    """The ``Plan`` named by ``plan``; only ``"auto"`` (which needs ``groups``) runs a
    collective (a broadcast)."""
    if isinstance(plan, Plan):
        return plan
    if isinstance(plan, str) and plan == "auto":
        assert groups is not None, "plan='auto' plans for known groups"
        return _auto_plan(source, chain, groups, device_type, dict(plan_options or {}))
    if isinstance(plan, (str, Path)):
        return Plan.load(plan)
    raise RuntimeSetupError(f"plan must be a Plan, a path to plan JSON or 'auto', got "
                            f"{type(plan).__name__}")


def _auto_plan(source: nn.Module | str, chain: BlockChain, groups: Groups, device_type: str,
               options: dict[str, Any]) -> Plan:
    profile_kw, solve_kw = _split_options(options, groups, device_type)
    payload: list[Any] = [None]
    if dist.get_rank() == 0:
        try:
            payload[0] = ("plan", _profile_and_solve(source, profile_kw, solve_kw))
        except AutopartError as exc:
            payload[0] = ("error", f"plan='auto' failed on rank 0: {exc}")
    dist.broadcast_object_list(payload, src=0)
    kind, text = payload[0]
    if kind == "error":
        raise RuntimeSetupError(text)
    return Plan.from_json(text, source="plan broadcast from rank 0")


def _split_options(options: dict[str, Any], groups: Groups,
                   device_type: str) -> tuple[dict[str, Any], dict[str, Any]]:
    from autopart.profile import profile_model

    profile_names = set(inspect.signature(profile_model).parameters) - {"source", "progress"}
    profile_kw = {k: v for k, v in options.items() if k in profile_names}
    solve_kw = {k: v for k, v in options.items() if k not in profile_names}
    profile_kw.setdefault("backend", "cuda" if device_type == "cuda" else "cpu")
    solve_kw.setdefault("pp_size", groups.pp_size)
    if groups.dp_size > 1:
        solve_kw.setdefault("dp_size", groups.dp_size)
    return profile_kw, solve_kw


def _profile_and_solve(source: nn.Module | str, profile_kw: dict[str, Any],
                       solve_kw: dict[str, Any]) -> str:
    from autopart.profile import profile_model
    from autopart.solve import make_plan

    profile = profile_model(source, **profile_kw)
    plan = make_plan(profile, **solve_kw)
    logger.info("plan='auto': %s on %d rank(s), %d microbatches, predicted %.1f ms/step",
                plan.schedule, plan.pp_size, plan.num_microbatches, plan.predicted_step_ms)
    return plan.to_json()
