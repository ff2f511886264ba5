"""Plan granularity: the head's vocabulary shards as blocks, and user-given cuts.

At ``auto`` (or ``sublayer``) granularity a profile whose head can be split
(``ModelInfo.head_split_rows``) gets its head block replaced by ``k`` shard blocks
``<head>.shard<i>ofK`` (``autopart.intake.head_split``); the solvers see them as
ordinary blocks. Their costs are **derived**, not measured: the head's F, B, W,
activation and workspace times the shard's vocabulary fraction (the head is its
vocabulary matmul and the loss over the logits, both linear in the rows), plus the
carry a shard sends on (the hidden state and two float32 values per position).
Parameters are divided by the same fraction (``num_params``, what each shard
computes with), but the runtime holds the whole head weight on every rank with a
shard, with a full-size gradient and optimizer state: the cost model counts the
head's whole weight once on each such rank (``autopart.cost``). A shard's backward
adds only its rows into that gradient (``autopart.runtime.head_shards``), which is
what the head's profiled backward (accumulating into an existing gradient) did for
all rows, so the fraction holds; what the split adds is per step: the gradient's
zero-fill when a rank first needs it (``ProfileSetup.head_grad_ms``, measured on cpu
and cuda, estimated from memory bandwidth on analytical profiles; a profile without
it gets a note; ``autopart.cost.stage_cost`` spreads it over the microbatches' F) and
the sum of the gradient over the ranks holding the weight
(``autopart.rank_cost.shared_grad_sync_ms``).
``k`` makes a shard about a quarter of the smallest decoder layer (or half-layer):
``ceil(4 * head / unit)``, within 2..64, so that stages of uneven layer halves can
still be levelled by the shards after them.

Decoder layers profiled as two halves (``profile --granularity sublayer``) stay
halves at ``auto`` and ``sublayer``. ``layer`` fuses them back and keeps the head
whole (``autopart.granularity.fuse_layers``); export targets, which cannot express
a cut inside a layer or the head, plan at ``layer`` with a note.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence

from autopart.errors import InfeasibleError, PlanError
from autopart.granularity import fuse_layers, fuse_quarters
from autopart.intake.half_slices import parse_slice
from autopart.intake.head_split import parse_shard, shard_names, vocab_range
from autopart.schema import Plan, Profile
from autopart.solve.slices import DEFAULT_SLICES, block_part, slice_halves

__all__ = ["GRANULARITY_CHOICES", "apply_granularity", "cut_bounds", "faster_of_sliced_or_whole",
           "faster_of_split_or_whole", "split_head", "splits_head"]

GRANULARITY_CHOICES = ("auto", "layer", "sublayer", "quarter", "slice")
_MAX_SHARDS = 64
SLICE_MARGIN = 0.01
"""How much faster ``auto`` must predict the sliced plan to keep it."""
_CARRY_VALUES = 2  # running log-sum-exp, target logit
_UNIT_KINDS = ("decoder_layer", "attention", "mlp")


def apply_granularity(profile: Profile, granularity: str, target: str | None,
                      shards: int | None = None, slices: int | None = None
                      ) -> tuple[Profile, list[str]]:
    """``profile`` with the blocks ``granularity`` allows, and notes for the plan.

    Args:
        profile: The profile to plan.
        granularity: ``auto`` or ``quarter`` (blocks as profiled, the head split into
            shards where the runtime can split it), ``sublayer`` (the same with the parts
            of a ``quarter`` profile's halves fused back into halves), ``slice`` (halves
            cut inside their call, ``autopart.solve.slices``, the head split) or ``layer``
            (whole blocks).
        target: An export format, or ``None``; exports plan at ``layer``.
        shards: How many vocabulary shards (default: ``num_shards``).
        slices: Slices per half at ``slice`` (default: ``slices.DEFAULT_SLICES``).

    Returns:
        The profile to plan on and one-line notes.

    Raises:
        PlanError: ``granularity`` is not one of ``GRANULARITY_CHOICES``.
    """
    if granularity not in GRANULARITY_CHOICES:
        raise PlanError(f"unknown granularity {granularity!r}; choose one of "
                        f"{', '.join(GRANULARITY_CHOICES)}")
    rows = profile.model.head_split_rows
    finer = profile.setup.granularity != "layer" or (rows and profile.blocks[-1].kind == "head")
    if granularity == "layer" or not finer:
        return fuse_layers(profile), []
    if granularity in ("sublayer", "slice"):
        profile = fuse_quarters(profile)
    if target is not None:
        return fuse_layers(profile), [f"{target} cannot express cuts inside a layer or the "
                                      f"head: planned at layer granularity"]
    notes = []
    if granularity == "slice":
        profile, notes = _sliced(profile, slices or DEFAULT_SLICES)
    if not rows or profile.blocks[-1].kind != "head":
        return profile, notes
    num = shards or num_shards(profile)
    head = profile.blocks[-1]
    grad_ms = profile.setup.head_grad_ms
    grad = (f"{grad_ms:.3g} ms, {profile.setup.time_source.split(':')[0]}" if grad_ms > 0 else
            "not in this profile: re-profile to count it")
    return split_head(profile, num), [*notes,
        f"{head.name} split into {num} vocabulary shards, costs by vocabulary fraction; every "
        f"rank with a shard holds the whole head weight ({head.num_params / 1e6:.1f}M "
        f"parameters, counted once per rank), zero-fills its gradient once per step "
        f"({grad}) and sums it with the other holders after the step"]


def _sliced(profile: Profile, num: int) -> tuple[Profile, list[str]]:
    """``profile`` with its sliceable halves in slices, and the note saying so."""
    units = profile.model.slice_units
    if not units:
        why = [n for n in profile.model.notes if "cannot be sliced" in n]
        return profile, [why[0] if why else "no half can be sliced in this profile (taken "
                         "before autopart sliced halves, or at layer granularity): re-profile "
                         "with --granularity sublayer"]
    sliced = slice_halves(profile, num)
    what = {"attention": "KV-head groups", "mlp": "column groups"}
    kinds = ", ".join(f"{k} into {min(num, u)} {what.get(k, 'parts')}"
                      for k, u in sorted(units.items()))
    return sliced, [f"halves cut inside their call: {kinds}, costs by unit fraction; a rank "
                    f"with a slice holds its half whole and sums its gradient with the other "
                    f"holder after the step"]


def splits_head(profile: Profile) -> bool:
    """Whether ``auto`` granularity splits the head of ``profile`` into shards."""
    return bool(profile.model.head_split_rows) and profile.blocks[-1].kind == "head"


def faster_of_split_or_whole(plan_on: Callable[[Profile], Plan], profile: Profile) -> Plan:
    """The faster of ``plan_on(profile)`` (head split) and the plan with the head whole.

    Every rank with a shard holds the whole weight, zero-fills its gradient once per
    step and sums it with the other holders, so on some devices the split loses:
    ``auto`` then keeps the head whole and says why.

    Args:
        plan_on: Plans a profile at ``sublayer`` granularity.
        profile: A profile whose head ``auto`` splits (``splits_head``).

    Returns:
        The plan with the faster predicted step (the split on a tie is not kept).

    Raises:
        InfeasibleError: Neither fits.
    """
    whole_profile = dataclasses.replace(
        profile, model=dataclasses.replace(profile.model, head_split_rows=0))
    split, whole = _both(lambda: plan_on(profile), lambda: plan_on(whole_profile))
    if whole is None or (split is not None and
                         split.predicted_step_ms < whole.predicted_step_ms):
        return split
    if split is None:
        return whole
    head = profile.blocks[-1].name
    return dataclasses.replace(whole, notes=(*whole.notes, (
        f"{head} kept whole: split into {num_shards(profile)} vocabulary shards the step is "
        f"predicted {split.predicted_step_ms:.1f} ms against {whole.predicted_step_ms:.1f} "
        f"ms (every rank with shards holds the whole head weight and sums its gradient)")))


def faster_of_sliced_or_whole(plan_at: Callable[[Profile, str], Plan], profile: Profile
                              ) -> Plan:
    """``auto`` on a profile with sliceable halves: the faster of the plan with the halves
    cut into slices (``slice``) and the plan with them whole (``quarter``: as profiled),
    each with the head split or whole (``faster_of_split_or_whole``).

    Args:
        plan_at: ``plan_at(profile, granularity)`` plans at a fixed granularity.
        profile: A profile with ``model.slice_units``.

    Returns:
        The sliced plan if its predicted step is ``SLICE_MARGIN`` faster, else the
        other (slice costs are derived by unit fraction, not measured: a margin).

    Raises:
        InfeasibleError: Neither fits.
    """
    def best(p: Profile, granularity: str) -> Plan:
        if splits_head(p):
            return faster_of_split_or_whole(lambda q: plan_at(q, granularity), p)
        return plan_at(p, granularity)

    whole_profile = dataclasses.replace(
        profile, model=dataclasses.replace(profile.model, slice_units={}))
    sliced, whole = _both(lambda: best(profile, "slice"), lambda: best(whole_profile, "quarter"))
    if whole is None or (sliced is not None and
                         sliced.predicted_step_ms < (1 - SLICE_MARGIN) * whole.predicted_step_ms):
        return sliced
    if sliced is None:
        return whole
    return dataclasses.replace(whole, notes=(*whole.notes, (
        f"halves kept whole: with halves cut into slices the step is predicted "
        f"{sliced.predicted_step_ms:.1f} ms against {whole.predicted_step_ms:.1f} ms, not "
        f"{SLICE_MARGIN:.0%} faster (slice costs are the half's by unit fraction; "
        f"--granularity slice keeps them)")))


def _both(finer: Callable[[], Plan], coarser: Callable[[], Plan]
          ) -> tuple[Plan | None, Plan | None]:
    """Both plans, ``None`` for one that does not fit; the coarser one alone is planned
    (and raises ``InfeasibleError``) when the finer one does not fit."""
    try:
        fine = finer()
    except InfeasibleError:
        return None, coarser()
    try:
        return fine, coarser()
    except InfeasibleError:
        return fine, None


def num_shards(profile: Profile) -> int:
    """``ceil(4 * head / unit)`` within 2..64 (``unit``: the cheapest layer or half-layer)."""
    head = profile.blocks[-1]
    units = [b.fwd_ms + b.bwd_ms for b in profile.blocks if b.kind in _UNIT_KINDS]
    units = [u for u in units if u > 0] or [b.fwd_ms + b.bwd_ms for b in profile.blocks[:-1]]
    unit = min((u for u in units if u > 0), default=0.0)
    cost = head.fwd_ms + head.bwd_ms
    num = math.ceil(4 * cost / unit) if unit > 0 else 2
    return max(2, min(_MAX_SHARDS, num, profile.model.head_split_rows))


def split_head(profile: Profile, num: int) -> Profile:
    """``profile`` with its head block replaced by ``num`` shard blocks (module docstring)."""
    head = profile.blocks[-1]
    rows = profile.model.head_split_rows
    setup = profile.setup
    carry = _CARRY_VALUES * 4 * setup.micro_batch_size * max(setup.seq_len - 1, 1)
    hidden = profile.blocks[-2].output_bytes if len(profile.blocks) > 1 else 0
    shards = [block_part(head, *vocab_range(i, num, rows), rows, name=name,
                         output_bytes=head.output_bytes if i == num - 1 else hidden + carry,
                         adopted=False)
              for i, name in enumerate(shard_names(head.name, num))]
    return dataclasses.replace(profile, blocks=(*profile.blocks[:-1], *shards))


def cut_bounds(profile: Profile, cuts: Sequence[str], pp_size: int,
               virtual_stages: int | str) -> tuple[tuple[tuple[int, int], ...], int]:
    """Stage bounds and v of a split given as ``pipeline_cuts`` (last block of each stage
    but the final one).

    Raises:
        PlanError: a name is not a block of ``profile``, the names are not in model
            order, or their count is not ``pp_size * v - 1``.
    """
    names = [b.name for b in profile.blocks]
    index = {name: i for i, name in enumerate(names)}
    for cut in cuts:
        if cut not in index:
            hint = ("; head shards exist only at --granularity auto or sublayer, and all "
                    "shard names must agree on K" if parse_shard(cut) else
                    "; half slices exist only where the profile offers them (slice_units), "
                    "of <= 64 and at most the half's units, and all slice names must agree "
                    "on K (attention halves get min(K, KV heads))" if parse_slice(cut) else "")
            raise PlanError(f"--cuts names {cut!r}, which is not a block of the profile "
                            f"(blocks: {names[0]} .. {names[-1]}){hint}; use block names "
                            f"from `autopart plan` or the profile")
    positions = [index[c] for c in cuts]
    for a, b in zip(positions, positions[1:]):
        if b <= a:
            raise PlanError(f"--cuts must follow model order: {names[b]!r} comes after "
                            f"{names[a]!r}; list the cuts from the first block to the last")
    if positions and positions[-1] == len(names) - 1:
        raise PlanError(f"--cuts ends with the last block {names[-1]!r}; a cut ends a stage "
                        f"that has a stage after it")
    count = len(cuts) + 1
    if virtual_stages == "auto":
        virtual = count // pp_size
        if count % pp_size:
            raise PlanError(f"--cuts gives {len(cuts)} cut(s) ({count} stages), expected "
                            f"pp * v - 1 ({pp_size - 1}, {2 * pp_size - 1}, ... for pp "
                            f"{pp_size}); give pp * v - 1 names")
    elif count != pp_size * virtual_stages:
        raise PlanError(f"--cuts gives {len(cuts)} cut(s) ({count} stages), expected pp * v "
                        f"- 1 = {pp_size * virtual_stages - 1} for pp {pp_size}, v "
                        f"{virtual_stages}; give pp * v - 1 names")
    else:
        virtual = virtual_stages
    starts = [0, *(p + 1 for p in positions), len(names)]
    return tuple(zip(starts[:-1], starts[1:])), virtual
