"""``auto_pipeline``: wrap a model with a plan and return this rank's ``PipelinedModel``.

Order of work: every check that can fail (world size, plan, fingerprint, loss_fn,
tensor-parallel plan) runs before the first collective; then the groups are made
(a ``("pp", "dp", "tp")`` mesh when the plan has dp or tp above 1), this rank's
blocks alone are given real storage, split over the tp ranks, wrapped into stage
modules with original FQNs, and handed to the torch schedule named by the plan.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from autopart.errors import RuntimeSetupError
from autopart.intake import BlockChain, discover_blocks, load_model
from autopart.intake.blocks import with_carries
from autopart.intake.half_slices import collapse_parts, parse_slice
from autopart.intake.sources import move_outside_blocks
from autopart.runtime.groups import Groups, resolve_groups
from autopart.runtime.loss import CausalLMLoss, LogitsLoss, TokenLossesLoss, VocabParallelLoss
from autopart.runtime.materialize import materialize_blocks
from autopart.runtime.pipeline import PipelinedModel, TiedWeight
from autopart.runtime.plan_source import resolve_plan
from autopart.runtime.stages import build_schedule, build_stage_modules, wrap_stages
from autopart.runtime.tensor_parallel import (
    TensorParallel,
    apply_tensor_parallel,
    local_tensor,
    tp_plan_of,
)
from autopart.runtime.tree import prune
from autopart.runtime.validate import (
    check_half_slices,
    check_head_split,
    check_model,
    check_plan,
    recompute_rule,
    thread_mismatch,
)
from autopart.schedules import schedule_info, stages_of_rank
from autopart.schema import Plan, StagePlan

__all__ = ["auto_pipeline"]

logger = logging.getLogger(__name__)



def auto_pipeline(model_or_source: nn.Module | str, *, plan: Plan | str | Path,
                  loss_fn: Callable[..., torch.Tensor] | None = None,
                  device: torch.device | str | None = None,
                  pp_group: dist.ProcessGroup | None = None, device_mesh=None,
                  param_init_fn: Callable[[nn.Module], None] | None = None,
                  dtype: torch.dtype | None = None,
                  activation_checkpointing: bool | str | None = None,
                  checkpoint_path: str | Path | None = None,
                  autocast_dtype: torch.dtype | None = None,
                  init_seed: int = 0,
                  plan_options: dict[str, Any] | None = None) -> PipelinedModel:
    """Build this rank's stages of ``model_or_source`` as ``plan`` says.

    Every stage keeps its blocks under their original FQNs and runs the model's
    own forward (``autopart.runtime.stages``), so checkpoints, optimizers and
    ``state_dict`` keys are those of the unpipelined model.
    A plan with ``tp_size`` above 1 splits each decoder layer over the tp ranks with
    torch's ``parallelize_module`` as the HF ``base_model_tp_plan`` says
    (``autopart.runtime.tensor_parallel``); ``dp_size`` replicas reduce gradients.

    Args:
        model_or_source: A model (best on the meta device: each rank materializes
            only its blocks) or an autopart model source (preset, HF config path,
            ``pkg.module:factory``).
        plan: A ``Plan``, the path of a plan JSON, or ``"auto"`` (profile and solve
            on rank 0, then broadcast).
        loss_fn: ``autopart.CausalLMLoss()`` (the default for HF causal LMs: the
            token mean of the next-token loss over the whole batch; ``step``'s
            ``target`` is the labels as HF takes them, shifted inside), or a custom
            ``loss_fn(output, target) -> scalar`` (required for other models), called
            per microbatch on the last stage's output with that microbatch's slice of
            ``target`` unchanged, the microbatch losses averaged. A plan that splits the
            head by vocabulary needs the built-in loss; with a custom one ``plan="auto"``
            keeps the head whole (it plans at ``layer`` granularity).
        device: Where this rank's blocks live (default: the current CUDA device,
            else the CPU).
        pp_group: The pipeline's process group when it is not the whole world.
        device_mesh: A DeviceMesh with a ``"pp"`` dimension and optional ``"dp"``
            and ``"tp"`` ones (instead of ``pp_group``). Without either, the groups
            come from the plan: the world must have ``pp_size * dp_size * tp_size``
            ranks, laid out as a ``("pp", "dp", "tp")`` mesh.
        param_init_fn: ``param_init_fn(block)`` initializes a materialized block.
        dtype: Cast the blocks to this dtype.
        activation_checkpointing: ``"plan"`` (the stages the plan marks), ``True``
            (every stage) or ``None``.
        checkpoint_path: Local safetensors file or directory to load weights from.
        autocast_dtype: Run the forward under ``torch.autocast`` in this dtype.
        init_seed: Seed of the default per-block initialization.
        plan_options: With ``plan="auto"``: options for ``profile_model``
            (``micro_batch_size``, ``seq_len``, ``backend``, ...) and ``make_plan``
            (``num_microbatches``, ``schedule``, ...).

    Returns:
        The ``PipelinedModel``: ``step(*inputs, target=...)`` runs one training step.

    Raises:
        RuntimeSetupError: The world size, plan, model or options do not fit
            together (one line naming the remedy).
        SchemaError: The plan file is missing or malformed.
        ModelSourceError: The model cannot be loaded or its forward not pipelined.
    """
    root = load_model(model_or_source).model
    chain = discover_blocks(root)
    check_model(chain, has_loss_fn=loss_fn is not None)
    builtin, custom = split_loss(loss_fn, chain)
    recompute = recompute_rule(activation_checkpointing)
    dev = _resolve_device(device)
    plan_options = auto_plan_options(plan_options, custom=custom is not None)
    groups, plan_obj, tp_plan = _groups_and_plan(plan, model_or_source, root, chain, pp_group,
                                                 device_mesh, dev, plan_options)
    chain = chain_for_plan(root, chain, plan_obj)
    check_plan(plan_obj, chain, pp_size=groups.pp_size, tp_size=groups.tp_size,
               dp_size=groups.dp_size)
    split_head = check_head_split(plan_obj, chain, root, has_loss_fn=custom is not None)
    check_half_slices(plan_obj, chain, root)
    info = schedule_info(plan_obj.schedule)
    mine = [plan_obj.stages[i] for i in stages_of_rank(
        groups.pp_rank, plan_obj.pp_size, plan_obj.virtual_stages, info.style)]
    if info.split_backward and any(recompute(s) for s in plan_obj.stages) \
            and dist.get_rank() == 0:
        logger.warning("activation checkpointing under %s: torch computes weight gradients "
                       "(W) in separate autograd passes, each recomputing the checkpointed "
                       "layers, so recomputed stages run their forward several times per "
                       "microbatch; prefer 1f1b or interleaved-1f1b with recompute",
                       plan_obj.schedule)
    mismatch = thread_mismatch(plan_obj.profile_threads, torch.get_num_threads(),
                               pp_size=plan_obj.pp_size, model=model_or_source
                               if isinstance(model_or_source, str) else "MODEL")
    if dev.type == "cpu" and mismatch and dist.get_rank() == 0:
        logger.warning("%s", mismatch)
    coef = getattr(getattr(root, "config", None), "router_aux_loss_coef", None)
    if coef and builtin is not None and dist.get_rank() == 0:
        logger.warning("router auxiliary loss (router_aux_loss_coef=%s) is dropped: the "
                       "pipeline trains on the token loss only", coef)
    ties = tied_parameters(root, chain)
    aliases = {later: first for first, later in ties}

    held = [dataclasses.replace(s, modules=tuple(collapse_parts(s.modules))) for s in mine]
    module = _materialize(root, chain, held, dev, dtype=dtype, param_init_fn=param_init_fn,
                          checkpoint_path=checkpoint_path, init_seed=init_seed,
                          aliases=aliases, ties=ties)
    sp = plan_obj.tp_size > 1 and plan_obj.sequence_parallel
    stage_modules = build_stage_modules(root, chain, mine, recompute=recompute,
                                        autocast_dtype=autocast_dtype,
                                        split_backward=info.split_backward,
                                        seq_mesh=groups.tp_mesh if sp else None)
    tp = TensorParallel()  # after the stages are built: their stand-ins copy the blocks first
    if tp_plan is not None and groups.tp_mesh is not None:
        blocks = {b.name: b for b in chain.blocks}
        tp = apply_tensor_parallel(
            module, tp_plan, groups.tp_mesh, ties=ties, gather_logits=builtin is None,
            held=[blocks[n] for n in dict.fromkeys(m for s in held for m in s.modules)],
            sequence_parallel=sp)
    tied = _share_across_ranks(module, plan_obj, chain, groups, ties)
    token_loss = _token_loss(builtin, split_head, tp, groups)
    pipe_stages = wrap_stages(stage_modules, mine, len(plan_obj.stages), dev, groups.pp_group)
    schedule = build_schedule(plan_obj, pipe_stages, token_loss or custom,
                              scale_grads=token_loss is None)
    pipelined = PipelinedModel(module=module, stage_modules=stage_modules, stage_plans=mine,
                               schedule=schedule, plan=plan_obj, groups=groups, device=dev,
                               token_loss=token_loss, tied=tied, aliases=aliases,
                               pipe_stages=pipe_stages, tp_grad_sum=tp.grad_sum,
                               head_split=split_head)
    if dist.get_rank() == 0:
        logger.info("autopart pipeline built:\n%s", pipelined.debug_summary())
    return pipelined


def _token_loss(builtin: CausalLMLoss | None, split_head: bool, tp: TensorParallel,
                groups: Groups) -> LogitsLoss | TokenLossesLoss | VocabParallelLoss | None:
    """The per-microbatch form of the built-in loss, by where the head's vocabulary is."""
    if builtin is None:
        return None
    if split_head:
        return TokenLossesLoss(builtin)
    if tp.head_rows is not None:
        return VocabParallelLoss(builtin, tp.head_rows, groups.tp_group)
    return LogitsLoss(builtin)


def split_loss(loss_fn: Callable[..., torch.Tensor] | None, chain: BlockChain
               ) -> tuple[CausalLMLoss | None, Callable[..., torch.Tensor] | None]:
    """``(built-in loss, custom loss)``, one of them ``None``: ``loss_fn`` itself when it is a
    ``CausalLMLoss``, the default ``CausalLMLoss()`` for an HF causal LM without one."""
    if isinstance(loss_fn, CausalLMLoss):
        return loss_fn, None
    if loss_fn is None and chain.family == "hf_causal_lm":
        return CausalLMLoss(), None
    return None, loss_fn


def auto_plan_options(options: dict[str, Any] | None, *, custom: bool) -> dict[str, Any]:
    """``plan_options`` for ``plan="auto"``: with a custom loss, which cannot see a head split
    by vocabulary, planned at ``layer`` granularity (the head whole) unless set."""
    return {"granularity": "layer", **(options or {})} if custom else dict(options or {})


def _groups_and_plan(plan: Plan | str | Path, source: nn.Module | str, root: nn.Module,
                     chain: BlockChain, pp_group: dist.ProcessGroup | None, device_mesh,
                     device: torch.device, plan_options: dict[str, Any] | None
                     ) -> tuple[Groups, Plan, dict[str, str] | None]:
    """The groups, the plan and the model's tp plan (``None`` for tp 1).

    ``"auto"`` plans for the given groups; a plan file or object decides the mesh,
    its sizes and tp plan checked before the mesh's collectives.
    """
    if isinstance(plan, str) and plan == "auto":
        groups = resolve_groups(pp_group, device_mesh)
        return groups, resolve_plan(plan, source, chain, groups, device.type, plan_options), None
    plan_obj = resolve_plan(plan, source, chain, None, device.type, plan_options)
    tp_plan = tp_plan_of(root, plan_obj.tp_size, sequence_parallel=plan_obj.sequence_parallel) \
        if plan_obj.tp_size > 1 else None
    groups = resolve_groups(pp_group, device_mesh, device_type=device.type,
                            sizes=(plan_obj.pp_size, plan_obj.dp_size, plan_obj.tp_size))
    return groups, plan_obj, tp_plan


def chain_for_plan(root: nn.Module, chain: BlockChain, plan: Plan) -> BlockChain:
    """``chain`` at the granularity ``plan`` was made at (its blocks name the halves of
    decoder layers when it was planned from a ``sublayer`` profile, their parts from a
    ``quarter`` one), with what crosses each cut traced when the plan cuts inside a half's
    module (``with_carries``: the residual beside a slice cut)."""
    listed = [m for stage in plan.stages for m in stage.modules]
    planned = set(collapse_parts(listed))
    found = chain if planned <= set(chain.names) else next(
        (finer for finer in (discover_blocks(root, granularity=g) for g in ("sublayer", "quarter"))
         if planned <= set(finer.names)), chain)
    return with_carries(root, found) if any(map(parse_slice, listed)) else found


def _resolve_device(device: torch.device | str | None) -> torch.device:
    if device is not None:
        return torch.device(device)
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def tied_parameters(root: nn.Module, chain: BlockChain) -> list[tuple[str, str]]:
    """``(first, later)`` FQNs of parameters that two blocks share (tied embedding and head)."""
    owner: dict[int, tuple[str, str]] = {}
    ties: list[tuple[str, str]] = []
    for block in chain.blocks:
        for fqn in block.fqns:
            for name, p in root.get_submodule(fqn).named_parameters(remove_duplicate=False):
                full = f"{fqn}.{name}"
                if id(p) not in owner:
                    owner[id(p)] = (block.name, full)
                elif owner[id(p)][0] != block.name:
                    ties.append((owner[id(p)][1], full))
    return ties


def _block_of(chain: BlockChain, param_fqn: str) -> str:
    return next(b.name for b in chain.blocks for f in b.fqns if param_fqn.startswith(f + "."))


def _materialize(root: nn.Module, chain: BlockChain, mine: list[StagePlan],
                 device: torch.device, ties: list[tuple[str, str]], **kwargs) -> nn.Module:
    """Real storage for this rank's blocks; the model's code between blocks moved to ``device``."""
    index = {name: i for i, name in enumerate(chain.names)}
    blocks = {b.name: b for b in chain.blocks}
    owned = [(index[name], fqn) for stage in mine for name in stage.modules
             for fqn in blocks[name].fqns]
    owned = list(dict.fromkeys(owned))  # stages of one rank may share the split head
    fqns = [fqn for _, fqn in owned]
    module = prune(root, [*fqns, *chain.shared_modules])
    materialize_blocks(root, owned, device=device, **kwargs)
    move_outside_blocks(root, chain.call_fqns, device)
    for first, later in ties:
        if any(first.startswith(f + ".") for f in fqns) and \
                any(later.startswith(f + ".") for f in fqns):
            holder, _, leaf = later.rpartition(".")
            setattr(module.get_submodule(holder), leaf, module.get_parameter(first))
    if hasattr(root, "config"):
        module.config = root.config
    module.train()
    return module


def _share_across_ranks(module: nn.Module, plan: Plan, chain: BlockChain, groups: Groups,
                        ties: list[tuple[str, str]]) -> list[TiedWeight]:
    """Weights held on several ranks, each with a group of its holders, same initial values.

    A tied embedding/head weight is held by the embedding's rank and the head's; a
    head split by vocabulary, or a half cut into slices, is held whole by every rank with
    one of its shards or slices.
    """
    if len(ties) > 1:
        raise RuntimeSetupError(f"{len(ties)} parameters are shared between blocks (e.g. "
                                f"{ties[1][1]}); autopart keeps one shared weight in sync "
                                f"across ranks; untie the others")
    ranks_of: dict[str, set[int]] = {}
    for stage in plan.stages:
        for name in collapse_parts(stage.modules):
            ranks_of.setdefault(name, set()).add(stage.rank)
    holders: dict[str, set[int]] = {}  # parameter FQN -> ranks holding it
    for first, later in ties:
        ranks = ranks_of[_block_of(chain, first)] | ranks_of[_block_of(chain, later)]
        holders[first if groups.pp_rank in ranks_of[_block_of(chain, first)] else later] = ranks
    head = chain.blocks[-1].name
    tied_fqns = {f for pair in ties for f in pair}
    for name, _ in module.named_parameters():
        if name.startswith(head + ".") and name not in tied_fqns:
            holders[name] = ranks_of[head]
    blocks = {b.name: b for b in chain.blocks}
    for half in {p[0] for s in plan.stages for p in map(parse_slice, s.modules) if p}:
        prefixes = tuple(f + "." for f in blocks[half].fqns)
        for name, _ in module.named_parameters():
            if name.startswith(prefixes):
                holders[name] = ranks_of[half]
    shared, made = [], {}
    for fqn, ranks in sorted(holders.items()):
        if len(ranks) < 2 or groups.pp_rank not in ranks:
            continue
        key = tuple(sorted(ranks))
        if key not in made:
            made[key] = dist.new_group([groups.pp_global_ranks[r] for r in key],
                                       use_local_synchronization=True)
        param = module.get_parameter(fqn)
        with torch.no_grad():
            dist.broadcast(local_tensor(param.data), src=groups.pp_global_ranks[key[0]],
                           group=made[key])
        shared.append(TiedWeight(param=param, group=made[key],
                                 counts_in_norm=groups.pp_rank == key[0]))
    return shared
