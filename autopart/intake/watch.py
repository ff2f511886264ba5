"""Watch a model's own forward once: which blocks it calls, with what, and where cuts are safe.

The forward runs on the CPU with every candidate block replaced by its meta
stand-in (``StandIn``), so nothing of full size is allocated and the model's own
code between blocks runs on real (tiny) tensors. A ``TorchFunctionMode`` labels
each tensor with the set of block calls its value derives from. That gives, per
block call:

* its **stream** arguments: the tensor arguments derived from earlier blocks (what
  crosses a pipeline cut just before it, ``layer(h, h)`` counted once);
* its **context**: the other tensor arguments (masks, rotary tables, position
  ids), recomputed by the model's own code on every stage;

and, for every cut position, whether it is **safe**: a cut after call ``k`` is safe
when everything derived only from calls ``<= k`` that is used once call ``k + 1``
has started is one of call ``k + 1``'s stream arguments itself (``h = h + layer(h)``
reuses its stream: the receiving stage substitutes the received tensor for it,
see ``ForwardTrace.stream_reused``). Calls separated by an unsafe cut are fused
into one block (GPT-2's ``wte`` and ``wpe``, added after both run).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.overrides import TorchFunctionMode

from autopart.errors import ModelSourceError
from autopart.intake.forward import StandIn, intercept, leaf_paths, model_output_tensor
from autopart.intake.head_split import LogitOp, logit_ops

__all__ = []

_READS_VALUES = frozenset({
    "item", "tolist", "__bool__", "__int__", "__float__", "__index__", "nonzero", "equal",
    "allclose",
})
"""Calls that turn tensor values into Python values (control flow, shapes)."""

_NO_VALUE = frozenset({
    "new_zeros", "new_ones", "new_empty", "new_full", "zeros_like", "ones_like", "empty_like",
    "full_like", "size", "dim", "numel", "stride", "is_floating_point", "is_complex",
    "get_device", "element_size", "data_ptr",
})


@dataclass(frozen=True, slots=True)
class CallRecord:
    """One block call seen in the forward."""

    fqn: str
    """FQN of the called module."""
    stream: tuple[int, ...]
    """For each flattened argument leaf: its stream slot (``>= 0``) or ``-1`` (not stream)."""
    num_stream: int
    """Distinct stream tensors the call receives."""
    signature: str
    """Argument shapes/dtypes, context identities and plain values: equal calls behave alike."""
    stream_bytes_per_token: float
    """Bytes of the stream tensors per input token (what crosses a cut before this call)."""


@dataclass(frozen=True, slots=True)
class ForwardTrace:
    """What one forward of the model did, block call by block call."""

    calls: tuple[CallRecord, ...]
    safe_cuts: tuple[bool, ...]
    """``safe_cuts[k]``: a pipeline cut between call ``k`` and call ``k + 1`` is exact."""
    output_labelled: bool
    """The model's output derives from the blocks (it is not constant)."""
    stream_reused: bool = False
    """Some stream tensor is used again after the call that receives it starts
    (a residual outside the layers): stages must substitute received tensors by identity."""
    carries: tuple[tuple[tuple[int, int], ...] | None, ...] = ()
    """Per cut (traced with ``carry=True``, else empty): ``()`` for a cut where only the
    next call's stream crosses or an unsafe one, else the values that cross beside that
    stream, each as ``(call, leaf)``: the ``leaf``-th flattened argument of an earlier
    ``call`` (a residual kept across the cut); ``None`` where some crossing value is no
    such argument (made by the model's code between blocks) or is not floating point."""
    after_last: tuple[str, ...] = ()
    """The torch functions the model's own code applies to the last call's output (an HF
    causal LM's head: its logits) after that call, in order of first use: ``("div",
    "tanh", "mul")`` where the forward soft-caps the logits, ``()`` where it returns them."""
    logit_ops: tuple[LogitOp, ...] | None = field(default=(), compare=False)
    """Those calls as a vocabulary slice of the logits can replay them
    (``head_split.logit_ops``), ``None`` where it cannot."""


class _Labels(TorchFunctionMode):
    """Label tensors with the block calls they derive from; record where labels are used."""

    def __init__(self) -> None:
        super().__init__()
        self.labels: dict[int, frozenset[int]] = {}
        self.keep: list[torch.Tensor] = []
        self.position = -0.5
        self.uses: list[tuple[float, int, int]] = []
        """(position, newest call the used value derives from, its id) per labelled use."""
        self.params_in_glue: list[str] = []
        self.value_reads: list[str] = []
        """Calls in the glue that read block outputs' values into Python (``.item()``)."""
        self.applied: list[tuple[float, int, Any, tuple, dict, Any]] = []
        """(position, newest call its labelled inputs derive from, func, args, kwargs,
        output) per glue call on labelled values."""
        self.inside = 0

    def label_of(self, t: Any) -> frozenset[int]:
        return self.labels.get(id(t), frozenset()) if isinstance(t, torch.Tensor) else frozenset()

    def mark(self, value: Any, label: frozenset[int]) -> None:
        for leaf in leaf_paths((value,), {}):
            if isinstance(leaf, torch.Tensor):
                self.labels[id(leaf)] = label
                self.keep.append(leaf)

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        try:
            out = func(*args, **kwargs)
        except Exception:
            if not self.inside:  # glue code failing on a parameter it reads (on meta)
                self.params_in_glue += [f"{tuple(x.shape)}"
                                        for x in leaf_paths(tuple(args), kwargs)
                                        if isinstance(x, nn.Parameter)]
            raise
        if self.inside:
            return out
        name = getattr(func, "__name__", "")
        if name in _NO_VALUE or name == "__get__":  # shapes, dtypes: no values used
            return out
        inputs = leaf_paths(tuple(args), kwargs)
        for x in inputs:
            if isinstance(x, nn.Parameter):
                self.params_in_glue.append(f"{tuple(x.shape)}")
        labels = [self.label_of(x) for x in inputs]
        if name in _READS_VALUES and any(labels):
            self.value_reads.append(name)
        for x, label in zip(inputs, labels):
            if label:
                self.uses.append((self.position, max(label), id(x)))
        label = frozenset().union(*labels)
        if label:
            self.applied.append((self.position, max(label), func, args, kwargs, out))
            self.mark(out, label)
        return out


def trace_forward(model: nn.Module, fqns: list[str], example: tuple[tuple, dict],
                  what: str, carry: bool = False) -> tuple[list[str], ForwardTrace]:
    """Run ``model(*args, **kwargs)`` once with the candidate modules ``fqns`` as stand-ins.

    Returns the candidates in the order the forward called them (uncalled ones
    dropped) and the trace (with ``ForwardTrace.carries`` when ``carry``). Raises
    ``ModelSourceError`` (one line) when the forward fails, calls a candidate twice,
    or uses a parameter outside every candidate.
    """
    shapes: dict = {}
    stand_ins = {fqn: StandIn(model.get_submodule(fqn), shapes) for fqn in fqns}
    mode = _Labels()
    order: list[int] = []
    records: list[CallRecord] = []
    contexts: dict[int, int] = {}
    stream_ids: list[set[int]] = []
    arg_of: dict[int, tuple[int, int, bool]] = {}  # tensor id -> (call, leaf, floating)
    last_out: Any = None

    def handler(idx: int, module: nn.Module, original: Any, args: tuple, kwargs: dict) -> Any:
        nonlocal last_out
        if idx in order:
            raise ModelSourceError(f"{what}'s forward calls {fqns[idx]} more than once; "
                                   f"autopart pipelines blocks that run once per step; pass "
                                   f"--layer-class to choose other blocks")
        call = len(order)
        order.append(idx)
        mode.position = float(call)
        records.append(_record(fqns[idx], args, kwargs, mode, contexts))
        stream_ids.append(set())
        for pos, leaf in enumerate(leaf_paths(args, kwargs)):
            if isinstance(leaf, torch.Tensor):
                arg_of.setdefault(id(leaf), (call, pos, leaf.is_floating_point()))
            if mode.label_of(leaf):
                stream_ids[-1].add(id(leaf))
                mode.uses.append((float(call), max(mode.label_of(leaf)), id(leaf)))
        mode.inside += 1
        try:
            out = stand_ins[fqns[idx]](args, kwargs, torch.device("cpu"))
        finally:
            mode.inside -= 1
        mode.mark(out, frozenset({call}))
        mode.position = call + 0.5
        last_out = out
        return out

    args, kwargs = example
    try:
        with torch.no_grad(), intercept(model, fqns, handler), mode:
            output = model(*args, **kwargs)
    except ModelSourceError:
        raise
    except Exception as exc:  # noqa: BLE001 - any failure of model code becomes one line
        if mode.params_in_glue:
            raise _outside(what, mode.params_in_glue[0]) from None
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise ModelSourceError(
            f"{what}'s forward failed while autopart watched it ({type(exc).__name__}: "
            f"{first[:200]}); check that the model runs on an input of shape "
            f"{_shapes(args)}, or define autopart_example_input(micro_batch_size, seq_len)"
        ) from None
    if mode.params_in_glue:
        raise _outside(what, mode.params_in_glue[0])
    if mode.value_reads:
        raise ModelSourceError(
            f"{what}'s forward reads the values of its blocks' outputs between blocks "
            f"(Tensor.{mode.value_reads[0]}), e.g. to decide what to run; a pipeline stage "
            f"replays that code without those values, so autopart cannot split it exactly; "
            f"move that code into a block or pass --layer-class to choose larger blocks")
    num = len(order)
    final = False
    for leaf in leaf_paths((output,), {}):
        if mode.label_of(leaf):
            final = True
            mode.uses.append((float(num), max(mode.label_of(leaf)), id(leaf)))
    safe = [records[k + 1].num_stream > 0 for k in range(num - 1)]
    reused = False
    for position, newest, tensor_id in mode.uses:
        # a use after call k + 1 started, of a value from calls <= k, crosses the cut
        # after k: exact only when the value is one of call k + 1's stream arguments
        for k in range(newest, num - 1):
            if position > k + 1:
                if tensor_id in stream_ids[k + 1]:
                    reused = True
                else:
                    safe[k] = False
    carries = _carries(mode.uses, stream_ids, arg_of, safe) if carry else ()
    after = [entry[2:] for entry in mode.applied if entry[1] == num - 1 and entry[0] > num - 1]
    return [fqns[i] for i in order], ForwardTrace(
        calls=tuple(records), safe_cuts=tuple(safe), output_labelled=bool(final),
        stream_reused=reused, carries=carries,
        after_last=tuple(dict.fromkeys(getattr(f, "__name__", "") for f, *_ in after)),
        logit_ops=_logit_ops(after, last_out, output, mode))


def _logit_ops(after: list[tuple[Any, tuple, dict, Any]], last_out: Any, output: Any,
               mode: _Labels) -> tuple[LogitOp, ...] | None:
    """``ForwardTrace.logit_ops``: the calls ``after`` the last call, from its output to the
    tensor the forward returned (``head_split.logit_ops``)."""
    if not isinstance(last_out, torch.Tensor):
        return None if after else ()
    try:
        final = model_output_tensor(output)
    except TypeError:
        return None
    newest = max(mode.label_of(last_out))
    return logit_ops(after, last_out, final,
                     lambda x: bool(mode.label_of(x)) and max(mode.label_of(x)) == newest)


def _carries(uses: list[tuple[float, int, int]], stream_ids: list[set[int]],
             arg_of: dict[int, tuple[int, int, bool]], safe: list[bool]
             ) -> tuple[tuple[tuple[int, int], ...] | None, ...]:
    """``ForwardTrace.carries``: per unsafe cut after call ``k``, the values used once call
    ``k + 1`` has started that derive from calls ``<= k`` and are not its stream, as the
    earlier call arguments they are (or ``None``)."""
    out: list[tuple[tuple[int, int], ...] | None] = []
    for k, exact in enumerate(safe):
        if exact or not stream_ids[k + 1]:
            out.append(() if exact else None)
            continue
        found: set[tuple[int, int]] | None = set()
        for position, newest, tensor_id in uses:
            if newest > k or position <= k + 1 or tensor_id in stream_ids[k + 1]:
                continue
            source = arg_of.get(tensor_id)
            if source is None or source[0] > k or not source[2]:
                found = None
                break
            found.add(source[:2])
        out.append(None if found is None else tuple(sorted(found)))
    return tuple(out)


def _record(fqn: str, args: tuple, kwargs: dict, mode: _Labels,
            contexts: dict[int, int]) -> CallRecord:
    slots: dict[int, int] = {}
    stream: list[int] = []
    parts: list[str] = []
    stream_bytes, tokens = 0, 0
    for leaf in leaf_paths(args, kwargs):
        if isinstance(leaf, torch.Tensor):
            if mode.label_of(leaf):
                slot = slots.setdefault(id(leaf), len(slots))
                if slot == len(slots) - 1 and stream.count(slot) == 0:
                    stream_bytes += leaf.numel() * leaf.element_size()
                    tokens = tokens or (leaf.shape[0] * leaf.shape[1] if leaf.dim() >= 2 else 1)
                stream.append(slot)
                parts.append(f"s{slot}:{tuple(leaf.shape)}:{leaf.dtype}")
            else:
                ctx = contexts.setdefault(id(leaf), len(contexts))
                mode.keep.append(leaf)
                stream.append(-1)
                parts.append(f"c{ctx}:{tuple(leaf.shape)}:{leaf.dtype}")
        else:
            stream.append(-1)
            parts.append(repr(leaf)[:80])
    return CallRecord(fqn=fqn, stream=tuple(stream), num_stream=len(slots),
                      signature="|".join(parts),
                      stream_bytes_per_token=stream_bytes / max(tokens, 1))


def _shapes(args: tuple) -> str:
    return ", ".join(str(tuple(a.shape)) for a in args if isinstance(a, torch.Tensor)) or "()"


def _outside(what: str, shape: str) -> ModelSourceError:
    """The one line for a forward that uses a parameter outside every block."""
    return ModelSourceError(
        f"{what}'s forward uses a parameter of shape {shape} outside its blocks, so no "
        f"pipeline stage could own it; move it into a submodule or pass --layer-class to "
        f"choose the blocks")
