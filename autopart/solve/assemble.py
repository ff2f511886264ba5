"""Turn a split (stage block ranges + recompute flags) into a simulated ``Plan``."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence
from typing import Any

from autopart.cost.stage import StageCost
from autopart.schedules import schedule_info, stage_to_rank
from autopart.schema import (
    BaselineResult,
    HeldModule,
    Plan,
    Profile,
    RankPlan,
    SolverInfo,
    StagePlan,
    TrainingSetup,
)
from autopart.simulate.engine import simulate_batch
from autopart.simulate.replay import with_step_overhead
from autopart.solve.cuts import shortest_names
from autopart.solve.records import Config, Evaluated

__all__ = []


def evaluate_splits(setup: TrainingSetup, config: Config,
                    splits: Sequence[tuple[tuple, tuple[bool, ...], Sequence[StageCost]]]
                    ) -> list[Evaluated]:
    """Simulate splits of one configuration (a ``records.Config``: schedule, pp, v, m),
    each given as ``(bounds, recompute, stage_costs)``: half-open block ranges, a flag
    and a ``stage_cost`` per stage. One vectorized simulation for all of them
    (``simulate_batch``), with the figures of simulating each alone."""
    schedule, pp_size = config.schedule, config.pp_size
    virtual_stages, num_microbatches = config.virtual_stages, config.num_microbatches
    results = simulate_batch([costs for _, _, costs in splits], schedule=schedule,
                             pp_size=pp_size, virtual_stages=virtual_stages,
                             num_microbatches=num_microbatches, setup=setup)
    limit = setup.memory_limit_bytes
    out = []
    for (bounds, flags, costs), result in zip(splits, results, strict=True):
        costs = tuple(costs)
        result = with_step_overhead(result, setup, costs, schedule, virtual_stages,
                                    num_microbatches)
        fits = limit is None or max(result.rank_peak_memory_bytes) <= limit
        out.append(Evaluated(schedule, pp_size, virtual_stages, num_microbatches,
                             tuple(bounds), tuple(flags), costs, result, fits))
    return out


def plan_from_split(profile: Profile, setup: TrainingSetup, best: Evaluated, *,
                    partition: str, solver: Mapping[str, Any],
                    baselines: Mapping[str, Mapping[str, Any]], notes: Sequence[str]) -> Plan:
    """Fill a ``Plan`` (schema.py) from a simulated split.

    Args:
        profile: The profile the split's block indices refer to.
        setup: The training setup it was simulated with.
        best: The winning split.
        partition: ``optimal`` or the baseline partition asked for.
        solver: The search's record of how ``best`` was found: the fields of
            ``SolverInfo``.
        baselines: Per baseline name, the fields of ``BaselineResult``.
        notes: Human-readable reasons to keep with the plan.

    Returns:
        The plan, with typed ``setup``, ``solver`` and ``baselines``.
    """
    style = schedule_info(best.schedule).style
    blocks = profile.blocks
    stages = []
    for s, ((i, j), cost) in enumerate(zip(best.bounds, best.stage_costs)):
        stages.append(StagePlan(
            index=s, rank=stage_to_rank(s, best.pp_size, best.virtual_stages, style),
            modules=tuple(b.name for b in blocks[i:j]), fwd_ms=cost.fwd_ms,
            bwd_ms=cost.bwd_ms, param_count=cost.param_count, first_block_idx=i,
            last_block_idx=j - 1, bwd_input_ms=cost.bwd_input_ms,
            bwd_weight_ms=cost.bwd_weight_ms, recompute=cost.recompute,
            activation_bytes=cost.activation_bytes, static_bytes=cost.static_bytes,
            input_bytes=cost.input_bytes, output_bytes=cost.output_bytes,
            transient_bytes=cost.transient_bytes,
            held=tuple(HeldModule(module=k, static_bytes=b) for k, b in cost.held),
            held_for_weight_bytes=cost.held_for_weight_bytes,
            adopted_grad_bytes=cost.adopted_grad_bytes, split_extra_ms=cost.split_extra_ms))
    result = best.result
    ranks = tuple(
        RankPlan(rank=r, stages=tuple(st.index for st in stages if st.rank == r),
                 peak_memory_bytes=int(result.rank_peak_memory_bytes[r]),
                 busy_ms=result.rank_busy_ms[r], idle_ms=result.rank_idle_ms[r],
                 memory_limit_bytes=setup.memory_limit_bytes)
        for r in range(best.pp_size))
    setup_used = dataclasses.replace(setup, pp_size=best.pp_size,
                                     num_microbatches=best.num_microbatches)
    return Plan(
        profile_fingerprint=profile.model.fingerprint, pp_size=best.pp_size,
        virtual_stages=best.virtual_stages, schedule=best.schedule,
        num_microbatches=best.num_microbatches,
        pipeline_cuts=tuple(shortest_names(blocks, [j for _, j in best.bounds[:-1]])),
        stages=tuple(stages), ranks=ranks, predicted_step_ms=result.step_ms,
        bubble_fraction=result.bubble_fraction,
        baselines={name: BaselineResult(**{**fields, "stage_num_blocks": tuple(
            fields.get("stage_num_blocks", ()))}) for name, fields in baselines.items()},
        model_name=profile.model.name, partition=partition, setup=setup_used,
        solver=SolverInfo(**solver), notes=tuple(notes),
        micro_batch_size=profile.setup.micro_batch_size, seq_len=profile.setup.seq_len,
        dtype=profile.setup.dtype, profile_threads=profile.setup.num_threads,
        granularity=profile.setup.granularity,
        head_shards=next((b.parts[-1].count for b in blocks
                          if b.parts and b.parts[-1].axis == "vocab"), 0),
        parts={b.name: b.parts for b in blocks if b.parts})
