"""Split decoder layers into their attention half and their MLP half, where that is exact.

At the ``half`` level the candidates inside a decoder layer are its
parameter-holding children (``input_layernorm``, ``self_attn``,
``post_attention_layernorm``, ``mlp``: whatever the layer holds, in call order),
and the layer's own code (residual adds) runs as glue between them. The trace
(``autopart.intake.watch``) then fuses children no exact cut separates. A pre-norm
residual layer ``h = h + attn(norm(h)); h = h + mlp(norm(h))`` comes out as two
blocks: the only value crossing the cut after the attention is ``h + attn(...)``,
the next half's own input (its reuse as the residual is substituted by identity).

The split is kept only when every layer comes out as exactly two blocks inside
it; otherwise (parallel attention and MLP off one residual as in GPT-J, NeoX or
Falcon, a layer holding its own parameters, a child called twice) layers stay
whole and the reason is returned for the profile's notes.
"""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

from torch import nn

from autopart.schema.parts import Part

if TYPE_CHECKING:
    from autopart.intake.chain import Block

__all__ = []

HALF_KINDS = ("attention", "mlp")
"""Block kinds of a layer's first half (input norm, attention) and second (norm, MLP or MoE)."""


def layer_children(model: nn.Module, layers: list[str]) -> tuple[dict[str, list[str]], str]:
    """The parameter-holding children of each layer, or why the layers cannot be split.

    Args:
        model: the model.
        layers: FQNs of its decoder layers.

    Returns:
        ``({layer: [child FQN, ...]}, "")``, or ``({}, reason)`` in one line.
    """
    if not layers:
        return {}, "the model has no repeated decoder layers to split"
    children: dict[str, list[str]] = {}
    for fqn in layers:
        layer = model.get_submodule(fqn)
        cls = type(layer).__name__
        own = [n for n, _ in layer.named_parameters(recurse=False)]
        if own:
            return {}, (f"{fqn} ({cls}) holds the parameter {own[0]!r} outside its "
                        f"sub-modules, so no half could own it")
        kids = [f"{fqn}.{n}" for n, c in layer.named_children()
                if any(True for _ in c.parameters())]
        if len(kids) < 2:
            return {}, f"{fqn} ({cls}) has {len(kids)} sub-module(s) with parameters"
        children[fqn] = kids
    return children, ""


def split_halves(blocks: tuple[Block, ...], children: dict[str, list[str]]
                 ) -> tuple[tuple[Block, ...], str]:
    """Name the two exact halves of every layer, or say why some layer has no two.

    Args:
        blocks: the fused block chain traced with the layers' children as candidates.
        children: ``layer_children``'s map.

    Returns:
        ``(blocks with kinds attention/mlp, each a part of its layer, "")`` or
        ``((), reason)``.
    """
    out = list(blocks)
    for layer, kids in children.items():
        prefix = layer + "."
        group = [i for i, b in enumerate(blocks) if any(f.startswith(prefix) for f in b.fqns)]
        if any(not f.startswith(prefix) for i in group for f in blocks[i].fqns):
            return (), (f"no exact cut separates {layer} from its neighbour once its "
                        f"sub-modules are blocks")
        called = [f for i in group for f in blocks[i].fqns]
        if sorted(called) != sorted(kids):
            missing = sorted(set(kids) - set(called))
            return (), f"{layer}'s forward does not call {missing[0] if missing else kids[0]}"
        if len(group) != 2:
            parts = " | ".join("+".join(f[len(prefix):] for f in blocks[i].fqns) for i in group)
            why = ("a value of its first part is used after the second starts, besides the "
                   "stream (a residual kept beside it, or attention and MLP in parallel)"
                   if len(group) == 1 else "not one attention half and one MLP half")
            return (), f"{layer} splits exactly only as [{parts}]: {why}"
        for n, (i, kind) in enumerate(zip(group, HALF_KINDS)):
            out[i] = replace(blocks[i], kind=kind,
                             parts=(Part(module=layer, axis="calls", index=n, count=2),))
    return tuple(out), ""
