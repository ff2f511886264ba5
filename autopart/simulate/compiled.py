"""The engine's form of an order: per rank, tuples of integer codes (cached).

A dependency or output is the code ``(table * num_stages + stage) * m + mb`` where
the table is ``ACT`` (stage's activation available to stage + 1, or to its own
``B`` on the last stage), ``GRAD`` (stage's input grad available to stage - 1) or
``BDONE`` (stage's ``B`` done, for its ``W``). Each action becomes
``(kind_idx, stage, mb, deps, local_outs, send_code, send_table, dst_rank, flush)``.
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np

from autopart.schedules import schedule_info, stage_to_rank, stages_of_rank
from autopart.simulate._compiled_arrays import compiled_arrays
from autopart.simulate.orders import action_groups

__all__ = []

KINDS = ("F", "B", "W")
ACT, GRAD, BDONE = 0, 1, 2
_NO_DST = -1


@lru_cache(maxsize=64)
def compiled_plan(schedule: str, pp_size: int, virtual_stages: int,
                  num_microbatches: int) -> tuple[tuple[tuple, ...], ...]:
    """Per rank, each action as ``(kind_idx, stage, mb, deps, local_outs, send_code,
    send_table, dst_rank, flush)`` with integer codes ``table * S * m + stage * m + mb``.

    ``deps`` must be available before the action starts; ``local_outs`` become
    available when it ends; ``send_code`` (or -1) is sent to ``dst_rank`` when the
    action's group ends (``flush``; 2: the rank then waits until its sends end, as
    1F1B's batched send/receive does). Cached.
    """
    info = schedule_info(schedule)
    style = info.style
    num_stages = pp_size * virtual_stages
    rank_of = [stage_to_rank(s, pp_size, virtual_stages, style) for s in range(num_stages)]
    rows = []
    for rank, groups in enumerate(action_groups(schedule, pp_size, virtual_stages,
                                          num_microbatches)):
        row = []
        for grp in groups:
            parts = [compile_action(kind, s, mb, rank, rank_of, num_microbatches)
                     for kind, s, mb in grp]
            if len(parts) > 1:
                parts = _merge_group(parts)
            row.extend(parts)
        if info.blocking_sends:
            row = _blocking_sends_1f1b(row, min(num_microbatches, pp_size - rank))
        rows.append(tuple(row))
    return tuple(rows)


def _blocking_sends_1f1b(row: list[tuple], num_warmup: int) -> list[tuple]:
    """Mark (``flush = 2``) the sends the rank waits for before its next action.

    torch 2.13's ``Schedule1F1B`` batches the last warm-up forward's send and every
    steady-state forward's send with the next backward's gradient receive, and every
    steady-state backward's send with the next forward's receive, then waits on the
    batch: those transfers do not overlap the rank's compute. The other warm-up and
    the cool-down sends are waited on only after the next action, like async sends.
    """
    out = []
    for i, entry in enumerate(row):
        kind, mb, send = entry[0], entry[2], entry[5]
        follows_f = i + 1 < len(row) and row[i + 1][0] == 0
        if send >= 0 and ((kind == 0 and mb >= num_warmup - 1) or (kind == 1 and follows_f)):
            entry = (*entry[:8], 2)
        out.append(entry)
    return out


def compile_action(kind: str, s: int, mb: int, rank: int, rank_of: list[int], m: int
                   ) -> tuple:
    """The compiled form of one action that is alone in its group."""
    num_stages = len(rank_of)
    n = num_stages * m
    idx = s * m + mb
    local: tuple[int, ...] = ()
    send, table, dst = -1, ACT, _NO_DST
    if kind == "F":
        deps = (idx - m,) if s > 0 else ()
        if s == num_stages - 1 or rank_of[s + 1] == rank:
            local = (idx,)  # the last stage's B waits on its own F; V turnaround is free
        else:
            send, dst = idx, rank_of[s + 1]
        return (0, s, mb, deps, local, send, table, dst, True)
    if kind == "B":
        deps = (n + idx + m,) if s + 1 < num_stages else (idx,)
        local = (2 * n + idx,)
        if s > 0:
            if rank_of[s - 1] == rank:
                local = (2 * n + idx, n + idx)
            else:
                send, table, dst = n + idx, GRAD, rank_of[s - 1]
        return (1, s, mb, deps, local, send, table, dst, True)
    assert kind == "W", kind
    return (2, s, mb, (2 * n + idx,), local, send, table, dst, True)


def _merge_group(parts: list[tuple]) -> list[tuple]:
    """One torch action expanded into parts: each part still waits for its own input
    (torch's runtime waits per sub-action), but the group's sends leave only when its
    last part ends (torch issues the SEND actions after the whole action)."""
    return [p[:8] + (pos == len(parts) - 1,) for pos, p in enumerate(parts)]


@lru_cache(maxsize=64)
def held_counts(schedule: str, pp_size: int, virtual_stages: int, num_microbatches: int
                ) -> tuple[tuple[tuple[int, ...], np.ndarray, np.ndarray, np.ndarray], ...]:
    """Per rank: its stages, one row per distinct moment an action runs with how many
    microbatches each of those stages holds then, the column of the running stage, and
    whether the action pays its stage's weight gradients as workspace: a weight-gradient
    backward (``B``, or ``W`` in split schedules) after the stage's first in the step.
    The first hands them to ``.grad`` (static) and ``F`` (and a split ``B``) computes
    none, so those leave out ``StageCost.adopted_grad_bytes``. Cached.

    A row has four columns per stage (``4 * len(stages)``): microbatches between their
    ``F`` and ``B``, then (split schedules) those between their ``B`` and ``W``, then
    the backwards done before the moment, then the releasing backwards done (``B``, or
    ``W`` in split schedules): torch waits some sends only at the end of the step, and
    the tensors they send stay alive until then (``autopart.simulate.engine``). A
    microbatch is held from the start of its ``F`` until the end of its releasing
    backward (``B``, or ``W`` in split schedules), and the running stage's workspace
    comes on top, so the rank's peak bytes during the step are ``max(counts @
    [activation_bytes, activation_bytes + held_for_weight_bytes] +
    transient_bytes[running])`` over its stages.
    """
    info = schedule_info(schedule)
    out = []
    for rank, rows in enumerate(compiled_arrays(schedule, pp_size, virtual_stages,
                                                num_microbatches)):
        stages = tuple(stages_of_rank(rank, pp_size, virtual_stages, info.style))
        table = _moments(rows[:, 0], rows[:, 1], stages, info.split_backward,
                         _full_backwards(rows) if info.split_backward else None)
        out.append((stages, table[:, :-2], table[:, -2], table[:, -1].astype(bool)))
    return tuple(out)


def _full_backwards(rows: np.ndarray) -> np.ndarray:
    """Rows of a split schedule's order that are a ``B`` torch runs as one full backward
    with the ``W`` after it (one group: DualPipeV's overlapped ``F B W``, a schedule's
    ``FULL_BACKWARD``), not as ``BACKWARD_INPUT`` then ``BACKWARD_WEIGHT``."""
    kind, stage, mb, flush = rows[:, 0], rows[:, 1], rows[:, 2], rows[:, 9]
    full = np.zeros(len(rows), dtype=bool)
    full[:-1] = ((kind[:-1] == 1) & (flush[:-1] == 0) & (kind[1:] == 2)
                 & (stage[1:] == stage[:-1]) & (mb[1:] == mb[:-1]))
    return full


def _moments(kind: np.ndarray, stage: np.ndarray, stages: tuple[int, ...],
             split_backward: bool, full: np.ndarray | None = None) -> np.ndarray:
    """One rank's distinct ``(held per column..., running column, pays)`` rows, sorted.

    A moment is taken after the action's ``F`` took its microbatch and before its
    backward let one go: held = the changes of the actions before it, plus its own
    ``F``. ``B`` releases its column (and, split, holds the microbatch in the B-to-W
    column), ``W`` releases the B-to-W column. A full backward (``full``: the ``B`` of a
    ``B W`` torch runs as one action) keeps no gradients for a later ``W``: the
    microbatch stays in its F-to-B column until the ``W`` releases it. Array arithmetic
    over the rank's actions (a loop over them cost as much as building the whole order).
    """
    num = len(stages)
    column = np.zeros(max(stages) + 1, dtype=np.int64)
    column[list(stages)] = np.arange(num)
    col = column[stage]
    rows = np.arange(len(kind))
    before = np.zeros((len(kind), 2 * num), dtype=np.int64)
    after = np.zeros_like(before)
    forward, backward, weight = kind == 0, kind == 1, kind == 2
    before[rows[forward], col[forward]] = 1
    after[rows[backward], col[backward]] = -1
    if split_backward:
        after[rows[backward], num + col[backward]] = 1
        after[rows[weight], num + col[weight]] = -1
        if full is not None and full.any():
            b = rows[full]
            after[b, col[b]] = after[b, num + col[b]] = 0
            after[b + 1, num + col[b]] = 0
            after[b + 1, col[b]] = -1
    held = np.cumsum(before, axis=0) + np.cumsum(after, axis=0) - after
    # Backwards and releasing backwards done before the moment (what a send still holds).
    done = np.zeros_like(before)
    done[rows[backward], col[backward]] = 1
    release = weight if split_backward else backward
    done[rows[release], num + col[release]] = 1
    held = np.hstack([held, np.cumsum(done, axis=0) - done])
    # Pays its weight gradients as workspace: a gradient backward after its stage's first.
    grads = np.flatnonzero(kind == (2 if split_backward else 1))
    pays = np.zeros(len(kind), dtype=np.int64)
    pays[grads] = 1
    pays[grads[np.unique(col[grads], return_index=True)[1]]] = 0
    table = np.column_stack([held, col, pays])
    table = table[np.lexsort(table.T[::-1])]  # rows in tuple order (a void-type sort is slow)
    distinct = np.ones(len(table), dtype=bool)
    distinct[1:] = (table[1:] != table[:-1]).any(axis=1)
    return table[distinct]
