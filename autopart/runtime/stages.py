"""Build this rank's stage modules and the torch schedule that drives them.

A stage module is a pruned copy of the model tree holding one stage's blocks under
their original FQNs (``HFStage`` for HF causal LMs, ``ChainStage`` for straight
chains of blocks). Each becomes a ``torch.distributed.pipelining.PipelineStage``;
the schedule class comes from ``autopart.schedules.SCHEDULES``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import PipelineStage
from torch.distributed.pipelining import schedules as torch_schedules
from torch.utils.checkpoint import checkpoint

from autopart.intake import BlockChain
from autopart.runtime.hf_stage import HFStage
from autopart.runtime.tree import Tree, prune
from autopart.schedules import schedule_info
from autopart.schema import Plan, StagePlan

__all__ = ["ChainStage", "build_schedule", "build_stage_modules", "wrap_stages"]


class ChainStage(Tree):
    """A straight run of blocks: each block takes the previous block's output."""

    def __init__(self, root: nn.Module, fqns: list[str], *, recompute: bool = False,
                 autocast_dtype: torch.dtype | None = None) -> None:
        super().__init__()
        prune(root, fqns, into=self)
        self._fqns = list(fqns)
        self._recompute = recompute
        self._autocast_dtype = autocast_dtype

    def forward(self, *args: torch.Tensor) -> torch.Tensor | tuple[torch.Tensor, ...]:
        """Run the blocks in order; a tuple output is unpacked into the next block."""
        out: torch.Tensor | tuple[torch.Tensor, ...] = args
        ctx = (torch.autocast(device_type=args[0].device.type, dtype=self._autocast_dtype)
               if self._autocast_dtype is not None else contextlib.nullcontext())
        recompute = self._recompute and self.training and torch.is_grad_enabled()
        with ctx:
            for fqn in self._fqns:
                block = self.get_submodule(fqn)
                inputs = out if isinstance(out, tuple) else (out,)
                out = (checkpoint(block, *inputs, use_reentrant=False) if recompute
                       else block(*inputs))
        return out


def build_stage_modules(root: nn.Module, chain: BlockChain, stages: list[StagePlan], *,
                        recompute: Callable[[StagePlan], bool],
                        autocast_dtype: torch.dtype | None) -> list[nn.Module]:
    """One stage module per stage plan (already materialized blocks of ``root``)."""
    modules: list[nn.Module] = []
    for stage in stages:
        fqns = list(stage.modules)
        if chain.family == "hf_causal_lm":
            module: nn.Module = HFStage(root, fqns, chain.shared_modules,
                                        recompute=recompute(stage),
                                        autocast_dtype=autocast_dtype)
        else:
            module = ChainStage(root, fqns, recompute=recompute(stage),
                                autocast_dtype=autocast_dtype)
        modules.append(module)
    return modules


def wrap_stages(modules: list[nn.Module], stages: list[StagePlan], num_stages: int,
                device: torch.device, group: dist.ProcessGroup) -> list[PipelineStage]:
    """``PipelineStage`` objects (shapes inferred at the first step)."""
    return [PipelineStage(module, stage.index, num_stages, device, group=group)
            for module, stage in zip(modules, stages)]


def build_schedule(plan: Plan, stages: list[PipelineStage],
                   loss_fn: Callable[..., torch.Tensor], *, scale_grads: bool):
    """The torch schedule object named by ``plan.schedule``."""
    info = schedule_info(plan.schedule)
    cls = getattr(torch_schedules, info.torch_class)
    if info.multi_stage:
        return cls(stages, n_microbatches=plan.num_microbatches, loss_fn=loss_fn,
                   scale_grads=scale_grads)
    (stage,) = stages
    return cls(stage, n_microbatches=plan.num_microbatches, loss_fn=loss_fn,
               scale_grads=scale_grads)
