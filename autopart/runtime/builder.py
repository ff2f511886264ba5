"""``auto_pipeline``: wrap a model with a plan and return this rank's ``PipelinedModel``.

Order of work: every check that can fail (world size, plan, fingerprint, loss_fn,
tensor-parallel plan, what FSDP can shard) runs before the first collective; then the
groups are made (a ``("pp", "dp", "tp")`` mesh when the plan has dp or tp above 1), this
rank's blocks alone are given real storage (``autopart.runtime.holding``), wrapped into
stage modules with original FQNs, split over the tp ranks
(``autopart.runtime.tensor_parallel``), sharded over the dp ranks when the plan says
FSDP (``autopart.runtime.fsdp``), and handed to the torch schedule named by the plan.
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

from autopart.intake import BlockChain, discover_blocks, load_model
from autopart.intake.blocks import with_carries
from autopart.profile.options import ProfileOptions
from autopart.profile.validate import TORCH_DTYPES
from autopart.runtime.aux_loss import router_aux_loss
from autopart.runtime.fsdp import apply_fsdp, check_fsdp, mixed_precision
from autopart.runtime.groups import Groups, resolve_groups
from autopart.runtime.holding import materialize_rank, share_across_ranks, tied_parameters
from autopart.runtime.loss import CausalLMLoss, LogitsLoss, TokenLossesLoss, VocabParallelLoss
from autopart.runtime.options import RuntimeOptions
from autopart.runtime.pipeline import PipelinedModel
from autopart.runtime.plan_source import AutoOptions, resolve_plan
from autopart.runtime.planned import base_names, chain_level
from autopart.runtime.stages import build_stage_modules
from autopart.runtime.tensor_parallel import TensorParallel, apply_tensor_parallel, tp_plan_of
from autopart.runtime.torch_stages import build_schedule, wrap_stages
from autopart.runtime.validate import (
    check_model,
    check_parts,
    check_plan,
    recompute_rule,
    thread_mismatch,
)
from autopart.schedules import schedule_info, stages_of_rank
from autopart.schema import Plan, StagePlan
from autopart.solve.options import PlanOptions

__all__ = ["auto_pipeline"]

logger = logging.getLogger(__name__)



def auto_pipeline(model_or_source: nn.Module | str, *, plan: Plan | str | Path,
                  loss_fn: Callable[..., torch.Tensor] | None = None,
                  options: RuntimeOptions | None = None,
                  plan_options: PlanOptions | dict[str, Any] | None = None,
                  profile_options: ProfileOptions | dict[str, Any] | None = None,
                  **fields: Any) -> PipelinedModel:
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
            on rank 0 with ``profile_options`` and ``plan_options``, then broadcast).
        loss_fn: ``autopart.CausalLMLoss()`` (the default for HF causal LMs: the
            token mean of the next-token loss over the whole batch; ``step``'s
            ``target`` is the labels as HF takes them, shifted inside), or a custom
            ``loss_fn(output, target) -> scalar`` (required for other models), called
            per microbatch on the last stage's output with that microbatch's slice of
            ``target`` unchanged, the microbatch losses averaged. A plan that splits the
            head by vocabulary needs the built-in loss; with a custom one ``plan="auto"``
            keeps the head whole (the plan does not cut it by vocabulary).
        options: Where the stages live and how their weights are made
            (``RuntimeOptions``: device, groups, initialization, dtype, checkpointing);
            ``fields`` replace its fields (``auto_pipeline(m, plan=p, device="cpu")``).
        plan_options: With ``plan="auto"``: the ``PlanOptions`` (or their fields as a
            dict; ``pp_size`` and ``dp_size`` default to the groups'). The memory limit
            and links default from the profile's device, as for ``autopart plan``.
        profile_options: With ``plan="auto"``: the ``ProfileOptions`` (or their fields);
            the backend defaults to the device's.
        **fields: ``RuntimeOptions`` fields.

    Returns:
        The ``PipelinedModel``: ``step(*inputs, target=...)`` runs one training step.

    Raises:
        RuntimeSetupError: The world size, plan, model or options do not fit
            together (one line naming the remedy).
        SchemaError: The plan file is missing or malformed.
        ModelSourceError: The model cannot be loaded or its forward not pipelined.
    """
    opts = RuntimeOptions.of(options, **fields)
    setup = _checked_setup(model_or_source, plan, loss_fn, opts,
                           AutoOptions(plan_options, profile_options))
    pipelined = _assemble(setup, dtype=_block_dtype(opts, setup.plan, setup.root),
                          param_init_fn=opts.param_init_fn,
                          checkpoint_path=opts.checkpoint_path, init_seed=opts.init_seed,
                          autocast_dtype=opts.autocast_dtype)
    if dist.get_rank() == 0:
        logger.info("autopart pipeline built:\n%s", pipelined.debug_summary())
    return pipelined


def _block_dtype(opts: RuntimeOptions, plan: Plan, root: nn.Module) -> torch.dtype | None:
    """``opts.dtype``; without it and without autocast, the plan's parameter dtype (the
    profile's) where it is narrower than the model's: a plan priced in bf16 runs in bf16
    on a model built in fp32 from its config (on an H200 such a run took 3.6x the plan's
    step and 2.3x its memory). A model already narrower than its plan keeps its dtype."""
    if opts.dtype is not None or opts.autocast_dtype is not None:
        return opts.dtype
    planned = TORCH_DTYPES[plan.setup.param_dtype]
    model = next((p.dtype for p in root.parameters() if p.is_floating_point()), planned)
    return planned if planned.itemsize < model.itemsize else None


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class _Setup:
    """Everything ``auto_pipeline`` checked before building this rank's stages."""

    source: nn.Module | str
    root: nn.Module
    chain: BlockChain
    plan: Plan
    groups: Groups
    device: torch.device
    tp_plan: dict[str, str] | None
    builtin: CausalLMLoss | None
    custom: Callable[..., torch.Tensor] | None
    split_head: bool
    mine: list[StagePlan]
    """This rank's stages."""
    recompute: Callable[[StagePlan], bool]
    ties: list[tuple[str, str]]


def _checked_setup(source: nn.Module | str, plan: Plan | str | Path,
                   loss_fn: Callable[..., torch.Tensor] | None, opts: RuntimeOptions,
                   auto: AutoOptions) -> _Setup:
    """The model, plan and groups, with every check that can fail done (module docstring)."""
    root = load_model(source).model
    chain = discover_blocks(root)
    check_model(chain, has_loss_fn=loss_fn is not None)
    builtin, custom = split_loss(loss_fn, chain, root)
    recompute = recompute_rule(opts.activation_checkpointing)
    dev = _resolve_device(opts.device)
    groups, plan_obj, tp_plan = _groups_and_plan(plan, source, root, chain, opts, dev, auto,
                                                 custom is not None)
    chain = chain_for_plan(root, chain, plan_obj)
    check_plan(plan_obj, chain, pp_size=groups.pp_size, tp_size=groups.tp_size,
               dp_size=groups.dp_size)
    parts = check_parts(plan_obj, chain, root, has_loss_fn=custom is not None)
    split_head = any(d.part.axis == "vocab" for d in parts)
    ties = tied_parameters(root, chain)
    check_fsdp(plan_obj, ties, chain, split_head=split_head)
    info = schedule_info(plan_obj.schedule)
    mine = [plan_obj.stages[i] for i in stages_of_rank(
        groups.pp_rank, plan_obj.pp_size, plan_obj.virtual_stages, info.style)]
    setup = _Setup(source=source, root=root, chain=chain, plan=plan_obj, groups=groups,
                   device=dev, tp_plan=tp_plan, builtin=builtin, custom=custom,
                   split_head=split_head, mine=mine, recompute=recompute, ties=ties)
    _warn(setup)
    return setup


def _warn(setup: _Setup) -> None:
    """One line on rank 0 for each setting that works but costs more than it looks."""
    if dist.get_rank() != 0:
        return
    plan = setup.plan
    if schedule_info(plan.schedule).split_backward and any(setup.recompute(s)
                                                           for s in plan.stages):
        logger.warning("activation checkpointing under %s: torch computes weight gradients "
                       "(W) in separate autograd passes, each recomputing the checkpointed "
                       "layers, so recomputed stages run their forward several times per "
                       "microbatch; prefer 1f1b or interleaved-1f1b with recompute",
                       plan.schedule)
    mismatch = thread_mismatch(plan.profile_threads, torch.get_num_threads(),
                               pp_size=plan.pp_size, model=setup.source
                               if isinstance(setup.source, str) else "MODEL")
    if setup.device.type == "cpu" and mismatch:
        logger.warning("%s", mismatch)


def _aux_asked(config: Any) -> bool:
    """The HF config asks its model to add the router's load-balancing loss."""
    return bool(getattr(config, "output_router_logits", False)
                and (getattr(config, "router_aux_loss_coef", 0) or 0) > 0)


def _assemble(setup: _Setup, *, autocast_dtype: torch.dtype | None, **materialize) -> \
        PipelinedModel:
    """This rank's blocks materialized, split over tp, wrapped into stages, sharded over dp
    (FSDP), their shared weights synced, and the schedule."""
    root, chain, plan, groups = setup.root, setup.chain, setup.plan, setup.groups
    aliases = {later: first for first, later in setup.ties}
    held = [dataclasses.replace(s, modules=tuple(base_names(plan, chain, s.modules)))
            for s in setup.mine]
    module = materialize_rank(root, chain, held, setup.device, aliases=aliases,
                              ties=setup.ties, **materialize)
    info = schedule_info(plan.schedule)
    sp = plan.tp_size > 1 and plan.sequence_parallel
    stage_modules = build_stage_modules(root, chain, plan, setup.mine, recompute=setup.recompute,
                                        autocast_dtype=autocast_dtype,
                                        split_backward=info.split_backward,
                                        seq_mesh=groups.tp_mesh if sp else None)
    tp = TensorParallel()  # after the stages are built: their stand-ins copy the blocks first
    if setup.tp_plan is not None and groups.tp_mesh is not None:
        blocks = {b.name: b for b in chain.blocks}
        tp = apply_tensor_parallel(
            module, setup.tp_plan, groups.tp_mesh, ties=setup.ties,
            gather_logits=setup.builtin is None, sequence_parallel=sp,
            held=[blocks[n] for n in dict.fromkeys(m for s in held for m in s.modules)])
    fsdp = plan.zero_stage == 3 and groups.dp_mesh is not None
    if fsdp:
        apply_fsdp(stage_modules, held, chain, groups.dp_mesh,
                   reshard_after_forward=plan.reshard_after_forward,
                   mp_policy=mixed_precision(plan.setup), sum_replicas=setup.builtin is not None)
    tied = share_across_ranks(module, plan, chain, groups, setup.ties)
    token_loss = _token_loss(setup.builtin, setup.split_head, tp, groups)
    pipe_stages = wrap_stages(stage_modules, setup.mine, len(plan.stages), setup.device,
                              groups.pp_group)
    aux = router_aux_loss(root, stage_modules, groups.pp_group) \
        if setup.builtin is not None else None
    config = getattr(root, "config", None)
    if aux is None and _aux_asked(config) and dist.get_rank() == 0:
        logger.warning("router auxiliary loss (router_aux_loss_coef=%s) is dropped: autopart "
                       "finds no router module recording the logits it needs (or a custom "
                       "loss_fn is used); the pipeline trains on the token loss only",
                       config.router_aux_loss_coef)
    schedule = build_schedule(plan, pipe_stages, token_loss or setup.custom,
                              scale_grads=token_loss is None)
    return PipelinedModel(module=module, stage_modules=stage_modules, stage_plans=setup.mine,
                          schedule=schedule, plan=plan, groups=groups, device=setup.device,
                          token_loss=token_loss, tied=tied, aliases=aliases,
                          pipe_stages=pipe_stages, tp_grad_sum=tp.grad_sum,
                          head_split=setup.split_head, fsdp=fsdp, aux=aux)


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


def split_loss(loss_fn: Callable[..., torch.Tensor] | None, chain: BlockChain,
               root: nn.Module | None = None
               ) -> tuple[CausalLMLoss | None, Callable[..., torch.Tensor] | None]:
    """``(built-in loss, custom loss)``, one of them ``None``: ``loss_fn`` itself when it is a
    ``CausalLMLoss``, the default ``CausalLMLoss()`` for an HF causal LM without one
    (its labels unshifted where the model's own loss does not shift them: ``root``)."""
    if isinstance(loss_fn, CausalLMLoss):
        return loss_fn, None
    if loss_fn is None and chain.family == "hf_causal_lm":
        return CausalLMLoss(shift_labels=root is None or shifts_labels(root)), None
    return None, loss_fn


def shifts_labels(model: nn.Module) -> bool:
    """Whether the HF model's own loss shifts the labels by one (HF's ``loss_function``,
    or its own shift), as ``labels=`` means for nearly every causal LM. CPM-Ant, XLNet and
    TrOCR apply ``CrossEntropyLoss`` to the labels as given: their labels are aligned
    with the logits already. Decided from the code of the model's ``forward`` (its
    docstring left out); ``True`` where it cannot be read."""
    import ast
    import inspect
    import textwrap

    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(type(model).forward)))
    except (OSError, TypeError, SyntaxError):
        return True
    func = tree.body[0]
    if isinstance(func, (ast.FunctionDef, ast.AsyncFunctionDef)) and ast.get_docstring(func):
        func.body = func.body[1:]  # TrOCR's docstring says its labels are "not shifted"
    source = ast.unparse(tree)
    if "loss_function" in source or "shift" in source:
        return True
    return "CrossEntropyLoss" not in source and "cross_entropy" not in source


def _groups_and_plan(plan: Plan | str | Path, source: nn.Module | str, root: nn.Module,
                     chain: BlockChain, opts: RuntimeOptions, device: torch.device,
                     auto: AutoOptions, custom_loss: bool
                     ) -> tuple[Groups, Plan, dict[str, str] | None]:
    """The groups, the plan and the model's tp plan (``None`` for tp 1).

    ``"auto"`` plans for the given groups; a plan file or object decides the mesh,
    its sizes and tp plan checked before the mesh's collectives.
    """
    if isinstance(plan, str) and plan == "auto":
        groups = resolve_groups(opts.pp_group, opts.device_mesh)
        return groups, resolve_plan(plan, source, chain, groups, device.type, auto,
                                    custom_loss=custom_loss), None
    plan_obj = resolve_plan(plan, source, chain, None, device.type, auto)
    tp_plan = tp_plan_of(root, plan_obj.tp_size, sequence_parallel=plan_obj.sequence_parallel) \
        if plan_obj.tp_size > 1 else None
    groups = resolve_groups(opts.pp_group, opts.device_mesh, device_type=device.type,
                            sizes=(plan_obj.pp_size, plan_obj.dp_size, plan_obj.tp_size))
    return groups, plan_obj, tp_plan


def chain_for_plan(root: nn.Module, chain: BlockChain, plan: Plan) -> BlockChain:
    """``chain`` at the level ``plan`` was made at (``autopart.runtime.planned.chain_level``:
    its blocks are the plan's, parts along ``calls`` included), with what crosses each cut
    traced when the plan cuts a half by units (``with_carries``: the residual beside a
    slice cut)."""
    level = chain_level(plan)
    found = chain if level == chain.granularity else discover_blocks(root, granularity=level)
    units = any(p and p[-1].axis == "units" for p in plan.parts.values())
    return with_carries(root, found) if units else found

def _resolve_device(device: torch.device | str | None) -> torch.device:
    if device is not None:
        return torch.device(device)
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


