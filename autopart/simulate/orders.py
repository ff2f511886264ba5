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

import numpy as np

from autopart.errors import PlanError
from autopart.schedules import check_schedule, schedule_info
from autopart.simulate._torch_orders import Group, torch_groups

__all__ = ["Action", "max_in_flight", "rank_orders"]

_KIND = {"F": 0, "B": 1, "W": 2}


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
    release = 2 if schedule_info(schedule).split_backward else 1
    num_stages = pp_size * virtual_stages
    kind, stage = np.concatenate(action_arrays(schedule, pp_size, virtual_stages,
                                               num_microbatches))[:, :2].T
    # Per stage, in each rank's run order (a stage runs on one rank): +1 at F, -1 at
    # the releasing backward; the peak of the running sum.
    order = np.argsort(stage, kind="stable")
    delta = np.where(kind == 0, 1, np.where(kind == release, -1, 0))[order]
    starts = np.searchsorted(stage[order], np.arange(num_stages))
    running = np.cumsum(delta)
    before = np.concatenate([[0], running])[starts]
    held = running - np.repeat(before, np.diff(np.append(starts, len(order))))
    ends = np.append(starts[1:], len(order)) - 1
    assert not held[ends].any(), f"unreleased activations {held[ends]} in {schedule}"
    return tuple(np.maximum.reduceat(held, starts).tolist())


def action_arrays(schedule: str, pp_size: int, virtual_stages: int,
                  num_microbatches: int) -> tuple[np.ndarray, ...]:
    """Per rank, ``action_groups``' actions in run order as rows ``(kind, stage_idx,
    microbatch_idx, last)``: kind 0 ``F``, 1 ``B``, 2 ``W``; ``last`` 1 on a group's
    last action. Validated and cached with the groups."""
    return _orders(schedule, pp_size, virtual_stages, num_microbatches)[1]


def action_groups(schedule: str, pp_size: int, virtual_stages: int,
                  num_microbatches: int) -> tuple[tuple[Group, ...], ...]:
    """Per rank, the compute groups in run order; validated and cached.

    A group is one torch action: usually one ``(kind, stage_idx, microbatch_idx)``,
    several where torch runs them as one (a full backward ``B W`` in split
    schedules, DualPipeV's overlapped ``F B W``). Raises ``PlanError`` when torch's
    class for ``schedule`` rejects the settings.
    """
    return _orders(schedule, pp_size, virtual_stages, num_microbatches)[0]


@lru_cache(maxsize=64)
def _orders(schedule: str, pp_size: int, virtual_stages: int, num_microbatches: int
            ) -> tuple[tuple[tuple[Group, ...], ...], tuple[np.ndarray, ...]]:
    """``action_groups`` and ``action_arrays``, built and checked once."""
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
        flat = tuple(_flat(row) for row in rows)
        _check_coverage(flat, schedule, pp_size * virtual_stages, num_microbatches,
                        info.split_backward)
        return tuple(tuple(row) for row in rows), flat


def _flat(row: list[Group]) -> np.ndarray:
    """One rank's groups as ``action_arrays`` rows."""
    sizes = np.fromiter(map(len, row), dtype=np.int64, count=len(row))
    out = np.zeros((int(sizes.sum()), 4), dtype=np.int64)
    if len(out):
        kind = _KIND
        flat = [x for grp in row for k, s, mb in grp for x in (kind[k], s, mb)]
        out[:, :3] = np.array(flat, dtype=np.int64).reshape(-1, 3)
        out[np.cumsum(sizes) - 1, 3] = 1
    return out


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


def _check_coverage(flat: tuple[np.ndarray, ...], schedule: str, num_stages: int,
                    num_microbatches: int, split_backward: bool) -> None:
    """Every (stage, microbatch) appears exactly once per kind (an internal invariant)."""
    kind, stage, mb = np.concatenate(flat)[:, :3].T
    num_kinds = 3 if split_backward else 2
    codes = (kind * num_stages + stage) * num_microbatches + mb
    counts = np.bincount(codes, minlength=num_kinds * num_stages * num_microbatches)
    wrong = [divmod(int(i), num_microbatches) for i in np.flatnonzero(counts != 1)]
    assert not wrong and kind.max(initial=0) < num_kinds, (
        f"{schedule} order does not run every action once; "
        f"(kind * num_stages + stage, mb) wrong: {wrong[:5]}")
