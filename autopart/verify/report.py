"""``RunReport``: what a real run of a plan measured, beside what the plan predicted (JSON).

The report is written by ``autopart verify --json`` and read by ``calibrate_profile``
(``autopart calibrate``). Figures are per microbatch for stage times (medians over
every timed step and microbatch), per step for step and busy times (medians over
the timed steps) and per rank for memory.
"""

from __future__ import annotations

import hashlib
import statistics
from dataclasses import dataclass, field, replace
from typing import Any

from autopart.jsonio import JsonFile
from autopart.schema import Part, Plan

__all__ = ["RunReport", "pooled_report", "report_thread_mismatch"]

REPORT_SCHEMA_VERSION = 1


@dataclass(frozen=True, kw_only=True, slots=True)
class StageReport:
    """One stage: predicted and measured time per microbatch."""

    index: int
    rank: int
    modules: tuple[str, ...]
    """Block FQNs of the stage, in order."""
    predicted_fwd_ms: float
    measured_fwd_ms: float
    """Forward, plus the loss on the last stage (the profile counts the loss in the head)."""
    predicted_bwd_ms: float
    """Full backward B + W."""
    measured_bwd_ms: float
    predicted_bwd_input_ms: float = 0.0
    measured_bwd_input_ms: float | None = None
    """B alone; measured only under split-backward (zero-bubble) schedules."""
    predicted_bwd_weight_ms: float = 0.0
    measured_bwd_weight_ms: float | None = None
    measured_fwd_cpu_ms: float | None = None
    """The forward's CPU time (the ranks' compute thread), median per microbatch: beside
    ``measured_fwd_ms`` it shows how much of the span the rank was descheduled by other
    work (``None`` in reports written before it)."""
    measured_bwd_cpu_ms: float | None = None
    """The same for the full backward (B + W)."""
    predicted_post_ms: float = 0.0
    """What ``predicted_fwd_ms``, and again ``predicted_bwd_ms`` and
    ``predicted_bwd_input_ms``, charge for posting the stage's sends and receives
    (``autopart.cost.stage.stage_post_ms``). torch posts them outside
    ``forward_one_chunk`` and ``backward_one_chunk``, whose spans are what is measured,
    so the per-stage errors compare the ``..._span_ms`` figures, which leave it out
    (0 in reports written before it)."""

    @property
    def predicted_fwd_span_ms(self) -> float:
        """The predicted F less its posts: what the measured F span holds."""
        return self.predicted_fwd_ms - self.predicted_post_ms

    @property
    def predicted_bwd_span_ms(self) -> float:
        """The predicted full backward less its posts."""
        return self.predicted_bwd_ms - self.predicted_post_ms

    @property
    def predicted_bwd_input_span_ms(self) -> float:
        """The predicted B less its posts (W posts nothing)."""
        return self.predicted_bwd_input_ms - self.predicted_post_ms


@dataclass(frozen=True, kw_only=True, slots=True)
class BlockReport:
    """One block's forward inside its stage, measured during the run (``BlockTimer``)."""

    stage: int
    block: str
    """The block (a head shard or unit slice: the module it is a part of), or ``(outside
    blocks)``: the stage's forward before its first block starts (the stage's own code,
    the model's code before its first block, earlier stages' stand-ins)."""
    measured_fwd_ms: float
    """Median per microbatch: from the block's start to the next block's (the last block's
    to the end of the forward)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class MeasuredMemory:
    """One rank's measured memory over a pipeline step, in bytes (``verify.memory``).

    On CUDA only the allocator's peak is known; on CPU the peak is the sum of the
    parts, each counted from live tensors.
    """

    peak_bytes: int
    """``torch.cuda.max_memory_allocated`` over the step, or on CPU the sum below."""
    params_bytes: int | None = None
    """Parameters of this rank's stages (CPU)."""
    grads_bytes: int | None = None
    """Their gradients (CPU)."""
    optimizer_bytes: int | None = None
    """Optimizer state, e.g. AdamW's two moments and step (CPU)."""
    buffer_bytes: int | None = None
    """torch's p2p receive buffers from before the step still alive at the peak (CPU; the
    tensors a V schedule hands over in their place this step are in ``live_peak_bytes``)."""
    live_peak_bytes: int | None = None
    """Peak of the tensors allocated and alive during the step, gradients left out (CPU)."""
    gathered_bytes: int | None = None
    """FSDP's gathered parameters, the most held after any action (CPU; 0 without FSDP)."""


@dataclass(frozen=True, kw_only=True, slots=True)
class RankReport:
    """One rank: predicted and measured peak memory, busy and waiting time per step."""

    rank: int
    """Pipeline rank (its predicted figures are the plan's for that rank)."""
    stages: tuple[int, ...]
    predicted_peak_memory_bytes: int
    measured_peak_memory_bytes: int
    predicted_busy_ms: float
    measured_busy_ms: float
    """Sum of this rank's F/B/W (and loss) spans in a step."""
    predicted_idle_ms: float
    measured_wait_ms: float
    """Time blocked in send/receive waits in a step."""
    measured_optimizer_ms: float = 0.0
    """``optimizer.step()`` after the pipeline step (not part of the predicted step)."""
    measured_cpu_ms: float = 0.0
    """Process CPU time during the pipeline step (CPU runs): busy + wait well above it
    means the rank was descheduled, i.e. the machine was shared."""
    memory: MeasuredMemory | None = None
    """The measured parts of the peak (``None`` in reports that did not record them)."""
    dp_rank: int = 0
    """Data-parallel replica (plans with ``dp_size`` above 1 report each replica)."""
    tp_rank: int = 0
    """Tensor-parallel rank (plans with ``tp_size`` above 1 report each shard)."""
    measured_step_ms: float = 0.0
    """This rank's own pipeline step, median over the timed steps (0 in older reports)."""

    @property
    def measured_outside_ms(self) -> float | None:
        """The rank's step less its actions and p2p waits: the schedule's own work between
        actions (posting sends and receives, the loss bookkeeping); the prediction has it
        inside busy (the machine check's per-action and per-p2p costs). ``None`` in older
        reports without the rank's own step."""
        if self.measured_step_ms <= 0:
            return None
        return max(self.measured_step_ms - self.measured_busy_ms - self.measured_wait_ms, 0.0)


@dataclass(frozen=True, kw_only=True, slots=True)
class RunReport(JsonFile):
    """A plan run for real: predicted vs measured (``autopart verify --json``)."""

    _json_what = "run report"
    _json_remedy = "autopart verify PLAN --model MODEL --json PATH"
    _json_version = REPORT_SCHEMA_VERSION

    plan_fingerprint: str
    """The plan's ``profile_fingerprint`` (the model the plan is for)."""
    plan_digest: str
    """Hash of the plan JSON: calibration checks it is given the plan that ran."""
    model: str
    schedule: str
    pp_size: int
    virtual_stages: int
    num_microbatches: int
    micro_batch_size: int
    seq_len: int
    steps: int
    warmup: int
    device: str
    num_threads_per_rank: int
    memory_method: str
    predicted_step_ms: float
    measured_step_ms: float
    """Median over timed steps of the slowest rank's pipeline step (forward + backward of
    every microbatch and gradient sync; the optimizer step is reported apart)."""
    measured_step_ms_spread: float
    """(p75 - p25) / median of the measured step times."""
    measured_train_step_ms: float
    """Median pipeline step + optimizer step (slowest rank)."""
    stages: tuple[StageReport, ...]
    ranks: tuple[RankReport, ...]
    profile_threads: int = 0
    """torch threads the plan's profile was measured with (0: not recorded); compare
    ``num_threads_per_rank``."""
    measured_events: tuple[tuple[Any, ...], ...] = ()
    """(rank, kind, stage, microbatch, start_ms, end_ms) of the median step, for traces
    (pipeline ranks of the first replica and tp rank)."""
    tp_size: int = 1
    dp_size: int = 1
    sequence_parallel: bool = True
    zero_stage: int = 0
    reshard_after_forward: bool = False
    """The plan's mesh: ``ranks`` holds one report per process of it."""
    parts: dict[str, tuple[Part, ...]] = field(default_factory=dict)
    """The plan's ``parts``: what each block of ``stages[].modules`` is a part of (for
    calibration; empty in reports written before it)."""
    blocks: tuple[BlockReport, ...] = ()
    """Every stage's forward split block by block (pipeline ranks of the first replica and
    tp rank; empty in reports written before it); ``autopart.verify.attribution`` puts
    them beside the profile."""
    measured_steps_ms: tuple[float, ...] = ()
    """Every timed step of the slowest rank, in the order they ran (``measured_step_ms`` is
    their median; empty in reports written before it)."""
    measured_count_ms: float = 0.0
    """The MoE router loss's counting pass before each step (``COUNT`` spans): the median
    over timed steps of the longest rank's; 0 without the loss (or before it was timed)."""
    schema_version: int = REPORT_SCHEMA_VERSION

    @property
    def step_error(self) -> float:
        """(predicted - measured) / measured step time."""
        return relative_error(self.predicted_step_ms, self.measured_step_ms)


def pooled_report(reports: tuple[RunReport, ...]) -> RunReport:
    """Several runs of one plan as one report: each stage's measured F, B (and B and W
    apart, where measured), each block's forward, the step and the counting pass are the
    geometric mean over the runs (the first run's where a run lacks it), the timed
    steps every run's in turn; everything else is the first run's.

    Args:
        reports: Runs of the same plan (one digest), e.g. launched minutes apart.

    Returns:
        The first report with the pooled times.

    Raises:
        ValueError: No report, or reports of different plans.
    """
    if not reports or len({r.plan_digest for r in reports}) > 1:
        raise ValueError("pooled_report takes one or more runs of the same plan")
    if len(reports) == 1:
        return reports[0]

    def mean(values: list[float | None]) -> float | None:
        if any(v is None or v <= 0 for v in values):
            return values[0]
        return statistics.geometric_mean(values)  # type: ignore[arg-type]

    keys = ("measured_fwd_ms", "measured_bwd_ms", "measured_bwd_input_ms",
            "measured_bwd_weight_ms")
    stages = []
    for i, stage in enumerate(reports[0].stages):
        runs = [r.stages[i] for r in reports]
        stages.append(replace(stage, **{key: mean([getattr(s, key) for s in runs])
                                        for key in keys}))
    rows = [{(b.stage, b.block): b.measured_fwd_ms for b in r.blocks} for r in reports]
    blocks = tuple(replace(b, measured_fwd_ms=round(mean([row.get((b.stage, b.block))
                                                          for row in rows]), 4))
                   for b in reports[0].blocks)
    return replace(reports[0], stages=tuple(stages), blocks=blocks,
                   measured_step_ms=mean([r.measured_step_ms for r in reports]),
                   measured_count_ms=mean([r.measured_count_ms for r in reports]),
                   measured_steps_ms=tuple(t for r in reports for t in r.measured_steps_ms))


def report_thread_mismatch(report: RunReport) -> str | None:
    """The line naming a profile / rank thread-count mismatch of a CPU run and its fix.

    Args:
        report: A run report.

    Returns:
        The line, or ``None`` when the counts agree, are unknown, or the run was on GPUs.
    """
    from autopart.runtime.validate import thread_mismatch

    if not report.device.startswith("cpu"):
        return None
    return thread_mismatch(report.profile_threads, report.num_threads_per_rank,
                           pp_size=report.pp_size, model=report.model)


def relative_error(predicted: float, measured: float) -> float:
    """(predicted - measured) / measured; 0 when nothing was measured."""
    return (predicted - measured) / measured if measured else 0.0


def plan_digest(plan: Plan) -> str:
    """Short hash of the plan's canonical JSON."""
    return hashlib.sha256(plan.to_json().encode()).hexdigest()[:16]
