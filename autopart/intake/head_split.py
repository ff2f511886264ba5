"""Which heads can be cut by vocabulary, and the rows a vocabulary part covers.

A causal LM's head block (the output projection, with the loss after it) can be cut
into ``k`` parts along ``vocab`` (``autopart.schema.parts``; named
``<head>.shard<i>of<k>``, e.g. ``lm_head.shard1of4``) that run on consecutive stages.
Part ``i`` of ``k`` covers the vocabulary rows ``[i * V // k, (i + 1) * V // k)`` of the
head's weight. A stage holding parts computes only its rows' logits and passes on the
final hidden state with two running values per token (the log-sum-exp of the logits so
far, shifted by their maximum, and the target logit): ``autopart.runtime.head_shards``
holds that arithmetic.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # planning must not import torch
    from torch import nn

__all__ = ["head_split_refusal", "vocab_range"]

_LOGIT_TRANSFORMS = ("logit_scale", "final_logit_softcapping", "logits_scaling",
                     "output_multiplier_scale", "logits_soft_cap")
"""Config fields of HF families whose forward changes the logits after the head."""

_KEEPS_LOGITS = frozenset({
    "__getitem__", "view", "reshape", "contiguous", "float", "to", "type", "clone",
    "detach", "narrow", "squeeze", "unsqueeze", "flatten",
})
"""Calls on the logits that change no value (views, copies, dtype casts)."""


def vocab_range(idx: int, num_shards: int, vocab_size: int) -> tuple[int, int]:
    """Rows ``[lo, hi)`` of the head's weight that shard ``idx`` of ``num_shards`` covers."""
    return idx * vocab_size // num_shards, (idx + 1) * vocab_size // num_shards


def head_split_refusal(model: nn.Module, head: str,
                       after_head: tuple[str, ...] = ()) -> str | None:
    """Why the head ``head`` of ``model`` cannot be split by vocabulary, or ``None``.

    The split computes ``hidden @ weight[lo:hi].T (+ bias[lo:hi])`` itself, so the
    head must be an ``nn.Linear`` whose output the model returns unchanged: no logit
    scaling or soft-capping in the config, and no call that changes values among
    ``after_head``, the torch calls the model's own forward applied to the head's
    output when it was watched (``ForwardTrace.after_last``: RecurrentGemma's
    ``tanh(logits / cap) * cap``, under a config key no list of known keys held).
    """
    module = model.get_submodule(head)
    from torch import nn

    if not isinstance(module, nn.Linear):
        return f"the head {head} is a {type(module).__name__}, not an nn.Linear"
    config = getattr(model, "config", None)
    for field in _LOGIT_TRANSFORMS:
        value = getattr(config, field, None)
        if value not in (None, 1, 1.0, 0, 0.0, False):
            return f"the model's forward changes the logits after {head} ({field}={value})"
    changes = [name for name in after_head if name not in _KEEPS_LOGITS]
    if changes:
        return f"the model's forward changes the logits after {head} (it calls " \
               f"{', '.join(changes[:3])} on them)"
    return None
