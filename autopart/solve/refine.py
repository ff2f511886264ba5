"""Local search with the simulator, and cut restrictions by fusing blocks.

The DP and ILP optimize a closed-form proxy of the step time; the simulator is the
judge. ``refine`` starts from a candidate (solver or baseline split) and moves one
stage boundary, or two at once, to the neighbouring allowed cut, keeping a move
when the simulated step gets faster and memory still fits; it also drops
recomputation where the stage fits without it. So a plan is never slower, in
simulation, than any split it started from: the baselines included. Moves that
the current critical path proves useless are not simulated.

``fuse_blocks`` merges the blocks between which no cut is allowed (e.g. NxD cuts
only after transformer layers), so the solvers see only legal cut positions.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Protocol

from autopart.levels import fuse
from autopart.schema import Profile

__all__ = []

Bounds = tuple[tuple[int, int], ...]


def allowed_cuts(profile: Profile, cut_kinds: Sequence[str] | None) -> list[bool]:
    """``allowed[j]``: may a stage end after block ``j - 1``? (positions ``0 .. n``)."""
    num = len(profile.blocks)
    allowed = [True] * (num + 1)
    if cut_kinds is not None:
        for j in range(1, num):
            allowed[j] = profile.blocks[j - 1].kind in cut_kinds
    return allowed


def legal(bounds: Bounds, allowed: Sequence[bool]) -> bool:
    """True when every stage boundary of ``bounds`` sits at an allowed cut."""
    return all(allowed[j] for _, j in bounds[:-1])


def fuse_blocks(profile: Profile, allowed: Sequence[bool]) -> tuple[Profile, list[int]]:
    """Merge runs of blocks with no allowed cut inside; return the fused profile and the
    original start position of every fused block (plus ``n`` at the end)."""
    starts = [0] + [j for j in range(1, len(profile.blocks)) if allowed[j]]
    if len(starts) == len(profile.blocks):
        return profile, [*starts, len(profile.blocks)]
    ends = [*starts[1:], len(profile.blocks)]
    fused = tuple(fuse(profile.blocks[i:j]) for i, j in zip(starts, ends, strict=True))
    return dataclasses.replace(profile, blocks=fused), [*starts, len(profile.blocks)]


class Judge(Protocol):
    """What the local search needs from the simulator for one configuration."""

    def evaluate_many(self, splits: Sequence[tuple[Bounds, tuple[bool, ...]]]) -> list[Any]:
        """Simulate several ``(bounds, recompute)`` splits (``Evaluated``s, in order)."""

    def critical(self, current: Any) -> Callable[[Bounds, tuple[bool, ...]], float]:
        """From a simulated split's critical path, a lower bound on another split's step."""


_PAIR_MOVES_MAX_CUTS = 16
"""Up to this many cuts every pair of cuts moves together; beyond, adjacent pairs only."""
_BOUND_SLACK = 1e-9
"""Relative margin on the bound (covers rounding in its sum)."""
_WIDEST_BATCH = 16
"""The most moves simulated together (``refine_counted``). One simulation of 16 splits
costs about what 2-3 of one split cost (``simulate.levels`` runs the same NumPy calls
per level, on wider rows); beyond 16 the cost per split hardly falls."""


def refine(judge: Judge, start: Any, allowed: Sequence[bool], *, max_evals: int = 300,
           visited: set | None = None) -> Any:
    """``refine_counted`` without the count: the end point of the climb."""
    return refine_counted(judge, start, allowed, max_evals=max_evals, visited=visited)[0]


def refine_counted(judge: Judge, start: Any, allowed: Sequence[bool], *, max_evals: int = 300,
                   visited: set | None = None) -> tuple[Any, int]:
    """Hill-climb from ``start`` (an ``Evaluated``) by moving one or two cuts at a time.

    A move is kept when it fits and lowers the step (or keeps it and lowers peak
    memory); moves are tried in a fixed order (recompute drops, single cuts, pairs
    of cuts) and the first that helps is taken. The current critical path, with a
    move's durations, bounds the move's step from below (``judge.critical``):
    when that bound is not below the current step the move cannot make the step
    faster and is not simulated, so only moves that shorten the critical path are
    re-simulated. Deterministic: ``max_evals`` counts simulations, never time.
    ``visited`` (shared by the searches of one configuration) holds the splits
    earlier searches passed through: from one of those the climb would repeat an
    earlier one, so it stops there. Returns the end point and the simulations spent.

    The moves are simulated in batches of 1, 2, 4, ... up to ``_WIDEST_BATCH`` after
    each kept move (most moves near the end of a climb do not help, and a batch costs
    far less per split). The climb and its count are those of trying the moves one
    at a time: a batch's moves after the first that helps were simulated in vain and
    are not counted, and no batch is wider than the simulations left.
    """
    best, num_evals = start, 0
    visited = set() if visited is None else visited
    improved = (start.bounds, start.recompute) not in visited
    visited.add((start.bounds, start.recompute))
    while improved and num_evals < max_evals:
        improved = moved = False
        bound = judge.critical(best)
        step = best.result.step_ms
        floor = step - _BOUND_SLACK * max(1.0, abs(step))
        promising = (move for move in neighbours(best.bounds, best.recompute, allowed)
                     if bound(*move) < floor)
        width = 1
        while not moved and num_evals < max_evals:
            batch = list(itertools.islice(promising, min(width, max_evals - num_evals)))
            if not batch:
                break
            for candidate in judge.evaluate_many(batch):
                num_evals += 1
                if candidate.fits and _key(candidate) < _key(best):
                    best, moved = candidate, True
                    improved = (best.bounds, best.recompute) not in visited
                    visited.add((best.bounds, best.recompute))
                    break
            width = min(2 * width, _WIDEST_BATCH)
    return best, num_evals


def _key(item: Any) -> tuple[float, int]:
    return (round(item.result.step_ms, 9), item.peak_memory_bytes)


def neighbours(bounds: Bounds, recompute: tuple[bool, ...], allowed: Sequence[bool]
                ) -> Iterator[tuple[Bounds, tuple[bool, ...]]]:
    """Splits one recompute drop, one cut move or one move of two cuts away."""
    for s, flag in enumerate(recompute):
        if flag:
            yield bounds, recompute[:s] + (False,) + recompute[s + 1:]
    cuts = [j for _, j in bounds[:-1]]
    for c in range(len(cuts)):
        for direction in (-1, 1):
            moved = _moved(cuts, allowed, {c: direction}, bounds[-1][1])
            if moved is not None:
                yield moved, recompute
    num_cuts = len(cuts)
    for c in range(num_cuts):
        last = num_cuts if num_cuts <= _PAIR_MOVES_MAX_CUTS else min(num_cuts, c + 2)
        for d in range(c + 1, last):
            for dir_c, dir_d in ((-1, -1), (1, 1), (-1, 1), (1, -1)):
                moved = _moved(cuts, allowed, {c: dir_c, d: dir_d}, bounds[-1][1])
                if moved is not None:
                    yield moved, recompute


def _moved(cuts: list[int], allowed: Sequence[bool], steps: dict[int, int], end: int
           ) -> Bounds | None:
    """The split with cut ``c`` moved to the next allowed cut in ``steps[c]``'s direction
    for every ``c`` in ``steps``; ``None`` when a stage would become empty."""
    new = list(cuts)
    for c in steps:
        pos = new[c] + steps[c]
        while 0 < pos < end and not allowed[pos]:
            pos += steps[c]
        new[c] = pos
    edges = [0, *new, end]
    if any(b <= a for a, b in itertools.pairwise(edges)):
        return None
    return tuple(itertools.pairwise(edges))
