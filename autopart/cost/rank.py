"""Costs of a rank and of a step, built from its stages' ``StageCost``s.

``autopart.cost.stage`` prices one stage from its blocks; this module adds what only a
rank or a whole step has: the static memory of a rank holding several stages (a
module held whole counted once), torch's receive buffers, the runtime's fixed work per
step, what torch's action runtime charges per send and receive (``post_charges_ms``),
and the per-step sum of the gradients of modules held on several ranks.
``stage_costs_of_plan`` rebuilds the stages' costs recorded in a plan.
"""

from __future__ import annotations

from collections.abc import Sequence

from autopart.cost.blocks import static_bytes_per_param
from autopart.cost.stage import StageCost
from autopart.schedules import schedule_info, stage_to_rank
from autopart.schema import DTYPE_BYTES, Plan, TrainingSetup

__all__ = ["post_charges_ms", "rank_static_bytes", "recv_buffer_bytes", "shared_grad_sync_ms",
           "stage_costs_of_plan", "step_overhead_ms"]


def rank_static_bytes(costs: Sequence[StageCost], stages: Sequence[int]) -> int:
    """Static bytes of a rank holding ``stages``: each stage's, a module held whole once.

    Torch shares one Parameter (one gradient, one optimizer state) between the embedding
    and the head when both sit on the same rank, and the runtime holds a module cut into
    parts (the head by vocabulary, a half by units) whole once per rank
    (``StageCost.held``, ``autopart.cost.held``).
    """
    total = sum(costs[s].static_bytes for s in stages)
    seen: set[str] = set()
    for s in stages:
        for key, num_bytes in costs[s].held:
            if key in seen:
                total -= num_bytes
            seen.add(key)
    return total


def recv_buffer_bytes(cost: StageCost, num_microbatches: int) -> int:
    """torch's receive buffers of a stage: one activation and one gradient per microbatch."""
    return num_microbatches * (cost.input_bytes + cost.output_bytes)


def step_overhead_ms(setup: TrainingSetup) -> float:
    """The runtime's fixed work per step (``RuntimeOverhead.step_ms``; 0 without a check)."""
    overhead = setup.runtime_overhead
    return overhead.step_ms if overhead is not None else 0.0


def post_charges_ms(setup: TrainingSetup, schedule: str, pp_size: int,
                    virtual_stages: int) -> list[float] | None:
    """Per stage, the ms to add to each F and to each B under torch's action runtime.

    ``StageCost`` charges every F and B the 1F1B check's ``p2p_ms`` per cut next to the
    stage. The multi-stage schedules run on ``_PipelineScheduleRuntime``, which posts
    every send and receive as an action of its own, at ``runtime_p2p_ms`` each (the
    machine check, ``autopart.verify.machine_runtime``), and posts nothing between two
    stages of one rank (a V schedule's turn). The charge is the difference: the stage's
    posts at the runtime's price less its cuts at the 1F1B price. GPipe, where the
    rehearsal priced its posts (``RuntimeOverhead.gpipe_p2p_ms``), pays that price per
    cut instead of 1F1B's.

    Args:
        setup: Its ``runtime_overhead`` (the machine check).
        schedule: The schedule's name.
        pp_size: Pipeline ranks.
        virtual_stages: Stages per rank.

    Returns:
        One figure per stage, or ``None`` when nothing changes (1F1B, no check, or a
        check without the schedule's own figure).
    """
    overhead = setup.runtime_overhead
    info = schedule_info(schedule)
    num = pp_size * virtual_stages
    if overhead is not None and schedule == "gpipe" and overhead.gpipe_p2p_ms:
        extra = overhead.gpipe_p2p_ms - overhead.p2p_ms
        return [extra * sum(0 <= t < num for t in (s - 1, s + 1)) for s in range(num)]
    if overhead is None or not overhead.runtime_p2p_ms or not info.multi_stage:
        return None
    ranks = [stage_to_rank(s, pp_size, virtual_stages, info.style) for s in range(num)]
    charges = []
    for s in range(num):
        cuts = [t for t in (s - 1, s + 1) if 0 <= t < num]
        posts = sum(ranks[t] != ranks[s] for t in cuts)
        charges.append(overhead.runtime_p2p_ms * posts - overhead.p2p_ms * len(cuts))
    return charges


def shared_grad_sync_ms(costs: Sequence[StageCost], stage_ranks: Sequence[int],
                        setup: TrainingSetup) -> float:
    """The per-step sum of the gradients of modules held whole on several ranks.

    After the schedule the runtime all-reduces the whole gradient of every module held
    on several ranks (a tied embedding/head, the head cut by vocabulary, a half cut by
    units: ``StageCost.held``) over its holders, on the pipeline link: a ring of ``n``
    holders moves ``2 (n - 1) / n`` of its bytes per rank in ``2 (n - 1)`` steps, each
    paying the link latency. Rings of different modules run at the same time; a rank in
    several does them one after another.

    Args:
        costs: Every stage's cost, in stage order.
        stage_ranks: The pp rank of each stage.
        setup: Its precision (gradient dtype) and link.

    Returns:
        Milliseconds: the busiest rank's rings; 0 when no module is held on two ranks.
    """
    holders: dict[str, set[int]] = {}
    whole: dict[str, int] = {}
    for cost, rank in zip(costs, stage_ranks):
        for key, num_bytes in cost.held:
            holders.setdefault(key, set()).add(rank)
            whole[key] = max(whole.get(key, 0), num_bytes)
    per_rank: dict[int, float] = {}
    for key, ranks in holders.items():
        if len(ranks) > 1 and whole[key] > 0:
            ms = _ring_ms(whole[key], len(ranks), setup)
            for rank in ranks:
                per_rank[rank] = per_rank.get(rank, 0.0) + ms
    return max(per_rank.values(), default=0.0)


def _ring_ms(static_bytes: int, num: int, setup: TrainingSetup) -> float:
    """All-reduce of the gradient of a weight of ``static_bytes`` over ``num`` ranks.

    On the machine check's own link, at the all-reduce's measured speed (two ranks: its
    fixed ms is two ring steps); on any other link (given, or no check), at the link's.
    """
    grad_bytes = static_bytes / static_bytes_per_param(setup) * DTYPE_BYTES[setup.grad_dtype]
    moved = 2 * (num - 1) / num * grad_bytes
    steps = 2 * (num - 1)
    check = setup.runtime_overhead
    if (check is not None and check.allreduce_bandwidth_bytes_per_s > 0
            and setup.link_bandwidth_bytes_per_s == check.link_bandwidth_bytes_per_s):
        return (steps * check.allreduce_latency_ms / 2
                + 1e3 * moved / check.allreduce_bandwidth_bytes_per_s)
    return steps * setup.link_latency_ms + 1e3 * moved / setup.link_bandwidth_bytes_per_s


def stage_costs_of_plan(plan: Plan) -> list[StageCost]:
    """Rebuild the StageCosts recorded in ``plan`` (to simulate a plan without its profile)."""
    return [StageCost(fwd_ms=s.fwd_ms, bwd_input_ms=s.bwd_input_ms,
                      bwd_weight_ms=s.bwd_weight_ms, static_bytes=s.static_bytes,
                      activation_bytes=s.activation_bytes, input_bytes=s.input_bytes,
                      output_bytes=s.output_bytes, transient_bytes=s.transient_bytes,
                      param_count=s.param_count, recompute=s.recompute,
                      held=tuple((h.module, h.static_bytes) for h in s.held),
                      held_for_weight_bytes=s.held_for_weight_bytes,
                      adopted_grad_bytes=s.adopted_grad_bytes,
                      split_extra_ms=s.split_extra_ms)
            for s in plan.stages]
