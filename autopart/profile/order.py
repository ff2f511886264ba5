"""Blocks timed again in model order, as a pipeline stage runs them (the CPU ``order`` method).

A block timed alone, even after the ``model`` flush, reads faster on CPU than the same
block inside a stage: there the blocks before it have just run, their saved tensors are
held until the backward and every call allocates its own into memory the caches have not
seen (docs/timing-sweep.md). ``time_in_order`` runs the model's forward a few times with
every block call timed on a materialized copy of its block, in the model's order, each
call's graph held, then each call's full backward in reverse order; the median over the
passes is each call's in-order time. ``in_order`` scales each measured kind of call's
forward, and its backward (full, B and W alike), by the median ratio of its calls'
in-order times to the times measured alone, so twins stay identical, split halves keep
their proportions and the memory figures are untouched.

It needs the whole model's weights, their gradients and one microbatch's activations in
memory at once; where that is more than a quarter of the memory available it is skipped
and the profile says so (``time_source``).
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from autopart.intake import BlockChain
from autopart.profile.engines import AnalyticalEngine, MeasuringEngine
from autopart.profile.materialize import materialize_block, weight_bytes
from autopart.profile.runner import ForwardRunner
from autopart.profile.tasks import first_tensor, make_task, task_loss

__all__ = []

ORDER_PASSES = 5
"""Timed passes over the model (after one untimed pass); each call's median is kept."""
ORDER_BUDGET_S = 30.0
"""No further timed pass starts after this many seconds of them (at least one runs):
the passes run every block, so on deep models they cost more than the profile's one
measurement per kind of block."""
MEMORY_SHARE = 0.25
"""The pass runs only when weights + one microbatch's activations fit in this share of
the memory available."""


def fits_in_memory(weight_bytes: int, activation_bytes: int) -> bool:
    """Whether the whole model and one microbatch's activations fit ``MEMORY_SHARE`` of
    the memory available now."""
    import psutil

    return weight_bytes + activation_bytes <= MEMORY_SHARE * psutil.virtual_memory().available


class OrderPass:
    """The profiler's second look at a model (``autopart.profile.profiler``): called with
    its per-call figures, returns them scaled to their times in model order; ``note``
    ends the profile's ``time_source`` (why the passes were skipped, if they were)."""

    def __init__(self, model: nn.Module, chain: BlockChain, runner: ForwardRunner,
                 dtype: torch.dtype, thread_clock: bool) -> None:
        self.model, self.chain, self.runner = model, chain, runner
        self.dtype, self.thread_clock = dtype, thread_clock
        self.note = ""

    def __call__(self, done: dict[int, tuple[Any, str]], splits: dict[int, int],
                 outputs: dict[int, Any]) -> dict[int, tuple[Any, str]]:
        """``in_order`` of ``time_in_order``, or ``done`` unchanged where the model does
        not fit (``fits_in_memory``)."""
        weights = weight_bytes(self.model, self.dtype)
        activations = sum(c.figures.memory.activation_bytes for c, _ in done.values())
        if not fits_in_memory(2 * weights, activations):  # weights and their grads
            self.note = (f" (not in model order: the model's {weights / 2**30:.1f} GiB of "
                         f"weights and its activations need more than a quarter of the "
                         f"memory available)")
            return done
        timed = time_in_order(self.model, self.chain, self.runner, outputs, self.dtype,
                              self.thread_clock)
        return in_order(done, splits, timed)


def order_pass(model: nn.Module, chain: BlockChain, runner: ForwardRunner,
               engine: MeasuringEngine | AnalyticalEngine,
               dtype: torch.dtype) -> OrderPass | None:
    """The order pass where ``engine``'s backend asks for it (the CPU ``order`` method)."""
    if not (isinstance(engine, MeasuringEngine) and engine.backend.times_in_order):
        return None
    return OrderPass(model, chain, runner, dtype, engine.backend.clock == "thread")


@dataclass(frozen=True, slots=True)
class InOrder:
    """Per block call, median ms over the passes, timed in model order."""

    fwd_ms: list[float]
    bwd_ms: list[float]
    """The call's full backward, run in reverse model order after the pass's forward."""
    joined_bwd_ms: float = 0.0
    """Median ms of the whole model's backward as one graph, one call from the loss, as
    a stage runs its blocks' (0: not measured). Each call's own backward, from a leaf
    input and a gradient handed to it, costs more: on this 2-core machine the calls'
    sum was 10-25% over it (an engine start per call, a leaf gradient made per call)."""


def time_in_order(model: nn.Module, chain: BlockChain, runner: ForwardRunner,
                  outputs: dict[int, Any], dtype: torch.dtype, thread_clock: bool,
                  num_passes: int = ORDER_PASSES) -> InOrder:
    """Every block call's forward timed in the model's order, then its full backward in
    reverse order, as a stage runs them.

    Every call runs on a materialized copy of its block (made once, kept for the passes)
    with the arguments the model's code gives it, its stream input a leaf that requires
    grad as in a stage; the last call ends in the loss, as the profile's task does. The
    model's code is answered with the call's recorded output (``outputs``, as profiled)
    and every call's graph is held until its backward, which starts from a fixed random
    gradient (the loss: none). A call's input, or its incoming gradient, is read again
    before the clock starts (a stage is handed it just produced).
    """
    hf_init = getattr(model, "_init_weights", None) if chain.family == "hf_causal_lm" else None
    modules: dict[int, nn.Module] = {}
    grads: dict[int, torch.Tensor | None] = {}
    clock = time.thread_time if thread_clock else time.perf_counter
    fwd: list[list[float]] = [[] for _ in chain.call_fqns]
    bwd: list[list[float]] = [[] for _ in chain.call_fqns]

    def one_pass(timed: bool) -> None:
        held: list[tuple[int, torch.Tensor]] = []

        def visit(idx: int, original: nn.Module, args: tuple, kwargs: dict) -> Any:
            if id(original) not in modules:
                modules[id(original)] = materialize_block(original, runner.device, dtype,
                                                          hf_init)
            task = make_task(chain, idx, modules[id(original)], args, kwargs, runner.device,
                             runner.labels)
            task.inputs.detach().sum()
            start = clock()
            out = task.forward()
            ms = (clock() - start) * 1e3
            if timed:
                fwd[idx].append(ms)
            if idx not in grads:
                grads[idx] = (None if task.loss_output or not out.is_floating_point()
                              else torch.randn_like(out))
            held.append((idx, out))
            return outputs[idx]

        runner.run(visit)
        while held:
            idx, out = held.pop()
            if not out.requires_grad:
                continue
            grad = grads[idx]
            if grad is not None:
                grad.sum()
            start = clock()
            torch.autograd.backward(out, grad)
            ms = (clock() - start) * 1e3
            if timed:
                bwd[idx].append(ms)
            del out

    def joined_pass() -> float:
        """The model's forward with every call run on its copy and its output handed on,
        so the whole model is one graph; returns its backward's ms (0 when no weight
        feeds the loss: the calls' own backwards stand)."""
        last = len(chain.call_fqns) - 1
        loss: list[torch.Tensor] = []

        def visit(idx: int, original: nn.Module, args: tuple, kwargs: dict) -> Any:
            out = modules[id(original)](*args, **kwargs)
            if idx == last:
                loss.append(task_loss(chain, first_tensor(out, chain.call_fqns[idx]),
                                      runner.labels.to(runner.device)))
            return out

        runner.run(visit, grad=True)
        if not (loss and loss[0].requires_grad):  # nothing trainable feeds the loss
            return 0.0
        start = clock()
        loss[0].backward()
        ms = (clock() - start) * 1e3
        for module in modules.values():
            module.zero_grad(set_to_none=True)
        return ms

    one_pass(False)
    joined_pass()
    joined: list[float] = []
    start = time.perf_counter()
    for _ in range(num_passes):
        one_pass(True)
        joined.append(joined_pass())
        if time.perf_counter() - start > ORDER_BUDGET_S:
            break
    for module in modules.values():
        module.zero_grad(set_to_none=True)
    return InOrder([statistics.median(s) if s else 0.0 for s in fwd],
                   [statistics.median(s) if s else 0.0 for s in bwd],
                   joined_bwd_ms=statistics.median(joined))


def in_order(done: dict[int, tuple[Any, str]], splits: dict[int, int],
             timed: InOrder) -> dict[int, tuple[Any, str]]:
    """``done`` (call -> (call figures, kind)) with every kind's forward scaled by the
    median, over its calls, of in-order ms / ms measured alone, and its backward (full,
    B and W alike) by the same ratio of full backwards times the model's joined backward
    over the sum of its calls' (``InOrder.joined_bwd_ms``). A split half's call ``P``
    (``splits``: P -> its child C) was measured as P less C and runs whole in order:
    both parts take P's ratios."""
    summed = sum(timed.bwd_ms)
    joined = timed.joined_bwd_ms / summed if timed.joined_bwd_ms > 0 and summed > 0 else 1.0
    child_of = {c: p for p, c in splits.items()}
    ratios: dict[tuple[str, str], list[float]] = {}
    for idx, (figures, kind) in done.items():
        if idx in child_of:
            continue
        for phase, ms in (("fwd", timed.fwd_ms[idx]), ("bwd", timed.bwd_ms[idx])):
            alone = _ms(figures, phase) + (_ms(done[splits[idx]][0], phase)
                                           if idx in splits else 0.0)
            if alone > 0 and ms > 0:
                ratios.setdefault((kind, phase), []).append(ms / alone)
    kind_ratio = {key: statistics.median(r) for key, r in ratios.items()}
    out = {}
    for idx, (figures, kind) in done.items():
        parent_kind = done[child_of[idx]][1] if idx in child_of else kind
        out[idx] = (_scaled(figures, kind_ratio.get((parent_kind, "fwd"), 1.0),
                            kind_ratio.get((parent_kind, "bwd"), 1.0) * joined), kind)
    return out


def _ms(call: Any, phase: str) -> float:
    times = call.figures.times
    return times.fwd_ms if phase == "fwd" else times.bwd_ms


def _scaled(call: Any, fwd: float, bwd: float) -> Any:
    times = call.figures.times
    figures = dataclasses.replace(call.figures, times=dataclasses.replace(
        times, fwd_ms=times.fwd_ms * fwd, bwd_ms=times.bwd_ms * bwd,
        bwd_input_ms=times.bwd_input_ms * bwd, bwd_weight_ms=times.bwd_weight_ms * bwd,
        split_extra_ms=times.split_extra_ms * bwd))
    return dataclasses.replace(call, figures=figures)
