"""Plan granularity ``slice``: layer halves cut inside their call into slice blocks.

A profile whose ``ModelInfo.slice_units`` names a half kind (``attention``: KV heads,
``mlp``: intermediate columns; ``autopart.intake.half_slices``) gets every half of
that kind replaced by ``k`` slice blocks ``<half>.slice<i>of<k>``, which the solvers
see as ordinary blocks. As for the head's vocabulary shards, their costs are
**derived**: the half's F, B, W, activations and workspace times the slice's share
of the units (its projections and, for attention, its heads' attention core are
linear in the units; the half's norm and residual add, a few percent, are spread
with them). What crosses a cut after a slice that is not the last is three
hidden-state tensors: the module's input, the residual beside it and the sum of the
slices so far (``cut_bytes``). Every rank holding a slice holds the half whole, with
its gradient and optimizer state, and the two ranks on either side of a cut inside
a half sum its gradient after the step: ``autopart.cost`` counts the whole half's
static bytes on both stages and ``autopart.rank_cost.shared_grad_sync_ms`` the sum.
"""

from __future__ import annotations

import dataclasses

from autopart.intake.half_slices import slice_names, unit_range
from autopart.schema import BlockProfile, Profile

__all__ = ["CROSSING_TENSORS", "DEFAULT_SLICES", "MAX_SLICES", "block_part", "slice_halves"]

DEFAULT_SLICES = 4
"""Slices per half: a quarter of a half is finer than the quarter split's coarsest part
(the MLP up to its output projection, over half a layer)."""
MAX_SLICES = 64
"""The most slices per half ``--cuts`` may ask for."""
CROSSING_TENSORS = 3
"""Hidden-state tensors crossing a cut inside a half: input, residual, partial sum."""


def slice_halves(profile: Profile, num: int = DEFAULT_SLICES) -> Profile:
    """``profile`` (``sublayer`` blocks) with every sliceable half split into slices.

    Args:
        profile: A profile whose halves are whole blocks (``sublayer``).
        num: Slices per half (at most the half's units; attention halves get
            ``min(num, KV heads)``).

    Returns:
        The profile with slice blocks in place of the halves of every kind in
        ``profile.model.slice_units`` (itself when there are none).
    """
    units = profile.model.slice_units
    if not units:
        return profile
    blocks: list[BlockProfile] = []
    for i, block in enumerate(profile.blocks):
        if block.kind not in units or not block.layer or i == 0:
            blocks.append(block)
            continue
        hidden = profile.blocks[i - 1].output_bytes
        blocks.extend(_slices(block, min(num, units[block.kind]), units[block.kind], hidden))
    return dataclasses.replace(profile, blocks=tuple(blocks))


def _slices(half: BlockProfile, num: int, units: int, hidden: int) -> list[BlockProfile]:
    """The ``num`` slice blocks of ``half`` (module docstring)."""
    return [block_part(half, *unit_range(i, num, units), units, name=name,
                       output_bytes=half.output_bytes if i == num - 1
                       else CROSSING_TENSORS * hidden)
            for i, name in enumerate(slice_names(half.name, num))]


def block_part(block: BlockProfile, lo: int, hi: int, total: int, *, name: str,
               output_bytes: int, adopted: bool = True) -> BlockProfile:
    """``block``'s share ``[lo, hi)`` of ``total`` units (a slice's, a head shard's): times,
    activations, workspace and parameters by that fraction (integers rounded at both
    ends, so the parts sum to the whole); ``adopted=False`` drops its adopted gradients."""
    frac = (hi - lo) / total

    def part(value: int) -> int:
        return round(value * hi / total) - round(value * lo / total)

    return dataclasses.replace(
        block, name=name, fwd_ms=block.fwd_ms * frac, bwd_ms=block.bwd_ms * frac,
        bwd_input_ms=block.bwd_input_ms * frac, bwd_weight_ms=block.bwd_weight_ms * frac,
        activation_bytes=part(block.activation_bytes),
        held_for_weight_bytes=part(block.held_for_weight_bytes),
        adopted_grad_bytes=min(part(block.adopted_grad_bytes), part(block.transient_bytes))
        if adopted else 0,
        transient_bytes=part(block.transient_bytes), output_bytes=output_bytes,
        param_bytes=part(block.param_bytes), num_params=part(block.num_params),
        measured=(), reused_from=None, modules=())
