"""Search schedule x virtual stages x microbatches; the public ``make_plan``.

For every allowed combination the chosen partition method proposes splits (DP,
ILP, and the public baselines as seeds), the simulator runs them, and the best
few are refined by a simulator-driven local search (``refine``); the fastest
split that fits wins, so it is never slower than a baseline it could have been.
Ties break by schedule order in ``autopart.schedules.SCHEDULES``, then fewer
virtual stages, then fewer microbatches, so the plan is deterministic. The
baselines are simulated under the winner's schedule, v and m.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from autopart.cost import BlockArrays, block_arrays
from autopart.errors import PlanError, SchemaError
from autopart.schedules import SCHEDULES, check_schedule, schedule_info, stage_to_rank
from autopart.schema import Plan, Profile, TrainingSetup, setup_fields_with_precision
from autopart.simulate import max_in_flight
from autopart.solve import _explain
from autopart.solve.assemble import Evaluated, evaluate_split, plan_from_split
from autopart.solve.baselines import BASELINES, baseline_split
from autopart.solve.chain import Chain, build_chain
from autopart.solve.dp import solve_dp
from autopart.solve.ilp import solve_ilp
from autopart.solve.refine import allowed_cuts, fuse_blocks, legal, refine
from autopart.targets import planning_constraints

__all__ = ["PARTITIONS", "SOLVERS", "make_plan"]

_LOG = logging.getLogger(__name__)

PARTITIONS = ("optimal", *BASELINES)
SOLVERS = ("auto", "dp", "ilp")
_AUTO_VIRTUAL = (2, 4, 8)
_ILP_AUTO_MAX_CELLS = 2048
"""``solver="auto"`` adds the ILP for v > 1 when blocks x stages is at most this."""
_ILP_TIME_LIMIT_S = 60.0
_ILP_AUTO_TIME_LIMIT_S = 5.0
"""Per-ILP time limits for ``solver="ilp"`` and ``solver="auto"`` (a limit hit is reported
with its gap in ``Plan.solver``)."""
_NUM_REFINED = 3
"""How many of the best (schedule, v, m) candidates the local search refines."""


@dataclass(frozen=True, slots=True)
class _Setting:
    """One microbatch count: the (possibly rescaled) profile and its solver inputs."""

    profile: Profile
    setup: TrainingSetup
    arrays: BlockArrays
    chain: Chain
    """The solvers' chain, over fused blocks when cuts are restricted."""
    starts: tuple[int, ...]
    """Original block position of every fused block of ``chain`` (plus ``n``)."""
    allowed: tuple[bool, ...]
    """``allowed[j]``: a stage may end after block ``j - 1``."""

    def unfuse(self, bounds: Sequence[tuple[int, int]]) -> tuple[tuple[int, int], ...]:
        """Fused-chain bounds -> bounds over the original blocks."""
        return tuple((self.starts[i], self.starts[j]) for i, j in bounds)


def make_plan(profile: Profile, *, pp_size: int, num_microbatches: int | None = None,
              global_batch_size: int | None = None, schedule: str | Sequence[str] = "auto",
              virtual_stages: int | str = "auto", partition: str = "optimal",
              solver: str = "auto", memory_limit_bytes: int | None = None,
              allow_recompute: bool = True, ilp_backend: str = "auto",
              ilp_time_limit_s: float | None = None, cut_kinds: Sequence[str] | None = None,
              refine_evals: int = 300, target: str | None = None,
              progress: Callable[[int, int, str], None] | None = None,
              **setup_fields: Any) -> Plan:
    """Plan the pipeline of ``profile`` on ``pp_size`` ranks.

    ``num_microbatches`` fixes m; else ``global_batch_size`` (samples per step and
    data-parallel replica) allows every m dividing it, rescaling the profile's
    per-microbatch costs linearly to ``global_batch_size / m`` samples; with neither,
    m = 4 * pp. ``schedule`` is a name, a list of names, or ``"auto"``;
    ``schedule`` / ``virtual_stages`` ``"auto"`` try every schedule and
    v in (2, 4, 8) that torch accepts. ``partition``: ``optimal`` (``solver``: dp,
    ilp, or auto = DP, plus the ILP for small multi-stage problems) or a baseline
    (even, params, torchtitan). ``cut_kinds`` restricts cuts to after blocks of
    those kinds (NxD: ``("decoder_layer",)``). ``target`` (an export format: ``nxd``,
    ``megatron``, ...) plans within that tool's rules (``autopart.targets``): its cut
    kinds unless ``cut_kinds`` is given, and its schedules. ``refine_evals`` bounds the
    local search's simulations per refined candidate (0 turns it off). ``ilp_time_limit_s``
    defaults to 60 s per ILP with ``solver="ilp"`` and 5 s with ``"auto"``.
    ``setup_fields`` go to ``TrainingSetup`` (optimizer, dtypes, link figures, ...);
    ``precision`` (a ``PRECISIONS`` preset) sets the dtypes, by default the profile dtype's.
    ``progress(done, total, what)`` is called after each (schedule, v, m) is searched
    and once more after the local search. Raises ``PlanError`` for bad settings and
    ``InfeasibleError`` (with the memory that would fit) when nothing fits.
    """
    if target is not None:
        rules = planning_constraints(target)
        schedule = rules.schedules_for(schedule, pp_size=pp_size,
                                       num_microbatches=num_microbatches)
        cut_kinds = rules.cut_kinds if cut_kinds is None else cut_kinds
    _check_args(profile, pp_size, partition, solver, virtual_stages)
    if ilp_time_limit_s is None:
        # Under "auto" the ILP is a second opinion beside the DP: keep it short.
        ilp_time_limit_s = _ILP_TIME_LIMIT_S if solver == "ilp" else _ILP_AUTO_TIME_LIMIT_S
    settings = _settings(profile, pp_size, num_microbatches, global_batch_size,
                         memory_limit_bytes, setup_fields, cut_kinds)
    num_units = min(setting.chain.num_blocks for setting in settings.values())
    configs = _configs(num_units, pp_size, schedule, virtual_stages, sorted(settings))
    found: list[tuple[Evaluated, dict]] = []
    for done, (name, num_virtual, m) in enumerate(configs, 1):
        found += _propose(settings[m], name, pp_size, num_virtual, m, partition, solver,
                          allow_recompute, ilp_backend, ilp_time_limit_s)
        if progress is not None:
            progress(done, len(configs) + 1, f"{name} v={num_virtual} m={m}")
    fitting = [item for item in found if item[0].fits]
    if not fitting:
        raise _explain.infeasible(settings, configs, found, pp_size, memory_limit_bytes,
                                  partition, allow_recompute)
    if partition == "optimal" and refine_evals > 0:
        fitting = _refined(settings, fitting, refine_evals)
    if progress is not None:
        progress(len(configs) + 1, len(configs) + 1, "local search")
    best, solver_info = min(fitting, key=lambda item: _rank_key(item[0]))
    setting = settings[best.num_microbatches]
    baselines = _baselines(setting, best)
    notes = _explain.notes(setting.profile, best, baselines, memory_limit_bytes,
                           default_m=num_microbatches is None and global_batch_size is None,
                           rescaled=setting.profile is not profile)
    # The setting's profile: the same blocks, its micro-batch size rescaled when m varied.
    return plan_from_split(setting.profile, setting.setup, best, partition=partition,
                           solver=solver_info, baselines=_baseline_json(best, baselines),
                           notes=notes)


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


def _settings(profile: Profile, pp_size: int, num_microbatches: int | None,
              global_batch_size: int | None, memory_limit_bytes: int | None,
              setup_fields: dict[str, Any], cut_kinds: Sequence[str] | None
              ) -> dict[int, _Setting]:
    """One ``_Setting`` per candidate microbatch count."""
    if num_microbatches is not None:
        counts = {num_microbatches: None}
    elif global_batch_size is not None:
        if global_batch_size < 1:
            raise PlanError(f"global_batch_size must be >= 1, got {global_batch_size}")
        counts = {m: global_batch_size // m for m in range(1, global_batch_size + 1)
                  if global_batch_size % m == 0}
    else:
        counts = {4 * pp_size: None}
    try:
        setup_fields = setup_fields_with_precision(setup_fields, profile.setup.dtype)
    except SchemaError as exc:
        raise PlanError(f"bad training setup: {exc}") from None
    out = {}
    for m, samples in counts.items():
        try:
            setup = TrainingSetup(pp_size=pp_size, num_microbatches=m,
                                  memory_limit_bytes=memory_limit_bytes, **setup_fields)
        except (TypeError, SchemaError) as exc:
            raise PlanError(f"bad training setup: {exc}") from None
        scaled = profile if samples is None else _rescaled(profile, samples)
        if cut_kinds is not None and not any(b.kind in cut_kinds for b in scaled.blocks):
            raise PlanError(f"the profile of {profile.model.name!r} has no {'/'.join(cut_kinds)} "
                            f"blocks to cut after; this export needs an HF decoder-only model")
        allowed = allowed_cuts(scaled, cut_kinds)
        fused, starts = fuse_blocks(scaled, allowed)
        if len(fused.blocks) < pp_size:
            raise PlanError(f"only {len(fused.blocks)} cut positions allow {cut_kinds} cuts, "
                            f"fewer than pp_size ({pp_size}); lower --pp")
        out[m] = _Setting(scaled, setup, block_arrays(scaled, setup),
                          build_chain(block_arrays(fused, setup), setup), tuple(starts),
                          tuple(allowed))
    return out


def _rescaled(profile: Profile, micro_batch_size: int) -> Profile:
    """The profile with per-microbatch times and activations scaled to a new batch size."""
    factor = micro_batch_size / profile.setup.micro_batch_size
    if factor == 1:
        return profile
    blocks = tuple(dataclasses.replace(
        b, fwd_ms=b.fwd_ms * factor, bwd_ms=b.bwd_ms * factor,
        bwd_input_ms=b.bwd_input_ms * factor, bwd_weight_ms=b.bwd_weight_ms * factor,
        activation_bytes=round(b.activation_bytes * factor),
        output_bytes=round(b.output_bytes * factor),
        transient_bytes=round(b.transient_bytes * factor)) for b in profile.blocks)
    setup = dataclasses.replace(profile.setup, micro_batch_size=micro_batch_size)
    return dataclasses.replace(profile, blocks=blocks, setup=setup)


def _configs(num_units: int, pp_size: int, schedule: str | Sequence[str],
             virtual_stages: int | str,
             counts: list[int]) -> list[tuple[str, int, int]]:
    """Every (schedule, v, m) torch accepts; raises the first reason when none is left."""
    if isinstance(schedule, str):
        names = list(SCHEDULES) if schedule == "auto" else [schedule_info(schedule).name]
    else:
        names = [schedule_info(name).name for name in schedule]
    configs, reasons = [], []
    for name in names:
        info = SCHEDULES[name]
        if virtual_stages != "auto":
            options = [virtual_stages]
        elif info.fixed_virtual_stages is not None:
            options = [info.fixed_virtual_stages]
        else:
            options = list(_AUTO_VIRTUAL)
        for num_virtual in options:
            if pp_size * num_virtual > num_units:
                reasons.append(f"{name} with v={num_virtual} needs {pp_size * num_virtual} "
                               f"stages, the profile allows {num_units} (blocks, or cut "
                               f"positions under cut_kinds); lower --pp or --virtual-stages")
                continue
            for m in counts:
                try:
                    check_schedule(name, pp_size, num_virtual, m)
                except PlanError as exc:
                    reasons.append(str(exc))
                    continue
                configs.append((name, num_virtual, m))
    if not configs:
        raise PlanError(reasons[0] if reasons else f"no schedule fits pp_size={pp_size}")
    return configs


def _propose(setting: _Setting, name: str, pp_size: int, num_virtual: int, m: int,
             partition: str, solver: str, allow_recompute: bool, ilp_backend: str,
             ilp_time_limit_s: float) -> list[tuple[Evaluated, dict]]:
    """Candidate splits for one configuration, simulated (empty when none fits)."""
    num_stages = pp_size * num_virtual
    common = {"schedule": name, "pp_size": pp_size, "virtual_stages": num_virtual,
                  "num_microbatches": m}
    if partition != "optimal":
        bounds = baseline_split(partition, setting.profile.blocks, num_stages)
        return [(evaluate_split(setting.arrays, setting.setup, bounds=bounds, **common),
                 {"name": partition, "status": "heuristic"})]
    # The baselines seed the local search; listed after the solvers so ties credit them.
    seeds = [(evaluate_split(setting.arrays, setting.setup, bounds=bounds, **common),
              {"name": name, "status": "baseline"})
             for name in BASELINES
             if legal(bounds := tuple(baseline_split(name, setting.profile.blocks, num_stages)),
                      setting.allowed)]
    out = []
    in_flight = max_in_flight(name, pp_size, num_virtual, m)
    limit = setting.setup.memory_limit_bytes
    # Split-backward schedules run B and W as separate autograd passes, and each pass
    # re-runs a checkpointed stage's forward: recomputation costs several forwards there.
    allow_recompute = allow_recompute and not schedule_info(name).split_backward
    if solver in ("auto", "dp"):
        per_stage = None if limit is None else limit / num_virtual
        dp = solve_dp(setting.chain, num_stages=num_stages, in_flight=in_flight,
                      limits_bytes=[per_stage] * num_stages,
                      weight=num_virtual * num_virtual * (m - 1),
                      allow_recompute=allow_recompute)
        if dp is not None:
            out.append((evaluate_split(setting.arrays, setting.setup,
                                       bounds=setting.unfuse(dp.bounds),
                                       recompute=dp.recompute, **common),
                        {"name": "dp", "status": "optimal", "gap": 0.0,
                         "objective_ms": dp.objective_ms}))
    cells = setting.chain.num_blocks * num_stages
    if solver == "ilp" or (solver == "auto" and num_virtual > 1
                           and cells <= _ILP_AUTO_MAX_CELLS):
        style = schedule_info(name).style
        ranks = [stage_to_rank(s, pp_size, num_virtual, style) for s in range(num_stages)]
        try:
            ilp = solve_ilp(setting.chain, stage_ranks=ranks, in_flight=in_flight,
                            num_microbatches=m, limit_bytes=limit,
                            allow_recompute=allow_recompute, backend=ilp_backend,
                            time_limit_s=ilp_time_limit_s)
        except ValueError as exc:
            raise PlanError(str(exc)) from None
        # Under "auto" only a proven optimum counts: an incumbent cut off by the time
        # limit depends on machine speed, and plans must be byte-identical run to run.
        if ilp is not None and (solver == "ilp" or ilp.status == "optimal"):
            out.append((evaluate_split(setting.arrays, setting.setup,
                                       bounds=setting.unfuse(ilp.bounds),
                                       recompute=ilp.recompute, **common),
                        {"name": "ilp", "status": ilp.status, "gap": ilp.gap,
                         "backend": ilp.backend, "objective_ms": ilp.objective_ms}))
    return out + seeds


def _refined(settings: dict[int, _Setting], fitting: list[tuple[Evaluated, dict]],
             max_evals: int) -> list[tuple[Evaluated, dict]]:
    """Local search from the best candidate of each of the best few configurations."""
    best_per_config: dict[tuple, tuple[Evaluated, dict]] = {}
    for item in sorted(fitting, key=lambda item: _rank_key(item[0])):
        ev = item[0]
        best_per_config.setdefault((ev.schedule, ev.virtual_stages, ev.num_microbatches), item)
    out = list(fitting)
    for ev, info in list(best_per_config.values())[:_NUM_REFINED]:
        setting = settings[ev.num_microbatches]

        def evaluate(bounds, recompute, ev=ev, setting=setting):
            return evaluate_split(setting.arrays, setting.setup, schedule=ev.schedule,
                                  pp_size=ev.pp_size, virtual_stages=ev.virtual_stages,
                                  num_microbatches=ev.num_microbatches, bounds=bounds,
                                  recompute=recompute)

        better = refine(evaluate, ev, setting.allowed, max_evals=max_evals)
        if better is not ev:
            gain = ev.result.step_ms / better.result.step_ms - 1
            out.append((better, {**info, "refined": True, "refine_gain": round(gain, 6)}))
    return out


def _rank_key(item: Evaluated) -> tuple:
    order = list(SCHEDULES).index(item.schedule)
    return (round(item.result.step_ms, 9), order, item.virtual_stages,
            item.num_microbatches, item.bounds, item.recompute)


def _baselines(setting: _Setting, best: Evaluated) -> dict[str, Evaluated]:
    """Every public baseline under the winner's schedule, v and m."""
    num_stages = best.pp_size * best.virtual_stages
    return {name: evaluate_split(setting.arrays, setting.setup, schedule=best.schedule,
                                 pp_size=best.pp_size, virtual_stages=best.virtual_stages,
                                 num_microbatches=best.num_microbatches,
                                 bounds=baseline_split(name, setting.profile.blocks,
                                                       num_stages))
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
