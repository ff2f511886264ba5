"""Run the model's own forward with every block call handed to a visitor (``ForwardRunner``).

The model's code between blocks (masks, rotary tables, embedding scaling, position
embeddings) runs on the *glue device*: the profiling device for ``cpu`` and ``cuda``, the
CPU for meta (``analytical``) and XLA. The profiler's visitor turns each call into a
``BlockTask`` (``autopart.profile.tasks``); ``ForwardRunner.time_glue`` times what a
pipeline stage runs besides its blocks (``GlueTimes``).
"""

from __future__ import annotations

import dataclasses
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_map_only

from autopart.intake import BlockChain
from autopart.intake.blocks import example_inputs
from autopart.intake.forward import (
    KeepOffMeta,
    StageExit,
    StandIn,
    intercept,
    leaf_paths,
    meta_copy,
    structure_key,
)
from autopart.intake.hf import own_router_loss_off
from autopart.schema import BlockProfile

__all__ = []


Visit = Callable[[int, nn.Module, tuple, dict], Any]


class ForwardRunner:
    """Runs the model's forward once with every block call handed to a visitor."""

    def __init__(self, model: nn.Module, chain: BlockChain, device: torch.device,
                 dtype: torch.dtype, micro_batch_size: int, seq_len: int) -> None:
        self.model, self.chain = model, chain
        self.device, self.dtype = device, dtype
        self.glue_device = device if device.type in ("cpu", "cuda") else torch.device("cpu")
        self.micro_batch_size, self.seq_len = micro_batch_size, seq_len
        self.hf = chain.family == "hf_causal_lm"
        vocab = int(getattr(getattr(model, "config", None), "vocab_size", 2) or 2)
        self.labels = torch.randint(0, vocab, (micro_batch_size, seq_len))

    def run(self, visit: Visit, clock: Callable[[], float] | None = None,
            grad: bool = False) -> tuple[float, float]:
        """Call ``visit(call_idx, module, args, kwargs)`` for each block call, in order.

        ``visit`` returns the call's output as the model's code should see it (on
        the glue device). The model itself is only read. Returns ``clock()`` just
        before the calls are routed and just after they are restored (0, 0 without a
        clock): the span a pipeline stage's forward takes. ``grad``: the model's own code
        records its graph too (else only the calls do). The model's code runs under
        ``KeepOffMeta``; ``visit`` runs outside it, as a stage runs its own blocks and
        the stand-ins before its first received tensor.
        """
        args, kwargs = example_inputs(self.model, self.chain.call_fqns, self.micro_batch_size,
                                      self.seq_len, self.glue_device, self.dtype)
        calls = self.chain.call_fqns

        keep = KeepOffMeta()  # for the model's code: the visitor runs blocks outside it

        def handler(idx: int, module: nn.Module, original: Any, a: tuple, kw: dict) -> Any:
            with torch.enable_grad(), keep.paused():
                out = visit(idx, module, a, kw)
            return out

        moved = _buffers_to(self.model, calls, self.glue_device)
        clock = clock or (lambda: 0.0)
        try:
            start = clock()
            with (torch.enable_grad() if grad else torch.no_grad()), \
                    intercept(self.model, calls, handler), keep, own_router_loss_off(self.model):
                self.model(*args, **kwargs)
            end = clock()
        finally:
            for module, name, buf in moved:
                module._buffers[name] = buf
        return start, end

    def time_glue(self, outputs: dict[int, Any], num_repeats: int = 5) -> GlueTimes:
        """What a pipeline stage's forward runs besides its own blocks, in median ms.

        The model's forward is run with every block call answered at once by its
        recorded output (``outputs[call_idx]``), timing the code before the first call,
        after each call up to the next (after the last: to the end) and the whole;
        then the same forward with every call answered by the runtime's ``StandIn``
        (what a later stage does for the calls before it), timing each answer; then,
        for each split half ``P`` (``BlockChain.splits``), its code on meta up to its
        child ``C``, which a stage starting at ``C`` walks. Stages run the glue from
        the model's start to their end, so they pay for it by position
        (``autopart.cost.stage``).
        """
        n = len(self.chain.call_fqns)
        recorded = [self._timed_forward(lambda idx, *_: outputs[idx]) for _ in range(num_repeats)]
        stand_ins: dict[int, StandIn] = {}
        shapes: dict = {}

        def stand_in(idx: int, module: nn.Module, args: tuple, kwargs: dict) -> Any:
            if idx not in stand_ins:
                stand_ins[idx] = StandIn(module, shapes)
            return stand_ins[idx](args, kwargs, self.glue_device)

        # the first run learns every stand-in's shapes on meta; a stage runs its stand-ins
        # outside any torch-function mode (its ``Substitute`` is entered at the first
        # received tensor, ``Substitute.from_first_add``), so they are timed outside one
        self._timed_forward(stand_in)
        stood = [self._timed_forward(stand_in) for _ in range(num_repeats)]
        total = statistics.median(r.total_ms for r in recorded)
        return GlueTimes(
            total_ms=total, after_call_bytes=self._glue_saved_bytes(outputs),
            after_call_ms=tuple(statistics.median(r.after_ms[i] for r in recorded)
                                for i in range(n)),
            stand_in_ms=tuple(statistics.median(r.call_ms[i] for r in stood) for i in range(n)),
            walk_ms=self._time_walks(outputs, num_repeats))

    def _glue_saved_bytes(self, outputs: dict[int, Any]) -> tuple[int, ...]:
        """Per call, the bytes the model's code after it (up to the next call) saves for
        its backward, each storage once; the calls' own outputs, held anyway, are not
        counted, and what the code before the first call saves goes to the first call.
        Gemma2's logit soft-capping (``tanh`` after the head) saves one logit-sized
        tensor per microbatch this way, which no block holds."""
        from autopart.profile.memory import storage_key

        n = len(self.chain.call_fqns)
        saved, seen, held = [0] * n, set(), set()
        current, copies = [0], []

        def visit(idx: int, module: nn.Module, args: tuple, kwargs: dict) -> Any:
            current[0] = idx
            # a copy that is no leaf, as a block's output on its stage is: CTRL scales
            # its embedding's output in place, which a leaf that requires grad refuses
            out = tree_map_only(torch.Tensor, lambda t: t.detach().requires_grad_().clone()
                                if t.is_floating_point() else t.detach(), outputs[idx])
            copies.append(out)  # alive to the end: a freed storage's key can come again
            held.update(storage_key(t) for t in tree_flatten(out)[0]
                        if isinstance(t, torch.Tensor))
            return out

        def pack(t: torch.Tensor) -> torch.Tensor:
            key = storage_key(t)
            if key is not None and key not in held and key not in seen:
                seen.add(key)
                saved[current[0]] += t.untyped_storage().nbytes()
            return t

        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            self.run(visit, grad=True)
        return tuple(saved)

    def _timed_forward(self, answer: Visit) -> _TimedForward:
        """One forward with every call answered by ``answer``; its times (see ``time_glue``)."""
        n = len(self.chain.call_fqns)
        spans: list[tuple[int, float, float]] = []  # (call, enter, leave) in call order
        clock = time.perf_counter
        sync = ((lambda: torch.cuda.synchronize(self.device)) if self.device.type == "cuda"
                else (lambda: None))

        def visit(idx: int, module: nn.Module, args: tuple, kwargs: dict) -> Any:
            sync()
            enter = clock()
            out = answer(idx, module, args, kwargs)
            sync()
            spans.append((idx, enter, clock()))
            return out

        start, end = self.run(visit, clock=lambda: (sync(), clock())[1])
        after, call = [0.0] * n, [0.0] * n  # calls never made (a split's C) keep 0
        for k, (idx, enter, leave) in enumerate(spans):
            after[idx] = 1e3 * ((spans[k + 1][1] if k + 1 < len(spans) else end) - leave)
            call[idx] = 1e3 * (leave - enter)
        return _TimedForward(total_ms=1e3 * (end - start) - sum(call), after_ms=after,
                             call_ms=call)

    def _time_walks(self, outputs: dict[int, Any], num_repeats: int) -> dict[int, float]:
        """Per split half's child call ``C``: median ms of the half's code on meta up to
        ``C`` (what ``autopart.runtime.stages`` runs on a stage that starts at ``C``).
        Halves of one structure called with the same shapes are timed once."""
        splits = dict(self.chain.splits)
        calls: dict[int, tuple[nn.Module, tuple, dict]] = {}

        def grab(idx: int, module: nn.Module, args: tuple, kwargs: dict) -> Any:
            if idx in splits:
                calls[idx] = (module, args, kwargs)
            return outputs[idx]

        if splits:
            self.run(grab)
        timed: dict[tuple, float] = {}
        walks = {}
        for parent, (module, args, kwargs) in calls.items():
            name = self.chain.call_fqns[splits[parent]][len(self.chain.call_fqns[parent]) + 1:]
            key = (structure_key(module), name, *(
                (tuple(x.shape), x.dtype) if isinstance(x, torch.Tensor) else type(x)
                for x in leaf_paths(args, kwargs)))
            if key not in timed:
                timed[key] = _walk_ms(module, name, args, kwargs, num_repeats)
            walks[splits[parent]] = timed[key]
        return walks

    def to_glue(self, output: Any) -> Any:
        """A block's output as the model's code should see it (zeros when it ran on meta)."""
        def move(t: torch.Tensor) -> torch.Tensor:
            if t.is_meta:
                return torch.zeros(t.shape, dtype=t.dtype, device=self.glue_device)
            return t.detach().to(self.glue_device)
        return tree_map_only(torch.Tensor, move, output)


@dataclass(frozen=True, slots=True)
class GlueTimes:
    """What a pipeline stage runs besides its blocks, per microbatch (``time_glue``)."""

    total_ms: float
    """The model's code between (before, after) all its block calls."""
    after_call_bytes: tuple[int, ...]
    """Per call, what the model's code after it saves for the backward (``_glue_saved_
    bytes``): held per microbatch like the call's own activations."""
    after_call_ms: tuple[float, ...]
    """Per call, the model's code after it up to the next call (after the last: to the
    end of the forward). ``total_ms`` less their sum runs before the first call."""
    stand_in_ms: tuple[float, ...]
    """Per call, answering it with ``StandIn``, as a stage after it does."""
    walk_ms: dict[int, float]
    """Call of a split half's child ``C`` -> its parent's code on meta up to ``C``."""

    def onto(self, chain: BlockChain, blocks: list[BlockProfile]) -> list[BlockProfile]:
        """``blocks`` with these times as ``BlockProfile.glue_after_ms``, ``stand_in_ms``
        and ``walk_ms``, and what the code after a block saves added to its
        ``activation_bytes``. A split half's call ends with its child ``C``: the code
        after it and its stand-in go to ``C``'s block."""
        block_of = {c: i for i, b in enumerate(chain.blocks) for c in b.calls}
        splits = dict(chain.splits)
        after, stand_in = [0.0] * len(blocks), [0.0] * len(blocks)
        saved = [0] * len(blocks)
        for c in block_of:
            end = block_of[splits.get(c, c)]
            after[end] += self.after_call_ms[c]
            stand_in[end] += self.stand_in_ms[c]
            saved[end] += self.after_call_bytes[c]
        walk = {block_of[c]: ms for c, ms in self.walk_ms.items()}
        return [dataclasses.replace(block, glue_after_ms=round(after[i], 4),
                                    stand_in_ms=round(stand_in[i], 4),
                                    walk_ms=round(walk.get(i, 0.0), 4),
                                    activation_bytes=block.activation_bytes + saved[i],
                                    glue_saved_bytes=saved[i])
                for i, block in enumerate(blocks)]


@dataclass(frozen=True, slots=True)
class _TimedForward:
    total_ms: float
    after_ms: list[float]
    call_ms: list[float]


def _meta_like(t: torch.Tensor) -> torch.Tensor:
    return t if t.is_meta else torch.empty_like(t, device="meta")


def _walk_ms(module: nn.Module, child: str, args: tuple, kwargs: dict,
             num_repeats: int) -> float:
    """Median ms of ``module``'s code on meta until it calls its submodule ``child`` (on a
    meta copy: buffers the model keeps real, such as rotary tables, go to meta too)."""
    module = meta_copy(module)
    meta_args, meta_kwargs = tree_map_only(torch.Tensor, _meta_like, (args, kwargs))

    def stop(*_: Any) -> Any:
        raise StageExit(None)

    times = []
    for _ in range(num_repeats + 1):  # the first is a warm-up
        start = time.perf_counter()
        try:
            with torch.no_grad(), intercept(module, [child], stop), KeepOffMeta():
                module(*meta_args, **meta_kwargs)
        except StageExit:
            pass
        times.append(1e3 * (time.perf_counter() - start))
    return statistics.median(times[1:])


def _buffers_to(model: nn.Module, calls: list[str], device: torch.device) -> list:
    """Move buffers outside the blocks to the glue device; return what to restore."""
    moved = []
    blocks = tuple(f + "." for f in calls)
    for fqn, module in model.named_modules():
        if fqn in calls or (fqn + ".").startswith(blocks):
            continue
        for name, buf in list(module._buffers.items()):
            if buf is not None and not buf.is_meta and buf.device != device:
                moved.append((module, name, buf))
                module._buffers[name] = buf.to(device)
    return moved
