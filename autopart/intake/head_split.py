"""Vocabulary shards of the head: names of the shard blocks and which heads can be split.

A causal LM's head block (the output projection, with the loss after it) can be
split into ``k`` **shard blocks** that run on consecutive stages. Shard ``i`` of
``k`` is named ``<head>.shard<i>of<k>`` (``lm_head.shard1of4``) and covers the
vocabulary rows ``[i * V // k, (i + 1) * V // k)`` of the head's weight. A stage
holding shards computes only its rows' logits and passes on the final hidden state
with two running values per token (the log-sum-exp of the logits so far, shifted
by their maximum, and the target logit): ``autopart.runtime.head_shards`` holds
that arithmetic. Shard names are
what plans list in ``stages[].modules`` and ``pipeline_cuts``, and what
``autopart plan --cuts`` accepts.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # shard names are plain strings: planning must not import torch
    from torch import nn

__all__ = ["collapse_shards", "head_split_refusal", "parse_part", "parse_shard", "shard_name",
           "shard_names", "vocab_range"]

_SHARD = re.compile(r"^(?P<head>.+)\.shard(?P<idx>\d+)of(?P<num>\d+)$")
_LOGIT_TRANSFORMS = ("logit_scale", "final_logit_softcapping", "logits_scaling",
                     "output_multiplier_scale")
"""Config fields of HF families whose forward changes the logits after the head."""


def shard_name(head: str, idx: int, num_shards: int) -> str:
    """``lm_head.shard{idx}of{num_shards}``: the block name of one vocabulary shard."""
    return f"{head}.shard{idx}of{num_shards}"


def shard_names(head: str, num_shards: int) -> list[str]:
    """The names of all ``num_shards`` shard blocks of ``head``, in order."""
    return [shard_name(head, i, num_shards) for i in range(num_shards)]


def parse_shard(name: str) -> tuple[str, int, int] | None:
    """``(head, idx, num_shards)`` of a shard block name, or ``None`` for other names."""
    return parse_part(_SHARD, name)


def parse_part(pattern: re.Pattern[str], name: str) -> tuple[str, int, int] | None:
    """``(block, idx, num)`` of a part name (``pattern``: groups ``idx``, ``num`` and the
    block's first), or ``None`` when it does not match or ``idx`` is not in ``0..num-1``
    with ``num >= 2``."""
    match = pattern.match(name)
    if match is None:
        return None
    idx, num = int(match["idx"]), int(match["num"])
    if num < 2 or idx >= num:
        return None
    return match[1], idx, num


def vocab_range(idx: int, num_shards: int, vocab_size: int) -> tuple[int, int]:
    """Rows ``[lo, hi)`` of the head's weight that shard ``idx`` of ``num_shards`` covers."""
    return idx * vocab_size // num_shards, (idx + 1) * vocab_size // num_shards


def collapse_shards(names: Sequence[str]) -> list[str]:
    """Block names with every shard replaced by its head, each head listed once."""
    out: list[str] = []
    for name in names:
        parsed = parse_shard(name)
        base = parsed[0] if parsed else name
        if not (parsed and out and out[-1] == base):
            out.append(base)
    return out


def head_split_refusal(model: nn.Module, head: str) -> str | None:
    """Why the head ``head`` of ``model`` cannot be split by vocabulary, or ``None``.

    The split computes ``hidden @ weight[lo:hi].T (+ bias[lo:hi])`` itself, so the
    head must be an ``nn.Linear`` whose output the model returns unchanged (no logit
    scaling or soft-capping in the config).
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
    return None
