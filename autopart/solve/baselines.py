"""The splits public tools use, for comparison and as ``--partition`` choices.

- ``even`` (NxD ``auto_partition``, NeMo): decoder layers divided evenly over the
  stages, the embedding with the first stage, norm and head with the last. Without
  decoder layers (``block`` kinds) every block counts as one layer.
- ``params`` (DeepSpeed ``partition_method="parameters"``): contiguous split that
  minimizes the largest per-stage parameter count.
- ``torchtitan`` (``pipeline_parallel.py``): the embedding and the norm+head each
  count as one layer, then the units are divided evenly.

Uneven divisions give the extra unit to the first stages (``numpy.array_split``).
These tools cut between whole modules: on a profile cut inside layers or the head
the parts are fused first (``autopart.levels.coarsen_blocks`` at ``layer``, the head
whole), so a baseline never cuts inside a layer or the head.
When there are fewer units than stages every block becomes a unit. A split is a
list of ``(first, stop)`` half-open block ranges, one per stage.
"""

from __future__ import annotations

from collections.abc import Sequence

from autopart.levels import coarsen_blocks
from autopart.schema import BlockProfile

__all__ = ["baseline_split"]

_LAYER = "decoder_layer"


def _units_even(blocks: Sequence[BlockProfile]) -> list[list[int]]:
    """Decoder layers as units; every other block joins its neighbouring layer."""
    layers = [b for b, blk in enumerate(blocks) if blk.kind == _LAYER]
    if not layers:
        return [[b] for b in range(len(blocks))]
    units = [[b] for b in layers]
    units[0] = list(range(layers[0] + 1))
    for pos, b in enumerate(layers):
        stop = layers[pos + 1] if pos + 1 < len(layers) else len(blocks)
        units[pos] = units[pos] + list(range(b + 1, stop))
    return units


def _units_torchtitan(blocks: Sequence[BlockProfile]) -> list[list[int]]:
    """Like ``_units_even`` but the blocks before the first layer (embedding) and after
    the last layer (norm + head) form one unit each."""
    layers = [b for b, blk in enumerate(blocks) if blk.kind == _LAYER]
    if not layers:
        return [[b] for b in range(len(blocks))]
    pre = list(range(layers[0]))
    units = [pre] if pre else []
    for pos, b in enumerate(layers):
        stop = layers[pos + 1] if pos + 1 < len(layers) else b + 1
        units.append(list(range(b, stop)))
    tail = list(range(layers[-1] + 1, len(blocks)))
    return units + ([tail] if tail else [])


def _split_units(units: list[list[int]], num_stages: int) -> list[tuple[int, int]]:
    """Divide ``units`` into ``num_stages`` contiguous groups, the extras first."""
    size, extra = divmod(len(units), num_stages)
    bounds, pos = [], 0
    for s in range(num_stages):
        take = size + (1 if s < extra else 0)
        group = units[pos:pos + take]
        bounds.append((group[0][0], group[-1][-1] + 1))
        pos += take
    return bounds


def _by_units(units: list[list[int]], num_blocks: int, num_stages: int
              ) -> list[tuple[int, int]]:
    if len(units) < num_stages:
        units = [[b] for b in range(num_blocks)]
    return _split_units(units, num_stages)


def even_split(blocks: Sequence[BlockProfile], num_stages: int) -> list[tuple[int, int]]:
    """NxD/NeMo: decoder layers evenly, embedding first, norm and head last."""
    return _by_units(_units_even(blocks), len(blocks), num_stages)


def torchtitan_split(blocks: Sequence[BlockProfile], num_stages: int) -> list[tuple[int, int]]:
    """torchtitan: embedding and norm+head count as one layer each, then evenly."""
    return _by_units(_units_torchtitan(blocks), len(blocks), num_stages)


def params_split(blocks: Sequence[BlockProfile], num_stages: int) -> list[tuple[int, int]]:
    """DeepSpeed ``parameters``: minimize the largest stage parameter count."""
    weights = [max(0, blk.num_params) for blk in blocks]
    lo, hi = max(weights), sum(weights)
    while lo < hi:  # smallest bottleneck that needs at most num_stages parts
        mid = (lo + hi) // 2
        if _num_parts(weights, mid) <= num_stages:
            hi = mid
        else:
            lo = mid + 1
    bounds, start, total = [], 0, 0
    for b, w in enumerate(weights):
        stages_left = num_stages - len(bounds)
        must_cut = len(weights) - b == stages_left - 1  # the rest need a block each
        if b > start and (total + w > lo or must_cut) and stages_left > 1:
            bounds.append((start, b))
            start, total = b, 0
        total += w
    bounds.append((start, len(weights)))
    return bounds


def _num_parts(weights: Sequence[int], bound: int) -> int:
    parts, total = 1, 0
    for w in weights:
        if total + w > bound:
            parts, total = parts + 1, 0
        total += w
    return parts


BASELINES = {"even": even_split, "params": params_split, "torchtitan": torchtitan_split}


def baseline_split(name: str, blocks: Sequence[BlockProfile], num_stages: int
                   ) -> list[tuple[int, int]]:
    """The split a public tool would make of ``blocks``.

    Args:
        name: ``even`` (decoder layers evenly, NxD / NeMo / Megatron), ``params``
            (parameter counts balanced, DeepSpeed) or ``torchtitan``.
        blocks: The profile's blocks, in order.
        num_stages: Stages to cut.

    Returns:
        One ``(start, stop)`` block range per stage.

    Raises:
        ValueError: ``name`` is not a baseline, or ``num_stages`` is not in
            ``1..len(blocks)``.
    """
    if name not in BASELINES:
        raise ValueError(f"unknown baseline {name!r}; choose one of {', '.join(BASELINES)}")
    if not 1 <= num_stages <= len(blocks):
        raise ValueError(f"num_stages ({num_stages}) must be in 1..{len(blocks)}")
    fused, starts = coarsen_blocks(blocks, "layer", head=False)
    if len(fused) == len(blocks) or len(fused) < num_stages:
        return BASELINES[name](blocks, num_stages)
    return [(starts[i], starts[j]) for i, j in BASELINES[name](fused, num_stages)]
