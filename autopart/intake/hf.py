"""The loss of HF causal LMs: next-token cross entropy over the tokens that count."""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["IGNORE_INDEX", "causal_lm_loss"]

IGNORE_INDEX = -100


def causal_lm_loss(logits: torch.Tensor, labels: torch.Tensor,
                   num_tokens: int | torch.Tensor | None = None) -> torch.Tensor:
    """Next-token cross entropy; positions labelled -100 are ignored.

    With ``num_tokens`` the summed loss is divided by it (so microbatch losses add
    up to the full batch's mean); otherwise the mean over this batch's tokens.
    """
    shift_logits = logits[..., :-1, :].reshape(-1, logits.shape[-1]).float()
    shift_labels = labels[..., 1:].reshape(-1).to(shift_logits.device)
    if num_tokens is None:
        return F.cross_entropy(shift_logits, shift_labels, ignore_index=IGNORE_INDEX)
    total = F.cross_entropy(shift_logits, shift_labels, ignore_index=IGNORE_INDEX,
                            reduction="sum")
    return total / num_tokens
