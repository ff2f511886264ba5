"""Profile the two parts of a half split before its output projection (``projection``).

A split half's module ``P`` (``autopart.intake.inner``) is measured whole, as at
``sublayer``; its output projection ``C`` is measured alone on the arguments ``P``'s
forward gives it (captured while ``P`` runs), and the part before the cut is the
difference: ``P``'s forward up to ``C`` (projections, attention core, ``act(gate) * up``)
costs ``P - C`` in time, parameters and saved activations, since ``P`` is that part
followed by ``C``. What crosses the cut (``C``'s stream and the carried residual) is
counted from the real tensors, in the profile's dtype.
"""

from __future__ import annotations

import contextlib
import dataclasses
from collections.abc import Iterator

import torch
from torch import nn

from autopart.intake import BlockChain
from autopart.intake.forward import leaf_paths
from autopart.profile.engines import Figures
from autopart.schema import BlockProfile

__all__ = []


@contextlib.contextmanager
def capture_call(module: nn.Module, child: str) -> Iterator[dict]:
    """While inside, record ``module.get_submodule(child)``'s first call as ``{"call":
    (args, kwargs)}``."""
    seen: dict = {}

    def hook(_m: nn.Module, args: tuple, kwargs: dict) -> None:
        seen.setdefault("call", (args, kwargs))

    handle = module.get_submodule(child).register_forward_pre_hook(hook, with_kwargs=True)
    try:
        yield seen
    finally:
        handle.remove()


def stream_bytes(stream: tuple[int, ...], args: tuple, kwargs: dict) -> int:
    """Bytes of a call's distinct stream arguments (``CallRecord.stream`` slots)."""
    picked: dict[int, torch.Tensor] = {}
    for leaf, slot in zip(leaf_paths(args, kwargs), stream):
        if slot >= 0 and isinstance(leaf, torch.Tensor):
            picked.setdefault(slot, leaf)
    return sum(t.numel() * t.element_size() for t in picked.values())


def minus_figures(whole: Figures, part: Figures) -> Figures:
    """``whole`` less ``part`` (times, saved activations, the gradients B keeps for W and
    the weight gradients in the workspace, never below zero); spreads and output of
    ``whole``."""
    t, p = whole.times, part.times
    times = dataclasses.replace(
        t, fwd_ms=max(t.fwd_ms - p.fwd_ms, 0.0), bwd_ms=max(t.bwd_ms - p.bwd_ms, 0.0),
        bwd_input_ms=max(t.bwd_input_ms - p.bwd_input_ms, 0.0),
        bwd_weight_ms=max(t.bwd_weight_ms - p.bwd_weight_ms, 0.0),
        split_extra_ms=max(t.split_extra_ms - p.split_extra_ms, 0.0))
    w, q = whole.memory, part.memory
    adopted = max(w.adopted_grad_bytes - q.adopted_grad_bytes, 0)
    memory = dataclasses.replace(
        w, activation_bytes=max(w.activation_bytes - q.activation_bytes, 0),
        held_for_weight_bytes=max(w.held_for_weight_bytes - q.held_for_weight_bytes, 0),
        adopted_grad_bytes=adopted,
        transient_bytes=max(w.transient_bytes - q.adopted_grad_bytes, adopted))
    return dataclasses.replace(whole, times=times, memory=memory)


def with_crossing_bytes(chain: BlockChain, profiles: list[BlockProfile],
                        crossing: dict) -> list[BlockProfile]:
    """``profiles`` with each block that ends before a split half's C sending what
    crosses: C's stream (``crossing[call of C]``) and the carried values
    (``crossing[(call, leaf)]``)."""
    split = dict(chain.splits)
    out = list(profiles)
    for i, block in enumerate(chain.blocks):
        if block.calls[-1] in split and chain.trace is not None:
            cut = split[block.calls[-1]]
            carried = sum(crossing[c] for c in chain.trace.carries[cut - 1] or ())
            out[i] = dataclasses.replace(out[i], output_bytes=crossing[cut] + carried)
    return out
