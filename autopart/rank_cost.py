"""Costs of a rank and of a step, built from its stages' ``StageCost``s.

``autopart.cost`` prices one stage from its blocks; this module adds what only a
rank or a whole step has: the static memory of a rank holding several stages (a
shared weight counted once), torch's receive buffers, the runtime's fixed work per
step, and the per-step sum of a weight held on several ranks. ``stage_costs_of_plan``
rebuilds the stages' costs recorded in a plan.
"""

from __future__ import annotations

from collections.abc import Sequence

from autopart.cost import StageCost, static_bytes_per_param
from autopart.schema import DTYPE_BYTES, Plan, TrainingSetup

__all__ = ["rank_static_bytes", "recv_buffer_bytes", "shared_grad_sync_ms",
           "stage_costs_of_plan", "step_overhead_ms"]


def rank_static_bytes(costs: Sequence[StageCost], stages: Sequence[int]) -> int:
    """Static bytes of a rank holding ``stages``: each stage's, the shared weight once.

    Torch shares one Parameter (and so one gradient and one optimizer state) between
    the embedding and the head when both sit on the same rank, and the runtime holds a
    head split by vocabulary whole on every rank with one of its shards.
    """
    whole = max((costs[s].tied_static_bytes for s in stages), default=0)
    held = set(stages)
    # a half cut between two stages of this rank (ZBV's turn) is held once
    twice = sum(costs[s].shared_half_bytes for s in stages if s + 1 in held)
    return sum(costs[s].static_bytes - costs[s].tied_part_bytes for s in stages) + whole - twice


def recv_buffer_bytes(cost: StageCost, num_microbatches: int) -> int:
    """torch's receive buffers of a stage: one activation and one gradient per microbatch."""
    return num_microbatches * (cost.input_bytes + cost.output_bytes)


def step_overhead_ms(setup: TrainingSetup) -> float:
    """The runtime's fixed work per step (``RuntimeOverhead.step_ms``; 0 without a check)."""
    overhead = setup.runtime_overhead
    return overhead.step_ms if overhead is not None else 0.0


def shared_grad_sync_ms(costs: Sequence[StageCost], stage_ranks: Sequence[int],
                        setup: TrainingSetup) -> float:
    """The per-step sum of a shared weight's gradient over the ranks holding it.

    The runtime all-reduces the whole gradient of the weight held on several ranks (a
    tied embedding/head, a head split by vocabulary) after the schedule, over the
    pipeline link: a ring of ``n`` holders moves ``2 (n - 1) / n`` of its bytes per rank
    in ``2 (n - 1)`` steps, each paying the link latency.

    Args:
        costs: Every stage's cost, in stage order.
        stage_ranks: The pp rank of each stage.
        setup: Its precision (gradient dtype) and link.

    Returns:
        Milliseconds; 0 when the weight is held by one rank or there is none.
    """
    holders = {r for c, r in zip(costs, stage_ranks) if c.tied_part_bytes > 0}
    whole = max((c.tied_static_bytes for c in costs), default=0)
    tied = _ring_ms(whole, len(holders), setup) if len(holders) > 1 and whole > 0 else 0.0
    return tied + _half_sync_ms(costs, stage_ranks, setup)


def _ring_ms(static_bytes: int, num: int, setup: TrainingSetup) -> float:
    """All-reduce of the gradient of a weight of ``static_bytes`` over ``num`` ranks."""
    grad_bytes = static_bytes / static_bytes_per_param(setup) * DTYPE_BYTES[setup.grad_dtype]
    moved = 2 * (num - 1) / num * grad_bytes
    return 2 * (num - 1) * setup.link_latency_ms + 1e3 * moved / setup.link_bandwidth_bytes_per_s


def _half_sync_ms(costs: Sequence[StageCost], stage_ranks: Sequence[int],
                  setup: TrainingSetup) -> float:
    """The sums of the halves cut between stages of two ranks (``autopart.solve.slices``):
    each pair of ranks sums its half's gradient, pairs at the same time; a rank in
    several pairs does them one after another. The busiest rank's total."""
    per_rank: dict[int, float] = {}
    for s, cost in enumerate(costs[:-1]):
        here, there = stage_ranks[s], stage_ranks[s + 1]
        if cost.shared_half_bytes > 0 and here != there:
            ms = _ring_ms(cost.shared_half_bytes, 2, setup)
            per_rank[here] = per_rank.get(here, 0.0) + ms
            per_rank[there] = per_rank.get(there, 0.0) + ms
    return max(per_rank.values(), default=0.0)


def stage_costs_of_plan(plan: Plan) -> list[StageCost]:
    """Rebuild the StageCosts recorded in ``plan`` (to simulate a plan without its profile)."""
    return [StageCost(fwd_ms=s.fwd_ms, bwd_input_ms=s.bwd_input_ms,
                      bwd_weight_ms=s.bwd_weight_ms, static_bytes=s.static_bytes,
                      activation_bytes=s.activation_bytes, input_bytes=s.input_bytes,
                      output_bytes=s.output_bytes, transient_bytes=s.transient_bytes,
                      param_count=s.param_count, recompute=s.recompute,
                      tied_static_bytes=s.tied_static_bytes,
                      tied_part_bytes=s.tied_part_bytes,
                      held_for_weight_bytes=s.held_for_weight_bytes,
                      adopted_grad_bytes=s.adopted_grad_bytes,
                      shared_half_bytes=s.shared_half_bytes)
            for s in plan.stages]
