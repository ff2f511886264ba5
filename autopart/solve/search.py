"""Search schedule x virtual stages x microbatches; the public ``make_plan``.

For every allowed ``Config`` (schedule, v, m) the proposers (``propose.py``: DP,
ILP, and the public baselines as seeds) offer splits, the simulator runs them, and
the best few are refined by a simulator-driven local search (``refine``); the
fastest split that fits wins, so it is never slower than a baseline it could have
been. Ties break by schedule order in ``autopart.schedules.SCHEDULES``, then fewer
virtual stages, then fewer microbatches, so the plan is deterministic. The
baselines are simulated under the winner's schedule, v and m.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable, Sequence
from typing import Any

from autopart.errors import PlanError
from autopart.intake.half_slices import parse_slice
from autopart.intake.head_split import parse_shard
from autopart.schedules import SCHEDULES
from autopart.schema import Plan, Profile
from autopart.solve import _explain
from autopart.solve.assemble import Evaluated, plan_from_split
from autopart.solve.baselines import BASELINES
from autopart.solve.propose import propose
from autopart.solve.records import Candidate, Config, Options
from autopart.solve.refine import legal, refine_counted
from autopart.solve.setting import ConfigJudge, Setting, build_settings, search_configs
from autopart.solve.shards import (
    apply_granularity,
    cut_bounds,
    faster_of_sliced_or_whole,
    faster_of_split_or_whole,
    splits_head,
)
from autopart.solve.slices import MAX_SLICES
from autopart.targets import planning_constraints

__all__ = ["PARTITIONS", "SOLVERS", "make_plan"]

PARTITIONS = ("optimal", *BASELINES)
SOLVERS = ("auto", "dp", "ilp")
_ILP_MAX_NODES = 100_000
_ILP_AUTO_MAX_NODES = 2_000
"""Per-ILP node limits for ``solver="ilp"`` and ``solver="auto"`` (a limit hit is reported
with its gap in ``Plan.solver``; under ``auto`` such a split is dropped)."""
_NUM_REFINED = 3
"""How many of the best (schedule, v, m) candidates the local search refines."""
_REFINE_NODE_BUDGET = 100_000_000
"""DAG nodes (``simulate.levels``) the local search may simulate in all, a bound on its
work that binds only at scale (a heuristic, deterministic on every machine): a step of
pp 8, m 32 has ~10^4 nodes, so 300 simulations of each of 12 seeds stay far below it;
at pp 64, m 256, v 4 (3.3 * 10^5 nodes) it allows ~300 simulations, spent on the
fastest seeds. There a climb from a seed 5-15% behind moves one cut by one block per
simulation and spent its 300 without reaching the front, most of the plan's time."""


def make_plan(profile: Profile, *, pp_size: int, num_microbatches: int | None = None,
              global_batch_size: int | None = None, schedule: str | Sequence[str] = "auto",
              virtual_stages: int | str = "auto", partition: str = "optimal",
              solver: str = "auto", memory_limit_bytes: int | None = None,
              allow_recompute: bool = True, ilp_backend: str = "auto",
              ilp_max_nodes: int | None = None, ilp_time_limit_s: float | None = None,
              cut_kinds: Sequence[str] | None = None,
              refine_evals: int = 300, target: str | None = None,
              granularity: str = "auto", cuts: Sequence[str] | None = None,
              progress: Callable[[int, int, str], None] | None = None,
              **setup_fields: Any) -> Plan:
    """Plan the pipeline of ``profile`` on ``pp_size`` ranks.

    Args:
        profile: Per-block costs (``autopart profile``).
        pp_size: Pipeline ranks.
        num_microbatches: Fix m. Else ``global_batch_size`` allows every m dividing
            it, or m = 4 * pp when neither is given.
        global_batch_size: Samples per step and data-parallel replica; the profile's
            per-microbatch costs are rescaled linearly to ``global_batch_size / m``.
        schedule: A name, a list of names, or ``"auto"`` (every schedule torch has).
        virtual_stages: Stages per rank, or ``"auto"``: for the multi-stage schedules
            every v from 2 with a block per stage that torch accepts, in ascending
            order, until two v in a row do worse than the best so far.
        partition: ``optimal``, or a baseline (``even``, ``params``, ``torchtitan``).
        solver: For ``optimal``: ``dp``, ``ilp``, or ``auto`` (the DP, plus the ILP for
            small multi-stage problems).
        memory_limit_bytes: Per-device memory; ``None`` is unlimited.
        allow_recompute: Let stages recompute their forward to fit memory.
        ilp_backend: ``auto``, ``highs`` or ``cbc``.
        ilp_max_nodes: Branch-and-bound nodes per ILP; defaults to 100,000 with
            ``solver="ilp"``, 2,000 with ``"auto"``. A bound on work, so plans are
            the same on every machine and under any load.
        ilp_time_limit_s: An optional wall-clock limit per ILP as well (default none);
            a split it cuts off depends on the machine.
        cut_kinds: Cut only after blocks of these kinds (NxD: ``("decoder_layer",)``).
        refine_evals: Simulations the local search may spend per refined candidate
            (0 turns it off); at pp 64 a bound on its total work binds first.
        target: An export format (``nxd``, ``megatron``, ...): plan within that tool's
            rules (``autopart.targets``), its cut kinds unless ``cut_kinds`` is given,
            and its schedules.
        granularity: ``auto`` / ``quarter``: the finest blocks the runtime runs (as
            profiled), the head split into vocabulary shards where it can be
            (``autopart.solve.shards``; ``auto`` keeps the head whole where that predicts
            a step as fast or faster); ``sublayer``: the same with a ``quarter``
            profile's parts fused into halves; ``layer``: whole blocks. Export targets
            plan at ``layer``.
        cuts: Evaluate this split instead of searching: the last block of every stage
            but the final one (``pp_size * v - 1`` names, in model order); shard names
            ``lm_head.shard<i>of<k>`` set the number of shards.
        progress: ``progress(done, total, what)`` is called after each (schedule, v,
            m) is searched and once more after the local search.
        **setup_fields: Fields of ``TrainingSetup`` (optimizer, dtypes, link figures);
            ``precision`` (a ``PRECISIONS`` preset) sets the dtypes, by default the
            profile dtype's.

    Returns:
        The plan with the fastest simulated step that fits, with the baselines
        simulated beside it and notes on why it looks the way it does.

    Raises:
        PlanError: A bad setting (pp, partition, solver, v, setup field, target,
            granularity, cuts).
        InfeasibleError: Nothing fits; the message names the memory that would fit.
    """
    args = {k: v for k, v in locals().items() if k not in ("profile", "setup_fields")}
    slice_counts = {min(parse_slice(c)[2], MAX_SLICES) for c in cuts or () if parse_slice(c)}
    if granularity == "auto" and slice_counts:
        granularity = "slice"  # --cuts model.layers.3.mlp.slice1of4: 4 slices per half
    if granularity == "auto" and cuts is None and target is None:
        if profile.model.slice_units and profile.setup.granularity != "layer":
            return faster_of_sliced_or_whole(lambda p, g: make_plan(
                p, **{**args, "granularity": g}, **setup_fields), profile)
        if splits_head(profile):
            return faster_of_split_or_whole(lambda p: make_plan(
                p, **{**args, "granularity": "quarter"}, **setup_fields), profile)
    if target is not None:
        schedule, cut_kinds = _target_rules(target, schedule, cut_kinds, pp_size,
                                            num_microbatches)
    shard_counts = {parse_shard(c)[2] for c in cuts or () if parse_shard(c)}
    profile, granularity_notes = apply_granularity(  # --cuts lm_head.shard1of4: 4 shards
        profile, granularity, target, shards=min(shard_counts) if shard_counts else None,
        slices=max(slice_counts) if slice_counts else None)
    _check_args(profile, pp_size, partition, solver, virtual_stages)
    given = None
    if cuts is not None:
        given, virtual_stages = cut_bounds(profile, cuts, pp_size, virtual_stages)
        partition = "cuts"
    if ilp_max_nodes is None:
        # Under "auto" the ILP is a second opinion beside the DP: keep it short.
        ilp_max_nodes = _ILP_MAX_NODES if solver == "ilp" else _ILP_AUTO_MAX_NODES
    options = Options(partition=partition, solver=solver, allow_recompute=allow_recompute,
                      ilp_backend=ilp_backend, ilp_max_nodes=ilp_max_nodes,
                      ilp_time_limit_s=ilp_time_limit_s, refine_evals=refine_evals,
                      cuts=given)
    settings = build_settings(profile, pp_size, num_microbatches, global_batch_size,
                              memory_limit_bytes, setup_fields, cut_kinds)
    if given is not None and not legal(given, next(iter(settings.values())).allowed):
        raise PlanError(f"--cuts cuts inside a unit {target or 'the cut kinds'} keeps whole "
                        f"(allowed after {'/'.join(cut_kinds or ())} blocks only); move the cuts")
    num_units = min(setting.chain.num_blocks for setting in settings.values())
    configs = search_configs(num_units, pp_size, schedule, virtual_stages, sorted(settings))
    best = _search(settings, configs, options, progress)
    setting = settings[best.evaluated.num_microbatches]
    baselines = _baselines(setting, best.evaluated)
    notes = _explain.notes(setting.profile, best.evaluated, baselines, memory_limit_bytes,
                           default_m=num_microbatches is None and global_batch_size is None,
                           rescaled=setting.profile is not profile) + granularity_notes
    # The setting's profile: the same blocks, its micro-batch size rescaled when m varied.
    plan = plan_from_split(setting.profile, setting.setup, best.evaluated, partition=partition,
                           solver=dataclasses.asdict(best.solver),
                           baselines=_baseline_json(best.evaluated, baselines), notes=notes)
    finer = profile.setup.granularity != "layer" or any(parse_shard(b.name)
                                                        for b in profile.blocks)
    kept = "quarter" if profile.setup.granularity == "quarter" else "sublayer"
    return dataclasses.replace(plan, granularity=kept if finer else "layer")


def _target_rules(target: str, schedule: str | Sequence[str],
                  cut_kinds: Sequence[str] | None, pp_size: int,
                  num_microbatches: int | None) -> tuple[Any, Sequence[str] | None]:
    """The schedules and cut kinds an export target allows (explicit cut kinds win)."""
    rules = planning_constraints(target)
    schedule = rules.schedules_for(schedule, pp_size=pp_size, num_microbatches=num_microbatches)
    return schedule, rules.cut_kinds if cut_kinds is None else cut_kinds


def _search(settings: dict[int, Setting], configs: list[Config], options: Options,
            progress: Callable[[int, int, str], None] | None) -> Candidate:
    """The fastest fitting candidate over ``configs``, refined; raises when none fits."""
    found: list[Candidate] = []
    total = len(configs) + 1
    trend = _VirtualTrend()
    for done, config in enumerate(configs, 1):
        if not trend.stopped(config):
            proposed = propose(settings[config.num_microbatches], config, options)
            trend.record(config, [c for c in proposed if c.evaluated.fits])
            found += proposed
        if progress is not None:
            progress(done, total, config.label)
    fitting = [c for c in found if c.evaluated.fits]
    if not fitting:
        raise _explain.infeasible(settings, configs, found, options)
    if options.partition == "optimal" and options.refine_evals > 0:
        fitting = _refined(settings, fitting, options.refine_evals)
    if progress is not None:
        progress(total, total, "local search")
    return min(fitting, key=lambda c: _rank_key(c.evaluated))


class _VirtualTrend:
    """Stops raising v for a (schedule, m) once two v in a row did worse than the best.

    A larger v shortens the bubble and adds transfers and per-stage overhead; once the
    best fitting candidate got slower twice in a row, larger v are not searched (the
    orders of a large v cost the most to build).
    """

    _PATIENCE = 2

    def __init__(self) -> None:
        self.best: dict[tuple[str, int], float] = {}
        self.worse: dict[tuple[str, int], int] = {}

    def stopped(self, config: Config) -> bool:
        """Has this (schedule, m) stopped raising v?"""
        return self.worse.get((config.schedule, config.num_microbatches), 0) >= self._PATIENCE

    def record(self, config: Config, fitting: list[Candidate]) -> None:
        """Note the fastest fitting candidate of ``config`` (none: counts as worse)."""
        key = (config.schedule, config.num_microbatches)
        step = min((c.evaluated.result.step_ms for c in fitting), default=math.inf)
        if step < self.best.get(key, math.inf):
            self.best[key], self.worse[key] = step, 0
        else:
            self.worse[key] = self.worse.get(key, 0) + 1


def _check_args(profile: Profile, pp_size: int, partition: str, solver: str,
                virtual_stages: int | str) -> None:
    num_blocks = len(profile.blocks)
    if pp_size < 1:
        raise PlanError(f"pp_size must be >= 1, got {pp_size}")
    if pp_size > num_blocks:
        raise PlanError(f"pp_size ({pp_size}) exceeds the number of blocks ({num_blocks}) in "
                        f"the profile of {profile.model.name!r}; lower --pp to at most "
                        f"{num_blocks} or profile at finer granularity")
    if partition not in PARTITIONS:
        raise PlanError(f"unknown partition {partition!r}; choose one of {', '.join(PARTITIONS)}")
    if solver not in SOLVERS:
        raise PlanError(f"unknown solver {solver!r}; choose one of {', '.join(SOLVERS)}")
    if virtual_stages != "auto":
        if not isinstance(virtual_stages, int) or virtual_stages < 1:
            raise PlanError(f"virtual_stages must be 'auto' or an integer >= 1, "
                            f"got {virtual_stages!r}")
        if pp_size * virtual_stages > num_blocks:
            raise PlanError(f"pp_size * virtual_stages ({pp_size} * {virtual_stages}) exceeds "
                            f"the number of blocks ({num_blocks}); lower --virtual-stages or "
                            f"--pp")


def _refined(settings: dict[int, Setting], fitting: list[Candidate],
             max_evals: int) -> list[Candidate]:
    """Local search from every distinct candidate of each of the best few configurations.

    Every seed is refined on its own (a hill-climb's end depends on its start), so a
    better seed can only add a better end point, never take one away. Seeds run fastest
    first, each with ``max_evals`` simulations, until the search has simulated
    ``_REFINE_NODE_BUDGET`` DAG nodes in all (see there: it binds only at scale).
    """
    ranked = sorted(fitting, key=lambda c: _rank_key(c.evaluated))
    top: list[Config] = []
    for cand in ranked:
        config = Config.of(cand.evaluated)
        if config not in top:
            top.append(config)
    top = top[:_NUM_REFINED]
    out = list(fitting)
    judges = {config: ConfigJudge(settings[config.num_microbatches], config) for config in top}
    visited: dict[Config, set] = {config: set() for config in top}
    nodes_left = _REFINE_NODE_BUDGET
    for cand in ranked:
        config, ev = Config.of(cand.evaluated), cand.evaluated
        if config not in top:
            continue
        judge = judges[config]
        affordable = min(max_evals, nodes_left // judge.num_nodes)
        if affordable <= 0:
            break
        better, spent = refine_counted(judge, ev, judge.setting.allowed, max_evals=affordable,
                                       visited=visited[config])
        nodes_left -= spent * judge.num_nodes
        if better is not ev:
            gain = ev.result.step_ms / better.result.step_ms - 1
            out.append(Candidate(better, dataclasses.replace(
                cand.solver, refined=True, refine_gain=round(gain, 6))))
    return out


def _rank_key(item: Evaluated) -> tuple:
    order = list(SCHEDULES).index(item.schedule)
    return (round(item.result.step_ms, 9), order, item.virtual_stages,
            item.num_microbatches, item.bounds, item.recompute)


def _baselines(setting: Setting, best: Evaluated) -> dict[str, Evaluated]:
    """Every public baseline under the winner's schedule, v and m, at allowed cuts."""
    config = Config.of(best)
    return {name: setting.evaluate(config, setting.baseline(name, config.num_stages))
            for name in BASELINES}


def _baseline_json(best: Evaluated, baselines: dict[str, Evaluated]) -> dict[str, dict]:
    out = {}
    for name, ev in baselines.items():
        step = ev.result.step_ms
        out[name] = {"predicted_step_ms": step,
                     "speedup": step / best.result.step_ms if best.result.step_ms > 0 else 1.0,
                     "fits": ev.fits, "peak_memory_bytes": ev.peak_memory_bytes,
                     "stage_num_blocks": [j - i for i, j in ev.bounds]}
    return out
