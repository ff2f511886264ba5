"""Compute-action orders taken from torch's own multi-stage schedule classes.

torch computes ``pipeline_order`` (rank -> list of ``_Action | None``) inside each
schedule's ``__init__``, which needs real ``PipelineStage`` objects and a process
group. The order itself only depends on a few attributes, so we build the object
with ``cls.__new__`` and set exactly the attributes that torch's
``_calculate_single_rank_operations`` reads (checked against torch 2.13). The
result is translated to plain ``(kind, stage_idx, microbatch_idx)`` groups:

- ``F`` -> ``("F",)``; ``I`` -> ``("B",)``; ``W`` -> ``("W",)``;
- ``B`` (FULL_BACKWARD) -> ``("B",)`` in a schedule without split backward, and the
  group ``("B", "W")`` in a split one (the weight grad runs inside the same call);
- ``OVERLAP_F_B`` (DualPipeV) -> its forward part first, then its backward part,
  as torch's runtime runs the sub-actions in order when no overlap function is
  registered: ``(F, B, W)``;
- ``None`` (padding) and every communication / FSDP action are dropped.

A group's cross-rank sends leave when its last member ends (torch issues the
SEND actions after the whole compute action), see ``engine.py``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

Group = tuple[tuple[str, int, int], ...]
"""One torch compute action as ``((kind, stage_idx, microbatch_idx), ...)``."""


def torch_groups(torch_class: str, pp_size: int, virtual_stages: int,
                 num_microbatches: int, split_backward: bool) -> list[list[Group]]:
    """Per-rank compute groups of ``torch_class`` without building stages or a group."""
    from torch.distributed.pipelining import schedules as ts

    cls = getattr(ts, torch_class)
    sched = cls.__new__(cls)
    _SETUP[torch_class](sched, pp_size, virtual_stages, num_microbatches)
    single = {ts.FORWARD: "F", ts.BACKWARD_INPUT: "B", ts.BACKWARD_WEIGHT: "W"}
    if not split_backward:
        single[ts.FULL_BACKWARD] = "B"
    groups = []
    for rank in range(pp_size):
        row: list[Group] = []
        append, kind_of = row.append, single.get
        for action in sched._calculate_single_rank_operations(rank):
            if action is None:
                continue
            kind = kind_of(action[1])
            if kind is None or action[2] is None or (kind != "F" and not split_backward
                                                     and action[1] != ts.FULL_BACKWARD):
                append(_translate(action, split_backward, ts))  # checks, overlap, B + W
            else:
                append(((kind, action[0], action[2]),))
        groups.append(row)
    return groups


def _translate(action: Any, split_backward: bool, ts: Any) -> Group:
    """One torch action as a group (the slow path, with the checks: overlapped actions and
    anything unexpected)."""
    ctype = action.computation_type
    if ctype == ts.OVERLAP_F_B:
        assert action.sub_actions is not None, action
        return tuple(part for sub in action.sub_actions
                     for part in _translate(sub, split_backward, ts))
    stage, mb = action.stage_index, action.microbatch_index
    assert mb is not None, action
    if ctype == ts.FORWARD:
        return (("F", stage, mb),)
    if ctype == ts.BACKWARD_INPUT:
        assert split_backward, f"input-only backward {action} in a non-split schedule"
        return (("B", stage, mb),)
    if ctype == ts.BACKWARD_WEIGHT:
        assert split_backward, f"weight backward {action} in a non-split schedule"
        return (("W", stage, mb),)
    assert ctype == ts.FULL_BACKWARD, f"unexpected compute action {action}"
    if split_backward:
        return (("B", stage, mb), ("W", stage, mb))
    return (("B", stage, mb),)


def _setup_common(sched: Any, pp_size: int, num_microbatches: int) -> None:
    sched.pp_group_size = pp_size
    sched._n_microbatches = num_microbatches


def _setup_interleaved(sched: Any, pp_size: int, virtual_stages: int,
                       num_microbatches: int) -> None:
    # Mirrors ScheduleInterleaved1F1B / ScheduleInterleavedZeroBubble.__init__.
    _setup_common(sched, pp_size, num_microbatches)
    sched.n_local_stages = virtual_stages
    sched.number_of_rounds = max(1, num_microbatches // pp_size)
    sched.microbatches_per_round = num_microbatches // sched.number_of_rounds


def _setup_looped_bfs(sched: Any, pp_size: int, virtual_stages: int,
                      num_microbatches: int) -> None:
    # ScheduleLoopedBFS only reads len(self._stages).
    _setup_common(sched, pp_size, num_microbatches)
    sched._stages = [None] * virtual_stages


def _setup_v(sched: Any, pp_size: int, virtual_stages: int, num_microbatches: int) -> None:
    # ScheduleZBVZeroBubble reads num_stages; ScheduleDualPipeV only pp size and m.
    _setup_common(sched, pp_size, num_microbatches)
    sched.n_local_stages = virtual_stages
    sched.num_stages = pp_size * virtual_stages
    sched._num_stages = pp_size * virtual_stages


_SETUP: dict[str, Callable[[Any, int, int, int], None]] = {
    "ScheduleInterleaved1F1B": _setup_interleaved,
    "ScheduleInterleavedZeroBubble": _setup_interleaved,
    "ScheduleLoopedBFS": _setup_looped_bfs,
    "ScheduleZBVZeroBubble": _setup_v,
    "ScheduleDualPipeV": _setup_v,
}
