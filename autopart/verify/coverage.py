"""Which of a profile's blocks each block of a run's stages ran.

A plan's stages name blocks as the planner made them: a profile block itself, a part of
a module's call (a slice of a split half, a shard of the head) or a block fused from
parts (a layer, a half). Calibration and the verify report's attribution put a run's
measurements on the profile's blocks through these.
"""

from __future__ import annotations

from dataclasses import dataclass

from autopart.schema import Part, Profile
from autopart.verify.instrument import block_module_name
from autopart.verify.report import RunReport, StageReport

__all__ = ["Row", "covered_blocks", "named_blocks", "priced_times", "sliced_loss", "stage_blocks",
           "stage_rows", "vocab_part"]


def covered_blocks(profile: Profile, name: str, parts: tuple[Part, ...]) -> list[int]:
    """Indices of the profile's blocks a planned block ran: itself; a part of a module's
    call (a slice of a half, a shard of the head) runs its share of the blocks of that half
    or head; a block fused from parts (a layer, a half) runs all of them."""
    blocks = profile.blocks
    direct = [i for i, b in enumerate(blocks) if b.name == name]
    if direct:
        return direct
    prefix = parts[:-1] if parts and parts[-1].derived else parts
    if prefix:
        return [i for i, b in enumerate(blocks) if b.parts[:len(prefix)] == prefix]
    module = parts[-1].module if parts else name
    return [i for i, b in enumerate(blocks)
            if b.name == module or (b.parts and b.parts[0].module == module)]


def stage_blocks(profile: Profile, report: RunReport,
                 stage: StageReport) -> list[tuple[int, float]]:
    """``(block index, weight)`` of every profile block ``stage`` ran: a part of a module's
    call derived by count (a head shard, a unit slice) runs ``1 / count`` of each of the
    module's blocks, anything else all of them."""
    return [c for name in stage.modules for c in named_blocks(profile, report, name)]


def named_blocks(profile: Profile, report: RunReport, name: str) -> list[tuple[int, float]]:
    """``(block index, weight)`` of every profile block the run's block ``name`` ran
    (``stage_blocks``' rule for one block of a stage)."""
    parts = tuple(report.parts.get(name, ()))
    weight = 1 / parts[-1].count if parts and parts[-1].derived else 1.0
    return [(i, weight) for i in covered_blocks(profile, name, parts)]


def vocab_part(report: RunReport, name: str) -> bool:
    """Whether the run's block ``name`` is a vocabulary shard of the head."""
    parts = report.parts.get(name) or ()
    return bool(parts) and parts[-1].derived and parts[-1].axis == "vocab"


def sliced_loss(profile: Profile, report: RunReport, name: str) -> tuple[float, float, float]:
    """``(forward scale, backward scale, fixed forward ms)`` of the run's block ``name``
    against its profile blocks, as the cost model prices it (``levels.split_head``,
    ``cost.stage``): a vocabulary part of the head runs the runtime's sliced loss, its
    share of the head's times scaled by ``ProfileSetup.head_slice_fwd_ratio`` and
    ``head_slice_bwd_ratio``, and a stage's parts together (one slice) pay
    ``head_slice_fwd_ms`` once per microbatch; anything else ``(1, 1, 0)``."""
    if vocab_part(report, name):
        setup = profile.setup
        return (setup.head_slice_fwd_ratio or 1.0, setup.head_slice_bwd_ratio or 1.0,
                setup.head_slice_fwd_ms)
    return 1.0, 1.0, 0.0


def priced_times(profile: Profile, report: RunReport, stage: StageReport) -> dict[str, float]:
    """The forward, B and W of ``stage``'s blocks as the cost model priced them: their
    profiled times, head shards' scaled by the sliced loss's ratios
    (``sliced_loss``), so that a stage factor scales the blocks as the plan
    prices them."""
    own = dict.fromkeys(("fwd", "bwd_input", "bwd_weight"), 0.0)
    for name in stage.modules:
        fwd, bwd, _ = sliced_loss(profile, report, name)
        for i, w in named_blocks(profile, report, name):
            block = profile.blocks[i]
            own["fwd"] += w * fwd * block.fwd_ms
            own["bwd_input"] += w * bwd * block.bwd_input_ms
            own["bwd_weight"] += w * bwd * block.bwd_weight_ms
    return own


@dataclass(frozen=True, slots=True)
class Row:
    """One row of a stage's forward (``BlockTimer``) as the cost model prices it."""

    name: str
    blocks: list[tuple[int, float]]
    """``(profile block, weight)`` it ran (``coverage.named_blocks``)."""
    fwd_ms: float
    """Its blocks' forward; head shards scaled by the sliced loss's ratio."""
    glue_ms: float
    """The model's code after its blocks."""
    shards: bool
    """Vocabulary shards of the head: the sliced loss, its fixed cost once per stage."""


def stage_rows(profile: Profile, report: RunReport, stage: StageReport) -> list[Row]:
    """The rows of ``stage``'s forward as the run timed them (``BlockTimer``: a module's
    parts, a head's shards, as one row), each priced as the cost model prices it."""
    rows: dict[str, Row] = {}
    for name in stage.modules:
        scale, _, _ = sliced_loss(profile, report, name)
        covered = named_blocks(profile, report, name)
        key = block_module_name(name)
        row = rows.get(key) or Row(key, [], 0.0, 0.0, False)
        rows[key] = Row(key, row.blocks + covered,
                        row.fwd_ms + sum(w * scale * profile.blocks[i].fwd_ms
                                         for i, w in covered),
                        row.glue_ms + sum(w * profile.blocks[i].glue_after_ms
                                          for i, w in covered),
                        row.shards or vocab_part(report, name))
    return list(rows.values())
