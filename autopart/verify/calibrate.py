"""Fold measured stage times back into a profile, so the next plan uses what really ran.

Every block of a stage is scaled by one factor per kind of time: ``fwd_ms`` by the
forward's (shared out between the blocks as the run's per-block rows say they ran,
``autopart.verify.outside.block_shares``), ``bwd_input_ms`` and ``bwd_weight_ms`` by
the B and W factors under split-backward schedules, else both by the full backward's
(``bwd_ms`` follows). A
stage's prediction is its blocks plus what it pays outside them (the runtime's per-action
cost, the model's glue and stand-ins: ``autopart.cost.stage``), which calibration leaves
as they are, but for the model's code outside the blocks (glue and stand-ins), which
the run's per-block rows price with one factor of their own (``autopart.verify.outside``);
so the factor is (measured - outside) / blocks, and planning the same cuts again
predicts what was measured. Head shards are priced as they ran, with the runtime's sliced
loss (``coverage.priced_times``), and how much slower than that their row ran scales the
sliced loss, its fixed cost per call and its cost per row (``outside.fit_slice_cost``),
not the head: a plan with the head whole does not pay it. Memory figures are left as they are.

What a rank spends outside its actions and p2p waits (``RankReport.measured_outside_ms``:
posting sends and receives, the schedule's bookkeeping) is priced by the machine check
per post, measured on stages that compute little; on a real model's run a post can cost
far more (on a 2-core machine a post of a 2-rank run waits for a core the other rank's
compute holds). Given the plan that ran, the price of the run's kind of schedule
(``p2p_ms`` single-stage, ``runtime_p2p_ms`` multi-stage: ``RuntimeOverhead``) is the
one at which the plan, with its stages calibrated, predicts the run's step
(``fit_post_price``): what the posts cost is partly spent while a rank would wait anyway,
and the check's link latency is a ping-pong that a pipeline's transfers overlap, so the
time outside actions, charged to every post, over-prices a run on the ranks that are not
the bottleneck. Without the plan, the run's own figure replaces the check's: (outside -
the per-step work) / the posts the rank made, median over the ranks. The other kind's
price moves by the same difference (the wait for a core is the machine's and the
model's, not the runtime's). The factors, the post prices and the run they came from
are recorded in ``Profile.calibration``.
"""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Callable, Sequence
from typing import Any

from autopart.cost.rank import stage_costs_of_plan
from autopart.cost.stage import StageCost
from autopart.errors import SchemaError
from autopart.schedules import schedule_info
from autopart.schema import BlockProfile, Plan, Profile, RuntimeOverhead
from autopart.verify.coverage import covered_blocks, priced_times, stage_blocks
from autopart.verify.outside import block_shares, fit_outside_scale, fit_slice_cost, scaled_outside
from autopart.verify.report import RunReport, StageReport, plan_digest

__all__ = ["calibrate_profile", "fit_count_pass", "fit_post_price", "post_field"]


def calibrate_profile(profile: Profile, report: RunReport, plan: Plan | None = None,
                      source: str = "") -> Profile:
    """Fold a verify run's measured stage times back into the profile.

    Every block of a stage has its F, B and W times scaled by that stage's measured /
    predicted ratio, so planning again from the result predicts what was measured; where
    the report splits each stage's forward block by block, the model's glue and the
    stand-ins are first scaled by how much slower the stages ran them
    (``fit_outside_scale``), and the blocks' factors are what is left. A
    head split into vocabulary shards over several stages gets the mean of their
    ratios, each weighted by its share of the vocabulary. The runtime's price per post
    of the report's kind of schedule becomes, given ``plan``, the one at which the plan
    predicts the run's step (``fit_post_price``), else the one the run measured outside
    the actions (``measured_post_ms``, where the report has the ranks' own steps). Given
    ``plan`` and a MoE router loss, the counting pass is first priced as measured
    (``fit_count_pass``).

    Args:
        profile: The profile the plan was made from.
        report: The run report of that plan (``verify_plan`` or ``autopart verify
            --json``).
        plan: The plan that ran; when given, checked against ``report.plan_digest``
            and its step fits the price of a post.
        source: Names the run report (a path) in the profile's calibration record.

    Returns:
        A copy of ``profile`` with scaled block times (and the sliced loss as fitted,
        ``calibration["slice_fwd_ms"]`` and ``["slice_fwd_ratio"]``: before, after) and
        a ``calibration`` record that chains any earlier one.

    Raises:
        SchemaError: The report is of another plan, model or sequence length, is
            already folded into ``profile``, or names blocks ``profile`` lacks.
    """
    _check(profile, report, plan)
    scale, added = fit_outside_scale(profile, report)
    profile = scaled_outside(profile, scale)
    slice_before = profile.setup.head_slice_fwd_ms
    ratio_before = profile.setup.head_slice_fwd_ratio
    slice_ms, row_scale, slice_added = fit_slice_cost(profile, report)
    for stage, ms in slice_added.items():
        added[stage] = added.get(stage, 0.0) + ms
    ratio_after = round((ratio_before or 1.0) * row_scale, 4) if row_scale != 1.0 \
        else ratio_before
    profile = dataclasses.replace(profile, setup=dataclasses.replace(
        profile.setup, head_slice_fwd_ms=slice_ms, head_slice_fwd_ratio=ratio_after))
    blocks = list(profile.blocks)
    factors = []
    shares: dict[int, list[tuple[float, dict[str, float]]]] = {}
    changes: dict[int, dict[str, float]] = {}
    for stage in report.stages:
        covered = stage_blocks(profile, report, stage)
        own = priced_times(profile, report, stage)
        ratio = _ratios(stage, own, added.get(stage.index, 0.0))
        changes[stage.index] = {key: (ratio[key] - 1) * own[key] for key in own}
        changes[stage.index]["fwd"] += added.get(stage.index, 0.0)
        speed = block_shares(profile, report, stage)
        for i, weight in covered:
            shares.setdefault(i, []).append((weight, {**ratio, "fwd": ratio["fwd"] * speed[i]}))
        factors.append({"stage": stage.index, "first_block": stage.modules[0],
                        "last_block": stage.modules[-1], **ratio})
    for i, parts in shares.items():
        total = sum(weight for weight, _ in parts)
        mean = {key: sum(weight * r[key] for weight, r in parts) / total for key in parts[0][1]}
        blocks[i] = _scaled(blocks[i], mean)
    previous = [profile.calibration] if profile.calibration else []
    record = {"source": source, "plan_digest": report.plan_digest,
              "schedule": report.schedule, "device": report.device,
              "predicted_step_ms": report.predicted_step_ms,
              "measured_step_ms": report.measured_step_ms, "factors": factors,
              "outside_scale": round(scale, 4), "previous": previous}
    if slice_ms != slice_before:
        record["slice_fwd_ms"] = [slice_before, slice_ms]
    if ratio_after != ratio_before:
        record["slice_fwd_ratio"] = [ratio_before, ratio_after]
    overhead = profile.runtime_overhead
    if overhead is not None and plan is not None and report.measured_step_ms > 0:
        costs = [_changed(cost, changes.get(s, {}), first=s == 0)
                 for s, cost in enumerate(stage_costs_of_plan(plan))]
        if report.measured_count_ms > 0 and plan.setup.router_loss_pass \
                and not schedule_info(plan.schedule).split_backward:
            overhead, record["count_pass"] = fit_count_pass(plan, costs, overhead,
                                                            report.measured_count_ms)
        overhead, record["post"] = fit_post_price(plan, report.measured_step_ms, overhead,
                                                  costs)
    elif overhead is not None and (post := measured_post_ms(report, overhead)) is not None:
        field = "runtime_p2p_ms" if schedule_info(report.schedule).multi_stage else "p2p_ms"
        shift = post - getattr(overhead, field)
        prices = {key: getattr(overhead, key) for key in _PRICES}
        moved = {key: round(_moved(key, value, shift), 4) for key, value in prices.items()
                 if value > 0 or key == field}
        record["post"] = {"field": field, "before_ms": getattr(overhead, field),
                          "after_ms": moved[field], "other_prices": {
                              key: [prices[key], value] for key, value in moved.items()
                              if key != field}}
        overhead = dataclasses.replace(overhead, **moved)
    return dataclasses.replace(profile, blocks=tuple(blocks), calibration=record,
                               runtime_overhead=overhead)


def fit_count_pass(plan: Plan, costs: Sequence[StageCost], overhead: RuntimeOverhead,
                   measured_ms: float) -> tuple[RuntimeOverhead, dict[str, Any]]:
    """The MoE router loss's counting pass priced as a run measured it: the scale
    (``RuntimeOverhead.count_pass_scale``) of its price from ``plan``'s stages
    (``costs``, as calibrated) that gives the run's ``measured_ms``.

    Returns:
        The overhead with the scale, and the record ``Profile.calibration`` keeps
        (``before``, ``after``, ``measured_ms``, ``priced_ms``: the price at scale 1).
    """
    from autopart.simulate.replay import counting_pass_ms

    setup = dataclasses.replace(plan.setup, runtime_overhead=dataclasses.replace(
        overhead, count_pass_scale=1.0))
    priced = counting_pass_ms(costs, schedule=plan.schedule, pp_size=plan.pp_size,
                              virtual_stages=plan.virtual_stages,
                              num_microbatches=plan.num_microbatches, setup=setup,
                              step_ms=0.0)
    scale = round(measured_ms / priced, 4) if priced > 0 else overhead.count_pass_scale
    return dataclasses.replace(overhead, count_pass_scale=scale), {
        "before": overhead.count_pass_scale, "after": scale,
        "measured_ms": round(measured_ms, 3), "priced_ms": round(priced, 3)}


def fit_post_price(plan: Plan, measured_step_ms: float, overhead: RuntimeOverhead,
                   costs: Sequence[StageCost] | None = None, *, others: bool = True,
                   outside_ms: float | None = None) -> tuple[RuntimeOverhead, dict[str, Any]]:
    """Price a post of ``plan``'s kind of schedule so that the plan predicts a run's step.

    The price (``post_field``: 1F1B's ``p2p_ms``, GPipe's ``gpipe_p2p_ms``, the action
    runtime's ``runtime_p2p_ms``) is found by bisection: the simulated step of ``plan``'s
    stages (``costs``, the plan's own by default) grows with it. Where even free posts
    predict a longer step than the run's, the posts are free and, with ``others``, the
    link's one-way latency (the machine check's ping-pong, which a pipeline's transfers
    overlap) is lowered to the one that predicts the run, down to 0. With ``others``, the
    other kinds' prices move by as much as the fitted one (GPipe's price is its own:
    nothing else moves). Where free posts predict a longer step than the run's and
    ``outside_ms`` is given (the run's own price per post, ``measured_post_ms``), the step
    says nothing about the posts, and they are priced at ``outside_ms`` instead of free:
    GPipe's blocks can run faster than 1F1B's rehearsed prices (a tiny Cohere's and
    Nemotron's even GPipe runs), which hides what its posts cost on that split and not on
    a balanced one.

    Args:
        plan: The plan that ran.
        measured_step_ms: The run's step.
        overhead: The prices the plan was made with (the profile's machine check).
        costs: The plan's stages as calibrated (``calibrate_profile``).
        others: Move the other kind's price and fit the latency too.
        outside_ms: The price where the step cannot fit one (above), or ``None``: free.

    Returns:
        The overhead with the fitted prices, and the record ``Profile.calibration`` keeps
        (``field``, ``before_ms``, ``after_ms``, the run's step ``run_step_ms``, the step
        ``plan`` predicts at the fitted prices ``predicted_step_ms`` (above the run's
        where free posts and latency could not reach it), ``other_prices``, where it
        moved, ``link_latency_ms`` before and after, and ``from_outside`` where the
        price is ``outside_ms``).
    """
    from autopart.simulate import simulate_plan

    costs = list(costs) if costs is not None else stage_costs_of_plan(plan)
    field = post_field(plan.schedule)
    gpipe = field == "gpipe_p2p_ms"  # its own price: 0 would read as not measured
    before = getattr(overhead, field) or (overhead.p2p_ms if gpipe else 0.0)
    own_latency = plan.setup.link_latency_ms == overhead.link_latency_ms

    # a stage's F and B carry p2p_ms per cut next to it (``autopart.cost.stage``)
    cuts = [int(s > 0) + int(s < len(costs) - 1) for s in range(len(costs))]

    def step(**prices: float) -> float:
        check = dataclasses.replace(overhead, **prices)
        setup = dataclasses.replace(plan.setup, runtime_overhead=check, **(
            {"link_latency_ms": check.link_latency_ms} if own_latency else {}))
        delta = check.p2p_ms - overhead.p2p_ms
        charged = [dataclasses.replace(cost, fwd_ms=cost.fwd_ms + delta * n,
                                       bwd_input_ms=cost.bwd_input_ms + delta * n)
                   for cost, n in zip(costs, cuts)]
        return simulate_plan(dataclasses.replace(plan, setup=setup), record_events=False,
                             costs=charged).step_ms

    lowest = 1e-4 if gpipe else 0.0
    price = _bisect(lambda v: step(**{field: v}), measured_step_ms, lowest,
                    max(4 * before, 1.0))
    if price is None:  # no post on the path (one stage), or a run far slower than any price
        price = before
    from_outside = price == lowest and outside_ms is not None and outside_ms > lowest
    if from_outside:
        price = outside_ms
    moved = {field: price}
    latency = overhead.link_latency_ms
    others = others and not gpipe and not from_outside
    if others and own_latency and price == 0.0:
        latency = _bisect(lambda v: step(**{field: 0.0, "link_latency_ms": v}),
                          measured_step_ms, 0.0, latency) or 0.0
        moved["link_latency_ms"] = latency
    shift = price - before
    if others:
        moved.update({key: _moved(key, getattr(overhead, key), shift) for key in _PRICES
                      if key != field and getattr(overhead, key) > 0})
    moved = {key: round(value, 4) for key, value in moved.items()}
    record: dict[str, Any] = {
        "field": field, "before_ms": before, "after_ms": moved[field],
        "run_step_ms": round(measured_step_ms, 3),
        "predicted_step_ms": round(step(**moved), 3), "other_prices": {
            key: [getattr(overhead, key), value] for key, value in moved.items()
            if key not in (field, "link_latency_ms")}}
    if from_outside:
        record["from_outside"] = True
    if latency != overhead.link_latency_ms:
        record["link_latency_ms"] = [overhead.link_latency_ms, moved["link_latency_ms"]]
    return dataclasses.replace(overhead, **moved), record


_PRICES = ("p2p_ms", "runtime_p2p_ms", "gpipe_p2p_ms")
"""``RuntimeOverhead``'s prices per post, one per kind of schedule (``post_field``)."""


def _moved(key: str, price: float, shift: float) -> float:
    """``price`` moved by ``shift``, at least 0 (GPipe's at least 1e-4: 0 reads as not
    measured)."""
    return max(price + shift, 1e-4 if key == "gpipe_p2p_ms" else 0.0)


def post_field(schedule: str) -> str:
    """The ``RuntimeOverhead`` price a post of ``schedule`` pays: ``runtime_p2p_ms`` under
    torch's action runtime (multi-stage schedules), ``gpipe_p2p_ms`` under GPipe,
    ``p2p_ms`` under 1F1B."""
    if schedule_info(schedule).multi_stage:
        return "runtime_p2p_ms"
    return "gpipe_p2p_ms" if schedule == "gpipe" else "p2p_ms"


def _bisect(step: Callable[[float], float], target: float, low: float,
            high: float) -> float | None:
    """The value in [``low``, ``high`` x 2^10] where ``step`` (growing) meets ``target``:
    ``low`` where it starts above it, ``None`` where it never reaches it."""
    if step(low) >= target:
        return low
    for _ in range(11):
        if step(high) >= target:
            break
        low, high = high, 2 * high
    else:
        return None
    for _ in range(30):
        middle = (low + high) / 2
        low, high = (low, middle) if step(middle) >= target else (middle, high)
    return (low + high) / 2


def measured_post_ms(report: RunReport, overhead: RuntimeOverhead | None) -> float | None:
    """The run's price per send or receive a rank posts: its time outside actions and
    waits, less the check's per-step work, over the posts it made (two per microbatch
    for each of its stages' neighbours on another rank: F's and B's), median over the
    ranks that posted. ``None`` without a machine check or the ranks' own steps."""
    if overhead is None:
        return None
    rank_of = {stage.index: stage.rank for stage in report.stages}
    last = max(rank_of, default=0)
    per_post = []
    for rank in report.ranks:
        outside = rank.measured_outside_ms
        cuts = sum(rank_of.get(t, rank.rank) != rank.rank
                   for s in rank.stages for t in (s - 1, s + 1) if 0 <= t <= last)
        posts = 2 * cuts * report.num_microbatches
        if outside is not None and posts:
            per_post.append(max(outside - overhead.step_ms, 0.0) / posts)
    return statistics.median(per_post) if per_post else None


def _check(profile: Profile, report: RunReport, plan: Plan | None) -> None:
    if plan is not None and plan_digest(plan) != report.plan_digest:
        raise SchemaError(f"the run report is of another plan (digest {report.plan_digest}, "
                          f"this plan's is {plan_digest(plan)}); pass the plan that was verified")
    if profile.model.fingerprint != report.plan_fingerprint:
        raise SchemaError(f"the run was of a plan for another model (fingerprint "
                          f"{report.plan_fingerprint}, the profile's is "
                          f"{profile.model.fingerprint}); pass the profile the plan came from")
    if report.seq_len != profile.setup.seq_len:
        raise SchemaError(f"the run used seq_len {report.seq_len} but the profile was taken at "
                          f"{profile.setup.seq_len}; pass the profile the plan came from")
    if report.plan_digest in _applied_digests(profile.calibration):
        raise SchemaError(f"this run (plan digest {report.plan_digest}) is already folded into "
                          f"the profile; calibrate the original profile, or verify again")
    missing = [m for s in report.stages for m in s.modules
               if not covered_blocks(profile, m, tuple(report.parts.get(m, ())))]
    if missing:
        raise SchemaError(f"the run report names blocks the profile lacks ({missing[:3]}); "
                          f"pass the profile the plan came from")


def _applied_digests(record: dict[str, Any]) -> set[str]:
    """Plan digests of every run already folded into a profile (its calibration chain)."""
    digests = set()
    while record:
        digests.add(record.get("plan_digest", ""))
        previous = record.get("previous") or [{}]
        record = previous[0]
    return digests


def _ratios(stage: StageReport, blocks: dict[str, float], added_fwd: float = 0.0
            ) -> dict[str, float]:
    """The factors of one stage's F, B and W (module docstring); ``blocks``: the stage's
    blocks' own ms of each, from the profile; ``added_fwd``: what the fitted outside scale
    adds to the stage's predicted F (``fit_outside_scale``). 1.0 where nothing was
    predicted; measured / predicted where the blocks are not what the prediction ran
    over (nothing left for them once the outside is taken off)."""
    def ratio(measured: float | None, predicted: float, own: float) -> float:
        if measured is None or predicted <= 0 or measured <= 0:
            return 1.0
        outside = predicted - own
        if own > 0 and outside >= 0 and measured > outside:
            return (measured - outside) / own
        return measured / predicted

    full = ratio(stage.measured_bwd_ms, stage.predicted_bwd_ms,
                 blocks["bwd_input"] + blocks["bwd_weight"])
    return {"fwd": ratio(stage.measured_fwd_ms, stage.predicted_fwd_ms + added_fwd,
                         blocks["fwd"]),
            "bwd_input": ratio(stage.measured_bwd_input_ms, stage.predicted_bwd_input_ms,
                               blocks["bwd_input"])
            if stage.measured_bwd_input_ms is not None else full,
            "bwd_weight": ratio(stage.measured_bwd_weight_ms, stage.predicted_bwd_weight_ms,
                                blocks["bwd_weight"])
            if stage.measured_bwd_weight_ms is not None else full}


def _changed(cost: StageCost, change: dict[str, float], first: bool) -> StageCost:
    """``cost`` with its blocks' F, B and W times changed by ``change`` (ms); the model's
    first stage runs its whole backward as W (``autopart.cost.stage``)."""
    fwd, bwd_in, bwd_w = (change.get(key, 0.0) for key in ("fwd", "bwd_input", "bwd_weight"))
    if first:
        bwd_in, bwd_w = 0.0, bwd_in + bwd_w
    return dataclasses.replace(cost, fwd_ms=max(cost.fwd_ms + fwd, 0.0),
                               bwd_input_ms=max(cost.bwd_input_ms + bwd_in, 0.0),
                               bwd_weight_ms=max(cost.bwd_weight_ms + bwd_w, 0.0))


def _scaled(block: BlockProfile, ratio: dict[str, Any]) -> BlockProfile:
    bwd_in = block.bwd_input_ms * ratio["bwd_input"]
    bwd_w = block.bwd_weight_ms * ratio["bwd_weight"]
    return dataclasses.replace(block, fwd_ms=block.fwd_ms * ratio["fwd"], bwd_input_ms=bwd_in,
                               bwd_weight_ms=bwd_w, bwd_ms=bwd_in + bwd_w)
