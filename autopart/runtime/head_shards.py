"""The next-token loss computed one vocabulary slice at a time, exactly.

For every position ``p`` the loss is ``logsumexp(z_p) - z_p[y_p]`` with ``z_p`` the
logits and ``y_p`` the next token. A stage holding the head's rows ``[lo, hi)``
computes ``z_p[lo:hi]`` only and updates three values per position, carried from
stage to stage as ordinary tensors (so autograd carries the gradients back):

* ``max``: the running maximum logit,
* ``sumexp``: the sum of ``exp(z - max)`` over the rows seen so far, rescaled
  whenever the maximum grows (the online softmax of Milakov and Gimelshein, 2018),
* ``target``: the target logit, added by the slice that holds the target row.

After the last slice ``max + log(sumexp) - target`` is the token loss; positions
labelled -100 count nothing, as in ``F.cross_entropy(ignore_index=-100)``. The
head weight is not sliced in memory: each stage indexes its rows of the whole
weight, and the weight's gradient is summed over the ranks holding it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from autopart.intake.hf import IGNORE_INDEX

__all__ = ["HeadCarry", "shard_carry", "summed_loss", "token_losses"]

HeadCarry = tuple[torch.Tensor, torch.Tensor, torch.Tensor]
"""``(max, sumexp, target)``, each float32 of shape ``[batch, seq - 1]``."""


def shard_carry(hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                rows: tuple[int, int], labels: torch.Tensor,
                carry: HeadCarry | None = None) -> HeadCarry:
    """Fold the logits of rows ``[lo, hi)`` into ``carry`` (a fresh one when ``None``).

    Args:
        hidden: The head's input ``[batch, seq, hidden]``.
        weight: The head's whole weight ``[vocab, hidden]``.
        bias: Its bias ``[vocab]`` or ``None``.
        rows: ``(lo, hi)``, the vocabulary rows of this slice.
        labels: Token labels ``[batch, seq]`` (unshifted, -100 ignored).
        carry: The values after the previous slices.

    Returns:
        The carry after this slice.
    """
    lo, hi = rows
    part_bias = bias[lo:hi] if bias is not None else None
    logits = F.linear(hidden[..., :-1, :], weight[lo:hi], part_bias).float()
    targets = labels[..., 1:].to(logits.device) - lo
    inside = (targets >= 0) & (targets < hi - lo)
    picked = logits.gather(-1, targets.clamp(0, hi - lo - 1).unsqueeze(-1)).squeeze(-1)
    picked = torch.where(inside, picked, torch.zeros_like(picked))
    local_max = logits.amax(dim=-1)
    if carry is None:
        sumexp = torch.exp(logits - local_max.unsqueeze(-1)).sum(-1)
        return local_max, sumexp, picked
    run_max, run_sum, run_target = carry
    new_max = torch.maximum(run_max, local_max)
    sumexp = (run_sum * torch.exp(run_max - new_max)
              + torch.exp(logits - new_max.unsqueeze(-1)).sum(-1))
    return new_max, sumexp, run_target + picked


def token_losses(carry: HeadCarry) -> torch.Tensor:
    """Per-position losses ``max + log(sumexp) - target`` after the last slice."""
    run_max, run_sum, run_target = carry
    return run_max + torch.log(run_sum) - run_target


def summed_loss(losses: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Sum of the per-position losses over the positions whose next label is not -100."""
    valid = labels[..., 1:].to(losses.device) != IGNORE_INDEX
    return torch.where(valid, losses, torch.zeros_like(losses)).sum()
