"""Which blocks drive a stage's forward error: the run's per-block forward beside the profile.

``autopart verify`` splits every stage's forward block by block while it runs
(``RunReport.blocks``, from ``BlockTimer``). Given the profile the plan was made from,
``block_errors`` puts each block's measured forward beside its profiled one, and
``error_drivers`` orders them by how many milliseconds they add to (or take from) the
stage's forward error. What the stage's forward spends outside its blocks (predicted:
the model's code before its first block, the stand-ins of the blocks before it and the
runtime's per-action cost; measured: before its first block starts) is one more row,
``(outside blocks)``; the model's code after a block, up to the next, is the block's, on
both sides (the run's block rows end where the next block starts), and the loss is the
head's on both (the profile prices it inside the head; the run's loss is a separate
action, added to the stage's last row). Backward is not split: its error is the
stage's alone.
"""

from __future__ import annotations

from dataclasses import dataclass

from autopart.schema import Profile
from autopart.verify.coverage import stage_rows
from autopart.verify.instrument import BlockTimer
from autopart.verify.report import RunReport

__all__ = ["BlockError", "block_errors", "error_drivers"]


@dataclass(frozen=True, slots=True)
class BlockError:
    """One block's forward in one stage: profiled against measured (ms per microbatch)."""

    stage: int
    block: str
    """The block (a part of a module's call: that module), or ``(outside blocks)``."""
    predicted_fwd_ms: float
    measured_fwd_ms: float

    @property
    def delta_ms(self) -> float:
        """predicted - measured: what this block adds to the stage's forward error."""
        return self.predicted_fwd_ms - self.measured_fwd_ms

    @property
    def error(self) -> float:
        """(predicted - measured) / measured (0 when nothing was measured)."""
        return self.delta_ms / self.measured_fwd_ms if self.measured_fwd_ms else 0.0


def block_errors(report: RunReport, profile: Profile) -> tuple[BlockError, ...]:
    """Every block of every stage, profiled forward beside the forward measured in the run.

    A block's profiled forward includes the model's code after it up to the next call
    (``BlockProfile.glue_after_ms``), as its measured one does. A block that is a part of
    a module's call (a head shard, a unit slice) is predicted at its share of that
    module's (a head shard as the cost model prices it: scaled by the sliced loss's ratio,
    the slice's fixed cost once per stage); blocks ending in one module are one row, as
    the run timed them (``coverage.stage_rows``, which calibration prices too).

    Args:
        report: A run report with per-block forwards (``RunReport.blocks``).
        profile: The profile the plan was made from.

    Returns:
        One ``BlockError`` per measured block and stage, in stage order; empty when the
        report has no per-block figures (written before they were recorded).
    """
    predicted: dict[tuple[int, str], float] = {}
    for stage in report.stages:
        total = 0.0
        for row in stage_rows(profile, report, stage):
            ms = row.fwd_ms + row.glue_ms + (profile.setup.head_slice_fwd_ms if row.shards
                                             else 0.0)  # a stage's shards: one slice
            predicted[stage.index, row.name] = ms
            total += ms
        # the span holds no posts (``StageReport.predicted_post_ms``)
        predicted[stage.index, BlockTimer.OUTSIDE] = max(stage.predicted_fwd_span_ms - total,
                                                         0.0)
    return tuple(BlockError(stage=b.stage, block=b.block,
                            predicted_fwd_ms=round(predicted.get((b.stage, b.block), 0.0), 4),
                            measured_fwd_ms=b.measured_fwd_ms) for b in report.blocks)


def error_drivers(report: RunReport, profile: Profile,
                  top: int = 3) -> dict[int, tuple[BlockError, ...]]:
    """The ``top`` blocks of each stage whose forward is furthest from its profile.

    Args:
        report: A run report with per-block forwards.
        profile: The profile the plan was made from.
        top: Blocks to keep per stage.

    Returns:
        Stage index -> its blocks ordered by ``|delta_ms|``, largest first.
    """
    by_stage: dict[int, list[BlockError]] = {}
    for error in block_errors(report, profile):
        by_stage.setdefault(error.stage, []).append(error)
    return {stage: tuple(sorted(errors, key=lambda e: -abs(e.delta_ms))[:top])
            for stage, errors in by_stage.items()}
