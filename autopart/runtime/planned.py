"""A plan's blocks as the runtime sees them: the model's blocks, and the derived parts.

A plan lists block names per stage; a block that is part of a module's call says so in
``Plan.parts`` (``autopart.schema.parts``). Parts along ``calls`` (a layer's halves, a
half before and from its output projection) are blocks of the model's chain at the
plan's level (``chain_level``). Parts along ``units`` (a half's slices) and ``vocab`` (the
head's shards) are *derived*: the runtime runs them as a share of the chain block that
holds their module (``base_block``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from autopart.errors import RuntimeSetupError
from autopart.intake import BlockChain
from autopart.schema import Part, Plan

__all__ = []


@dataclass(frozen=True, slots=True)
class DerivedPart:
    """One planned block that is a derived part of a chain block."""

    name: str
    """The planned block's name (``lm_head.shard2of8``)."""
    part: Part
    """Its derived part (``units`` or ``vocab``)."""
    base: str
    """The chain block holding ``part.module`` (a half, the head)."""
    stage: int
    """The stage that holds it."""


def chain_level(plan: Plan) -> str:
    """The level of the chain the runtime discovers for ``plan``: ``slice`` parts are
    derived from the ``half`` chain."""
    return "half" if plan.granularity == "slice" else plan.granularity


def base_block(chain: BlockChain, part: Part, where: str = "the plan") -> str:
    """The chain block whose modules include ``part.module``.

    Raises:
        RuntimeSetupError: No block of the chain holds that module.
    """
    for block in chain.blocks:
        if part.module in block.fqns:
            return block.name
    raise RuntimeSetupError(f"{where} cuts {part.module} along {part.axis}, but no block of "
                            f"this model is that module (blocks: {chain.names[0]} .. "
                            f"{chain.names[-1]}); make the plan from this model's profile")


def derived_parts(plan: Plan, chain: BlockChain, stages: Sequence[int] | None = None,
                  where: str = "the plan") -> list[DerivedPart]:
    """The derived parts of ``plan``'s stages (all, or ``stages``), in model order."""
    out = []
    wanted = None if stages is None else set(stages)
    for stage in sorted(plan.stages, key=lambda s: s.index):
        if wanted is not None and stage.index not in wanted:
            continue
        for name in stage.modules:
            parts = plan.parts_of(name)
            if parts and parts[-1].derived:
                out.append(DerivedPart(name, parts[-1], base_block(chain, parts[-1], where),
                                       stage.index))
    return out


def base_names(plan: Plan, chain: BlockChain, names: Sequence[str],
               where: str = "the plan") -> list[str]:
    """``names`` with every derived part replaced by its chain block, each listed once."""
    out: list[str] = []
    for name in names:
        parts = plan.parts_of(name)
        base = base_block(chain, parts[-1], where) if parts and parts[-1].derived else name
        if not (out and out[-1] == base and base != name):
            out.append(base)
    return out
