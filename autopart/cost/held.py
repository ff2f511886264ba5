"""Modules held whole on several stages: one cost for the tied weight, head shards and slices.

A module cut along ``units`` or ``vocab`` (``autopart.schema.parts``: a half cut into
slices, the head into vocabulary shards) runs on every stage that holds one of its parts,
and each such stage holds the module *whole*: its weight, gradient and optimizer state.
A weight two blocks share (a tied input embedding and head) is the same: each of the two
stages holds it. Such a group of blocks is ``held whole``:

- a stage holding any of its blocks holds the group's whole static bytes (``stage_cost``);
- a rank holding it on several stages holds it once (``autopart.cost.rank``);
- after the step the ranks holding it sum its gradient, a ring over them.

Groups are keyed by the module: the half's module ``P``, the head (also for the tied
weight, which the embedding shares with the head or its shards). A cut-up module's parts
are contiguous, so a stage starting or ending inside one extends to its ends (``span``);
the tied weight's two holders lie at the chain's two ends and are counted per block.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from autopart.schema import Profile

__all__ = []


@dataclass(frozen=True, slots=True)
class HeldWhole:
    """The groups of a chain's blocks held whole (module docstring), as arrays."""

    keys: tuple[str, ...]
    """Each group's module FQN."""
    whole_params: np.ndarray
    """Per group, the parameters of its whole module (or shared weight)."""
    group_of: np.ndarray
    """Per block, the group it belongs to, or -1."""
    part_params: np.ndarray
    """Per block, its parameters that belong to its group (its whole count for a part of a
    cut-up module, the shared weight for a tied block); the rest are its own."""
    span: tuple[np.ndarray, np.ndarray] | None
    """Per block, the first and last block of the cut-up module it is a part of (itself
    for other blocks); ``None`` when no module is cut up."""

    def groups_in(self, first: int, last: int) -> list[tuple[int, bool]]:
        """The groups blocks ``first .. last`` touch, in order, each with whether the
        stage holds only some of its blocks (it then shares the group with another)."""
        found = self.group_of[first:last + 1]
        found = found[found >= 0]
        groups = list(dict.fromkeys(int(g) for g in found))
        return [(g, int((found == g).sum()) < int((self.group_of == g).sum())) for g in groups]


def held_whole(profile: Profile) -> HeldWhole | None:
    """The held-whole groups of ``profile``'s blocks, or ``None`` when there are none.

    Parts along ``units`` or ``vocab`` form one group per module; a tied embedding and
    head (``ModelInfo.tied_embeddings``) join the head's group, with the shared weight
    ``vocab x hidden`` (at most either block's parameters) as the part of each.
    """
    blocks = profile.blocks
    n = len(blocks)
    keys: list[str] = []
    group_of = np.full(n, -1, dtype=np.int64)
    part = np.zeros(n, dtype=np.int64)
    for i, block in enumerate(blocks):
        derived = block.parts[-1] if block.parts and block.parts[-1].derived else None
        if derived is not None:
            if derived.module not in keys:
                keys.append(derived.module)
            group_of[i] = keys.index(derived.module)
            part[i] = block.num_params
    whole = [int(part[group_of == g].sum()) for g in range(len(keys))]
    _join_tied(profile, keys, whole, group_of, part)
    if not keys:
        return None
    return HeldWhole(keys=tuple(keys), whole_params=np.array(whole, dtype=np.int64),
                     group_of=group_of, part_params=part, span=_span(blocks, group_of))


def _join_tied(profile: Profile, keys: list[str], whole: list[int], group_of: np.ndarray,
               part: np.ndarray) -> None:
    """Add the tied embedding and head to the head's group (made when the head is whole)."""
    blocks, model = profile.blocks, profile.model
    embeddings = [i for i, b in enumerate(blocks) if b.kind == "embedding"]
    heads = [i for i, b in enumerate(blocks) if b.kind == "head"]
    if not (model.tied_embeddings and len(embeddings) == 1 and heads):
        return
    head = blocks[heads[0]]
    key = head.parts[-1].module if head.parts else head.name
    whole_head = sum(blocks[i].num_params for i in heads)
    tied = min(model.vocab_size * model.hidden_size, blocks[embeddings[0]].num_params,
               whole_head)
    if key not in keys:
        keys.append(key)
        whole.append(0)
    g = keys.index(key)
    group_of[embeddings[0]] = g
    part[embeddings[0]] = tied
    if len(heads) == 1:  # the whole head: the shared weight is its part
        group_of[heads[0]] = g
        part[heads[0]] = tied
    whole[g] = max(whole[g], tied)


def _span(blocks, group_of: np.ndarray) -> tuple[np.ndarray, np.ndarray] | None:
    """``HeldWhole.span``: the parts of one cut-up module are consecutive blocks."""
    first = np.arange(len(blocks))
    last = np.arange(len(blocks))
    cut = False
    for i, block in enumerate(blocks):
        derived = block.parts[-1] if block.parts and block.parts[-1].derived else None
        if derived is not None:
            first[i] = i - derived.index
            last[i] = i + derived.count - 1 - derived.index
            cut = True
    return (first, last) if cut else None
