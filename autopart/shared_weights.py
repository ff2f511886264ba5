"""Weights held whole on several stages, for the cost model (``autopart.cost``).

Two kinds: the one weight shared across the chain (a tied embedding/head, a head
split into vocabulary shards, ``tied_params``), and the layer halves cut inside their
call into slices (``autopart.solve.slices``), each held whole by the two stages on
either side of the cut (``half_span``, ``span_sum``, ``shared_half``).
"""

from __future__ import annotations

import numpy as np

from autopart.intake.half_slices import parse_slice
from autopart.intake.head_split import parse_shard
from autopart.schema import Profile

__all__ = ["half_span", "shared_half", "span_sum", "tied_params"]

Span = tuple[np.ndarray, np.ndarray]


def tied_params(profile: Profile) -> tuple[np.ndarray, int]:
    """Per block, its parameters of the one weight held whole on several ranks, and
    that weight's parameters: a head split by vocabulary (each shard its rows, the
    whole head held), the tied embedding/head weight (``vocab x hidden`` on the
    embedding and on the head), or both; zeros and 0 when there is none."""
    blocks = profile.blocks
    part = np.zeros(len(blocks), dtype=np.int64)
    shards = [i for i, b in enumerate(blocks) if parse_shard(b.name)]
    heads = [i for i, b in enumerate(blocks) if b.kind == "head" and i not in shards]
    for i in shards:
        part[i] = blocks[i].num_params
    whole = int(part.sum())
    model = profile.model
    embeddings = [i for i, b in enumerate(blocks) if b.kind == "embedding"]
    if model.tied_embeddings and len(embeddings) == 1 and len(heads) + bool(shards) == 1:
        owners = embeddings + heads
        tied = min([model.vocab_size * model.hidden_size]
                   + [blocks[i].num_params for i in owners])
        part[owners] = tied
        whole = max(whole, tied)
    return part, whole


def half_span(names: list[str]) -> Span | None:
    """``(first, last)`` block index of the half each block is a slice of (itself for
    other blocks), or ``None`` when no block is a slice (``BlockArrays.half_span``)."""
    halves = [parse_slice(n) for n in names]
    if not any(halves):
        return None
    first = np.arange(len(names))
    last = np.arange(len(names))
    for i, parsed in enumerate(halves):
        if parsed is not None:
            first[i] = i - parsed[1]
            last[i] = i + parsed[2] - 1 - parsed[1]
    return first, last


def span_sum(span: Span | None, prefix: np.ndarray, first: int, last: int) -> int:
    """``prefix`` (a per-block prefix sum) over blocks ``first .. last``, with the halves
    the stage starts or ends inside counted whole."""
    if span is not None:
        first, last = int(span[0][first]), int(span[1][last])
    return int(prefix[last + 1] - prefix[first])


def shared_half(span: Span | None, prefix_static: np.ndarray, last: int) -> int:
    """Static bytes of the half a stage ending at block ``last`` ends inside (0 if none)."""
    if span is None or span[1][last] == last:
        return 0
    lo, hi = int(span[0][last]), int(span[1][last])
    return int(prefix_static[hi + 1] - prefix_static[lo])
