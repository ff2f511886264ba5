"""Feed each block exactly what the model's own forward gives it, one block at a time.

``autopart.profile.runner.ForwardRunner`` runs the model's forward once
(``autopart.intake.forward``) with every block call routed to the profiler's
``visit``; on the meta and XLA glue devices a block's output comes back as zeros of
its shape. ``visit`` turns a call into a ``BlockTask`` (``make_task``): the call's
first stream argument (what crosses a cut before it) is the task's input, every
other argument (context) is held fixed. The last call's task ends in the loss: the
next-token loss on HF causal LMs, ``output.float().pow(2).mean()`` otherwise.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_map_only

from autopart.errors import ProfileError
from autopart.intake import BlockChain
from autopart.intake.forward import (
    leaf_paths,
    replace_leaves,
)
from autopart.intake.hf import causal_lm_loss

__all__ = []


@dataclass(slots=True)
class BlockTask:
    """One materialized block call, its input and how to run it."""

    run: Callable[[torch.Tensor], torch.Tensor]
    """Forward from the block input to its output (to the loss for the last block)."""
    inputs: torch.Tensor
    """The block input: a leaf that requires grad iff ``input_grad``."""
    input_grad: bool
    """Whether the backward computes a gradient for the input (B > 0)."""
    loss_output: bool
    """The output is a scalar loss: backward starts from it with no incoming gradient."""
    module: nn.Module
    exclude: tuple[torch.Tensor, ...] = ()
    """Tensors that are not activations of this block (context shared by all layers)."""
    meta_task: Callable[[nn.Module], BlockTask] | None = None
    """The same call on meta for a meta copy of the module (XLA computes memory there)."""
    call: Callable[[], Any] | None = None
    """Run the module on the call's own arguments; its whole output (what the model sees)."""

    def forward(self) -> torch.Tensor:
        """Run the block's forward once."""
        return self.run(self.inputs)

    def trainable(self) -> list[torch.Tensor]:
        """Parameters that receive gradients."""
        return [p for p in self.module.parameters() if p.requires_grad]


def make_task(chain: BlockChain, call_idx: int, module: nn.Module, args: tuple, kwargs: dict,
              device: torch.device, labels: torch.Tensor) -> BlockTask:
    """The task running ``module`` (a materialized copy) on the call's arguments on ``device``.

    Raises:
        ProfileError: the call has no tensor argument to start from.
    """
    record = chain.call(call_idx)
    args, kwargs = tree_map_only(torch.Tensor, lambda t: on_device(t, device), (args, kwargs))
    leaves = leaf_paths(args, kwargs)
    positions = [i for i, slot in enumerate(record.stream) if slot == 0]
    if not positions:
        positions = [next((i for i, x in enumerate(leaves) if isinstance(x, torch.Tensor)), -1)]
        if positions[0] < 0:
            raise ProfileError(f"block {record.fqn} receives no tensor; autopart cannot time it")
    start = leaves[positions[0]]
    grad = start.is_floating_point() and record.num_stream > 0
    x = start.detach().requires_grad_(grad)
    context = tuple(leaf for i, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor)
                    and i not in positions)
    last = call_idx == len(chain.call_fqns) - 1
    target = labels.to(device) if device.type != "meta" else torch.empty_like(labels,
                                                                               device="meta")

    def run(value: torch.Tensor) -> torch.Tensor:
        a, kw = replace_leaves(args, kwargs, {i: value for i in positions})
        out = first_tensor(module(*a, **kw), record.fqn)
        return task_loss(chain, out, target) if last else out

    def on_meta(meta_module: nn.Module) -> BlockTask:
        return make_task(chain, call_idx, meta_module, args, kwargs, torch.device("meta"),
                         labels)

    return BlockTask(run=run, inputs=x, input_grad=grad, loss_output=last, module=module,
                     exclude=context, meta_task=on_meta, call=lambda: module(*args, **kwargs))


def on_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A detached copy of ``t`` on ``device`` (an empty tensor of its shape on meta)."""
    if device.type == "meta":
        return torch.empty_like(t, device="meta")
    return t.detach().to(device)


def task_loss(chain: BlockChain, out: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """The loss the profile's last call ends in: the causal-LM loss of a Hugging Face
    model's logits on ``labels``, else the mean square of the output."""
    if chain.family == "hf_causal_lm":
        return causal_lm_loss(out, labels)
    return out.float().pow(2).mean()


def first_tensor(out: object, fqn: str) -> torch.Tensor:
    """The first tensor of a block's output (``fqn`` names the block when there is none).

    Raises:
        ProfileError: the output holds no tensor.
    """
    if isinstance(out, torch.Tensor):
        return out
    for leaf in tree_flatten(out)[0]:
        if isinstance(leaf, torch.Tensor):
            return leaf
    raise ProfileError(f"block {fqn} returned {type(out).__name__} with no tensor in it")
