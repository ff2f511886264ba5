"""Which heads can be cut by vocabulary, and the rows a vocabulary part covers.

A causal LM's head block (the output projection, with the loss after it) can be cut
into ``k`` parts along ``vocab`` (``autopart.schema.parts``; named
``<head>.shard<i>of<k>``, e.g. ``lm_head.shard1of4``) that run on consecutive stages.
Part ``i`` of ``k`` covers the vocabulary rows ``[i * V // k, (i + 1) * V // k)`` of the
head's weight. A stage holding parts computes only its rows' logits and passes on the
final hidden state with two running values per token (the log-sum-exp of the logits so
far, shifted by their maximum, and the target logit): ``autopart.runtime.head_shards``
holds that arithmetic. What the model's own code does to the logits before it returns
them (a soft-cap, a scale: ``logit_ops``, from the forward autopart watched) each such
stage repeats on its rows first; a head whose logits the code changes otherwise stays
whole.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # planning must not import torch
    from torch import nn

__all__ = ["LOGITS", "LogitOp", "head_split_refusal", "logit_ops", "replay_logit_ops",
           "vocab_range"]

ELEMENTWISE = frozenset({
    "div", "__truediv__", "__rtruediv__", "true_divide", "mul", "__mul__", "__rmul__",
    "multiply", "add", "__add__", "__radd__", "sub", "__sub__", "__rsub__", "subtract",
    "neg", "__neg__", "tanh", "clamp", "clip", "float", "to", "type", "contiguous",
})
"""Calls that act on each logit alone (with scalars): a slice of the vocabulary gets
exactly its part of what the whole logits get."""

LOGITS = "<logits>"
"""Stands for the logits among a ``LogitOp``'s arguments."""


@dataclass(frozen=True, eq=False, slots=True)
class LogitOp:
    """One call the model's code applies to the head's logits, replayable on a slice."""

    func: Callable[..., Any]
    args: tuple
    """The call's positional arguments, the logits as ``LOGITS``, scalars as given."""
    kwargs: tuple[tuple[str, Any], ...]


def logit_ops(calls: list[tuple[Callable[..., Any], tuple, dict, Any]], head_out: Any,
              final: Any, is_derived: Callable[[Any], bool]) -> tuple[LogitOp, ...] | None:
    """The calls a watched forward made from the head's output to the logits it returned,
    as ops a vocabulary slice can replay, or ``None`` where a slice cannot (a call that
    mixes logits, e.g. a log-softmax, a view, a branch, a tensor that is no scalar).

    Args:
        calls: ``(func, args, kwargs, output)`` of every call on values derived from the
            head's output, in order.
        head_out: The head's output tensor.
        final: The logits tensor the forward returned.
        is_derived: Whether a value derives from the head's output.
    """
    ops: list[LogitOp] = []
    current = head_out
    for func, args, kwargs, out in calls:
        if getattr(func, "__name__", "") not in ELEMENTWISE:
            return None
        derived = [x for x in (*args, *kwargs.values()) if is_derived(x)]
        if len(derived) != 1 or derived[0] is not current:
            return None
        if any(_tensor_arg(x) for x in (*args, *kwargs.values()) if x is not current):
            return None
        ops.append(LogitOp(func, tuple(_kept(x, current) for x in args),
                           tuple((k, _kept(v, current)) for k, v in kwargs.items())))
        current = out
    return tuple(ops) if current is final else None


def replay_logit_ops(ops: tuple[LogitOp, ...], logits: Any) -> Any:
    """``logits`` (a vocabulary slice's) through ``ops``, as the model's code did the whole."""
    for op in ops:
        logits = op.func(*(_put(x, logits) for x in op.args),
                         **{k: _put(v, logits) for k, v in op.kwargs})
    return logits


def _kept(x: Any, logits: Any) -> Any:
    """A ``LogitOp`` argument: ``LOGITS`` for the logits, a scalar tensor copied."""
    if x is logits:
        return LOGITS
    return x.detach().clone() if _is_tensor(x) else x


def _put(x: Any, logits: Any) -> Any:
    """A ``LogitOp`` argument for a replay on ``logits`` (a scalar tensor on its device)."""
    if isinstance(x, str) and x == LOGITS:
        return logits
    return x.to(logits.device) if _is_tensor(x) else x


def _is_tensor(x: Any) -> bool:
    from torch import Tensor

    return isinstance(x, Tensor)


def _tensor_arg(x: Any) -> bool:
    """A tensor argument other than one scalar (which a slice's call can take as is)."""
    return _is_tensor(x) and x.numel() != 1


def vocab_range(idx: int, num_shards: int, vocab_size: int) -> tuple[int, int]:
    """Rows ``[lo, hi)`` of the head's weight that shard ``idx`` of ``num_shards`` covers."""
    return idx * vocab_size // num_shards, (idx + 1) * vocab_size // num_shards


def head_split_refusal(model: nn.Module, head: str, trace: Any = None) -> str | None:
    """Why the head ``head`` of ``model`` cannot be split by vocabulary, or ``None``.

    The split computes ``hidden @ weight[lo:hi].T (+ bias[lo:hi])`` itself, so the
    head must be an ``nn.Linear``, and what the model's own code does to its logits
    before returning them must be replayable on a slice of them: calls on each logit
    alone with scalars (``ForwardTrace.logit_ops``: Gemma 2's soft-cap ``tanh(logits /
    cap) * cap``, Cohere's ``logits * logit_scale``), which each stage with shards
    replays on its rows. ``trace`` is the watched forward (``autopart.intake.watch.
    ForwardTrace``, which imports this module); without one (``None``) the split is
    refused: what the code does to the logits is unknown.
    """
    module = model.get_submodule(head)
    from torch import nn

    if not isinstance(module, nn.Linear):
        return f"the head {head} is a {type(module).__name__}, not an nn.Linear"
    if trace is None:
        return "the model's forward was not watched, so what it does to the logits is unknown"
    if trace.logit_ops is None:
        calls = ", ".join(trace.after_last[:3])
        return f"the model's forward changes the logits after {head} in a way a " \
               f"slice of them cannot repeat (it calls {calls} on them)"
    return None
