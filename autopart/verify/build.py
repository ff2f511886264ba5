"""Turn the per-rank measurements of a run into a ``RunReport`` beside the plan's prediction.

The prediction is ``simulate_plan(plan)``, so it is exactly what ``autopart plan``
and ``autopart simulate`` show for this plan.
"""

from __future__ import annotations

import statistics
from collections import defaultdict
from collections.abc import Sequence

from autopart.cost.stage import stage_post_ms
from autopart.schedules import schedule_info
from autopart.schema import Plan
from autopart.simulate import SimResult, simulate_plan
from autopart.verify.report import (
    BlockReport,
    RankReport,
    RunReport,
    StageReport,
    plan_digest,
)
from autopart.verify.worker import RankResult, RunSettings

__all__ = []

_COMPUTE = ("F", "LOSS", "B", "BW", "W")


def build_report(plan: Plan, settings: RunSettings, results: Sequence[RankResult]
                 ) -> RunReport:
    """A ``RunReport`` from every rank's ``run_rank`` result (each process of the mesh).

    Args:
        plan: The plan that ran.
        settings: How it ran.
        results: One ``RankResult`` per process, in any order; stage times pool every
            replica's and tp rank's spans, each process gets its own rank report.

    Returns:
        Measured against predicted, per stage, per rank and per step.
    """
    results = sorted(results, key=lambda r: (r.rank, r.dp_rank, r.tp_rank))
    first = [r for r in results if r.dp_rank == 0 and r.tp_rank == 0]  # one per pp rank
    sim = simulate_plan(plan)
    steps = [max(r.step_ms[i] for r in results) for i in range(len(results[0].step_ms))]
    train = [max(r.step_ms[i] + r.optimizer_ms[i] for r in results)
             for i in range(len(steps))]
    median_idx = sorted(range(len(steps)), key=steps.__getitem__)[len(steps) // 2]
    return RunReport(
        plan_fingerprint=plan.profile_fingerprint, plan_digest=plan_digest(plan),
        model=settings.model, schedule=plan.schedule, pp_size=plan.pp_size,
        virtual_stages=plan.virtual_stages, num_microbatches=plan.num_microbatches,
        micro_batch_size=plan.micro_batch_size, seq_len=plan.seq_len, steps=settings.steps,
        warmup=settings.warmup, device=results[0].device,
        num_threads_per_rank=results[0].num_threads,
        profile_threads=plan.profile_threads,
        memory_method=results[0].memory_method,
        predicted_step_ms=sim.step_ms, measured_step_ms=statistics.median(steps),
        measured_step_ms_spread=_spread(steps),
        measured_steps_ms=tuple(round(t, 4) for t in steps),
        measured_train_step_ms=statistics.median(train),
        stages=_stage_reports(plan, results),
        ranks=tuple(_rank_report(r, sim) for r in results),
        measured_events=tuple(
            (r.rank, *span) for r in first for span in r.spans[median_idx]),
        tp_size=plan.tp_size, dp_size=plan.dp_size, sequence_parallel=plan.sequence_parallel,
        zero_stage=plan.zero_stage, reshard_after_forward=plan.reshard_after_forward,
        parts=dict(plan.parts),
        blocks=_block_reports(first),
        measured_count_ms=_count_ms(results),
    )


def _count_ms(results: Sequence[RankResult]) -> float:
    """Median over timed steps of the longest ``COUNT`` span of any rank (0: none)."""
    per_step = [max((end - start for r in results for kind, *_, start, end in r.spans[i]
                     if kind == "COUNT"), default=0.0)
                for i in range(min(len(r.spans) for r in results))]
    return round(statistics.median(per_step), 4) if per_step else 0.0


def _block_reports(results: Sequence[RankResult]) -> tuple[BlockReport, ...]:
    """Median forward per microbatch of every block of every stage (``BlockTimer``), in the
    order the stages run them."""
    samples: dict[tuple[int, str], list[float]] = defaultdict(list)
    for r in results:
        for step in r.block_fwd:
            for stage, name, ms in step:
                samples[stage, name].append(ms)
    return tuple(BlockReport(stage=stage, block=name, measured_fwd_ms=round(_median(ms), 4))
                 for (stage, name), ms in sorted(samples.items(), key=lambda kv: kv[0][0]))


def _stage_reports(plan: Plan, results: Sequence[RankResult]) -> tuple[StageReport, ...]:
    """Median F (+ loss), B, W, full backward per stage over every timed step and microbatch."""
    samples: dict[tuple[str, int], list[float]] = defaultdict(list)
    cpu: dict[tuple[str, int], list[float]] = defaultdict(list)
    for r in results:
        for i, step in enumerate(r.spans):
            cpu_of = r.span_cpu_ms[i] if i < len(r.span_cpu_ms) else ()
            fwd: dict[tuple[int, int], float] = defaultdict(float)
            fwd_cpu: dict[tuple[int, int], float] = defaultdict(float)
            bwd_cpu: dict[tuple[int, int], float] = defaultdict(float)
            for j, (kind, stage, mb, start, end) in enumerate(step):
                if kind in ("F", "LOSS"):
                    fwd[stage, mb] += end - start
                elif kind in _COMPUTE:
                    samples[kind, stage].append(end - start)
                if j < len(cpu_of) and kind in _COMPUTE:
                    (fwd_cpu if kind in ("F", "LOSS") else bwd_cpu)[stage, mb] += cpu_of[j]
            for (stage, _), ms in fwd.items():
                samples["F", stage].append(ms)
            for key, table in (("F", fwd_cpu), ("BW", bwd_cpu)):
                for (stage, _), ms in table.items():
                    cpu[key, stage].append(ms)
    split = schedule_info(plan.schedule).split_backward
    overhead, last = plan.setup.runtime_overhead, len(plan.stages) - 1
    reports = []
    for s in plan.stages:
        f = _median(samples["F", s.index])
        b, w = _median(samples["B", s.index]), _median(samples["W", s.index])
        full = _median(samples["BW", s.index])
        # Split schedules run most backwards as B then W, some (cooldown) as one full pass.
        bwd = b + w if split and samples["B", s.index] else full
        extra = s.split_extra_ms if split else 0.0  # torch's split backward, in W
        reports.append(StageReport(
            index=s.index, rank=s.rank, modules=s.modules, predicted_fwd_ms=s.fwd_ms,
            measured_fwd_ms=f,
            predicted_bwd_ms=s.bwd_ms + extra, measured_bwd_ms=bwd,
            predicted_bwd_input_ms=s.bwd_input_ms,
            measured_bwd_input_ms=b if split and samples["B", s.index] else None,
            predicted_bwd_weight_ms=s.bwd_weight_ms + extra,
            measured_bwd_weight_ms=w if split and samples["W", s.index] else None,
            measured_fwd_cpu_ms=_median(cpu["F", s.index]) if cpu["F", s.index] else None,
            measured_bwd_cpu_ms=_median(cpu["BW", s.index]) if cpu["BW", s.index] else None,
            predicted_post_ms=stage_post_ms(overhead, s.index > 0, s.index < last)))
    return tuple(reports)


def _rank_report(result: RankResult, sim: SimResult) -> RankReport:
    busy = [sum(e - s for kind, *_, s, e in step if kind in _COMPUTE) for step in result.spans]
    wait = [sum(e - s for kind, *_, s, e in step if kind == "WAIT") for step in result.spans]
    rank = result.rank
    return RankReport(
        rank=rank, stages=result.stages,
        predicted_peak_memory_bytes=int(sim.rank_peak_memory_bytes[rank]),
        measured_peak_memory_bytes=result.memory.peak_bytes,
        predicted_busy_ms=sim.rank_busy_ms[rank], measured_busy_ms=_median(busy),
        predicted_idle_ms=sim.rank_idle_ms[rank], measured_wait_ms=_median(wait),
        measured_optimizer_ms=_median(result.optimizer_ms),
        measured_cpu_ms=_median(result.cpu_ms), memory=result.memory,
        dp_rank=result.dp_rank, tp_rank=result.tp_rank,
        measured_step_ms=_median(result.step_ms))


def _median(values: Sequence[float]) -> float:
    return float(statistics.median(values)) if values else 0.0


def _spread(values: Sequence[float]) -> float:
    if len(values) < 2:
        return 0.0
    q = statistics.quantiles(values, n=4)
    med = statistics.median(values)
    return (q[2] - q[0]) / med if med else 0.0
