"""``compiled_plan``'s entries as arrays, built with NumPy arithmetic (cached).

The level simulator (``levels.py``) and the memory moments (``compiled.held_counts``)
read every action of a configuration; at pp 64, m 256 that is ~300k actions, and
building a tuple per action cost more than all the rest of their work. Here each
rank's order becomes one ``(actions, len(COLUMNS))`` int64 array, equal field by
field to ``compiled_plan``'s tuples (``deps`` and ``local_outs`` padded with -1; an
action has at most one dependency and two local outputs).
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np

from autopart.schedules import schedule_info, stage_to_rank
from autopart.simulate.orders import action_arrays

__all__ = []

COLUMNS = ("kind", "stage", "mb", "dep", "local1", "local2", "send", "table", "dst", "flush")
"""One column per field: kind index (F 0, B 1, W 2), stage, microbatch, the dependency
code (-1: none), up to two local output codes (-1: none), the send code (-1: none), its
table (``ACT`` 0, ``GRAD`` 1), its destination rank (-1), flush (0, 1, or 2: the rank
waits for its sends)."""


@lru_cache(maxsize=64)
def compiled_arrays(schedule: str, pp_size: int, virtual_stages: int,
                    num_microbatches: int) -> tuple[np.ndarray, ...]:
    """Per rank, its actions in run order as rows of ``COLUMNS`` (see ``compiled_plan``
    for the codes and the flush rules). Cached."""
    info = schedule_info(schedule)
    num_stages = pp_size * virtual_stages
    rank_of = np.array([stage_to_rank(s, pp_size, virtual_stages, info.style)
                        for s in range(num_stages)], dtype=np.int64)
    out = []
    for rank, actions in enumerate(action_arrays(schedule, pp_size, virtual_stages,
                                                 num_microbatches)):
        rows = _rank_rows(actions, rank, rank_of, num_microbatches)
        if info.blocking_sends:
            _mark_blocking_sends(rows, min(num_microbatches, pp_size - rank))
        out.append(rows)
    return tuple(out)


def _rank_rows(actions: np.ndarray, rank: int, rank_of: np.ndarray, m: int) -> np.ndarray:
    """``compile_action`` and ``_merge_group`` of one rank (``action_arrays`` rows), as
    array arithmetic."""
    kind, stage, mb, last = actions.T
    num_stages = len(rank_of)
    n, idx = num_stages * m, stage * m + mb
    fwd, bwd = kind == 0, kind == 1
    has_next, has_prev = stage < num_stages - 1, stage > 0
    next_rank = rank_of[np.minimum(stage + 1, num_stages - 1)]
    prev_rank = rank_of[np.maximum(stage - 1, 0)]
    f_send = fwd & has_next & (next_rank != rank)  # else its output stays on the rank
    b_send = bwd & has_prev & (prev_rank != rank)
    b_local = bwd & has_prev & (prev_rank == rank)
    rows = np.full((len(kind), len(COLUMNS)), -1, dtype=np.int64)
    rows[:, 0], rows[:, 1], rows[:, 2] = kind, stage, mb
    rows[:, 3] = np.where(fwd, np.where(has_prev, idx - m, -1),
                          np.where(bwd, np.where(has_next, n + idx + m, idx), 2 * n + idx))
    rows[:, 4] = np.where(fwd & ~f_send, idx, np.where(bwd, 2 * n + idx, -1))
    rows[:, 5] = np.where(b_local, n + idx, -1)
    rows[:, 6] = np.where(f_send, idx, np.where(b_send, n + idx, -1))
    rows[:, 7] = np.where(b_send, 1, 0)
    rows[:, 8] = np.where(f_send, next_rank, np.where(b_send, prev_rank, -1))
    rows[:, 9] = last
    return rows


def _mark_blocking_sends(rows: np.ndarray, num_warmup: int) -> None:
    """``compiled._blocking_sends_1f1b``: flush 2 on the sends the rank waits for."""
    kind, mb, send = rows[:, 0], rows[:, 2], rows[:, 6]
    follows_f = np.zeros(len(rows), dtype=bool)
    follows_f[:-1] = kind[1:] == 0
    waits = (send >= 0) & (((kind == 0) & (mb >= num_warmup - 1)) | ((kind == 1) & follows_f))
    rows[waits, 9] = 2
