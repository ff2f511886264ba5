"""The whole-batch token-mean loss of causal LMs, split over microbatches exactly."""

from __future__ import annotations

import torch

from autopart.intake.hf import IGNORE_INDEX, causal_lm_loss
from autopart.runtime.head_shards import summed_loss

__all__ = ["HeadShardLoss", "TokenMeanLoss", "count_target_tokens"]


def count_target_tokens(labels: torch.Tensor) -> torch.Tensor:
    """Number of positions the next-token loss counts (shifted labels not -100)."""
    return (labels[..., 1:] != IGNORE_INDEX).sum()


class TokenMeanLoss:
    """Microbatch loss = its summed token losses / the valid tokens of the whole batch.

    The microbatch losses then add up to the batch's token mean, so with
    ``scale_grads=False`` the gradients equal those of the unpipelined model on
    the whole batch, padding included. ``num_tokens`` is set before every step.
    """

    def __init__(self) -> None:
        self.num_tokens: torch.Tensor | int = 1

    def __call__(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return causal_lm_loss(logits, labels, num_tokens=self.num_tokens)


class HeadShardLoss(TokenMeanLoss):
    """``TokenMeanLoss`` when the head is split: the last stage outputs per-position losses.

    The last shard stage returns ``lse - target`` per position
    (``autopart.runtime.head_shards``); this sums the positions that count and
    divides by the whole batch's token count, as ``TokenMeanLoss`` does.
    """

    def __call__(self, losses: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        return summed_loss(losses, labels) / self.num_tokens
