"""One pipeline stage of an HF causal LM, and the whole-batch token-mean loss.

A stage holds a contiguous run of blocks (embedding, decoder layers, final norm,
head) under their original FQNs and calls them through ``HFCausalLM``. The padding
mask and position ids reach every stage as per-microbatch keyword arguments of
the schedule's ``step`` (torch splits them like the inputs), so only hidden
states cross the pipeline and padded batches train exactly as unpipelined.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from autopart.intake import HFCausalLM, causal_lm_loss
from autopart.intake.hf import IGNORE_INDEX
from autopart.runtime.tree import Tree, prune

__all__ = ["HFStage", "TokenMeanLoss", "count_target_tokens"]


class HFStage(Tree):
    """Blocks ``fqns`` of an HF causal LM, run in order; keeps the original FQNs."""

    def __init__(self, root: nn.Module, fqns: list[str], shared: tuple[str, ...], *,
                 recompute: bool = False, autocast_dtype: torch.dtype | None = None) -> None:
        super().__init__()
        prune(root, [*fqns, *shared], into=self)
        self.config = root.config
        self._fqns = list(fqns)
        self._layer_ids = [int(f.rsplit(".", 1)[1]) for f in fqns if f.startswith("model.layers.")]
        self._recompute = recompute
        self._autocast_dtype = autocast_dtype
        self._hf = HFCausalLM(self)

    def forward(self, x: torch.Tensor, attention_mask: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Token ids (first stage) or hidden states -> hidden states or logits (last stage)."""
        with self._autocast(x):
            hidden = self._hf.embed(x) if "model.embed_tokens" in self._fqns else x
            if self._layer_ids:
                ctx = self._hf.context(hidden, attention_mask, position_ids)
                for idx in self._layer_ids:
                    hidden = self._run_layer(idx, hidden, ctx)
            if "model.norm" in self._fqns:
                hidden = self._hf.norm(hidden)
            if "lm_head" in self._fqns:
                hidden = self._hf.head(hidden)
        return hidden

    def _run_layer(self, idx: int, hidden: torch.Tensor, ctx: Any) -> torch.Tensor:
        if not (self._recompute and self.training and torch.is_grad_enabled()):
            return self._hf.layer(idx, hidden, ctx)
        return checkpoint(lambda h: self._hf.layer(idx, h, ctx), hidden, use_reentrant=False)

    def _autocast(self, x: torch.Tensor) -> contextlib.AbstractContextManager:
        if self._autocast_dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(device_type=x.device.type, dtype=self._autocast_dtype)


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
