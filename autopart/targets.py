"""What each export target can run: where it cuts, which schedules, which microbatch counts.

The one home of these rules. ``make_plan(..., target=...)`` plans within them, and
``autopart.export`` refuses a plan that breaks them with the same words:

* NxD (``NxDPPModel``) cuts only after transformer layers, so the embedding stays
  on the first stage and the head on the last; it runs 1F1B and interleaved 1F1B,
  the latter with ``num_microbatches`` divisible by pp.
* Megatron-core's ``--pipeline-model-parallel-layout`` has no symbol for the final
  norm, which stays with the head; it runs 1F1B and interleaved 1F1B.
* NeMo AutoPipeline and torchtitan take any list of module FQNs and every torch
  schedule.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from autopart.errors import PlanError
from autopart.schedules import SCHEDULES
from autopart.schema import Plan, Profile

__all__ = ["TARGETS", "planning_constraints"]


@dataclass(frozen=True, kw_only=True, slots=True)
class PlanningConstraints:
    """What a plan must respect for one target tool to run it."""

    target: str
    """The export format (``nxd``, ``nemo``, ``torchtitan``, ``megatron``)."""
    tool: str
    """The tool's name, for messages."""
    cut_kinds: tuple[str, ...] | None = None
    """A stage may end only after a block of one of these kinds; ``None``: anywhere."""
    schedules: tuple[str, ...] | None = None
    """The schedules the tool runs; ``None``: every schedule autopart knows."""
    interleaved_needs_multiple_of_pp: bool = False
    """With several stages per rank, ``num_microbatches`` must be divisible by pp."""

    def schedules_for(self, schedule: str | Sequence[str], *, pp_size: int,
                      num_microbatches: int | None) -> str | list[str]:
        """The ``schedule`` argument of ``make_plan`` under these constraints.

        Args:
            schedule: A schedule name, a list of names, or ``"auto"``.
            pp_size: Pipeline ranks.
            num_microbatches: The fixed microbatch count, or ``None`` when it is
                searched.

        Returns:
            ``schedule`` itself when it is allowed; for ``"auto"`` the list of the
            tool's schedules that can run with this pp and microbatch count.

        Raises:
            PlanError: A named schedule the tool does not run, or an interleaved
                one with a microbatch count the tool refuses.
        """
        if self.schedules is None:
            return schedule
        multiple_ok = not (self.interleaved_needs_multiple_of_pp and num_microbatches
                           is not None and num_microbatches % pp_size)
        if schedule == "auto":
            return [name for name in self.schedules
                    if multiple_ok or not SCHEDULES[name].multi_stage]
        for name in [schedule] if isinstance(schedule, str) else schedule:
            self._check_schedule(name)
            if not multiple_ok and SCHEDULES[name].multi_stage:
                raise self._multiple_error(num_microbatches, pp_size)
        return schedule

    def check_plan(self, plan: Plan, profile: Profile) -> None:
        """Refuse a plan the tool cannot run.

        Args:
            plan: The plan to export.
            profile: The profile it was made from (for the kinds of the cut blocks).

        Raises:
            PlanError: A cut after a block the tool cannot cut after, a schedule it
                does not run, or a microbatch count its interleaved schedule refuses.
        """
        if self.cut_kinds is not None:
            kinds = {b.name: b.kind for b in profile.blocks}
            for cut in plan.pipeline_cuts:
                if kinds.get(cut) not in self.cut_kinds:
                    raise PlanError(
                        f"cut after {cut!r} (kind {kinds.get(cut, 'unknown')}) is not where "
                        f"{self.tool} can cut: only after {' or '.join(self.cut_kinds)} "
                        f"blocks; re-plan with --format {self.target} (make_plan(..., "
                        f"target={self.target!r})) so cuts stay there")
        if self.schedules is not None:
            self._check_schedule(plan.schedule)
        if (self.interleaved_needs_multiple_of_pp and plan.virtual_stages > 1
                and plan.num_microbatches % plan.pp_size):
            raise self._multiple_error(plan.num_microbatches, plan.pp_size)

    def _check_schedule(self, name: str) -> None:
        assert self.schedules is not None
        if name not in self.schedules:
            raise PlanError(f"{self.tool} runs no {name} schedule; plan with --schedule "
                            f"{' or '.join(self.schedules)} for {self.tool}")

    def _multiple_error(self, num_microbatches: int | None, pp_size: int) -> PlanError:
        return PlanError(f"{self.tool}'s interleaved schedule needs num_microbatches "
                         f"({num_microbatches}) divisible by pp ({pp_size}); plan with "
                         f"--microbatches a multiple of {pp_size}, or --schedule 1f1b")


_ONE_F_ONE_B = ("1f1b", "interleaved-1f1b")

_RULES = {
    rules.target: rules
    for rules in (
        PlanningConstraints(target="nxd", tool="NxD", cut_kinds=("decoder_layer",),
                            schedules=_ONE_F_ONE_B, interleaved_needs_multiple_of_pp=True),
        PlanningConstraints(target="nemo", tool="NeMo"),
        PlanningConstraints(target="torchtitan", tool="torchtitan"),
        PlanningConstraints(target="megatron", tool="Megatron",
                            cut_kinds=("embedding", "decoder_layer"), schedules=_ONE_F_ONE_B),
    )
}

TARGETS = tuple(_RULES)
"""The export formats, each with its planning constraints."""


def planning_constraints(target: str) -> PlanningConstraints:
    """The rules a plan must follow for ``target`` to run it.

    Args:
        target: One of ``TARGETS``.

    Returns:
        Its cut kinds, schedules and microbatch rule.

    Raises:
        PlanError: ``target`` is not a known export format.
    """
    try:
        return _RULES[target]
    except KeyError:
        raise PlanError(f"unknown export format {target!r}; choose one of "
                        f"{', '.join(TARGETS)}") from None
