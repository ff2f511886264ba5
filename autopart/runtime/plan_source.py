"""Turn the ``plan`` argument of ``auto_pipeline`` into a ``Plan``.

A ``Plan`` is used as is and a path is read on every rank. ``"auto"`` profiles
the model and solves on global rank 0 only (``autopart.profile.profile_model``,
``autopart.solve.make_plan``) with the typed ``ProfileOptions`` and ``PlanOptions``
(``AutoOptions``), then broadcasts the plan JSON so every rank runs the same plan; a
failure on rank 0 is broadcast too and raised on every rank.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch.distributed as dist
from torch import nn

from autopart.errors import AutopartError, RuntimeSetupError
from autopart.intake import BlockChain
from autopart.profile.options import ProfileOptions
from autopart.runtime.groups import Groups
from autopart.schema import Plan
from autopart.solve.options import PlanOptions

__all__ = []

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class AutoOptions:
    """``auto_pipeline``'s options for ``plan="auto"``: what to profile and plan."""

    plan: PlanOptions | dict[str, Any] | None = None
    """``PlanOptions``, or their fields as a dict."""
    profile: ProfileOptions | dict[str, Any] | None = None
    """``ProfileOptions``, or their fields as a dict."""

    def resolved(self, groups: Groups, device_type: str, *, custom_loss: bool
                 ) -> tuple[ProfileOptions, PlanOptions]:
        """The options for these groups: pp and dp sizes default to the groups', the
        profiling backend to the device's; a custom loss keeps the head whole.

        Raises:
            AutopartError: A field the options do not have, or a bad value (one line).
        """
        profile = self.profile if isinstance(self.profile, ProfileOptions) else \
            ProfileOptions.of(**{"backend": "cuda" if device_type == "cuda" else "cpu",
                                 **(self.profile or {})})
        defaults: dict[str, Any] = {"pp_size": groups.pp_size}
        if groups.dp_size > 1:
            defaults["dp_size"] = groups.dp_size
        if custom_loss:
            defaults["split_head"] = False
        if isinstance(self.plan, PlanOptions):
            plan = dataclasses.replace(self.plan, split_head=False) if custom_loss \
                and self.plan.split_head is None else self.plan
        else:
            plan = PlanOptions.of(**{**defaults, **(self.plan or {})})
        return profile, plan


def resolve_plan(plan: Plan | str | Path, source: nn.Module | str, chain: BlockChain,
                 groups: Groups | None, device_type: str, options: AutoOptions,
                 *, custom_loss: bool = False) -> Plan:
    """The ``Plan`` named by ``plan``; only ``"auto"`` (which needs ``groups``) runs a
    collective (a broadcast)."""
    if isinstance(plan, Plan):
        return plan
    if isinstance(plan, str) and plan == "auto":
        assert groups is not None, "plan='auto' plans for known groups"
        return _auto_plan(source, groups, options.resolved(groups, device_type,
                                                           custom_loss=custom_loss))
    if isinstance(plan, (str, Path)):
        return Plan.load(plan)
    raise RuntimeSetupError(f"plan must be a Plan, a path to plan JSON or 'auto', got "
                            f"{type(plan).__name__}")


def _auto_plan(source: nn.Module | str, groups: Groups,
               options: tuple[ProfileOptions, PlanOptions]) -> Plan:
    payload: list[Any] = [None]
    if dist.get_rank() == 0:
        try:
            payload[0] = ("plan", _profile_and_solve(source, *options))
        except AutopartError as exc:
            payload[0] = ("error", f"plan='auto' failed on rank 0: {exc}")
    dist.broadcast_object_list(payload, src=0)
    kind, text = payload[0]
    if kind == "error":
        raise RuntimeSetupError(text)
    return Plan.from_json(text, source="plan broadcast from rank 0")


def _profile_and_solve(source: nn.Module | str, profile_options: ProfileOptions,
                       plan_options: PlanOptions) -> str:
    from autopart.profile import profile_model
    from autopart.solve import make_plan

    profile = profile_model(source, profile_options)
    plan = make_plan(profile, plan_options)
    logger.info("plan='auto': %s on %d rank(s), %d microbatches, predicted %.1f ms/step",
                plan.schedule, plan.pp_size, plan.num_microbatches, plan.predicted_step_ms)
    return plan.to_json()
