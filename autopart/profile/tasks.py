"""Feed each block exactly what the model's own forward gives it, one block at a time.

``ForwardRunner`` runs the model's forward once (``autopart.intake.forward``) with
every block call routed to the profiler's ``visit``. The model's code between
blocks (masks, rotary tables, embedding scaling, position embeddings) runs on
the *glue device*: the profiling device for ``cpu`` and ``cuda``, the CPU for
meta (``analytical``) and XLA, where a block's output comes back as zeros of its
shape. ``visit`` turns a call into a ``BlockTask``: the call's first stream
argument (what crosses a cut before it) is the task's input, every other
argument (context) is held fixed. The last call's task ends in the loss: the
next-token loss on HF causal LMs, ``output.float().pow(2).mean()`` otherwise.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_flatten, tree_map_only

from autopart.errors import ProfileError
from autopart.intake import BlockChain
from autopart.intake.blocks import example_inputs
from autopart.intake.forward import KeepOffMeta, intercept, leaf_paths, replace_leaves
from autopart.intake.hf import causal_lm_loss

__all__ = []


@dataclass(slots=True)
class BlockTask:
    """One materialized block call, its input and how to run it."""

    run: Callable[[torch.Tensor], torch.Tensor]
    """Forward from the block input to its output (to the loss for the last block)."""
    inputs: torch.Tensor
    """The block input: a leaf that requires grad iff ``input_grad``."""
    input_grad: bool
    """Whether the backward computes a gradient for the input (B > 0)."""
    loss_output: bool
    """The output is a scalar loss: backward starts from it with no incoming gradient."""
    module: nn.Module
    exclude: tuple[torch.Tensor, ...] = ()
    """Tensors that are not activations of this block (context shared by all layers)."""
    meta_task: Callable[[nn.Module], BlockTask] | None = None
    """The same call on meta for a meta copy of the module (XLA computes memory there)."""
    call: Callable[[], Any] | None = None
    """Run the module on the call's own arguments; its whole output (what the model sees)."""

    def forward(self) -> torch.Tensor:
        """Run the block's forward once."""
        return self.run(self.inputs)

    def trainable(self) -> list[torch.Tensor]:
        """Parameters that receive gradients."""
        return [p for p in self.module.parameters() if p.requires_grad]


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

    def run(self, visit: Visit) -> None:
        """Call ``visit(call_idx, module, args, kwargs)`` for each block call, in order.

        ``visit`` returns the call's output as the model's code should see it (on
        the glue device). The model itself is only read.
        """
        args, kwargs = example_inputs(self.model, self.chain.call_fqns, self.micro_batch_size,
                                      self.seq_len, self.glue_device, self.dtype)
        calls = self.chain.call_fqns

        def handler(idx: int, module: nn.Module, original: Any, a: tuple, kw: dict) -> Any:
            with torch.enable_grad():
                out = visit(idx, module, a, kw)
            return out

        moved = _buffers_to(self.model, calls, self.glue_device)
        try:
            with torch.no_grad(), intercept(self.model, calls, handler), KeepOffMeta():
                self.model(*args, **kwargs)
        finally:
            for module, name, buf in moved:
                module._buffers[name] = buf

    def time_glue(self, outputs: dict[int, Any], num_repeats: int = 5) -> float:
        """Median ms of the model's own code between blocks: the forward with every block
        call answered at once by its recorded output (``outputs[call_idx]``). Every
        pipeline stage runs this code for each microbatch it forwards."""
        times = []
        for _ in range(num_repeats):
            start = time.perf_counter()
            self.run(lambda idx, module, args, kwargs: outputs[idx])
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            times.append(1e3 * (time.perf_counter() - start))
        return statistics.median(times)

    def to_glue(self, output: Any) -> Any:
        """A block's output as the model's code should see it (zeros when it ran on meta)."""
        def move(t: torch.Tensor) -> torch.Tensor:
            if t.is_meta:
                return torch.zeros(t.shape, dtype=t.dtype, device=self.glue_device)
            return t.detach().to(self.glue_device)
        return tree_map_only(torch.Tensor, move, output)


def make_task(chain: BlockChain, call_idx: int, module: nn.Module, args: tuple, kwargs: dict,
              device: torch.device, labels: torch.Tensor) -> BlockTask:
    """The task running ``module`` (a materialized copy) on the call's arguments on ``device``.

    Raises:
        ProfileError: the call has no tensor argument to start from.
    """
    record = chain.call(call_idx)
    args, kwargs = tree_map_only(torch.Tensor, lambda t: on_device(t, device), (args, kwargs))
    leaves = leaf_paths(args, kwargs)
    positions = [i for i, slot in enumerate(record.stream) if slot == 0]
    if not positions:
        positions = [next((i for i, x in enumerate(leaves) if isinstance(x, torch.Tensor)), -1)]
        if positions[0] < 0:
            raise ProfileError(f"block {record.fqn} receives no tensor; autopart cannot time it")
    start = leaves[positions[0]]
    grad = start.is_floating_point() and record.num_stream > 0
    x = start.detach().requires_grad_(grad)
    context = tuple(leaf for i, leaf in enumerate(leaves) if isinstance(leaf, torch.Tensor)
                    and i not in positions)
    last = call_idx == len(chain.call_fqns) - 1
    hf = chain.family == "hf_causal_lm"
    target = labels.to(device) if device.type != "meta" else torch.empty_like(labels,
                                                                               device="meta")

    def run(value: torch.Tensor) -> torch.Tensor:
        a, kw = replace_leaves(args, kwargs, {i: value for i in positions})
        out = _first_tensor(module(*a, **kw), record.fqn)
        if not last:
            return out
        if hf:
            return causal_lm_loss(out, target)
        return out.float().pow(2).mean()

    def on_meta(meta_module: nn.Module) -> BlockTask:
        return make_task(chain, call_idx, meta_module, args, kwargs, torch.device("meta"),
                         labels)

    return BlockTask(run=run, inputs=x, input_grad=grad, loss_output=last, module=module,
                     exclude=context, meta_task=on_meta, call=lambda: module(*args, **kwargs))


def on_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A detached copy of ``t`` on ``device`` (an empty tensor of its shape on meta)."""
    if device.type == "meta":
        return torch.empty_like(t, device="meta")
    return t.detach().to(device)


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


def _first_tensor(out: object, fqn: str) -> torch.Tensor:
    if isinstance(out, torch.Tensor):
        return out
    for leaf in tree_flatten(out)[0]:
        if isinstance(leaf, torch.Tensor):
            return leaf
    raise ProfileError(f"block {fqn} returned {type(out).__name__} with no tensor in it")
