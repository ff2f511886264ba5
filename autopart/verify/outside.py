"""The model's code outside a stage's blocks, as a pipeline run measured it.

Every stage runs the model's own forward with its blocks and stand-ins for the blocks of
the stages before it (``autopart.runtime.stages``): the model's code before the first
block and between blocks (``ProfileSetup.glue_fwd_ms``, ``BlockProfile.glue_after_ms``)
and each earlier block's stand-in (``BlockProfile.stand_in_ms``). The profile times that
code on its own; inside a pipeline's stage it runs slower (a tiny SmolLM3's last stage
spent 1.5 ms before its first block where 1.0 was predicted, its first stage 0.6 where
0.4 was). Folding that excess into the stage's block factors, as calibration did before,
charges it to the blocks: a plan that cuts elsewhere then carries the last stage's
factor onto blocks that run first on a stage, and the excess onto a stage with fewer
stand-ins.

``fit_outside_scale`` fits one factor for that code from a run's per-block rows
(``RunReport.blocks``, whose ``(outside blocks)`` row is a stage's forward before its
first block starts): the measured excess before the first blocks over the stages'
glue and stand-ins before them. ``scaled_outside`` applies it to a profile's glue,
stand-ins and walks into split halves (the parent's code run on meta up to a stage's
first block: Python of the same kind), so every stage of every plan pays it in
proportion to the code it runs.
"""

from __future__ import annotations

import dataclasses

from autopart.schema import Profile
from autopart.verify.coverage import stage_blocks, stage_rows
from autopart.verify.instrument import BlockTimer
from autopart.verify.report import RunReport, StageReport

__all__ = ["OUTSIDE_SCALE_RANGE", "block_shares", "fit_outside_scale", "fit_slice_cost",
           "lead_ms", "scaled_outside"]

OUTSIDE_SCALE_RANGE = (0.5, 4.0)
"""The factors a fit may give; outside it the rows measure something else (a stage
descheduled before its first block), and the fit is clipped."""

MIN_LEAD_MS = 0.05
"""Below this much glue and stand-ins before the stages' first blocks (summed over the
stages) the rows cannot tell a factor from the action's own noise: no fit."""


def lead_ms(profile: Profile, first: int) -> float:
    """The model's code a stage whose first block is ``first`` runs before it: the code
    before the model's first block, every earlier block's code after it and stand-in,
    and starting inside a split half's call, the parent's code on meta up to it
    (``BlockProfile.walk_ms``); none for a stage starting inside the head, after its
    first vocabulary part."""
    blocks = profile.blocks
    if first > 0 and _vocab_part(profile, first) and _vocab_part(profile, first - 1):
        return 0.0
    after = sum(b.glue_after_ms for b in blocks)
    lead = max(profile.setup.glue_fwd_ms - after, 0.0) + blocks[first].walk_ms
    return lead + sum(b.glue_after_ms + b.stand_in_ms for b in blocks[:first])


def fit_outside_scale(profile: Profile, report: RunReport) -> tuple[float, dict[int, float]]:
    """The factor by which the run's stages ran their glue and stand-ins over the profile.

    Per stage, the excess is the measured forward before its first block less the one
    predicted (the stage's predicted F less its blocks' F as priced, head shards with the
    sliced loss's fixed cost, and the code after them, as ``autopart.verify.attribution``
    splits it); the factor is 1 + the summed excess over
    the summed glue and stand-ins before the stages' first blocks (``lead_ms``),
    clipped to ``OUTSIDE_SCALE_RANGE``.

    Args:
        profile: The profile the plan was made from.
        report: The run report, with per-block rows (``RunReport.blocks``).

    Returns:
        The factor (1.0 where the report has no per-block rows or too little such code,
        ``MIN_LEAD_MS``), and per stage the F the factor adds to its prediction: its
        lead and its own blocks' code after them, times the factor less 1.
    """
    measured = {b.stage: b.measured_fwd_ms for b in report.blocks
                if b.block == BlockTimer.OUTSIDE}
    excess, lead, code = 0.0, 0.0, {}
    for stage in report.stages:
        covered = stage_blocks(profile, report, stage)
        if stage.index not in measured or not covered:
            return 1.0, {}
        own_after = sum(w * profile.blocks[i].glue_after_ms for i, w in covered)
        rows = stage_rows(profile, report, stage)
        own = sum(row.fwd_ms for row in rows) + own_after + (
            profile.setup.head_slice_fwd_ms if any(row.shards for row in rows) else 0.0)
        stage_lead = lead_ms(profile, min(i for i, _ in covered))
        excess += measured[stage.index] - max(stage.predicted_fwd_ms - own, 0.0)
        lead += stage_lead
        code[stage.index] = stage_lead + own_after
    if lead < MIN_LEAD_MS:
        return 1.0, {}
    low, high = OUTSIDE_SCALE_RANGE
    scale = min(max(1.0 + excess / lead, low), high)
    return scale, {s: (scale - 1.0) * ms for s, ms in code.items()}


def scaled_outside(profile: Profile, scale: float) -> Profile:
    """``profile`` with its glue (before the first block, after each), stand-ins and
    walks into split halves times ``scale``."""
    if scale == 1.0:
        return profile
    blocks = tuple(dataclasses.replace(b, glue_after_ms=round(b.glue_after_ms * scale, 4),
                                       stand_in_ms=round(b.stand_in_ms * scale, 4),
                                       walk_ms=round(b.walk_ms * scale, 4))
                   for b in profile.blocks)
    setup = dataclasses.replace(profile.setup,
                                glue_fwd_ms=round(profile.setup.glue_fwd_ms * scale, 4))
    return dataclasses.replace(profile, blocks=blocks, setup=setup)


def block_shares(profile: Profile, report: RunReport, stage: StageReport) -> dict[int, float]:
    """How fast each block of ``stage`` ran against its profile, relative to the stage's
    blocks together, from the run's per-block rows.

    A row (a block, or all parts of one module) runs from its start to the next row's, so
    it holds the block's forward and the model's code after it (as ``profile`` prices it,
    scaled by ``fit_outside_scale``); its blocks ran (row - that code) / their profiled
    forward. A row of head shards ran the runtime's sliced loss, not the head the profile
    measured, so it says nothing of the head's own speed (read as the head's, a rehearsal
    cut inside the head priced a whole head at 1.97 ms where it ran 1.06 on tiny-llama):
    what it measures beyond its price is the sliced loss's (``fit_slice_cost``). Blocks
    without a row (a head in shards, a stage starting inside the head) run at the
    stage's mean. The shares are normalized so that the stage's blocks keep their
    profiled forward in sum: the stage's factor (``calibrate_profile``) sets the stage's
    total, the shares only divide it, so a plan that moves a block to another stage
    takes the block's own speed along, not the factor of the stage it left (the
    heavy-head Llama's layers, run beside its head, took the head's factor).

    Args:
        profile: The profile, with the outside scale applied (``scaled_outside``).
        report: The run report, with per-block rows.
        stage: One of ``report.stages``.

    Returns:
        Block index -> its share (1.0 everywhere without rows).
    """
    measured = _measured(report, stage)
    speed: dict[int, float] = {}
    covered: list[tuple[int, float]] = []
    for row in stage_rows(profile, report, stage):
        covered += row.blocks
        ran = measured.get(row.name, 0.0) - row.glue_ms
        if not row.shards and row.fwd_ms > 0 and ran > 0:
            speed.update({i: ran / row.fwd_ms for i, _ in row.blocks})
    timed = sum(w * profile.blocks[i].fwd_ms for i, w in covered if i in speed)
    if timed <= 0:
        return {i: 1.0 for i, _ in covered}
    mean = sum(w * profile.blocks[i].fwd_ms * speed[i] for i, w in covered if i in speed) \
        / timed  # the stage's blocks ran mean x their forward: each share is its own / that
    return {i: speed.get(i, mean) / mean for i, _ in covered}


def fit_slice_cost(profile: Profile, report: RunReport
                   ) -> tuple[float, float, dict[int, float]]:
    """The sliced loss as a run's rows of head shards measured it: its fixed forward cost
    per call (``ProfileSetup.head_slice_fwd_ms``) and its cost per row
    (``head_slice_fwd_ratio``), both scaled by how much slower than priced it ran.

    A stage's shards run as one slice, one row (``BlockTimer``). Priced at the speed the
    stage's other rows ran (their measured forward over their profiled one, summed), the
    row is the shards' share of the head's forward times the sliced loss's ratio, plus
    the slice's fixed cost (``coverage.sliced_loss``); the row's measured forward, less
    the code after the head, over that price is the sliced loss's scale. Where every
    stage with shards runs other blocks too (the rehearsal's even split: all of them on
    its last stage), their mean scale, at least 0.05, multiplies both the fixed cost and
    the cost per row; a stage of shards alone has no speed to price them at, and the
    sliced loss is then left as it is. Without it, a rehearsal whose even split cut the
    head into shards read the sliced loss's cost as the head's own, and a plan with the
    head whole paid it. One slice of every row cannot tell a fixed cost from a cost per
    row; through r35 the whole excess went to the fixed cost, which a stage pays per
    call: the heavy-head Llama's rehearsal read 4.96 ms per call where the sliced loss
    alone costs about 0.5 ms on its 32768 x 256 head (fitted over an eighth to all of
    its rows), and a plan with the shards on two stages paid it twice (its Interleaved
    plan predicted 11-20% slow in r32-r35, the shard stages' forwards 15-40%).

    Args:
        profile: The profile, with the outside scale applied (``scaled_outside``).
        report: The run report, with per-block rows.

    Returns:
        The fitted fixed cost and the scale of the cost per row (the profile's and 1.0
        where they cannot be fitted), and per stage with shards the F the change adds to
        its prediction (the fixed cost once, and its shards' share of the head).
    """
    before = profile.setup.head_slice_fwd_ms
    scales, shares = [], {}
    for stage in report.stages:
        measured = _measured(report, stage)
        rows = stage_rows(profile, report, stage)
        shards = [row for row in rows if row.shards]
        if not shards:
            continue
        others = [row for row in rows if not row.shards and row.name in measured
                  and row.fwd_ms > 0]
        ran = sum(measured[row.name] - row.glue_ms for row in others)
        priced = sum(row.fwd_ms for row in others)
        head = shards[0]
        if head.name not in measured or ran <= 0 or priced <= 0 or head.fwd_ms + before <= 0:
            return before, 1.0, {}  # a stage that runs only shards: no speed to price them
        shares[stage.index] = head.fwd_ms
        scales.append((measured[head.name] - head.glue_ms) / ((head.fwd_ms + before)
                                                              * ran / priced))
    if not scales:
        return before, 1.0, {}
    scale = max(sum(scales) / len(scales), 0.05)
    after = round(before * scale, 4)
    return after, scale, {s: after - before + (scale - 1) * share
                          for s, share in shares.items()}


def _measured(report: RunReport, stage: StageReport) -> dict[str, float]:
    """The run's forward of each row of ``stage`` (``RunReport.blocks``)."""
    return {b.block: b.measured_fwd_ms for b in report.blocks if b.stage == stage.index}


def _vocab_part(profile: Profile, index: int) -> bool:
    parts = profile.blocks[index].parts
    return bool(parts) and parts[-1].axis == "vocab"
