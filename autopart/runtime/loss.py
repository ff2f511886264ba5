"""``CausalLMLoss``, autopart's built-in loss, and the per-microbatch forms the runtime runs.

What ``target`` means is decided here, once:

* ``CausalLMLoss(shift_labels=True)`` (the default, and what ``auto_pipeline`` uses for an
  HF causal LM when no ``loss_fn`` is given): ``target`` is the labels as HF models take
  them, one token id per input position (usually the input ids), ``ignore_index`` (-100)
  where a position does not count. The loss predicts ``target[:, t + 1]`` from the logits
  at position ``t``: the shift by one is done here, never by the caller.
* ``CausalLMLoss(shift_labels=False)``: ``target`` is already aligned with the logits
  (``target[:, t]`` is the token the logits at ``t`` predict), as torchtitan's data
  loaders produce (inputs ``tokens[:-1]``, labels ``tokens[1:]``).

Either way the loss is the mean over every counted token of the whole batch: all
microbatches and all data-parallel replicas, so a padded batch trains exactly as the
unpipelined model does on it. Each microbatch's summed token losses are divided by the
batch's token count, which ``PipelinedModel.step`` counts before the schedule runs, and
torch's schedule then adds the microbatch gradients without scaling them.

The runtime runs the loss in one of three forms, by where the vocabulary is:

* ``LogitsLoss``: the last stage returns whole logits (cross entropy, as HF computes it);
* ``TokenLossesLoss``: the head is split by vocabulary across stages
  (``autopart.runtime.head_shards``): the last stage returns per-position losses;
* ``VocabParallelLoss``: tensor parallelism holds the head split by vocabulary over the
  tp group: each tp rank's last stage returns the logits of its rows, and the loss
  folds the tp ranks' ``(lse, target)`` carries exactly as the head split folds the
  stages' (``autopart.runtime.head_shards.fold_carries``).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from autopart.runtime.head_shards import (
    gather_carries,
    slice_carry,
    summed_loss,
    token_losses,
)

__all__ = ["CausalLMLoss"]


class CausalLMLoss:
    """Next-token cross entropy of a causal LM: the token mean over the whole batch.

    Pass it as ``auto_pipeline(..., loss_fn=autopart.CausalLMLoss())``; it runs with the
    head whole, split by vocabulary across stages, or split over the tensor-parallel
    group (a plan's head split needs it: a custom callable cannot see a split head's
    logits). Called directly,
    ``loss(logits, target)`` is the same loss on one unpipelined batch (a reference run).

    Args:
        shift_labels: ``True``: ``target`` holds the labels as HF takes them and the
            logits at ``t`` predict ``target[:, t + 1]``; ``False``: ``target`` is
            aligned with the logits already.
        ignore_index: Label of positions that do not count (padding, prompts).
    """

    def __init__(self, *, shift_labels: bool = True, ignore_index: int = -100) -> None:
        self.shift_labels = shift_labels
        self.ignore_index = ignore_index

    def __repr__(self) -> str:
        return (f"CausalLMLoss(shift_labels={self.shift_labels}, "
                f"ignore_index={self.ignore_index})")

    def targets(self, target: torch.Tensor) -> torch.Tensor:
        """``target`` aligned with the logits: ``target[..., 1:]`` when shifting, else itself.

        The logits used are the first ``targets(target).shape[-1]`` positions (all but
        the last when shifting)."""
        return target[..., 1:] if self.shift_labels else target

    def count(self, target: torch.Tensor) -> torch.Tensor:
        """Number of tokens that count in ``target`` (as passed to ``step``)."""
        return (self.targets(target) != self.ignore_index).sum()

    def __call__(self, logits: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """The mean loss of ``logits`` against ``target`` over this batch's counted tokens."""
        aligned = self.targets(target)
        total = _summed_cross_entropy(logits, aligned, self.ignore_index)
        return total / (aligned != self.ignore_index).sum().clamp(min=1)


class TokenMeanLoss:
    """A microbatch's summed token losses / the counted tokens of the whole batch.

    The microbatch losses then add up to the batch's token mean; with
    ``scale_grads=False`` the gradients equal those of the unpipelined model on the
    whole batch, padding included. ``num_tokens`` is set before every step; the
    targets the schedule passes are already aligned (``CausalLMLoss.targets``).
    """

    def __init__(self, spec: CausalLMLoss) -> None:
        self.spec = spec
        self.num_tokens: torch.Tensor | int = 1


class LogitsLoss(TokenMeanLoss):
    """The last stage returns whole logits."""

    def __call__(self, logits: torch.Tensor, aligned: torch.Tensor) -> torch.Tensor:
        return _summed_cross_entropy(logits, aligned, self.spec.ignore_index) / self.num_tokens


class TokenLossesLoss(TokenMeanLoss):
    """The head is split by vocabulary across stages: the last stage returns ``lse - target``
    per position (``autopart.runtime.head_shards``)."""

    def __call__(self, losses: torch.Tensor, aligned: torch.Tensor) -> torch.Tensor:
        return summed_loss(losses, aligned, self.spec.ignore_index) / self.num_tokens


class VocabParallelLoss(TokenMeanLoss):
    """The head is split by vocabulary over the tensor-parallel group: the last stage returns
    this tp rank's logits, of the vocabulary rows ``[lo, hi)``.

    Each rank folds its rows into an ``(lse, target)`` carry (``slice_carry``), the carries
    of the group are gathered and folded in rank order, as the stages of a split head fold
    theirs, and every rank then holds the same per-position losses. The gather's backward
    hands each rank the gradient of its own carry only: the loss after it is computed
    alike on every rank, each rank running its own backward.
    """

    def __init__(self, spec: CausalLMLoss, rows: tuple[int, int],
                 group: dist.ProcessGroup) -> None:
        super().__init__(spec)
        self.rows = rows
        self.group = group

    def __call__(self, logits: torch.Tensor, aligned: torch.Tensor) -> torch.Tensor:
        carry = slice_carry(logits[..., :aligned.shape[-1], :], self.rows, aligned)
        losses = token_losses(gather_carries(carry, self.group))
        return summed_loss(losses, aligned, self.spec.ignore_index) / self.num_tokens


def _summed_cross_entropy(logits: torch.Tensor, aligned: torch.Tensor,
                          ignore_index: int) -> torch.Tensor:
    """Summed cross entropy of the first ``aligned.shape[-1]`` positions of ``logits``."""
    used = logits[..., :aligned.shape[-1], :]
    return F.cross_entropy(used.reshape(-1, used.shape[-1]).float(),
                           aligned.reshape(-1).to(used.device), ignore_index=ignore_index,
                           reduction="sum")
