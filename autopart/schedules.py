"""The schedules autopart knows, and the one place that maps stages to ranks.

Names are the CLI's (``1f1b``, ``interleaved-1f1b``, ...); each maps to the torch
class that runs it and to the placement of stages on ranks: ``loop`` (stage ``s``
on rank ``s % pp``) or ``v`` (stages go down the ranks and back up, as ZBV and
DualPipeV need).
"""

from __future__ import annotations

from dataclasses import dataclass

from autopart.errors import PlanError

__all__ = ["SCHEDULES", "check_schedule", "recompute_allowed", "schedule_info", "stage_to_rank",
           "stages_of_rank"]


@dataclass(frozen=True, kw_only=True, slots=True)
class ScheduleInfo:
    """Static facts about one schedule."""

    name: str
    torch_class: str
    """Class name in ``torch.distributed.pipelining.schedules``."""
    multi_stage: bool
    """True when a rank may hold several stages (``virtual_stages > 1``)."""
    style: str
    """``loop`` or ``v``."""
    split_backward: bool
    """B and W run as separate actions (zero-bubble schedules)."""
    fixed_virtual_stages: int | None = None
    """Schedules that require an exact number of stages per rank (ZBV, DualPipeV: 2)."""
    blocking_sends: bool = False
    """torch batches a rank's steady-state sends with its next receive and waits on the
    batch before computing on (1F1B), so those transfers do not overlap compute."""


SCHEDULES: dict[str, ScheduleInfo] = {
    info.name: info
    for info in (
        ScheduleInfo(name="gpipe", torch_class="ScheduleGPipe", multi_stage=False,
                     style="loop", split_backward=False, fixed_virtual_stages=1),
        ScheduleInfo(name="1f1b", torch_class="Schedule1F1B", multi_stage=False,
                     style="loop", split_backward=False, fixed_virtual_stages=1,
                     blocking_sends=True),
        ScheduleInfo(name="interleaved-1f1b", torch_class="ScheduleInterleaved1F1B",
                     multi_stage=True, style="loop", split_backward=False),
        ScheduleInfo(name="looped-bfs", torch_class="ScheduleLoopedBFS",
                     multi_stage=True, style="loop", split_backward=False),
        ScheduleInfo(name="interleaved-zb", torch_class="ScheduleInterleavedZeroBubble",
                     multi_stage=True, style="loop", split_backward=True),
        ScheduleInfo(name="zbv", torch_class="ScheduleZBVZeroBubble", multi_stage=True,
                     style="v", split_backward=True, fixed_virtual_stages=2),
        ScheduleInfo(name="dualpipev", torch_class="ScheduleDualPipeV", multi_stage=True,
                     style="v", split_backward=True, fixed_virtual_stages=2),
    )
}


def schedule_info(name: str) -> ScheduleInfo:
    """Look up a schedule by its CLI name; raise ``PlanError`` naming the choices."""
    try:
        return SCHEDULES[name]
    except KeyError:
        raise PlanError(f"unknown schedule {name!r}; choose one of "
                        f"{', '.join(SCHEDULES)}") from None


def stage_to_rank(stage_idx: int, pp_size: int, virtual_stages: int, style: str) -> int:
    """Rank holding stage ``stage_idx`` (same mapping as torch's schedules)."""
    num_stages = pp_size * virtual_stages
    assert 0 <= stage_idx < num_stages, (stage_idx, num_stages)
    if style == "loop":
        return stage_idx % pp_size
    assert style == "v", style
    round_idx, offset = divmod(stage_idx, pp_size)
    return offset if round_idx % 2 == 0 else pp_size - 1 - offset


def stages_of_rank(rank: int, pp_size: int, virtual_stages: int, style: str) -> list[int]:
    """Stage indices held by ``rank``, ascending."""
    return [s for s in range(pp_size * virtual_stages)
            if stage_to_rank(s, pp_size, virtual_stages, style) == rank]


def check_schedule(name: str, pp_size: int, virtual_stages: int, num_microbatches: int) -> None:
    """Raise ``PlanError`` when torch's class for ``name`` would reject these settings."""
    info = schedule_info(name)
    num_stages = pp_size * virtual_stages
    if info.fixed_virtual_stages is not None and virtual_stages != info.fixed_virtual_stages:
        raise PlanError(f"schedule {name} needs exactly {info.fixed_virtual_stages} stage(s) "
                        f"per rank, got virtual_stages={virtual_stages}; use "
                        f"--virtual-stages {info.fixed_virtual_stages} or another schedule")
    if info.multi_stage and virtual_stages < 2 and info.fixed_virtual_stages is None:
        raise PlanError(f"schedule {name} runs several stages per rank, got virtual_stages="
                        f"{virtual_stages}; use --virtual-stages 2 or more, or 1f1b/gpipe")
    if name in ("1f1b", "dualpipev") and num_microbatches < num_stages:
        raise PlanError(f"schedule {name} needs at least as many microbatches as stages "
                        f"({num_stages}), got {num_microbatches}; raise --microbatches")
    if name in ("interleaved-1f1b", "interleaved-zb"):
        num_rounds = max(1, num_microbatches // pp_size)
        if num_microbatches % num_rounds != 0:
            raise PlanError(f"schedule {name} needs num_microbatches ({num_microbatches}) to be "
                            f"a multiple of num_microbatches // pp ({num_rounds}); use a "
                            f"multiple of --pp ({pp_size})")


def recompute_allowed(name: str, allow_recompute: bool) -> bool:
    """Whether the planner may choose recomputation under schedule ``name``.

    Not under split-backward schedules: B and W run as separate autograd passes, and
    each pass re-runs a checkpointed stage's forward, so recomputation costs several
    forwards there. The search and the out-of-memory message both follow this rule.
    """
    return allow_recompute and not schedule_info(name).split_backward
