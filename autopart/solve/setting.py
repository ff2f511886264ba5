"""The search's inputs per microbatch count (``Setting``) and its grid of ``Config``s."""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from autopart.cost.blocks import BlockArrays, block_arrays
from autopart.cost.rank import post_charges_ms
from autopart.cost.stage import StageCost, stage_cost
from autopart.errors import PlanError, SchemaError
from autopart.levels import stage_ends
from autopart.schedules import SCHEDULES, check_schedule, schedule_info
from autopart.schema import (
    LEVELS,
    BlockProfile,
    Profile,
    TrainingSetup,
    setup_fields_with_precision,
)
from autopart.simulate.engine import (
    critical_counts,
    duration_table,
    updated_duration_table,
)
from autopart.simulate.levels import level_plan
from autopart.solve.assemble import evaluate_splits
from autopart.solve.baselines import baseline_split
from autopart.solve.chain import Chain, build_chain
from autopart.solve.records import Config, Evaluated
from autopart.solve.refine import allowed_cuts, fuse_blocks

__all__ = []


@dataclass(frozen=True, slots=True)
class Setting:
    """One microbatch count: the (possibly rescaled) profile and its solver inputs."""

    profile: Profile
    """The profile, its per-microbatch costs rescaled when m varies the micro batch size."""
    setup: TrainingSetup
    """The training setup at this m."""
    arrays: BlockArrays
    """Per-block cost arrays of ``profile`` (the simulator's input)."""
    chain: Chain
    """The solvers' chain, over fused blocks when cuts are restricted."""
    starts: tuple[int, ...]
    """Original block position of every fused block of ``chain`` (plus ``n``)."""
    allowed: tuple[bool, ...]
    """``allowed[j]``: a stage may end after block ``j - 1``."""
    fused_blocks: tuple[BlockProfile, ...]
    """The blocks of ``chain``: runs with no allowed cut inside merged into one."""
    coarser: tuple[tuple[Chain, tuple[int, ...]], ...] = ()
    """For a profile cut inside layers or the head: the solvers' chain with cuts between
    layer halves only and between whole layers only, the head whole (the coarser levels),
    each with the original position of its blocks (plus ``n``). Their DP splits seed the
    search, so that a finer level never plans slower than the coarser split it contains
    would."""

    baselines: dict = field(default_factory=dict, compare=False, repr=False)
    """Cache: ``(name, num_stages)`` -> ``baseline``'s split (configurations with the same
    number of stages share it)."""

    def baseline(self, name: str, num_stages: int) -> tuple[tuple[int, int], ...]:
        """The public tool's split, made over the fused blocks so that its cuts are
        allowed ones (NxD's even split with cuts after decoder layers only). Cached."""
        key = (name, num_stages)
        if key not in self.baselines:
            self.baselines[key] = self.unfuse(baseline_split(name, self.fused_blocks,
                                                             num_stages))
        return self.baselines[key]

    def unfuse(self, bounds: Sequence[tuple[int, int]]) -> tuple[tuple[int, int], ...]:
        """Fused-chain bounds -> bounds over the original blocks."""
        return tuple((self.starts[i], self.starts[j]) for i, j in bounds)

    def evaluate(self, config: Config, bounds: Sequence[tuple[int, int]],
                 recompute: Sequence[bool] | None = None) -> Evaluated:
        """Simulate the split ``bounds`` (original blocks) under ``config`` (``recompute``
        ``None``: no stage recomputes)."""
        return self.evaluate_many(config, [(bounds, recompute)])[0]

    def evaluate_many(self, config: Config,
                      splits: Sequence[tuple[Sequence[tuple[int, int]], Sequence[bool] | None]]
                      ) -> list[Evaluated]:
        """``evaluate`` of several ``(bounds, recompute)`` splits in one vectorized
        simulation (``assemble.evaluate_splits``)."""
        items = []
        for bounds, recompute in splits:
            flags = tuple(recompute) if recompute is not None else (False,) * len(bounds)
            costs = [stage_cost(self.arrays, i, j - 1, r) for (i, j), r in zip(bounds, flags)]
            items.append((tuple(bounds), flags, costs))
        return evaluate_splits(self.setup, config, items)


@dataclass(frozen=True, slots=True)
class ConfigJudge:
    """The local search's view of one configuration (``refine.Judge``)."""

    setting: Setting
    """Where the splits are simulated."""
    config: Config
    """The configuration they are simulated under."""
    stage_costs: dict = field(default_factory=dict)
    """Cache: ``(first, stop, recompute)`` -> ``StageCost``."""

    def evaluate_many(self, splits: Sequence[tuple[Sequence[tuple[int, int]], Sequence[bool]]]
                      ) -> list[Evaluated]:
        """Simulate several ``(bounds, recompute)`` splits under the configuration in one
        vectorized simulation (``assemble.evaluate_splits``), stage costs from the cache:
        the figures of ``Setting.evaluate`` on each, less time per split."""
        return evaluate_splits(self.setting.setup, self.config, [
            (tuple(bounds), tuple(recompute),
             [self.cost(i, j, r) for (i, j), r in zip(bounds, recompute, strict=True)])
            for bounds, recompute in splits])

    @property
    def num_nodes(self) -> int:
        """Nodes of the configuration's step DAG: one simulation's work."""
        config = self.config
        return len(level_plan(config.schedule, config.pp_size, config.virtual_stages,
                              config.num_microbatches).duration_idx)

    def critical(self, current: Evaluated) -> PathBound:
        """The bound from a simulated split's critical path (``simulate.critical_counts``)."""
        config = self.config
        counts = critical_counts(current.stage_costs, schedule=config.schedule,
                                 pp_size=config.pp_size, virtual_stages=config.virtual_stages,
                                 num_microbatches=config.num_microbatches,
                                 setup=self.setting.setup)
        split = schedule_info(config.schedule).split_backward
        charges = post_charges_ms(self.setting.setup, config.schedule, config.pp_size,
                                  config.virtual_stages)
        table = duration_table(current.stage_costs, split, self.setting.setup, charges)
        return PathBound(self, current, counts, table, split, charges)

    def cost(self, first: int, stop: int, recompute: bool) -> StageCost:
        """The (cached) cost of the stage holding blocks ``first .. stop - 1``."""
        key = (first, stop, recompute)
        found = self.stage_costs.get(key)
        if found is None:
            found = self.stage_costs[key] = stage_cost(self.setting.arrays, first, stop - 1,
                                                       recompute)
        return found


@dataclass(frozen=True, slots=True)
class PathBound:
    """One critical path of the current split, to bound the step of its neighbours."""

    judge: ConfigJudge
    """The configuration's judge (stage costs)."""
    current: Evaluated
    """The split whose critical path this is."""
    counts: np.ndarray
    """How often each duration-table entry lies on the path."""
    table: np.ndarray
    """The current split's duration table."""
    split_backward: bool
    """B and W run apart in this schedule."""
    charges: list[float] | None
    """The schedule's per-stage ms on each F and B (``rank_cost.post_charges_ms``)."""

    def __call__(self, bounds: Sequence[tuple[int, int]], recompute: Sequence[bool]) -> float:
        """The path's length under another split's durations (a lower bound on its
        step); only the stages that differ from the current split are recomputed."""
        current = self.current
        changed = [s for s, (b, r) in enumerate(zip(bounds, recompute))
                   if b != current.bounds[s] or r != current.recompute[s]]
        costs = list(current.stage_costs)
        for s in changed:
            costs[s] = self.judge.cost(*bounds[s], recompute[s])
        table = updated_duration_table(self.table, costs, changed, self.split_backward,
                                       self.judge.setting.setup, self.charges)
        return float(self.counts @ table)


def build_settings(profile: Profile, pp_size: int, num_microbatches: int | None,
                   global_batch_size: int | None, memory_limit_bytes: int | None,
                   setup_fields: dict[str, Any], cut_kinds: Sequence[str] | None
                   ) -> dict[int, Setting]:
    """One ``Setting`` per candidate microbatch count (see ``make_plan`` for the rules)."""
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
    setup_fields = _with_machine_check(profile, setup_fields)
    if profile.model.router_loss_pass:
        setup_fields = {"router_loss_pass": True, **setup_fields}
    out = {}
    for m, samples in counts.items():
        try:
            setup = TrainingSetup(pp_size=pp_size, num_microbatches=m,
                                  memory_limit_bytes=memory_limit_bytes, **setup_fields)
        except (TypeError, SchemaError) as exc:
            raise PlanError(f"bad training setup: {exc}") from None
        scaled = profile if samples is None else rescaled(profile, samples)
        if cut_kinds is not None and not any(b.kind in cut_kinds for b in scaled.blocks):
            raise PlanError(f"the profile of {profile.model.name!r} has no {'/'.join(cut_kinds)} "
                            f"blocks to cut after; this export needs an HF decoder-only model")
        allowed = allowed_cuts(scaled, cut_kinds)
        fused, starts = fuse_blocks(scaled, allowed)
        if len(fused.blocks) < pp_size:
            raise PlanError(f"only {len(fused.blocks)} cut positions allow {cut_kinds} cuts, "
                            f"fewer than pp_size ({pp_size}); lower --pp")
        out[m] = Setting(scaled, setup, block_arrays(scaled, setup),
                         build_chain(block_arrays(fused, setup), setup), tuple(starts),
                         tuple(allowed), fused.blocks,
                         coarser=_coarser_chains(scaled, allowed, setup, pp_size))
    return out


def _coarser_chains(profile: Profile, allowed: Sequence[bool], setup: TrainingSetup,
                    pp_size: int) -> tuple[tuple[Chain, tuple[int, ...]], ...]:
    """``Setting.coarser``: chains with cuts only where a coarser level allows them
    (``autopart.levels.stage_ends``): ``half``, then ``layer`` with the head whole (the
    coarsest, where ``solver="auto"`` runs its ILP)."""
    level = profile.setup.granularity
    out, seen = [], [list(allowed)]
    for coarser in ("half", "layer"):
        if LEVELS.index(coarser) > LEVELS.index(level):
            continue
        ends = stage_ends(profile.blocks, coarser, head=coarser != "layer")
        mask = [ok and end for ok, end in zip(allowed, ends)]
        if mask in seen or sum(mask) - 1 < pp_size:
            continue
        seen.append(mask)
        fused, starts = fuse_blocks(profile, mask)
        out.append((build_chain(block_arrays(fused, setup), setup), tuple(starts)))
    return tuple(out)


def _with_machine_check(profile: Profile, setup_fields: dict[str, Any]) -> dict[str, Any]:
    """The profile's machine check (runtime overhead, measured link) as setup defaults;
    fields the caller gives win."""
    overhead = profile.runtime_overhead
    if overhead is None:
        return setup_fields
    return {"runtime_overhead": overhead, "link_latency_ms": overhead.link_latency_ms,
            "link_bandwidth_bytes_per_s": overhead.link_bandwidth_bytes_per_s, **setup_fields}


def rescaled(profile: Profile, micro_batch_size: int) -> Profile:
    """The profile with per-microbatch times and activations scaled to a new batch size
    (the weight gradients in a block's workspace, ``adopted_grad_bytes``, do not scale)."""
    factor = micro_batch_size / profile.setup.micro_batch_size
    if factor == 1:
        return profile
    blocks = tuple(dataclasses.replace(
        b, fwd_ms=b.fwd_ms * factor, bwd_ms=b.bwd_ms * factor,
        bwd_input_ms=b.bwd_input_ms * factor, bwd_weight_ms=b.bwd_weight_ms * factor,
        activation_bytes=round(b.activation_bytes * factor),
        glue_saved_bytes=round(b.glue_saved_bytes * factor),
        held_for_weight_bytes=round(b.held_for_weight_bytes * factor),
        output_bytes=round(b.output_bytes * factor),
        transient_bytes=round(b.transient_bytes * factor),
        adopted_grad_bytes=min(b.adopted_grad_bytes, round(b.transient_bytes * factor)))
        for b in profile.blocks)
    setup = dataclasses.replace(profile.setup, micro_batch_size=micro_batch_size)
    return dataclasses.replace(profile, blocks=blocks, setup=setup)


def search_configs(num_units: int, pp_size: int, schedule: str | Sequence[str],
                   virtual_stages: int | str, counts: Sequence[int]) -> list[Config]:
    """Every (schedule, v, m) torch accepts, v ascending per schedule and m; raises the
    first reason when none is left."""
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
        else:  # every v with a block per stage (the search stops early, see make_plan)
            options = list(range(2, max(2, num_units // pp_size) + 1))
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
                configs.append(Config(name, pp_size, num_virtual, m))
    if not configs:
        raise PlanError(reasons[0] if reasons else f"no schedule fits pp_size={pp_size}")
    return configs
