"""Build this rank's stage modules.

A stage module (``ForwardStage``) holds one stage's blocks under their original
FQNs and runs the **model's own forward** for every microbatch, with
``autopart.intake.forward.intercept`` deciding what each block call does:

* blocks before the stage are stood in for (``StandIn``: zeros of the right
  shape; the intake trace proved their values never reach this stage's blocks);
* the stage's first block gets the tensors received from the previous stage in
  place of its stream arguments (``layer(h, h)`` gets the one tensor twice);
* the stage's blocks run for real (its layers checkpointed when the plan says so,
  by the cost model's rule ``autopart.cost.blocks.checkpointed``);
* the first block after the stage stops the forward, and its stream arguments
  are what the stage sends on. The last stage returns the model's output (HF:
  the logits).

A stage holding vocabulary parts of the head (``lm_head.shard1of4``, see
``autopart.intake.head_split``) computes its rows' logits at the head call and
sends the head's input on with the running (log-sum-exp, target logit) values
(``autopart.runtime.head_shards``); a stage that starts inside the head skips the
model's forward; the last shard stage returns per-position losses.

A stage may start or end inside a half's module ``P`` cut by units into slices
(``model.layers.3.mlp.slice1of4``, ``autopart.runtime.partials``): ending inside, it
computes ``P`` from its slices' units at ``P``'s call and sends ``P``'s input, the
residual and that partial output; starting inside, its first call is ``P``'s, whose
whole output is the received partial plus its own.

So masks, rotary embeddings, embedding scaling and any other code between blocks
run exactly as in the unpipelined model, for every family, with no names of one.
Each becomes a ``torch.distributed.pipelining.PipelineStage`` driven by the schedule
the plan names (``autopart.runtime.torch_stages``).
"""

from __future__ import annotations

import contextlib
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard
from torch.utils._pytree import tree_map_only
from torch.utils.checkpoint import checkpoint

from autopart.cost.blocks import checkpointed
from autopart.intake import BlockChain
from autopart.intake.forward import (
    StageExit,
    StandIn,
    Substitute,
    intercept,
    leaf_paths,
    model_output_tensor,
)
from autopart.intake.head_split import vocab_range
from autopart.intake.hf import own_router_loss_off
from autopart.intake.slice_rules import main_output
from autopart.runtime.head_shards import HeadCarry, shard_carry, token_losses
from autopart.runtime.partials import Partial, plus_partial, run_partial, stage_partials
from autopart.runtime.planned import DerivedPart, base_names, derived_parts
from autopart.runtime.tree import Tree, prune
from autopart.schema import Plan, StagePlan

__all__ = []

LABELS_KWARG = "autopart_labels"
"""Keyword under which every stage receives the labels when the head is split."""


def input_kwarg(idx: int) -> str:
    """Keyword under which stages after the first receive the model's ``idx``-th input."""
    return f"autopart_input_{idx}"


class ForwardStage(Tree):
    """Blocks of ``root`` run inside the model's own forward (see the module docstring)."""

    def __init__(self, root: nn.Module, chain: BlockChain, bases: list[str],
                 derived: list[DerivedPart], *, recompute: bool = False,
                 autocast_dtype: torch.dtype | None = None,
                 split_backward: bool = False,
                 seq_mesh: DeviceMesh | None = None) -> None:
        super().__init__()
        # sequence parallelism: what crosses a cut is this tp rank's sequence shard of the
        # stream (``autopart.runtime.tensor_parallel``), sent and received as a plain tensor
        object.__setattr__(self, "_seq_mesh", seq_mesh)
        index = {b.name: i for i, b in enumerate(chain.blocks)}
        blocks = [chain.blocks[index[n]] for n in bases]
        shards = [d.part for d in derived if d.part.axis == "vocab"]
        prune(root, [f for b in blocks for f in b.fqns], into=self)
        object.__setattr__(self, "_root", root)  # the skeleton: not a submodule of the stage
        self.config = getattr(root, "config", None)
        self._calls = chain.call_fqns
        self.block_starts = {b.name: self._calls[b.calls[0]] for b in blocks}
        """Each block's first call (a module FQN): where its forward starts
        (``autopart.verify.instrument.BlockTimer`` times blocks from these)."""
        # a stage may start and/or end inside a half's module P (``autopart.runtime.partials``)
        partials = stage_partials(root, chain, [d.part for d in derived if d.part.axis == "units"])
        self._partials = {p.call: p for p in partials}
        starts = [p.call for p in partials if p.starts_inside]
        ends = [p.call for p in partials if p.ends_inside]
        self._first_call = starts[0] if starts else blocks[0].calls[0]
        self._end_call = ends[0] if ends else blocks[-1].calls[-1] + 1
        self.is_first = self._first_call == 0
        self.is_last = self._end_call == len(self._calls)
        # blocks of other stages (stood in for, or where the forward stops) run without their
        # forward hooks: a tensor-parallel or FSDP block held by this rank for another stage
        # must not convert, gather or reshard here
        last = self._end_call if ends else self._end_call - 1  # a half it ends inside runs
        self._outside = [root.get_submodule(c) for i, c in enumerate(self._calls)
                         if not self._first_call <= i <= max(last, self._first_call)]
        self._in_slots = chain.call(self._first_call).stream
        self._out_slots = None if self.is_last else chain.call(self._end_call).stream
        # values crossing a cut beside the next call's stream (``projection``: the residual),
        # each the ``leaf``-th argument of an earlier call: {call: [(index, leaf), ...]}
        self._num_in = chain.call(self._first_call).num_stream
        self._carry_in = _carried(chain, self._first_call)
        self._carry_out = {} if self.is_last else _carried(chain, self._end_call)
        self._split_at = dict(chain.splits)  # call of a split half's module P -> call of C
        self._shards = None  # (head module, first row, end row, starts inside the head)
        if shards:
            head = root.get_submodule(shards[0].module)
            rows = (vocab_range(shards[0].index, shards[0].count, head.weight.shape[0])[0],
                    vocab_range(shards[-1].index, shards[-1].count, head.weight.shape[0])[1])
            starts_inside = derived[0].part.axis == "vocab" and len(bases) == 1 \
                and not shards[0].first
            self._shards = (head, *rows, starts_inside)
            self.is_last = shards[-1].last
        # what the model's code does to the logits after the head, replayed on the rows'
        self._logit_ops = chain.trace.logit_ops if chain.trace is not None else ()
        self._const_kwargs = {"use_cache": False} if chain.family == "hf_causal_lm" else {}
        self._reuse = bool(chain.trace is not None and chain.trace.stream_reused
                           or self._carry_in)
        self._stand_ins: dict[int, StandIn] = {}
        self._shapes: dict = {}  # output shapes shared by this stage's identical stand-ins
        for idx in range(self._first_call):  # blocks this rank holds for other stages: their
            module = root.get_submodule(self._calls[idx])  # meta copies before TP / FSDP
            if any(not t.is_meta for t in module.parameters()):
                self._stand_ins[idx] = StandIn(module, self._shapes).prepare()
        # The cost model's rule (autopart.cost.blocks.checkpointed): layers only. A split half's
        # module P is checkpointed with its C inside (C then not again); when C starts the
        # next stage, P runs until C in a checkpoint of its own (``_until``).
        self._checkpointed = ({c for b in blocks if checkpointed(b.kind) for c in b.calls}
                              if recompute else set())
        self._checkpointed -= {c for p, c in self._split_at.items() if p in self._checkpointed}
        self._autocast_dtype = autocast_dtype
        # torch's zero-bubble backward detaches stage outputs in place; a checkpoint that
        # saved one as its input (P's input at a slice cut, the residual as the norm's
        # input) could not recompute for W: every value sent is then a copy
        self._copy_sent = split_backward and bool(self._checkpointed)

    def forward(self, *args: torch.Tensor, **kwargs: Any) -> Any:
        """Model inputs (first stage) or received tensors -> tensors to send, or the output."""
        inputs = []
        while input_kwarg(len(inputs)) in kwargs:
            inputs.append(kwargs.pop(input_kwarg(len(inputs))))
        labels = kwargs.pop(LABELS_KWARG, None)
        model_args = args if self.is_first else tuple(inputs)
        if not self.is_first:
            _contiguous_grads(args)
        received = None if self.is_first else self._from_shards(args)
        device = next((t.device for t in args if isinstance(t, torch.Tensor)), None)
        autocast = (torch.autocast(device_type=device.type, dtype=self._autocast_dtype)
                    if self._autocast_dtype is not None and device is not None
                    else contextlib.nullcontext())
        if self._shards is not None and self._shards[3]:  # the stage starts inside the head
            with autocast:
                return self._head_step(args[0], labels, tuple(args[1:3]))
        return _local(self._forward(model_args, received, kwargs, labels, autocast, device))

    def _forward(self, model_args: tuple, received: tuple | None, kwargs: dict,
                 labels: torch.Tensor | None, autocast: Any,
                 device: torch.device | None) -> Any:
        """The model's own forward with this stage's blocks (module docstring)."""
        recompute = bool(self._checkpointed) and self.training and torch.is_grad_enabled()
        swaps = Substitute()
        kept: list[torch.Tensor] = [None] * len(  # type: ignore[list-item]
            [n for v in self._carry_out.values() for n in v])  # carried values to send

        def handler(idx: int, module: nn.Module, original: Callable[..., Any], a: tuple,
                    kw: dict) -> Any:
            if idx in self._carry_out or idx in self._carry_in:
                leaves = leaf_paths(a, kw)
                for n, pos in self._carry_out.get(idx, ()):
                    kept[n] = leaves[pos]
                if received is not None and idx != self._first_call:  # the first: ``swap_in``
                    for n, pos in self._carry_in.get(idx, ()):
                        swaps.add(leaves[pos], received[self._num_in + n])
            if idx < self._first_call:
                if self._split_at.get(idx) == self._first_call:  # walk P's code up to C
                    meta_a, meta_kw = tree_map_only(torch.Tensor, _on_meta, (a, kw))
                    return original(*meta_a, **meta_kw)
                return self._stand_in(idx)(a, kw, device)
            a, kw = swaps.swap(a, kw)
            if self._shards is not None and module is self._shards[0]:
                raise StageExit(self._head_step(leaf_paths(a, kw)[0], labels, None))
            part = self._partials.get(idx)
            if part is not None:  # this stage's slices of P (and the received ones)
                with swaps.paused():
                    out = self._partial_call(part, original, a, kw, recompute)
                if part.starts_inside:
                    out = plus_partial(received[-1], out)
                if part.ends_inside:
                    raise StageExit(_sendable(self._stream_of(a, kw), (
                        *swaps.swap(kept, {})[0], main_output(out)), received,
                        copy=self._copy_sent))
                return out
            if idx == self._end_call:
                raise StageExit(_sendable(self._stream_of(a, kw), swaps.swap(kept, {})[0],
                                          copy=self._copy_sent))
            if recompute and idx in self._checkpointed:
                if self._split_at.get(idx) == self._end_call:
                    stream = checkpoint(self._until, original, idx, a, kw, use_reentrant=False)
                    raise StageExit(_sendable(stream, swaps.swap(kept, {})[0],
                                              copy=self._copy_sent))
                with swaps.paused():
                    return checkpoint(original, *a, use_reentrant=False, **kw)
            with swaps.paused():  # its arguments are swapped: the mode is for the glue
                return original(*a, **kw)

        def swap_in(_module: nn.Module, a: tuple, kw: dict) -> tuple[tuple, dict]:
            """The received tensors in place of the first call's stream arguments, before
            the block's own hooks (tensor parallelism, FSDP) see them."""
            leaves = leaf_paths(a, kw)
            for n, pos in self._carry_in.get(self._first_call, ()):
                swaps.add(leaves[pos], received[self._num_in + n])
            for pos, slot in enumerate(self._in_slots):
                if slot >= 0:
                    swaps.add(leaves[pos], received[slot])
            return swaps.swap(a, kw)

        glue = swaps.from_first_add() if self._reuse and received is not None \
            else contextlib.nullcontext()
        first = self._root.get_submodule(self._calls[self._first_call])
        receive = first.register_forward_pre_hook(swap_in, prepend=True, with_kwargs=True) \
            if received is not None else None
        try:
            with autocast, intercept(self._root, self._calls, handler), glue, \
                    _hooks_suspended(self._outside), own_router_loss_off(self._root):
                output = self._root(*model_args, **self._const_kwargs, **kwargs)
        except StageExit as stop:
            return stop.value
        finally:
            if receive is not None:
                receive.remove()
        return model_output_tensor(output)

    def _from_shards(self, received: tuple) -> tuple:
        """Received sequence shards as the ``DTensor`` stream (sequence parallelism)."""
        if self._seq_mesh is None:
            return received
        return tuple(DTensor.from_local(t, self._seq_mesh, [Shard(1)], run_check=False)
                     if isinstance(t, torch.Tensor) and t.is_floating_point() and t.dim() >= 2
                     else t for t in received)

    def _head_step(self, hidden: torch.Tensor, labels: torch.Tensor | None,
                   carry: HeadCarry | None) -> torch.Tensor | tuple[torch.Tensor, ...]:
        """This stage's vocabulary rows folded into the carry; per-position losses at the end."""
        assert labels is not None, "a head-split stage needs the labels (PipelinedModel.step)"
        head, lo, hi, _ = self._shards
        carry = shard_carry(hidden, head.weight, head.bias, (lo, hi), labels, carry,
                            self._logit_ops)
        if self.is_last:
            return token_losses(carry)
        # the next shard stage needs the hidden state too: a copy, never the received tensor
        return (hidden.clone(), *carry)

    def _partial_call(self, part: Partial, original: Callable[..., Any], args: tuple,
                      kwargs: dict, recompute: bool) -> Any:
        """``P``'s output from this stage's units, checkpointed like ``P`` when recomputing."""
        if recompute and part.call in self._checkpointed:
            return checkpoint(run_partial, part, original, args, kwargs, use_reentrant=False)
        return run_partial(part, original, args, kwargs)

    def _until(self, original: Callable[..., Any], idx: int, args: tuple,
               kwargs: dict) -> tuple[torch.Tensor, ...]:
        """Run a split half's module ``P`` (call ``idx``) until it calls ``C``, the next
        stage's first call; what crosses the cut. Deterministic, so a checkpoint's
        recomputation, outside the stage's forward, replays it."""
        child = self._calls[self._split_at[idx]]

        def stop(_i: int, _m: nn.Module, _f: Callable[..., Any], a: tuple, kw: dict) -> Any:
            raise StageExit(self._stream_of(a, kw))

        try:
            with intercept(self._root, [child], stop):
                original(*args, **kwargs)
        except StageExit as exit_:
            return exit_.value
        raise AssertionError(f"{child} was not called")  # the trace saw it called

    def _stream_of(self, args: tuple, kwargs: dict) -> tuple[torch.Tensor, ...]:
        leaves = leaf_paths(args, kwargs)
        picked: dict[int, torch.Tensor] = {}
        for pos, slot in enumerate(self._out_slots or ()):
            if slot >= 0:
                picked.setdefault(slot, leaves[pos])
        return tuple(picked[s] for s in sorted(picked))

    def _stand_in(self, idx: int) -> StandIn:
        if idx not in self._stand_ins:
            self._stand_ins[idx] = StandIn(self._root.get_submodule(self._calls[idx]),
                                         self._shapes)
        return self._stand_ins[idx]


def _carried(chain: BlockChain, call: int) -> dict[int, list[tuple[int, int]]]:
    """The values crossing the cut before ``call`` beside its stream:
    ``{earlier call: [(index among them, leaf), ...]}``."""
    carries = chain.trace.carries if chain.trace is not None else ()
    out: dict[int, list[tuple[int, int]]] = {}
    if 0 < call <= len(carries):
        for n, (source, leaf) in enumerate(carries[call - 1] or ()):
            out.setdefault(source, []).append((n, leaf))
    return out


def _sendable(stream: tuple[torch.Tensor, ...], carried: tuple[torch.Tensor, ...],
              received: tuple[torch.Tensor, ...] | None = None, *, copy: bool = False
              ) -> torch.Tensor | tuple[torch.Tensor, ...]:
    """What a stage sends: the next call's stream, then the carried values. torch's
    zero-bubble backward detaches stage outputs in place, which a view (HF heads read
    ``hidden_states[:, slice, :]``) does not allow: a view is sent as a copy (a sequence-
    parallel ``DTensor`` is sent as its local shard, a view too), and so is a
    received tensor sent on (a stage inside one half passes ``P``'s input and the
    residual through); with ``copy`` every value is sent as a copy. Every copy is
    contiguous, and so is every value sent: gloo sends and receives contiguous tensors
    only, and torch receives a stage output's gradient into a buffer laid out like the
    output (Zamba's and RecurrentGemma's layers return transposed-stride outputs)."""
    passed = {id(t) for t in received or ()}
    local = (t.to_local() if isinstance(t, DTensor) else t for t in (*stream, *carried))
    values = tuple(t.clone(memory_format=torch.contiguous_format)
                   if copy or t._is_view() or id(t) in passed or not t.is_contiguous() else t
                   for t in local)
    return values[0] if len(values) == 1 else values


@contextlib.contextmanager
def _hooks_suspended(modules: list[nn.Module]) -> Any:
    """Run without the forward hooks of ``modules`` (restored on exit)."""
    saved = [(m, m._forward_pre_hooks, m._forward_hooks) for m in modules
             if m._forward_pre_hooks or m._forward_hooks]
    try:
        for m, _, _ in saved:
            m._forward_pre_hooks, m._forward_hooks = OrderedDict(), OrderedDict()
        yield
    finally:
        for m, pre, post in saved:
            m._forward_pre_hooks, m._forward_hooks = pre, post


def _contiguous_grads(received: tuple) -> None:
    """Make the gradients of the received tensors contiguous, as they are sent back: gloo
    sends only contiguous tensors, and the sending stage receives them into a buffer
    laid out like the gradient torch found when it inferred the shapes (Zamba's shared
    attention gives its input a transposed-stride gradient)."""
    for t in received:
        if isinstance(t, torch.Tensor) and t.requires_grad:
            t.register_hook(_contiguous)


def _contiguous(grad: torch.Tensor) -> torch.Tensor:
    """``grad`` in contiguous memory (a tensor hook)."""
    return grad.contiguous()


def _local(value: Any) -> Any:
    """The model's output as this rank's part of it (a ``DTensor`` as its local tensor)."""
    return value.to_local() if isinstance(value, DTensor) else value


def _on_meta(t: torch.Tensor) -> torch.Tensor:
    return t if t.is_meta else torch.empty_like(t, device="meta")


def build_stage_modules(root: nn.Module, chain: BlockChain, plan: Plan,
                        stages: list[StagePlan], *, recompute: Callable[[StagePlan], bool],
                        autocast_dtype: torch.dtype | None,
                        split_backward: bool = False,
                        seq_mesh: DeviceMesh | None = None) -> list[nn.Module]:
    """One stage module per stage plan (already materialized blocks of ``root``);
    ``split_backward``: the schedule computes weight gradients apart (zero-bubble);
    ``seq_mesh``: the tp mesh when the stream is sequence-parallel."""
    return [ForwardStage(root, chain, base_names(plan, chain, stage.modules),
                         derived_parts(plan, chain, [stage.index]),
                         recompute=recompute(stage), autocast_dtype=autocast_dtype,
                         split_backward=split_backward, seq_mesh=seq_mesh)
            for stage in stages]
