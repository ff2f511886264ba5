"""Tensor parallelism inside the pipeline stages, with torch's ``parallelize_module``.

An HF model says how its decoder layers split in ``config.base_model_tp_plan``
(Llama: ``{"layers.*.self_attn.q_proj": "colwise", ..., "layers.*.mlp.down_proj":
"rowwise"}``). autopart maps each style to torch's ``ColwiseParallel`` /
``RowwiseParallel`` and applies them, over the ``"tp"`` mesh dimension, to the
blocks this rank holds (the pruned tree has no others, so a wildcard matches only
them). Values are materialized whole on every tp rank, then scattered from tp rank 0.

Colwise layers take a replicated input and keep their output sharded; rowwise
layers sum the partial outputs into a replicated plain tensor. So a block's output,
which is what crosses a pipeline cut, is a plain tensor as without TP, and torch's
``PipelineStage`` sends it unchanged. Attention runs on the local heads: HF
attention reshapes the q/k/v outputs with ``view(..., -1, head_dim)``.

The embedding, the final norm and the head stay replicated (the causal LM's own
``_tp_plan`` shards ``lm_head`` with a gathered output; autopart does not yet), so
the loss is computed exactly as without TP. Sharded parameters and their gradients
are ``DTensor``s: ``p.grad.full_tensor()`` gathers one.
"""

from __future__ import annotations

import fnmatch
import logging

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    RowwiseParallel,
    parallelize_module,
)

from autopart.errors import RuntimeSetupError

__all__ = ["apply_tensor_parallel", "is_sharded", "local_tensor", "tp_plan_of"]

logger = logging.getLogger(__name__)

# HF tp-plan style -> torch ParallelStyle (layer outputs are plain local tensors), as
# transformers.distributed.tensor_parallel registers them
_STYLES = {
    "colwise": lambda: ColwiseParallel(),
    "rowwise": lambda: RowwiseParallel(),
    "colwise_rep": lambda: ColwiseParallel(output_layouts=Replicate()),
    "colwise_gather_output": lambda: ColwiseParallel(output_layouts=Replicate()),
    "rowwise_rep": lambda: RowwiseParallel(input_layouts=Replicate()),
    "rowwise_split_input": lambda: RowwiseParallel(input_layouts=Replicate()),
}
# a replicated module that sees only this rank's heads (Qwen3's per-head q_norm): its
# parameters stay plain and their gradients are summed over the tp group after backward
_GRAD_SUM = "replicated_with_grad_allreduce"
_HEAD_COUNTS = ("num_attention_heads", "num_key_value_heads")


def tp_plan_of(root: nn.Module, tp_size: int) -> dict[str, str]:
    """The model's tensor-parallel plan as ``{FQN pattern: style}``, checked for ``tp_size``.

    Args:
        root: The whole model (any device); an HF model with ``config.base_model_tp_plan``.
        tp_size: Ranks each layer is split over.

    Returns:
        ``base_model_tp_plan`` with the base model's prefix (``model.layers.*.mlp.up_proj``).

    Raises:
        RuntimeSetupError: The model has no tp plan, uses a style autopart does not
            map, or ``tp_size`` does not divide its attention heads.
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
    for attr in _HEAD_COUNTS:
        heads = getattr(config, attr, None)
        if isinstance(heads, int) and heads % tp_size:
            raise RuntimeSetupError(f"tp_size {tp_size} does not divide {attr} ({heads}) of "
                                    f"{name}; use a tp_size that divides it")
    prefix = getattr(root, "base_model_prefix", "")
    if prefix and isinstance(getattr(root, prefix, None), nn.Module):
        return {f"{prefix}.{pattern}": style for pattern, style in base_plan.items()}
    return base_plan


def apply_tensor_parallel(module: nn.Module, tp_plan: dict[str, str],
                          mesh: DeviceMesh) -> list[nn.Parameter]:
    """Shard the layers of ``module`` (this rank's blocks) that ``tp_plan`` names over ``mesh``.

    Args:
        module: This rank's pruned model tree, materialized, with original FQNs.
        tp_plan: ``{FQN pattern: style}`` from ``tp_plan_of``.
        mesh: The 1-D tensor-parallel mesh.

    Returns:
        The replicated parameters whose gradients must be summed over the tp group
        after backward (style ``replicated_with_grad_allreduce``).

    Raises:
        RuntimeSetupError: A layer the plan shards is not a Linear layer whose split
            dimension ``mesh.size()`` divides.
    """
    styles: dict[str, ParallelStyle] = {}
    grad_sum: list[nn.Parameter] = []
    for fqn, sub in module.named_modules():
        style = next((s for pattern, s in tp_plan.items() if _matches(fqn, pattern)), None)
        if style == _GRAD_SUM:
            grad_sum.extend(p for p in sub.parameters() if p.requires_grad)
        elif style is not None:
            _check_layer(fqn, sub, style, mesh.size())
            styles[fqn] = _STYLES[style]()
    if styles:
        parallelize_module(module, mesh, styles)
    elif any(True for _ in module.parameters()):
        logger.warning("tensor parallelism: no layer of this rank matches the model's tp plan "
                       "%s; its blocks stay replicated", sorted(tp_plan)[:2])
    return grad_sum


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


def local_tensor(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a ``DTensor`` (sharing its storage), or ``tensor`` itself."""
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def is_sharded(tensor: torch.Tensor) -> bool:
    """True for a ``DTensor`` split over its mesh (each rank holds a different part)."""
    return isinstance(tensor, DTensor) and any(isinstance(p, Shard) for p in tensor.placements)
