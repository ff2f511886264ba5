"""The loss of HF causal LMs: next-token cross entropy over the tokens that count."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["IGNORE_INDEX", "causal_lm_loss", "own_router_loss_off"]

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


@contextlib.contextmanager
def own_router_loss_off(model: nn.Module) -> Iterator[None]:
    """The HF model's own router load-balancing loss off (``output_router_logits``) for
    the duration, restored after.

    Neither the profiler nor a stage lets the model compute it: autopart adds the loss
    itself (``autopart.runtime.aux_loss``, whose hooks on the routers do not need the
    model to record their logits). The model would compute it from the logits its own
    forward recorded: none where the block calls are answered by recorded outputs
    (``ForwardRunner.time_glue``) or where the last stage holds no MoE layer, and HF's
    ``load_balancing_loss_func`` fails on the empty tuple; a part of them elsewhere,
    work thrown away."""
    config = getattr(model, "config", None)
    if not getattr(config, "output_router_logits", False):
        yield
        return
    config.output_router_logits = False
    try:
        yield
    finally:
        config.output_router_logits = True
