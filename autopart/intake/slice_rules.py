"""Slices of a decoder layer's half: KV-head groups of the attention, column groups of the MLP.

A half's module ``P`` whose output is a sum over independent units can be cut
*inside* its call. The MLP ``down(act(gate(x)) * up(x))`` is the sum over its
intermediate columns ``j`` of ``down[:, j] * act(gate[j] x) * up[j] x``; the attention
``o(attn(q(x), k(x), v(x)))`` is the sum over its KV heads (each with its group of
query heads) of ``o[:, heads] attn_g(...)``. Slice ``i`` of ``k`` (a part of ``P``'s call
along ``units``, ``autopart.schema.parts``; named ``model.layers.3.mlp.slice1of4``) covers
the units ``[i * U // k, (i + 1) * U // k)``. A stage ending inside ``P`` sends ``P``'s input,
the values crossing beside it (the residual) and the sum of its slices' outputs so
far; the next stage adds its slices and the model's code goes on exactly as in the
unpipelined model. Every rank with a slice holds ``P`` whole and the ranks sum its
gradient (each slice adds only its rows' and columns' gradient,
``autopart.runtime.held_grads``).

``slice_rule`` decides from the module's structure which parameters are cut along
which dimension (nothing names a family): an MLP is ``nn.Linear`` children from the
hidden size to ``U`` (or to a multiple of ``U``: a fused gate and up projection, cut in
every block of ``U`` rows) and one output ``nn.Linear`` from ``U`` back (the last
``nn.Linear`` child defined); an attention adds per-head projections of ``D =
P.head_dim`` rows per head (query heads ``U * rep``, key/value heads ``U``) and may
hold per-head norms of size ``D``, which every slice uses whole. The output
projection's bias is added by the last slice only. ``check_slices`` runs a split
against the whole module on real inputs (a shape check on meta) before a profile
offers the slices.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from torch import nn

__all__ = ["SliceRule", "add_outputs", "check_slices", "main_output", "partial_forward",
           "slice_rule", "unit_range"]


def unit_range(idx: int, num: int, units: int) -> tuple[int, int]:
    """Units ``[lo, hi)`` (MLP columns, KV heads) that slice ``idx`` of ``num`` covers."""
    return idx * units // num, (idx + 1) * units // num


@dataclass(frozen=True)
class SliceRule:
    """How the parameters of a half's module ``P`` split into ``units``."""

    kind: str
    """``mlp`` (units: intermediate columns) or ``attention`` (units: KV heads)."""
    units: int
    rows: tuple[tuple[str, int], ...]
    """Parameters cut along dim 0, with their rows per unit."""
    cols: tuple[tuple[str, int], ...]
    """Parameters cut along dim 1 (the output projection's weight), columns per unit."""
    last_only: tuple[str, ...] = ()
    """Parameters only the slice holding the last unit uses (the output bias)."""
    blocks: tuple[tuple[str, int], ...] = ()
    """Parameters of ``rows`` made of several stacked blocks of ``units`` rows each (a
    fused gate and up projection: 2, chunked by the module's forward); a slice takes its
    rows from every block. Not listed: one block."""


def slice_rule(module: nn.Module) -> tuple[SliceRule | None, str]:
    """``(rule, "")`` if ``module``'s output is a sum over units (module docstring), else
    ``(None, why not)``."""
    from torch import nn

    if any(True for _ in module.parameters(recurse=False)):
        return None, f"{type(module).__name__} holds parameters of its own"
    kids = [(n, c) for n, c in module.named_children() if any(True for _ in c.parameters())]
    linears = [(n, c) for n, c in kids if isinstance(c, nn.Linear)]
    if len(linears) < 2:
        return None, f"{type(module).__name__} holds fewer than two nn.Linear projections"
    out_name, out = linears[-1]
    inputs = linears[:-1]
    hidden, units_dim = out.out_features, out.in_features
    if any(c.in_features != hidden for _, c in inputs):
        return None, f"{type(module).__name__}'s projections do not all read the hidden size"
    others = [(n, c) for n, c in kids if not isinstance(c, nn.Linear)]
    last_only = (f"{out_name}.bias",) if out.bias is not None else ()
    head_dim = getattr(module, "head_dim", None)
    if head_dim is None and all(c.out_features % units_dim == 0 for _, c in inputs) \
            and not others:
        rows = tuple((f"{n}.{p}", 1) for n, c in inputs for p, _ in c.named_parameters())
        blocks = tuple((f"{n}.{p}", c.out_features // units_dim) for n, c in inputs
                       for p, _ in c.named_parameters() if c.out_features > units_dim)
        return SliceRule("mlp", units_dim, rows, ((f"{out_name}.weight", 1),), last_only,
                         blocks), ""
    if head_dim is None:
        return None, (f"{type(module).__name__}'s input projections do not give whole "
                      f"blocks of {out_name}'s {units_dim} inputs, and it has no head_dim "
                      f"to split by heads")
    if not isinstance(head_dim, int) or head_dim <= 0 or units_dim % head_dim:
        return None, f"{type(module).__name__} has no per-head layout (head_dim) to split by"
    num_heads = units_dim // head_dim
    kv = {c.out_features for _, c in inputs if c.out_features != units_dim}
    num_kv = (kv.pop() // head_dim) if len(kv) == 1 else num_heads if not kv else 0
    if not num_kv or num_heads % num_kv or num_kv < 2 or any(
            c.out_features % head_dim for _, c in inputs):
        return None, f"{type(module).__name__}'s key/value heads do not divide its query heads"
    if any(p.dim() != 1 or p.shape[0] != head_dim for _, c in others for p in c.parameters()):
        return None, (f"{type(module).__name__} holds sub-modules that are neither projections "
                      f"nor per-head norms")
    rep = num_heads // num_kv
    rows = tuple((f"{n}.{p}", (rep if c.out_features == units_dim else 1) * head_dim)
                 for n, c in inputs for p, _ in c.named_parameters())
    return SliceRule("attention", num_kv, rows, ((f"{out_name}.weight", rep * head_dim),),
                     last_only), ""


def partial_forward(module: nn.Module, rule: SliceRule, lo: int, hi: int, args: tuple,
                    kwargs: dict, rows: Callable[..., Any] | None = None,
                    cols: Callable[..., Any] | None = None) -> Any:
    """``module``'s output computed from units ``[lo, hi)`` only: its own forward on slices
    of its parameters.

    ``rows(param, first, end)`` and ``cols(param, first, end)`` take the slices; by default
    plain views, whose gradients reach the whole parameters (a full-size gradient per
    backward). The runtime passes ones that add only the slice's gradient
    (``autopart.runtime.held_grads``).
    """
    import torch
    from torch.func import functional_call

    rows = rows or (lambda p, a, b: p[a:b])
    cols = cols or (lambda p, a, b: p[:, a:b])
    params = dict(module.named_parameters())
    stacked = dict(rule.blocks)

    def taken(name: str, per: int) -> Any:
        size = rule.units * per  # rows of one block
        parts = [rows(params[name], b * size + lo * per, b * size + hi * per)
                 for b in range(stacked.get(name, 1))]
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    sub = {name: taken(name, per) for name, per in rule.rows}
    sub.update({name: cols(params[name], lo * per, hi * per) for name, per in rule.cols})
    if hi < rule.units:
        sub.update({name: torch.zeros_like(params[name]) for name in rule.last_only})
    return functional_call(module, sub, args, kwargs, strict=False)


def add_outputs(first: Any, second: Any) -> Any:
    """The sum of two partial outputs: the main tensor (the first one) added, the rest
    (e.g. attention weights, ``None`` under SDPA) taken from ``second``."""
    if isinstance(second, tuple):
        return (add_outputs(first[0], second[0]), *second[1:])
    return first + second


def main_output(output: Any) -> Any:
    """The tensor a partial output carries to the next stage (its first element)."""
    return output[0] if isinstance(output, tuple) else output


def check_slices(module: nn.Module, rule: SliceRule, args: tuple, kwargs: dict) -> str:
    """Run ``module`` whole and as two slices on ``args``; ``""`` if they agree (same shape
    on meta; within rounding of the dtype elsewhere), else why not. On meta a rule with
    stacked blocks is refused: their layout needs numbers."""
    import torch

    try:
        with torch.no_grad():
            whole = main_output(module(*args, **kwargs))
            mid = rule.units // 2
            split = main_output(add_outputs(
                partial_forward(module, rule, 0, mid, args, kwargs),
                partial_forward(module, rule, mid, rule.units, args, kwargs)))
    except Exception as exc:  # noqa: BLE001 - any failure means: do not slice
        return f"{type(module).__name__} fails on sliced weights ({type(exc).__name__})"
    if not isinstance(whole, torch.Tensor) or split.shape != whole.shape:
        return f"{type(module).__name__}'s output does not split into a sum over its units"
    if whole.is_meta:
        # shapes cannot tell stacked blocks from interleaved rows: only numbers prove it
        return (f"{type(module).__name__}'s input projections stack blocks whose layout only "
                f"a numeric check proves; profile on cpu or cuda to slice it"
                if rule.blocks else "")
    tol = 1e-4 if whole.dtype == torch.float32 else 2e-2
    err = (split.float() - whole.float()).norm() / whole.float().norm().clamp(min=1e-12)
    if not err <= tol:
        return (f"{type(module).__name__}'s output is not the sum of its slices (relative "
                f"difference {float(err):.2g})")
    return ""
