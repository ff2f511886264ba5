"""A block's backward the way torch's zero-bubble schedules split it.

They run B as ``stage_backward_input``, which records the gradient flowing into every op
that feeds a weight (its ``param_groups``' grads) and keeps it, with the whole graph,
until W, ``stage_backward_weight``: a graph walk per parameter group, each weight's
gradient made apart and added into ``.grad``. The profiler counts what B keeps
(``held_for_weight_bytes``) and times B and W that way (``timed_split``), whose sum less
the full backward is ``BlockProfile.split_extra_ms``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from autopart.profile.backends import Backend
from autopart.profile.memory import storage_key
from autopart.profile.tasks import BlockTask

__all__ = []


def held_for_weight_bytes(task: BlockTask, grad_out: torch.Tensor | None) -> int:
    """Bytes of the gradients the block's B keeps alive until its W in a split backward.

    This runs the block's forward and torch's B and counts those gradients, each storage
    once (on meta too). 0 for a block without an input gradient or without trainable
    weights. ``grad_out``: the incoming gradient (``None`` for the loss).
    """
    params = task.trainable()
    if not (task.input_grad and params):
        return 0
    task.inputs.grad = None
    _, groups = _split_b(task, task.forward(), grad_out, params)
    kept = {storage_key(g) or id(g): g.untyped_storage().nbytes()
            for group in groups for grads in group.get("grads") or ()
            for g in grads if isinstance(g, torch.Tensor)}
    task.inputs.grad = None
    return sum(kept.values())


def timed_split(task: BlockTask, backend: Backend, out: torch.Tensor,
                grad_out: torch.Tensor | None, warm: Callable[[], None] | None
                ) -> tuple[float, float]:
    """Ms of torch's B and of its W on ``out`` (the block's output, just computed), W
    adding into gradients made by the step's earlier microbatches; the block's gradients
    are cleared afterwards. The block needs trainable weights and an input gradient."""
    from torch.distributed.pipelining._backward import stage_backward_weight

    params = task.trainable()
    b_ms, (_, groups) = backend.time(lambda: _split_b(task, out, grad_out, params),
                                     (grad_out,), warm)
    for p in params:
        p.grad = torch.zeros_like(p)
    w_ms, _ = backend.time(lambda: stage_backward_weight(iter(params), groups), (), warm)
    for p in params:
        p.grad = None
    task.inputs.grad = None
    return b_ms, w_ms


def _split_b(task: BlockTask, out: torch.Tensor, grad_out: torch.Tensor | None,
             params: list[torch.nn.Parameter]) -> tuple[Any, list[dict[str, Any]]]:
    """torch's B (``stage_backward_input``) from ``out``."""
    from torch.distributed.pipelining._backward import stage_backward_input

    # B detaches its outputs in place: a view's copy (no weight op) keeps its base, and the
    # copy of an output that is the block's input (a block returning it untouched, as
    # Phi-4-multimodal's feature embedding on text alone) keeps the input a leaf that
    # every later round differentiates
    if out._is_view() or out is task.inputs:
        out = out.clone()
    return stage_backward_input([out], None if grad_out is None else [grad_out],
                                [task.inputs], iter(params))
