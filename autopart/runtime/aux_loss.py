"""The MoE router's load-balancing loss, added by the stages exactly as the whole model adds it.

HF's ``load_balancing_loss_func`` (Mixtral, Qwen3-MoE and the families copying them) is,
over the whole batch and every MoE layer ``l`` at once::

    aux = E * sum_e (T_e / R) * (P_e / R),   T_e = sum_l t_le,   P_e = sum_l p_le

with ``t_le`` the (masked) number of top-k assignments of expert ``e`` in layer ``l``
(no gradient), ``p_le`` the (masked) sum of its routing probabilities and ``R`` the
(masked) rows of all layers together. It is not a sum of per-layer terms: layer ``l``'s
gradient reads ``T_e`` of every layer and every microbatch. It is linear in the ``p_le``
given ``T`` and ``R`` though, so

    aux = sum_l sum_e w_e * p_le,   w_e = E * T_e / R**2

is exact once ``T`` and ``R`` are known. ``T`` and ``R`` depend on the whole batch's
forward, which a 1F1B schedule has not finished when it starts its first backward, so
``RouterAuxLoss`` gathers them first: a forward-only pass of the schedule (no gradient)
counts each rank's layers' ``t_le`` and rows, summed over the pipeline group. The step
then adds, on each stage and microbatch, ``coef * sum_e w_e * p_le`` of its own layers
to the stage's output through ``_AddShare`` (its gradient is 1 whatever flows back),
so loss and every gradient are the unpipelined model's. The pass costs one extra
forward per step, paid only when the config asks for the loss.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from autopart.runtime.groups import all_reduce

__all__ = ["RouterAuxLoss", "router_aux_loss"]


def router_aux_loss(root: nn.Module, stage_modules: list[nn.Module],
                    pp_group: Any) -> RouterAuxLoss | None:
    """The ``RouterAuxLoss`` for an HF model whose config asks for the router's loss
    (``router_loss_spec``); ``None`` otherwise."""
    spec = router_loss_spec(root)
    if spec is None:
        return None
    target, index, num_experts, top_k, coef = spec
    return RouterAuxLoss(stage_modules, target, index, num_experts, top_k, coef, pp_group)


def router_loss_spec(root: nn.Module) -> tuple[type, int, int, int, float] | None:
    """``(router class, index of its logits output, experts, top-k, coef)`` when ``root``'s
    HF config asks for the router's loss (``output_router_logits`` and
    ``router_aux_loss_coef > 0``) and the model records its router logits from a router
    class (``_can_record_outputs``): then the runtime adds the loss, with its counting pass
    each step; ``None`` otherwise."""
    config = getattr(root, "config", None)
    coef = getattr(config, "router_aux_loss_coef", 0.0) or 0.0
    if config is None or not getattr(config, "output_router_logits", False) or coef <= 0:
        return None
    recorder = None
    for module in root.modules():
        recorder = (getattr(module, "_can_record_outputs", None) or {}).get("router_logits")
        if recorder is not None:
            break
    target = getattr(recorder, "target_class", None)
    num_experts = next((getattr(config, k) for k in ("num_local_experts", "num_experts",
                                                      "n_routed_experts")
                        if getattr(config, k, None)), None)
    top_k = getattr(config, "num_experts_per_tok", None)
    if target is None or not num_experts or not top_k:
        return None
    return target, getattr(recorder, "index", 0) or 0, int(num_experts), int(top_k), float(coef)


def _shape_inference() -> bool:
    """Called from torch's shape inference of a stage (on its first step, and again when
    the schedule switches between training and forward-only): a forward on stand-in
    values that must neither count routing nor add to the loss."""
    frame = sys._getframe(2)
    while frame is not None:
        if frame.f_code.co_name == "_forward_metadata_inference":
            return True
        frame = frame.f_back
    return False


class _WeightedSum(torch.autograd.Function):
    """``(probs * factors).sum()``; ``factors`` (the microbatch's mask times the expert
    weights) is kept on the context, not saved: a checkpoint recomputing the layer (in
    another microbatch's forward context) must not replace it."""

    @staticmethod
    def forward(ctx, probs: torch.Tensor, factors: torch.Tensor) -> torch.Tensor:  # noqa: D102
        ctx.factors = factors
        return (probs * factors).sum()

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, None]:  # noqa: D102
        return grad * ctx.factors, None


class _AddShare(torch.autograd.Function):
    """A copy of ``x``; backward also gives the share the gradient 1 (it joins the loss)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, share: torch.Tensor) -> torch.Tensor:  # noqa: D102
        ctx.share_shape = share.shape
        return x.clone()  # not a view: zero-bubble schedules detach stage outputs in place

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:  # noqa: D102
        return grad, torch.ones(ctx.share_shape, dtype=torch.float32, device=grad.device)


class RouterAuxLoss:
    """Counts routing, then adds each stage's layers' share of the load-balancing loss.

    Args:
        stage_modules: this rank's stage modules (their routers are found by class).
        router_class: the module class whose output ``index`` is a layer's router logits.
        index: which output of the router is its logits.
        num_experts: experts per MoE layer (``E``).
        top_k: experts per token.
        coef: ``router_aux_loss_coef``.
        pp_group: the pipeline group the counts are summed over.
    """

    def __init__(self, stage_modules: list[nn.Module], router_class: type, index: int,
                 num_experts: int, top_k: int, coef: float, pp_group: Any) -> None:
        self.stage_modules = stage_modules
        seen: set[int] = set()  # stages of one rank may share the model tree
        self.routers = []
        for stage in stage_modules:
            mine = [m for m in stage.modules() if isinstance(m, router_class)
                    and id(m) not in seen]
            seen.update(id(m) for m in mine)
            self.routers.append(mine)
        self.index, self.num_experts, self.top_k, self.coef = index, num_experts, top_k, coef
        self.pp_group = pp_group
        self._mask: torch.Tensor | None = None
        self._counts: torch.Tensor | None = None
        self._rows: torch.Tensor | None = None
        self._weights: torch.Tensor | None = None
        self._shares: list[torch.Tensor] = []
        self._pending: list[torch.Tensor] = []
        self._inside = 0
        self._live = True
        self.total: torch.Tensor | None = None
        """The last step's auxiliary loss (``coef`` included), summed over the pipeline."""

    def _real(self, output: Any) -> torch.Tensor | None:
        """The router logits, ``None`` on meta (a stand-in for another stage's layer)."""
        logits = output[self.index] if isinstance(output, tuple) else output
        return None if logits.is_meta else logits

    def _probs(self, output: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """A layer's routing probabilities and row weights (the microbatch's mask)."""
        logits = output[self.index] if isinstance(output, tuple) else output
        probs = torch.softmax(logits.reshape(-1, logits.shape[-1]).float(), dim=-1)
        mask = (torch.ones(probs.shape[0], device=probs.device) if self._mask is None
                else self._mask.reshape(-1).to(probs.device, torch.float32))
        return probs, mask

    def _count(self, _module: nn.Module, _args: Any, output: Any) -> None:
        if not self._inside or not self._live or self._real(output) is None:
            return
        probs, mask = self._probs(output.detach() if isinstance(output, torch.Tensor)
                                  else tuple(o.detach() if isinstance(o, torch.Tensor) else o
                                             for o in output))
        chosen = torch.topk(probs, self.top_k, dim=-1).indices
        self._counts += torch.zeros(self.num_experts, device=probs.device).scatter_add_(
            0, chosen.reshape(-1), mask.repeat_interleave(self.top_k)).to(self._counts.device)
        self._rows += mask.sum().to(self._rows.device)

    def _share(self, _module: nn.Module, _args: Any, output: Any) -> None:
        if self._real(output) is None:  # a stand-in for another stage's layer
            return
        probs, mask = self._probs(output)
        weights = self._weights.to(probs.device)
        share = _WeightedSum.apply(probs, self.coef * mask[:, None] * weights[None, :])
        # a checkpoint recomputing the layer in the backward runs the same ops (its saved
        # tensors must match) but the share was added in the forward already
        if self._inside and self._live:
            self._pending.append(share)

    def _attach(self, _module: nn.Module, _args: Any, output: Any) -> Any:
        """The stage's output carrying the shares its forward made (the first floating
        tensor that requires a gradient)."""
        self._inside -= 1
        if not self._pending or not self._live or not torch.is_grad_enabled():
            self._pending.clear()
            return output
        share = torch.stack(self._pending).sum()
        self._pending.clear()
        self._shares.append(share.detach())
        leaves = list(output) if isinstance(output, tuple) else [output]
        for i, leaf in enumerate(leaves):
            if isinstance(leaf, torch.Tensor) and leaf.requires_grad:
                leaves[i] = _AddShare.apply(leaf, share)
                break
        return tuple(leaves) if isinstance(output, tuple) else leaves[0]

    def _leave(self, _module: nn.Module, _args: Any, _output: Any) -> None:
        self._inside -= 1  # a checkpoint's recomputation in the backward is not counted

    def _note_mask(self, _module: nn.Module, _args: Any, kwargs: dict) -> None:
        self._mask = kwargs.get("attention_mask")
        self._inside += 1
        self._live = not _shape_inference()

    @contextlib.contextmanager
    def _hooked(self, router_hook: Any, attach: bool) -> Iterator[None]:
        handles = []
        try:
            for stage, routers in zip(self.stage_modules, self.routers):
                handles.append(stage.register_forward_pre_hook(self._note_mask,
                                                               with_kwargs=True))
                handles += [r.register_forward_hook(router_hook) for r in routers]
                handles.append(stage.register_forward_hook(self._attach if attach
                                                           else self._leave))
            yield
        finally:
            for handle in handles:
                handle.remove()
            self._mask = None
            self._inside = 0

    def count(self, run_forward: Any, device: torch.device) -> None:
        """Run ``run_forward()`` (the schedule's forward-only pass) counting routing; the
        weights ``coef``-free ``E * T_e / R**2`` summed over the pipeline group."""
        self._counts = torch.zeros(self.num_experts, device=device)
        self._rows = torch.zeros((), device=device)
        with self._hooked(self._count, attach=False):
            run_forward()
        both = torch.cat([self._counts, self._rows[None]])
        all_reduce(both, self.pp_group)
        counts, rows = both[:-1], both[-1].clamp(min=1)
        self._weights = self.num_experts * counts / rows ** 2
        self._shares = []

    @contextlib.contextmanager
    def adding(self) -> Iterator[None]:
        """Inside: every stage forward adds its routers' shares to the loss."""
        with self._hooked(self._share, attach=True):
            yield
        mine = torch.stack(self._shares).sum() if self._shares else \
            torch.zeros((), device=self._weights.device)
        all_reduce(mine, self.pp_group)
        self.total = mine
