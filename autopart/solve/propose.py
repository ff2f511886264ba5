"""One proposer per method: each turns a ``Setting`` and a ``Config`` into simulated
``Candidate`` splits (an empty list when the method finds none that fits)."""

from __future__ import annotations

from autopart.errors import PlanError
from autopart.schedules import recompute_allowed, schedule_info, stage_to_rank
from autopart.schema import Profile, SolverInfo
from autopart.simulate import max_in_flight
from autopart.solve.baselines import BASELINES
from autopart.solve.chain import Chain
from autopart.solve.dp import solve_dp
from autopart.solve.ilp import ILPLimits, solve_ilp
from autopart.solve.records import Candidate, Config, Options
from autopart.solve.setting import Setting

__all__ = []

ILP_AUTO_MAX_CELLS = 2048
"""``solver="auto"`` adds the ILP for v > 1 when blocks x stages of the coarsest chain is
at most this (``second_opinion``)."""


def propose(setting: Setting, config: Config, options: Options) -> list[Candidate]:
    """Every candidate ``options`` asks for under ``config``.

    A baseline ``partition`` gives that split alone, as do user ``cuts``. ``optimal``
    gives the solvers' splits, then the baselines as seeds for the local search
    (listed after the solvers so that ties credit the solvers).
    """
    if options.cuts is not None:
        return [Candidate(setting.evaluate(config, options.cuts),
                          SolverInfo(name="cuts", status="given"))]
    if options.partition != "optimal":
        bounds = setting.baseline(options.partition, config.num_stages)
        return [Candidate(setting.evaluate(config, bounds),
                          SolverInfo(name=options.partition, status="heuristic"))]
    out = []
    if options.solver in ("auto", "dp"):
        out += propose_dp(setting, config, options)
    if options.solver == "ilp":
        out += propose_ilp(setting, config, options)
    return out + (propose_baselines(setting, config) if options.baseline_seeds else [])


def second_opinion(setting: Setting, config: Config, options: Options) -> list[Candidate]:
    """``solver="auto"``: the ILP's split for a multi-stage configuration, on the coarsest
    chain (whole layers and head when the profile is cut inside them) if it has at most
    ``ILP_AUTO_MAX_CELLS`` blocks x stages and does not cut the head into shards (where
    whole layers are too few for the stages); its exact rank sums seed the local search
    on the finer chain. The search asks for it on its best configurations only."""
    if options.solver != "auto" or config.virtual_stages == 1 or options.cuts is not None \
            or options.partition != "optimal":
        return []
    chain, starts = setting.coarser[-1] if setting.coarser else (setting.chain, setting.starts)
    if config.num_stages > chain.num_blocks or \
            chain.num_blocks * config.num_stages > ILP_AUTO_MAX_CELLS or \
            _cuts_inside_head(setting.profile, starts):
        return []
    return propose_ilp(setting, config, options, chain, starts)


def _cuts_inside_head(profile: Profile, starts: tuple[int, ...]) -> bool:
    """Whether a chain (its blocks' original ``starts``) may cut between vocabulary shards
    of the head: the ILP of such a chain is symmetric in its identical shards, and HiGHS
    spent 10-25 s a problem proving what the DP had found (tiny-llama at pp 8 under
    Interleaved 1F1B, where whole layers are too few for the stages: the same plan in
    7 s without it, 120-340 s with it)."""
    blocks = profile.blocks
    return sum(1 for i in starts[:-1]
               if blocks[i].parts and blocks[i].parts[-1].axis == "vocab") > 1


def _recompute_allowed(config: Config, options: Options) -> bool:
    """``schedules.recompute_allowed`` (none under split-backward schedules)."""
    return recompute_allowed(config.schedule, options.allow_recompute)


def propose_dp(setting: Setting, config: Config, options: Options) -> list[Candidate]:
    """The DP's split (exact for its closed form: one stage per rank's slowest stage),
    then its splits at the coarser cuts of ``setting.coarser`` (``layer_optimal``): the
    closed form prices transfers as a bound, so on a chain of parts whose cuts carry
    large tensors its finest split can simulate slower than the coarser one it contains."""
    in_flight = max_in_flight(config.schedule, config.pp_size, config.virtual_stages,
                              config.num_microbatches)
    limit = setting.setup.memory_limit_bytes
    per_stage = None if limit is None else limit / config.virtual_stages
    v = config.virtual_stages
    found = []
    levels = [(setting.chain, setting.starts, "model_optimal"),
              *((chain, starts, "layer_optimal") for chain, starts in setting.coarser)]
    for chain, starts, status in levels:
        if chain.num_blocks < config.num_stages:
            continue
        dp = solve_dp(chain, num_stages=config.num_stages, in_flight=in_flight,
                      limits_bytes=[per_stage] * config.num_stages,
                      weight=v * v * (config.num_microbatches - 1),
                      allow_recompute=_recompute_allowed(config, options),
                      blocking=schedule_info(config.schedule).blocking_sends,
                      split=schedule_info(config.schedule).split_backward)
        if dp is None:
            continue
        found.append(((tuple((starts[i], starts[j]) for i, j in dp.bounds), dp.recompute),
                      SolverInfo(name="dp", status=status, gap=0.0,
                                 objective_ms=dp.objective_ms)))
    evaluated = setting.evaluate_many(config, [split for split, _ in found])
    return [Candidate(ev, info) for ev, (_, info) in zip(evaluated, found, strict=True)]


def propose_ilp(setting: Setting, config: Config, options: Options,
                chain: Chain | None = None, starts: tuple[int, ...] | None = None
                ) -> list[Candidate]:
    """The ILP's split (exact rank sums for v > 1) of ``chain`` (default: the setting's;
    ``starts``: the original position of its blocks). Under ``solver="auto"`` only a
    proven optimum counts: a split the node limit stopped at is not a second opinion."""
    coarser = chain is not None and chain is not setting.chain
    chain = chain if chain is not None else setting.chain
    starts = starts if starts is not None else setting.starts
    style = schedule_info(config.schedule).style
    ranks = [stage_to_rank(s, config.pp_size, config.virtual_stages, style)
             for s in range(config.num_stages)]
    in_flight = max_in_flight(config.schedule, config.pp_size, config.virtual_stages,
                              config.num_microbatches)
    try:
        ilp = solve_ilp(chain, stage_ranks=ranks, in_flight=in_flight,
                        num_microbatches=config.num_microbatches,
                        limit_bytes=setting.setup.memory_limit_bytes,
                        allow_recompute=_recompute_allowed(config, options),
                        limits=ILPLimits(options.ilp_backend, options.ilp_max_nodes,
                                         options.ilp_time_limit_s))
    except ValueError as exc:
        raise PlanError(str(exc)) from None
    if ilp is None or (options.solver != "ilp" and ilp.status != "optimal"):
        return []
    ev = setting.evaluate(config, tuple((starts[i], starts[j]) for i, j in ilp.bounds),
                          ilp.recompute)
    status = ("layer_optimal" if coarser else "model_optimal") if ilp.status == "optimal" \
        else ilp.status
    return [Candidate(ev, SolverInfo(name="ilp", status=status, gap=ilp.gap,
                                     backend=ilp.backend, objective_ms=ilp.objective_ms))]


def propose_baselines(setting: Setting, config: Config) -> list[Candidate]:
    """Every public baseline split, at allowed cuts, as seeds."""
    evaluated = setting.evaluate_many(config, [(setting.baseline(name, config.num_stages), None)
                                               for name in BASELINES])
    return [Candidate(ev, SolverInfo(name=name, status="baseline"))
            for name, ev in zip(BASELINES, evaluated, strict=True)]
