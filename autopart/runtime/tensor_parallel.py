"""Tensor parallelism inside the pipeline stages, as the planner prices it (``autopart.cost.mesh``).

An HF model says how its decoder layers split in ``config.base_model_tp_plan``
(Llama: ``{"layers.*.self_attn.q_proj": "colwise", ..., "layers.*.mlp.down_proj":
"rowwise"}``). autopart maps each style to torch's ``ColwiseParallel`` /
``RowwiseParallel`` and applies them over the ``"tp"`` mesh dimension to the blocks
this rank holds, as Megatron-LM runs them (Shoeybi et al. 2019):

* the **embedding** is vocabulary-parallel (``RowwiseParallel`` on ``nn.Embedding``:
  each rank holds ``1 / tp`` of the rows, the lookups summed over the group);
* the **head** is vocabulary-parallel (``ColwiseParallel``): each rank computes the
  logits of its rows only, and the built-in loss folds the ranks' log-sum-exps
  (``autopart.runtime.loss.VocabParallelLoss``); a custom ``loss_fn`` gets the logits
  gathered whole instead;
* the module holding a layer's first split layers (``self_attn``, ``mlp``) takes its
  input as one replicated tensor, so its backward sums the input gradient once over the
  group (one all-reduce per half each way, the cost model's count), not once per split
  layer;
* **sequence parallelism** (Korthikanti et al. 2022), on or off as the plan says
  (``Plan.sequence_parallel``): the residual stream between the split layers is sharded
  along the sequence (a ``DTensor`` placed ``Shard(1)``); the norms and every other
  module with parameters outside the split layers run on the sequence shards with their
  parameters replicated (``SequenceParallel``); the first split layers' input is
  all-gathered (backward: reduce-scatter), the last ones' output reduce-scattered
  (backward: all-gather), and the model's own code between blocks sees the global
  shapes. What crosses a pipeline cut is this rank's sequence shard
  (``autopart.runtime.stages``). Without it the stream is a plain replicated tensor,
  sent whole.

Values are materialized whole on every tp rank, then each keeps its shard (replicated
parameters are taken as they are: every tp rank holds the same values). Split
parameters and their gradients are ``DTensor``s: ``p.grad.full_tensor()`` gathers one.
"""

from __future__ import annotations

import fnmatch
import logging
from dataclasses import dataclass, field
from functools import partial

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    RowwiseParallel,
    SequenceParallel,
    parallelize_module,
)

from autopart.errors import RuntimeSetupError
from autopart.intake.chain import Block
from autopart.runtime.vocab_parallel import local_rows, split_lookup, vocab_embedding, vocab_head

__all__ = ["local_tensor"]

logger = logging.getLogger(__name__)

_SEQ = Shard(1)
"""Sequence-parallel placement of the residual stream ``[batch, seq, hidden]``."""

# HF tp-plan style -> torch ParallelStyle, as transformers.distributed.tensor_parallel
# registers them; ``sp``: the stream is sequence-parallel (only colwise and rowwise)
_STYLES = {
    "colwise": lambda sp: ColwiseParallel(),
    "rowwise": lambda sp: RowwiseParallel(output_layouts=_SEQ, use_local_output=False)
    if sp else RowwiseParallel(),
    "colwise_rep": lambda sp: ColwiseParallel(output_layouts=Replicate()),
    "colwise_gather_output": lambda sp: ColwiseParallel(output_layouts=Replicate()),
    "rowwise_rep": lambda sp: RowwiseParallel(input_layouts=Replicate()),
    "rowwise_split_input": lambda sp: RowwiseParallel(input_layouts=Replicate()),
}
_SEQUENCE_PARALLEL_STYLES = ("colwise", "rowwise")
# a replicated module that sees only this rank's heads (Qwen3's per-head q_norm): its
# parameters stay plain and their gradients are summed over the tp group after backward
_GRAD_SUM = "replicated_with_grad_allreduce"
_HEAD_COUNTS = ("num_attention_heads", "num_key_value_heads")


@dataclass(frozen=True, slots=True)
class TensorParallel:
    """What ``apply_tensor_parallel`` did on this rank."""

    grad_sum: list[nn.Parameter] = field(default_factory=list)
    """Replicated parameters whose gradients are summed over the tp group after backward."""
    head_rows: tuple[int, int] | None = None
    """The vocabulary rows ``[lo, hi)`` of this rank's head logits (vocabulary-parallel
    head with the built-in loss); ``None`` when this rank holds no head or gathers it."""
    sequence_parallel: bool = False


def tp_plan_of(root: nn.Module, tp_size: int, *,
               sequence_parallel: bool = False) -> dict[str, str]:
    """The model's tensor-parallel plan as ``{FQN pattern: style}``, checked for ``tp_size``.

    Args:
        root: The whole model (any device); an HF model with ``config.base_model_tp_plan``.
        tp_size: Ranks each layer is split over.
        sequence_parallel: The plan runs the stream sequence-parallel.

    Returns:
        ``base_model_tp_plan`` with the base model's prefix (``model.layers.*.mlp.up_proj``).

    Raises:
        RuntimeSetupError: The model has no tp plan, uses a style autopart does not map
            (under sequence parallelism: one other than colwise and rowwise), or
            ``tp_size`` does not divide its attention heads or its vocabulary.
    """
    config = getattr(root, "config", None)
    base_plan = dict(getattr(config, "base_model_tp_plan", None) or {})
    name = type(root).__name__
    if not base_plan:
        raise RuntimeSetupError(f"{name} has no tensor-parallel plan (config.base_model_tp_plan);"
                                f" use a plan with tp_size 1 for this model")
    unknown = sorted({s for s in base_plan.values() if s not in _STYLES and s != _GRAD_SUM})
    if unknown:
        raise RuntimeSetupError(f"{name}'s tensor-parallel plan uses style(s) {unknown}; "
                                f"autopart maps only {sorted(_STYLES)}: use tp_size 1")
    gathered = sorted({s for s in base_plan.values()
                       if s not in (*_SEQUENCE_PARALLEL_STYLES, _GRAD_SUM)})
    if sequence_parallel and gathered:
        raise RuntimeSetupError(f"{name}'s tensor-parallel plan uses {gathered}, whose layers "
                                f"take or return the whole sequence; plan with "
                                f"--sequence-parallel off for this model")
    for attr in (*_HEAD_COUNTS, "vocab_size"):
        size = getattr(config, attr, None)
        if isinstance(size, int) and size % tp_size:
            raise RuntimeSetupError(f"tp_size {tp_size} does not divide {attr} ({size}) of "
                                    f"{name}; use a tp_size that divides it")
    prefix = getattr(root, "base_model_prefix", "")
    if prefix and isinstance(getattr(root, prefix, None), nn.Module):
        return {f"{prefix}.{pattern}": style for pattern, style in base_plan.items()}
    return base_plan


def apply_tensor_parallel(module: nn.Module, tp_plan: dict[str, str], mesh: DeviceMesh, *,
                          held: list[Block], sequence_parallel: bool, gather_logits: bool,
                          ties: list[tuple[str, str]] = ()) -> TensorParallel:
    """Split this rank's blocks of ``module`` over ``mesh`` (see the module docstring).

    Args:
        module: This rank's pruned model tree, materialized, with original FQNs.
        tp_plan: ``{FQN pattern: style}`` from ``tp_plan_of``.
        mesh: The 1-D tensor-parallel mesh.
        held: The blocks this rank holds (their kinds find the embedding, head and norms).
        sequence_parallel: Shard the stream along the sequence.
        gather_logits: Gather the head's logits whole (a custom ``loss_fn``).
        ties: ``(first, later)`` FQNs of parameters two blocks share; when both are here
            they stay one parameter.

    Returns:
        The parameters to sum over the group after backward and the head's rows.

    Raises:
        RuntimeSetupError: A layer the plan shards is not a Linear layer whose split
            dimension ``mesh.size()`` divides, or the embedding or head is not an
            ``nn.Embedding`` / ``nn.Linear``.
    """
    styles: dict[str, ParallelStyle] = {}
    grad_sum: list[nn.Parameter] = []
    split: set[str] = set()
    for fqn, sub in module.named_modules():
        style = next((s for pattern, s in tp_plan.items() if _matches(fqn, pattern)), None)
        if style == _GRAD_SUM:
            grad_sum.extend(p for p in sub.parameters() if p.requires_grad)
        elif style is not None:
            _check_layer(fqn, sub, style, mesh.size())
            styles[fqn] = _STYLES[style](sequence_parallel)
            split.add(fqn)
    parents = {fqn.rpartition(".")[0] for fqn in split
               if tp_plan_style(fqn, tp_plan).startswith("colwise")}
    head_rows = None
    for block in held:
        if block.kind == "embedding":
            styles.update(vocab_embedding(module, block, sequence_parallel))
        elif block.kind == "head":
            styles.update(vocab_head(module, block, sequence_parallel, gather_logits))
        if sequence_parallel and block.kind not in ("embedding", "head"):
            styles.update({f: SequenceParallel() for f in
                           _sequence_parallel_modules(module, block, split | parents)})
    if not split and any(True for _ in module.parameters()) and \
            any(b.kind not in ("embedding", "norm", "head") for b in held):
        logger.warning("tensor parallelism: no layer of this rank matches the model's tp plan "
                       "%s; its layers stay replicated", sorted(tp_plan)[:2])
    parallelize_module(module, mesh, styles)
    for block in held:
        embedding = module.get_submodule(block.fqns[-1]) if block.kind == "embedding" else None
        if embedding is not None and block.fqns[-1] not in styles:
            split_lookup(embedding, mesh, sequence_parallel)
    for parent in sorted(parents):
        module.get_submodule(parent).register_forward_pre_hook(
            partial(_replicated_input, mesh, sequence_parallel), with_kwargs=True)
    _retie(module, ties)
    for param in module.parameters():
        if isinstance(param, DTensor) and any(isinstance(x, Shard) for x in param.placements):
            param.register_hook(partial(_keep_shard, param))
    head = next((b for b in held if b.kind == "head"), None)
    if head is not None and not gather_logits:
        head_rows = local_rows(module.get_submodule(head.fqns[-1]).weight)
    return TensorParallel(grad_sum=grad_sum, head_rows=head_rows,
                          sequence_parallel=sequence_parallel)


def tp_plan_style(fqn: str, tp_plan: dict[str, str]) -> str:
    """The style ``tp_plan`` gives the module ``fqn`` (``""`` for none)."""
    return next((s for pattern, s in tp_plan.items() if _matches(fqn, pattern)), "")


def _sequence_parallel_modules(module: nn.Module, block: Block, skip: set[str]) -> list[str]:
    """Modules of ``block`` with parameters of their own that run on the sequence shards:
    every one outside the split layers and the modules holding them (the norms)."""
    found = []
    for top in block.fqns:
        for name, sub in module.get_submodule(top).named_modules():
            fqn = f"{top}.{name}" if name else top
            if any(fqn == s or fqn.startswith(s + ".") for s in skip):
                continue
            if any(True for _ in sub.parameters(recurse=False)):
                found.append(fqn)
    return found


def _replicated_input(mesh: DeviceMesh, sp: bool, _module: nn.Module, args: tuple,
                      kwargs: dict) -> tuple[tuple, dict]:
    """Forward pre-hook of a module holding split layers: its stream input as one replicated
    ``DTensor`` (all-gathered from the sequence shards under sequence parallelism), so the
    input gradient of all its split layers is reduced once over the group."""
    def convert(value):
        if isinstance(value, DTensor) and tuple(value.placements) == (_SEQ,):
            return value.redistribute(placements=[Replicate()])
        if not sp and type(value) is torch.Tensor and value.is_floating_point() \
                and value.dim() == 3:
            return DTensor.from_local(value, mesh, [Replicate()], run_check=False)
        return value
    return tuple(convert(a) for a in args), {k: convert(v) for k, v in kwargs.items()}


def _retie(module: nn.Module, ties: list[tuple[str, str]]) -> None:
    """Parameters shared by two blocks of this rank are one parameter again after the split."""
    names = dict(module.named_parameters(remove_duplicate=False))
    for first, later in ties:
        if first in names and later in names:
            holder, _, leaf = later.rpartition(".")
            setattr(module.get_submodule(holder), leaf, module.get_parameter(first))


def _matches(fqn: str, pattern: str) -> bool:
    parts, atoms = fqn.split("."), pattern.split(".")
    return len(parts) == len(atoms) and all(fnmatch.fnmatchcase(p, a)
                                            for p, a in zip(parts, atoms))


def _check_layer(fqn: str, layer: nn.Module, style: str, tp_size: int) -> None:
    if not isinstance(layer, nn.Linear):
        raise RuntimeSetupError(f"the tp plan shards {fqn} ({type(layer).__name__}) {style}; "
                                f"autopart shards only nn.Linear layers: use tp_size 1")
    width = layer.out_features if style.startswith("colwise") else layer.in_features
    if width % tp_size:
        raise RuntimeSetupError(f"tp_size {tp_size} does not divide the width {width} that "
                                f"{fqn} splits ({style}); use a tp_size that divides it")


def place_grads(params: list[nn.Parameter]) -> None:
    """Give every ``DTensor`` gradient its parameter's placement, after the step: the
    pending sums (``Partial``) of the replicated parameters of sequence-parallel norms are
    reduced once per step, as Megatron does, not once per microbatch."""
    for p in params:
        grad = p.grad
        if isinstance(grad, DTensor) and tuple(grad.placements) != tuple(p.placements):
            p.grad = grad.redistribute(placements=p.placements)


def _keep_shard(param: nn.Parameter, grad: torch.Tensor) -> torch.Tensor:
    """A split parameter keeps only its shard of a gradient torch computed whole (the
    vocabulary-parallel embedding's lookup backward is replicated): a local slice."""
    if isinstance(grad, DTensor) and tuple(grad.placements) != tuple(param.placements) \
            and not any(isinstance(x, Partial) for x in grad.placements):
        return grad.redistribute(placements=param.placements)
    return grad


def local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a ``DTensor`` (sharing its storage), or ``tensor`` itself."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def is_sharded(tensor: torch.Tensor) -> bool:
    """True for a ``DTensor`` split over its mesh (each rank holds a different part)."""
    return isinstance(tensor, DTensor) and any(isinstance(p, Shard) for p in tensor.placements)
