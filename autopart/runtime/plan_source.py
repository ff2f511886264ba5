"""Turn the ``plan`` argument of ``auto_pipeline`` into a ``Plan``: an object or a JSON path."""

from __future__ import annotations

from pathlib import Path

from torch import nn

from autopart.errors import RuntimeSetupError
from autopart.intake import BlockChain
from autopart.runtime.groups import Groups
from autopart.schema import Plan

__all__ = ["resolve_plan"]


def resolve_plan(plan: Plan | str | Path, source: nn.Module | str, root: nn.Module,
                 chain: BlockChain, groups: Groups) -> Plan:
    """The ``Plan`` named by ``plan`` (no collective)."""
    del source, root, chain, groups  # used by plan="auto"
    if isinstance(plan, Plan):
        return plan
    if isinstance(plan, (str, Path)):
        return Plan.load(plan)
    raise RuntimeSetupError(f"plan must be a Plan or a path to plan JSON, got "
                            f"{type(plan).__name__}")
