"""Checks that a plan can run here, done before any collective.

Every failure is a ``RuntimeSetupError`` with one line: what was wrong, the value
seen, what was expected and what to do.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch.distributed as dist
from torch import nn

from autopart.errors import PlanError, RuntimeSetupError
from autopart.intake import BlockChain
from autopart.intake.head_split import head_split_refusal
from autopart.intake.slice_rules import slice_rule
from autopart.runtime.planned import DerivedPart, base_names, derived_parts
from autopart.schedules import check_schedule, schedule_info, stage_to_rank
from autopart.schema import Plan

__all__ = ["thread_mismatch"]


def thread_mismatch(profile_threads: int, rank_threads: int, *, pp_size: int,
                    model: str = "MODEL") -> str | None:
    """One line naming a CPU thread-count mismatch between the profile and the ranks, and
    the fix; ``None`` when they agree or the profile's count is unknown.

    Args:
        profile_threads: torch threads the profile was measured with (``Plan.profile_threads``;
            0 for unknown).
        rank_threads: torch threads each rank runs with.
        pp_size: Ranks of the pipeline (for the suggested ``--pp``).
        model: How to name the model in the suggested command.

    Returns:
        The line to print or log, or ``None``.
    """
    if profile_threads <= 0 or profile_threads == rank_threads:
        return None
    return (f"the profile was measured with {profile_threads} thread(s) but each rank runs "
            f"{rank_threads}: CPU block times do not transfer; profile again with "
            f"`autopart profile {model} --threads {rank_threads}` (or `--pp {pp_size}` on the "
            f"machine that will host the ranks) and plan again")

logger = logging.getLogger(__name__)


def check_model(chain: BlockChain, *, has_loss_fn: bool) -> None:
    """Raise ``RuntimeSetupError`` for models the runtime cannot train as given."""
    if chain.family != "hf_causal_lm" and not has_loss_fn:
        raise RuntimeSetupError(
            f"a {chain.family} model needs loss_fn(output, target) -> scalar for its last "
            f"stage; pass loss_fn=... (autopart.CausalLMLoss() for a model returning logits) "
            f"to auto_pipeline on every rank")


def check_plan(plan: Plan, chain: BlockChain, *, pp_size: int, tp_size: int = 1,
               dp_size: int | None = None, where: str = "the plan") -> None:
    """Raise ``RuntimeSetupError`` unless ``plan`` fits ``chain`` and the groups' sizes.

    A tp size other than the plan's is refused (the plan's memory assumes its split);
    a dp size other than the plan's (``dp_size`` given) only warns, on rank 0.
    """
    if plan.tp_size != tp_size:
        raise RuntimeSetupError(
            f"{where} is for tp_size {plan.tp_size} but the device mesh has {tp_size} "
            f"tensor-parallel rank(s); pass a mesh whose 'tp' dimension has {plan.tp_size} "
            f"(or no mesh: one is built from the plan) or make a plan for tp {tp_size}")
    if dp_size is not None:
        _warn_plan_mismatch(plan, dp_size)
    if plan.pp_size != pp_size:
        raise RuntimeSetupError(
            f"{where} is for pp_size {plan.pp_size} but the pipeline group has {pp_size} "
            f"rank(s); launch {plan.pp_size} pipeline ranks (e.g. torchrun "
            f"--nproc_per_node={plan.pp_size}) or make a plan with --pp {pp_size}")
    if plan.profile_fingerprint != chain.fingerprint:
        raise RuntimeSetupError(
            f"{where} was made for another model (profile fingerprint "
            f"{plan.profile_fingerprint}, this model's is {chain.fingerprint}); profile and "
            f"plan this model again")
    try:
        info = schedule_info(plan.schedule)
        check_schedule(plan.schedule, plan.pp_size, plan.virtual_stages, plan.num_microbatches)
    except PlanError as exc:
        raise RuntimeSetupError(f"{where}: {exc}") from None
    _check_modules(plan, chain, where)
    for stage in plan.stages:
        expected = stage_to_rank(stage.index, plan.pp_size, plan.virtual_stages, info.style)
        if stage.rank != expected:
            raise RuntimeSetupError(
                f"{where}: stage {stage.index} is placed on rank {stage.rank} but schedule "
                f"{plan.schedule} ({info.style} placement) runs it on rank {expected}; "
                f"regenerate the plan")


def _warn_plan_mismatch(plan: Plan, dp_size: int) -> None:
    if not dist.is_initialized() or dist.get_rank() != 0:
        return
    if plan.dp_size != dp_size:
        logger.warning("the plan is for dp_size %d but the data-parallel group has %d "
                       "replica(s); the plan's memory and time predictions assume %d",
                       plan.dp_size, dp_size, plan.dp_size)
    if plan.zero_stage == 1:
        logger.warning("the plan assumes ZeRO-%d (optimizer state split over dp replicas) "
                       "but autopart's runtime keeps the whole optimizer state on every "
                       "replica: memory can exceed the plan's prediction", plan.zero_stage)


def _check_modules(plan: Plan, chain: BlockChain, where: str) -> None:
    names = chain.names
    planned = base_names(plan, chain, [m for stage in sorted(plan.stages, key=lambda s: s.index)
                                       for m in stage.modules], where)
    if planned == names:
        if any(not stage.modules for stage in plan.stages):
            raise RuntimeSetupError(f"{where} has an empty stage; regenerate the plan")
        return
    unknown = [m for m in planned if m not in names]
    missing = [m for m in names if m not in planned]
    if unknown:
        detail = f"names unknown blocks {unknown[:3]}"
    elif missing:
        detail = f"leaves out blocks {missing[:3]}"
    else:
        detail = "does not list the blocks once each, in model order"
    raise RuntimeSetupError(f"{where} {detail} (model blocks: {names[0]} .. {names[-1]}, "
                            f"{len(names)} in all); make the plan from this model's profile")


def check_parts(plan: Plan, chain: BlockChain, root: nn.Module, *, has_loss_fn: bool,
                where: str = "the plan") -> list[DerivedPart]:
    """The derived parts of ``plan`` (the head by vocabulary, halves by units), checked to
    run on this model: the one runtime check of parts.

    ``chain`` must carry ``trace.carries`` (``autopart.intake.blocks.with_carries``) when
    the plan cuts a half by units.

    Returns:
        The plan's derived parts in model order (empty when it has none).

    Raises:
        RuntimeSetupError: the parts of a module are not ``0 .. k-1`` once each, in order;
            the module's block cannot be cut that way here (the head of an HF causal LM
            that ``head_split_refusal`` accepts; a decoder-layer half whose module
            ``slice_rule`` splits into at least k units, with nothing made by the model's
            code before it crossing the cut); tp above 1; or a custom ``loss_fn`` (not
            ``CausalLMLoss``) with the head cut.
    """
    found = derived_parts(plan, chain, where=where)
    modules: dict[str, list[DerivedPart]] = {}
    for item in found:
        modules.setdefault(item.part.module, []).append(item)
    for module, items in modules.items():
        parts = [d.part for d in items]
        count = parts[0].count
        if [(p.axis, p.index, p.count) for p in parts] != [
                (parts[0].axis, i, count) for i in range(count)]:
            raise RuntimeSetupError(f"{where} lists parts {[d.name for d in items][:4]} of "
                                    f"{module}; expected parts 0 .. {count - 1} of {count} "
                                    f"once each, in order; regenerate the plan")
        if plan.tp_size > 1:
            raise RuntimeSetupError(f"{where} cuts {module} along {parts[0].axis} and shards "
                                    f"it over tp {plan.tp_size}; plan tensor parallelism "
                                    f"with --granularity layer")
        if parts[0].axis == "vocab":
            _check_vocab(chain, root, items[0], has_loss_fn, where)
        else:
            _check_units(chain, root, items, where)
    return found


def _check_vocab(chain: BlockChain, root: nn.Module, item: DerivedPart, has_loss_fn: bool,
                 where: str) -> None:
    """``check_parts`` for the head cut by vocabulary."""
    head = item.part.module
    last = chain.blocks[-1]
    if item.base != last.name or last.kind != "head" or chain.family != "hf_causal_lm":
        raise RuntimeSetupError(f"{where} splits {head} by vocabulary, but only the head of "
                                f"an HF causal LM ({last.name} here is a {last.kind}) can be "
                                f"split; plan with --head whole")
    why = head_split_refusal(root, head, chain.trace)
    if why is not None:
        raise RuntimeSetupError(f"{where} splits the head, but {why}; plan with "
                                f"--head whole")
    if has_loss_fn:
        raise RuntimeSetupError(f"{where} splits {head} by vocabulary, which a custom loss_fn "
                                f"cannot see whole; pass loss_fn=autopart.CausalLMLoss() (or "
                                f"none) or plan with the head whole (--head whole)")


def _check_units(chain: BlockChain, root: nn.Module, items: list[DerivedPart],
                 where: str) -> None:
    """``check_parts`` for one half's module cut by units into slices."""
    half, count = items[0].part.module, items[0].part.count
    block = {b.name: b for b in chain.blocks}[items[0].base]
    if not block.layer:
        raise RuntimeSetupError(f"{where} cuts {half} into slices, but it is a {block.kind} "
                                f"block, not the module of a decoder-layer half; make the "
                                f"plan from this model's profile")
    rule, why = slice_rule(root.get_submodule(half))
    if rule is None:
        raise RuntimeSetupError(f"{where} cuts {half} into slices, but {why}; plan without "
                                f"slices of it")
    if count > rule.units:
        unit = "key/value heads" if rule.kind == "attention" else "intermediate columns"
        raise RuntimeSetupError(f"{where} cuts {half} into {count} slices but it has only "
                                f"{rule.units} {unit}; regenerate the plan")
    cut = len({d.stage for d in items}) > 1
    call = chain.call_fqns.index(half)
    if cut and (chain.trace is None or not chain.trace.carries
                or chain.trace.carries[call - 1] is None):
        raise RuntimeSetupError(f"{where} cuts inside {half}, but a value made by the "
                                f"model's code before it (not an argument of an earlier "
                                f"block) crosses that cut; plan without slices of it")


def recompute_rule(mode: bool | str | None) -> Callable:
    """Which stages run activation checkpointing: none, the plan's choice, or all."""
    if mode is None or mode is False:
        return lambda stage: False
    if mode == "plan":
        return lambda stage: stage.recompute
    if mode is True:
        return lambda stage: True
    raise RuntimeSetupError(f"activation_checkpointing={mode!r}; use None, 'plan' or True")
