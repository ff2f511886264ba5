"""Search schedule x virtual stages x microbatches on one mesh (``plan_pipeline``).

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

from autopart.errors import PlanError
from autopart.schedules import SCHEDULES
from autopart.schema import Plan, Profile
from autopart.solve import _explain
from autopart.solve.assemble import plan_from_split
from autopart.solve.baselines import BASELINES
from autopart.solve.choices import plan_levels
from autopart.solve.cuts import cut_bounds
from autopart.solve.options import PlanOptions
from autopart.solve.propose import propose, second_opinion
from autopart.solve.records import Candidate, Config, Evaluated, Options
from autopart.solve.refine import legal, refine_counted
from autopart.solve.request import Request, resolve_request
from autopart.solve.setting import ConfigJudge, Setting, build_settings, search_configs

__all__ = ["PARTITIONS", "SOLVERS"]

PARTITIONS = ("optimal", *BASELINES)
SOLVERS = ("auto", "dp", "ilp")
_NUM_REFINED = 3
"""How many of the best (schedule, v, m) candidates the local search refines."""
_SEEDS_PER_CONFIG = 3
"""How many of a refined configuration's fastest distinct splits the local search starts
from (the DP's at each level, the ILP's and the baselines' are often the same few)."""
_REFINE_NODE_BUDGET = 100_000_000
"""DAG nodes (``simulate.levels``) the local search may simulate in all, a bound on its
work that binds only at scale (a heuristic, deterministic on every machine): a step of
pp 8, m 32 has ~10^4 nodes, so 300 simulations of each of 12 seeds stay far below it;
at pp 64, m 256, v 4 (3.3 * 10^5 nodes) it allows ~300 simulations, spent on the
fastest seeds. There a climb from a seed 5-15% behind moves one cut by one block per
simulation and spent its 300 without reaching the front, most of the plan's time."""


def plan_pipeline(profile: Profile, options: PlanOptions,
                  progress: Callable[[int, int, str], None] | None = None) -> Plan:
    """``make_plan`` on one mesh (``options.devices`` unset): the fastest pipeline of
    ``profile`` that fits memory, at every level ``options`` asks for.

    Args:
        profile: Per-block costs.
        options: What to plan.
        progress: ``progress(done, total, what)`` after each searched configuration.

    Returns:
        The plan, with the baselines simulated beside it.
    """
    request = resolve_request(profile, options)
    return plan_levels(profile, request, _plan_at, progress)


def scan_plan(profile: Profile, options: PlanOptions) -> Plan:
    """``make_plan`` as a quick estimate, to rank the meshes of a cluster: the DP's split
    alone (no baselines as seeds, no ILP, no local search); the baselines are still
    simulated beside the plan."""
    request = resolve_request(profile, dataclasses.replace(options, refine_evals=0))
    request = dataclasses.replace(request, search=dataclasses.replace(
        request.search, baseline_seeds=False,
        solver="dp" if options.solver == "auto" else options.solver))
    return plan_levels(profile, request, _plan_at, None)


def _plan_at(profile: Profile, request: Request, configs: Sequence[Config] | None,
             progress: Callable[[int, int, str], None] | None) -> tuple[Plan, list[Config]]:
    """The plan of ``profile`` (blocks at one level) under ``request``, searched over
    ``configs`` (``None``: every configuration), and the configurations ranked by their
    best fitting candidate."""
    opts = request.options
    pp_size = opts.pp_size
    assert pp_size is not None
    _check_args(profile, pp_size, opts.partition, opts.solver, request.virtual_stages)
    given, virtual_stages = None, request.virtual_stages
    partition = opts.partition
    if opts.cuts is not None:
        given, virtual_stages = cut_bounds(profile, opts.cuts, pp_size, virtual_stages)
        partition = "cuts"
    search = dataclasses.replace(request.search, partition=partition, cuts=given)
    settings = build_settings(profile, pp_size, opts.num_microbatches, opts.global_batch_size,
                              request.memory_limit_bytes, request.setup_fields,
                              request.cut_kinds)
    if given is not None and not legal(given, next(iter(settings.values())).allowed):
        raise PlanError(f"--cuts cuts inside a unit {opts.target or 'the cut kinds'} keeps "
                        f"whole (allowed after {'/'.join(request.cut_kinds or ())} blocks "
                        f"only); move the cuts")
    num_units = min(setting.chain.num_blocks for setting in settings.values())
    configs = [c for c in configs or () if c.num_stages <= num_units
               and c.num_microbatches in settings]
    if not configs:  # every configuration, or the carried ones need more blocks
        configs = search_configs(num_units, pp_size, request.schedule, virtual_stages,
                                 sorted(settings))
    best, ranked = _search(settings, list(configs), search, progress)
    setting = settings[best.evaluated.num_microbatches]
    baselines = _baselines(setting, best.evaluated)
    notes = _explain.notes(setting.profile, best.evaluated, baselines,
                           request.memory_limit_bytes,
                           default_m=opts.num_microbatches is None
                           and opts.global_batch_size is None,
                           rescaled=setting.profile is not profile)
    # The setting's profile: the same blocks, its micro-batch size rescaled when m varied.
    plan = plan_from_split(setting.profile, setting.setup, best.evaluated, partition=partition,
                           solver=dataclasses.asdict(best.solver),
                           baselines=_baseline_json(best.evaluated, baselines), notes=notes)
    return plan, ranked


def _search(settings: dict[int, Setting], configs: list[Config], options: Options,
            progress: Callable[[int, int, str], None] | None
            ) -> tuple[Candidate, list[Config]]:
    """The fastest fitting candidate over ``configs``, refined, and the configurations
    ranked by their fastest fitting candidate; raises when none fits."""
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
    for config in _best_configs(fitting):
        fitting += [c for c in second_opinion(settings[config.num_microbatches], config,
                                              options) if c.evaluated.fits]
    if not fitting:
        raise _explain.infeasible(settings, configs, found, options)
    if options.partition == "optimal" and options.refine_evals > 0:
        fitting = _refined(settings, fitting, options.refine_evals)
    if progress is not None:
        progress(total, total, "local search")
    ranked = sorted(fitting, key=lambda c: _rank_key(c.evaluated))
    return ranked[0], list(dict.fromkeys(Config.of(c.evaluated) for c in ranked))


def _best_configs(candidates: list[Candidate]) -> list[Config]:
    """The ``_NUM_REFINED`` configurations of the fastest candidates, best first."""
    ranked = sorted(candidates, key=lambda c: _rank_key(c.evaluated))
    return list(dict.fromkeys(Config.of(c.evaluated) for c in ranked))[:_NUM_REFINED]


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
        raise PlanError(f"pp_size ({pp_size}) exceeds the number of blocks ({num_blocks}) of "
                        f"{profile.model.name!r} at the {profile.setup.granularity} level; "
                        f"lower --pp to at most {num_blocks}, or plan and profile at a finer "
                        f"level (the defaults of `autopart plan` and `autopart profile`)")
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
    """Local search from the fastest distinct candidates of each of the best few
    configurations (``_SEEDS_PER_CONFIG`` each).

    Every seed is refined on its own (a hill-climb's end depends on its start), so a
    better seed can only add a better end point, never take one away. Seeds run fastest
    first, each with ``max_evals`` simulations, until the search has simulated
    ``_REFINE_NODE_BUDGET`` DAG nodes in all (see there: it binds only at scale).
    """
    ranked = sorted(fitting, key=lambda c: _rank_key(c.evaluated))
    top = _best_configs(ranked)
    out = list(fitting)
    judges = {config: ConfigJudge(settings[config.num_microbatches], config) for config in top}
    visited: dict[Config, set] = {config: set() for config in top}
    seeds: dict[Config, set] = {config: set() for config in top}
    nodes_left = _REFINE_NODE_BUDGET
    for cand in ranked:
        config, ev = Config.of(cand.evaluated), cand.evaluated
        if config not in top or len(seeds[config]) >= _SEEDS_PER_CONFIG or \
                (ev.bounds, ev.recompute) in seeds[config]:
            continue
        seeds[config].add((ev.bounds, ev.recompute))
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
    evaluated = setting.evaluate_many(config, [(setting.baseline(name, config.num_stages), None)
                                               for name in BASELINES])
    return dict(zip(BASELINES, evaluated, strict=True))


def _baseline_json(best: Evaluated, baselines: dict[str, Evaluated]) -> dict[str, dict]:
    out = {}
    for name, ev in baselines.items():
        step = ev.result.step_ms
        out[name] = {"predicted_step_ms": step,
                     "speedup": step / best.result.step_ms if best.result.step_ms > 0 else 1.0,
                     "fits": ev.fits, "peak_memory_bytes": ev.peak_memory_bytes,
                     "stage_num_blocks": [j - i for i, j in ev.bounds]}
    return out
