"""Parameters on the meta device, then real storage and initial values for part of a model.

``params_on_meta`` builds a model with every parameter on meta (small constructor values
kept beside them); ``empty_on`` gives a module real storage; ``init_empty`` and
``init_hf_weights`` fill it as the module's classes or the HF model would.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch
from torch import nn

__all__ = ["empty_on", "init_empty", "init_empty_parameter", "init_hf_weights",
           "params_on_meta"]


_CONSTRUCTED = "_autopart_constructed"
"""Attribute of a meta parameter holding the value its constructor gave it."""
_KEEP_NUMEL = 1 << 16
"""Largest parameter whose constructor value ``params_on_meta`` keeps (scales, biases)."""


@contextlib.contextmanager
def params_on_meta() -> Iterator[None]:
    """Create every ``nn.Parameter`` registered inside on the meta device; buffers stay real.

    Parameters are moved to meta as they are registered, before any module
    initializes them, so no full-size weight is ever filled. The value a constructor
    gave a small parameter of at most one dimension (GPT-1's zero biases, Apertus'
    xIELU slopes: values no ``_init_weights`` sets again) is kept beside it, and
    ``empty_on`` starts the parameter from it.
    """
    original = nn.Module.register_parameter

    def register(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        original(module, name, param)
        if param is not None and param.device.type != "meta":
            held = module._parameters[name]
            extra = dict(held.__dict__)
            extra.pop(_CONSTRUCTED, None)
            extra["requires_grad"] = param.requires_grad
            on_meta = type(held)(held.to("meta"), **extra)
            if held.dim() <= 1 and held.numel() <= _KEEP_NUMEL:
                setattr(on_meta, _CONSTRUCTED, held.detach().clone())
            module._parameters[name] = on_meta

    nn.Module.register_parameter = register
    try:
        yield
    finally:
        nn.Module.register_parameter = original


def empty_on(module: nn.Module, device: torch.device | str, *,
             fill: float | None = None) -> None:
    """Give every meta parameter and buffer of ``module`` uninitialized storage on ``device``.

    Unlike ``nn.Module.to_empty`` it keeps the values of real buffers (rotary
    tables built by ``params_on_meta``), moving them to ``device``, and starts a
    parameter from the value its constructor gave it where ``params_on_meta`` kept one.
    With ``fill``, the other meta parameters hold ``fill`` (NaN marks what no
    initialization has set yet: ``init_hf_weights``).
    """
    for sub in module.modules():
        for name, p in list(sub._parameters.items()):
            if p is not None:
                kept = getattr(p, _CONSTRUCTED, None)
                if p.is_meta and kept is not None and kept.shape == p.shape:
                    value = kept.to(device=device, dtype=p.dtype, copy=True)
                elif p.is_meta and fill is not None and p.is_floating_point():
                    value = torch.full_like(p, fill, device=device)
                elif p.is_meta:
                    value = torch.empty_like(p, device=device)
                else:
                    value = p.detach().to(device)
                sub._parameters[name] = nn.Parameter(value, requires_grad=p.requires_grad)
        for name, b in list(sub._buffers.items()):
            if b is not None:
                sub._buffers[name] = torch.empty_like(b, device=device) if b.is_meta \
                    else b.to(device)


def init_empty(module: nn.Module, *, std: float = 0.02) -> list[str]:
    """Initialize a module just given empty storage the way its classes would.

    Each submodule's ``reset_parameters`` (or torch's private ``_reset_parameters``,
    which ``nn.MultiheadAttention`` and ``nn.Transformer`` use) sets its own
    parameters. Parameters no such method covers get zeros (biases), ones (other
    1-D weights) or N(0, ``std``); their names are returned so callers can say so.
    Call it under ``torch.no_grad()`` with the RNG seeded as wanted.
    """
    covered: set[int] = set()
    for sub in module.modules():
        reset = getattr(sub, "reset_parameters", None) or getattr(sub, "_reset_parameters", None)
        if callable(reset):
            reset()
            covered.update(id(p) for p in sub.parameters(recurse=False))
    uncovered = []
    for name, p in module.named_parameters():
        if id(p) in covered:
            continue
        uncovered.append(name)
        init_empty_parameter(name, p, std=std)
    return uncovered


def init_hf_weights(module: nn.Module, root: nn.Module, *, std: float = 0.02,
                    seed_each: Callable[[str], None] | None = None,
                    prefix: str = "") -> list[str]:
    """Initialize ``module`` (``root`` or one of its blocks), given storage by
    ``empty_on(..., fill=nan)``, with the HF model ``root``'s own ``_init_weights``.

    A parameter that ``_init_weights`` leaves unset and whose constructor set it on
    the fly (GPT-1's ``Conv1D`` weights: ``nn.init.normal_`` inside ``__init__``, a
    no-op on meta) still holds NaN afterwards; it gets zeros (biases), ones (other 1-D
    weights) or N(0, ``std``), like ``init_empty``'s uncovered parameters. Call it under
    ``torch.no_grad()`` with the RNG seeded as wanted.

    Each sub-module is initialized by the innermost HF model holding it, as
    transformers does (Gemma 3n's and xLSTM's ``_init_weights`` read attributes only
    their inner text model has).

    Args:
        module: The module to initialize.
        root: The HF model holding it.
        std: The fallback's standard deviation.
        seed_each: Called with each sub-module's and fallback parameter's name (under
            ``prefix``) before it is initialized, to seed the RNG by name.
        prefix: ``module``'s FQN in ``root``.

    Returns:
        Names (in ``module``) of the parameters set by that fallback.
    """
    owner = _init_owners(root)
    for name, sub in module.named_modules(prefix=prefix):
        if seed_each is not None:
            seed_each(name)
        owner.get(id(sub), root)._init_weights(sub)
    unset = []
    for name, p in module.named_parameters(prefix=prefix):
        if p.is_floating_point() and bool(torch.isnan(p).any()):
            unset.append(name)
            if seed_each is not None:
                seed_each(name)
            init_empty_parameter(name, p, std=std)
    return unset


def _init_owners(root: nn.Module) -> dict[int, nn.Module]:
    """``id(module) -> the innermost module with ``_init_weights`` holding it`` in ``root``."""
    owner: dict[int, nn.Module] = {}

    def walk(module: nn.Module, current: nn.Module) -> None:
        if callable(getattr(module, "_init_weights", None)):
            current = module
        owner[id(module)] = current
        for child in module.children():
            walk(child, current)

    walk(root, root)
    return owner


def init_empty_parameter(name: str, p: torch.Tensor, *, std: float = 0.02) -> None:
    """A parameter no initialization covers: zeros (a bias), ones (other 1-D weights) or
    N(0, ``std``). Call it under ``torch.no_grad()`` with the RNG seeded as wanted."""
    if name.endswith("bias"):
        p.zero_()
    elif p.dim() == 1:
        p.fill_(1.0)
    else:
        p.normal_(0.0, std)
