"""A stage's part of a decoder-layer half cut inside its module ``P`` (half slices).

A plan may cut a half's module ``P`` (``model.layers.3.mlp``) into slices: parts along
``units`` (``model.layers.3.mlp.slice1of4``, ``autopart.intake.slice_rules``). A stage
whose blocks begin with slice ``i > 0`` of ``P`` *starts inside* ``P``: its first call is
``P``'s, with ``P``'s stream arguments, the residual and the partial output of the
slices before it received; it adds its own slices' output to the received partial and
the model's code goes on with ``P``'s whole output. A stage whose names end with
slice ``j < k - 1`` *ends inside* ``P``: at ``P``'s call it computes its slices'
output (plus the received partial when it also started inside ``P``) and sends, in
this order, ``P``'s stream arguments, the values crossing the cut beside them (the
residual, ``ForwardTrace.carries``) and the partial output's main tensor.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from autopart.intake import BlockChain
from autopart.intake.slice_rules import (
    SliceRule,
    add_outputs,
    partial_forward,
    slice_rule,
    unit_range,
)
from autopart.runtime.held_grads import cols_of, rows_of
from autopart.schema import Part

__all__ = []


@dataclass(frozen=True)
class Partial:
    """The units ``[lo, hi)`` of a half's module ``P`` one stage computes."""

    call: int
    """Index of ``P``'s call in ``BlockChain.call_fqns``."""
    module: nn.Module
    rule: SliceRule
    lo: int
    hi: int
    starts_inside: bool
    """The stage's first call is ``P``'s (it received the partial of the slices before)."""
    ends_inside: bool
    """The stage stops at ``P``'s call (it sends its partial on)."""


def stage_partials(root: nn.Module, chain: BlockChain, parts: list[Part]) -> list[Partial]:
    """The halves this stage holds only some slices of (at most two: the one it starts
    inside, the one it ends inside; one when it lies inside a single half).

    Args:
        root: the model (its halves' modules, on any device).
        chain: its block chain (``half``).
        parts: the stage's parts along ``units``, in order (validated).

    Returns:
        One ``Partial`` per half cut at this stage's start or end, in call order.
    """
    groups: list[tuple[str, int, int, int]] = []  # (module, first idx, last idx, count)
    for part in parts:
        if groups and groups[-1][0] == part.module:
            groups[-1] = (part.module, groups[-1][1], part.index, part.count)
        else:
            groups.append((part.module, part.index, part.index, part.count))
    calls = chain.call_fqns
    out = []
    for half, first, last, num in groups:
        if first == 0 and last == num - 1:
            continue  # every slice here: the half runs whole
        module = root.get_submodule(half)
        rule, why = slice_rule(module)
        assert rule is not None, why  # validate.check_parts refused it otherwise
        lo, hi = unit_range(first, num, rule.units)[0], unit_range(last, num, rule.units)[1]
        out.append(Partial(call=calls.index(half), module=module, rule=rule, lo=lo, hi=hi,
                           starts_inside=first > 0, ends_inside=last < num - 1))
    return out


@contextlib.contextmanager
def _unrouted(module: nn.Module, original: Callable[..., Any]) -> Iterator[None]:
    """``module``'s own forward while inside (``intercept`` routes it to the stage's handler)."""
    routed = module.__dict__.get("forward")
    module.forward = original
    try:
        yield
    finally:
        if routed is None:
            del module.forward
        else:
            module.forward = routed


def run_partial(part: Partial, original: Callable[..., Any], args: tuple, kwargs: dict) -> Any:
    """``P``'s output from this stage's units only (``slice_rules.partial_forward``), run
    through ``P``'s own forward ``original``; its backward adds only the units' gradient
    into the parameters' ``.grad`` (``held_grads``). Deterministic, so a checkpoint
    replays it."""
    with _unrouted(part.module, original):
        return partial_forward(part.module, part.rule, part.lo, part.hi, args, kwargs,
                               rows=rows_of, cols=cols_of)


def plus_partial(received: torch.Tensor, output: Any) -> Any:
    """``output`` (``P``'s, from this stage's units) with the received partial main tensor
    (the units before) added to its main tensor: ``P``'s output over both."""
    return add_outputs((received,) if isinstance(output, tuple) else received, output)
