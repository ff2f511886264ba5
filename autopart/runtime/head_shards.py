"""The next-token loss computed one vocabulary slice at a time, exactly.

For every position ``p`` the loss is ``logsumexp(z_p) - z_p[y_p]`` with ``z_p`` the
logits and ``y_p`` the next token. A stage holding the head's rows ``[lo, hi)``
computes ``z_p[lo:hi]`` only and updates two values per position, carried from
stage to stage as ordinary tensors (so autograd carries the gradients back):

* ``lse``: the running log-sum-exp of the rows seen so far; each slice's own
  log-sum-exp (from ``log_softmax``, which shifts by the slice's maximum) joins it
  with ``torch.logaddexp``, which again shifts by the larger of the two (the online
  softmax of Milakov and Gimelshein, 2018, with the running maximum folded in);
* ``target``: the target logit, added by the slice that holds the target row.

After the last slice ``lse - target`` is the token loss; positions labelled -100
count nothing, as in ``F.cross_entropy(ignore_index=-100)``. A slice's backward is
written out (``_SliceLoss``): the softmax of its logits (``exp`` of the saved
``log_softmax``) times the incoming gradient of ``lse``, plus that of ``target``
at the target row, in one buffer, as cross entropy's own backward does.

Every rank with a shard holds the head's whole weight (so checkpoints keep the
original FQNs and a tied embedding stays one parameter) and takes its rows with
``autopart.runtime.held_grads.rows_of``: a view in the forward, and in the backward
the rows' gradient as a sparse tensor that autograd adds into the weight's dense
``.grad`` in place (indexing would add a full-size gradient on every backward of every
microbatch); the weight's gradient is summed over the ranks
holding it after the step (``autopart.runtime.pipeline``).

Under tensor parallelism the head is split by vocabulary over the tp group instead, and
the carries of the group's ranks are gathered and folded the same way
(``gather_carries``).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from autopart.intake.head_split import LogitOp, replay_logit_ops
from autopart.intake.hf import IGNORE_INDEX
from autopart.runtime.groups import wait_and_keep
from autopart.runtime.held_grads import rows_of

__all__ = []

HeadCarry = tuple[torch.Tensor, torch.Tensor]
"""``(lse, target)``, each float32 of shape ``[batch, positions]`` (``seq - 1`` when the
loss shifts the labels, ``autopart.runtime.loss.CausalLMLoss``)."""


class _SliceLoss(torch.autograd.Function):
    """``(logsumexp(logits), logits[target] or 0)`` per position, with a fused backward."""

    @staticmethod
    def forward(ctx, logits: torch.Tensor, index: torch.Tensor, inside: torch.Tensor):
        # log_softmax is one fused kernel (cross entropy's own); lse = z - log_softmax(z)
        logp = torch.log_softmax(logits, dim=-1)
        lse = logits[..., 0] - logp[..., 0]
        picked = logits.gather(-1, index.unsqueeze(-1)).squeeze(-1)
        ctx.save_for_backward(logp, index, inside)
        return lse, torch.where(inside, picked, torch.zeros_like(picked))

    @staticmethod
    def backward(ctx, grad_lse: torch.Tensor | None, grad_picked: torch.Tensor | None):
        logp, index, inside = ctx.saved_tensors
        grad = torch.exp(logp)  # the softmax
        if grad_lse is None:
            grad.zero_()
        else:
            grad.mul_(grad_lse.unsqueeze(-1))
        if grad_picked is not None:
            at_target = torch.where(inside, grad_picked, torch.zeros_like(grad_picked))
            grad.scatter_add_(-1, index.unsqueeze(-1), at_target.unsqueeze(-1))
        return grad, None, None


def shard_carry(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                rows: tuple[int, int], aligned: torch.Tensor,
                carry: HeadCarry | None = None,
                logit_ops: tuple[LogitOp, ...] = ()) -> HeadCarry:
    """Fold the logits of rows ``[lo, hi)`` into ``carry`` (a fresh one when ``None``).

    Args:
        hidden: The head's input ``[batch, seq, hidden]``; its first
            ``aligned.shape[-1]`` positions are used.
        weight: The head's whole weight ``[vocab, hidden]``.
        bias: Its bias ``[vocab]`` or ``None``.
        rows: ``(lo, hi)``, the vocabulary rows of this slice.
        aligned: The token each used position predicts, ``[batch, positions]``
            (``autopart.runtime.loss.CausalLMLoss.targets``; ignored positions hold any
            value outside the vocabulary, e.g. -100).
        carry: The values after the previous slices.
        logit_ops: What the model's code does to its logits after the head, replayed on
            the slice's (``ForwardTrace.logit_ops``: a soft-cap, a scale).

    Returns:
        The carry after this slice.
    """
    lo, hi = rows
    part_bias = rows_of(bias, lo, hi) if bias is not None else None
    used = hidden[..., :aligned.shape[-1], :]
    logits = replay_logit_ops(logit_ops, F.linear(used, rows_of(weight, lo, hi), part_bias))
    return fold_carries(carry, slice_carry(logits, rows, aligned))


def slice_carry(logits: torch.Tensor, rows: tuple[int, int],
                aligned: torch.Tensor) -> HeadCarry:
    """The carry of one vocabulary slice from its logits.

    Args:
        logits: The logits of rows ``[lo, hi)``, ``[batch, positions, hi - lo]``.
        rows: ``(lo, hi)``.
        aligned: The token each position predicts, ``[batch, positions]``.

    Returns:
        ``(logsumexp of the slice, the target logit where the target is in the slice, else 0)``
        per position, float32.
    """
    lo, hi = rows
    logits = logits.float()
    targets = aligned.to(logits.device) - lo
    inside = (targets >= 0) & (targets < hi - lo)
    return _SliceLoss.apply(logits, targets.clamp(0, hi - lo - 1), inside)


def fold_carries(carry: HeadCarry | None, part: HeadCarry) -> HeadCarry:
    """``carry`` with the slice ``part`` folded in: log-sum-exps joined, target logits added."""
    if carry is None:
        return part
    run_lse, run_target = carry
    lse, picked = part
    return torch.logaddexp(run_lse, lse), run_target + picked


class _GatherCarries(torch.autograd.Function):
    """Every rank's carry, stacked in rank order; the backward keeps this rank's own part.

    Every rank folds the same gathered carries into the same loss and runs its own
    backward from it, so the gradient of its own carry is already whole on each rank:
    nothing is summed on the way back (as Megatron's vocabulary-parallel cross entropy)."""

    @staticmethod
    def forward(ctx, lse: torch.Tensor, target: torch.Tensor, group: dist.ProcessGroup):
        ctx.rank = dist.get_rank(group)
        mine = torch.stack([lse, target]).contiguous()
        parts = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
        wait_and_keep(dist.all_gather(parts, mine, group=group, async_op=True))
        both = torch.stack(parts)  # [ranks, 2, batch, positions]
        return both[:, 0], both[:, 1]

    @staticmethod
    def backward(ctx, grad_lse: torch.Tensor, grad_target: torch.Tensor):
        return grad_lse[ctx.rank], grad_target[ctx.rank], None


def gather_carries(carry: HeadCarry, group: dist.ProcessGroup) -> HeadCarry:
    """The carries of every rank of ``group`` (each holding some vocabulary rows of the head,
    tensor parallelism) folded in rank order, as the stages of a split head fold theirs.

    Args:
        carry: This rank's carry (``slice_carry`` of its rows).
        group: The ranks holding the other rows (the tensor-parallel group).

    Returns:
        The carry of the whole vocabulary, the same on every rank of ``group``.
    """
    lses, targets = _GatherCarries.apply(*carry, group)
    folded = None
    for lse, target in zip(lses.unbind(0), targets.unbind(0)):
        folded = fold_carries(folded, (lse, target))
    return folded


def token_losses(carry: HeadCarry) -> torch.Tensor:
    """Per-position losses ``lse - target`` after the last slice."""
    run_lse, run_target = carry
    return run_lse - run_target


def summed_loss(losses: torch.Tensor, aligned: torch.Tensor,
                ignore_index: int = IGNORE_INDEX) -> torch.Tensor:
    """Sum of the per-position losses over the positions whose target is not ``ignore_index``."""
    valid = aligned.to(losses.device) != ignore_index
    return torch.where(valid, losses, torch.zeros_like(losses)).sum()
