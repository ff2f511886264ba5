"""The event engine's step as max-plus recurrences, evaluated level by level with NumPy.

An order fixes every dependency, so one step is a DAG whose nodes are the compute
actions and the sends, each with at most two predecessors:

- compute action: the previous action of its rank (or that action's send, when
  the rank waits for it: 1F1B's batched send/receive), and the action or send
  that delivers its input; ``end = max(end[pred_1], end[pred_2]) + duration``;
- send: the action whose group issues it, and the previous send on the same
  directed link (a link carries one transfer at a time, in issue order);
  ``end = max(...) + transfer time``.

These are exactly the engine's (``engine.run_compiled``) start/end rules, with the
same floating-point operations in the same order, so the results are identical.
Nodes are grouped by depth (longest path from a source): all nodes of one depth
depend only on shallower ones, so one level is a handful of vectorized operations,
and a batch of K splits of the same configuration runs as one ``(nodes, K)`` array.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from autopart.simulate._compiled_arrays import compiled_arrays

__all__ = ["level_plan"]

@dataclass(frozen=True, slots=True)
class LevelPlan:
    """The step's DAG for one (schedule, pp, v, m), nodes numbered level by level.

    Node 0 is a source that ends at 0 (the missing predecessor of first actions).
    """

    num_stages: int
    duration_idx: np.ndarray
    """Per node, its row in the duration table ``(table * num_stages + stage)``."""
    level_bounds: tuple[tuple[slice, np.ndarray, np.ndarray], ...]
    """Per level: its node range ``[lo, hi)`` as a slice, and the first and the second
    predecessor of each of its nodes (a gather each: cheaper than slicing one)."""
    rank_nodes: np.ndarray
    """``(longest run, ranks)``: per rank its compute nodes in run order, then padding
    (the index one past the last node, whose duration is 0)."""
    last_nodes: np.ndarray
    """Per rank, its last compute node."""
    predecessors: tuple[np.ndarray, np.ndarray]
    """Both predecessors of every node (for ``critical_counts``)."""

    def critical_counts(self, column: np.ndarray) -> np.ndarray:
        """How often each duration-table row lies on one critical path of a split.

        ``column`` is one split's duration table (``5 * num_stages`` values). The path
        runs back from the last action to end, always through the predecessor that
        ended last; its durations add up to the step, so the same counts dotted with
        another split's table give a lower bound on that split's step.
        """
        table = column.reshape(-1, 1)
        end, _busy, step = self._ends(table)
        ranks_end = end[self.last_nodes, 0]
        node = int(self.last_nodes[int(np.argmax(ranks_end))])
        counts = np.zeros(len(column), dtype=np.int64)
        first, second = self.predecessors
        while node:
            counts[self.duration_idx[node]] += 1
            a, b = int(first[node]), int(second[node])
            node = a if end[a, 0] >= end[b, 0] else b
        return counts

    def run(self, table: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Per-rank busy time ``(ranks, K)`` and step time ``(K,)`` for a batch.

        ``table`` is ``(5 * num_stages, K)``: per column one split's F, B, W, activation
        send and gradient send times of every stage (``duration_table``).
        """
        _end, busy, step = self._ends(table)
        return busy, step

    def _ends(self, table: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Every node's end, per-rank busy and the step, for a batch of tables."""
        num, width = len(self.duration_idx), table.shape[1]
        # One split runs on flat arrays: NumPy indexes those about twice as fast.
        shape = (num + 1,) if width == 1 else (num + 1, width)
        durations = np.empty(shape)
        np.take(table.reshape(len(table), width) if width > 1 else table.ravel(),
                self.duration_idx, axis=0, out=durations[:num])
        durations[num] = 0.0  # the padding of ``rank_nodes``
        # end = duration + max(both predecessors' ends), level by level (the source and
        # the padding end at 0). d + max(a, b) is max(a, b) + d bit for bit (IEEE
        # addition commutes), so this equals the engine's start + duration.
        end = durations.copy()
        end[0] = 0.0
        take, maximum = end.take, np.maximum
        if width == 1:  # the loop runs once per level: keep its NumPy calls few
            for nodes, first, second in self.level_bounds:
                end[nodes] += maximum(take(first), take(second))
        else:
            for nodes, first, second in self.level_bounds:
                end[nodes] += maximum(take(first, axis=0), take(second, axis=0))
        # Summed in each rank's run order, as the engine does (0.0 padding adds nothing).
        busy = np.add.accumulate(durations[self.rank_nodes], axis=0)[-1]
        step = end[self.last_nodes].max(axis=0)
        if width == 1:
            return end.reshape(-1, 1), busy.reshape(-1, 1), step.reshape(1)
        return end, busy, step


@lru_cache(maxsize=64)
def level_plan(schedule: str, pp_size: int, virtual_stages: int,
               num_microbatches: int) -> LevelPlan:
    """The cached ``LevelPlan`` of a configuration (from ``compiled_arrays``)."""
    plan = compiled_arrays(schedule, pp_size, virtual_stages, num_microbatches)
    num_stages = pp_size * virtual_stages
    dur, pred1, pred2, rank_of_node, starts = _nodes(plan, num_stages)
    depth = _depths(pred1, pred2, starts)
    order = np.argsort(depth, kind="stable")
    new_id = np.empty_like(order)
    new_id[order] = np.arange(len(order))
    p1, p2 = new_id[np.array(pred1)[order]], new_id[np.array(pred2)[order]]
    sorted_depth = depth[order]
    cuts = np.flatnonzero(np.diff(sorted_depth)) + 1
    bounds = [0, *cuts.tolist(), len(order)]
    levels = tuple((slice(lo, hi), p1[lo:hi].copy(), p2[lo:hi].copy())
                   for lo, hi in zip(bounds[1:-1], bounds[2:]))
    compute = np.array(rank_of_node)[order]
    per_rank = [np.flatnonzero(compute == r) for r in range(pp_size)]
    longest = max(len(nodes) for nodes in per_rank)
    rank_nodes = np.full((longest, pp_size), len(order))
    for r, nodes in enumerate(per_rank):
        rank_nodes[:len(nodes), r] = nodes
    return LevelPlan(num_stages, np.array(dur)[order], levels, rank_nodes,
                     np.array([nodes[-1] for nodes in per_rank]), (p1, p2))


def _nodes(plan: tuple[np.ndarray, ...], num_stages: int) -> tuple[np.ndarray, ...]:
    """Per node: duration row, both predecessors, and its rank (-1 for sends, the source);
    then where each rank's nodes start (one more entry: the number of nodes).

    ``plan`` is ``compiled_arrays``'. Node 0 is the source; then rank by rank, each
    compute action followed by the sends its group flushes, in issue order. Compute
    nodes of a rank keep their run order among the node ids (``rank_nodes`` relies on
    it). Second predecessors: the producer of the action's dependency (the source when
    none), and for a send the previous send on its directed link. Every predecessor on
    the node's own rank (its first, a send's second) has a smaller id (``_depths``
    relies on it).
    """
    parts, base, starts = [], 1, [1]
    for rank, rows in enumerate(plan):
        parts.append(_rank_nodes(rows, rank, base, num_stages))
        base += len(parts[-1][0])
        starts.append(base)
    dur, pred1, dep, rank_of, codes, owners = (
        np.concatenate([[start], *(part[k] for part in parts)]).astype(np.int64)
        for k, start in enumerate((0, 0, -1, -1, -1, 0)))
    producer = np.zeros(max(int(codes.max()), int(dep.max())) + 2, dtype=np.int64)
    producer[codes[1:]] = owners[1:]
    # dep >= 0: a code (its producer), -1: none (the source), <= -2: -2 - the link's
    # previous send (the source when there was none).
    pred2 = np.where(dep >= 0, producer[np.maximum(dep, 0)], np.where(dep == -1, 0, -2 - dep))
    return dur, pred1, pred2, rank_of, np.array(starts)


def _rank_nodes(rows: np.ndarray, rank: int, base: int, num_stages: int
                ) -> tuple[np.ndarray, ...]:
    """One rank's nodes numbered from ``base``: duration rows, first predecessors,
    dependencies (see ``_nodes``), ranks, and the codes they produce with their nodes."""
    kind, stage, dep = rows[:, 0], rows[:, 1], rows[:, 3]
    send, table, dst, flush = rows[:, 6], rows[:, 7], rows[:, 8], rows[:, 9]
    # The sends pending since the previous flush leave at a flushing action, in order.
    sends_so_far = np.cumsum(send >= 0)
    flushing = np.flatnonzero(flush > 0)
    emitted = np.zeros(len(rows), dtype=np.int64)
    emitted[flushing] = np.diff(sends_so_far[flushing], prepend=0)
    count = emitted[flushing]
    compute_id = base + np.arange(len(rows)) + np.cumsum(emitted) - emitted
    senders = np.flatnonzero(send >= 0)[:int(count.sum())]
    flusher = np.repeat(flushing, count)
    send_id = (compute_id[flusher] + 1 + np.arange(len(senders))
               - np.repeat(np.cumsum(count) - count, count))
    # A rank's next node follows its previous one, or that one's sends when it waited.
    prev = np.concatenate([[0], compute_id[:-1]])
    waited = np.flatnonzero((flush[:-1] == 2) & (emitted[:-1] > 0))
    prev[waited + 1] = compute_id[waited] + emitted[waited]
    link_prev = np.zeros(len(senders), dtype=np.int64)
    order = np.argsort(dst[senders], kind="stable")
    same = np.flatnonzero(dst[senders][order][1:] == dst[senders][order][:-1])
    link_prev[order[same + 1]] = send_id[order[same]]
    num = len(rows) + len(senders)
    out = np.empty((4, num), dtype=np.int64)
    at_compute, at_send = compute_id - base, send_id - base
    out[:, at_compute] = kind * num_stages + stage, prev, dep, np.full(len(rows), rank)
    out[:, at_send] = ((3 + table[senders]) * num_stages + stage[senders],
                       compute_id[flusher], -2 - link_prev, np.full(len(senders), -1))
    local = rows[:, 4:6].T.ravel()
    made = local >= 0
    codes = np.concatenate([local[made], send[senders]])
    owners = np.concatenate([np.tile(compute_id, 2)[made], send_id])
    return (*out, codes, owners)


def _depths(pred1: np.ndarray, pred2: np.ndarray, starts: np.ndarray) -> np.ndarray:
    """Longest-path depth of every node (the source has depth 0), rank by rank.

    A node's depth is one more than its deeper predecessor's. Each rank's nodes
    (``starts[r]`` to ``starts[r + 1]``) are walked in id order, where every predecessor
    on the same rank comes first (``_nodes``); a node whose other predecessor (on another
    rank) has no depth yet parks its rank until that node gets one, as the engine's
    ranks wait for their inputs (``engine.run_compiled``). One pass over the nodes in
    plain Python; measured against a vectorized frontier sweep (NumPy calls once per
    level, about one level per action of a rank): 3-5x faster at pp 4-8 with m 128-256,
    even at pp 32, 2x slower at pp 64 (wide levels), where both take about 0.1 s.
    """
    first, second = pred1.tolist(), pred2.tolist()
    depth = [-1] * len(first)
    depth[0] = 0
    pos, ends = starts[:-1].tolist(), starts[1:].tolist()
    waiting: dict[int, list[int]] = {}
    ready = list(range(len(pos) - 1, -1, -1))
    while ready:
        rank = ready.pop()
        node, end = pos[rank], ends[rank]
        while node < end:
            other = depth[second[node]]
            if other < 0:
                waiting.setdefault(second[node], []).append(rank)
                break
            own = depth[first[node]]
            depth[node] = (own if own > other else other) + 1
            if node in waiting:
                ready.extend(waiting.pop(node))
            node += 1
        pos[rank] = node
    stuck = sum(end - node for node, end in zip(pos, ends))
    assert not stuck, f"schedule deadlocked: {stuck} actions wait"
    return np.array(depth, dtype=np.int64)
