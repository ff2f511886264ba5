"""The levels of cut as one rule over typed parts: coarsen what was measured, derive the rest.

A profile holds blocks at the finest level intake found exact (``ProfileSetup.granularity``:
``layer``, ``half`` or ``projection``), each part of a module's call saying so
(``BlockProfile.parts``). A level (``autopart.schema.parts.LEVELS``) says which parts may
end a stage (``cuttable``); every other run of parts is fused back into its module
(``coarsen``, with the one formula ``fuse``). The ``slice`` level cuts each half into
parts along ``units`` and the head may be cut along ``vocab`` at any level: those parts are
derived from the measured block by their share of its units (``part_of``, the one
formula that splits), since the block is a sum over them:

- a half's module ``P`` sums over its KV-head groups or MLP columns
  (``autopart.intake.slice_rules``); a cut after a slice that is not the last sends three
  hidden states: ``P``'s input, the residual beside it and the partial sum;
- the head's logits and loss are linear in its vocabulary rows; a cut after a shard sends
  the hidden state and two float32 values per position (running log-sum-exp, target
  logit). A shard keeps no weight gradient in its workspace: the runtime adds its rows
  into one dense gradient per rank, zero-filled once per step (``ProfileSetup.head_grad_ms``).
  Their memory is not the measured head's (the model's own loss) but the runtime's
  sliced loss, computed from the shapes (``_sliced_loss_bytes``).

Fusing and deriving keep totals: the parts of a block sum to it (integers rounded at both
ends), and fusing a level's parts gives back the coarser block.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

from autopart.schema import DTYPE_BYTES, BlockProfile, Part, Profile
from autopart.schema.parts import LEVELS, derived_name

__all__ = ["MAX_SLICES", "at_level", "coarsen", "coarsen_blocks", "fuse", "num_shards",
           "stage_ends"]

DEFAULT_SLICES = 4
"""Slices per half at the ``slice`` level: a quarter of a half is finer than the
projection level's coarsest piece (the MLP up to its output projection, over half a layer)."""
MAX_SLICES = 64
"""The most slices per half a cut name may ask for."""
MAX_SHARDS = 64
"""The most vocabulary shards of the head."""
CROSSING_TENSORS = 3
"""Hidden-state tensors crossing a cut inside a half's call by units (module docstring)."""
_CARRY_VALUES = 2
"""float32 values per position a head shard sends on beside the hidden state."""
_UNIT_KINDS = ("decoder_layer", "attention", "mlp")


def cuttable(part: Part, depth: int, level: str, *, head: bool = True) -> bool:
    """May a stage end inside ``part``'s module call at ``level``?

    Args:
        part: One of a block's parts.
        depth: Its position in the block's parts (0: the outermost).
        level: A level of ``LEVELS``.
        head: Whether parts of the head along ``vocab`` may end a stage.

    Returns:
        ``calls`` parts of a layer (its halves) from ``half`` on, the ones inside a half
        (before its output projection) at ``projection``; ``units`` parts at ``slice``;
        ``vocab`` parts when ``head``.
    """
    if part.axis == "vocab":
        return head
    if part.axis == "units":
        return level == "slice"
    if depth == 0:
        return level != "layer"
    return level == "projection"


def stage_ends(blocks: Sequence[BlockProfile], level: str, *, head: bool = True) -> list[bool]:
    """``ends[j]``: may a stage end after block ``j - 1`` at ``level``? (positions ``0..n``).

    A cut after a block falls inside the call of every part of it that is not its module's
    last; it is allowed when all of those are ``cuttable``.
    """
    ends = [True] * (len(blocks) + 1)
    for j in range(1, len(blocks)):
        ends[j] = all(p.last or cuttable(p, d, level, head=head)
                      for d, p in enumerate(blocks[j - 1].parts))
    return ends


def fuse(blocks: Sequence[BlockProfile], *, name: str | None = None, kind: str | None = None,
         parts: tuple[Part, ...] | None = None, modules: tuple[str, ...] | None = None,
         class_name: str | None = None) -> BlockProfile:
    """One block that runs ``blocks`` one after another (the one formula that fuses).

    Times, parameters and saved activations add up; the output is the last block's; the
    workspace is the largest, and its weight-gradient share is what the largest
    gradient-free workspace leaves of it; the glue and stand-in costs add up, the walk
    is the first block's (a stage starting there starts there). Identity fields default
    to the last block's, the parts to those all of ``blocks`` share (a run of all parts
    of a module is that module).

    Args:
        blocks: Consecutive blocks (one is returned as is when no field is given).
        name, kind, parts, modules, class_name: The fused block's, if not the default.

    Returns:
        The fused block (``measured`` of the first, ``reused_from`` unset).
    """
    last = blocks[-1]
    given = {"name": name, "kind": kind, "parts": parts, "modules": modules,
             "class_name": class_name}
    given = {k: v for k, v in given.items() if v is not None}
    if len(blocks) == 1:
        return dataclasses.replace(last, **given) if given else last

    def total(field: str) -> float:
        return sum(getattr(b, field) for b in blocks)

    if parts is None:
        shared = 0
        while all(len(b.parts) > shared and b.parts[shared] == last.parts[shared]
                  for b in blocks):
            shared += 1
        given["parts"] = last.parts[:shared]
    work = max(b.transient_bytes for b in blocks)
    return dataclasses.replace(
        last, fwd_ms=total("fwd_ms"), bwd_ms=total("bwd_ms"),
        bwd_input_ms=total("bwd_input_ms"), bwd_weight_ms=total("bwd_weight_ms"),
        split_extra_ms=total("split_extra_ms"),
        param_bytes=int(total("param_bytes")), num_params=int(total("num_params")),
        activation_bytes=int(total("activation_bytes")),
        glue_saved_bytes=int(total("glue_saved_bytes")),
        held_for_weight_bytes=int(total("held_for_weight_bytes")), transient_bytes=work,
        adopted_grad_bytes=work - max(b.transient_bytes - b.adopted_grad_bytes for b in blocks),
        fwd_ms_spread=max(b.fwd_ms_spread for b in blocks),
        bwd_ms_spread=max(b.bwd_ms_spread for b in blocks), measured=blocks[0].measured,
        compile_ms=total("compile_ms"), noisy=any(b.noisy for b in blocks),
        num_measurements=max(b.num_measurements for b in blocks),
        expert_load=next((b.expert_load for b in blocks if b.expert_load), ()),
        glue_after_ms=total("glue_after_ms"), stand_in_ms=total("stand_in_ms"),
        walk_ms=blocks[0].walk_ms, reused_from=None, **given)


def part_of(block: BlockProfile, part: Part, units: int, *, output_bytes: int,
            adopted: bool = True) -> BlockProfile:
    """``block``'s share of ``units`` that ``part`` covers (the one formula that splits).

    Part ``i`` of ``k`` covers units ``[i * U // k, (i + 1) * U // k)``: times, saved
    activations, workspace and parameters by that fraction (integers rounded at both
    ends, so the parts sum to the block); the glue after the module's call and its
    stand-in go to the last part, the walk to its call to every part.

    Args:
        block: The measured block (a half, the head).
        part: The derived part (``units`` or ``vocab``) of ``block``'s module.
        units: ``U``, the units the module sums over (KV heads, MLP columns, rows).
        output_bytes: What crosses a cut after this part.
        adopted: Keep the weight gradients' share of the workspace (``False`` for head
            shards, whose rows add into one dense gradient).

    Returns:
        The part's block, named ``derived_name(...)``, with ``part`` after the block's parts.
    """
    lo, hi = part.index * units // part.count, (part.index + 1) * units // part.count

    def share(value: int) -> int:
        return round(value * hi / units) - round(value * lo / units)

    frac = (hi - lo) / units
    last = part.index == part.count - 1
    return dataclasses.replace(
        block, name=derived_name(part.module, part.axis, part.index, part.count),
        parts=(*block.parts, part), fwd_ms=block.fwd_ms * frac, bwd_ms=block.bwd_ms * frac,
        bwd_input_ms=block.bwd_input_ms * frac, bwd_weight_ms=block.bwd_weight_ms * frac,
        split_extra_ms=block.split_extra_ms * frac,
        activation_bytes=share(block.activation_bytes),
        glue_saved_bytes=share(block.glue_saved_bytes),
        held_for_weight_bytes=share(block.held_for_weight_bytes),
        adopted_grad_bytes=min(share(block.adopted_grad_bytes), share(block.transient_bytes))
        if adopted else 0,
        transient_bytes=share(block.transient_bytes), output_bytes=output_bytes,
        param_bytes=share(block.param_bytes), num_params=share(block.num_params),
        # a stage ending at an earlier part stops inside the module's call: the code
        # after the call, and standing in for the call, belong to the last part
        glue_after_ms=block.glue_after_ms if last else 0.0,
        stand_in_ms=block.stand_in_ms if last else 0.0,
        measured=(), reused_from=None)


def coarsen(profile: Profile, level: str, *, head: bool = True) -> Profile:
    """``profile`` with every run of parts that ``level`` does not cut fused into its module.

    Args:
        profile: Any profile.
        level: A level coarser than or equal to the profile's (``slice`` coarsens to
            ``half``: its parts are derived, ``slice_halves``).
        head: Keep the head's vocabulary parts (else they are fused into the head).

    Returns:
        The profile at ``level`` (itself when nothing fuses), ``setup.granularity`` set.
    """
    if level not in LEVELS:
        raise ValueError(f"unknown level {level!r}")
    classes = profile.model.layer_classes
    blocks, _ = coarsen_blocks(profile.blocks, level, head=head,
                               layer_class=classes[0] if len(classes) == 1 else "")
    kept = "half" if level == "slice" else level
    granularity = min(kept, profile.setup.granularity, key=LEVELS.index)
    setup = dataclasses.replace(profile.setup, granularity=granularity)
    return dataclasses.replace(profile, blocks=tuple(blocks), setup=setup)


def coarsen_blocks(blocks: Sequence[BlockProfile], level: str, *, head: bool = True,
                   layer_class: str = "") -> tuple[list[BlockProfile], list[int]]:
    """``coarsen`` on a chain of blocks: the fused blocks and the position of each one's
    first block (plus ``n``); ``layer_class`` names a fused decoder layer's class."""
    ends = stage_ends(blocks, level, head=head)
    starts = [j for j in range(len(blocks)) if ends[j]] + [len(blocks)]
    runs = [blocks[i:j] for i, j in zip(starts, starts[1:])]
    if len(runs) == len(blocks):
        return list(blocks), starts
    fused = [_fuse_run(run, level, head, layer_class) for run in runs]
    named = {b.name: f.name for run, f in zip(runs, fused) for b in run}
    return [dataclasses.replace(f, reused_from=_twin(run, named, f.name))
            if len(run) > 1 else f for run, f in zip(runs, fused)], starts


def _fuse_run(run: Sequence[BlockProfile], level: str, head: bool, layer_class: str
              ) -> BlockProfile:
    """The block of a run of parts: the outermost module whose call the run covers whole."""
    if len(run) == 1:
        return run[0]
    first = run[0]
    depth = next(d for d, p in enumerate(first.parts) if not cuttable(p, d, level, head=head))
    module = first.parts[depth].module
    inside = module + "."
    modules = list(dict.fromkeys(module if f == module or f.startswith(inside) else f
                                 for b in run for f in (b.modules or (b.name,))))
    layer = depth == 0 and first.parts[0].axis == "calls"
    return fuse(run, name=modules[-1], kind="decoder_layer" if layer else first.kind,
                parts=first.parts[:depth], modules=tuple(modules) if len(modules) > 1 else (),
                class_name=layer_class if layer else "")


def _twin(run: Sequence[BlockProfile], named: dict[str, str], name: str) -> str | None:
    """The fused block every part of ``run`` was reused from, if one (and not itself)."""
    twins = {named.get(b.reused_from) if b.reused_from else None for b in run}
    twin = next(iter(twins)) if len(twins) == 1 else None
    return twin if twin != name else None


def slice_halves(profile: Profile, count: int = DEFAULT_SLICES) -> Profile:
    """``profile`` (at ``half``) with every half whose kind the profile offers to slice
    (``ModelInfo.slice_units``) cut into ``min(count, units)`` parts along ``units``.

    Returns:
        The profile at the ``slice`` level (itself when nothing slices).
    """
    units = profile.model.slice_units
    relative = profile.model.slice_modules
    blocks: list[BlockProfile] = []
    for i, block in enumerate(profile.blocks):
        if block.kind not in units or len(block.parts) != 1 or i == 0:
            blocks.append(block)
            continue
        num = min(count, units[block.kind])
        module = f"{block.layer}.{relative[block.kind]}" if block.kind in relative else block.name
        hidden = profile.blocks[i - 1].output_bytes
        blocks.extend(part_of(block, Part(module=module, axis="units", index=k, count=num),
                              units[block.kind], output_bytes=block.output_bytes
                              if k == num - 1 else CROSSING_TENSORS * hidden)
                      for k in range(num))
    if len(blocks) == len(profile.blocks):
        return profile
    setup = dataclasses.replace(profile.setup, granularity="slice")
    return dataclasses.replace(profile, blocks=tuple(blocks), setup=setup)


def num_shards(profile: Profile) -> int:
    """Default vocabulary shards of the head: about a quarter of the cheapest layer or half
    each, ``ceil(4 * head / unit)`` within 2..``MAX_SHARDS`` (and the head's rows), so that
    stages of uneven halves can still be levelled by the shards after them."""
    head = profile.blocks[-1]
    units = [b.fwd_ms + b.bwd_ms for b in profile.blocks if b.kind in _UNIT_KINDS]
    units = [u for u in units if u > 0] or [b.fwd_ms + b.bwd_ms for b in profile.blocks[:-1]]
    unit = min((u for u in units if u > 0), default=0.0)
    num = math.ceil(4 * (head.fwd_ms + head.bwd_ms) / unit) if unit > 0 else 2
    return max(2, min(MAX_SHARDS, num, profile.model.head_split_rows))


def split_head(profile: Profile, count: int) -> Profile:
    """``profile`` with its head cut into ``count`` parts along ``vocab`` (module docstring);
    itself when the head cannot be split (``ModelInfo.head_split_rows`` 0) or ``count`` < 2."""
    rows = profile.model.head_split_rows
    head = profile.blocks[-1]
    if count < 2 or not rows or head.kind != "head" or head.parts or len(profile.blocks) < 2:
        return profile
    setup = profile.setup
    positions = setup.micro_batch_size * max(setup.seq_len - 1, 1)
    carry = _CARRY_VALUES * 4 * positions
    hidden = profile.blocks[-2].output_bytes
    count = min(count, rows)
    per_token = hidden // max(setup.seq_len * setup.micro_batch_size, 1)
    sliced = _sliced_loss_bytes(rows, positions, setup.dtype, per_token)
    # what the model's code after the head saves, each slice repeats on its rows
    sliced["activation_bytes"] += head.glue_saved_bytes
    head = dataclasses.replace(head, **sliced,
                               **_sliced_loss_times(head, setup.head_slice_fwd_ratio,
                                                    setup.head_slice_bwd_ratio))
    shards = [part_of(head, Part(module=head.name, axis="vocab", index=k, count=count), rows,
                      output_bytes=head.output_bytes if k == count - 1 else hidden + carry,
                      adopted=False)
              for k in range(count)]
    return dataclasses.replace(profile, blocks=(*profile.blocks[:-1], *shards))


def _sliced_loss_bytes(rows: int, positions: int, dtype: str,
                       token_bytes: int) -> dict[str, int]:
    """The memory of the whole head run as the runtime runs its shards, from the shapes.

    The profile measured the head with the model's own loss (cross entropy over the
    logits, upcast to float32 in HF); shards run ``head_shards._SliceLoss`` instead. Per
    microbatch a slice holds its ``log_softmax`` (``L``: positions x rows); its backward
    makes the softmax in one buffer (``L`` more; the saved one is freed when it returns),
    then, while that buffer lives, the rows' weight gradient (``R``: rows x hidden, the
    values ``_Rows`` hands on before autograd adds them into the dense gradient) and the
    input's (``g``): workspace ``max(L, R + g)`` above what is held (checked with
    ``profile.memory.LiveTensors``: 4.06 MiB for L = R = 4 MiB, g = 64 KiB). Shards take
    their share of both (``part_of``)."""
    size = DTYPE_BYTES[dtype]
    hidden = max(token_bytes // size, 1)
    logits = positions * rows * size
    return {"activation_bytes": logits,
            "transient_bytes": max(logits, (rows + positions) * hidden * size)}


def _sliced_loss_times(head: BlockProfile, fwd_ratio: float, bwd_ratio: float
                       ) -> dict[str, float]:
    """The head's times run as the shards run it: scaled by the sliced loss's measured
    ratios to the model's own (``ProfileSetup.head_slice_fwd_ratio``; 0: unchanged)."""
    fwd, bwd = fwd_ratio or 1.0, bwd_ratio or 1.0
    return {"fwd_ms": head.fwd_ms * fwd, "bwd_ms": head.bwd_ms * bwd,
            "bwd_input_ms": head.bwd_input_ms * bwd, "bwd_weight_ms": head.bwd_weight_ms * bwd,
            "split_extra_ms": head.split_extra_ms * bwd}


def at_level(profile: Profile, level: str, head_shards: int = 0,
             slices: int = DEFAULT_SLICES) -> Profile:
    """``profile``'s blocks at ``level`` with the head in ``head_shards`` parts (0: whole).

    Args:
        profile: A profile as measured (any level).
        level: A level of ``LEVELS``; finer than the profile's, its measured parts are
            not there and the profile's own level is what comes out.
        head_shards: Vocabulary parts of the head (0 or 1: whole).
        slices: Parts per half at ``slice``.

    Returns:
        The profile to plan on.
    """
    out = coarsen(profile, level, head=False)
    if level == "slice":
        out = slice_halves(out, slices)
    return split_head(out, head_shards)
