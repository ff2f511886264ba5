"""Local search with the simulator, and cut restrictions by fusing blocks.

The DP and ILP optimize a closed-form proxy of the step time; the simulator is the
judge. ``refine`` starts from the best candidate (solver or baseline split) and
moves one stage boundary at a time to the neighbouring allowed cut, keeping a move
when the simulated step gets faster and memory still fits; it also drops
recomputation where the stage fits without it. So a plan is never slower, in
simulation, than any split it started from: the baselines included.

``fuse_blocks`` merges the blocks between which no cut is allowed (e.g. NxD cuts
only after transformer layers), so the solvers see only legal cut positions.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

from autopart.schema import BlockProfile, Profile

__all__ = ["allowed_cuts", "fuse_blocks", "legal", "refine"]

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
    fused = tuple(_fuse(profile.blocks[i:j]) for i, j in zip(starts, ends, strict=True))
    return dataclasses.replace(profile, blocks=fused), [*starts, len(profile.blocks)]


def _fuse(blocks: Sequence[BlockProfile]) -> BlockProfile:
    if len(blocks) == 1:
        return blocks[0]
    last = blocks[-1]

    def total(field: str) -> float:
        return sum(getattr(b, field) for b in blocks)

    return dataclasses.replace(
        last, fwd_ms=total("fwd_ms"), bwd_ms=total("bwd_ms"),
        bwd_input_ms=total("bwd_input_ms"), bwd_weight_ms=total("bwd_weight_ms"),
        param_bytes=int(total("param_bytes")), num_params=int(total("num_params")),
        activation_bytes=int(total("activation_bytes")),
        transient_bytes=max(b.transient_bytes for b in blocks), reused_from=None)


def refine(evaluate: Callable[[Bounds, tuple[bool, ...]], object], start: object,
           allowed: Sequence[bool], *, max_evals: int = 300) -> object:
    """Hill-climb from ``start`` (an ``Evaluated``) by moving single boundaries.

    ``evaluate(bounds, recompute)`` simulates a split. A move is kept when it fits
    and lowers ``(step_ms, peak memory)``. Deterministic: moves are tried in a
    fixed order and the evaluation budget is a count, not a time.
    """
    best, num_evals = start, 0
    improved = True
    while improved and num_evals < max_evals:
        improved = False
        for bounds, recompute in _neighbours(best.bounds, best.recompute, allowed):
            candidate = evaluate(bounds, recompute)
            num_evals += 1
            if candidate.fits and _key(candidate) < _key(best):
                best, improved = candidate, True
                break
            if num_evals >= max_evals:
                break
    return best


def _key(item: object) -> tuple[float, int]:
    return (round(item.result.step_ms, 9), item.peak_memory_bytes)


def _neighbours(bounds: Bounds, recompute: tuple[bool, ...], allowed: Sequence[bool]):
    """Splits one boundary move (or one recompute drop) away from ``bounds``."""
    for s, flag in enumerate(recompute):
        if flag:
            yield bounds, recompute[:s] + (False,) + recompute[s + 1:]
    for s in range(len(bounds) - 1):
        (i, j), (_, k) = bounds[s], bounds[s + 1]
        for new in (_step(allowed, j, -1, i), _step(allowed, j, +1, k)):
            if new is not None:
                moved = bounds[:s] + ((i, new), (new, k)) + bounds[s + 2:]
                yield moved, recompute


def _step(allowed: Sequence[bool], j: int, direction: int, limit: int) -> int | None:
    """The next allowed cut from ``j`` in ``direction`` strictly inside ``(limit, j)``."""
    pos = j + direction
    while (pos > limit if direction < 0 else pos < limit):
        if allowed[pos]:
            return pos
        pos += direction
    return None
