"""What a block finds warm when a pipeline calls it, for backends that flush before timing.

In a pipeline the other blocks' weights pass through the caches between two calls of a
block, while its code (every layer runs the same), the allocator's state and its input
(just produced) are warm. After its flush, the CPU ``model`` flush
(``autopart.profile.backends.CPUBackend``) runs ``warm_on_a_copy``'s call on a copy of
the block's weights and reads ``hot_inputs`` again, none of it timed.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch

from autopart.profile.tasks import BlockTask

__all__ = []


def warm_on_a_copy(task: BlockTask, grad_out: torch.Tensor | None
                    ) -> tuple[Callable[[], None], Callable[[], None]]:
    """The block's forward, and its forward + backward, run on a copy of its weights.

    In a pipeline every layer runs the same code, so a block's code, its kernels' and
    autograd's are warm when it runs, while its weights come back from farther away
    after the other blocks' passed through the caches. Run after the flush, a copy
    warms the first and leaves the second cold (the copy's weights are not the block's).
    """
    params = [p for p in task.module.parameters()]
    copies = {id(p): p.detach().clone().requires_grad_(p.requires_grad) for p in params}
    wanted = [c for c in copies.values() if c.requires_grad]
    if task.input_grad:
        wanted.append(task.inputs)

    def forward() -> None:
        with _on_copies(task.module, copies):
            task.forward()

    def backward() -> None:
        with _on_copies(task.module, copies):
            out = task.forward()
            if wanted and out.requires_grad:
                torch.autograd.grad(out, wanted, grad_out, allow_unused=True)

    return forward, backward


@contextmanager
def _on_copies(module: torch.nn.Module, copies: dict[int, torch.Tensor]) -> Iterator[None]:
    """Run ``module`` with ``copies`` (by ``id`` of the parameter) in place of its
    parameters; the originals are put back on exit."""
    swapped = []
    for sub in module.modules():
        for name, param in list(sub._parameters.items()):
            if param is not None and id(param) in copies:
                swapped.append((sub, name, param))
                sub._parameters[name] = copies[id(param)]
    try:
        yield
    finally:
        for sub, name, param in swapped:
            sub._parameters[name] = param


def hot_inputs(task: BlockTask) -> tuple[torch.Tensor, ...]:
    """What a pipeline hands the block warm: its input and the shared context."""
    return (task.inputs, *task.exclude)
