"""Rows or columns of a parameter held whole, whose backward adds only their gradient.

A rank that computes part of a module it holds whole (vocabulary shards of the head,
``autopart.runtime.head_shards``; slices of a half's module, ``autopart.runtime.partials``)
takes views of the module's parameters. Plain indexing (``weight[lo:hi]``,
``weight[:, lo:hi]``) hands autograd a full-size gradient for every backward of every
microbatch: zeros outside the part, the part copied in, and all of it added into
``.grad``. On a stage holding a quarter of a 1024 x 2736 MLP that costs about twice the
quarter's own backward (measured on this project's CPU host, 1 thread, 32 tokens).

``rows_of`` and ``cols_of`` create the dense ``.grad`` once per step (zeros, when it is
``None``) and add only the part into it:

- rows: the backward hands autograd the rows' gradient as a sparse tensor (row indices
  and the rows' values, no copy), which autograd adds into ``.grad`` in place;
- columns: a sparse tensor cannot hold columns without an index per value, so the
  backward adds the columns' gradient into ``.grad[:, lo:hi]`` itself (made contiguous
  first: adding the transposed gradient a linear layer's backward produces into a strided
  slice is several times slower) and hands autograd an empty sparse gradient, so that
  ``AccumulateGrad``, its hooks and the split weight backward of the zero-bubble
  schedules (``stage_backward_weight``) run as for any parameter. The side effect makes
  this backward for ``.grad`` only: ``torch.autograd.grad`` through it would still
  write into ``.grad``. The runtime only runs it under a stage's backward.

A parameter that is not a plain leaf requiring a gradient (frozen, a ``DTensor``), or a
call under ``no_grad``, is indexed as usual.
"""

from __future__ import annotations

import torch

__all__ = []


class _Rows(torch.autograd.Function):
    """``weight[lo:hi]`` whose backward hands autograd only the rows' gradient (sparse)."""

    @staticmethod
    def forward(ctx, weight: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
        ctx.weight = weight
        ctx.rows = (lo, hi)
        return weight[lo:hi]

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        weight = ctx.weight
        lo, hi = ctx.rows
        index = torch.arange(lo, hi, device=grad.device).unsqueeze(0)
        rows = torch.sparse_coo_tensor(index, grad, weight.shape, is_coalesced=True,
                                       check_invariants=False)
        return rows, None, None


class _Cols(torch.autograd.Function):
    """``weight[:, lo:hi]`` whose backward adds the columns' gradient into ``.grad`` and
    hands autograd an empty one (module docstring)."""

    @staticmethod
    def forward(ctx, weight: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
        ctx.weight = weight
        ctx.cols = (lo, hi)
        return weight[:, lo:hi]

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        weight = ctx.weight
        lo, hi = ctx.cols
        if weight.grad is None:  # set to None after the forward: a fresh buffer
            weight.grad = torch.zeros_like(weight)
        weight.grad[:, lo:hi].add_(grad.contiguous())
        empty = torch.sparse_coo_tensor(
            torch.zeros(1, 0, dtype=torch.long, device=grad.device),
            grad.new_zeros((0, *weight.shape[1:])), weight.shape, is_coalesced=True,
            check_invariants=False)
        return empty, None, None


def _held(weight: torch.Tensor) -> bool:
    """Whether ``weight`` is a leaf parameter that takes a gradient here (not frozen, not a
    ``DTensor``, grad enabled); if so, its dense ``.grad`` is created (zeros) where it is
    ``None``, once per step, for the part to be added into."""
    if not (type(weight) in (torch.Tensor, torch.nn.Parameter) and weight.is_leaf
            and weight.requires_grad and torch.is_grad_enabled()):
        return False
    if weight.grad is None:
        weight.grad = torch.zeros_like(weight)
    return True


def rows_of(weight: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
    """Rows ``[lo, hi)`` of ``weight`` whose backward adds only those rows into ``.grad``.

    Args:
        weight: A leaf parameter held whole (the head's weight or bias, a projection's).
        lo: First row.
        hi: End row (exclusive).

    Returns:
        The view ``weight[lo:hi]``, whose gradient is the rows' only (a sparse tensor);
        ``weight.grad`` is created here, dense zeros, when it is ``None``, so that autograd
        adds the rows into it in place. A weight that is not a plain leaf requiring a
        gradient is indexed as usual.
    """
    return _Rows.apply(weight, lo, hi) if _held(weight) else weight[lo:hi]


def cols_of(weight: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
    """Columns ``[lo, hi)`` of a 2-D ``weight`` whose backward adds only those columns into
    ``.grad`` (module docstring).

    Args:
        weight: A leaf parameter held whole (an output projection's weight).
        lo: First column.
        hi: End column (exclusive).

    Returns:
        The view ``weight[:, lo:hi]``; ``weight.grad`` is created, dense zeros, when it is
        ``None``. A weight that is not a plain leaf requiring a gradient is indexed as
        usual.
    """
    return _Cols.apply(weight, lo, hi) if _held(weight) else weight[:, lo:hi]
