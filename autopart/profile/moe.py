"""Routing of mixture-of-experts layers: how evenly the profiled tokens spread over experts.

A MoE layer's cost depends on its routing. The profiler runs the router for real on
the tokens the layer really receives; ``expert_counter`` watches the router (a
submodule whose output holds logits over the experts) and counts the tokens each
expert gets under top-k routing, reported as the busiest and idlest expert's load
relative to the mean.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch import nn
from torch.utils._pytree import tree_flatten

__all__ = []

_NUM_EXPERTS = ("num_local_experts", "num_experts", "n_routed_experts")


@contextlib.contextmanager
def expert_counter(module: nn.Module) -> Iterator[list[float]]:
    """Yield a list that, on exit, holds ``[max / mean, min / mean]`` tokens per expert.

    Stays empty for modules without a router, and on meta (no routing values).
    """
    result: list[float] = []
    counts: list[torch.Tensor] = []
    hooks = []
    for sub in module.modules():
        if not _is_router(sub):
            continue
        config = getattr(sub, "config", None)
        experts = next((getattr(owner, a) for owner in (sub, config) for a in _NUM_EXPERTS
                        if isinstance(getattr(owner, a, None), int)), None)
        top_k = next((getattr(owner, a) for owner in (sub, config)
                      for a in ("top_k", "num_experts_per_tok")
                      if isinstance(getattr(owner, a, None), int)), None)
        if experts and top_k:
            hooks.append(sub.register_forward_hook(_hook(experts, top_k, counts)))
    try:
        yield result
    finally:
        for hook in hooks:
            hook.remove()
        if counts:
            load = torch.stack(counts).sum(0).float()
            mean = load.mean().clamp(min=1e-9)
            result.extend([round((load.max() / mean).item(), 4),
                           round((load.min() / mean).item(), 4)])


def _is_router(module: nn.Module) -> bool:
    name = type(module).__name__.lower()
    return "router" in name or "gate" in name and "proj" not in name


def _hook(experts: int, top_k: int, counts: list[torch.Tensor]):
    def hook(module: nn.Module, args: tuple, output: object) -> None:
        leaves = [x for x in tree_flatten(output)[0] if isinstance(x, torch.Tensor)]
        for leaf in leaves:
            if not leaf.is_meta and not leaf.is_floating_point() and leaf.shape[-1] == top_k:
                counts.append(torch.bincount(leaf.flatten().long().cpu(), minlength=experts))
                return
        for leaf in leaves:
            if (isinstance(leaf, torch.Tensor) and not leaf.is_meta and leaf.is_floating_point()
                    and leaf.shape[-1] == experts):
                chosen = leaf.reshape(-1, experts).topk(top_k, dim=-1).indices
                counts.append(torch.bincount(chosen.flatten().cpu(), minlength=experts))
                return
    return hook
