"""Per-rank compute-action orders of every schedule, and the in-flight counts they imply.

GPipe and 1F1B orders are generated here (torch 2.13's ``Schedule1F1B.pipeline_order``
numbers the last rank's microbatches from 1); the multi-stage schedules come from
torch's own order computation (``_torch_orders.py``). Only compute actions are kept:
``F`` forward, ``B`` backward (input grad in split schedules, full backward
otherwise), ``W`` weight grad (split schedules only).

Orders depend only on (schedule, pp, v, m) and are cached.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from functools import lru_cache

from autopart.errors import PlanError
from autopart.schedules import check_schedule, schedule_info
from autopart.simulate._torch_orders import Group, torch_groups

__all__ = ["Action", "action_groups", "max_in_flight", "paused_gc", "rank_orders"]


@dataclass(frozen=True, slots=True)
class Action:
    """One compute action of one rank."""

    kind: str
    """``F``, ``B`` (input grad; the full backward in non-split schedules) or ``W``."""
    stage_idx: int
    microbatch_idx: int


def rank_orders(schedule: str, pp_size: int, virtual_stages: int,
                num_microbatches: int) -> list[list[Action]]:
    """Compute actions of each rank, in the order the rank runs them.

    The order is cached; the ``Action`` lists are built per call (for loops over
    many settings, prefer ``max_in_flight`` / ``simulate``, which use the cache).
    Raises ``PlanError`` when torch's class for ``schedule`` rejects the settings.
    """
    return [[Action(*a) for grp in row for a in grp]
            for row in action_groups(schedule, pp_size, virtual_stages, num_microbatches)]


def max_in_flight(schedule: str, pp_size: int, virtual_stages: int,
                  num_microbatches: int) -> list[int]:
    """Per stage: the most microbatches whose activations the stage holds at once.

    A microbatch is held from its ``F`` until its releasing backward (``B`` in
    non-split schedules, ``W`` in split ones, since torch keeps the graph until the
    weight grad). Counted from the real action order: 1F1B stage ``s`` holds
    ``min(pp - s, m)``, GPipe ``m``. Cached (a fresh list each call).
    """
    return list(_max_in_flight(schedule, pp_size, virtual_stages, num_microbatches))


@lru_cache(maxsize=1024)
def _max_in_flight(schedule: str, pp_size: int, virtual_stages: int,
                   num_microbatches: int) -> tuple[int, ...]:
    release = "W" if schedule_info(schedule).split_backward else "B"
    num_stages = pp_size * virtual_stages
    held = [0] * num_stages
    peak = [0] * num_stages
    for row in action_groups(schedule, pp_size, virtual_stages, num_microbatches):
        for grp in row:
            for kind, stage, _ in grp:
                if kind == "F":
                    held[stage] += 1
                    peak[stage] = max(peak[stage], held[stage])
                elif kind == release:
                    held[stage] -= 1
    assert not any(held), f"unreleased activations {held} in {schedule}"
    return tuple(peak)


@lru_cache(maxsize=16)
def action_groups(schedule: str, pp_size: int, virtual_stages: int,
                  num_microbatches: int) -> tuple[tuple[Group, ...], ...]:
    """Per rank, the compute groups in run order; validated and cached.

    A group is one torch action: usually one ``(kind, stage_idx, microbatch_idx)``,
    several where torch runs them as one (a full backward ``B W`` in split
    schedules, DualPipeV's overlapped ``F B W``). Raises ``PlanError`` when torch's
    class for ``schedule`` rejects the settings.
    """
    if pp_size < 1 or virtual_stages < 1 or num_microbatches < 1:
        raise PlanError(f"pp_size ({pp_size}), virtual_stages ({virtual_stages}) and "
                        f"num_microbatches ({num_microbatches}) must all be >= 1")
    check_schedule(schedule, pp_size, virtual_stages, num_microbatches)
    info = schedule_info(schedule)
    with paused_gc():
        if schedule == "gpipe":
            rows = [_gpipe(rank, num_microbatches) for rank in range(pp_size)]
        elif schedule == "1f1b":
            rows = [_one_f_one_b(rank, pp_size, num_microbatches) for rank in range(pp_size)]
        else:
            rows = torch_groups(info.torch_class, pp_size, virtual_stages, num_microbatches,
                                info.split_backward)
        _check_coverage(rows, schedule, pp_size * virtual_stages, num_microbatches,
                        info.split_backward)
        return tuple(tuple(row) for row in rows)


@contextmanager
def paused_gc() -> Iterator[None]:
    """Pause the cyclic garbage collector while building many small acyclic tuples.

    With torch imported the heap holds ~350k objects, and a full collection that
    the allocations trigger costs more than the work itself (measured: 100 ms plans
    taking 350 ms). Reference counting still frees everything; the collector's
    previous state is restored.
    """
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


def _gpipe(rank: int, num_microbatches: int) -> list[Group]:
    """All forwards, then all backwards in microbatch order (torch's ScheduleGPipe)."""
    return ([(("F", rank, mb),) for mb in range(num_microbatches)]
            + [(("B", rank, mb),) for mb in range(num_microbatches)])


def _one_f_one_b(rank: int, pp_size: int, num_microbatches: int) -> list[Group]:
    """``pp - rank`` warm-up forwards, then alternate B and F, then drain the backwards.

    The same order torch's ``Schedule1F1B._step_microbatches`` runs.
    """
    num_warmup = min(num_microbatches, pp_size - rank)
    order: list[Group] = [(("F", rank, mb),) for mb in range(num_warmup)]
    for mb in range(num_microbatches):
        order.append((("B", rank, mb),))
        if num_warmup + mb < num_microbatches:
            order.append((("F", rank, num_warmup + mb),))
    return order


def _check_coverage(rows: list[list[Group]], schedule: str, num_stages: int,
                    num_microbatches: int, split_backward: bool) -> None:
    """Every (stage, microbatch) appears exactly once per kind (an internal invariant)."""
    kinds = "FBW" if split_backward else "FB"
    counts = [0] * (len(kinds) * num_stages * num_microbatches)
    for row in rows:
        for grp in row:
            for kind, stage, mb in grp:
                counts[(kinds.index(kind) * num_stages + stage) * num_microbatches + mb] += 1
    wrong = [divmod(i, num_microbatches) for i, c in enumerate(counts) if c != 1]
    assert not wrong, (f"{schedule} order does not run every action once; "
                       f"(kind * num_stages + stage, mb) wrong: {wrong[:5]}")
