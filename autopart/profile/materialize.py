"""Materialize one block at a time: a private copy on the target device, never the full model.

The block module is deep-copied (cheap on meta), cast to the requested dtype, and
then either given real storage with ``to_empty`` and initialized (meta models) or
moved to the device (real models, whose weights are copied). The user's model is
never touched: its parameters, buffers, ``requires_grad`` flags and training flag
stay as they were.
"""

from __future__ import annotations

import copy
import itertools
from collections.abc import Callable

import torch
from torch import nn

from autopart.intake.forward import meta_safe_experts
from autopart.intake.storage import empty_on, init_empty

__all__ = []

_INIT_STD = 0.02


def materialize_block(module: nn.Module, device: torch.device, dtype: torch.dtype,
                      hf_init: Callable[[nn.Module], None] | None = None) -> nn.Module:
    """A training-mode copy of ``module`` on ``device`` in ``dtype`` with initialized weights.

    Meta tensors are initialized with each submodule's ``reset_parameters`` (or ones
    for 1-D weights, zeros for biases, N(0, 0.02) otherwise), then with the HF model's
    ``_init_weights`` (``hf_init``) where given. Random values come from a forked RNG,
    so the caller's RNG state is unchanged. On ``device="meta"`` nothing is allocated.
    """
    block = copy.deepcopy(module)
    for sub in block.modules():
        sub.__dict__.pop("forward", None)  # a routed forward copied from inside ``intercept``
    if device.type == "meta":
        meta_safe_experts(block)
    block.to(dtype=dtype)
    tensors = itertools.chain(block.parameters(), block.buffers())
    on_meta = any(t.is_meta for t in tensors)
    if on_meta and device.type != "meta":
        meta_buffers = any(b.is_meta for b in block.buffers())
        empty_on(block, device)
        with torch.no_grad(), torch.random.fork_rng(devices=[]):
            torch.manual_seed(0)
            _generic_init(block, zero_buffers=meta_buffers)
            if hf_init is not None:
                for sub in block.modules():
                    hf_init(sub)
    elif not on_meta or device.type == "meta":
        block.to(device=device)
    block.train()
    return block


def weight_bytes(module: nn.Module, dtype: torch.dtype) -> int:
    """Bytes of ``module``'s parameters in ``dtype`` (tied weights once)."""
    return param_bytes_and_count(module)[1] * dtype.itemsize


def param_bytes_and_count(module: nn.Module) -> tuple[int, int]:
    """Bytes and number of the parameters of ``module`` (each shared parameter once)."""
    params = list(module.parameters())
    return sum(p.numel() * p.element_size() for p in params), sum(p.numel() for p in params)


def _generic_init(block: nn.Module, *, zero_buffers: bool) -> None:
    """Give every parameter and buffer defined values (to_empty leaves garbage, even NaN)."""
    init_empty(block, std=_INIT_STD)
    for sub in block.modules() if zero_buffers else ():
        if not getattr(sub, "reset_parameters", None):
            for buf in sub.buffers(recurse=False):
                buf.zero_()
